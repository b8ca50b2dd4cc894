"""``python -m deepinfer_ascend_950.dry_run``: which implementation would serve each op, here and on an
Ascend 950 host, without running anything on a device.

"here" judges the predicates on this process's probes (device: the NPU if one is available, else the
CPU); "npu" assumes an NPU device with torch_npu (and the fused operators the backend adapts), TileLang
and CANN's bisheng. TileLang kernels additionally pass a self-check on the device when an engine is built
(not run here).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch

from deepinfer_ascend_950 import NAME, npu
from deepinfer_ascend_950.npu import is_available
from deepinfer_ascend_950.registration import op_labels
from deepinfer_core.ops.registry import BuildContext
from deepinfer_core.plugins import collect_registry, load_backend

#: the model the plans are for: DeepSeek-V4 routes by sqrtsoftplus (which selects the TileLang moe_route)
V4_MODEL = SimpleNamespace(scoring_func="sqrtsoftplus")
ASSUMED_NPU = npu.Environment(torch_npu=SimpleNamespace(__name__="torch_npu (assumed)"), tilelang=True,
                              bisheng="bisheng (assumed)", fused_ops=frozenset(npu.FUSED_OPS))


def plans(dtype: torch.dtype | None = torch.bfloat16) -> dict[str, dict[str, str]]:
    """``{"here": op -> implementation, "npu": op -> implementation}``."""
    registry = collect_registry(load_backend(NAME, require_available=False))
    ok, _ = is_available()
    here_device = SimpleNamespace(type="npu", index=0) if ok else torch.device("cpu")
    here = op_labels(registry, BuildContext(backend=NAME, dtype=dtype, device=here_device, model_config=V4_MODEL,
                                            probe_only=True))
    with npu.assume(ASSUMED_NPU):
        ctx = BuildContext(backend=NAME, dtype=dtype, device=SimpleNamespace(type="npu", index=0),
                           model_config=V4_MODEL, probe_only=True)
        on_npu = op_labels(registry, ctx)
    return {"here": here, "npu": on_npu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_ascend_950.dry_run", description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", help="model dtype the predicates see")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    result = plans(dtype)
    ok, reason = is_available()
    if args.json:
        print(json.dumps({"available": ok, "reason": reason, "dtype": args.dtype, **result}, indent=2))
        return 0
    print(f"backend {NAME}: " + ("available here" if ok else f"not available here: {reason}"))
    print(f"dtype {args.dtype}; 'on an NPU' assumes torch_npu ({', '.join(npu.FUSED_OPS)}), TileLang and bisheng")
    width = max(map(len, result["here"]))
    here_w = max(len("HERE"), *map(len, result["here"].values()))
    print(f"{'OP'.ljust(width)}  {'HERE'.ljust(here_w)}  ON AN NPU")
    for op in result["here"]:
        print(f"{op.ljust(width)}  {result['here'][op].ljust(here_w)}  {result['npu'][op]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
