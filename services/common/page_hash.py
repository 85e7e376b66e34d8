"""Chained page hashes: the keys of KV pages in the host (L2) and kvstore (L3) tiers.

A page is ``page_size`` consecutive tokens. Its key covers every token from the start of the
sequence through the end of the page, through a chain::

    h_{-1} = seed(namespace)                      32 bytes
    h_i    = SHA-256(h_{i-1} ‖ tokens of page i)  tokens as little-endian uint32

so equal keys mean equal prefixes (up to SHA-256 collisions), a prefix's hashes are a prefix of the
longer sequence's hashes, and page ``i``'s key is computed from ``h_{i-1}`` alone, without the
tokens before it. A partial last page has no key: only whole pages are cached below L1. A hybrid
model's recurrent state after page ``i`` is keyed by ``state_key(h_i, state layout)``.

The seed namespaces the chain, so KV bytes never cross into a context where they would be wrong:
another model or weights (fingerprint), another byte layout or page size (layout), another tensor
parallel shard (rank, size), another tenant or adapter (cache_salt). The seed encoding is part of
the wire format of L3 keys: changing it (or ``_VERSION``) orphans everything already stored.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

HASH_BYTES = 32
_VERSION = b"strata.page_hash.v1"
_STATE = b"strata.mamba_state.v1"
_U32_MAX = 0xFFFFFFFF

if array("I").itemsize != 4:  # pragma: no cover - every platform torch supports has 4-byte uint
    raise ImportError("page_hash needs array('I') to hold 32-bit items")


def _field(data: bytes) -> bytes:
    # Length-prefixed, so ("ab", "c") and ("a", "bc") give different seeds.
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True, slots=True)
class HashNamespace:
    """What a chain is keyed by besides tokens; every field changes every hash.

    ``layout`` should name everything that changes a page's bytes: e.g.
    ``HostPool.layout`` = ``"page-first/L28/H8/D128/bfloat16/P16"`` (layers, kv heads, head dim,
    dtype, page size). ``cache_salt`` is the request's cache salt (and adapter id, if any).
    """

    model_fingerprint: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""
    seed: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("HashNamespace.model_fingerprint must be non-empty")
        if not self.layout:
            raise ValueError("HashNamespace.layout must be non-empty")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"HashNamespace: need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}")
        encoded = b"".join(
            (
                _field(_VERSION),
                _field(self.model_fingerprint.encode()),
                _field(self.layout.encode()),
                struct.pack("<II", self.tp_rank, self.tp_size),
                _field(self.cache_salt.encode()),
            )
        )
        # Computed once: every chain starts from it.
        object.__setattr__(self, "seed", hashlib.sha256(encoded).digest())


def _pack(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian uint32 bytes; raises ValueError for ids outside 0..2**32-1."""
    try:
        packed = array("I", tokens)
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t <= _U32_MAX)
        raise ValueError(f"token id {bad} does not fit in uint32") from None
    if sys.byteorder != "little":  # pragma: no cover - keys must not depend on the host
        packed.byteswap()
    return packed.tobytes()


def extend_hashes(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes of the whole pages of ``tokens`` chained after ``parent`` (a seed or the previous
    page's hash); a partial tail is ignored. Pure; costs one SHA-256 per page and no per-token Python.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    n_pages = len(tokens) // page_size
    if not n_pages:
        return []
    data = memoryview(_pack(tokens[: n_pages * page_size]))
    stride = page_size * 4
    out: list[bytes] = []
    prev = parent
    for start in range(0, n_pages * stride, stride):
        h = hashlib.sha256(prev)
        h.update(data[start : start + stride])
        prev = h.digest()
        out.append(prev)
    return out


def state_key(page_hash: bytes, state_layout: str) -> bytes:
    """The L3 key of a hybrid model's recurrent (Mamba) state right after the page whose chained
    hash is ``page_hash``: the state depends on exactly the tokens that hash covers, and its bytes
    on ``state_layout`` (``WorkerInfo.state_layout``). Never equal to a page key."""
    if len(page_hash) != HASH_BYTES:
        raise ValueError(f"page hash must be {HASH_BYTES} bytes, got {len(page_hash)}")
    if not state_layout:
        raise ValueError("state_layout must be non-empty")
    return hashlib.sha256(_field(_STATE) + _field(state_layout.encode()) + page_hash).digest()


def rank_key(key: bytes, tp_rank: int, tp_size: int) -> bytes:
    """The L3 key under which tensor-parallel rank ``tp_rank`` of ``tp_size`` stores its shard of
    the page (or state) the scheduler keyed ``key``. The scheduler's keys are rank 0's (its
    ``kv_layout`` / ``state_layout`` end in ``tp0of<size>``, so they differ between TP sizes);
    each other rank derives its own, so ranks never read each other's shards."""
    if tp_rank == 0:
        return key
    return hashlib.sha256(_field(b"tp-rank") + struct.pack("<II", tp_rank, tp_size) + key).digest()


@functools.lru_cache(maxsize=4096)  # per-user salts come and go: bounded
def namespace_seed(
    model_fingerprint: str, layout: str, cache_salt: str = "", tp_rank: int = 0, tp_size: int = 1
) -> bytes:
    """``HashNamespace(...).seed``, computed once per namespace."""
    return HashNamespace(model_fingerprint, layout, tp_rank, tp_size, cache_salt).seed


@dataclass(frozen=True, slots=True)
class PageKeying:
    """How a cache's page keys are made, salt aside: what a KV-aware router needs to compute
    keys that match a scheduler's (``Scheduler/WatchCache`` sends it)."""

    page_tokens: int
    model_fingerprint: str
    layout: str

    def keys(self, tokens: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """Keys of the whole pages of ``tokens`` under ``cache_salt``."""
        seed = namespace_seed(self.model_fingerprint, self.layout, cache_salt)
        return extend_hashes(seed, tokens, self.page_tokens)


def page_hashes(tokens: Sequence[int], page_size: int, namespace: HashNamespace) -> list[bytes]:
    """Keys of the whole pages of ``tokens`` from the start of a sequence (``len(tokens) //
    page_size`` of them, 32 bytes each)."""
    return extend_hashes(namespace.seed, tokens, page_size)


class PageHashChain:
    """The hashes of one growing sequence, extended as tokens arrive (prefill, then decode).

    Keeps the last hash and fewer than ``page_size`` pending tokens, so each page is hashed
    exactly once however the tokens are fed. Not thread-safe.
    """

    __slots__ = ("_last", "_pending", "hashes", "page_size")

    def __init__(self, namespace: HashNamespace, page_size: int, tokens: Sequence[int] = ()) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.hashes: list[bytes] = []
        self._last = namespace.seed
        self._pending: list[int] = []
        self.extend(tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far, the pending partial page included."""
        return len(self.hashes) * self.page_size + len(self._pending)

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Feed more tokens; returns the hashes of the pages they completed (also appended to
        ``hashes``)."""
        if self._pending:
            tokens = [*self._pending, *tokens]
        new = extend_hashes(self._last, tokens, self.page_size)
        self._pending = list(tokens[len(new) * self.page_size :])
        if new:
            self._last = new[-1]
            self.hashes.extend(new)
        return new
