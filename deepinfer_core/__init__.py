"""deepinfer: a hardware-abstracted inference engine for the DeepSeek-V4 model family."""

from deepinfer_core.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]


def __getattr__(name):
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from deepinfer_core import entrypoints, sampling

        return {"LLM": entrypoints.LLM, "SamplingParams": sampling.SamplingParams}.get(name) or getattr(
            entrypoints, name
        )
    raise AttributeError(name)
