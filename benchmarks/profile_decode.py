"""Kernel-level breakdown of one decode step at V4-Flash widths (random weights), with torch.profiler.

Builds the model as ``bench_gpu_decode.py`` does, prefills ``--batch`` prompts, decodes a few warm-up
steps, then profiles ``--steps`` decode steps and prints the CUDA time per kernel family and the host
time of the step's phases. Run eagerly (``--eager``) to see kernels; with graphs the profile shows the
replay and what stays on the host.

  python benchmarks/profile_decode.py --batch 64 --eager --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_decode as bench  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--out", default="profile_out")
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args(argv)
    from transformers import DeepseekV4ForCausalLM

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.sampling.params import SamplingParams

    ba = bench.parse_args(["--gen-len", str(a.steps + 4), "--prompt-len", str(a.prompt_len)])
    config = bench.make_config(ba)
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = DeepseekV4ForCausalLM(config).to(dtype)
    torch.set_default_dtype(torch.float32)
    bench.randomize(hf, config, ba.std, 0)
    tmp = tempfile.TemporaryDirectory()
    config.save_pretrained(tmp.name)
    cfg = ModelConfig.from_pretrained(Path(tmp.name))
    params = bench.convert_params(hf, cfg, dtype)
    del hf
    model = bench.build_deepinfer_model(cfg, params, "nvidia_sm100", dtype, device)
    engine = bench.make_engine(
        model, tmp.name, backend="nvidia_sm100", dtype=dtype, device="cuda", max_model_len=a.prompt_len + 64,
        max_num_seqs=a.batch, max_num_batched_tokens=max(2048, a.prompt_len), enable_prefix_caching=False,
        block_size=bench.cfg_block_size(cfg), enforce_eager=a.eager, async_scheduling=a.async_scheduling,
    )
    gen = torch.Generator().manual_seed(0)
    params_s = SamplingParams(temperature=0.0, max_tokens=a.steps + 60, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(str(i), torch.randint(2, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist(), params_s)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.waiting) or \
            engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows)
    host = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    tag = f"b{a.batch}_{'eager' if a.eager else 'graphs'}{'_async' if a.async_scheduling else ''}"
    (out / f"profile_{tag}.txt").write_text(table + "\n\n" + host)
    events = prof.key_averages()
    total_cuda = sum(e.self_device_time_total for e in events) / 1e3 / a.steps
    summary = {"batch": a.batch, "mode": tag, "device_ms_per_step": total_cuda,
               "top": [(e.key, e.self_device_time_total / 1e3 / a.steps) for e in
                       sorted(events, key=lambda e: -e.self_device_time_total)[:a.rows]]}
    (out / f"profile_{tag}.json").write_text(json.dumps(summary, indent=1))
    print(f"== {tag}: device time {total_cuda:.2f} ms/step")
    for k, v in summary["top"]:
        print(f"{v:9.3f} ms  {k[:110]}")


if __name__ == "__main__":
    main()
