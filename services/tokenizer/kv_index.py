"""Which scheduler holds which pages, and which one a request should go to.

Each scheduler streams the keys of the pages its cache holds (``Scheduler/WatchCache``: a
snapshot, then stored / removed batches with consecutive ids, and its load). ``KvIndex`` keeps one
global map page key → replicas holding it, kept from those streams. A request's overlap with a
replica is the number of its leading pages that replica holds, computed with that replica's keying
(page size, model fingerprint, layout) and the request's cache salt, so salts never match each
other's pages.

The choice (``choose``) minimises, over the replicas, an estimate of the work a request waits for,
in tokens of prefill:

    cost(r) = 2 × (prompt − overlap(r))                  the prompt tokens r would compute
            + max(0, queued(r) − expected(r))            the prefill queued on r that is not for
                                                         this request's own prefix
            + load_weight × running(r)                   requests in flight on r (each slows
                                                         every step)

``queued(r)``: the uncached prompt tokens this router sent r that have not started (no first token
yet); ``running(r)``: the larger of r's last report and what this router has in flight there.
Computing counts twice (``RECOMPUTE_WEIGHT``): the request waits for it, and so does every other
request on that replica, while waiting behind work already queued adds nothing to the cluster's
load. With weight 1, a group whose replica is busy with another group's prefill would recompute
its shared prefix on an idle replica (measured: 93 % of a single replica's hit rate on the shared
prefix bench instead of 95 %+).

A request the ``kv`` policy sends somewhere also marks its prompt's pages as *expected* there
for ``EXPECT_S``: the pages reach the index only once that replica has prefilled them, and a
second request with the same prefix routed in the meantime (a group sharing a system prompt, sent
at once) should follow the first, where the scheduler holds it until the prefix is cached, rather
than compute it again elsewhere. ``expected(r)`` is the part of the overlap that is only expected:
the queued work that computes it is work this request would otherwise do itself, so it does not
count against r. An expectation ends when it expires (the real events have long arrived by then,
or the request failed).

Policies: ``kv`` (the cost above), ``least_load`` (the cost with no overlap term), ``round_robin``.
Ties go round-robin, so equal replicas share the load. Pure: no I/O; the caller passes the clock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.common.page_hash import PageKeying

Policy = Literal["kv", "round_robin", "least_load"]
POLICIES: tuple[Policy, ...] = ("kv", "round_robin", "least_load")
DEFAULT_LOAD_WEIGHT = 32.0  # prompt tokens one running request weighs as
RECOMPUTE_WEIGHT = 2.0  # see the module docstring
EXPECT_S = 30.0  # how long a routed prompt's pages count as held by its replica before its events


@dataclass(slots=True)
class Replica:
    """What the router knows of one scheduler."""

    address: str
    epoch: int = 0
    event_id: int = 0
    keying: PageKeying | None = None  # None until its first snapshot
    pages: set[bytes] = field(default_factory=set)
    running: int = 0  # from its last load report
    sent_tokens: int = 0  # prompt tokens this router sent it that have not started (no first token)
    sent_running: int = 0  # requests this router sent it that have not finished

    @property
    def queued(self) -> int:
        # This router's own estimate of uncached prefill, not the replica's waiting requests: those
        # count whole prompts, so a group held back behind its shared prefix would look like a
        # queue of prefill work.
        return self.sent_tokens

    @property
    def busy(self) -> int:
        return max(self.running, self.sent_running)


@dataclass(frozen=True, slots=True)
class Choice:
    address: str
    overlap_tokens: int  # predicted cached prompt tokens on that replica
    cost: float


class KvIndex:
    def __init__(self) -> None:
        self.replicas: dict[str, Replica] = {}
        self._holders: dict[bytes, set[str]] = {}
        self._expected: dict[bytes, set[str]] = {}  # pages routed to a replica, not yet reported
        self._expiry: deque[tuple[float, str, list[bytes]]] = deque()

    # -- keeping it -------------------------------------------------------------------------------
    def replica(self, address: str) -> Replica:
        r = self.replicas.get(address)
        if r is None:
            r = self.replicas[address] = Replica(address)
        return r

    def apply(
        self,
        address: str,
        *,
        epoch: int,
        event_id: int,
        snapshot: bool,
        stored: Iterable[bytes],
        removed: Iterable[bytes],
        keying: PageKeying | None = None,
    ) -> bool:
        """Apply one batch from ``address``'s stream. False when it does not follow the last one
        (a gap in the ids, or another epoch): the caller should subscribe again for a snapshot;
        the replica's pages are then unknown (cleared) until it comes."""
        r = self.replica(address)
        if snapshot:
            self._clear(r)
            r.epoch, r.event_id, r.keying = epoch, event_id, keying
            self._add(r, stored)
            return True
        if epoch != r.epoch or r.keying is None:
            self._clear(r)
            return False
        if event_id == r.event_id:  # a load report
            return True
        if event_id != r.event_id + 1:
            self._clear(r)
            return False
        r.event_id = event_id
        self._add(r, stored)
        for key in removed:
            r.pages.discard(key)
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._holders[key]
        return True

    def _add(self, r: Replica, keys: Iterable[bytes]) -> None:
        for key in keys:
            r.pages.add(key)
            self._holders.setdefault(key, set()).add(r.address)

    def _clear(self, r: Replica) -> None:
        for key in r.pages:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(r.address)
                if not holders:
                    del self._holders[key]
        r.pages = set()
        r.keying = None

    def unknown(self, address: str) -> None:
        """``address``'s pages are no longer known (its stream broke): route to it by load only."""
        self._clear(self.replica(address))

    def expect(self, address: str, keys: list[bytes], now: float, ttl_s: float = EXPECT_S) -> None:
        """``address`` will hold ``keys`` once it has prefilled them: count them as held until
        ``now + ttl_s``."""
        for key in keys:
            self._expected.setdefault(key, set()).add(address)
        self._expiry.append((now + ttl_s, address, keys))

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, address, keys = self._expiry.popleft()
            for key in keys:
                holders = self._expected.get(key)
                if holders is not None:
                    holders.discard(address)
                    if not holders:
                        del self._expected[key]

    def drop(self, address: str) -> None:
        """Forget a replica (it left discovery)."""
        r = self.replicas.pop(address, None)
        if r is not None:
            self._clear(r)

    @property
    def pages(self) -> int:
        return len(self._holders)

    # -- using it ---------------------------------------------------------------------------------
    def prompt_keys(self, addresses: Sequence[str], tokens: Sequence[int], salt: str) -> dict[PageKeying, list[bytes]]:
        """The prompt's page keys under each keying these replicas use (hashed once per keying)."""
        keyings = {r.keying for a in addresses if (r := self.replicas.get(a)) is not None and r.keying is not None}
        return {k: k.keys(tokens, salt) for k in keyings}

    def overlaps(
        self,
        addresses: Sequence[str],
        tokens: Sequence[int],
        salt: str,
        expected: bool = True,
        keys: dict[PageKeying, list[bytes]] | None = None,
    ) -> dict[str, int]:
        """Predicted cached prompt tokens on each replica: its leading pages in the index, with
        the pages expected there unless ``expected`` is False (never the whole prompt: the last
        token is always computed). ``keys``: ``prompt_keys`` of the same request, when known."""
        out = dict.fromkeys(addresses, 0)
        by_keying: dict[PageKeying, list[str]] = {}
        for a in addresses:
            r = self.replicas.get(a)
            if r is not None and r.keying is not None:
                by_keying.setdefault(r.keying, []).append(a)
        for keying, group in by_keying.items():
            alive = set(group)
            matched = 0
            for key in keys[keying] if keys is not None else keying.keys(tokens, salt):
                holders = self._holders.get(key, _NONE)
                if expected:
                    holders = holders | self._expected.get(key, _NONE)
                if not holders:
                    break
                still = alive & holders
                for a in alive - still:
                    out[a] = matched * keying.page_tokens
                alive = still
                if not alive:
                    break
                matched += 1
            for a in alive:
                out[a] = matched * keying.page_tokens
        cap = max(len(tokens) - 1, 0)
        return {a: min(n, cap) for a, n in out.items()}


