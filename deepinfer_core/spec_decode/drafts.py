"""DraftPlanner: the engine's side of speculative decoding.

Before scheduling it gives every decoding sequence a ``draft_budget`` (all usable drafts, or the
confidence scheduler's choice); after a step it takes each sequence's accepted tokens (the accepted
drafts become computed tokens, the blocks only the rejected ones needed are released, so block hashes
and memory only ever cover accepted tokens) and keeps the drafts proposed for its next step.
"""

from __future__ import annotations

import itertools
from typing import Any

from deepinfer_core.config import ModelConfig, ParallelConfig, SchedulerConfig
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.sequence import PLACEHOLDER, Sequence
from deepinfer_core.model.cache_layout import cache_layout
from deepinfer_core.spec_decode.confidence import Candidate, ConfidenceScheduler, StepProfile
from deepinfer_core.spec_decode.config import SpeculativeConfig, max_speculative_tokens
from deepinfer_core.spec_decode.gate import SpeculationGate, step_begin
from deepinfer_core.spec_decode.metrics import SpecDecodeStats


class DraftPlanner:
    def __init__(self, config: SpeculativeConfig, window: int = 0, gate: bool = True):
        self.config = config
        self.window = window  # the MTP block's sliding window: what a plain step leaves stale
        self.stats = SpecDecodeStats()
        self.confidence = ConfidenceScheduler() if config.schedule == "confidence" else None
        # confidence scheduling may also choose plain decode steps (no drafting at all) where those are faster
        self.gate = None
        if self.confidence is not None and gate:
            self.gate = SpeculationGate(max_tokens_per_step=1 + config.num_speculative_tokens)
        self.speculate = True  # whether the step being scheduled speculates
        self._step_finish: float | None = None  # when the last finished step's output was there

    @classmethod
    def create(cls, value: Any, cfg: ModelConfig, parallel: ParallelConfig) -> DraftPlanner | None:
        """The planner for ``speculative_config`` (None: no speculation); raises ValueError when the model
        or the engine cannot speculate as asked."""
        config = SpeculativeConfig.from_arg(value)
        if config is None:
            return None
        # a config may narrow its architecture's drafters to its checkpoint's (V4-Flash: mtp; 0731: dspark)
        methods = getattr(cfg, "drafter_methods", None) or cfg.architecture.drafters
        if config.method not in methods:
            drafters = sorted(methods) or "none"
            raise ValueError(f"speculative_config method {config.method!r} is not available for "
                             f"{cfg.architecture.name} (its drafters: {drafters})")
        if not getattr(cfg, "num_nextn_predict_layers", 0):
            raise ValueError(f"speculative_config method {config.method!r} needs a checkpoint with its drafter's "
                             f"layers (num_nextn_predict_layers >= 1, the mtp.* tensors)")
        if config.method == "dspark":
            block = getattr(cfg, "dspark_block_size", 0)
            if not block:
                raise ValueError("speculative_config method 'dspark' needs dspark_block_size in the checkpoint's "
                                 "config")
            if config.num_speculative_tokens > block:
                raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} is more than the DSpark "
                                 f"block of this checkpoint drafts ({block})")
        rows = [b.rows for b in cache_layout(cfg).branch_pools if b.stateful]
        cap = max_speculative_tokens(rows)
        if cap is not None and config.num_speculative_tokens > cap:
            raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} is more than this model "
                             f"allows ({cap}: a verification must fit its smallest compressor ring of "
                             f"{cap + 1} rows)")
        # expert-parallel ranks meet in every MoE layer's collectives: each step of each rank speculates
        return cls(config, window=cfg.sliding_window or 0, gate=parallel.expert_parallel_size == 1)

    # --- before scheduling -----------------------------------------------------------------------

    @staticmethod
    def room(seq: Sequence, max_model_len: int) -> int:
        """Drafts a verification of ``seq`` may hold: none before ``min_tokens`` (the masks of EOS and stop
        tokens are the plain sampler's), and never past ``max_tokens`` or ``max_model_len``. With a step in
        flight (async scheduling) its accepted drafts are not known yet: the room for ``max_tokens`` is
        the one if it accepts none (the worker, which knows, drops drafts past the limit), and for
        ``max_model_len`` the one if it accepts all. A grammar request's drafts end before the first one
        its grammar rejects: that row's mask would reject it."""
        p = seq.params
        if seq.num_uncomputed != 1 or len(seq.output_token_ids) < p.min_tokens:
            return 0
        room = len(seq.draft_token_ids)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(seq.output_token_ids) - 1)
        room = max(0, min(room, max_model_len - len(seq) - seq.num_unresolved_drafts - 1))
        if room and seq.grammar is not None:  # none the grammar rejects (no step of it is ever in flight)
            room = seq.grammar.valid_prefix(seq.draft_token_ids[:room])
        return room

    def decide(self, scheduler: Any) -> bool:
        """Whether the next step speculates (the gate's choice for its decoding sequences; always
        without a gate)."""
        if self.gate is not None:
            running = scheduler.running
            decoding = sum(seq.num_uncomputed == 1 for seq in running)
            room = scheduler.config.max_num_seqs - len(running)
            admits = scheduler.waiting and room > 0  # a prompt may join
            decode_only = decoding == len(running) and not admits
            # a step with prefill chunks takes the mode of the batch its sequences will decode in
            after = len(running) + (min(len(scheduler.waiting), room) if admits else 0)
            self.speculate = self.gate.decide(decoding if decode_only else after, decode_only)
        return self.speculate

    def plan(self, scheduler: Any, config: SchedulerConfig) -> None:
        if not self.speculate:  # a plain step, and no stale drafts for the first speculative one after it
            for seq in scheduler.running:
                seq.draft_budget = 0
                seq.mtp_stale_until = len(seq) + self.window
                if not seq.num_inflight:
                    seq.draft_token_ids, seq.draft_confidences = [], []
            return
        running = scheduler.running
        rooms = [self.room(seq, config.max_model_len) for seq in running]
        if self.confidence is None:
            for seq, room in zip(running, rooms):
                seq.draft_budget = room
            return
        uncomputed = [seq.num_uncomputed for seq in running]
        room = max(0, config.max_num_seqs - len(running))  # requests queued behind a full batch wait
        base = sum(uncomputed) + sum(seq.num_uncomputed for seq in itertools.islice(scheduler.waiting, room))
        base = min(base, config.max_num_batched_tokens)
        decoding = [(seq, room) for seq, room, n in zip(running, rooms, uncomputed) if n == 1]
        decode_only = base == len(decoding)  # no prefill chunk: a step of a graph's shape
        if decode_only:
            span = self.confidence.best_span([seq.draft_confidences for seq, _ in decoding],
                                             [room for _, room in decoding], config.max_num_batched_tokens)
            if span is not None:
                for seq, room in zip(running, rooms):
                    seq.draft_budget = min(room, len(seq.draft_confidences), span)
                return
        candidates = [Candidate(seq.seq_id, seq.draft_confidences, room) for seq, room in decoding if room]
        budget = self.confidence.plan(candidates, base, len(decoding), config.max_num_batched_tokens,
                                      num_seqs=len(decoding) if decode_only else None, batch=len(decoding))
        for seq in running:
            seq.draft_budget = budget.get(seq.seq_id, 0)

    def use_profile(self, profile: StepProfile | None) -> None:
        """The workers' timing of their decode graphs: what the confidence scheduler prices decode steps by."""
        if self.confidence is not None and profile is not None and profile.seconds:
            self.confidence.profile = profile

    # --- after a step ----------------------------------------------------------------------------

    def observe_step(self, num_tokens: int, started: float, now: float, speculated: bool = True,
                     pipelined: bool = False, num_seqs: int | None = None) -> None:
        """A step of ``num_tokens`` (``num_seqs`` sampled sequences) launched at ``started`` has its output
        at ``now``. Where a later step was
        launched before it finished (``pipelined``), its time runs from the later of its launch and the
        previous step's output: while that one ran, this one only waited. The last step of a pipeline is
        not timed (see :func:`~deepinfer_core.spec_decode.gate.step_begin`)."""
        begin = step_begin(started, self._step_finish, pipelined)
        self._step_finish = now
        # the verification cost curve is a speculative step's
        if self.confidence is not None and speculated and begin is not None:
            self.confidence.observe_step(num_tokens, now - begin, num_seqs)

    def observe_output(self, speculated: bool, num_decoding: int | None, num_tokens: int, started: float,
                       now: float, seqs: list[Sequence] = (), pipelined: bool = True,
                       num_going_on: int | None = None) -> None:
        """A finished step's output tokens for the gate; ``num_decoding`` None: not an all-decode step;
        ``seqs``: its sequences (a speculative step is fresh when none drafted from rows a plain step left);
        ``pipelined``: a later step was launched before it finished; ``num_going_on``: the sequences the
        step did not finish, whose tokens ``num_tokens`` counts (default: all of them)."""
        if self.gate is None:
            return
        if num_decoding is None:
            self.gate.interrupt()
        else:
            fresh = not speculated or all(len(seq) >= seq.mtp_stale_until for seq in seqs)
            self.gate.observe(speculated, num_decoding, num_tokens, started, now, fresh=fresh, pipelined=pipelined,
                              num_yielding=num_going_on)

    def accept(self, seq: Sequence, pos: int, tokens: list[int], block_manager: BlockManager,
               verified: int | None = None, reserved: int = 0) -> None:
        """``tokens``: the step's new tokens of ``seq``, whose first is already at output index ``pos``;
        ``verified``: the drafts the step verified (``seq.num_scheduled_drafts`` unless a later step,
        launched before this one ended, has been scheduled since); ``reserved``: the drafts memory was
        taken for (more when the worker dropped some past ``max_tokens``). With a later step in flight its
        placeholder stays after the new tokens and the memory its drafts write is kept."""
        if verified is None:
            verified = seq.num_scheduled_drafts
        if seq.spec_stats is None:
            seq.spec_stats = SpecDecodeStats()
        if not verified:
            if seq.num_inflight or reserved:  # memory taken for drafts that were not verified
                block_manager.release_tail(seq, seq.num_unresolved_drafts)
            return
        accepted = len(tokens) - 1
        for stats in (self.stats, seq.spec_stats):
            stats.observe(verified, accepted)
        if self.confidence is not None:
            self.confidence.observe_verification(seq.draft_confidences[:verified], accepted)
        seq.num_computed_tokens += accepted
        # hash the blocks the accepted tokens completed before a stop among them may end the sequence
        seq.output_token_ids[pos + 1:pos + 1] = tokens[1:]
        block_manager.commit(seq)
        block_manager.release_tail(seq, seq.num_unresolved_drafts)
        del seq.output_token_ids[pos + 1:pos + len(tokens)]

    def launched(self, seq: Sequence) -> None:
        """``seq`` sampled in a speculative step just launched, which will propose drafts for it. Where it
        has none yet (the step ends its prompt, or follows plain steps) a step scheduled before this one ends
        may verify them already: placeholders stand for them, as ``offer`` leaves for later steps."""
        if not seq.draft_token_ids:
            seq.draft_token_ids = [PLACEHOLDER] * self.config.num_speculative_tokens
            seq.draft_confidences = []

    def offer(self, seq: Sequence, drafts: list[int], confidences: list[float]) -> None:
        """The drafts proposed for ``seq``'s next step. When that step is already in flight (async
        scheduling) they are on their way already, and a step scheduled before it ends verifies the
        drafts it proposes, known to the workers only: the host keeps placeholders, and the confidences
        of these drafts plan the budget of that step."""
        seq.draft_token_ids, seq.draft_confidences = list(drafts), list(confidences)
        if seq.num_inflight:
            seq.draft_token_ids = [PLACEHOLDER] * len(drafts)
        seq.num_scheduled_drafts = 0
        self.stats.num_proposed_tokens += len(drafts)
        if seq.spec_stats is not None:
            seq.spec_stats.num_proposed_tokens += len(drafts)

    def request_stats(self, seqs: list[Sequence]) -> dict:
        total = SpecDecodeStats()
        for seq in seqs:
            if seq.spec_stats is not None:
                total.add(seq.spec_stats)
        return total.as_dict()
