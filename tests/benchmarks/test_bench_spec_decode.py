"""benchmarks/bench_spec_decode.py: forced acceptance reaches the all-greedy verification path too, and
the speed mode runs on random tiny-width weights with an MTP block (what the H200 run does at V4-Flash
widths)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.spec_decode import verifier, verify_graph

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bsd(monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_spec_decode

    for name in ("rejection_sample", "greedy_verify"):  # force_acceptance replaces them
        monkeypatch.setattr(verifier, name, getattr(verifier, name))
    monkeypatch.setattr(verify_graph, "greedy_verify", verify_graph.greedy_verify)
    return bench_spec_decode


@pytest.mark.parametrize("rate, accepted", [(1.0, [3, 2]), (0.0, [0, 0])])
def test_forced_acceptance_covers_greedy_verification(bsd, rate, accepted):
    bsd.force_acceptance(rate)
    logits = torch.zeros(2, 4, 10)
    logits[..., 7] = 1.0  # the target's argmax is 7 everywhere: the drafts (1, 2, 3) would all be rejected
    drafts, num = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2])
    out = verifier.greedy_verify(logits, drafts, num)
    assert out.num_accepted.tolist() == accepted
    for row, n, d in zip(out.output_token_ids.tolist(), accepted, drafts.tolist()):
        assert row[:n] == d[:n] and row[n] == 7 and all(t == -1 for t in row[n + 1:])


def test_forced_acceptance_covers_the_verification_graphs(bsd):
    """Chained steps verify greedily inside graphs (``greedy_verify_spans``): forced there too (found on an
    H100: chained runs accepted 1.0 drafts a step at a forced 0.7, the unchained ones 2.7)."""
    bsd.force_acceptance(1.0)
    logits = torch.zeros(8, 10)
    logits[:, 7] = 1.0  # the target's argmax is 7 everywhere: the drafts would all be rejected
    input_ids = torch.tensor([9, 1, 2, 3, 9, 4, 5, 0])  # two spans of 4: a first token, then drafts
    out, rejected = verify_graph.greedy_verify_spans(logits, input_ids, torch.tensor([3, 2]), 4, 8)
    assert out.num_accepted.tolist() == [3, 2]
    assert rejected.tolist() == [False] * 7 + [True]


def test_speed_mode_on_random_weights_with_an_mtp_block(bsd, tmp_path):
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1",
                       "--batch-sizes", "2", "--max-tokens", "6", "--prompt-len", "12", "--force-acceptance", "1.0",
                       "--threads", "1", "--no-warmup", "--json-out", str(tmp_path / "spec.json")])
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "off eager", "k=1", "confidence k=1"} and report["async_scheduling"] is False
    assert rows["k=1"]["mean_acceptance_length"] == pytest.approx(2.0)  # every draft accepted
    assert report["model"].startswith("random tiny-width, 2 layers")
    assert (tmp_path / "spec.json").read_text().startswith("{")


def test_step_profile_times_the_speculative_step_and_puts_every_function_back(bsd, tmp_path):
    import profile_spec_step

    from deepinfer_core.engine.llm_engine import LLMEngine

    step, tolist = LLMEngine.step, torch.Tensor.tolist
    report = profile_spec_step.main(["--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
                                     "--max-tokens", "6", "--prompt-len", "12", "--force-acceptance", "1.0",
                                     "--threads", "1", "--json-out", str(tmp_path / "profile.json")])
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "k=1"}
    off, spec = rows["off"], rows["k=1"]
    assert "MtpProposer.propose" not in off["ms_per_step"] and "ModelRunner.execute_model" in off["ms_per_step"]
    assert spec["calls_per_step"]["MtpProposer.propose"] == pytest.approx(1.0)
    assert spec["tokens_per_step"] > off["tokens_per_step"]  # every draft accepted
    assert spec["ms_per_step"]["LLMEngine.step"] >= spec["ms_per_step"]["SpecDecodeModelRunner.execute_model"]
    [bound] = report["speed_up_bounds"]  # no GPU: the achieved speed-up only
    assert (bound["mode"], bound["batch"]) == ("k=1", 2)
    assert "device_ms" not in bound and bound["tokens_per_step"] == pytest.approx(spec["tokens_per_step"] / 2)
    rate = {m: r["tokens_per_step"] * r["steps"] / r["seconds"] for m, r in rows.items()}
    assert bound["achieved"] == pytest.approx(rate["k=1"] / rate["off"])
    assert LLMEngine.step is step and torch.Tensor.tolist is tolist
    assert (tmp_path / "profile.json").read_text().startswith("{")


def test_step_profile_runs_only_the_modes_asked_for(bsd):
    import profile_spec_step

    args = ["--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "1", "--max-tokens", "3",
            "--prompt-len", "8", "--threads", "1", "--confidence"]
    report = profile_spec_step.main(args + ["--modes", "always"])
    assert [r["mode"] for r in report["rows"]] == ["off", "confidence k=1 always"]
    with pytest.raises(SystemExit, match="unknown"):
        profile_spec_step.main(args + ["--modes", "fast"])


def test_speed_up_bound_is_tokens_per_device_millisecond_against_plain_decodes(bsd):
    import profile_spec_step

    def row(mode, seconds, steps, tokens_per_step, busy):
        return {"mode": mode, "batch": 1, "seconds": seconds, "steps": steps, "tokens_per_step": tokens_per_step,
                "device_busy_ms_per_step": busy}

    # plain: 1 token per 1.25 ms step (1.0 ms of GPU work); k=3: 2.4 tokens per 2.5 ms step (1.6 ms)
    rows = [row("off", 0.125, 100, 1.0, 1.0), row("k=3", 0.25, 100, 2.4, 1.6)]
    [b] = profile_spec_step._speed_up_bounds(rows)
    assert b["overhead"] == pytest.approx(0.6) and b["bound"] == pytest.approx(2.4 / 1.6)
    assert b["achieved"] == pytest.approx(2.4 / 2.5 / (1 / 1.25))


def test_speed_mode_schedules_asynchronously_when_asked(bsd, monkeypatch):
    from deepinfer_core.engine import llm_engine

    seen = []
    init = llm_engine.LLMEngine.__init__
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__",
                        lambda self, args, *a, **kw: seen.append(args.async_scheduling) or init(self, args, *a, **kw))
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
                       "--max-tokens", "4", "--prompt-len", "12", "--threads", "1", "--no-warmup",
                       "--async-scheduling"])
    assert report["async_scheduling"] is True and seen and all(seen)


def test_speed_mode_repeats_each_run_and_reports_the_median_and_spread(bsd):
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
                       "--max-tokens", "4", "--prompt-len", "12", "--threads", "1", "--no-warmup", "--repeats", "3"])
    assert report["repeats"] == 3
    off = next(r["run_seconds"] for r in report["rows"] if r["mode"] == "off")
    for row in report["rows"]:
        runs = row["run_seconds"]
        assert len(runs) == 3 and row["seconds"] == sorted(runs)[1]
        assert row["spread"] == max(runs) / min(runs) - 1 >= 0
        assert row["paired_speedup"] == sorted(o / s for o, s in zip(off, runs))[1]
    with pytest.raises(SystemExit):
        bsd.main(["--mode", "speed", "--repeats", "0"])


def test_speed_mode_runs_the_modes_in_rotation(bsd, monkeypatch):
    """Each repeat runs every mode once, repeat r starting at mode r, after every mode's warm-up."""
    calls, generate = [], bsd._generate

    def spy(llm, prompts, params, clock=None):
        calls.append(llm)
        return generate(llm, prompts, params, clock)

    monkeypatch.setattr(bsd, "_generate", spy)
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
                       "--max-tokens", "3", "--prompt-len", "12", "--threads", "1", "--repeats", "2"])
    engines = list(dict.fromkeys(calls))
    order = [engines.index(c) for c in calls]
    n = len(report["rows"])
    assert n == 4 and order == list(range(n)) + list(range(n)) + list(range(1, n)) + [0]


