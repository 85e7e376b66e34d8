"""The jobs of the host and L3 tiers (see ``memory/host_tier.py``): a *group* is one
backup, put or prefetch — a pages op and / or a state op, acknowledged separately by the worker
and finished when both are. Pure: ``group_ops`` turns a group into step ops, ``land`` applies its
acknowledgements to the host indexes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from services.common.step import CacheOp, HostBackup, L3Get, L3Put, StateBackup
from services.scheduler.memory.base import CacheHandle
from services.scheduler.memory.host_index import HostIndex
from services.scheduler.memory.host_policy import PrefetchTracker


@dataclass(slots=True)
class Group:
    """One backup, put or prefetch: a pages op and/or a state op, finished when both are acked."""

    kind: Literal["backup", "put", "prefetch"]
    keys: list[bytes]  # page keys, in order
    pages: list[int]  # their host pages (reserved for backup / prefetch)
    skey: bytes | None  # the state's key, when a state takes part
    state: int | None  # its host state slot
    kv_job: int = 0
    state_job: int = 0
    waiting: int = 0  # ops sent and not yet acknowledged
    kv_done: int = 0  # pages the pages op wrote or stored
    state_ok: bool = False
    node: CacheHandle | None = None  # backup: the device node locked until acked
    pins: list[bytes] = field(default_factory=list)  # host page keys pinned until acked
    spins: list[bytes] = field(default_factory=list)  # host state keys pinned until acked
    tracker: PrefetchTracker | None = None
    put_sent: bool = False  # backup: its put went in the same step (``host_writes``)


def group_ops(
    g: Group, ids: Iterator[int], *, get: bool = False, backup_slots: tuple[tuple[int, ...], int] | None = None
) -> list[CacheOp]:
    """The group's ops, pages first, then the state; sets its job ids and ``waiting``. A backup
    passes ``backup_slots`` = (the pages' device slots, the state's device slot); a prefetch
    ``get``; otherwise the group is a put."""
    ops: list[CacheOp] = []
    if g.pages:
        g.kv_job = next(ids)
        if backup_slots is not None:
            ops.append(HostBackup(g.kv_job, backup_slots[0], tuple(g.pages)))
        elif get:
            ops.append(L3Get(g.kv_job, tuple(g.keys), tuple(g.pages)))
        else:
            ops.append(L3Put(g.kv_job, tuple(g.pages), tuple(g.keys)))
    if g.state is not None and g.skey is not None:
        g.state_job = next(ids)
        if backup_slots is not None:
            ops.append(StateBackup(g.state_job, (backup_slots[1],), (g.state,)))
        elif get:
            ops.append(L3Get(g.state_job, (g.skey,), (g.state,), states=True))
        else:
            ops.append(L3Put(g.state_job, (g.state,), (g.skey,), states=True))
    g.waiting = len(ops)
    return ops


def land(g: Group, pages: HostIndex, states: HostIndex) -> tuple[int, bool]:
    """Apply a finished group to the host indexes; returns (pages done, state done). A backup or
    prefetch indexes what arrived (the leading pages; the state only with every page before it)
    and releases the rest of its reservation; a put marks what was stored as in L3. Pins go.

    A put sent with its backup lands right after it (same step, later op): its pages are indexed
    by then. One that finds an entry gone (a failed step, a reset) marks nothing for it."""
    got = g.kv_done
    state_ok = g.state_ok and (g.kind != "prefetch" or got == len(g.pages))
    if g.kind == "put":
        marked = 0
        for k in g.keys[:got]:
            entry = pages.get(k)
            if entry is not None:
                entry.l3 = True
                marked += 1
        got = marked
        sentry = states.get(g.skey) if state_ok and g.skey is not None else None
        if sentry is not None:
            sentry.l3 = True
        state_ok = sentry is not None
    else:
        for k, p in reversed(list(zip(g.keys[:got], g.pages[:got], strict=True))):
            pages.add(k, p)
        pages.release(g.pages[got:])
        if g.state is not None and g.skey is not None:
            if state_ok:
                states.add(g.skey, g.state)
            else:
                states.release([g.state])
    pages.unpin(g.pins)
    states.unpin(g.spins)
    return got, state_ok
