"""User-facing entry points of deepinfer.

The Python API (the ``LLM`` class and friends) is exported from this package; the command line lives
in :mod:`deepinfer_core.entrypoints.cli`, which imports its subcommand modules lazily, so importing this
package stays cheap and does not pull in the CLI.
"""

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from deepinfer_core.entrypoints.llm import LLM

        return LLM
    if name in ("CompletionOutput", "RequestOutput"):
        from deepinfer_core import outputs

        return getattr(outputs, name)
    if name == "SamplingParams":
        from deepinfer_core.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
