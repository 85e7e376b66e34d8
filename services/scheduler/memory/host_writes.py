"""The host tier's writes (``host_tier.py``): backups by the write policy (a prefix entering the
tree, a second hit, or a device eviction under write_back), L3 puts, and what a finished group does
to the host indexes, the tree and the counters. Functions over the tier, kept apart so admission
and prefetch read without them.

With L3, a backup's put goes in the same step, right after it: the worker runs a step's host ops
in order, so the put reads the host pages the backup has just written (its bytes are snapshotted
there and then), and both are acknowledged with that step. A prefill replica hands a request over
once its prompt is in L3 (``HostTierPlanner.in_l3``): that is one step after its pages enter the
tree, not two. When the in-flight bound leaves no room for the put, it follows the backup's
acknowledgement instead, as a put of the pages then on the host."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from services.common.step import CacheOp
from services.scheduler.memory.base import CacheHandle, CacheKey
from services.scheduler.memory.host_jobs import Group, land

if TYPE_CHECKING:
    from services.scheduler.memory.host_tier import HostTierPlanner


def want(t: HostTierPlanner, key: CacheKey) -> None:
    """Back ``key``'s pages (and the state at its end) up with the next step."""
    m = t.tree.match(key, touch=False)
    if m.length != len(key.tokens) or (t.states is not None and m.state is None):
        return
    if t.full():
        t.counters.refused += 1
        return
    t.tree.lock(m.node)
    t.backlog.append((m.node, key, m.state))


def evicted(
    t: HostTierPlanner, extra: str, tokens: array[int], start: int, slots: list[int], state: int | None
) -> None:
    """write_back: the tree removes ``tokens[start:]`` (its ``slots``) and the state after it:
    copy what the host lacks before the slots can be reused (``first_ops``)."""
    ps = t.tree_page
    keys = t.hashes(CacheKey(tokens, extra))
    have = {i for i in range(start // ps, len(keys)) if keys[i] in t.kv_host or keys[i] in t.incoming}
    missing = [i for i in range(start // ps, len(keys)) if i not in have] if slots else []
    skey = t.skey(keys[-1]) if state is not None and keys else None
    if skey is not None and (skey in t.state_host or skey in t.incoming):
        skey = None
    if missing or skey is not None:
        dev = tuple(s for i in missing for s in slots[(i * ps - start) : (i + 1) * ps - start])
        _backup(t, keys, missing, skey, dev, state, t.first_ops, node=None)


def _backup(t: HostTierPlanner, keys: list[bytes], missing: list[int], skey: bytes | None, dev: tuple[int, ...],
            state: int | None, ops: list[CacheOp], node: CacheHandle | None) -> bool:
    """Reserve host room for pages ``missing`` (device ``dev``) and the state, and send."""
    if t.full() and node is None:
        t.counters.refused += 1
        return False
    pages = t.kv_host.reserve(len(missing))
    hs = t.state_host.reserve(1) if skey is not None and pages is not None else []
    if pages is None or hs is None:  # no host room that is not pinned
        if pages:
            t.kv_host.release(pages)
        t.counters.refused += 1
        return False
    g = Group("backup", [keys[i] for i in missing], pages, skey if hs else None, hs[0] if hs else None)
    g.node = node
    t.incoming.update(g.keys)
    if g.skey is not None:
        t.incoming.add(g.skey)
    t.send(g, ops, backup_slots=(dev, state if state is not None else -1))
    if t.l3 and not t.full():  # the put of what this backup writes, in the same step (module docstring)
        g.put_sent = True
        t.send(Group("put", g.keys, g.pages, g.skey, g.state), ops)
    return True


def start_backup(t: HostTierPlanner, node: CacheHandle, key: CacheKey, state: int | None, ops: list[CacheOp]) -> None:
    ps = t.tree_page
    keys = t.hashes(key)
    skey = t.skey(keys[-1]) if state is not None else None
    missing = [i for i, k in enumerate(keys) if k not in t.kv_host and k not in t.incoming]
    if skey is not None and (skey in t.state_host or skey in t.incoming):
        skey = None
    slots = t.tree.kv_path(key)
    assert len(slots) == len(key.tokens), "a locked node keeps its path"
    dev = tuple(s for i in missing for s in slots[i * ps : (i + 1) * ps])
    if not (missing or skey is not None) or not _backup(t, keys, missing, skey, dev, state, ops, node):
        t.tree.unlock(node)  # the host has it all or is getting it, or there is no room


def start_put(t: HostTierPlanner, keys: list[bytes], skey: bytes | None, ops: list[CacheOp]) -> None:
    keys = [k for k in keys if (e := t.kv_host.get(k)) is not None and not e.l3]
    se = t.state_host.get(skey) if skey is not None else None
    if se is not None and se.l3:
        se = None
    if not keys and se is None:
        return
    if t.full():
        t.counters.refused += 1
        return
    g = Group("put", keys, [t.kv_host.get(k).index for k in keys],  # type: ignore[union-attr]
              skey if se is not None else None, se.index if se is not None else None)
    g.pins = t.kv_host.pin(keys)
    g.spins = t.state_host.pin([skey]) if se is not None and skey is not None else []
    t.send(g, ops)


def finish(t: HostTierPlanner, g: Group) -> None:
    t.busy -= 1
    got, state_ok = land(g, t.kv_host, t.state_host)
    c = t.counters
    if g.kind == "put":
        c.put_pages += got
        c.state_puts += state_ok
    elif g.kind == "backup":
        t.incoming.difference_update(g.keys)
        t.incoming.discard(g.skey or b"")
        if g.node is not None:
            t.tree.unlock(g.node)
        c.backup_pages += got
        c.state_backups += state_ok
        if t.l3 and (got or state_ok) and not g.put_sent:
            t.puts.append((g.keys[:got], g.skey if state_ok else None))
    elif g.kind == "prefetch":
        c.prefetched_pages += got
        c.states_prefetched += state_ok
        assert g.tracker is not None
        g.tracker.on_done(got + state_ok)
