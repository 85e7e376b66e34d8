"""The host tier inside ``Memory`` (``host_tier.HostTierPlanner``): what it does, its settings, its
counters and the helpers it shares with ``Memory``.

A host tier is composed into ``Memory`` when the worker has a host pool (L2, and the kvstore L3
behind it). It moves no bytes: it plans ``HostLoad`` / ``HostBackup`` / ``L3Put`` / ``L3Get`` (and
their state twins) as step ops and hears the worker's acknowledgements in ``on_results``.

- **admission** (``extend_match``): after the device match, a continuation held on the host is
  loaded back into new slots and served like a device hit. Loads are acknowledged when planned:
  the step stream runs them before any reader (``ops.py``), and a failed step takes the worker's
  whole pool view with it (the loop rebuilds it);
- **L3 prefetch** (``hold``): when the kvstore holds at least ``prefetch_threshold`` pages beyond
  the local match (``Req.mem.l3_pages``, looked up at submission), host pages are reserved and an
  ``L3Get`` is sent; the request waits as the stop policy says;
- **writes** (``cached``, ``evict_device``): backups and puts the write policy wants go with the
  next step and are acknowledged from its ``StepResult.jobs``; until then what they read stays
  pinned. Jobs in flight are bounded by ``max_inflight_jobs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.memory.base import CacheKey
from services.scheduler.memory.host_policy import PrefetchTracker, StopPolicy, WritePolicy

if TYPE_CHECKING:
    from services.scheduler.request import Req

# Backups, puts and prefetches in flight at once (the default of --hicache-max-inflight).
MAX_INFLIGHT_JOBS = 64


@dataclass(frozen=True, slots=True)
class HiConfig:
    """The scheduler's hierarchical-cache settings (the pool sizes come from the worker)."""

    write_policy: WritePolicy = "write_through"
    prefetch_policy: StopPolicy = "wait_complete"
    prefetch_threshold: int = 1  # pages L3 must hold beyond the local match to fetch them
    prefetch_timeout_s: float = 2.0
    max_inflight_jobs: int = MAX_INFLIGHT_JOBS


@dataclass(slots=True)
class HiCounters:
    """Exported as metrics (``hicache_events``) and asserted in tests."""

    load_tokens: int = 0  # tokens brought back from the host at admission
    prefetch_pages: int = 0  # pages asked of L3
    prefetched_pages: int = 0  # pages that arrived from L3
    backup_pages: int = 0
    put_pages: int = 0
    failed_jobs: int = 0
    state_loads: int = 0
    state_backups: int = 0
    state_puts: int = 0
    states_prefetched: int = 0
    refused: int = 0  # backups / puts / prefetches skipped: in-flight bound or no host room


def wait_for_prefetch(req: Req, start: Callable[[Req, float], PrefetchTracker | None]) -> bool:
    """Whether ``req`` should wait for its L3 prefetch, started by ``start(req, now)`` on the first
    call (None: no prefetch pays, do not wait); the tracker's stop policy decides after that."""
    t: PrefetchTracker | None = req.mem.prefetch
    now = time.monotonic()
    if t is None:
        t = start(req, now)
        if t is None:
            return False
    t.expire(now)
    return not t.may_admit(now)


def match_key(req: Req) -> CacheKey:
    """What a request may match: ``req.seq[:req.matchable]`` (all but the last token, whose logits
    are needed; with its prompt still to score, only the positions already scored)."""
    return CacheKey(req.tokens(0, req.matchable), req.cache_salt)
