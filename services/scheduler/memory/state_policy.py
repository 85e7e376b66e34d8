"""Where to checkpoint Mamba states, and which cached state to give up first. Pure functions.

Checkpointing. A recurrent state exists only at the position the request has computed up to, so a
state can be cached only where a prefill chunk ends. `checkpoint_positions` picks those ends:

- every multiple of `chunk_size`: the chunked prefill stops there anyway, so the checkpoint costs
  one slot copy and no extra kernel launch; positions are an absolute grid (not relative to where
  the request's match ended) so requests sharing a prefix checkpoint at the same places and their
  states dedupe in the tree;
- branch points learned from insertions (Marconi): where this prompt leaves the tree
  (`TreeMatch.kv_len`), or any other place the caller knows several sequences diverge. A state
  there is shared by every branch, which is where reuse actually happens;
- the end of the prompt (whole pages only), when asked for: a continuation of this prompt
  matches there. The scheduler asks only when pages are longer than one token: with one-token
  pages a finished request donates its working state at its very end (deeper, and free), so a
  prompt-end fork would only take a slot that a more useful state could hold.

A state can only sit at the end of a whole page, so every position is rounded down to a page.

Eviction. Under "lru" the least recently *used* state goes first (a state is used when a match ends
at it, or when it is inserted), the shallower first on ties. Under "marconi" each unlocked state
gets a score and the lowest goes first:

    score = (1 - alpha) * recency + alpha * saved
    recency = rank by last use among the candidates, scaled to [0, 1] (0 = least recent)
    saved   = depth / max depth among the candidates, in (0, 1]

A hit on a state at depth d saves recomputing d tokens, so FLOPs saved grow with d (linearly for
the projections and Mamba layers; the attention part grows faster, which this ignores, erring
towards recency). Every state costs the same bytes in the pool, so FLOPs saved per byte is
proportional to depth. alpha = 0 is plain LRU; Marconi's finding is that a short, rarely branched
prefix is cheap to recompute and should go before a long one of similar age.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

StatePolicy = Literal["lru", "marconi"]

# Equal weight to recency and compute saved per byte: Marconi tunes this per workload; 0.5 keeps a
# hot short prefix (a shared system prompt) ahead of a cold long one.
DEFAULT_MARCONI_ALPHA = 0.5


def checkpoint_positions(
    prompt_len: int,
    chunk_size: int,
    page_size: int,
    branch_points: Iterable[int],
    *,
    start: int = 0,
    include_end: bool = True,
) -> list[int]:
    """Ascending, distinct, page-aligned positions p with start < p <= prompt_len where the request
    should fork its state into the tree during prefill. `start` is the length it matched (states at
    or before it are cached already). The batcher ends a prefill chunk at each position (a chunk may
    end earlier, never later), forks there and inserts `tokens[:p]` with the fork.
    `chunk_size <= 0` turns the chunk grid off (branch points and the prompt end only)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if prompt_len < 0 or start < 0:
        raise ValueError(f"negative length: prompt_len={prompt_len}, start={start}")
    wanted: set[int] = set(branch_points)
    if include_end:
        wanted.add(prompt_len)
    if chunk_size > 0:
        first = (start // chunk_size + 1) * chunk_size
        wanted.update(range(first, prompt_len + 1, chunk_size))
    aligned = {p - p % page_size for p in wanted}
    return sorted(p for p in aligned if start < p <= prompt_len)


def state_eviction_order(
    last_use: Sequence[int],
    depth: Sequence[int],
    policy: StatePolicy,
    alpha: float = DEFAULT_MARCONI_ALPHA,
) -> list[int]:
    """Indices of the candidate states (given by their last-use tick and depth in tokens) in the
    order they should be evicted, first to go first. Ties fall back to least recent, then
    shallowest, then index, so the order is deterministic."""
    n = len(last_use)
    if len(depth) != n:
        raise ValueError(f"{n} last-use ticks for {len(depth)} depths")
    by_recency = sorted(range(n), key=lambda i: (last_use[i], depth[i], i))
    if policy == "lru" or n <= 1:
        return by_recency
    if policy != "marconi":
        raise ValueError(f"unknown state eviction policy {policy!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    recency = [0.0] * n
    for rank, i in enumerate(by_recency):
        recency[i] = rank / (n - 1)
    deepest = max(depth) or 1
    score = [(1.0 - alpha) * recency[i] + alpha * depth[i] / deepest for i in range(n)]
    return sorted(range(n), key=lambda i: (score[i], recency[i], depth[i], i))
