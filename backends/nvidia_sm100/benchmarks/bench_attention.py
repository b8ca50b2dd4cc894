"""Sparse-attention decode at DeepSeek-V4-Flash shapes: the engine's Triton kernel and FlashMLA, side by side.

Shapes (the engine's own): 64 heads of 512 (RoPE 64), one or two query tokens per request (two: MTP),
per query token the sliding window's 128 rows plus, by layer kind, nothing (``sliding``), the indexer's
512 picks among the compressed entries (``csa``, rate 4) or every compressed entry of the context (``hca``,
rate 128), a sink per head; every request has ``--context`` tokens of context in its own pool rows.

Measured, each over the same inputs (GPU work timed with CUDA events, median of ``--iters`` calls):

* ``triton``: ``deepinfer_nvidia_sm100.triton_ops.sparse_attention`` on bfloat16 pools (what the engine
  runs without FlashMLA);
* ``triton_1split``: the same kernel with one program per query token (``splits=1``, what batch-invariant
  mode runs; ``triton`` splits each query's index columns over programs when the batch has few tokens);
* ``engine``: the op table's ``sparse_attention`` at V4-Flash widths when it is not that kernel (an
  adapter that passed its self-check, or on the CPU the core's torch body);
* ``engine_fp8``: the op table's ``sparse_attention_fp8`` on DeepSeek's FP8 KV entries (584 bytes a row,
  :mod:`deepinfer_core.quant.kv_fp8`);
* ``flash_mla_decode``: FlashMLA's sparse decode, ``flash_mla_with_kvcache(q[b, s_q, 64, 512], the same
  FP8 entries as pages of one row, indices[b, s_q, topk] int32, attn_sink, extra_k_cache,
  extra_indices_in_kvcache, is_fp8_kvcache=True)`` with the scheduler metadata of ``get_mla_metadata()``
  computed on the first call and reused (as one decode step would for all its layers); the extra list is
  padded with -1 to a multiple of 64, which the kernel needs, and the entries sit at a 592-byte row stride
  (FlashMLA's 128-bit loads need 16-byte aligned rows, which the engine's 584-byte stride gives only every
  other row); ``flash_mla_decode_meta``: the same with new metadata every call;
* ``flash_mla_sparse_fwd``: the nvidia backend's FlashMLA adapter (``external.flash_mla_sparse_attention``:
  ``flash_mla_sparse_fwd`` per pool on bfloat16 pools, merged through the log-sum-exps).

FlashMLA's columns need ``flash_mla`` importable and a CUDA device; otherwise they are reported as
skipped, with the reason. ``max_err`` is against the core's torch body in float32 on the same values
(for the FP8 columns, the decoded entries). ``--configs`` also times other launch configurations of the
Triton kernel (at the ``csa`` shape), to choose its default.

  python backends/nvidia_sm100/benchmarks/bench_attention.py --out OUT [--configs]
  python backends/nvidia_sm100/benchmarks/bench_attention.py --out OUT \\
      --device cpu --backend cpu_ref --batches 1,2 --context 1024
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# this folder (kernel_timing), the repository's benchmarks (bench_gpu_decode's model) and its root
# (benchmarks.gpu_sweep)
for _path in (REPO, REPO / "benchmarks", HERE):
    sys.path.insert(0, str(_path))
from bench_gpu_decode import FLASH  # noqa: E402
from kernel_timing import cuda_time_ms  # noqa: E402

# the engine's V4-Flash shapes (those of the sweep's random model)
HEADS, DIM, WINDOW, TOPK = FLASH["heads"], FLASH["head_dim"], FLASH["sliding_window"], FLASH["index_topk"]
CSA_RATE, HCA_RATE = FLASH["csa_rate"], FLASH["hca_rate"]
LAYERS = ("csa", "hca", "sliding")
FLASH_MLA_TOPK_MULTIPLE = 64  # the sm90 sparse decode kernel's TOPK_BLOCK_SIZE
FLASH_MLA_ROW_ALIGN = 16  # its 128-bit loads of a KV row
FLASH_MLA = ("flash_mla_decode", "flash_mla_decode_meta", "flash_mla_sparse_fwd")
CONFIGS = [  # BLOCK_H, BLOCK_K, BLOCK_DV, num_warps, num_stages
    (32, 32, 256, 8, None), (64, 32, 256, 8, None), (64, 32, 512, 8, None), (64, 64, 256, 8, None),
    (16, 32, 512, 4, None), (64, 32, 256, 8, 2), (64, 16, 512, 8, 2), (32, 64, 256, 8, 2),
]


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want comma-separated integers >= 1, got {text!r}")
    return values


def layer_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in LAYERS for k in kinds):
        raise argparse.ArgumentTypeError(f"want layer kinds from {','.join(LAYERS)}, got {text!r}")
    return kinds


# --- inputs ----------------------------------------------------------------------------------------


@dataclass
class Case:
    """One shape's inputs: bfloat16 pools and the same rows as FP8 entries (and decoded back)."""

    layer: str
    batch: int
    q_per_request: int
    rope_dim: int
    q: torch.Tensor  # [T, H, D], T = batch * q_per_request, request-major
    sinks: torch.Tensor  # [H] float32
    window: torch.Tensor  # [Nw, D]
    window_idx: torch.Tensor  # [T, WINDOW] long
    extra: torch.Tensor | None  # [Ne, D]
    extra_idx: torch.Tensor | None  # [T, K2] long
    window_fp8: torch.Tensor  # [Nw, B] uint8
    extra_fp8: torch.Tensor | None
    window_dec: torch.Tensor  # the FP8 entries decoded, bfloat16
    extra_dec: torch.Tensor | None

    @property
    def tokens(self) -> int:
        return self.q.shape[0]

    @property
    def keys(self) -> int:
        return self.window_idx.shape[1] + (0 if self.extra_idx is None else self.extra_idx.shape[1])

    def args(self) -> tuple:
        return self.q, self.window, self.window_idx, self.sinks, DIM**-0.5, self.extra, self.extra_idx

    def args_decoded(self) -> tuple:
        return self.q, self.window_dec, self.window_idx, self.sinks, DIM**-0.5, self.extra_dec, self.extra_idx


