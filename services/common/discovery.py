"""Service discovery and model metadata in etcd (client: ``aetcd``).

Layout (DESIGN.md §2):

    /strata/v1/services/<kind>/<instance-id>  -> ServiceRecord JSON, attached to the instance's lease
    /strata/v1/models/<name>                  -> ModelRecord JSON, written once by the first claimant

Failure model:
- ``Registration`` keeps its key alive with a lease refreshed every ttl/3. A lost lease (expired,
  revoked, or etcd restarted without its data) is noticed at the next refresh and replaced by a new
  lease and a new put, in the same process. While etcd is unreachable it retries with capped backoff
  and logs once per outage.
- ``Discovery`` serves the last membership it saw while etcd is unreachable, and on reconnect
  re-reads the prefix before watching again from the revision of that read, so no event is missed.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aetcd

from services.common import tls
from services.common.errors import FailedPrecondition

log = logging.getLogger(__name__)

SERVICES_PREFIX = "/strata/v1/services/"
MODELS_PREFIX = "/strata/v1/models/"

# A restarted etcd must be found within about a second, not after gRPC's default reconnect backoff
# (which grows to two minutes); keepalive pings notice a hung etcd on a long-lived watch stream.
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
_RPC_TIMEOUT_S = 3.0
_BACKOFF_INITIAL_S = 0.1
_BACKOFF_MAX_S = 2.0

Membership = dict[str, "ServiceRecord"]
OnChange = Callable[[Membership], Awaitable[None] | None]


class FingerprintMismatch(FailedPrecondition):
    """A model name is already claimed in etcd with a different fingerprint."""


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    """One service instance as published in etcd.

    ``capacity`` is free-form numbers (e.g. ``{"kv_pages": 4096}``); it is excluded from hashing.
    """

    kind: str
    instance_id: str
    address: str
    model: str = ""
    role: str = ""
    capacity: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("kind", "instance_id"):
            value = getattr(self, name)
            if not value or "/" in value:
                raise ValueError(f"ServiceRecord.{name} must be non-empty and contain no '/': {value!r}")
        if not self.address:
            raise ValueError(f"ServiceRecord {self.kind}/{self.instance_id} has an empty address")

    @property
    def key(self) -> str:
        return f"{SERVICES_PREFIX}{self.kind}/{self.instance_id}"

    def to_json(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "instance_id": self.instance_id,
                "address": self.address,
                "model": self.model,
                "role": self.role,
                "capacity": self.capacity,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, data: str | bytes) -> ServiceRecord:
        """Parse a record; unknown keys are ignored so newer writers stay readable. Raises ValueError."""
        try:
            obj = json.loads(data)
            return cls(
                kind=str(obj["kind"]),
                instance_id=str(obj["instance_id"]),
                address=str(obj["address"]),
                model=str(obj.get("model", "")),
                role=str(obj.get("role", "")),
                capacity=dict(obj.get("capacity", {})),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed service record {data!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """Model metadata stored once per model name; ``fingerprint`` covers config + weights + tokenizer."""

    name: str
    fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_json(self) -> str:
        obj = {"name": self.name, "fingerprint": self.fingerprint, "meta": self.meta}
        return json.dumps(obj, sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> ModelRecord:
        try:
            obj = json.loads(data)
            return cls(name=str(obj["name"]), fingerprint=str(obj["fingerprint"]), meta=dict(obj["meta"]))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed model record {data!r}: {exc}") from exc


def advertised_address(host: str, port: int, advertise_host: str = "") -> str:
    """The ``host:port`` other services reach this one at, as registered in etcd: ``advertise_host``
    when given; else the listen host, unless it is a wildcard (0.0.0.0, ::, empty), which nobody can
    dial: then this machine's address (a container's or pod's IP)."""
    if advertise_host:
        return f"{advertise_host}:{port}"
    if host not in ("", "0.0.0.0", "::", "[::]"):
        return f"{host}:{port}"
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    return f"{ip}:{port}"


