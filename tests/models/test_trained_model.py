"""The embedded trained tiny DeepSeek-V4 (``deepinfer_core/assets/deepseek-v4-tiny``) against its baseline.

``tools/train_tiny.py`` writes the folder and ``tools/eval_perplexity.py`` the baseline
(``data/perplexity_baseline_cpu_ref.json``); this test recomputes the engine's float64 perplexity on the
stored held-out slice (``data/heldout_slice.txt``), compares transformers on the same tokens and runs a
short greedy generation.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# overridable to check a fresh training run before it is copied into the tree
MODEL = Path(os.environ.get("DEEPINFER_TRAINED_MODEL", REPO / "deepinfer_core" / "assets" / "deepseek-v4-tiny"))
BASELINE = Path(os.environ.get("DEEPINFER_TRAINED_BASELINE", REPO / "data" / "perplexity_baseline_cpu_ref.json"))
SLICE = REPO / "data" / "heldout_slice.txt"

pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").is_file(),
    reason=f"no trained checkpoint in {MODEL} (run tools/train_tiny.py, see data/README.md)",
)


@pytest.fixture(scope="module")
def ev():
    spec = importlib.util.spec_from_file_location("eval_perplexity", REPO / "tools" / "eval_perplexity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def baseline():
    if not BASELINE.is_file():
        pytest.fail(f"{BASELINE} is missing: run tools/eval_perplexity.py --model {MODEL}")
    return json.loads(BASELINE.read_text())


@pytest.fixture(scope="module")
def pairs(ev):
    return ev.chunks(ev.tokenize(MODEL, SLICE.read_text(encoding="utf-8")), ev.chunk_len(MODEL))


@pytest.fixture(scope="module")
def engine_result(ev, pairs):
    from deepinfer_core.models import load_model

    model = load_model(MODEL, backend="cpu_ref", dtype=torch.float64)
    return ev.engine_scores(model, pairs)


def test_baseline_is_for_this_checkpoint_and_slice(ev, baseline, pairs):
    assert baseline["model"]["safetensors_sha256"] == ev.sha256_file(MODEL / "model.safetensors"), (
        "the checkpoint changed since the baseline was written: rerun tools/eval_perplexity.py")
    assert baseline["slice"]["sha256"] == ev.hashlib.sha256(SLICE.read_text(encoding="utf-8").encode()).hexdigest()
    assert baseline["slice"]["predicted"] == sum(len(t) for _, t in pairs)


def test_engine_perplexity_matches_baseline(baseline, engine_result):
    stored = baseline["slice"]["engine"]["ppl"]
    ppl = engine_result["ppl"]
    assert math.isfinite(ppl)
    assert abs(ppl / stored - 1) <= 1e-5, f"engine perplexity {ppl!r} vs baseline {stored!r}"
    # a trained model: far below the unigram model and the untrained one
    assert ppl < 0.5 * baseline["slice"]["unigram"]["ppl"]
    if "untrained" in baseline["slice"]:
        assert ppl < 0.1 * baseline["slice"]["untrained"]["ppl"]


def test_transformers_perplexity_agrees(ev, pairs, engine_result):
    hf = ev.load_hf(MODEL, torch.float64)
    # transformers as is: float32 indexer scores, torch's top-k tie order
    plain = ev.hf_scores(hf, pairs)["ppl"]
    assert abs(plain / engine_result["ppl"] - 1) <= 1e-3, (plain, engine_result["ppl"])
    # with the engine's tie-break (earlier entry first) the two agree to rounding
    stable = ev.hf_scores(hf, pairs, stable_ties=True)["ppl"]
    assert abs(stable / engine_result["ppl"] - 1) <= 1e-5, (stable, engine_result["ppl"])


def test_greedy_generation_from_a_code_prompt():
    from deepinfer_core.entrypoints import LLM, SamplingParams

    llm = LLM(str(MODEL), backend="cpu_ref", dtype="float32", max_model_len=512)
    out = llm.generate("def fibonacci(n):\n", SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text.strip(), completion
    assert len(completion.token_ids) > 0


def test_folder_holds_mtp_and_loads_in_transformers():
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight"} <= keys
    size = sum(p.stat().st_size for p in MODEL.iterdir() if p.is_file())
    assert size < 12e6, f"checkpoint folder is {size / 1e6:.1f} MB"
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL))
    ids = tok("import os\n", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits.float()).all()
