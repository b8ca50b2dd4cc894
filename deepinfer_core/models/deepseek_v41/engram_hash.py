"""The n-gram hashing that feeds DeepSeek-V4.1's Engram tables, bit-exact with DeepSeek's release.

Every new token ``p`` is hashed together with the ``max_ngram_size - 1`` tokens before it:

1. token ids go through a *compressed* map (:func:`compressed_token_map`) where ids that normalise to
   the same text share one id;
2. the ids at shifts ``0 .. max_ngram_size-1`` (``p, p-1, ...``) are read; the look-back stops at the
   first shift that falls before the sequence start or on a *dead* token (an image token) and every
   later shift is blocked too; blocked slots take the compressed pad id;
3. per Engram layer, the id at shift ``s`` is multiplied by that layer's odd multiplier ``m[s]`` and
   the products are XOR-ed together one shift at a time, so the running value after shift ``i`` is the
   hash of the ``(i+1)``-gram;
4. each of those (2-gram .. max-gram) values is reduced modulo one prime per head and shifted by the
   column's offset inside the layer's table (offsets are the cumulative primes of the earlier
   columns, so the columns own disjoint row ranges and a layer's table has ``sum(primes)`` rows).

The engine does not keep a per-sequence hash cache: the hash input of a token is a pure function of
the sequence's token ids (and which of them are dead), so :func:`ngram_history` derives it from the
token list each step. Prefix caching, preemption/recompute and speculative rollback therefore need no
Engram state of their own -- whatever tokens the sequence holds *is* the state.

Usage from a model forward (flat varlen batch of ``T`` new tokens)::

    layout = EngramHashLayout.build(layer_ids=(1, 14), max_ngram_size=4, n_heads=8,
                                    vocab_size=16_000_000, token_map=compressed_token_map(tok)[0],
                                    compressed_vocab_size=99_092, pad_token_id=2)
    hasher = EngramHasher(layout).to(device)
    rows = []
    for seq in batch:   # host side, per sequence per step
        rows += ngram_history(seq.token_ids, seq.num_computed, seq.num_new, layout.max_ngram_size, seq.dead)
    ids = hasher(torch.tensor(rows, dtype=torch.long, device=device))   # [T, n_layers, n_cols]
    # Engram at layer L reads table rows ids[:, layout.layer_index(L)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from deepinfer_core.ops.native import engram_hash

__all__ = [
    "BEFORE_START",
    "DEAD",
    "EngramHashLayout",
    "EngramHasher",
    "compressed_token_map",
    "engram_multipliers",
    "engram_primes",
    "is_prime",
    "ngram_history",
]

#: history entry for a position before the sequence start
BEFORE_START = -1
#: history entry for a dead token (an image token): it takes no part in any n-gram
DEAD = -2


# --------------------------------------------------------------------------------------------------
# token normalisation


def _engram_normalizer():
    """NFKC -> NFD -> strip accents -> lowercase -> collapse [ \\t\\r\\n]+ to one space -> strip.

    A text that is exactly one space after the collapse is kept as one space (it is swapped for a
    private-use char around ``Strip`` and back), so it does not become the empty string.
    """
    from tokenizers import Regex, normalizers

    keep_space = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    )


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Map every token id to a compressed id; returns ``(map, compressed_vocab_size)``.

    ``tokenizer`` is a ``transformers`` fast tokenizer (its Rust ``backend_tokenizer`` is used, i.e.
    raw decoding without clean-up of tokenisation spaces) or a ``tokenizers.Tokenizer``. Each id is
    decoded on its own; the key is its normalised text, or the decoded text itself where the
    normalisation leaves nothing, or the raw token string where the decoding holds U+FFFD (a partial
    UTF-8 byte token). Keys share one namespace and get compressed ids in first-seen id order, so
    ``map`` takes every value in ``0 .. compressed_vocab_size-1``. The hash multipliers derive from
    ``compressed_vocab_size``, so it must match the checkpoint's configured value exactly.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(tokenizer, "backend_tokenizer"):
        n_tokens = len(tokenizer)
    else:
        n_tokens = backend.get_vocab_size(with_added_tokens=True)
    normalizer = _engram_normalizer()
    texts = backend.decode_batch([[i] for i in range(n_tokens)], skip_special_tokens=False)
    compressed: dict[str | None, int] = {}
    token_map: list[int] = []
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(compressed.setdefault(key, len(compressed)))
    return token_map, len(compressed)


# --------------------------------------------------------------------------------------------------
# bucket primes and hash multipliers

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_MR_LIMIT = 3_317_044_064_679_887_385_961_981  # these bases decide primality exactly below this


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for every ``n`` below ~3.3e24)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= _MR_LIMIT:
        raise ValueError(f"is_prime is only exact below {_MR_LIMIT}, got {n}")
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=4096)
def _prime_after(n: int) -> int:
    """The smallest prime strictly above ``n``."""
    candidate = n + 1
    while not is_prime(candidate):
        candidate += 1
    return candidate


@lru_cache(maxsize=64)
def engram_primes(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple:
    """Bucket moduli, ``primes[layer][ngram_size - 2][head]``, as DeepSeek's layout draws them.

    Every (layer, n-gram size) group restarts its search at ``vocab_size - 1``, and each head takes
    the smallest prime above the previous head's that no earlier column has taken; no prime is used
    twice. (This equals the first ``n_layers * (max_ngram_size-1) * n_heads`` primes >= vocab_size,
    in order.)
    """
    if n_layers < 1 or max_ngram_size < 2 or n_heads < 1 or vocab_size < 1:
        raise ValueError(
            "engram_primes needs n_layers >= 1, max_ngram_size >= 2, n_heads >= 1, vocab_size >= 1; got "
            f"{n_layers=}, {max_ngram_size=}, {n_heads=}, {vocab_size=}"
        )
    taken: set[int] = set()
    layers = []
    for _ in range(n_layers):
        groups = []
        for _ in range(max_ngram_size - 1):
            heads, p = [], vocab_size - 1
            for _ in range(n_heads):
                p = _prime_after(p)
                while p in taken:
                    p = _prime_after(p)
                taken.add(p)
                heads.append(p)
            groups.append(tuple(heads))
        layers.append(tuple(groups))
    return tuple(layers)


def engram_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Per-layer odd hash multipliers, ``multipliers[layer][shift]``.

    Drawn from ``np.random.default_rng(10007 * layer_id)`` below ``(int64_max // compressed_vocab) // 2``
    (at least 1), then mapped to ``2v + 1``: odd, and small enough that ``compressed_id * multiplier``
    stays inside int64.
    """
    if compressed_vocab_size < 1:
        raise ValueError(f"compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    out = []
    for layer_id in layer_ids:
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        out.append(tuple(int(v) * 2 + 1 for v in draws))
    return tuple(out)


@dataclass(frozen=True)
class EngramHashLayout:
    """Everything the hash needs, for all Engram layers of a model.

    Invariants: ``primes[l][g][h]`` are distinct across the whole model; ``offsets[l]`` is the exclusive
    cumulative sum of layer ``l``'s primes flattened in (n-gram size, head) order, so column ``c`` of
    layer ``l`` owns rows ``offsets[l][c] .. offsets[l][c] + prime - 1`` and ``num_rows[l] = sum`` of
    the layer's primes (the table height, before any sharding padding); every ``token_map`` value is
    below ``compressed_vocab_size``; ``pad_id = token_map[pad_token_id]``.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    vocab_size: int  # bucket size the prime search of every (layer, n-gram size) starts from
    compressed_vocab_size: int
    pad_id: int  # compressed id that fills blocked n-gram slots
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][ngram_size - 2][head]
    offsets: tuple[tuple[int, ...], ...]  # [layer][column], column = (ngram_size - 2) * n_heads + head
    multipliers: tuple[tuple[int, ...], ...]  # [layer][shift]
    num_rows: tuple[int, ...]  # [layer] table rows
    token_map: tuple[int, ...] = field(repr=False, compare=False)  # token id -> compressed id

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        """Hash columns (table rows read) per token and layer: ``(max_ngram_size - 1) * n_heads``."""
        return (self.max_ngram_size - 1) * self.n_heads

    def layer_index(self, layer_id: int) -> int:
        """Index along the hasher output's layer axis of model layer ``layer_id``."""
        return self.layer_ids.index(layer_id)

    @classmethod
    def build(
        cls,
        *,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        vocab_size: int,
        token_map: Sequence[int],
        compressed_vocab_size: int | None = None,
        pad_token_id: int = 2,
    ) -> EngramHashLayout:
        """Build the layout from the checkpoint config and :func:`compressed_token_map`'s map.

        ``vocab_size`` is the config's ``engram_vocab_size`` (where the prime search starts, not the
        tokenizer vocab); ``compressed_vocab_size`` (``engram_compressed_vocab_size``) defaults to
        ``max(token_map) + 1`` and, if given, must equal it -- the multipliers derive from it, so a
        tokenizer that does not match the checkpoint would silently rehash every n-gram.
        ``pad_token_id`` is a *tokenizer* id (``engram_pad_id``); the layout keeps its compressed id.
        """
        layer_ids = tuple(int(i) for i in layer_ids)
        if not layer_ids or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids must be non-empty and distinct, got {layer_ids}")
        token_map = tuple(int(t) for t in token_map)
        if not token_map or min(token_map) < 0:
            raise ValueError("token_map must be a non-empty sequence of non-negative compressed ids")
        derived = max(token_map) + 1
        if compressed_vocab_size is None:
            compressed_vocab_size = derived
        elif compressed_vocab_size != derived:
            raise ValueError(
                f"token_map has {derived} compressed ids but compressed_vocab_size is {compressed_vocab_size}: "
                "the tokenizer does not match the checkpoint"
            )
        if not 0 <= pad_token_id < len(token_map):
            raise ValueError(f"pad_token_id {pad_token_id} is outside the token map (size {len(token_map)})")
        primes = engram_primes(len(layer_ids), max_ngram_size, n_heads, vocab_size)
        offsets, num_rows = [], []
        for layer in primes:
            flat = [p for group in layer for p in group]
            offsets.append(tuple(int(o) for o in np.cumsum([0, *flat[:-1]])))
            num_rows.append(sum(flat))
        return cls(
            layer_ids=layer_ids,
            max_ngram_size=max_ngram_size,
            n_heads=n_heads,
            vocab_size=vocab_size,
            compressed_vocab_size=compressed_vocab_size,
            pad_id=token_map[pad_token_id],
            primes=primes,
            offsets=tuple(offsets),
            multipliers=engram_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
            num_rows=tuple(num_rows),
            token_map=token_map,
        )


# --------------------------------------------------------------------------------------------------
# hashing


def ngram_history(
    token_ids: Sequence[int], start: int, count: int, n: int, dead: Sequence[bool] | None = None
) -> list[list[int]]:
    """History rows of tokens ``start .. start+count-1`` of one sequence, for :class:`EngramHasher`.

    Row ``j`` holds, for ``p = start + j`` and ``s = 0 .. n-1``, ``token_ids[p - s]``, or
    :data:`BEFORE_START` where ``p - s < 0``, or :data:`DEAD` where ``dead[p - s]`` (``dead``, if
    given, is aligned with ``token_ids``: True for tokens that take no part in an n-gram, e.g. image
    tokens). Needs only the sequence's tokens, so it is correct after prefix-cache hits, preemption
    and speculative rollback alike.
    """
    if n < 1 or start < 0 or count < 0 or start + count > len(token_ids):
        raise ValueError(
            f"ngram_history: need n >= 1 and 0 <= start <= start + count <= len(token_ids); got {n=}, "
            f"{start=}, {count=}, len(token_ids)={len(token_ids)}"
        )
    if dead is not None and len(dead) < start + count:
        raise ValueError(f"ngram_history: dead has {len(dead)} entries, needs at least {start + count}")
    rows = []
    for p in range(start, start + count):
        row = []
        for q in range(p, p - n, -1):
            if q < 0:
                row.append(BEFORE_START)
            elif dead is not None and dead[q]:
                row.append(DEAD)
            else:
                row.append(int(token_ids[q]))
        rows.append(row)
    return rows


class EngramHasher(torch.nn.Module):
    """Hashes a flat varlen batch of token histories into Engram table row ids (all layers at once).

    Holds the layout as non-persistent device buffers (move it with ``.to(device)``; nothing is
    loaded from a checkpoint). Same numbers as DeepSeek's ``NgramHashState.forward``, without its
    per-batch-slot cache: the caller passes each token's history instead (see :func:`ngram_history`).
    """

    def __init__(self, layout: EngramHashLayout):
        super().__init__()
        self.layout = layout
        self.pad_id = layout.pad_id
        self.register_buffer("token_map", torch.tensor(layout.token_map, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.tensor(layout.multipliers, dtype=torch.int64), persistent=False)
        self.register_buffer("primes", torch.tensor(layout.primes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(layout.offsets, dtype=torch.int64), persistent=False)

    def forward(
        self, history: torch.Tensor, blocked: torch.Tensor | None = None, *, validate: bool = True
    ) -> torch.Tensor:
        """``history``: integer ``[T, max_ngram_size]``, column ``s`` = tokenizer id at ``p - s``, or a
        negative value (:data:`BEFORE_START`, :data:`DEAD`) for a slot that blocks the look-back.
        ``blocked``: optional bool ``[T, max_ngram_size]``, True marks a slot as dead too (for callers
        that keep a token-type mask rather than writing :data:`DEAD`). Both must be on the hasher's
        device. Returns int64 ``[T, n_layers, n_cols]`` row ids into each layer's table.

        ``validate`` checks the id range on the host (one device sync); the model's forward calls the
        ``engram_hash`` op directly instead (:meth:`op_args`), without it: an out-of-range id then fails as
        an indexing error instead of a ValueError.
        """
        n = self.layout.max_ngram_size
        if history.dim() != 2 or history.shape[1] != n:
            raise ValueError(f"history must be [T, max_ngram_size={n}], got shape {tuple(history.shape)}")
        if history.dtype.is_floating_point or history.dtype.is_complex or history.dtype == torch.bool:
            raise ValueError(f"history must hold integer token ids, got {history.dtype}")
        history = history.to(torch.int64)
        if blocked is not None and (blocked.shape != history.shape or blocked.dtype != torch.bool):
            raise ValueError(
                f"blocked must be bool with history's shape {tuple(history.shape)}, "
                f"got {blocked.dtype} {tuple(blocked.shape)}"
            )
        if validate and history.numel():
            lo, hi = torch.aminmax(history)
            lo, hi = int(lo), int(hi)
            if lo < DEAD or hi >= self.token_map.shape[0]:
                raise ValueError(
                    f"history ids must lie in [0, {self.token_map.shape[0]}) (the compressed map's tokenizer "
                    f"vocab), or be BEFORE_START={BEFORE_START} / DEAD={DEAD}; got min {lo}, max {hi}"
                )

        if blocked is not None:
            history = history.masked_fill(blocked, DEAD)
        return engram_hash(history, self.token_map, self.multipliers, self.primes, self.offsets, self.pad_id)

    def op_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The layout arguments of the ``engram_hash`` op, after the history: (token_map, multipliers,
        primes, offsets, pad_id), on the hasher's device."""
        return self.token_map, self.multipliers, self.primes, self.offsets, self.pad_id
