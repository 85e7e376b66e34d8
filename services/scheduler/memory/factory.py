"""One factory: the worker's pools (``WorkerInfo``) and the scheduler's settings make one ``Memory``.

    worker has           composed
    (always)             slots, rows, the prefix tree (one that keeps nothing with --cache none)
    a state pool         + StateTrack; the tree carries states
    a host pool          + HostTierPlanner (host pages, and host states with a state track); the tree is
                         then paged in host pages
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.page_hash import HashNamespace
from services.common.step import WorkerInfo
from services.scheduler.memory.allocator import RowAllocator, SlotAllocator
from services.scheduler.memory.core import Memory
from services.scheduler.memory.host import HiConfig
from services.scheduler.memory.host_tier import HostTierPlanner
from services.scheduler.memory.states import StateTrack
from services.scheduler.memory.tree import EvictionPolicy, PrefixTree


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """The scheduler's memory settings (the pool sizes come from the worker)."""

    cache: str = "radix"  # "radix" | "none"
    eviction: str = "lru"  # KV eviction order: "lru" | "lfu"
    state_policy: str = "marconi"  # cached-state eviction order: "marconi" | "lru"
    checkpoint_every: int = 1024  # state checkpoint grid in tokens
    hicache: HiConfig = field(default_factory=HiConfig)


def build_memory(info: WorkerInfo, cfg: MemoryConfig) -> Memory:
    """The memory for ``info``'s worker: device parts, then the host tier if it has a host pool."""
    caching = cfg.cache == "radix"
    host = bool(info.host_pages) and caching and (not info.hybrid or bool(info.host_states))
    if info.hybrid and info.num_mamba_slots < 1 and info.num_rows:
        raise ValueError("no Mamba state slot: a running request needs one (fewer than rows is fine: "
                         "admission waits for a free state)")
    num_states = info.num_mamba_slots if info.hybrid else 0
    # With a host tier the tree is paged in host pages: every node (and checkpoint) is whole ones.
    tree_page = info.host_page_tokens if host else 0
    mem = device_memory(info.num_slots, info.num_rows, info.page_size, cfg, num_states=num_states, tree_page=tree_page)
    if host:
        mem.host = HostTierPlanner(
            mem.tree, mem.states, host_pages=info.host_pages, host_states=info.host_states,
            namespace=HashNamespace(info.fingerprint, info.kv_layout), state_layout=info.state_layout, l3=info.l3,
            cfg=cfg.hicache, alloc=mem.alloc, free_pages=mem.free_pages,
        )
    return mem


def device_memory(
    num_slots: int, num_rows: int, page_size: int, cfg: MemoryConfig, *, num_states: int = 0, tree_page: int = 0
) -> Memory:
    """Slots, rows and the prefix tree, plus a state track when ``num_states`` (a model with
    recurrent layers). ``tree_page``: tokens per page of the tree (and checkpoint grid), a multiple
    of ``page_size``; 0 = ``page_size``."""
    tree_page = tree_page or page_size
    if tree_page % page_size:
        raise ValueError(f"tree_page ({tree_page}) must be a multiple of page_size ({page_size})")
    slots = SlotAllocator(num_slots, page_size)
    states = StateTrack(num_states, None, tree_page, cfg.checkpoint_every) if num_states else None
    if cfg.cache != "radix":
        tree = PrefixTree(tree_page, slots.free, keep=False)
    elif states is not None:
        tree = states.tree = PrefixTree(
            tree_page, slots.free, states.pool.free_many, eviction=_eviction(cfg),
            state_policy="lru" if cfg.state_policy == "lru" else "marconi",
        )
    else:
        tree = PrefixTree(tree_page, slots.free, eviction=_eviction(cfg))
    return Memory(slots, RowAllocator(num_rows), tree, states)


def _eviction(cfg: MemoryConfig) -> EvictionPolicy:
    return "lfu" if cfg.eviction == "lfu" else "lru"
