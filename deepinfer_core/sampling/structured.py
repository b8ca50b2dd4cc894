"""Structured output through xgrammar: grammars compiled when a request is added, masks every step.

* :meth:`StructuredOutputManager.compile` turns a request's
  :class:`~deepinfer_core.sampling.params.StructuredOutputsParams` into an xgrammar ``CompiledGrammar``
  in ``add_request`` (never inside a step), through a small LRU keyed by the constraint; a constraint
  that does not compile raises ``ValueError`` (and is remembered, so it is not compiled again), which
  fails that request only.
* JSON constraints allow free whitespace between tokens unless the request or the engine
  (``StructuredOutputsConfig.disable_any_whitespace``) disables it, as in vLLM: a model may otherwise
  spend ``max_tokens`` on newlines and never close the value.
* Each sequence gets its own :class:`GrammarState` (an xgrammar ``GrammarMatcher``). Before sampling,
  :meth:`StructuredOutputManager.bitmask` fills one int32 row of xgrammar's bitmask per sampled row
  (all ones for rows without a grammar); the sampler applies it with the backend op
  ``apply_token_bitmask``, so an accelerator can fuse it.
* The engine feeds every appended token to :meth:`GrammarState.accept`. A token the matcher rejects
  (which the mask makes possible only when no token at all was allowed, e.g. ``min_tokens`` banning
  the end-of-sequence token the grammar requires) ends that request with ``finish_reason="error"``;
  a matcher that terminates (it accepted the end-of-sequence token after a complete match) ends it
  with ``"stop"``.
* Preemption recomputes a sequence's KV from the tokens it keeps and samples only the *next* token,
  so the matcher, which has accepted exactly the kept output tokens, stays valid: nothing is
  accepted twice and nothing needs rolling back.
* With speculative decoding a verification of drafts gets a mask row per position: the matcher
  accepts the drafts one by one to fill the rows after them, then rolls back
  (:meth:`GrammarState.fill_after`); the engine feeds it only the tokens verification keeps. Drafts
  from the first one the grammar rejects on are not verified at all (:meth:`GrammarState.valid_prefix`):
  their rows' masks would reject them anyway.

xgrammar is an optional dependency (``pip install deepinfer[structured]``), imported on first use.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from deepinfer_core.sampling.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

INSTALL_HINT = "structured outputs need xgrammar: pip install 'deepinfer[structured]'"


def xgrammar_available() -> bool:
    """Whether xgrammar imports here (importing it takes seconds: done on first use only)."""
    try:
        import xgrammar  # noqa: F401
    except Exception:
        return False
    return True


def _ebnf_literal(text: str) -> str:
    """``text`` as a double-quoted EBNF string literal (xgrammar's escapes)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _detail(exc: Exception) -> str:
    """xgrammar's message without its "[time] /source/file.cc:line:" prefix."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[0])


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Bool [..., V] -> xgrammar's int32 words [..., ceil(V/32)] (bit v % 32 of word v // 32)."""
    vocab = allowed.shape[-1]
    pad = -vocab % 32
    bits = torch.nn.functional.pad(allowed.long(), (0, pad)).view(*allowed.shape[:-1], -1, 32)
    words = (bits << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class GrammarState:
    """One sequence's matcher: what it has accepted, whether it is done or stuck."""

    def __init__(self, matcher: Any, description: str):
        self.matcher = matcher
        self.description = description
        self.num_accepted = 0
        self.dead_end = False  # set by the sampler: no token satisfied the grammar and the other masks

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_after(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows ``row + 1 ..``: the masks after each draft (speculative decoding), as far as the matcher
        accepts them; the matcher is then as it was."""
        self._try(drafts, lambda accepted: self.fill(bitmask, row + accepted))

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts``, from the first, the grammar allows (none after one that ends the output);
        the matcher is then as it was."""
        return self._try(drafts)

    def _try(self, drafts: list[int], after=None) -> int:
        """Accept ``drafts`` while the grammar allows them, calling ``after(count)`` after each that does
        not end the output, then roll back; returns the count accepted."""
        advanced = 0
        for token in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            advanced += 1
            if after is not None and not self.matcher.is_terminated():
                after(advanced)
        if advanced:
            self.matcher.rollback(advanced)
        return advanced

    def accept(self, token: int) -> bool:
        ok = bool(self.matcher.accept_token(int(token)))
        if ok:
            self.num_accepted += 1
        return ok

    def rejection_message(self, token: int) -> str:
        if self.dead_end:
            return (f"structured output ({self.description}): no token satisfies the grammar together with "
                    f"the other sampling constraints (min_tokens, stop tokens) after {self.num_accepted} tokens")
        return (f"structured output ({self.description}): the grammar matcher rejected token {token} after "
                f"{self.num_accepted} tokens")


class StructuredOutputManager:
    """Compiles constraints for one engine's tokenizer and fills the per-step bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 64,
                 max_threads: int = 2, disable_any_whitespace: bool = False):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        # the engine's StructuredOutputsConfig: compact JSON for every request (a request may ask for
        # it alone); fixed for the manager's life, so the compile cache need not key on it
        self.disable_any_whitespace = disable_any_whitespace
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size, self.max_threads = cache_size, max_threads
        self._compiler: Any = None
        self._never: torch.Tensor | None = None  # int32 words: 0 bits for special tokens never generated
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"compiled": 0, "cache_hits": 0, "failed": 0}

    # --- compilation (add_request time) -----------------------------------------------------------

    def _xgr(self) -> Any:
        try:
            import xgrammar
        except Exception as exc:  # missing, or broken (e.g. installed without pydantic)
            raise ValueError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc
        return xgrammar

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model folder has none")
            xgr = self._xgr()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
            # special tokens (BOS, ...) other than the stop tokens are never part of the text: xgrammar
            # would allow them inside strings (by their literal spelling) while decoding drops them
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            special = set(getattr(self.tokenizer, "all_special_ids", [])) - set(self.stop_token_ids)
            allowed[[t for t in special if 0 <= t < self.vocab_size]] = False
            self._never = pack_bitmask(allowed)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached); ValueError when it does not compile."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                hit = self._cache[key]
                if isinstance(hit, ValueError):
                    raise ValueError(str(hit))
                return hit
            compiler = self._get_compiler()
            try:
                compiled = self._compile(compiler, params, self.disable_any_whitespace)
                self.stats["compiled"] += 1
            except Exception as exc:  # xgrammar reports every bad constraint as a RuntimeError
                self.stats["failed"] += 1
                compiled = ValueError(f"invalid structured output constraint ({params.kind}): {_detail(exc)}")
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(compiled, ValueError):
            raise compiled
        return compiled

    @staticmethod
    def _compile(compiler: Any, params: StructuredOutputsParams, disable_any_whitespace: bool = False) -> Any:
        kind = params.kind
        # xgrammar without any_whitespace: one line, separators ", " and ": ", no newline anywhere
        any_ws = not (params.disable_any_whitespace or disable_any_whitespace)
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, any_whitespace=any_ws)
        if kind == "json_object":  # as vLLM: any JSON object (xgrammar's builtin grammar allows any value)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)

    def new_state(self, compiled: Any, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._xgr().GrammarMatcher(compiled), params.kind)

    # --- the step -----------------------------------------------------------------------------------

    def bitmask(self, states: list[GrammarState | None], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """xgrammar's int32 bitmask [rows, ceil(V/32)]: the grammar's allowed tokens for rows with a state,
        every token for the others. A row per state, or with ``drafts`` (each state's drafts to verify)
        ``1 + len(drafts[i])`` rows for state ``i``, its row ``j`` the mask after its drafts before ``j``.
        The rows after a draft the grammar rejects allow every token: verification rejects that draft,
        so it reads none of them."""
        drafts = drafts or [[] for _ in states]
        mask = torch.full((sum(1 + len(d) for d in drafts), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row = 0
        for state, ahead in zip(states, drafts):
            if state is not None:
                state.fill(mask, row)
                state.fill_after(mask, row, ahead)
                mask[row: row + 1 + len(ahead)] &= self._never
            row += 1 + len(ahead)
        return mask
