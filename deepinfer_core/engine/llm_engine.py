"""LLMEngine: requests, scheduling and outputs. Each step the scheduler's output goes to the executor,
whose workers run the model; the engine post-processes what comes back (stops, text, outputs).

One process's engine; :func:`~deepinfer_core.engine.factory.make_engine` builds the data-parallel
front-end instead where the arguments ask for several ranks (it runs an LLMEngine in every rank)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig, structured_outputs_config_of
from deepinfer_core.engine.args import EngineArgs, parallel_config_of
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.detokenizer import fast_decoder
from deepinfer_core.engine.processor import InputProcessor, Request
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.scheduler_output import SchedulerOutput
from deepinfer_core.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from deepinfer_core.engine.stop import FinishStatus, check_stop
from deepinfer_core.model.cache import check_block_size
from deepinfer_core.model.replay import replay_keep_of, resolve_bounded_replay
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.plugins import load_backend
from deepinfer_core.sampling.params import RequestOutputKind, SamplingParams
from deepinfer_core.sampling.structured import StructuredOutputManager
from deepinfer_core.spec_decode.config import SpeculativeConfig
from deepinfer_core.spec_decode.drafts import DraftPlanner
from deepinfer_core.worker.executor import Executor, UniProcExecutor
from deepinfer_core.worker.outputs import AsyncModelRunnerOutput

logger = logging.getLogger(__name__)
BATCH_INVARIANT_ENV = "DEEPINFER_BATCH_INVARIANT"


@dataclass
class _Step:
    """A launched step: what it computed, whom it sampled, and at which output index each sample goes."""

    scheduled: list[tuple[Sequence, int]]
    sampled: list[Sequence]
    positions: list[int]
    output: AsyncModelRunnerOutput | None  # the samples on their way to the host
    num_tokens: int = 0  # tokens the step computed
    started: float = 0.0  # when it was launched (perf_counter)
    num_drafts: list[int] | None = None  # speculative decoding: drafts verified per sampled sequence
    speculate: bool = True  # speculative decoding: whether the step drafts (a plain step does not)

    @property
    def decode_only(self) -> bool:
        """Every sequence decodes (its token and drafts): no prefill chunk, a graph's shape."""
        return len(self.scheduled) == len(self.sampled) and (
            self.num_tokens == len(self.sampled) + sum(self.num_drafts or []))