def make_case(layer: str, batch: int, q_per_request: int, context: int, rope_dim: int,
              device: torch.device) -> Case:
    """Every request owns ``window + q_per_request - 1`` window rows and ``context / rate`` compressed rows,
    the requests' regions in shuffled order; query token j of a request reads its window ending at j."""
    from deepinfer_core.quant.kv_fp8 import pack_kv_fp8, unpack_kv_fp8

    gen = torch.Generator(device=device).manual_seed(1000 * batch + 10 * q_per_request + LAYERS.index(layer))
    tokens = batch * q_per_request

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    def regions(rows_each: int) -> torch.Tensor:  # [batch] first row of each request's region
        return torch.randperm(batch, generator=gen, device=device) * rows_each

    span = WINDOW + q_per_request - 1
    window = randn(batch * span, DIM)
    pos = torch.arange(q_per_request, device=device).repeat(batch)  # query token j of its request
    base = regions(span).repeat_interleave(q_per_request)
    window_idx = base.unsqueeze(1) + pos.unsqueeze(1) + torch.arange(WINDOW, device=device)
    extra = extra_idx = None
    if layer != "sliding":
        rate = CSA_RATE if layer == "csa" else HCA_RATE
        entries = max(context // rate, 1)
        extra = randn(batch * entries, DIM)
        base = regions(entries).repeat_interleave(q_per_request).unsqueeze(1)
        if layer == "csa":
            picks = min(TOPK, entries)
            order = torch.rand(tokens, entries, generator=gen, device=device).argsort(dim=1)[:, :picks]
            extra_idx = base + order
        else:
            extra_idx = base + torch.arange(entries, device=device)
    window_fp8 = pack_kv_fp8(window, rope_dim)
    extra_fp8 = None if extra is None else pack_kv_fp8(extra, rope_dim)

    def decode(entries: torch.Tensor) -> torch.Tensor:
        return unpack_kv_fp8(entries, DIM, rope_dim, torch.bfloat16, torch.bfloat16)

    return Case(layer, batch, q_per_request, rope_dim, randn(tokens, HEADS, DIM),
                torch.randn(HEADS, generator=gen, device=device), window, window_idx, extra, extra_idx,
                window_fp8, extra_fp8, decode(window_fp8), None if extra_fp8 is None else decode(extra_fp8))


def reference(args: tuple) -> torch.Tensor:
    """The core's torch body in float32."""
    from deepinfer_core.ops import native

    q, kv, idx, sinks, scale, ekv, eidx = args
    return native.sparse_attention(q.float(), kv.float(), idx, sinks, scale,
                                   None if ekv is None else ekv.float(), eidx)


# --- implementations -------------------------------------------------------------------------------


class Skip(Exception):
    """An implementation that cannot run here (the reason is reported)."""


#: errors after which the CUDA context is unusable
STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address", "unspecified launch failure",
                      "device-side assert", "illegal instruction")


