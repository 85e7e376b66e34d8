"""One memory budget shared by several workers' schedulers (separate processes), kept in etcd.

Each member (a scheduler with elastic pools) publishes, under its own lease,

    /strata/v1/budgets/<name>/members/<member>  ->  {"claim", "held", "floor", "want", "min", "busy"}

where ``claim`` is the bytes it may commit and ``held`` what it has committed (its worker's pool
capacities as sent). Every ``period_s`` it reads all entries, computes its share by
``orchestrator.split_shares`` (floors, wants, the spare to busy members),
and moves its claim towards that share: never below what it holds (a shrink is lazy; the claim
follows once the worker has released), and otherwise never above ``total - Σ others' claims``. Every write
is a compare-and-swap on ``/strata/v1/budgets/<name>/gen`` (bumped by each write), so two members
never grow into the same free bytes: **Σ claims ≤ total** at every revision, and each member
commits at most its claim, so the workers together never pass the budget. (The one exception is
a member whose worker already holds more than is free when it joins — its pools at start are
outside the ledger's control — so start workers small; the claim then tells the truth.)

A member that dies loses its lease and its entry (its worker's memory went with it, or the
worker is serving nobody). A member that cannot reach etcd keeps its last claim (it may not grow
beyond it). The scheduler reads ``granted`` (its claim) each plan and gives it to its orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict, dataclass

import aetcd

from services.common.discovery import connect
from services.scheduler.orchestrator import Share, split_shares

log = logging.getLogger(__name__)

PREFIX = "/strata/v1/budgets/"


@dataclass(frozen=True, slots=True)
class Entry:
    claim: int
    held: int
    floor: int
    want: int
    min: int
    busy: bool

    def share(self) -> Share:
        return Share(self.floor, self.want, self.claim, self.min, self.busy)


class BudgetLedger:
    """This scheduler's membership of the shared budget ``name`` of ``total_bytes``."""

    def __init__(
        self, etcd: str, name: str, member: str, total_bytes: int, *, period_s: float = 0.25, ttl_s: int = 5
    ) -> None:
        if not name or "/" in name or not member or "/" in member:
            raise ValueError(f"budget name and member must be non-empty without '/': {name!r}, {member!r}")
        self.name, self.member, self.total_bytes = name, member, total_bytes
        self._client = connect(etcd)
        self._gen_key = f"{PREFIX}{name}/gen".encode()
        self._members = f"{PREFIX}{name}/members/"
        self._key = f"{self._members}{member}".encode()
        self._period_s, self._ttl_s = period_s, ttl_s
        self._lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.granted = 0  # bytes this member may commit (its published claim)
        self._local = Entry(0, 0, 0, 0, 0, False)  # the latest report, claim unused
        self.syncs = self.conflicts = 0

    async def start(self) -> None:
        """Take a lease and keep the entry in sync every ``period_s`` until ``stop``."""
        lease = await self._client.lease(self._ttl_s)
        self._lease = lease.id
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease is not None:
            with contextlib.suppress(aetcd.ClientError):
                await self._client.revoke_lease(self._lease)  # deletes the entry: the bytes are free
        await self._client.close()

    def report(self, *, held: int, floor: int, want: int, min_bytes: int, busy: bool) -> None:
        """This member's numbers now (bytes); published at the next sync."""
        self._local = Entry(0, held, floor, want, min_bytes, busy)

    def update_held(self, held: int) -> None:
        """The worker's commitment changed since ``report`` (a resize was just sent)."""
        e = self._local
        self._local = Entry(0, held, e.floor, e.want, e.min, e.busy)

    async def read(self) -> tuple[dict[str, Entry], int]:
        """Every member's entry and the generation key's mod revision (0 when never written)."""
        entries: dict[str, Entry] = {}
        gen = 0
        for kv in await self._client.get_prefix(f"{PREFIX}{self.name}/".encode()):
            if kv.key == self._gen_key:
                gen = kv.mod_revision
            elif kv.key.startswith(self._members.encode()):
                try:
                    entries[kv.key.decode()[len(self._members):]] = Entry(**json.loads(kv.value))
                except (TypeError, ValueError):
                    log.warning("ignoring a malformed budget entry %r", kv.key)
        return entries, gen

    async def sync(self) -> bool:
        """One read-compute-CAS round; True when this member's entry was written (on a conflict
        another member wrote first: the claim is left as it was, or lowered, never raised)."""
        entries, gen = await self.read()
        others = [e for m, e in entries.items() if m != self.member]
        me = self._local
        mine = Share(me.floor, me.want, max(me.held, self.granted), me.min, me.busy)
        share = split_shares(self.total_bytes, [mine, *(e.share() for e in others)])[0]
        room = self.total_bytes - sum(e.claim for e in others)
        claim = max(me.held, min(share, room))
        # Lower the local limit before the write is even sent: a plan made meanwhile must not grow
        # into bytes about to be released to the others (plans never interleave with this code).
        self.granted = min(self.granted, claim)
        value = json.dumps(asdict(Entry(claim, me.held, me.floor, me.want, me.min, me.busy))).encode()
        tx = self._client.transactions
        ok, _ = await self._client.transaction(
            compare=[tx.mod(self._gen_key) == gen],
            success=[tx.put(self._gen_key, b""), tx.put(self._key, value, lease=self._lease)],
            failure=[],
        )
        self.syncs += 1
        if ok:
            self.granted = claim
        else:
            self.conflicts += 1
        return bool(ok)

    async def _run(self) -> None:
        refresh_every = max(1, int(self._ttl_s / 3 / self._period_s))
        n = 0
        while True:
            try:
                n += 1
                if n % refresh_every == 0 and self._lease is not None:
                    await self._client.refresh_lease(self._lease)
                await self.sync()
            except Exception as e:  # etcd away: keep the last claim, try again
                log.warning("budget %s: sync failed: %r", self.name, e)
            await asyncio.sleep(self._period_s)