class LLMEngine:
    def __init__(self, args: EngineArgs, executor_class: type[Executor] = UniProcExecutor):
        from deepinfer_core.default_model import default_model_path

        self.args = args
        path = Path(args.model) if args.model is not None else default_model_path()
        self.model_config = cfg = ModelConfig.from_pretrained(path)
        backend = load_backend(args.backend)
        max_len = args.max_model_len or int(cfg.max_position_embeddings)  # capped below by the pools
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(args, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len, enable_chunked_prefill=args.enable_chunked_prefill)
        if resolve_bounded_replay(getattr(args, "bounded_replay", None), cfg) is not None:
            self.scheduler_config.replay_keep = replay_keep_of(cfg, SpeculativeConfig.from_arg(args.speculative_config))
        self.cache_config = CacheConfig(
            block_size=args.block_size, num_blocks=args.num_blocks, num_window_blocks=args.num_window_blocks,
            cpu_kv_cache_bytes=args.kv_cache_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching)
        self.parallel_config = parallel_config_of(args)
        self.structured_outputs_config = structured_outputs_config_of(args.structured_outputs_config)
        self.drafts = DraftPlanner.create(args.speculative_config, cfg, self.parallel_config)
        self._async = bool(args.async_scheduling)
        backend.hook.deepinfer_configure(model_config=cfg, cache_config=self.cache_config)
        check_block_size(cfg, self.cache_config.block_size)  # a plugin may have changed it
        env = os.environ.get(BATCH_INVARIANT_ENV, "").strip().lower()
        self.batch_invariant = bool(args.batch_invariant) or env in ("1", "true", "yes", "on")
        from deepinfer_core.tokenizer import get_tokenizer

        # before the weights: a broken tokenizer file fails at once, not after the load
        self.tokenizer = get_tokenizer(path)
        self.decoder = fast_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.executor = executor_class(args, backend, cfg, path, self.scheduler_config, self.cache_config,
                                       self.parallel_config, batch_invariant=self.batch_invariant)
        if self.drafts is not None:
            self.drafts.use_profile(getattr(self.executor, "step_profile", None))
        sizes = self.pool_sizes = self.executor.pool_sizes
        self._fit_max_model_len(sizes.num_blocks * self.cache_config.block_size)
        self.block_manager = BlockManager(
            sizes.num_blocks, sizes.num_window_blocks, sizes.num_state_slots, self.cache_config.block_size,
            cfg.sliding_window,
            enable_prefix_caching=args.enable_prefix_caching, max_replay_tokens=args.max_replay_tokens,
            cache_salt=f"{path.resolve()}|{self.dtype}",
        )
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, drafting=self.drafts is not None)
        self.structured = StructuredOutputManager(
            self.tokenizer, cfg.vocab_size, cfg.eos_token_ids,
            disable_any_whitespace=self.structured_outputs_config.disable_any_whitespace)
        self.processor = InputProcessor(cfg, self.scheduler_config, self.tokenizer, self.structured, args.seed)
        self.requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self._inflight: _Step | None = None  # async scheduling: the launched step not yet finished

    def _fit_max_model_len(self, capacity: int) -> None:
        """Without an explicit ``max_model_len`` the checkpoint's ``max_position_embeddings`` is the default,
        capped by the tokens the compressed pool the memory plan sized holds for one sequence (``capacity``)."""
        sched = self.scheduler_config
        if sched.max_model_len <= capacity or self.cache_config.num_blocks is not None:
            return  # explicit pool sizes: a sequence that outgrows them ends with an error of its own
        if self.args.max_model_len is None:
            logger.info("max_model_len %d (the checkpoint's max_position_embeddings) capped to %d, what the KV "
                        "pools hold for one sequence; a larger KV budget (gpu_memory_utilization, "
                        "kv_cache_bytes) holds more", sched.max_model_len, capacity)
            sched.max_model_len = capacity
        else:
            logger.warning("max_model_len %d is more than the KV pools hold for one sequence (%d tokens); "
                           "longer sequences are preempted or fail", sched.max_model_len, capacity)

    # --- the in-process worker (single-process executor only) -------------------------------------

    @property
    def _worker(self) -> Any:
        return self.executor.driver_worker

    @property
    def model(self) -> Any:
        return self._worker.model

    @property
    def cache(self) -> Any:
        return self._worker.cache

    @property
    def runner(self) -> Any:
        return self._worker.model_runner

    @property
    def sampler(self) -> Any:
        return self._worker.model_runner.sampler

    @property
    def device(self) -> torch.device:
        return self._worker.device

    @property
    def dtype(self) -> torch.dtype:
        return self._worker.dtype

    @property
    def platform(self) -> Any:
        return self._worker.platform

    # --- requests --------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return self.processor.encode(prompt)

    def add_request(self, request_id: str | None, prompt: str | dict | list[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) when the request is invalid."""
        params = params or SamplingParams()
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.requests[request_id] = self.processor.process(request_id, prompt, params)
        for seq in req.seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishStatus.ABORTED
                self._end(seq, len(seq.completed_output_ids))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no running request holds (and the hit statistics)."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.stats = dict.fromkeys(self.block_manager.stats, 0)

    def prefix_cache_stats(self) -> dict[str, float]:
        """Engine-wide: queries, prompt tokens looked up, tokens served from cache, tokens replayed, hit rate."""
        stats = dict(self.block_manager.stats)
        stats["hit_rate"] = stats["hit_tokens"] / stats["query_tokens"] if stats["query_tokens"] else 0.0
        return stats

    def spec_decode_stats(self) -> dict | None:
        """Engine-wide speculative decoding counters (None without speculation)."""
        if self.drafts is None:
            return None
        stats = self.drafts.stats.as_dict()
        if self.drafts.gate is not None:
            stats["gate"] = self.drafts.gate.as_dict()
        return stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step --------------------------------------------------------------------------------
    #
    # A step is launched (``_run``: the scheduler output goes to the executor, whose workers batch, run
    # and sample; the sampled tokens start for the host) and finished (``_finish``: tokens put in place,
    # stop checks, text). Synchronously the two follow each other. With async scheduling step N stays
    # in flight: the next call schedules and launches N+1 (a sequence whose token of N is still on the
    # device is scheduled with a placeholder that the worker fills in) and then finishes N.
    # ``_can_overlap`` falls back to finishing N first whenever launching N+1 early could change what
    # N+1 computes for any sequence.
    #
    # With speculative decoding the host does not know, while N is in flight, how many of a sequence's
    # drafts N accepts, nor the drafts N proposes. N+1 is then scheduled optimistically: the sequence's
    # span is its token of N and up to k drafts, all placeholders, at the position it would have if N
    # accepted nothing; memory is taken as if N accepted everything (``Sequence.num_unresolved_drafts``)
    # and the draft budget plans from the confidences of the drafts N verified. The worker, which has
    # N's result when N+1 reaches it, shifts the span by N's accepted drafts and fills in its tokens and
    # drafts. When N ends, its accepted drafts go in before N+1's placeholder and the blocks past what
    # N+1 writes are released. An exception while launching or finishing a step fails that step's
    # sequences (finish reason "error") and nothing else.

    def step(self) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        prev, self._inflight = self._inflight, None
        if self.drafts is not None:
            self.drafts.decide(self.scheduler)
        planned = prev is not None and self.drafts is not None
        if planned:  # the draft budgets N+1 would verify
            self.drafts.plan(self.scheduler, self.scheduler_config)
        if prev is not None and not self._can_overlap(prev):
            self._finish_or_fail(prev, touched)
            prev, planned = None, False
        if prev is not None:  # a sequence whose in-flight token is its last leaves now, as it would have
            for seq in prev.sampled:
                if seq.finish_reason is None and self._out_of_room(seq):
                    self.scheduler.finish(seq)
                    planned = False  # the budgets were planned with it among the candidates
        preemptions = self.scheduler.num_preemptions
        if self.drafts is not None and not planned:
            self.drafts.plan(self.scheduler, self.scheduler_config)
        so = self.scheduler.schedule(speculate=self.drafts is None or self.drafts.speculate)
        assert prev is None or (self.scheduler.num_preemptions == preemptions and not so.unfittable)
        for seq in so.unfittable:  # already finished by the scheduler, which put the reason in stop_reason
            seq.finish_reason = FinishStatus.ERROR
            touched[seq.request_id] = self.requests[seq.request_id]
        launched = None
        if so.scheduled_seqs:
            try:
                launched = self._run(so, prev)
            except Exception as exc:
                self._fail([seq for seq, _ in so.scheduled_seqs], exc, touched)
        if prev is not None:
            # prev's output is read after the next step's launch; where that one has prefill chunks its eager
            # launch would count as prev's time, so prev ends a pipeline for the gate and the step-time curve
            self._finish_or_fail(prev, touched, pipelined=launched is not None and launched.decode_only)
        if launched is not None:
            for seq, _ in launched.scheduled:
                if not seq.is_finished:
                    self.block_manager.commit(seq)
            if self._async:
                self._inflight = launched
            else:
                self._finish_or_fail(launched, touched)
        outputs = []
        for req in touched.values():
            if (req.seqs[0].params.output_kind is RequestOutputKind.FINAL_ONLY
                    and any(s.status != SequenceStatus.FINISHED for s in req.seqs)):
                continue
            out = self._output(req)
            outputs.append(out)
            if out.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _can_overlap(self, prev: _Step) -> bool:
        """Whether step N+1 may be scheduled and launched before ``prev`` (step N) is finished.

        Not when a sequence going on needs its token of N on the host to sample N+1 (grammar, min_tokens;
        penalties count N's tokens on the device), nor when the schedule would preempt. A sequence that may
        stop on its token of N (stop or end-of-sequence tokens, stop strings) is scheduled and its row
        discarded if it did stop.
        The extra row moves the other rows' arithmetic unless the engine is batch-invariant, and the rest
        of the schedule must not depend on it (``Scheduler.running_fits``, strict): otherwise N is
        finished first.
        """
        if self.drafts is not None and prev.speculate != self.drafts.speculate:
            return False  # N+1's placeholders would be of the other kind of step
        live = [s for s in prev.sampled if s.finish_reason is None]
        leaving = {s.seq_id for s in live if self._out_of_room(s)}
        going = [s for s in live if s.seq_id not in leaving]
        if any(s.grammar is not None or len(s.output_token_ids) < s.params.min_tokens for s in going):
            return False
        limit = self.scheduler_config.max_model_len  # positions past it may not be computed, even dropped
        if any(len(s) + s.num_unresolved_drafts >= limit for s in going if s.num_unresolved_drafts):
            return False
        may_stop = any(self._may_stop(s) or self._may_run_out(s) for s in going)
        # with speculation the rows around a sequence already change with what was accepted: its outputs
        # are equal to those without speculation to rounding, so an extra row for a stopping one is fine
        if may_stop and not (self.batch_invariant or self.drafts is not None):
            return False
        return self.scheduler.running_fits(leaving, strict=may_stop)

    def _may_run_out(self, seq: Sequence) -> bool:
        """Whether ``seq`` reaches ``max_tokens`` should its step in flight accept enough drafts."""
        unresolved, max_tokens = seq.num_unresolved_drafts, seq.params.max_tokens
        return bool(unresolved) and max_tokens is not None and len(seq.output_token_ids) + unresolved >= max_tokens

    def _may_stop(self, seq: Sequence) -> bool:
        """Whether the token being sampled could end ``seq`` through its value."""
        p = seq.params
        return bool(p.stop_token_ids or (p.stop and self.tokenizer is not None)
                    or (not p.ignore_eos and seq.eos_token_ids))

    def _out_of_room(self, seq: Sequence) -> bool:
        """Whether ``seq`` is at its length limit (its last output token counted, in flight or not)."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and len(seq.output_token_ids) >= max_tokens) or (
            len(seq) >= self.scheduler_config.max_model_len)

    def _grammar_bitmask(self, to_sample: list[Sequence]) -> torch.Tensor | None:
        """The allowed tokens of every sampled row (after each draft before it), where a grammar constrains."""
        grammars = [seq.grammar for seq in to_sample]
        if all(g is None for g in grammars):
            return None
        return self.structured.bitmask(grammars, [seq.draft_token_ids[: seq.num_scheduled_drafts] for seq in to_sample])

    def _run(self, so: SchedulerOutput, prev: _Step | None = None) -> _Step:
        """Launch a step; its sampled tokens become placeholders until ``_finish``."""
        scheduled, to_sample = so.scheduled_seqs, so.sampled_seqs
        so.grammar_bitmask = self._grammar_bitmask(to_sample)
        started = time.perf_counter()
        output = self.executor.execute_model(so)
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new - seq.num_scheduled_drafts  # drafts count once accepted
        positions, num_drafts = [], []
        for seq in to_sample:
            positions.append(len(seq.output_token_ids))
            num_drafts.append(seq.num_scheduled_drafts)
            seq.inflight_drafts = seq.num_scheduled_drafts
            seq.output_token_ids.append(PLACEHOLDER)
            seq.num_inflight += 1
            if self._async and so.speculate and self.drafts is not None:
                self.drafts.launched(seq)
        return _Step(scheduled, to_sample, positions, output if to_sample else None,
                     sum(n for _, n in scheduled), started, num_drafts, so.speculate)

    def _finish_or_fail(self, launched: _Step, touched: dict[str, Request], pipelined: bool = False) -> None:
        try:
            self._finish(launched, touched, pipelined)
        except Exception as exc:
            self._fail(launched.sampled, exc, touched)

    def _finish(self, launched: _Step, touched: dict[str, Request], pipelined: bool = False) -> None:
        """Post-process a launched step: put its tokens in place of the placeholders, check stops;
        ``pipelined``: a later step of decodes only was launched before it finished (see ``step``)."""
        if launched.output is None:
            return
        out = launched.output.get_output()
        emitted = going_on = 0  # output tokens of the sequences not finished by the step, and those sequences
        if self.drafts is not None:
            self.drafts.observe_step(launched.num_tokens, launched.started, time.perf_counter(), launched.speculate,
                                     pipelined, len(launched.sampled))
        for i, (seq, pos) in enumerate(zip(launched.sampled, launched.positions)):
            if seq.finish_reason is not None:  # finished or aborted after the launch: its sample is dropped
                continue
            if self.drafts is not None:  # an earlier step may have put accepted drafts before it since
                pos = len(seq.output_token_ids) - seq.num_inflight
            token = out.sampled_token_ids[i]
            seq.output_token_ids[pos] = token
            seq.num_inflight -= 1
            if out.dead_ends is not None and seq.grammar is not None:
                seq.grammar.dead_end = out.dead_ends[i]
            touched[seq.request_id] = self.requests[seq.request_id]
            if out.new_token_ids is None:
                self._append(seq, pos, token, out.logprobs[i])
                going_on += seq.finish_reason is None
                emitted += seq.finish_reason is None
                continue
            tokens, verified = out.new_token_ids[i], launched.num_drafts[i]
            if seq.params.max_tokens is not None:  # the worker dropped drafts past it (see ``DraftPlanner.room``)
                verified = max(0, min(verified, seq.params.max_tokens - pos - 1))
            self.drafts.accept(seq, pos, tokens, self.block_manager, verified, launched.num_drafts[i])
            for j, token in enumerate(tokens):
                if j:  # before the placeholder of a later step in flight, if there is one
                    seq.output_token_ids.insert(pos + j, token)
                self._append(seq, pos + j, token, out.new_logprobs[i][j] if out.new_logprobs[i] else None)
                if seq.finish_reason is not None:
                    break
            else:
                self.drafts.offer(seq, out.draft_token_ids[i], out.draft_confidences[i])
                emitted += len(tokens)
                going_on += 1
        if self.drafts is not None:
            decode = launched.decode_only
            self.drafts.observe_output(launched.speculate, len(launched.sampled) if decode else None, emitted,
                                       launched.started, time.perf_counter(), launched.sampled, pipelined, going_on)

    def _fail(self, seqs: list[Sequence], exc: Exception, touched: dict[str, Request]) -> None:
        """End ``seqs`` with an error after an exception in their step; the other requests go on."""
        logger.error("a step failed; its %d sequence(s) end with an error: %s: %s", len(seqs),
                     type(exc).__name__, exc, exc_info=exc)
        for seq in seqs:
            if seq.finish_reason is not None:
                continue
            seq.finish_reason, seq.stop_reason = FinishStatus.ERROR, f"the step failed: {type(exc).__name__}: {exc}"
            self._end(seq, len(seq.completed_output_ids))
            if seq.request_id in self.requests:
                touched[seq.request_id] = self.requests[seq.request_id]

    def _append(self, seq: Sequence, pos: int, token: int, logprobs: dict[int, float] | None) -> None:
        """Stop checks and text for ``seq``'s output token ``pos`` (already in place); a finished
        sequence loses anything sampled after it."""
        params = seq.params
        if seq.grammar is not None and not seq.grammar.accept(token):  # the request ends, the batch goes on
            seq.finish_reason, seq.stop_reason = FinishStatus.ERROR, seq.grammar.rejection_message(token)
            self._end(seq, pos)
            self._detokenize(seq, pos, last=True)
            return
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        n_out = pos + 1
        status, reason = check_stop(seq, self.scheduler_config.max_model_len) or (None, None)
        if status is None and not params.stop and params.output_kind is RequestOutputKind.FINAL_ONLY:
            seq.text_pending = True  # no stop string to look for and no output before the end: decoded then
            return
        stopped = status == FinishStatus.STOPPED
        # a stop string ending in this token still wins over the length limit; a stop token is not shown
        strings = params.stop if n_out >= params.min_tokens and not stopped else ()
        matched = self._detokenize(seq, pos if stopped else n_out, last=status is not None, stop=strings)
        if matched is not None:
            status, reason = FinishStatus.STOPPED, matched
        if status is not None:
            seq.finish_reason, seq.stop_reason = status, reason
            self._end(seq, n_out)

    def _end(self, seq: Sequence, num_outputs: int) -> None:
        """Finish ``seq`` keeping its first ``num_outputs`` output tokens (in-flight ones are dropped)."""
        del seq.output_token_ids[num_outputs:]
        seq.num_inflight = 0
        self.scheduler.finish(seq)
        self.scheduler.retire(seq)

    def _detokenize(self, seq: Sequence, num_ids: int, last: bool, stop: tuple[str, ...] | list[str] = ()
                    ) -> str | None:
        """Text of the first ``num_ids`` output tokens (a stop token is not shown, nor anything from a stop
        string on); returns the stop string that ended it, if one did.

        Until the last token, text ending in an incomplete UTF-8 character (shown as U+FFFD) is held
        back, so every text a stream reports is a prefix of the final one.
        """
        if self.tokenizer is None:
            return None
        seq.text_pending = False
        return seq.detokenizer.advance(self.decoder, seq.output_token_ids, num_ids,
                                       seq.params.skip_special_tokens, last, stop)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        finished = all(s.status == SequenceStatus.FINISHED for s in req.seqs)
        for seq in req.seqs:
            cum, ids = None, seq.completed_output_ids
            if seq.text_pending and finished:  # ended without its last token's decode (an error, say)
                self._detokenize(seq, len(ids), last=True)
            if seq.output_logprobs:
                cum = sum(lp[t] for lp, t in zip(seq.output_logprobs, ids))
            text = seq.detokenizer.get_next_output_text(seq.is_finished, seq.params.stop)
            outs.append(CompletionOutput(
                seq.index, text, ids, seq.finish_reason, seq.stop_reason,
                list(seq.output_logprobs) if seq.params.logprobs is not None else None, cum,
            ))
        error = next((str(s.stop_reason) for s in req.seqs if s.finish_reason == FinishStatus.ERROR), None)
        cached = req.seqs[0].num_cached_tokens
        spec = self.drafts.request_stats(req.seqs) if self.drafts is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, cached, error, spec)
