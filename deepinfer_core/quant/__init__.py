"""Number formats shared by ops/ and models/: DeepSeek's block FP8, packed FP4 (e2m1 + ue8m0) and the
FP8 KV entry. Nothing here knows a model's parameter names; which tensors use which format is each
architecture's checkpoint manifest."""
