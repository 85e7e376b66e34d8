"""KV memory of a hybrid (full attention + Mamba / linear attention) model: KV slots, rows, Mamba
state slots, and the Mamba radix cache over both.

A cached prefix is only usable together with the recurrent state right after it, so on top of
``KVMemory`` every running request owns one *working state* (``req.mamba_slot``) and:

- **admission**: the match ends at a node with a state; the request locks it (KV path + state),
  allocates its working state and copies the matched state into it (``MambaCopy``, copy-on-write:
  the cached state is never written), or zeroes it (``MambaReset``) when nothing matched;
- **checkpoints**: prefill chunks are cut at the request's checkpoint positions (see
  ``cache.mamba_policy.checkpoint_positions``). When a chunk ends at one, the request allocates a
  *fork* slot; the copy working → fork runs at the head of the *next* step's ops (after this
  step's forward has brought the working state to that position, before the next forward moves
  it on). When the chunk's step is committed, ``tokens[:p]`` and the fork go into the tree and the
  request's lock moves down to the new node;
- **release**: a request whose working state sits exactly at the end of the whole pages it caches
  (no later token planned) donates the working slot itself to the tree; otherwise it is freed.

Ordering is what keeps this correct without locks on the worker: every op and forward runs in
step order, and an op that reads or overwrites a slot is always planned after the op or forward
that produced what it must see. Freed slots may still be written by a step already in flight;
whoever gets the slot next writes it in a later step.

A fork that cannot get a slot (pool full of working and locked states) is skipped, never an
error. Invariant when idle: ``states.available + state_evictable + state_protected == size``.
"""

from __future__ import annotations

import bisect
import logging

from services.common.step import CacheOp, MambaCopy, MambaReset
from services.scheduler.cache.base import CacheKey, NoCache
from services.scheduler.cache.mamba_policy import StatePolicy, checkpoint_positions
from services.scheduler.cache.tree import PrefixTree
from services.scheduler.mamba_alloc import MambaSlotAllocator
from services.scheduler.memory import KVMemory
from services.scheduler.request import Fork, Req

log = logging.getLogger(__name__)


