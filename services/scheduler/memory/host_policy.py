"""Pure policy pieces of the hierarchical cache: write and stop policies, the prefetch decision, and
the one-request prefetch tracker. No tree, no I/O: everything here is decided from numbers.

Write policies (device L1 → host L2, and host L2 → kvstore L3 when L3 is on):

    write_through            every page is backed up as soon as it is cached in the tier above
    write_through_selective  a page is backed up once a match has hit it a second time
    write_back               a page is backed up only when it is evicted from the tier above

Prefetch stop policies (how long an admitted request waits for pages coming from L3):

    best_effort    never wait: admit with whatever is local now
    wait_complete  wait until the fetch has been acknowledged (complete or partial)
    timeout        wait until the acknowledgement or `timeout_s`, whichever comes first

The reservation (the host pages a fetch writes into) is released exactly once, and never while
the worker may still be writing into it: on the worker's acknowledgement, or at once when the fetch
is abandoned before it was ever sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
StopPolicy = Literal["best_effort", "wait_complete", "timeout"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("write_through", "write_through_selective", "write_back")
STOP_POLICIES: tuple[StopPolicy, ...] = ("best_effort", "wait_complete", "timeout")


class DoubleAckError(ValueError):
    """A job (or a prefetch reservation) acknowledged twice, or one this cache never issued."""


def should_prefetch(l3_hit_pages: int, device_hit_pages: int, threshold_pages: int) -> bool:
    """Whether fetching from L3 is worth it: the pages L3 holds beyond the local hit (device plus
    host, in whole pages from the start of the prompt) must reach `threshold_pages` (at least one).

    A small gain is not worth a round trip to the kvstore and a host reservation: recomputing a few
    pages is about as fast and costs no memory while it waits.
    """
    if min(l3_hit_pages, device_hit_pages, threshold_pages) < 0:
        raise ValueError("page counts must be >= 0")
    return l3_hit_pages - device_hit_pages >= max(threshold_pages, 1)


PrefetchState = Literal["pending", "issued", "done", "cancelled"]


class PrefetchTracker:
    """One request's L3 prefetch, from reservation to release. Pure: time is passed in.

        pending ──issue()──▶ issued ──on_done(arrived)──▶ done       release(arrived)
           │                   │ abort() / deadline: the request stops waiting; release still
           │                   ▼ waits for on_done (the worker may be writing the pages)
           └──abort() / expire(now) past the deadline──▶ cancelled   release(0): never sent

    `release` is called exactly once (a second acknowledgement raises DoubleAckError); with the
    hierarchical cache it is `lambda n: cache.prefetch_done(job, n)`, which keeps the `n` pages
    that arrived and frees the rest of the reservation.
    """

    __slots__ = ("_release", "aborted", "arrived", "deadline", "pages", "policy", "state")

    def __init__(
        self,
        pages: int,
        policy: StopPolicy,
        *,
        now: float,
        timeout_s: float,
        release: Callable[[int], object],
    ) -> None:
        if policy not in STOP_POLICIES:
            raise ValueError(f"unknown prefetch stop policy {policy!r}")
        if pages < 1:
            raise ValueError(f"a prefetch needs at least one page, got {pages}")
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.pages = pages
        self.policy: StopPolicy = policy
        self.deadline = now + timeout_s
        self.state: PrefetchState = "pending"
        self.arrived = 0
        self.aborted = False
        self._release = release

    @property
    def released(self) -> bool:
        return self.state in ("done", "cancelled")

    @property
    def should_issue(self) -> bool:
        """Whether the fetch op should still be put in a step (not abandoned, not yet sent)."""
        return self.state == "pending"

    def issue(self) -> None:
        """The fetch op has been put in a step: from now on only the worker's ack releases."""
        if self.state != "pending":
            raise ValueError(f"cannot issue a prefetch that is {self.state}")
        self.state = "issued"

    def on_done(self, arrived: int) -> None:
        """The worker acknowledged the fetch: the first `arrived` pages were written."""
        if self.state != "issued":
            raise DoubleAckError(f"prefetch acknowledged while {self.state}")
        if not 0 <= arrived <= self.pages:
            raise ValueError(f"arrived={arrived} outside [0, {self.pages}]")
        self.arrived = arrived
        self.state = "done"
        self._release(arrived)

    def abort(self) -> None:
        """The request went away. An unsent fetch is cancelled now; a sent one releases on its ack."""
        self.aborted = True
        if self.state == "pending":
            self._cancel()

    def expire(self, now: float) -> bool:
        """Past the deadline, cancel a fetch that was never sent; True when this call released."""
        if self.state == "pending" and now >= self.deadline:
            self._cancel()
            return True
        return False

    def may_admit(self, now: float) -> bool:
        """Whether the request may be admitted now, with what is local (arrived pages included)."""
        if self.aborted:
            return False
        if self.policy == "best_effort" or self.released:
            return True
        return self.policy == "timeout" and now >= self.deadline

    def _cancel(self) -> None:
        self.state = "cancelled"
        self._release(0)
