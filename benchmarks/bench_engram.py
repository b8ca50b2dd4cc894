"""Engram time per decode step for each table placement, against a V4.1-width decode step, on one GPU.

    python benchmarks/bench_engram.py --rows 384006168 --out engram.json     # one full table (101 GB)

For each placement (``device``, ``host``: pinned and read in place by the ``engram_lookup`` Triton kernel over
unified addressing, ``file``: a safetensors file's mapping, rows gathered on the host) and each batch of
decode tokens (1 .. 256), the Engram work of one step at V4.1's shapes: the n-gram hash of every token
(``engram_hash``, 2 layers x 24 columns), then per Engram layer (2) the lookup of its 24 rows of 256 E4M3
values (264 B with the scales), the ``wkv`` projection (6144 -> 5 x 5120) and the gate. Both layers read the
one table built here (``--rows`` rows: one full table of the release is 384,006,168 rows, 101.4 GB; pass the
largest that fits and state it). ``device`` is skipped when the table does not fit the GPU.

The step it is compared with is a proxy of a V4.1 decode step at the release's widths: per layer (40) the
attention projections (``wq_a``, ``wq_b``, ``wkv``, grouped ``wo_a``, ``wo_b``), the shared expert and the
routed experts the batch touches (``min(6 B, 384)`` of them, batched 64 at a time over 64 distinct ones), as
bfloat16 GEMMs. It is not a real step: the sparse attention, mHC and norms are left out (shorter) and the
weights are bfloat16 where the release has FP8 and FP4 (more bytes read: longer), so read the Engram share it
gives as indicative; ``bench_engram_step.py`` measures what the tables add to the engine's own V4.1 step.
The issue's goal: ``host`` adds at most 5% at batch 64.

Prints a table and writes JSON (``--out``). Needs CUDA and the nvidia_sm100 backend (its Triton kernel).
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
from pathlib import Path

import torch

D_MODEL, HC, HEADS, HEAD_DIM, Q_LORA, O_GROUPS, O_LORA = 5120, 4, 64, 512, 1280, 8, 1024
INTER, EXPERTS, TOP_K, LAYERS = 2304, 384, 6, 40
E_HEAD_DIM, E_COLS, E_LAYERS, NGRAM = 256, 24, 2, 4
ROW_BYTES = E_HEAD_DIM + E_HEAD_DIM // 32


def write_table(path: Path, rows: int, chunk: int = 1 << 22) -> None:
    """A safetensors file of one Engram table (E4M3 rows, E8M0 scales), written in chunks (no full copy)."""
    header = {"w": {"dtype": "F8_E4M3", "shape": [rows, E_HEAD_DIM], "data_offsets": [0, rows * E_HEAD_DIM]},
              "s": {"dtype": "F8_E8M0", "shape": [rows, E_HEAD_DIM // 32],
                    "data_offsets": [rows * E_HEAD_DIM, rows * ROW_BYTES]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            f.write(torch.randint(0, 0x7F, (n, E_HEAD_DIM), dtype=torch.uint8, generator=gen).numpy().tobytes())
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            f.write(torch.full((n, E_HEAD_DIM // 32), 120, dtype=torch.uint8).numpy().tobytes())


def cuda_time(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (after two warm-ups), by CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class StepProxy:
    """The GEMMs of a V4.1 decode step at the release's widths (see the module docstring)."""

    def __init__(self, device: torch.device, distinct_experts: int = 64):
        def w(*shape):
            return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.01

        self.wq_a, self.wq_b, self.wkv = w(Q_LORA, D_MODEL), w(HEADS * HEAD_DIM, Q_LORA), w(HEAD_DIM, D_MODEL)
        self.wo_a = w(O_GROUPS, O_LORA, HEADS * HEAD_DIM // O_GROUPS)
        self.wo_b = w(D_MODEL, O_GROUPS * O_LORA)
        self.shared13, self.shared2 = w(2 * INTER, D_MODEL), w(D_MODEL, INTER)
        self.w13, self.w2 = w(distinct_experts, 2 * INTER, D_MODEL), w(distinct_experts, D_MODEL, INTER)

    @staticmethod
    def swiglu(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def __call__(self, batch: int) -> None:
        x = torch.randn(batch, D_MODEL, device=self.wo_b.device, dtype=torch.bfloat16)
        touched = min(TOP_K * batch, EXPERTS)  # decode: each touched expert sees a token or more
        pool = self.w13.shape[0]
        for _ in range(LAYERS):
            q = (x @ self.wq_a.T) @ self.wq_b.T
            x @ self.wkv.T
            o = torch.einsum("bgi,goi->bgo", q.view(batch, O_GROUPS, -1), self.wo_a).reshape(batch, -1)
            h = o @ self.wo_b.T
            h = self.swiglu(h @ self.shared13.T) @ self.shared2.T
            for first in range(0, touched, pool):  # the touched experts' weights, read once each
                m = min(pool, touched - first)
                t = h[torch.arange(first, first + m, device=h.device) % batch].unsqueeze(1)
                up = torch.bmm(t, self.w13[:m].transpose(1, 2))
                torch.bmm(self.swiglu(up), self.w2[:m].transpose(1, 2))


class EngramStep:
    """One step's Engram work on one table (both layers read it)."""

    def __init__(self, ops, weight, scale, device: torch.device):
        from deepinfer_core.models.deepseek_v41.engram_hash import EngramHasher, EngramHashLayout

        layout = EngramHashLayout.build(layer_ids=(1, 14), max_ngram_size=NGRAM, n_heads=8, vocab_size=16_000_000,
                                        token_map=list(range(99_092)) + [5] * 30_188, pad_token_id=2)
        self.hash_args = EngramHasher(layout).to(device).op_args()
        self.ops, self.weight, self.scale, self.device = ops, weight, scale, device
        self.rows = weight.shape[0]
        self.wkv = torch.randn((HC + 1) * D_MODEL, E_COLS * E_HEAD_DIM, device=device, dtype=torch.bfloat16) * 0.01
        self.qk = torch.ones(HC, D_MODEL, device=device)

    def __call__(self, batch: int) -> None:
        history = torch.randint(0, 129_280, (batch, NGRAM), device=self.device)
        ids = self.ops.engram_hash(history, *self.hash_args) % self.rows  # both layers into the one table
        streams = torch.randn(batch, HC, D_MODEL, device=self.device, dtype=torch.bfloat16)
        for layer in range(E_LAYERS):
            rows = self.ops.engram_lookup(ids[:, layer], self.weight, self.scale, 0).to(torch.bfloat16)
            key, value = (rows @ self.wkv.T).split([HC * D_MODEL, D_MODEL], dim=-1)
            streams = self.ops.engram_gate(streams, key.view(batch, HC, D_MODEL), value, self.qk, self.qk, 1e-20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=384_006_168, help="table rows (one full table: 384006168)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--placements", default="device,host,file")
    parser.add_argument("--dir", default=None, help="where the table file is written (default: a temp dir)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="bench_engram.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_engram needs a CUDA device")
    from deepinfer_core.model.mapped import file_view
    from deepinfer_core.plugins import build_op_table

    device = torch.device("cuda")
    ops = build_op_table("nvidia_sm100", dtype=torch.bfloat16, device=device)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench-engram-"))
    path = folder / "engram.safetensors"
    started = time.perf_counter()
    write_table(path, args.rows)
    print(f"table: {args.rows:,} rows, {args.rows * ROW_BYTES / 1e9:.1f} GB at {path} "
          f"(written in {time.perf_counter() - started:.0f} s)")
    mapped_w, mapped_s = file_view(path, "w"), file_view(path, "s")
    batches = [int(b) for b in args.batches.split(",")]
    proxy = StepProxy(device)
    step_ms = {b: cuda_time(lambda b=b, f=proxy: f(b), max(3, args.iters // 4)) for b in batches}
    del proxy
    torch.cuda.empty_cache()
    results: dict[str, dict[int, float]] = {}
    for placement in args.placements.split(","):
        if placement == "file":
            weight, scale = mapped_w, mapped_s
        elif placement == "host":
            weight = torch.empty(mapped_w.shape, dtype=mapped_w.dtype, pin_memory=True)
            scale = torch.empty(mapped_s.shape, dtype=mapped_s.dtype, pin_memory=True)
            for start in range(0, args.rows, 1 << 24):
                weight[start:start + (1 << 24)].copy_(mapped_w[start:start + (1 << 24)])
            scale.copy_(mapped_s)
        else:
            free, _ = torch.cuda.mem_get_info()
            if args.rows * ROW_BYTES > 0.9 * free:
                print(f"device: skipped ({args.rows * ROW_BYTES / 1e9:.1f} GB > 90% of {free / 1e9:.1f} GB free)")
                continue
            weight, scale = mapped_w.to(device), mapped_s.to(device)
        engram = EngramStep(ops, weight, scale, device)
        results[placement] = {b: cuda_time(lambda b=b, f=engram: f(b), args.iters) for b in batches}
        del engram, weight, scale
        torch.cuda.empty_cache()
    head = f"{'batch':>6} {'step ms':>9}" + "".join(f" {p + ' ms':>10} {'%':>6}" for p in results)
    print(head)
    for b in batches:
        print(f"{b:>6} {step_ms[b]:>9.3f}" + "".join(f" {results[p][b]:>10.3f} {100 * results[p][b] / step_ms[b]:>6.1f}"
                                                    for p in results))
    report = {"device": torch.cuda.get_device_name(), "rows": args.rows, "table_bytes": args.rows * ROW_BYTES,
              "step_proxy_ms": step_ms, "engram_ms": results,
              "note": "step proxy: V4.1-width GEMMs only (no attention, mHC, norms); Engram: hash + 2 layers of "
                      "lookup, wkv and gate, both layers reading the one table"}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
