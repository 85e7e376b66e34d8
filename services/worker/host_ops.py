"""The worker's side of the hierarchical cache: host (L2) and kvstore (L3) step operations.

``HostBackup`` / ``HostLoad`` copy between the device KV pool and the host pool synchronously, in
op order, before the step's forward; ``StateBackup`` / ``StateLoad`` do the same between the
device Mamba pool and the host state pool (hybrid models). ``L3Put`` / ``L3Get`` start in op order
on the kvstore port (the worker's event loop talks to the shards) and run while the forward does;
``HostOpRunner.finish`` waits for them (bounded by ``timeout_s``), writes fetched pages (or states,
``states=True``) into the host pools and returns one ``JobResult`` per host op, in op order, for
the step's result. A put's bytes are copied when the op runs, so the transfer never reads host
memory a later op may change.

A shard that is down, missing or slow is a failed (or short) job, never a failed step: the
scheduler then treats the pages as not in L3. Only ops that contradict the pools (out-of-range
slots or pages, page counts that do not match) are refused, by ``check_host_op``, before the step
touches anything.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from services.common.page_hash import rank_key
from services.common.step import (
    HostBackup,
    HostLoad,
    HostOp,
    JobResult,
    L3Get,
    L3Put,
    StateBackup,
    StateLoad,
    StepError,
)
from services.worker.host_cache import HostPool
from services.worker.host_states import HostStatePool
from services.worker.pools import KVPool

if TYPE_CHECKING:
    from services.worker.mamba_pool import MambaPool

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


NO_STATE_POOL = "this worker has no host state pool (a hybrid model started with --host-cache-bytes has one)"


def check_host_op(
    op: HostOp,
    where: str,
    *,
    num_slots: int,
    host_pages: int,
    page_tokens: int,
    l3: bool,
    num_mamba_slots: int = 0,
    host_states: int = 0,
) -> None:
    """Raise ``StepError`` when ``op`` cannot run on these pools (nothing has been touched yet).

    ``num_slots`` / ``num_mamba_slots``: the device pools' capacities at this point of the step;
    ``host_pages`` / ``host_states``: the host pools' sizes (0 = no such pool)."""
    if isinstance(op, StateBackup | StateLoad):
        _check_state_op(op, where, num_mamba_slots=num_mamba_slots, host_states=host_states)
        return
    if isinstance(op, L3Put | L3Get) and op.states:
        if host_states == 0:
            raise StepError(f"{where}.states: {NO_STATE_POOL}")
        _indices(op.host_pages, host_states, f"{where}.host_pages", "host state", " (states=True)")
    else:
        if host_pages == 0:
            raise StepError(f"{where}: this worker has no host pool (start it with --host-cache-bytes)")
        _indices(op.host_pages, host_pages, f"{where}.host_pages", "page")
    pages = op.host_pages
    if isinstance(op, HostBackup | HostLoad):
        if len(op.slots) != len(pages) * page_tokens:
            raise StepError(
                f"{where}: {len(pages)} host pages need {len(pages) * page_tokens} slots "
                f"({page_tokens} per page), got {len(op.slots)}"
            )
        _indices(op.slots, num_slots, f"{where}.slots", "slot")
        dst: Sequence[int] = pages if isinstance(op, HostBackup) else op.slots
        if len(set(dst)) != len(dst):
            raise StepError(f"{where}: a destination repeats; each page or slot is written once")
        return
    if not l3:
        raise StepError(f"{where}: this worker has no kvstore connection (start it with --l3 and --etcd)")
    what = "host states" if op.states else "host pages"
    if len(op.keys) != len(pages):
        raise StepError(f"{where}: {len(op.keys)} keys for {len(pages)} {what}")
    bad_keys = [i for i, k in enumerate(op.keys) if len(k) != KEY_BYTES]
    if bad_keys:
        raise StepError(f"{where}.keys[{bad_keys[0]}]: a key is {KEY_BYTES} bytes (a page hash)")
    if isinstance(op, L3Get) and len(set(pages)) != len(pages):
        unit = "host state" if op.states else "page"
        raise StepError(f"{where}: host_pages repeat; each {unit} is written once")