def test_step_log_keeps_every_measured_run_of_every_batch_size(bsd):
    """A list per measured run (the warm-up left out) of each batch size: its steps in order, their output
    tokens adding up to the run's."""
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes",
                       "1,2", "--max-tokens", "4", "--prompt-len", "12", "--threads", "1", "--repeats", "2",
                       "--step-log"])
    for row in report["rows"]:
        runs = row["step_log"]
        assert len(runs) == 2
        for steps in runs:
            assert sum(step[5] for step in steps) == 4 * row["requests"]
            assert [step[0] for step in steps] == sorted(step[0] for step in steps)
            assert all(step[1] <= step[0] and 1 <= step[2] <= row["batch"] for step in steps)
            assert steps[0][6] == 0 and steps[-1][6] == 1  # the prompts, then decode steps
            assert row["mode"] != "off" or not any(step[4] for step in steps)  # no speculation, no drafts


def test_speed_mode_spreads_request_lengths_alike_in_every_mode(bsd, monkeypatch):
    lengths, generate = [], bsd._generate

    def spy(llm, prompts, params, clock=None):
        lengths.append([p.max_tokens for p in params])
        outs, seconds = generate(llm, prompts, params, clock)
        assert [len(o) for o in outs] == lengths[-1]
        return outs, seconds

    monkeypatch.setattr(bsd, "_generate", spy)
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
                       "--max-tokens", "8", "--max-tokens-spread", "0.5", "--waves", "3", "--prompt-len", "12",
                       "--threads", "1", "--no-warmup"])
    assert all(x == lengths[0] for x in lengths) and len(set(lengths[0])) > 1 and len(lengths[0]) == 6
    assert all(4 <= n <= 12 for n in lengths[0]) and report["max_tokens_spread"] == 0.5
    for row in report["rows"]:
        assert row["total_tok_s"] * row["seconds"] == pytest.approx(sum(lengths[0]))
    with pytest.raises(SystemExit):
        bsd.main(["--mode", "speed", "--max-tokens-spread", "1"])


