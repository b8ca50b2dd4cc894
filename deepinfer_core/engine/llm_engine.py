"""LLMEngine: add requests, step (schedule -> run model -> sample -> post-process), collect outputs."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.memory import plan_pools, profile_activation_bytes
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from deepinfer_core.model import load_model
from deepinfer_core.model.cache import ModelCache, check_block_size
from deepinfer_core.model.metadata import SeqSpan
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.plugins import load_backend
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import Sampler, SamplerOutput
from deepinfer_core.sampling.structured import StructuredOutputManager

logger = logging.getLogger(__name__)
BATCH_INVARIANT_ENV = "DEEPINFER_BATCH_INVARIANT"


@dataclass
class EngineArgs:
    model: str | Path | None = None
    backend: str = "cpu_ref"
    dtype: str | torch.dtype | None = None
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_replay_tokens: int = 512
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int = 2 << 30
    block_size: int = 128
    num_blocks: int | None = None
    num_window_blocks: int | None = None
    seed: int = 0
    allow_reference_fallback: bool = False
    batch_invariant: bool = False  # also on with DEEPINFER_BATCH_INVARIANT=1
    enforce_eager: bool = False  # never capture graphs of the forward (CUDA graphs are used on cuda otherwise)
    max_cudagraph_capture_size: int | None = None  # largest decode batch run from a graph (max_num_seqs)
    async_scheduling: bool = False  # schedule step N+1 while the device runs step N (zero-overhead)
    quantization: str | None = None  # "fp8": linear and expert weights in E4M3 with 128x128 block scales


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence]):
        self.request_id, self.prompt, self.prompt_token_ids, self.seqs = request_id, prompt, prompt_token_ids, seqs


@dataclass
class _Step:
    """A launched step: what it computed, whom it sampled, and at which output index each sample goes."""

    scheduled: list[tuple[Sequence, int]]
    sampled: list[Sequence]
    positions: list[int]
    tokens: torch.Tensor | None  # the samples on the device
    host: SamplerOutput | None  # the samples on their way to the host


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from deepinfer_core.default_model import default_model_path

        self.args = args
        path = Path(args.model) if args.model is not None else default_model_path()
        self.model_config = ModelConfig.from_pretrained(path)
        backend = load_backend(args.backend)
        self.device = torch.device(args.device) if args.device else backend.hook.deepinfer_init_device(local_rank=0)
        default_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.dtype = resolve_dtype(args.dtype, default_dtype)
        if self.dtype == torch.float64 and self.device.type != "cpu":
            raise ValueError("float64 is for golden runs on the CPU reference backend only")
        cfg = self.model_config
        max_len = args.max_model_len or min(int(cfg.max_position_embeddings), 4096)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(args, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                                                args.enable_chunked_prefill)
        self.cache_config = CacheConfig(args.block_size, args.num_blocks, args.num_window_blocks,
                                        args.kv_cache_bytes, args.gpu_memory_utilization, args.enable_prefix_caching)
        check_block_size(cfg, args.block_size)
        backend.hook.deepinfer_configure(model_config=cfg, cache_config=self.cache_config)
        env = os.environ.get(BATCH_INVARIANT_ENV, "").strip().lower()
        self.batch_invariant = bool(args.batch_invariant) or env in ("1", "true", "yes", "on")
        self.model = load_model(path, args.backend, self.dtype, self.device, args.allow_reference_fallback,
                                batch_invariant=self.batch_invariant, quantization=args.quantization)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer.json").is_file() or (
            path / "tokenizer_config.json").is_file() else None
        activation = 0
        if self.device.type == "cuda":
            activation = profile_activation_bytes(self.model, self.scheduler_config, args.block_size)
        sizes = plan_pools(cfg, self.cache_config, self.scheduler_config, self.dtype, self.device, activation)
        self.pool_sizes = sizes
        self.cache = ModelCache(cfg, sizes.num_blocks, sizes.num_window_blocks, sizes.num_state_slots,
                                args.block_size, self.dtype, self.device)
        self.runner = ModelRunner.create(self.model, self.cache, args, self.scheduler_config, backend)
        self.block_manager = BlockManager(
            sizes.num_blocks, sizes.num_window_blocks, sizes.num_state_slots, args.block_size, cfg.sliding_window,
            enable_prefix_caching=args.enable_prefix_caching, max_replay_tokens=args.max_replay_tokens,
            cache_salt=f"{path.resolve()}|{self.dtype}",
        )
        from deepinfer_core.engine.scheduler import Scheduler

        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.sampler = Sampler(self.model.ops, cfg.vocab_size, cfg.eos_token_ids, self.structured)
        self.requests: dict[str, _Request] = {}
        self._counter = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(args.seed)
        self._inflight: _Step | None = None  # async scheduling: the launched step not yet finished

    # --- requests --------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer; pass prompt_token_ids instead")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str | None, prompt: str | dict | list[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) when the request is invalid."""
        params = params or SamplingParams()
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        self._validate(ids, params)
        so = params.structured_outputs
        grammar = self.structured.compile(so) if so is not None else None  # ValueError: not queued
        seqs = []
        for i in range(params.n):
            gen = torch.Generator()
            if params.seed is not None:
                gen.manual_seed((params.seed * 1000003 + i) % 2**64)  # any int seed, no overflow
            else:
                gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._seed_rng)))
            seqs.append(Sequence(request_id, i, ids, params, gen))
            if grammar is not None:
                seqs[-1].grammar = self.structured.new_state(grammar, so)
        self.requests[request_id] = _Request(request_id, text, ids, seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab, max_len = self.model_config.vocab_size, self.scheduler_config.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {max_len} "
                             "(prompt plus at least one generated token must fit)")
        sched = self.scheduler_config
        if not sched.enable_chunked_prefill and len(ids) > sched.max_num_batched_tokens:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_num_batched_tokens is "
                             f"{sched.max_num_batched_tokens} and chunked prefill is off")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids {params.stop_token_ids} are outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no running request holds (and the hit statistics)."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.stats = dict.fromkeys(self.block_manager.stats, 0)

    def prefix_cache_stats(self) -> dict[str, float]:
        """Engine-wide: queries, prompt tokens looked up, tokens served from cache, tokens replayed, hit rate."""
        stats = dict(self.block_manager.stats)
        stats["hit_rate"] = stats["hit_tokens"] / stats["query_tokens"] if stats["query_tokens"] else 0.0
        return stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step --------------------------------------------------------------------------------
    #
    # A step is launched (``_run``: batch, forward, sample, the sampled tokens start for the host) and
    # finished (``_finish``: tokens appended, stop checks, text). Synchronously the two follow each
    # other. With async scheduling step N stays in flight: the next call schedules and launches N+1
    # (a sequence whose token of N is still on the device is scheduled with a placeholder that the
    # device fills in) and then finishes N. ``_can_overlap`` falls back to finishing N first whenever
    # launching N+1 early could change what N+1 computes for any sequence.

    def step(self) -> list[RequestOutput]:
        touched: dict[str, _Request] = {}
        prev, self._inflight = self._inflight, None
        if prev is not None and not self._can_overlap(prev):
            self._finish(prev, touched)
            prev = None
        if prev is not None:  # a sequence whose in-flight token is its last leaves now, as it would have
            for seq in prev.sampled:
                if seq.finish_reason is None and self._out_of_room(seq):
                    self.scheduler.finish(seq)
        preemptions = self.scheduler.num_preemptions
        scheduled, unfittable = self.scheduler.schedule()
        assert prev is None or (self.scheduler.num_preemptions == preemptions and not unfittable)
        for seq in unfittable:  # already finished by the scheduler, which put the reason in stop_reason
            seq.finish_reason = "error"
            touched[seq.request_id] = self.requests[seq.request_id]
        launched = self._run(scheduled, prev) if scheduled else None
        if prev is not None:
            self._finish(prev, touched)
        if launched is not None:
            for seq, _ in launched.scheduled:
                if not seq.is_finished:
                    self.block_manager.commit(seq)
            if self.args.async_scheduling:
                self._inflight = launched
            else:
                self._finish(launched, touched)
        outputs = []
        for req in touched.values():
            out = self._output(req)
            outputs.append(out)
            if out.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _can_overlap(self, prev: _Step) -> bool:
        """Whether step N+1 may be scheduled and launched before ``prev`` (step N) is finished.

        Not when a sequence going on needs its token of N on the host to sample N+1 (grammar, penalties,
        min_tokens), nor when the schedule would preempt. A sequence that may stop on its token of N
        (stop or end-of-sequence tokens, stop strings) is scheduled and its row discarded if it did stop.
        The extra row moves the other rows' arithmetic unless the engine is batch-invariant, and the rest
        of the schedule must not depend on it (``Scheduler.running_fits``, strict): otherwise N is
        finished first.
        """
        live = [s for s in prev.sampled if s.finish_reason is None]
        leaving = {s.seq_id for s in live if self._out_of_room(s)}
        going = [s for s in live if s.seq_id not in leaving]
        if any(s.grammar is not None or s.params.has_penalties or len(s.output_token_ids) < s.params.min_tokens
               for s in going):
            return False
        may_stop = any(self._may_stop(s) for s in going)
        if may_stop and not self.batch_invariant:
            return False
        return self.scheduler.running_fits(leaving, strict=may_stop)

    def _may_stop(self, seq: Sequence) -> bool:
        """Whether the token being sampled could end ``seq`` through its value."""
        p = seq.params
        return bool(p.stop_token_ids or (p.stop and self.tokenizer is not None)
                    or (not p.ignore_eos and self.model_config.eos_token_ids))

    def _out_of_room(self, seq: Sequence) -> bool:
        """Whether ``seq`` is at its length limit (its last output token counted, in flight or not)."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and len(seq.output_token_ids) >= max_tokens) or (
            len(seq) >= self.scheduler_config.max_model_len)

    def _run(self, scheduled: list[tuple[Sequence, int]], prev: _Step | None) -> _Step:
        """Launch a step; its sampled tokens become placeholders until ``_finish``."""
        spans, ids, rows, to_sample, fill = [], [], [], [], []
        src = {seq.seq_id: i for i, seq in enumerate(prev.sampled)} if prev is not None else {}
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            if seq.pending_restore is not None:
                self.cache.restore_boundary(seq.pending_restore, seq.state_slot, start)
                seq.pending_restore = None
            spans.append(SeqSpan(start, num_new, seq.block_table, seq.window_block_table, seq.state_slot,
                                 seq.write_from))
            ids.extend(seq.token_slice(start, start + num_new))
            if seq.num_inflight:  # its last token is prev's sample, still on the device
                fill.append((len(ids) - 1, src[seq.seq_id]))
            if start + num_new == len(seq):
                rows.append(len(ids) - 1)
                to_sample.append(seq)
        batch = self.runner.prepare(ids, spans, rows)
        if fill:
            where = torch.tensor(fill, dtype=torch.long).to(self.device, non_blocking=True)
            batch.input_ids[where[:, 0]] = prev.tokens[where[:, 1]]
        logits = self.runner.execute(batch)  # may be a graph's output buffer: sampled before the next execute
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new
        out = self.sampler(logits, to_sample) if to_sample else None
        positions = []
        for seq in to_sample:
            positions.append(len(seq.output_token_ids))
            seq.output_token_ids.append(PLACEHOLDER)
            seq.num_inflight += 1
        if out is None:
            return _Step(scheduled, [], [], None, None)
        return _Step(scheduled, to_sample, positions, out.sampled_token_ids, out.to_host())

    def _finish(self, launched: _Step, touched: dict[str, _Request]) -> None:
        """Post-process a launched step: put its tokens in place of the placeholders, check stops."""
        if launched.host is None:
            return
        tokens, logprobs = launched.host.tolists(launched.sampled)
        for seq, pos, token, lp in zip(launched.sampled, launched.positions, tokens, logprobs):
            if seq.finish_reason is not None:  # finished or aborted after the launch: its sample is dropped
                continue
            seq.output_token_ids[pos] = token
            seq.num_inflight -= 1
            touched[seq.request_id] = self.requests[seq.request_id]
            self._append(seq, pos, token, lp)

    def _append(self, seq: Sequence, pos: int, token: int, logprobs: dict[int, float] | None) -> None:
        """Stop checks and text for ``seq``'s output token ``pos`` (already in place); a finished
        sequence loses anything sampled after it."""
        params = seq.params
        if seq.grammar is not None and not seq.grammar.accept(token):  # the request ends, the batch goes on
            seq.finish_reason, seq.stop_reason = "error", seq.grammar.rejection_message(token)
            self._end(seq, pos)
            self._detokenize(seq, pos, check_stop=False, last=True)
            return
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        n_out = pos + 1
        may_stop = n_out >= params.min_tokens
        if may_stop and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif may_stop and not params.ignore_eos and token in self.model_config.eos_token_ids:
            seq.finish_reason = "stop"
        elif seq.grammar is not None and seq.grammar.is_terminated:
            seq.finish_reason = "stop"  # the grammar is complete (it accepted an end-of-sequence token)
        out_of_room = (params.max_tokens is not None and n_out >= params.max_tokens) or (
            len(seq.prompt_token_ids) + n_out >= self.scheduler_config.max_model_len)
        # a stop string ending in this token still wins over the length limit
        num_shown = pos if seq.finish_reason == "stop" else n_out
        self._detokenize(seq, num_shown, check_stop=may_stop, last=out_of_room or seq.finish_reason is not None)
        if seq.finish_reason is None and out_of_room:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._end(seq, n_out)

    def _end(self, seq: Sequence, num_outputs: int) -> None:
        """Finish ``seq`` keeping its first ``num_outputs`` output tokens (in-flight ones are dropped)."""
        del seq.output_token_ids[num_outputs:]
        seq.num_inflight = 0
        self.scheduler.finish(seq)

    def _detokenize(self, seq: Sequence, num_ids: int, check_stop: bool, last: bool) -> None:
        """Text of the first ``num_ids`` output tokens; a stop token is not shown, nor anything from a stop
        string on.

        Until the last token, text ending in an incomplete UTF-8 character (shown as U+FFFD) is held
        back, so every text a stream reports is a prefix of the final one.
        """
        if self.tokenizer is None:
            return
        text = seq.detokenizer.update(self.tokenizer, seq.output_token_ids, num_ids, seq.params.skip_special_tokens,
                                      last)
        if text is None:
            return
        if check_stop and seq.finish_reason is None:
            # only a stop string that ends in text new since the last update counts: one completed
            # while min_tokens held stops back was passed over then and must not cut the text now
            prev = len(seq.text)
            for stop in seq.params.stop:
                cut = text.find(stop, max(0, prev - len(stop) + 1))
                if cut >= 0:
                    text = text[:cut]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    break
        seq.text = text

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            cum, ids = None, seq.completed_output_ids
            if seq.output_logprobs:
                cum = sum(lp[t] for lp, t in zip(seq.output_logprobs, ids))
            outs.append(CompletionOutput(
                seq.index, seq.text, ids, seq.finish_reason, seq.stop_reason,
                list(seq.output_logprobs) if seq.params.logprobs is not None else None, cum,
            ))
        finished = all(s.status == SequenceStatus.FINISHED for s in req.seqs)
        error = next((str(s.stop_reason) for s in req.seqs if s.finish_reason == "error"), None)
        cached = req.seqs[0].num_cached_tokens
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, cached, error)
