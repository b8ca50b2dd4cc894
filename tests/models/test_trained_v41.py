"""The embedded trained tiny DeepSeek-V4.1 (``deepinfer_core/assets/deepseek-v41-tiny``, the default model;
``tools/train_tiny_v41.py`` writes it): greedy decoding with its trained DSpark stages equals greedy decoding
without them while they are accepted for real (no forced acceptance), and its held-out perplexity by the
engine equals DeepSeek's ``inference/model.py`` on the same sequences (float64, quantisation off; the
oracle test is skipped where the release folder beside the repository is absent)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import engine_fixtures
import pytest
import torch
import v41_reference as ref

from deepinfer_core.default_model import EMBEDDED_MODEL

REPO = Path(__file__).resolve().parents[2]
SLICE = REPO / "data" / "heldout_slice.txt"
SEQ_LEN = 64  # tokens a held-out sequence
N_SEQS = 3

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "model.safetensors").is_file(),
                                reason=f"no trained checkpoint in {EMBEDDED_MODEL} (run tools/train_tiny_v41.py)")


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


@pytest.fixture(scope="module")
def heldout_ids() -> list[list[int]]:
    """``N_SEQS`` sequences of ``SEQ_LEN`` tokens from the stored held-out slice (files no training saw)."""
    from deepinfer_core.tokenizer import get_tokenizer

    ids = get_tokenizer(EMBEDDED_MODEL).encode(SLICE.read_text(encoding="utf-8"), add_special_tokens=False)
    stride = len(ids) // N_SEQS
    return [ids[i * stride : i * stride + SEQ_LEN] for i in range(N_SEQS)]


def test_the_default_is_the_trained_v41_with_dspark_stages():
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    info = json.loads((EMBEDDED_MODEL / "training_info.json").read_text())
    assert config["model_type"] == "deepseek_v41" and "quantization_config" not in config
    text = config["text_config"]
    assert text["engram_layer_ids"] and text["candidate_source_layer_id"] >= 0 and text["dspark_block_size"] == 3
    assert info["heldout"]["perplexity"] < info["heldout"]["unigram_perplexity"]


def test_greedy_with_dspark_equals_greedy_without(heldout_ids):
    """Held-out prompts, 24 greedy tokens each, float64: the same tokens, and the trained stages' drafts are
    accepted often enough that a verification step yields more than one token on average."""
    from deepinfer_core import LLM, SamplingParams

    prompts = [{"prompt_token_ids": ids[:32]} for ids in heldout_ids]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(EMBEDDED_MODEL), dtype="float64")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(EMBEDDED_MODEL), dtype="float64",
               speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec.llm_engine.spec_decode_stats()
    assert stats["mean_acceptance_length"] > 1.0, stats
    assert stats["accepted_per_position"][0] > 0, stats


def nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Per-token negative log-likelihood of ``ids[1:]`` under ``logits`` [len(ids), V] (float64)."""
    return -logits[:-1].double().log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_heldout_perplexity_equals_model_py(heldout_ids):
    """float64, quantisation off on both sides: every sequence's perplexity to 1e-9 relative, and below the
    train split's unigram perplexity as ``training_info.json`` records it."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, PretrainedConfig

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.models import load_model
    from deepinfer_core.testing.model_runner import SimpleRunner

    if not ref.reference_present():
        pytest.skip(f"{ref.REFERENCE_DIR} not present")
    cfg = ModelConfig.from_pretrained(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL), config=PretrainedConfig())
    oracle = ref.load_reference(cfg.to_flat(), load_file(str(EMBEDDED_MODEL / "model.safetensors")), tokenizer,
                                quant=False, dtype=torch.float64, max_seq_len=SEQ_LEN)
    engine = load_model(EMBEDDED_MODEL, dtype=torch.float64, numerics="unquantised")
    info = json.loads((EMBEDDED_MODEL / "training_info.json").read_text())
    for ids in heldout_ids:
        theirs = nll(ref.teacher_forced_logits(oracle, ids, len(ids)), ids)
        runner = SimpleRunner(engine, 1, SEQ_LEN, block_size=32)
        ours = nll(runner.step({0: ids}, all_logits=True)[0], ids)
        ppl_ours, ppl_theirs = math.exp(ours.mean()), math.exp(theirs.mean())
        assert abs(ppl_ours - ppl_theirs) <= 1e-9 * ppl_theirs, (ppl_ours, ppl_theirs)
        assert (ours - theirs).abs().max() <= 1e-9, (ours - theirs).abs().max()
        assert ppl_ours < info["heldout"]["unigram_perplexity"]