def test_speed_mode_serves_waves_of_requests_at_most_a_batch_at_once(bsd, monkeypatch):
    from deepinfer_core.engine.scheduler import Scheduler

    running, schedule = [], Scheduler.schedule

    def spy(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        running.append((self.config.max_num_seqs, len(self.running)))
        return out

    monkeypatch.setattr(Scheduler, "schedule", spy)
    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes",
                       "2,4", "--max-tokens", "4", "--prompt-len", "12", "--threads", "1", "--no-warmup", "--waves",
                       "3", "--modes", "k=1"])
    assert report["waves"] == 3
    assert {cap: max(n for c, n in running if c == cap) for cap, _ in running} == {2: 2, 4: 4}
    for row in report["rows"]:
        b = row["batch"]
        assert row["requests"] == 3 * b and row["total_tok_s"] == pytest.approx(3 * b * 4 / row["seconds"])
        assert row["per_user_tok_s"] == pytest.approx(row["total_tok_s"] / b)
    with pytest.raises(SystemExit):
        bsd.main(["--mode", "speed", "--waves", "0"])


def test_speed_mode_picks_modes_samples_and_traces_the_gate(bsd):
    """``--modes`` runs the named modes beside plain decode, ``--temperature`` samples, and ``--gate-trace``
    keeps each confidence row's gate decisions (one letter a step, bucket changes and interval starts)."""
    import re

    report = bsd.main(["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
                       "--max-tokens", "12", "--prompt-len", "12", "--threads", "1", "--modes", "confidence",
                       "--temperature", "0.8", "--top-p", "0.9", "--gate-trace"])
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "confidence k=1"} and report["temperature"] == 0.8
    trace = rows["confidence k=1"]["gate_trace"]
    assert re.fullmatch(r"(\|\d+:|<\d+/\d+>|[SPsp])+", trace) and re.search("[SPsp]", trace), trace
    assert "gate_trace" not in rows["off"]