def connect(endpoint: str) -> aetcd.Client:
    """An aetcd client for ``host:port`` (``http://`` accepted); ``https://host:port`` connects over
    TLS with this process's certificates (``tls.etcd_credentials``). Connects lazily."""
    secure = endpoint.startswith("https://")
    hostport = endpoint.removeprefix("https://").removeprefix("http://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port or http(s)://host:port, got {endpoint!r}")
    cls = _TlsClient if secure else aetcd.Client
    # aetcd annotates timeout as int; gRPC takes any float.
    return cls(host, int(port), timeout=_RPC_TIMEOUT_S, options=_CHANNEL_OPTIONS)  # type: ignore[arg-type]


class _TlsClient(aetcd.Client):
    """aetcd 1.0 always opens its channel with ``aetcd.rpc.insecure_channel``; while this client
    connects, that name makes a TLS channel instead. The replacement is process-wide for the
    moment of the call, which is sound because a process has one etcd endpoint (its ``--etcd``):
    every etcd client of a process with an ``https://`` endpoint is one of these."""

    async def connect(self) -> None:
        plain = aetcd.rpc.insecure_channel
        creds = tls.etcd_credentials()

        def secure(target: str, options: Any = None, **kw: Any) -> Any:
            return aetcd.rpc.secure_channel(target, creds, options=options, **kw)

        aetcd.rpc.insecure_channel = secure
        try:
            await super().connect()
        finally:
            aetcd.rpc.insecure_channel = plain


class _Backoff:
    """Doubling delay between retries, capped; ``reset`` after a success."""

    def __init__(self, initial: float = _BACKOFF_INITIAL_S, maximum: float = _BACKOFF_MAX_S) -> None:
        self._initial = initial
        self._maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self._initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        return delay


