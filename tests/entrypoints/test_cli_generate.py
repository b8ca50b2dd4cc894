"""``deepinfer generate``, ``deepinfer bench`` and the examples, on the embedded tiny default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.entrypoints import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops are too small to gain from threads, and a busy CPU makes them much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_generate_prints_text_per_prompt(capsys):
    code = cli.main(["generate", "--temperature", "0", "--max-tokens", "4", "def fibonacci(n):", "The quick"])
    out = capsys.readouterr().out
    assert code == 0
    assert "prompt 1/2: 'def fibonacci(n):'" in out
    assert "prompt 2/2: 'The quick'" in out
    assert out.count("finish_reason=length, tokens=4") == 2


def test_generate_json_has_the_fields(capsys):
    code = cli.main(["generate", "--json", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
                     "--n", "2", "--logprobs", "2", "--max-tokens", "3", "--ignore-eos", "hello"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dtype"] == "float32" and doc["backend"] == "cpu_ref"
    assert doc["sampling_params"]["seed"] == 3 and doc["sampling_params"]["n"] == 2
    (result,) = doc["results"]
    assert result["prompt"] == "hello" and result["error"] is None
    assert result["prompt_token_ids"] and all(isinstance(t, int) for t in result["prompt_token_ids"])
    assert [o["index"] for o in result["outputs"]] == [0, 1]
    for o in result["outputs"]:
        assert isinstance(o["text"], str)
        assert len(o["token_ids"]) == 3 and o["finish_reason"] == "length"
        assert len(o["logprobs"]) == 3
        for tok, step in zip(o["token_ids"], o["logprobs"]):
            assert str(tok) in step and 2 <= len(step) <= 3
            assert all(lp <= 0 for lp in step.values())
        total = sum(step[str(tok)] for tok, step in zip(o["token_ids"], o["logprobs"]))
        assert o["cumulative_logprob"] == pytest.approx(total)


def test_generate_token_id_prompt_and_stop(capsys):
    code = cli.main(["generate", "--json", "--temperature", "0", "--max-tokens", "4",
                     "--prompt-token-ids", "5,6,7"])
    assert code == 0
    greedy = json.loads(capsys.readouterr().out)["results"][0]
    assert greedy["prompt"] is None and greedy["prompt_token_ids"] == [5, 6, 7]
    text = greedy["outputs"][0]["text"]
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.strip()), None)
    if stop is None:
        pytest.skip("greedy text has no character to stop at")
    assert cli.main(["generate", "--json", "--temperature", "0", "--max-tokens", "4", "--stop", stop,
                     "--prompt-token-ids", "5,6,7"]) == 0
    out = json.loads(capsys.readouterr().out)["results"][0]["outputs"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["text"] == text[: text.index(stop)]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--n", "0"], "--n"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--block-size", "0"], "--block-size"),
        (["--cpu-threads", "0"], "--cpu-threads"),
        (["--backend", "no_such_backend"], "no_such_backend"),
        (["--model", "no/such/folder"], "config.json"),
        (["--prompt-token-ids", "5,999999"], "prompt 1: prompt token ids [999999]"),  # after "hello"
    ],
)
def test_generate_invalid_values_exit_2_without_traceback(capsys, argv, needle):
    code = cli.main(["generate", *argv, "hello"])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and "error" in err
    assert "Traceback" not in err


def test_generate_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--temperature", "hot", "hello"])
    assert exc.value.code == 2
    assert "--temperature" in capsys.readouterr().err
    assert cli.main(["generate"]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_bench_writes_json_and_prints_a_table(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    from deepinfer_core.default_model import v4_model_path

    code = cli.main(["bench", "--model", str(v4_model_path()), "--batch-sizes", "1,2", "--prompt-len", "8",
                     "--gen-len", "4", "--json-out", str(out_file)])  # the V4: transformers has it
    stdout = capsys.readouterr().out
    assert code == 0
    report = json.loads(out_file.read_text())
    machine = report["machine"]
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == 1 and machine["date"]
    assert report["config"]["prompt_len"] == 8 and report["config"]["gen_len"] == 4
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        for side in ("engine", "transformers"):
            assert row[side]["prefill_tok_s"] > 0 and row[side]["decode_tok_s"] > 0
            assert row[side]["decode_tokens"] == row["batch_size"] * 3
        assert row["ratio"]["prefill"] == pytest.approx(
            row["engine"]["prefill_tok_s"] / row["transformers"]["prefill_tok_s"])
        assert row["ratio"]["decode"] > 0
        assert row["greedy_token_agreement"] > 0.5  # same model, prompts and greedy decoding
    lines = stdout.splitlines()
    header = next(line for line in lines if "prefill engine" in line)
    assert "prefill HF" in header and "decode engine" in header and "decode HF" in header
    rows = [line.split() for line in lines[lines.index(header) + 1:]]
    rows = [r for r in rows if r and r[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(r[3].endswith("x") and r[6].endswith("x") for r in rows)


def test_bench_engine_only_and_invalid_batch_sizes(capsys):
    assert cli.main(["bench", "--no-hf", "--no-warmup", "--batch-sizes", "1", "--prompt-len", "4",
                     "--gen-len", "2"]) == 0
    out = capsys.readouterr().out
    assert "prefill engine" in out and "HF" not in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--batch-sizes", "1,x"])
    assert exc.value.code == 2
    assert "--batch-sizes" in capsys.readouterr().err


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / name), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_offline_inference_example_runs():
    proc = run_example("offline_inference.py", "--max-tokens", "4")
    assert proc.stdout.count("Prompt: ") == 4
    assert proc.stdout.count("Generated text: ") == 4
    assert "finish_reason=" in proc.stdout


def test_streaming_example_runs():
    proc = run_example("streaming.py", "--max-tokens", "4", "def fibonacci(n):")
    assert "Prompt: 'def fibonacci(n):'" in proc.stdout
    assert "Done: 4 tokens" in proc.stdout or "finish_reason=stop" in proc.stdout


@pytest.mark.slow
def test_sampling_options_example_runs():
    proc = run_example("sampling_options.py")
    assert "greedy is deterministic: True" in proc.stdout
    assert "same seed, same sample: True" in proc.stdout
    assert "logprobs=3" in proc.stdout
