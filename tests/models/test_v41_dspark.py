"""DeepSeek-V4.1's DSpark drafter against ``forward_spec`` of DeepSeek's ``inference/model.py`` (the release
folder ``shared/reference/deepseek-v4.1-flash/inference`` beside the repository, run through the suite's
kernel stand-ins, :mod:`v41_reference`): after a prefill and at every decode step, the block the drafter
proposes (greedy: model.py's ``sample`` at temperature 0), its logits with the Markov biases and its
confidence logits, on the tiny checkpoint in the release's layout (block of 3 after the current token,
window of 8 rolling over during the decode, three stages with their own 4 experts, top-2)."""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
import v41_reference as ref
from safetensors.torch import load_file
from test_v41_model import IDS, PREFILL, tiny  # noqa: F401

from deepinfer_core.config import ModelConfig
from deepinfer_core.models import load_model
from deepinfer_core.testing.model_runner import SimpleRunner

pytestmark = pytest.mark.skipif(not ref.reference_present(), reason=f"{ref.REFERENCE_DIR} not present")

STEPS = 12  # decode steps after the prefill, each followed by a draft


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


def reference_drafts(path, quant: bool, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    from transformers import AutoTokenizer, PretrainedConfig

    cfg = ModelConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), config=PretrainedConfig())
    model = ref.load_reference({**cfg.to_flat(), "temperature": 0}, load_file(str(path / "model.safetensors")),
                               tokenizer, quant, dtype, max_seq_len=64)
    out = []
    with torch.random.fork_rng(devices=[]):
        ids, _, hidden = model.forward(torch.tensor([IDS[:PREFILL]]), 0)
        assert model.forward_spec(ids, hidden, 0) is None  # a prefill only seeds the stages' windows
        for i in range(PREFILL, PREFILL + STEPS):
            ids, _, hidden = model.forward(torch.tensor([[IDS[i]]]), i)
            drafted, logits, confidence = model.forward_spec(ids, hidden, i)
            out.append((drafted[0], logits[0].double(), confidence[0].double()))
    return out


def engine_drafts(path, numerics: str, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    model = load_model(path, dtype=dtype, numerics=numerics)
    assert model.dspark is not None and model.drafter is model.dspark
    runner = SimpleRunner(model, 1, 64, block_size=8)
    logits, batch, hidden = runner.forward({0: IDS[:PREFILL]})
    assert hidden.shape == (PREFILL, 3 * model.cfg.hidden_size)
    model.dspark.seed(hidden, batch, runner.cache)
    out = []
    for i in range(PREFILL, PREFILL + STEPS):
        logits, batch, hidden = runner.forward({0: [IDS[i]]})
        model.dspark.seed(hidden, batch, runner.cache)
        token = logits[0][-1].argmax().view(1)
        rows = batch.window_rows()[batch.logits_indices]
        drafted, block_logits, confidence = model.dspark.draft(token, torch.tensor([i]), rows, runner.cache)
        out.append((drafted[0], block_logits[0].double(), confidence[0].double()))
    return out


@pytest.mark.parametrize("numerics, quant", [("unquantised", False), ("deepseek", True)])
def test_drafts_equal_forward_spec(tiny, numerics, quant):  # noqa: F811
    """float32: every drafted token equal, the block's logits to 1e-5 of their scale, the confidence logits to
    1e-5 of theirs (measured over the 12 drafts: logits 7e-7 unquantised, 2e-7 deepseek; confidence 1.2e-5
    and 1.6e-6 absolute, on logits up to 3.7)."""
    theirs = reference_drafts(tiny, quant, torch.float32)
    ours = engine_drafts(tiny, numerics, torch.float32)
    for step, ((ids_r, logits_r, conf_r), (ids_e, logits_e, conf_e)) in enumerate(zip(theirs, ours)):
        assert torch.equal(ids_e, ids_r), step
        assert (logits_e - logits_r).abs().max() <= 1e-5 * logits_r.abs().max(), step
        assert (conf_e - conf_r).abs().max() <= 1e-5 * max(1.0, conf_r.abs().max()), step


def test_a_rank_reads_only_its_share_of_the_drafters_own_experts(tiny):  # noqa: F811
    """Expert parallel with DSpark: a rank's stages hold exactly its span of their own experts (4 in the
    tiny checkpoint, against the target's 8), the rows of a whole load."""
    from deepinfer_core.parallel.ep import drafter_stacks

    whole = drafter_stacks(load_model(tiny, dtype=torch.float64))
    part = drafter_stacks(load_model(tiny, dtype=torch.float64, drafter_experts=range(2, 4)))
    assert len(part) == len(whole) > 0
    for a, b in zip(part, whole, strict=True):
        for name in ("w13", "w2"):
            got, want = getattr(a, name), getattr(b, name)
            assert got.weight.shape[0] == 2 and torch.equal(got.weight, want.weight[2:4])
            if want.scale is not None:
                assert torch.equal(got.scale, want.scale[2:4])
    for bad in (range(3, 3), range(3, 5)):
        with pytest.raises(ValueError, match="drafter_experts must be a non-empty contiguous range within 0..4"):
            load_model(tiny, dtype=torch.float64, drafter_experts=bad)