def _check_state_op(op: StateBackup | StateLoad, where: str, *, num_mamba_slots: int, host_states: int) -> None:
    if host_states == 0:
        raise StepError(f"{where}: {NO_STATE_POOL}")
    if len(op.slots) != len(op.host_states):
        raise StepError(
            f"{where}: {len(op.host_states)} host states need as many Mamba slots, got {len(op.slots)}"
        )
    _indices(op.host_states, host_states, f"{where}.host_states", "host state")
    _indices(op.slots, num_mamba_slots, f"{where}.slots", "Mamba slot")
    field, dst = ("host_states", op.host_states) if isinstance(op, StateBackup) else ("slots", op.slots)
    seen: set[int] = set()
    for x in dst:
        if x in seen:
            raise StepError(f"{where}.{field}: {x} repeats; each destination is written once")
        seen.add(x)


def _indices(values: Sequence[int], size: int, field: str, what: str, note: str = "") -> None:
    if values and (min(values) < 0 or max(values) >= size):
        bad = next(v for v in values if not 0 <= v < size)
        raise StepError(f"{field}: {what} {bad} outside [0, {size}){note}")


class HostOpRunner:
    """The host pools plus the kvstore port; runs a step's host ops and collects their results.

    ``states``: the host state pool of a hybrid model (None on dense models: state ops and
    ``states=True`` L3 ops are then refused by ``check_host_op`` before they reach ``run``)."""

    def __init__(
        self,
        pool: HostPool,
        l3: L3Port | None,
        timeout_s: float = 10.0,
        states: HostStatePool | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """``tp_rank`` / ``tp_size``: a tensor-parallel rank stores and fetches its shards under
        its own keys (``page_hash.rank_key``)."""
        self.pool = pool
        self.l3 = l3
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeout_s = timeout_s
        self.states = states
        self._results: list[JobResult | None] = []
        self._pending: list[tuple[int, HostOp, concurrent.futures.Future[object]]] = []
        # Figures for metrics and benchmarks.
        self.pages_backed_up = self.pages_loaded = self.pages_put = self.pages_got = 0
        self.states_backed_up = self.states_loaded = self.states_put = self.states_got = 0

    def begin(self) -> None:
        """Start a step: forget what a failed step left (its transfers' results are moot)."""
        for _, _, fut in self._pending:
            fut.cancel()
        self._results, self._pending = [], []

    def run(self, op: HostOp, kv: KVPool, mamba: MambaPool | None = None) -> None:
        """Execute (device ↔ host) or start (L3) one op; its result comes from ``finish``.

        ``mamba``: the device Mamba pool, needed by ``StateBackup`` / ``StateLoad`` (which read or
        write it as the ops before them in the step left it)."""
        if isinstance(op, StateBackup | StateLoad):
            assert self.states is not None and mamba is not None  # validated
            if isinstance(op, StateBackup):
                self.states.backup(mamba, op.slots, op.host_states)
                self.states_backed_up += len(op.host_states)
            else:
                self.states.load(op.host_states, mamba, op.slots)
                self.states_loaded += len(op.host_states)
            self._results.append(JobResult(op.job_id, True, len(op.host_states)))
        elif isinstance(op, HostBackup):
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
                read = self._state_pool().state_bytes if op.states else self.pool.page_bytes
                data = [(self._key(k), bytes(read(p))) for k, p in zip(op.keys, op.host_pages, strict=True)]
                fut = self.l3.put(data)  # type: ignore[assignment]
            else:
                fut = self.l3.get([self._key(k) for k in op.keys])  # type: ignore[assignment]
            self._pending.append((len(self._results), op, fut))
            self._results.append(None)

    def _key(self, key: bytes) -> bytes:
        return rank_key(key, self.tp_rank, self.tp_size)  # rank 0 (and one rank) keeps the key as is

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
                if op.states:
                    self.states_put += stored
                else:
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
        """Write the leading run of fetched pages (or states) of the right size; a missing or
        damaged one ends it."""
        write: Callable[[int, bytes], None]
        if op.states:
            states = self._state_pool()
            size, write, unit = states.bytes_per_state, states.write_state, "state"
        else:
            size, write, unit = self.pool.bytes_per_page, self.pool.write_page, "page"
        n = 0
        for page, blob in zip(op.host_pages, data, strict=True):
            if blob is None or len(blob) != size:
                if blob is not None:
                    log.warning("L3 %s of %d bytes for job %d, expected %d: treated as missing",
                                unit, len(blob), op.job_id, size)
                break
            write(page, blob)
            n += 1
        if op.states:
            self.states_got += n
        else:
            self.pages_got += n
        return n

    def _state_pool(self) -> HostStatePool:
        assert self.states is not None  # validated: states=True ops need a host state pool
        return self.states