class Registration:
    """Publishes one ``ServiceRecord`` under a kept-alive lease until ``stop``.

    ``start`` returns once the key is in etcd (or raises ``TimeoutError``); from then on a background
    task refreshes the lease every ``ttl_s / 3`` and re-registers after a lost lease or an outage.
    ``stop`` revokes the lease, which deletes the key at once; a crashed process's key disappears
    when its lease expires, within ``ttl_s`` (etcd rounds the TTL up to whole seconds, minimum 2).
    """

    def __init__(self, endpoint: str, record: ServiceRecord, ttl_s: float = 5.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._client = connect(endpoint)
        self._endpoint = endpoint
        self._record = record
        self._ttl = max(1, math.ceil(ttl_s))
        self._refresh_s = ttl_s / 3
        self._lease_id: int | None = None
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def record(self) -> ServiceRecord:
        return self._record

    @property
    def lease_id(self) -> int | None:
        """The lease currently holding the key, or None between a lost lease and its replacement."""
        return self._lease_id

    async def start(self, timeout: float = 10.0) -> None:
        if self._task is not None:
            raise RuntimeError(f"registration of {self._record.key} already started")
        self._task = asyncio.create_task(self._run(), name=f"etcd-registration:{self._record.key}")
        try:
            await asyncio.wait_for(self._registered.wait(), timeout)
        except TimeoutError:
            await self.stop()
            raise TimeoutError(
                f"could not register {self._record.key} in etcd at {self._endpoint} within {timeout:.1f} s"
            ) from None

    async def update(self, record: ServiceRecord) -> None:
        """Replace the published record (same key, same lease); e.g. when capacity changes.

        Raises ``aetcd.ClientError`` if etcd is unreachable; the new record is still the one put by
        any later re-registration.
        """
        if record.key != self._record.key:
            raise ValueError(f"update must keep the key {self._record.key}, got {record.key}")
        self._record = record
        if self._lease_id is not None:
            await self._client.put(record.key.encode(), record.to_json().encode(), lease=self._lease_id)

    async def __aenter__(self) -> Registration:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop refreshing and revoke the lease (deleting the key); best effort if etcd is down."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                await self._client.revoke_lease(lease_id)
            except aetcd.ClientError as exc:
                # The lease will expire on its own within the TTL.
                log.warning("could not revoke lease key=%s error=%s", self._record.key, exc)
        await self._client.close()

    async def _register(self) -> None:
        lease = await self._client.lease(self._ttl)
        # A failed put leaves an orphan lease that expires by itself; the next attempt takes a new one.
        await self._client.put(self._record.key.encode(), self._record.to_json().encode(), lease=lease.id)
        self._lease_id = lease.id
        self._registered.set()
        log.info("registered key=%s lease=%x ttl_s=%d", self._record.key, lease.id, self._ttl)

    async def _refresh(self, lease_id: int) -> bool:
        """Refresh the lease; False when etcd no longer knows it (keepalive answers TTL 0)."""
        reply = await self._client.refresh_lease(lease_id)
        return reply is not None and reply.TTL > 0

    async def _run(self) -> None:
        # Retry at least as often as we refresh, so a lease etcd kept across its restart is renewed
        # before it expires.
        backoff = _Backoff(maximum=min(_BACKOFF_MAX_S, self._refresh_s))
        outage = False
        while True:
            try:
                if self._lease_id is None:
                    await self._register()
                elif not await self._refresh(self._lease_id):
                    log.warning(
                        "lease lost key=%s lease=%x; re-registering", self._record.key, self._lease_id
                    )
                    self._lease_id = None
                    continue
                if outage:
                    log.info("etcd reachable again key=%s", self._record.key)
                    outage = False
                backoff.reset()
                await asyncio.sleep(self._refresh_s)
            except Exception as exc:
                # Never let the keep-alive die: anything unexpected is retried like an outage, with a trace.
                if not outage:
                    log.warning(
                        "etcd unreachable key=%s error=%s; retrying", self._record.key, exc,
                        exc_info=not isinstance(exc, aetcd.ClientError),
                    )  # fmt: skip
                    outage = True
                await asyncio.sleep(backoff.next())


class Discovery:
    """The live membership of one service kind, kept by a get + watch on its etcd prefix.

    ``on_change`` (sync or async) is called from the watch task with a copy of the new membership
    each time it changes; it should be quick, since events wait for it. Exceptions it raises are logged.
    """

    def __init__(self, endpoint: str, kind: str, on_change: OnChange | None = None) -> None:
        if not kind or "/" in kind:
            raise ValueError(f"kind must be non-empty and contain no '/': {kind!r}")
        self._client = connect(endpoint)
        self._endpoint = endpoint
        self._kind = kind
        self._prefix = f"{SERVICES_PREFIX}{kind}/"
        self._on_change = on_change
        self._members: Membership = {}
        self._changed = asyncio.Condition()
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def members(self) -> Membership:
        """A copy of the current membership: instance id -> record."""
        return dict(self._members)

    async def start(self, timeout: float = 10.0) -> None:
        """Load the prefix and start watching; raises ``TimeoutError`` if etcd cannot be read in time."""
        if self._task is not None:
            raise RuntimeError(f"discovery of {self._prefix} already started")
        self._task = asyncio.create_task(self._run(), name=f"etcd-discovery:{self._prefix}")
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except TimeoutError:
            await self.stop()
            raise TimeoutError(
                f"could not read {self._prefix} from etcd at {self._endpoint} within {timeout:.1f} s"
            ) from None

    async def wait_for(self, n: int, timeout: float) -> Membership:
        """Wait until at least ``n`` instances are known; returns the membership or raises TimeoutError."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: len(self._members) >= n)
        except TimeoutError:
            raise TimeoutError(
                f"{len(self._members)} of {n} '{self._kind}' instances registered after {timeout:.1f} s"
            ) from None
        return self.members()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._client.close()

    async def _run(self) -> None:
        backoff = _Backoff()
        outage = False
        while True:
            try:
                revision = await self._resync()
                watch = await self._client.watch_prefix(self._prefix.encode(), start_revision=revision + 1)
                self._synced.set()
                if outage:
                    log.info("etcd reachable again prefix=%s members=%d", self._prefix, len(self._members))
                    outage = False
                backoff.reset()
                async for event in watch:
                    await self._apply(event)
            except Exception as exc:
                # Includes a compacted start revision (the resync reads a fresh one); anything
                # unexpected is retried too, with a trace, so the membership never freezes silently.
                if not outage:
                    log.warning(
                        "etcd unreachable prefix=%s error=%s; keeping %d known members",
                        self._prefix, exc, len(self._members),
                        exc_info=not isinstance(exc, aetcd.ClientError),
                    )  # fmt: skip
                    outage = True
                await asyncio.sleep(backoff.next())

    async def _resync(self) -> int:
        """Replace the membership with a fresh read of the prefix; returns the read's revision."""
        result = await self._client.get_prefix(self._prefix.encode())
        members: Membership = {}
        for kv in result:
            record = self._parse(kv.key, kv.value)
            if record is not None:
                members[record.instance_id] = record
        await self._publish(members)
        revision: int = result.header.revision
        return revision

    async def _apply(self, event: aetcd.Event) -> None:
        members = dict(self._members)
        instance_id = event.kv.key.decode()[len(self._prefix) :]
        record = self._parse(event.kv.key, event.kv.value) if event.kind == aetcd.EventKind.PUT else None
        if record is None:
            members.pop(instance_id, None)
        else:
            members[instance_id] = record
        await self._publish(members)

    def _parse(self, key: bytes, value: bytes) -> ServiceRecord | None:
        try:
            return ServiceRecord.from_json(value)
        except ValueError as exc:
            name = key.decode(errors="replace")
            log.warning("ignoring malformed service record key=%s error=%s", name, exc)
            return None

    async def _publish(self, members: Membership) -> None:
        if members == self._members:
            return
        async with self._changed:
            self._members = members
            self._changed.notify_all()
        log.info("membership changed prefix=%s members=%s", self._prefix, sorted(members))
        if self._on_change is None:
            return
        try:
            result = self._on_change(dict(members))
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("on_change callback failed prefix=%s", self._prefix)


class ModelRegistry:
    """Model metadata at ``/strata/v1/models/<name>``: first claim wins, later claims must match."""

    def __init__(self, endpoint: str) -> None:
        self._client = connect(endpoint)

    async def claim(self, name: str, fingerprint: str, meta: dict[str, Any] | None = None) -> ModelRecord:
        """Store the record if the name is free (atomically); return the stored record.

        Raises ``FingerprintMismatch`` when the name is stored with a different fingerprint (the
        stored ``meta`` wins when fingerprints agree), ``aetcd.ClientError`` when etcd is unreachable.
        """
        if not name or "/" in name:
            raise ValueError(f"model name must be non-empty and contain no '/': {name!r}")
        record = ModelRecord(name, fingerprint, dict(meta or {}))
        key = f"{MODELS_PREFIX}{name}".encode()
        tx = self._client.transactions
        created, responses = await self._client.transaction(
            compare=[tx.version(key) == 0],
            success=[tx.put(key, record.to_json().encode())],
            failure=[tx.get(key)],
        )
        if created:
            log.info("model claimed name=%s fingerprint=%s", name, fingerprint)
            return record
        ((value, _kv),) = responses[0]
        stored = ModelRecord.from_json(value)
        if stored.fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"model {name!r} is registered in etcd with fingerprint {stored.fingerprint}, "
                f"but this instance has {fingerprint}; its config, weights or tokenizer differ"
            )
        return stored

    async def get(self, name: str) -> ModelRecord | None:
        result = await self._client.get(f"{MODELS_PREFIX}{name}".encode())
        return None if result is None else ModelRecord.from_json(result.value)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> ModelRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
