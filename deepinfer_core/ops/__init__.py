from deepinfer_core.ops.catalogue import CATALOGUE, OpSpec
from deepinfer_core.ops.registry import (
    BuildContext,
    MissingOpError,
    OpImpl,
    OpRegistrationError,
    OpRegistry,
    OpTable,
    resolve_ops,
)

__all__ = [
    "CATALOGUE",
    "BuildContext",
    "MissingOpError",
    "OpImpl",
    "OpRegistrationError",
    "OpRegistry",
    "OpSpec",
    "OpTable",
    "resolve_ops",
]
