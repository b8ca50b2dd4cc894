"""User-facing entry points of deepinfer.

The Python API (the ``LLM`` class and friends) is exported from this package; the command line lives
in :mod:`deepinfer_core.entrypoints.cli`, which imports its subcommand modules lazily, so importing this
package stays cheap and does not pull in the CLI.
"""

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