_NONE: frozenset[str] = frozenset()


class Chooser:
    """Applies a policy over the index; keeps the round-robin position for ties."""

    def __init__(self, index: KvIndex, policy: Policy = "kv", load_weight: float = DEFAULT_LOAD_WEIGHT) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.index = index
        self.policy = policy
        self.load_weight = load_weight
        self._rr = itertools.count()

    def choose(self, addresses: Sequence[str], tokens: Sequence[int], salt: str = "", now: float = 0.0) -> Choice:
        """The replica for a prompt of ``tokens`` (``now``: the caller's monotonic clock, for the
        expected pages of earlier choices)."""
        if not addresses:
            raise ValueError("no replica to choose from")
        self.index.expire(now)
        turn = next(self._rr)
        if self.policy == "round_robin" or len(addresses) == 1:
            a = addresses[turn % len(addresses)]
            overlap = self.index.overlaps([a], tokens, salt)[a] if self.policy != "round_robin" else 0
            return Choice(a, overlap, 0.0)
        overlaps = reported = dict.fromkeys(addresses, 0)
        keys = self.index.prompt_keys(addresses, tokens, salt) if self.policy == "kv" else {}
        if self.policy == "kv":
            overlaps = self.index.overlaps(addresses, tokens, salt, keys=keys)
            reported = self.index.overlaps(addresses, tokens, salt, expected=False, keys=keys)
        costs = {a: self.cost(a, len(tokens), overlaps[a], overlaps[a] - reported[a]) for a in addresses}
        best = min(costs.values())
        tied = [a for a in addresses if costs[a] == best]
        a = tied[turn % len(tied)]
        keying = self.index.replicas[a].keying if a in self.index.replicas else None
        if keying is not None and keying in keys:
            self.index.expect(a, keys[keying], now)
        return Choice(a, overlaps[a], best)

    def cost(self, address: str, prompt: int, overlap: int, expected: int = 0) -> float:
        r = self.index.replicas.get(address) or Replica(address)
        return RECOMPUTE_WEIGHT * (prompt - overlap) + max(r.queued - expected, 0) + self.load_weight * r.busy
