"""The worker's side of the hierarchical cache: host (L2) and kvstore (L3) step operations.

``HostBackup`` / ``HostLoad`` copy between the device KV pool and the host pool synchronously, in
op order, before the step's forward. ``L3Put`` / ``L3Get`` start in op order on the kvstore port
(the worker's event loop talks to the shards) and run while the forward does; ``HostTier.finish``
waits for them (bounded by ``timeout_s``), writes fetched pages into the host pool and returns one
``JobResult`` per host op, in op order, for the step's result. A put's page bytes are copied when
the op runs, so the transfer never reads host memory a later op may change.

A shard that is down, missing or slow is a failed (or short) job, never a failed step: the
scheduler then treats the pages as not in L3. Only ops that contradict the pools (out-of-range
slots or pages, page counts that do not match) are refused, by ``check_host_op``, before the step
touches anything.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Protocol

from services.common.step import HostBackup, HostLoad, HostOp, JobResult, L3Get, L3Put, StepError
from services.worker.host_cache import HostPool
from services.worker.pools import KVPool

log = logging.getLogger(__name__)

KEY_BYTES = 32  # chained SHA-256 page hashes (services.common.page_hash)


class L3Port(Protocol):
    """Puts and gets on the kvstore shards, callable from the engine's thread."""

    def put(self, pages: list[tuple[bytes, bytes]]) -> concurrent.futures.Future[int]:
        """Resolves to the number of pages stored (fewer when a shard was down)."""
        ...

    def get(self, keys: list[bytes]) -> concurrent.futures.Future[list[bytes | None]]:
        """Resolves to each key's data, None where missing or where its shard is down."""
        ...


def check_host_op(
    op: HostOp, where: str, *, num_slots: int, host_pages: int, page_tokens: int, l3: bool
) -> None:
    """Raise ``StepError`` when ``op`` cannot run on these pools (nothing has been touched yet)."""
    if host_pages == 0:
        raise StepError(f"{where}: this worker has no host pool (start it with --host-cache-bytes)")
    pages = op.host_pages
    if pages and (min(pages) < 0 or max(pages) >= host_pages):
        bad = next(p for p in pages if not 0 <= p < host_pages)
        raise StepError(f"{where}.host_pages: page {bad} outside [0, {host_pages})")
    if isinstance(op, HostBackup | HostLoad):
        if len(op.slots) != len(pages) * page_tokens:
            raise StepError(
                f"{where}: {len(pages)} host pages need {len(pages) * page_tokens} slots "
                f"({page_tokens} per page), got {len(op.slots)}"
            )
        if op.slots and (min(op.slots) < 0 or max(op.slots) >= num_slots):
            bad = next(s for s in op.slots if not 0 <= s < num_slots)
            raise StepError(f"{where}.slots: slot {bad} outside [0, {num_slots})")
        dst: Sequence[int] = pages if isinstance(op, HostBackup) else op.slots
        if len(set(dst)) != len(dst):
            raise StepError(f"{where}: a destination repeats; each page or slot is written once")
        return
    if not l3:
        raise StepError(f"{where}: this worker has no kvstore connection (start it with --l3 and --etcd)")
    if len(op.keys) != len(pages):
        raise StepError(f"{where}: {len(op.keys)} keys for {len(pages)} host pages")
    bad_keys = [i for i, k in enumerate(op.keys) if len(k) != KEY_BYTES]
    if bad_keys:
        raise StepError(f"{where}.keys[{bad_keys[0]}]: a key is {KEY_BYTES} bytes (a page hash)")
    if isinstance(op, L3Get) and len(set(pages)) != len(pages):
        raise StepError(f"{where}: host_pages repeat; each page is written once")


class HostTier:
    """The host pool plus the kvstore port; runs a step's host ops and collects their results."""

    def __init__(self, pool: HostPool, l3: L3Port | None, timeout_s: float = 10.0) -> None:
        self.pool = pool
        self.l3 = l3
        self.timeout_s = timeout_s
        self._results: list[JobResult | None] = []
        self._pending: list[tuple[int, HostOp, concurrent.futures.Future[object]]] = []
        # Figures for metrics and benchmarks.
        self.pages_backed_up = self.pages_loaded = self.pages_put = self.pages_got = 0

    def begin(self) -> None:
        """Start a step: forget what a failed step left (its transfers' results are moot)."""
        for _, _, fut in self._pending:
            fut.cancel()
        self._results, self._pending = [], []

    def run(self, op: HostOp, kv: KVPool) -> None:
        """Execute (device ↔ host) or start (L3) one op; its result comes from ``finish``."""
        if isinstance(op, HostBackup):
            self.pool.backup(kv, op.slots, op.host_pages)
            self.pages_backed_up += len(op.host_pages)
            self._results.append(JobResult(op.job_id, True, len(op.host_pages)))
        elif isinstance(op, HostLoad):
            self.pool.load(kv, op.host_pages, op.slots)
            self.pages_loaded += len(op.host_pages)
            self._results.append(JobResult(op.job_id, True, len(op.host_pages)))
        else:
            assert self.l3 is not None  # validated
            fut: concurrent.futures.Future[object]
            if isinstance(op, L3Put):
                data = [(k, bytes(self.pool.page_bytes(p))) for k, p in zip(op.keys, op.host_pages, strict=True)]
                fut = self.l3.put(data)  # type: ignore[assignment]
            else:
                fut = self.l3.get(list(op.keys))  # type: ignore[assignment]
            self._pending.append((len(self._results), op, fut))
            self._results.append(None)

    def finish(self) -> list[JobResult]:
        """Wait for the L3 transfers started by ``run`` and return every op's result, in order."""
        for i, op, fut in self._pending:
            try:
                value = fut.result(timeout=self.timeout_s)
            except Exception as e:  # a slow or broken store: the job failed, the step did not
                fut.cancel()
                log.warning("%s job %d failed: %r", type(op).__name__, op.job_id, e)
                self._results[i] = JobResult(op.job_id, False, 0)
                continue
            if isinstance(op, L3Put):
                stored = int(value)  # type: ignore[call-overload]
                self.pages_put += stored
                self._results[i] = JobResult(op.job_id, stored == len(op.keys), stored)
            else:
                assert isinstance(op, L3Get) and isinstance(value, list)
                got = self._write_leading(op, value)
                self._results[i] = JobResult(op.job_id, got == len(op.keys), got)
        out = [r for r in self._results if r is not None]
        assert len(out) == len(self._results)
        self._results, self._pending = [], []
        return out

    def _write_leading(self, op: L3Get, data: list[bytes | None]) -> int:
        """Write the leading run of fetched pages of the right size; a missing or damaged page
        ends it."""
        n = 0
        size = self.pool.bytes_per_page
        for page, blob in zip(op.host_pages, data, strict=True):
            if blob is None or len(blob) != size:
                if blob is not None:
                    log.warning("L3 page of %d bytes for job %d, expected %d: treated as missing",
                                len(blob), op.job_id, size)
                break
            self.pool.write_page(page, blob)
            n += 1
        self.pages_got += n
        return n
