"""The state track of a model with recurrent layers (Mamba / linear attention): working states,
copy-on-write, checkpoint forks and donation. Composed into ``Memory`` when the worker reports a
state pool; dense models have none.

A cached prefix is usable only together with the recurrent state right after it, so every running
request owns one *working state* (``req.mem.mamba_slot``) and:

- **start** (after the match): the request gets its working state and the matched state is copied
  into it (``MambaCopy``, copy-on-write: a cached state is never written), or it is zeroed
  (``MambaReset``) when nothing matched;
- **checkpoints**: prefill chunks are cut at the request's checkpoint positions (see
  ``state_policy.checkpoint_positions``). When a chunk ends at one, the request allocates a *fork*
  slot; the copy working → fork runs at the head of the *next* step's ops (after this step's forward
  has brought the working state there, before the next forward moves it on). When the chunk's step
  is committed, ``tokens[:p]`` and the fork go into the tree and the request's lock moves down;
- **release**: a request whose working state sits exactly at the end of the whole pages it caches
  (no later token planned) donates the working slot itself to the tree; otherwise it is freed.

A fork that cannot get a slot (pool full of working and locked states) is skipped, never an error.
Invariant when idle: ``pool.available + tree.state_evictable + tree.state_protected == size``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.step import CacheOp, MambaCopy, MambaReset
from services.scheduler.memory.base import CacheHandle
from services.scheduler.memory.request_memory import Fork
from services.scheduler.memory.state_alloc import MambaSlotAllocator
from services.scheduler.memory.state_policy import checkpoint_positions
from services.scheduler.memory.tree import PrefixTree

if TYPE_CHECKING:
    from services.scheduler.request import Req


@dataclass(slots=True)
class StateCounters:
    """Exported as metrics (``mamba_events``) and asserted in tests."""

    cow_copy: int = 0  # matched state copied into a working state
    fork: int = 0  # checkpoint forks planned
    fork_inserted: int = 0  # forks the tree kept
    fork_skipped: int = 0  # no slot for a fork
    donated: int = 0  # working states the tree kept at release
    evicted: int = 0  # cached states evicted


class StateTrack:
    def __init__(self, num_states: int, tree: PrefixTree | None, tree_page: int, checkpoint_every: int) -> None:
        """``tree``: the prefix tree (with states), None when the cache is off; ``tree_page``: its page."""
        self.pool = MambaSlotAllocator(num_states)
        self.tree = tree
        self.tree_page = tree_page
        self.checkpoint_every = checkpoint_every
        self.ops: list[CacheOp] = []  # resets and copy-on-writes of the step being planned
        self.head: list[MambaCopy] = []  # forks: run first in the step after the one planned
        # Tree nodes whose state is a fork not yet copied (its copy waits in ``head``): locked, so
        # nothing reads (backs up) or evicts the slot before the copy is on its way.
        self.unsent: list[CacheHandle] = []
        self.counters = StateCounters()

    # -- admission ------------------------------------------------------------------------------
    def plan_checkpoints(self, req: Req) -> None:
        """Where the request just matched should fork its state into the tree (ascending)."""
        if self.tree is None:
            req.mem.checkpoints = []
            return
        branches = [req.mem.branch_len, *req.mem.branch_hints]
        if self.tree_page > 1:
            # Besides the prompt's end (for the next turn), the last page a resend of the same
            # prompt can match (its last token is always computed): they differ when the prompt
            # is whole pages.
            branches.append(len(req.seq) - 1)
        req.mem.checkpoints = checkpoint_positions(
            len(req.seq), self.checkpoint_every, self.tree_page, branches, start=req.mem.cache_len,
            include_end=self.tree_page > 1,
        )

    def start(self, req: Req) -> bool:
        """Give the admitted request its working state (a copy of the matched one, or zeroed).
        False when no state slot can be had (the caller undoes the admission)."""
        own = self.alloc()
        if own is None:
            return False
        src = req.mem.matched_state if req.mem.cache_len else None
        if src is not None:
            self.ops.append(MambaCopy(src, own))
            self.counters.cow_copy += 1
        else:
            self.ops.append(MambaReset(own))
        req.mem.mamba_slot, req.mem.matched_state = own, None
        return True

    def add_branch_hint(self, req: Req, pos: int) -> None:
        """A sibling waits for ``req``'s prefix up to ``pos``: checkpoint there if still ahead."""
        rm = req.mem
        pos -= pos % self.tree_page
        if self.tree is None or pos in rm.checkpoints or pos in rm.branch_hints:
            return
        rm.branch_hints.append(pos)
        if rm.mamba_slot is not None and rm.planned_len < pos <= len(req.seq):
            bisect.insort(rm.checkpoints, pos)

    def chunk_limit(self, req: Req, n: int) -> int:
        """Cut a prefill chunk of ``n`` tokens so that it ends at the next checkpoint, if any."""
        cps, done = req.mem.checkpoints, req.mem.planned_len
        i = bisect.bisect_right(cps, done)
        return min(n, cps[i] - done) if i < len(cps) else n

    def alloc(self) -> int | None:
        """A free state slot, evicting one cached state if needed."""
        got = self.pool.alloc()
        if got is None and self.tree is not None:
            self.counters.evicted += self.tree.evict_states(1)
            got = self.pool.alloc()
        return got

    # -- planning -------------------------------------------------------------------------------
    def planned(self, req: Req, end: int) -> Fork | None:
        """``req``'s input in the step being planned brings its working state to ``end``: fork it
        when that is a checkpoint. Returns the fork (to insert once the step is committed)."""
        rm = req.mem
        if self.tree is None or end > len(req.seq) or end not in rm.checkpoints:
            return None
        slot = self.alloc()
        if slot is None:
            self.counters.fork_skipped += 1
            return None
        assert rm.mamba_slot is not None
        self.head.append(MambaCopy(rm.mamba_slot, slot))
        fork = Fork(end, slot)
        rm.forks.append(fork)
        self.counters.fork += 1
        return fork

    def take(self) -> tuple[list[MambaCopy], list[CacheOp]]:
        """(forks planned in the previous step, this plan's resets and copies), both emptied."""
        head, ops = self.head, self.ops
        self.head, self.ops = [], []
        if self.tree is not None:
            for node in self.unsent:
                self.tree.unlock(node)
        self.unsent = []
        return head, ops

    def hold_until_sent(self, req: Req, fork: Fork) -> None:
        """``fork`` just entered the tree at ``req.mem.lock``: if its copy has not been handed out
        yet, keep the node locked until it is (a write-back eviction would read it too early)."""
        rm = req.mem
        if self.tree is not None and rm.mamba_slot is not None and MambaCopy(rm.mamba_slot, fork.slot) in self.head:
            self.tree.lock(rm.lock)
            self.unsent.append(rm.lock)

    # -- release --------------------------------------------------------------------------------
    def release(self, req: Req, donated: bool) -> None:
        """Free the working state unless it was ``donated`` to the tree, and any pending forks
        (dropping their copies if not sent yet); clear the request's state fields."""
        rm = req.mem
        own = rm.mamba_slot
        if own is not None and not donated:
            self.pool.free(own)
        for fork in rm.forks:
            self.pool.free(fork.slot)
            if own is not None and (op := MambaCopy(own, fork.slot)) in self.head:
                self.head.remove(op)  # not sent yet: no need to copy into a freed slot
        rm.forks, rm.mamba_slot, rm.checkpoints, rm.branch_hints = [], None, [], []

    # -- accounting -----------------------------------------------------------------------------
    def owners(self) -> dict[str, int]:
        """State slots by owner: free, cache, requests."""
        free = self.pool.available
        cached = self.tree.state_evictable + self.tree.state_protected if self.tree is not None else 0
        return {"free": free, "cache": cached, "requests": self.pool.size - free - cached}

    def check_idle(self) -> None:
        cached = 0
        if self.tree is not None:
            self.tree.sanity_check()
            cached = self.tree.state_evictable + self.tree.state_protected
        size = self.pool.size + self.pool.shrink_pending
        if self.pool.available + cached != size:
            raise AssertionError(
                f"Mamba accounting broken when idle: {self.pool.available} free + {cached} cached != {size}"
            )
