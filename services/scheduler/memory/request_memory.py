"""What one request holds of a worker's memory (``Req.mem``): written by ``Memory`` (and the parts
it composes) at each point of the request's life, read by the batcher to build the step.

    slots:  [ the tree's, locked by ``lock`` | the request's own ]
            0                        cache_len                  len(slots) = tokens with KV

The batcher reads ``slots``, ``row``, ``mamba_slot`` and ``row_dirty`` (what the worker's row and
state are, and whether to resend the row); only ``Memory`` writes them (the server sets
``l3_pages`` at submission).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Fork:
    """A Mamba slot a hybrid request copies its working state into once it has computed ``pos``
    tokens, to donate to the prefix cache as a checkpoint (compared by identity)."""

    pos: int
    slot: int


@dataclass(eq=False, slots=True)
class RequestMemory:
    """``slots[i]`` holds the KV of token ``i`` of the request's ``seq``; ``slots[:cache_len]``
    belong to the prefix tree and are protected by ``lock``; the rest are the request's own."""

    slots: list[int] = field(default_factory=list)
    row: int | None = None  # the worker's row (its req_to_token entry), while admitted
    mamba_slot: int | None = None  # the working state (hybrid models), while running
    cache_len: int = 0  # prefix tokens owned by the cache and locked by this request
    # Tokens covered by inputs of steps already planned (<= len(slots): a slot granted in a plan
    # that then retracted the request was never written).
    planned_len: int = 0
    row_dirty: bool = False  # the worker's row holds slots the cache replaced: resend them
    lock: Any = None  # the tree node locked for slots[:cache_len]
    # Hybrid models (see ``states.py``): where to fork the working state into the tree, positions
    # siblings wait for, forks not yet in the tree, the matched state and where the prompt left the
    # tree at admission.
    checkpoints: list[int] = field(default_factory=list)
    branch_hints: list[int] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    matched_state: int | None = None
    branch_len: int = 0
    l3_pages: int = 0  # leading prompt pages the shared store (L3) holds, looked up at submission
    prefetch: Any = None  # the host tier's L3 prefetch for this request (a PrefetchTracker), once started