class HybridMemory(KVMemory):
    """``KVMemory`` plus Mamba state slots; ``cache`` "radix" uses the Mamba radix cache."""

    def __init__(
        self,
        num_slots: int,
        num_rows: int,
        page_size: int,
        cache: str,
        num_states: int,
        *,
        state_policy: StatePolicy = "marconi",
        checkpoint_every: int = 1024,
        tree_page: int = 0,
    ) -> None:
        """``tree_page``: tokens per page of the prefix tree (and checkpoint grid), a multiple of
        ``page_size``; 0 = ``page_size``. The hierarchical cache uses its host page here."""
        super().__init__(num_slots, num_rows, page_size, "none")
        tree_page = tree_page or page_size
        if tree_page % page_size:
            raise ValueError(f"tree_page ({tree_page}) must be a multiple of page_size ({page_size})")
        self.tree_page = tree_page
        if num_states < 1 and num_rows:
            raise ValueError("no Mamba state slot: a running request needs one (fewer than rows is fine: "
                             "admission waits for a free state)")
        self.states = MambaSlotAllocator(num_states)
        self.mcache: PrefixTree | None = None
        if cache == "radix":
            self.mcache = PrefixTree(tree_page, self.slots.free, self.states.free_many, state_policy=state_policy)
            self.cache = self.mcache
        self.checkpoint_every = checkpoint_every
        self.ops: list[CacheOp] = []  # for the step being planned
        self.head_ops: list[MambaCopy] = []  # forks: run first in the step after the one planned
        # Counters (exported as metrics, asserted in tests).
        self.cow_copies = 0
        self.forks = 0
        self.forks_inserted = 0
        self.forks_skipped = 0
        self.donated = 0
        self.states_evicted = 0

    # -- admission ------------------------------------------------------------------------------
    def match(self, req: Req) -> int:
        if self.mcache is None:
            req.matched_state, req.branch_len = None, 0
            return 0
        m = self.mcache.match(self.match_key(req))
        n = len(m.slots)
        req.branch_len = m.kv_len
        req.matched_state = m.state
        if n:
            self.mcache.lock(m.node)
            req.lock, req.slots, req.cache_len = m.node, m.slots, n
        return n

    def plan_checkpoints(self, req: Req) -> None:
        """Where the request just matched should fork its state into the tree (ascending)."""
        req.checkpoints = self._checkpoints(req) if self.mcache is not None else []

    def start_state(self, req: Req) -> bool:
        """Give the admitted request its working state (a copy of the matched one, or zeroed).
        False when no state slot can be had (the caller undoes the match)."""
        own = self._alloc_state()
        if own is None:
            return False
        src = req.matched_state if req.cache_len else None
        if src is not None:
            self.ops.append(MambaCopy(src, own))
            self.cow_copies += 1
        else:
            self.ops.append(MambaReset(own))
        req.mamba_slot, req.matched_state = own, None
        return True

    def _checkpoints(self, req: Req) -> list[int]:
        branches = [req.branch_len, *req.branch_hints]
        if self.tree_page > 1:
            # Besides the prompt's end (for the next turn), the last page a resend of the same
            # prompt can match (its last token is always computed): they differ when the prompt
            # is whole pages.
            branches.append(len(req.seq) - 1)
        return checkpoint_positions(
            len(req.seq), self.checkpoint_every, self.tree_page, branches, start=req.cache_len,
            include_end=self.tree_page > 1,
        )

    def add_branch_hint(self, req: Req, pos: int) -> None:
        """A sibling waits for ``req``'s prefix up to ``pos``: checkpoint there if still ahead."""
        pos -= pos % self.tree_page
        if self.mcache is None or pos in req.checkpoints or pos in req.branch_hints:
            return
        req.branch_hints.append(pos)
        if req.mamba_slot is not None and req.planned_len < pos <= len(req.seq):
            bisect.insort(req.checkpoints, pos)

    def chunk_limit(self, req: Req, n: int) -> int:
        """Cut a prefill chunk of ``n`` tokens so that it ends at the next checkpoint, if any."""
        cps, done = req.checkpoints, req.planned_len
        i = bisect.bisect_right(cps, done)
        return min(n, cps[i] - done) if i < len(cps) else n

    def _alloc_state(self) -> int | None:
        got = self.states.alloc()
        if got is None and self.mcache is not None:
            self.states_evicted += self.mcache.evict_states(1)
            got = self.states.alloc()
        return got

    def available_states(self) -> int:
        """State slots a new request could get: free now plus cached and unlocked."""
        return self.states.available + (self.mcache.state_evictable if self.mcache is not None else 0)

    # -- planning -------------------------------------------------------------------------------
    def planned(self, req: Req, end: int) -> Fork | None:
        """``req``'s input in the step being planned brings its working state to ``end``: fork it
        when that is a checkpoint. Returns the fork (to insert once the step is committed)."""
        req.planned_len = end
        if self.mcache is None or end > len(req.seq) or end not in req.checkpoints:
            return None
        slot = self._alloc_state()
        if slot is None:
            self.forks_skipped += 1
            return None
        assert req.mamba_slot is not None
        self.head_ops.append(MambaCopy(req.mamba_slot, slot))
        fork = Fork(end, slot)
        req.forks.append(fork)
        self.forks += 1
        return fork

    def take_ops(self, head: list[MambaCopy]) -> list[CacheOp]:
        """The ops of the step being planned: last step's forks first, then this plan's."""
        ops: list[CacheOp] = [*head, *self.ops]
        self.ops = []
        return ops

    def take_head(self) -> list[MambaCopy]:
        head, self.head_ops = self.head_ops, []
        return head

    # -- commit ---------------------------------------------------------------------------------
    def insert_fork(self, req: Req, fork: Fork) -> None:
        """The step that computed ``fork`` is committed: put ``tokens[:pos]`` and the fork into the
        tree and move ``req``'s lock down to it (switching to the tree's slots where a sibling
        cached the same tokens first)."""
        if fork not in req.forks:  # released (finished, aborted, retracted) meanwhile: slot freed
            return
        req.forks.remove(fork)
        assert self.mcache is not None
        pos = fork.pos
        if pos <= req.cache_len:  # already cached up to here (a deeper node is locked): surplus
            self.states.free(fork.slot)
            return
        key = CacheKey(req.seq[:pos], req.cache_salt)
        res = self.mcache.insert_checkpoint(key, req.slots[:pos], fork.slot)
        self.forks_inserted += res.state_taken
        self._lock_inserted(req, key, res.cached_len)
        if res.state_taken:
            self.checkpointed(key)

    def cache_unfinished(self, req: Req) -> None:
        """Hybrid prefixes enter the tree only with a state: at forks (``insert_fork``)."""

    def checkpointed(self, key: CacheKey) -> None:
        """A state for ``key`` just entered the tree (a fork or a donated working state). A hook
        for the hierarchical cache, which backs such prefixes up to the host."""

    # -- release --------------------------------------------------------------------------------
    def cache_and_release(self, req: Req) -> None:
        """As ``KVMemory.cache_and_release``, donating the working state when it sits exactly at
        the end of what is cached; frees the working state otherwise and any pending forks."""
        own, m = req.mamba_slot, req.cache_len
        computed = min(req.planned_len, len(req.prompt) + len(req.output))
        aligned = self.cache.aligned_len(computed)
        donate = self.mcache is not None and own is not None and aligned > m and req.planned_len == aligned
        if aligned > m and not isinstance(self.cache, NoCache):
            assert self.mcache is not None
            key = CacheKey(req.seq[:aligned], req.cache_salt)
            res = self.mcache.insert_checkpoint(key, req.slots[:aligned], own if donate else None)
            self.donated += res.state_taken
            if res.state_taken:
                self.checkpointed(key)
            to_free = req.slots[m : res.cached_len] + req.slots[aligned:]
        else:
            to_free = req.slots[m:]
        if req.lock is not None:
            self.cache.unlock(req.lock)
        if to_free:
            self.slots.free(self._pages(to_free))
        if own is not None and not donate:
            self.states.free(own)
        for fork in req.forks:
            self.states.free(fork.slot)
            if own is not None and (op := MambaCopy(own, fork.slot)) in self.head_ops:
                self.head_ops.remove(op)  # not sent yet: no need to copy into a freed slot
        req.forks, req.mamba_slot, req.checkpoints, req.branch_hints = [], None, [], []
        req.lock, req.slots, req.cache_len, req.planned_len = None, [], 0, 0

    # -- accounting -----------------------------------------------------------------------------
    def check_idle_invariant(self) -> None:
        super().check_idle_invariant()
        cached = 0
        if self.mcache is not None:
            self.mcache.sanity_check()
            cached = self.mcache.state_evictable + self.mcache.state_protected
        size = self.states.size + self.states.shrink_pending
        if self.states.available + cached != size:
            raise AssertionError(
                f"Mamba accounting broken when idle: {self.states.available} free + {cached} cached != {size}"
            )