class DeviceLost(Exception):
    """A kernel left the CUDA context unusable; ``row`` holds what was measured of its shape."""

    def __init__(self, row: dict[str, Any], name: str):
        super().__init__(f"{name} left the CUDA context unusable: {row['errors'][name]}")
        self.row = row


def _pad(idx: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -idx.shape[-1] % multiple
    return torch.nn.functional.pad(idx, (0, pad), value=-1) if pad else idx


def flash_mla_pages(entries: torch.Tensor) -> torch.Tensor:
    """FP8 entries [N, B] as FlashMLA's k_cache [N, 1, 1, B]: one token a page, pages 16-byte aligned.

    FlashMLA reads a row with 128-bit loads, so every row must start on 16 bytes; at the engine's own
    584-byte stride only every other row does, so the rows are copied (once, outside the timing) to a
    stride rounded up to 16 (592)."""
    n, width = entries.shape
    stride = -(-width // FLASH_MLA_ROW_ALIGN) * FLASH_MLA_ROW_ALIGN
    pages = torch.zeros((n, stride), dtype=torch.uint8, device=entries.device)
    pages[:, :width] = entries
    return pages[:, :width].view(n, 1, 1, width)


def flash_mla_decode(fm: Any, case: Case, fresh_meta: bool) -> Callable[[], torch.Tensor]:
    """``flash_mla_with_kvcache`` over the FP8 entries, each row a page of one token."""
    b, s = case.batch, case.q_per_request
    q = case.q.view(b, s, HEADS, DIM)
    kcache = flash_mla_pages(case.window_fp8)
    idx = _pad(case.window_idx, FLASH_MLA_TOPK_MULTIPLE).to(torch.int32).view(b, s, -1).contiguous()
    ekcache = eidx = None
    if case.extra_fp8 is not None:
        ekcache = flash_mla_pages(case.extra_fp8)
        eidx = _pad(case.extra_idx, FLASH_MLA_TOPK_MULTIPLE).to(torch.int32).view(b, s, -1).contiguous()
    meta = fm.get_mla_metadata()[0]

    def run() -> torch.Tensor:
        sched = fm.get_mla_metadata()[0] if fresh_meta else meta
        out, _ = fm.flash_mla_with_kvcache(q, kcache, None, None, DIM, sched, None, DIM**-0.5, False, True, idx,
                                           case.sinks, ekcache, eidx)
        return out.view(case.tokens, HEADS, DIM)

    return run


class Implementations:
    """What can be measured here, built once: name -> (case -> callable, which inputs), and why the rest not."""

    def __init__(self, backend: str, device: torch.device, ops: Any, flash_mla: Any = None):
        """``flash_mla``: the module to measure (default: ``import flash_mla``, on CUDA devices only)."""
        self.makers: dict[str, Callable[[Case], Callable[[], torch.Tensor]]] = {}
        self.fp8: set[str] = set()  # the implementations that read the FP8 entries
        self.skipped: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        triton_fn = None
        if backend == "nvidia_sm100":
            try:
                from deepinfer_nvidia_sm100 import capability

                ok, why = capability.triton_usable(device)
                if not ok:
                    raise Skip(why)
                from deepinfer_nvidia_sm100 import triton_ops

                triton_fn = triton_ops.sparse_attention
                self.makers["triton"] = lambda c: (lambda: triton_fn(*c.args()))
                self.makers["triton_1split"] = lambda c: (lambda: triton_fn(*c.args(), splits=1))
            except (Skip, ImportError) as exc:
                self.skipped["triton"] = str(exc)
        else:
            self.skipped["triton"] = f"the Triton kernel is the nvidia_sm100 backend's; --backend is {backend}"
        engine = ops.chosen["sparse_attention"]
        if engine.fn is triton_fn:
            self.notes["engine"] = "the engine's sparse_attention is the Triton kernel (column triton)"
        else:
            self.makers["engine"] = lambda c: (lambda: ops.sparse_attention(*c.args()))
        engine_fp8 = ops.sparse_attention_fp8

        def fp8_call(c: Case) -> Callable[[], torch.Tensor]:
            return lambda: engine_fp8(c.q, c.window_fp8, c.window_idx, c.sinks, DIM**-0.5, c.rope_dim,
                                      torch.bfloat16, c.extra_fp8, c.extra_idx)

        self.makers["engine_fp8"] = fp8_call
        self.fp8.add("engine_fp8")
        reason = self._flash_mla(device, flash_mla)
        if reason:
            for name in FLASH_MLA:
                self.skipped[name] = reason

    def _flash_mla(self, device: torch.device, fm: Any) -> str:
        if fm is None:
            try:
                fm = importlib.import_module("flash_mla")
            except Exception as exc:  # missing, hidden, or a broken build
                return f"flash_mla is not importable: {type(exc).__name__}: {exc}"
            if device.type != "cuda":
                return f"FlashMLA runs on CUDA devices; the device is {device}"
        missing = [a for a in ("flash_mla_with_kvcache", "get_mla_metadata", "flash_mla_sparse_fwd")
                   if not callable(getattr(fm, a, None))]
        if missing:
            return f"flash_mla {getattr(fm, '__version__', '?')} has no {', '.join(missing)}"
        from deepinfer_nvidia_sm100 import external

        self.makers["flash_mla_decode"] = lambda c: flash_mla_decode(fm, c, False)
        self.makers["flash_mla_decode_meta"] = lambda c: flash_mla_decode(fm, c, True)
        # the backend's adapter (external.flash_mla_sparse_attention) on this module's flash_mla_sparse_fwd
        fwd = fm.flash_mla_sparse_fwd
        self.makers["flash_mla_sparse_fwd"] = lambda c: (lambda: external.flash_mla_attention_with(fwd, *c.args()))
        self.fp8.update(("flash_mla_decode", "flash_mla_decode_meta"))
        where = getattr(fm, "__file__", None)
        self.notes["flash_mla"] = f"flash_mla {getattr(fm, '__version__', '?')} from {where and Path(where).parent}"
        return ""


def timer(device: torch.device, warmup: int, iters: int) -> Callable[[Callable[[], Any]], float]:
    """Microseconds of one call: CUDA events around each call (median), or the host clock on the CPU."""
    if device.type == "cuda":
        return lambda fn: 1e3 * cuda_time_ms(fn, warmup=warmup, iters=iters)

    def host(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    return host


def measure(case: Case, impls: Implementations, time_us: Callable) -> dict[str, Any]:
    row: dict[str, Any] = {"layer": case.layer, "batch": case.batch, "q_per_request": case.q_per_request,
                           "tokens": case.tokens, "keys_per_token": case.keys, "us": {}, "max_err": {},
                           "errors": {}}
    refs = {False: reference(case.args()), True: reference(case.args_decoded())}
    for name, make in impls.makers.items():
        try:
            fn = make(case)
            out = fn()
            if out.is_cuda:
                torch.cuda.synchronize(out.device)  # a kernel's fault is this implementation's
            row["max_err"][name] = float((out.float() - refs[name in impls.fp8]).abs().max())
            row["us"][name] = time_us(fn)
        except Exception as exc:  # a shape an implementation refuses: recorded, the others go on
            row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if any(m in str(exc) for m in STICKY_CUDA_ERRORS):  # the context is lost: nothing else can run
                raise DeviceLost(row, name) from exc
    base = row["us"].get("triton") or row["us"].get("engine")
    row["vs_triton" if "triton" in row["us"] else "vs_engine"] = (
        {k: v / base for k, v in row["us"].items()} if base else {})
    # bytes one call must read: the gathered rows (bf16 or FP8 entries) and the queries
    rows = case.tokens * case.keys
    row["kv_mb"] = {"bf16": rows * DIM * 2 / 1e6, "fp8": rows * case.window_fp8.shape[1] / 1e6}
    return row


# --- Triton launch configurations ------------------------------------------------------------------


def launch(args, block_h, block_k, block_dv, warps, stages):
    from deepinfer_nvidia_sm100.triton_ops import _k, _prec

    q, kv, idx, sinks, scale, ekv, eidx = args
    tokens = q.shape[0]
    out = torch.empty_like(q)
    extra = {} if stages is None else {"num_stages": stages}

    def run():
        _k().sparse_attention_kernel[(tokens, HEADS // block_h, DIM // block_dv)](
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], idx, idx.stride(0), idx.shape[1],
            ekv, ekv.stride(0), ekv.shape[0], eidx, eidx.stride(0), eidx.shape[1], sinks, out, out.stride(0),
            out.stride(1), HEADS, DIM, scale, HAS_EXTRA=True, BLOCK_H=block_h, BLOCK_K=block_k,
            BLOCK_DK=128, BLOCK_DV=block_dv, DOT_PREC=_prec(q.dtype), num_warps=warps, **extra,
        )
        return out

    return run


def launch_configs(case: Case, time_us: Callable) -> dict[str, Any]:
    ref = reference(case.args())
    out = {}
    for cfg in CONFIGS:
        try:
            run = launch(case.args(), *cfg)
            out[str(cfg)] = {"us": time_us(run), "max_err": float((run().float() - ref).abs().max())}
        except Exception as exc:  # a configuration the compiler refuses (registers, shared memory)
            out[str(cfg)] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return out


# --- report ----------------------------------------------------------------------------------------


SHORT = {"triton": "triton", "triton_1split": "tri_1split", "engine": "engine", "engine_fp8": "eng_fp8",
         "flash_mla_decode": "fm_dec",
         "flash_mla_decode_meta": "fm_dec+meta", "flash_mla_sparse_fwd": "fm_fwd"}


def table(report: dict[str, Any]) -> str:
    """Microseconds per call, then each implementation's time over the baseline's (triton, else engine)."""
    names = [n for n in SHORT if n in report["measured"]]
    base = "triton" if "triton" in names else "engine"
    ratios = [n for n in names if n != base]
    legend = ", ".join(f"{SHORT[n]} = {n}" for n in names if SHORT[n] != n)
    head = f"{'layer':>7} {'batch':>5} {'q/req':>5} {'keys':>5}" + "".join(f" {SHORT[n] + ' us':>14}" for n in names)
    head += "".join(f" {SHORT[n] + '/' + base:>18}" for n in ratios)
    lines = [f"us per call ({legend})" if legend else "us per call", head]
    for r in report["rows"]:
        key = "vs_triton" if "vs_triton" in r else "vs_engine"
        cells = [f" {r['us'][n]:>14.1f}" if n in r["us"] else f" {'error' if n in r['errors'] else '-':>14}"
                 for n in names]
        cells += [f" {r[key][n]:>18.2f}" if n in r.get(key, {}) else f" {'-':>18}" for n in ratios]
        lines.append(f"{r['layer']:>7} {r['batch']:>5} {r['q_per_request']:>5} {r['keys_per_token']:>5}"
                     + "".join(cells))
    return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128], help="requests per call")
    ap.add_argument("--q-per-request", type=int_list, default=[1, 2], help="query tokens per request (2: MTP)")
    ap.add_argument("--layers", type=layer_list, default=list(LAYERS), help="layer kinds: csa, hca, sliding")
    ap.add_argument("--context", type=int, default=4096, help="context tokens of every request")
    ap.add_argument("--backend", default="nvidia_sm100")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", action="store_true", help="also time other launch configurations of the kernel")
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args(argv)

    import bench_gpu_decode as bgd

    from benchmarks.gpu_sweep.libraries import implementation_label
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.plugins import build_op_table

    device = torch.device(a.device)
    cfg = ModelConfig.from_hf(bgd.make_config(bgd.parse_args([])))  # V4-Flash widths: the adapters' predicates
    ops = build_op_table(a.backend, dtype=torch.bfloat16, device=device, model_config=cfg)
    impls = Implementations(a.backend, device, ops)
    report: dict[str, Any] = {
        "environment": bgd.environment(device),
        "shapes": {"heads": HEADS, "head_dim": DIM, "rope_dim": cfg.rope_dim, "window": WINDOW, "index_topk": TOPK,
                   "csa_rate": CSA_RATE, "hca_rate": HCA_RATE, "context": a.context, "batches": a.batches,
                   "q_per_request": a.q_per_request, "layers": a.layers},
        "method": "median of iters calls after warmup; CUDA events around each call on a GPU (host clock on the "
                  "CPU); max_err against the core's torch body in float32 on the same values",
        "ops": {op: implementation_label(ops.chosen[op]) for op in ("sparse_attention", "sparse_attention_fp8")},
        "measured": list(impls.makers), "skipped": impls.skipped, "notes": impls.notes, "rows": [],
    }
    by_reason: dict[str, list[str]] = {}
    for name, why in impls.skipped.items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        print(f"skipped: {', '.join(names)} ({why})")
    print(f"engine ops: {', '.join(f'{op} <- {label}' for op, label in report['ops'].items())}")
    for note in impls.notes.values():
        print(note)
    time_us = timer(device, a.warmup, a.iters)
    try:
        for layer in a.layers:
            for batch in a.batches:
                for s_q in a.q_per_request:
                    case = make_case(layer, batch, s_q, a.context, cfg.rope_dim, device)
                    row = measure(case, impls, time_us)
                    if a.configs and layer == "csa" and "triton" in impls.makers:
                        row["configs"] = launch_configs(case, time_us)
                    report["rows"].append(row)
                    print(json.dumps(row))
                    del case
    except DeviceLost as exc:  # what was measured is still written
        report["rows"].append(exc.row)
        report["fatal"] = str(exc)
        print(f"stopped: {exc}")
    print()
    print(table(report))
    for why, names in by_reason.items():  # again, below the figures: never a number in their place
        print(f"skipped: {', '.join(names)} ({why})")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'attention.json'}")
    return report


if __name__ == "__main__":
    main()
