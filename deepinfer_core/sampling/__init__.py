from deepinfer_core.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