def test_speed_mode_times_steps_by_a_virtual_clock_when_asked(bsd):
    """``--virtual-clock P1,P64,S1,S64``: every run's seconds are the cost model's, the same on any machine;
    plain decode at batch 2 takes its plain step cost a token (one prefill step besides)."""
    argv = ["--mode", "speed", "--random", "--small", "--layers", "2", "--ks", "1", "--batch-sizes", "2",
            "--max-tokens", "8", "--prompt-len", "12", "--threads", "1", "--modes", "k=1", "--async-scheduling",
            "--virtual-clock", "1,1,3,3"]
    first, again = bsd.main(argv), bsd.main(argv)
    assert first["virtual_clock"]["plain"] == pytest.approx(1e-3)
    assert [r["seconds"] for r in first["rows"]] == [r["seconds"] for r in again["rows"]]
    off = next(r for r in first["rows"] if r["mode"] == "off")
    assert off["seconds"] == pytest.approx(8e-3, rel=0.1)
    with pytest.raises(SystemExit):
        bsd.main(["--mode", "speed", "--virtual-clock", "fast"])


def test_confidence_plan_benchmark_times_both_pricings(bsd, tmp_path):
    import bench_confidence_plan

    report = bench_confidence_plan.main(["--batch-sizes", "1,8", "--repeats", "2",
                                         "--json-out", str(tmp_path / "plan.json")])
    rows = {(r["pricing"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {("graphs", 1), ("graphs", 8), ("eager", 1), ("eager", 8)}
    assert all(r["plan_ms"] > 0 and 0 <= r["drafts_admitted"] <= 3 * r["batch"] for r in rows.values())
    assert rows["graphs", 1]["drafts_admitted"] == 3  # a lone sequence verifies every draft
    assert (tmp_path / "plan.json").read_text().startswith("{")


def test_host_path_profile_times_the_host_apart_from_the_graphs_work(bsd):
    """Each mode's host milliseconds per step outside what graphs run, the ops it launches outside them and
    their estimated GPU host cost; the engine's functions are put back afterwards."""
    import profile_host_path

    from deepinfer_core.worker.graph_runner import GraphRunner

    replay = GraphRunner.replay_step
    report = profile_host_path.main(["--modes", "off,fixed,confidence", "--batch-size", "2", "--max-tokens", "6",
                                     "--prompt-len", "8", "--k", "2", "--launch-us", "10"])
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "fixed", "confidence"}
    for r in rows.values():
        assert r["steps"] >= 2 and r["host_python_ms"] > 0 and r["ops"] > 0 and r["device_cpu_ms"] > 0
        assert r["gpu_host_ms"] == pytest.approx(r["host_python_ms"] + r["ops"] * 10 / 1e3)
    assert rows["fixed"]["ops"] > rows["off"]["ops"]  # the verification and drafting's host side launch more
    assert GraphRunner.replay_step is replay
    with pytest.raises(SystemExit, match="unknown"):
        profile_host_path.main(["--modes", "spec"])


def test_calibration_error_is_the_weighted_gap_per_bin(bsd):
    # bin 9: confidence 0.95, accepted 1 of 2 (gap 0.45); bin 2: confidence 0.2, accepted 0 of 2 (gap 0.2)
    tests = [(0.95, True), (0.95, False), (0.2, False), (0.2, False)]
    assert bsd.calibration_error(tests) == pytest.approx((0.45 * 2 + 0.2 * 2) / 4)
    assert bsd.calibration_error([(0.5, True), (0.5, False)]) == pytest.approx(0.0)
    assert bsd.calibration_error([]) is None


def test_speed_mode_on_random_v41_with_dspark_stages(bsd):
    """The release's V4.1 config (read from the reference folder) with random weights and its DSpark stages,
    at a sixteenth of its widths: the drafts are DSpark's, every one accepted when forced."""
    import bench_bounded_replay

    if not bench_bounded_replay.RELEASE_CONFIG.exists():
        pytest.skip(f"{bench_bounded_replay.RELEASE_CONFIG} not present")
    report = bsd.main(["--mode", "speed", "--method", "dspark", "--random", "--small", "--layers", "4",
                       "--experts", "4", "--ks", "2", "--batch-sizes", "2", "--max-tokens", "7", "--prompt-len", "12",
                       "--force-acceptance", "1.0", "--threads", "1", "--no-warmup", "--modes", "k="])
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "k=2"}
    assert rows["k=2"]["mean_acceptance_length"] == pytest.approx(3.0)  # 1 + 3 + 3 tokens: every draft kept
    assert report["model"].startswith("random V4.1-width / 16, 4 layers, 4 routed experts")
