"""The model and the engine on nvidia_sm100 (CUDA) follow cpu_ref in float64, on the tiny checkpoints.

* Per-step logits: both backends' models are driven by ``SimpleRunner`` over two sequences of
  different lengths (chunked prefill, then decode), both fed cpu_ref's greedy tokens. float32 (TF32
  off): every step's logits within 1e-3 (max abs) of float64, and the same greedy token except where
  cpu_ref's two best logits are within that tolerance. bfloat16: cosine similarity > 0.999 per step,
  with the model's discrete selections (the routed experts of ``moe_route``, the entries of
  ``indexer_topk``) pinned to the ones cpu_ref made in float64. Unpinned, a near-tie among expert or
  indexer scores flips in bfloat16 on any backend (cpu_ref's own bfloat16 run drops to cosine 0.83 on
  ``tiny``), and one flipped expert moves a step's logits far more than rounding does; the GPU's own
  route/indexer kernels still run on every call, only the choice carried forward is float64's.
* The engine (``LLM(..., backend="nvidia_sm100")`` on CUDA, float32): greedy tokens follow cpu_ref's
  (up to a near-tie, after which the sequences may legitimately part), and the logprob it reports for
  each token matches cpu_ref's log-softmax.
* Bad input on the GPU ends as on the CPU: an over-long prompt is refused naming it and the others
  then run, a sequence that can never fit the pools ends with an error, one that outgrows them ends with an
  error keeping its tokens.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import BACKEND, TINY_MODELS, drive, gpu_marks, make_prompt, near_tie

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.models import load_model
from deepinfer_core.sampling.params import SamplingParams

pytestmark = gpu_marks()

FP32_TOL = 1e-3
BF16_MIN_COSINE = 0.999
PROMPT_LENS = (45, 29)
STEPS = 24
CHUNK = 20
BLOCK = 16


SELECTIONS = ("moe_route", "indexer_topk")


def _record_selections(model) -> dict[str, list]:
    """Wrap the model's selection ops to keep every call's result, in call order."""
    seen: dict[str, list] = {op: [] for op in SELECTIONS}
    for op in SELECTIONS:
        fn = getattr(model.ops, op)

        def record(*args, fn=fn, op=op):
            out = fn(*args)
            seen[op].append(out)
            return out

        setattr(model.ops, op, record)
    return seen


def _pin_selections(model, recorded: dict[str, list]) -> None:
    """Make the model's selection ops return the recorded choices (same calls, same order).

    ``moe_route`` runs with the recorded ids as fixed ids, so its weights are still this backend's
    own scores at those experts; ``indexer_topk`` runs and its result is replaced by the recorded one.
    """
    route, index = model.ops.moe_route, model.ops.indexer_topk
    routes, picks = iter(recorded["moe_route"]), iter(recorded["indexer_topk"])

    def pinned_route(logits, scoring, top_k, bias, fixed, factor):
        ids = next(routes)[1].to(logits.device)
        return route(logits, scoring, top_k, bias, ids, factor)

    def pinned_index(*args):
        ours = index(*args)
        want = next(picks).to(ours.device)
        assert ours.shape == want.shape
        return want

    model.ops.moe_route, model.ops.indexer_topk = pinned_route, pinned_index


def _drive(model, prompts: list[list[int]], feed: list[list[int]] | None, steps: int):
    return drive(model, prompts, feed, steps, CHUNK, BLOCK)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [make_prompt(n, seed=i) for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def reference(tiny_path, prompts):
    """cpu_ref float64 greedy, per tiny model: (logits per sequence per step, greedy tokens, the
    selection ops' results in call order)."""
    made = {}

    def get(name: str):
        if name not in made:
            model = load_model(tiny_path(name), "cpu_ref", torch.float64, "cpu")
            selections = _record_selections(model)
            made[name] = (*_drive(model, prompts, None, STEPS), selections)
        return made[name]

    return get


@pytest.mark.parametrize("name", TINY_MODELS)
def test_float32_logits_follow_cpu_ref_float64(name, tiny_path, prompts, reference, device):
    ref_logits, ref_tokens, _ = reference(name)
    model = load_model(tiny_path(name), BACKEND, torch.float32, device)
    logits, _ = _drive(model, prompts, ref_tokens, STEPS)
    for s in range(len(prompts)):
        for i, (got, want) in enumerate(zip(logits[s], ref_logits[s])):
            err = (got - want).abs().max().item()
            assert err <= FP32_TOL, f"{name}: sequence {s} step {i}: max abs logit error {err:.3g}"
            if int(got.argmax()) != int(want.argmax()):
                assert near_tie(want, FP32_TOL), f"{name}: sequence {s} step {i}: greedy token differs"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_bfloat16_logits_follow_cpu_ref_float64(name, tiny_path, prompts, reference, device):
    ref_logits, ref_tokens, selections = reference(name)
    model = load_model(tiny_path(name), BACKEND, torch.bfloat16, device)
    _pin_selections(model, selections)
    logits, _ = _drive(model, prompts, ref_tokens, STEPS)
    for s in range(len(prompts)):
        for i, (got, want) in enumerate(zip(logits[s], ref_logits[s])):
            assert torch.isfinite(got).all(), f"{name}: sequence {s} step {i}: non-finite logits"
            cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
            assert cos > BF16_MIN_COSINE, f"{name}: sequence {s} step {i}: cosine {cos:.6f}"


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _llm(path, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_batched_tokens", 64)  # the 45-token prompt takes two steps (chunked prefill)
    return LLM(str(path), backend=BACKEND, **kw)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_engine_float32_greedy_follows_cpu_ref(name, tiny_path, prompts, reference):
    ref_logits, ref_tokens, _ = reference(name)
    llm = _llm(tiny_path(name), dtype="float32")
    engine = llm.llm_engine
    assert engine.device.type == "cuda"
    assert all(engine.model.ops.provider(op).endswith(BACKEND) for op in engine.model.ops.chosen)
    batch = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(batch, _greedy(STEPS, logprobs=0), use_tqdm=False)
    for s, out in enumerate(outs):
        assert out.error is None and out.outputs[0].finish_reason == "length", out.error
        comp = out.outputs[0]
        assert len(comp.token_ids) == STEPS
        for i, tok in enumerate(comp.token_ids):
            want = torch.log_softmax(ref_logits[s][i], dim=-1)
            got_lp = comp.logprobs[i][tok]
            assert abs(got_lp - want[tok].item()) <= FP32_TOL, f"{name}: seq {s} step {i}: logprob"
            if tok != ref_tokens[s][i]:
                why = f"{name}: seq {s} step {i}: token {tok}, cpu_ref {ref_tokens[s][i]}"
                assert near_tie(ref_logits[s][i], FP32_TOL), why
                break  # a near-tie went the other way: the rest of the sequence may differ


def test_engine_bfloat16_generates(tiny_path, prompts):
    llm = _llm(tiny_path("tiny"), dtype="bfloat16")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(8), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert all(0 <= t < 384 for o in outs for t in o.outputs[0].token_ids)


# --- bad input behaves as on the CPU ----------------------------------------------------------------


def _both(tiny_path, **kw) -> tuple[LLM, LLM]:
    """The same engine settings on nvidia_sm100 (CUDA, float32) and on cpu_ref (float32)."""
    path = tiny_path("tiny")
    gpu = _llm(path, dtype="float32", **kw)
    cpu = LLM(str(path), backend="cpu_ref", dtype="float32", block_size=BLOCK,
              **{"max_model_len": 128, "max_num_batched_tokens": 64, **kw})
    return gpu, cpu


def _summary(outs):
    return [(o.finished, o.outputs[0].finish_reason, o.error is not None, len(o.outputs[0].token_ids))
            for o in outs]


def _drained(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    bm = engine.block_manager
    for pool in (bm.blocks, bm.window_blocks, bm.slots):
        assert pool.num_free == pool.size, f"{pool.name} pool leaked"


def test_over_long_prompt_is_refused_naming_it_and_the_others_run(tiny_path, prompts):
    """Offline, an invalid prompt raises before anything runs (vLLM's behaviour), naming its index; the
    engine holds nothing afterwards and the valid prompts then run as on the CPU."""
    gpu, cpu = _both(tiny_path, max_model_len=40)
    ok = [{"prompt_token_ids": prompts[1]}, {"prompt_token_ids": make_prompt(12, seed=3)}]
    bad = [ok[0], {"prompt_token_ids": make_prompt(40, seed=9)}, ok[1]]
    outs = {}
    for llm, where in ((gpu, "cuda"), (cpu, "cpu")):
        with pytest.raises(ValueError, match=r"prompt 1: .*max_model_len"):
            llm.generate(bad, _greedy(5), use_tqdm=False)
        _drained(llm)
        outs[where] = llm.generate(ok, _greedy(5), use_tqdm=False)
        _drained(llm)
        assert all(o.error is None for o in outs[where])
    assert _summary(outs["cuda"]) == _summary(outs["cpu"])


def test_sequence_that_never_fits_the_pools_ends_with_error(tiny_path, prompts):
    gpu, cpu = _both(tiny_path, num_blocks=3, num_window_blocks=6)
    batch = [{"prompt_token_ids": make_prompt(12, seed=3)}, {"prompt_token_ids": make_prompt(60, seed=7)}]
    outs = {}
    for llm, where in ((gpu, "cuda"), (cpu, "cpu")):
        outs[where] = llm.generate(batch, _greedy(5), use_tqdm=False)
        _drained(llm)
        bad = outs[where][1]
        assert bad.finished and bad.outputs[0].finish_reason == "error" and "pool" in bad.error
        assert outs[where][0].outputs[0].finish_reason == "length"
    assert _summary(outs["cuda"]) == _summary(outs["cpu"])


def test_growing_past_the_pools_ends_with_error_keeping_tokens(tiny_path):
    gpu, cpu = _both(tiny_path, num_blocks=2, num_window_blocks=4)
    prompt = make_prompt(28, seed=8)
    outs = {}
    for llm, where in ((gpu, "cuda"), (cpu, "cpu")):
        out = llm.generate([{"prompt_token_ids": prompt}], _greedy(10), use_tqdm=False)[0]
        _drained(llm)
        assert out.outputs[0].finish_reason == "error" and out.error
        assert len(out.outputs[0].token_ids) == 32 - 28 + 1
        outs[where] = out
    roomy = _llm(tiny_path("tiny"), dtype="float32").generate([{"prompt_token_ids": prompt}], _greedy(5),
                                                              use_tqdm=False)[0]
    assert outs["cuda"].outputs[0].token_ids == roomy.outputs[0].token_ids


def test_pools_are_sized_after_a_profiling_forward(tiny_path):
    """gpu_memory_utilization is a share of the whole device: weights, the profiled activation peak of a
    full token budget and the pools together stay inside it, and a bigger token budget leaves less."""
    from deepinfer_core.engine.memory import profile_activation_bytes

    llm = _llm(tiny_path("tiny"), dtype="float32", gpu_memory_utilization=0.05, max_model_len=1 << 12,
               max_num_seqs=4096)
    engine = llm.llm_engine
    small = profile_activation_bytes(engine.model, engine.scheduler_config, BLOCK, engine.platform)
    engine.scheduler_config.max_num_batched_tokens *= 8
    large = profile_activation_bytes(engine.model, engine.scheduler_config, BLOCK, engine.platform)
    assert 0 < small < large
    total = torch.cuda.get_device_properties(engine.device).total_memory
    assert engine.pool_sizes.budget_bytes <= 0.05 * total - small // 2
    assert torch.cuda.memory_allocated(engine.device) <= 0.05 * total
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], _greedy(4), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
