"""deepinfer: a hardware-abstracted inference engine for the DeepSeek-V4 model family."""

from deepinfer_core.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__", "hookimpl"]


def __getattr__(name: str):
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        from deepinfer_core import entrypoints

        return getattr(entrypoints, name)
    raise AttributeError(name)
