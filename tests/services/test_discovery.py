"""Discovery, registration and the model registry against a real etcd server.

The etcd fixtures come from tests/etcd_fixture.py through tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest

from services.common.discovery import (
    Discovery,
    FingerprintMismatch,
    Membership,
    ModelRegistry,
    Registration,
    ServiceRecord,
    connect,
)
from services.common.etcd_proc import EtcdProcess, free_port

TTL_S = 2.0


def _record(instance_id: str, kind: str = "worker") -> ServiceRecord:
    return ServiceRecord(
        kind=kind, instance_id=instance_id, address=f"127.0.0.1:{5000 + len(instance_id)}",
        model="qwen3-tiny", role="decode", capacity={"kv_pages": 128},
    )  # fmt: skip


async def _eventually(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``predicate`` holds; returns the seconds it took, fails the test after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_record_json_round_trip() -> None:
    rec = _record("w0")
    assert ServiceRecord.from_json(rec.to_json()) == rec
    with pytest.raises(ValueError, match="malformed"):
        ServiceRecord.from_json(b'{"kind": "worker"}')
    with pytest.raises(ValueError, match="no '/'"):
        ServiceRecord(kind="worker", instance_id="a/b", address="x:1")


def test_register_visible_then_stop_gone(etcd_endpoint: str) -> None:
    async def main() -> None:
        seen: list[Membership] = []

        async def on_change(members: Membership) -> None:
            seen.append(members)

        disc = Discovery(etcd_endpoint, "worker", on_change=on_change)
        other_kind = Discovery(etcd_endpoint, "kvstore")
        await disc.start()
        await other_kind.start()
        reg = Registration(etcd_endpoint, _record("w0"), ttl_s=TTL_S)
        await reg.start()
        members = await disc.wait_for(1, timeout=5)
        assert members == {"w0": _record("w0")}
        assert seen[-1] == members
        assert other_kind.members() == {}

        # A malformed value under the prefix is skipped, not fatal to the watch.
        outsider = connect(etcd_endpoint)
        await outsider.put(b"/strata/v1/services/worker/bad", b"{not json")
        await outsider.close()
        await reg.stop()
        await _eventually(lambda: disc.members() == {}, 2.0, "stopped instance leaves discovery")
        assert seen[-1] == {}
        with pytest.raises(TimeoutError, match="0 of 1 'worker' instances"):
            await disc.wait_for(1, timeout=0.2)
        await disc.stop()
        await other_kind.stop()

    asyncio.run(main())


_CHILD = """
import asyncio, sys
from services.common.discovery import Registration, ServiceRecord
async def main():
    rec = ServiceRecord(kind="worker", instance_id="doomed", address="127.0.0.1:1")
    await Registration(sys.argv[1], rec, ttl_s=float(sys.argv[2])).start()
    sys.stdout.write("registered\\n"); sys.stdout.flush()
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_killed_instance_disappears_within_ttl(etcd_endpoint: str) -> None:
    async def main() -> None:
        disc = Discovery(etcd_endpoint, "worker")
        await disc.start()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, etcd_endpoint, str(TTL_S)], stdout=subprocess.PIPE
        )
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
            assert line == b"registered\n"
            await disc.wait_for(1, timeout=5)
        finally:
            child.kill()  # SIGKILL: no chance to revoke the lease
            child.wait()
        # The lease was last refreshed up to ttl/3 before the kill; etcd checks expiry every 0.5 s.
        took = await _eventually(lambda: "doomed" not in disc.members(), TTL_S + 1.5, "killed key expires")
        assert took > TTL_S / 3, "the key vanished before its lease could have expired"
        await disc.stop()

    asyncio.run(main())


def test_lease_reacquired_after_revoke(etcd_endpoint: str) -> None:
    async def main() -> None:
        disc = Discovery(etcd_endpoint, "worker")
        await disc.start()
        reg = Registration(etcd_endpoint, _record("w0"), ttl_s=TTL_S)
        await reg.start()
        await disc.wait_for(1, timeout=5)
        old_lease = reg.lease_id
        assert old_lease is not None

        outsider = connect(etcd_endpoint)
        await outsider.revoke_lease(old_lease)
        await _eventually(lambda: reg.lease_id not in (None, old_lease), TTL_S, "a new lease is taken")
        await _eventually(lambda: "w0" in disc.members(), TTL_S, "the record is put again")
        stored = await outsider.get(_record("w0").key.encode())
        assert stored is not None and stored.lease == reg.lease_id
        await outsider.close()
        await reg.stop()
        await disc.stop()

    asyncio.run(main())


def test_etcd_outage_keeps_membership_and_recovers(etcd_process: EtcdProcess) -> None:
    endpoint = etcd_process.endpoint

    async def main() -> None:
        disc = Discovery(endpoint, "worker")
        await disc.start()
        reg_a = Registration(endpoint, _record("a"), ttl_s=TTL_S)
        await reg_a.start()
        await disc.wait_for(1, timeout=5)

        await asyncio.to_thread(etcd_process.kill)
        await asyncio.sleep(TTL_S + 0.5)  # longer than the lease: the outage must not expire anything
        assert disc.members() == {"a": _record("a")}, "last known membership kept during the outage"

        await asyncio.to_thread(etcd_process.start)
        reg_b = Registration(endpoint, _record("b"), ttl_s=TTL_S)
        await reg_b.start()
        await disc.wait_for(2, timeout=10)
        # etcd restored a's lease with a fresh TTL; it survives only if a's keep-alive resumed.
        await asyncio.sleep(TTL_S * 1.5)
        assert set(disc.members()) == {"a", "b"}
        await reg_a.stop()
        await _eventually(lambda: set(disc.members()) == {"b"}, 5.0, "watch delivers updates after restart")
        await reg_b.stop()
        await disc.stop()

    asyncio.run(main())


def test_registration_survives_lost_data(
    etcd_process: EtcdProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """etcd restarted empty (its data lost): the old lease is unknown and the instance re-registers."""

    async def main() -> None:
        reg = Registration(etcd_process.endpoint, _record("w0"), ttl_s=TTL_S)
        await reg.start()
        await asyncio.to_thread(etcd_process.kill)
        etcd_process.data_dir = tmp_path_factory.mktemp("fresh") / "etcd-data"
        await asyncio.to_thread(etcd_process.start)
        client = connect(etcd_process.endpoint)
        key = _record("w0").key.encode()

        async def present() -> bool:
            return await client.get(key) is not None

        deadline = time.monotonic() + 3 * TTL_S
        while not await present():
            assert time.monotonic() < deadline, "instance did not re-register on a fresh etcd"
            await asyncio.sleep(0.1)
        await client.close()
        await reg.stop()

    asyncio.run(main())


def test_model_registry_claims_atomically(etcd_session_endpoint: str) -> None:
    name = f"m-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        async with ModelRegistry(etcd_session_endpoint) as registry:
            assert await registry.get(name) is None
            first = await registry.claim(name, "fp-aaa", {"vocab": 151936})
            assert first.meta == {"vocab": 151936}
            again = await registry.claim(name, "fp-aaa", {"vocab": 0})
            assert again == first, "a matching claim returns the stored record"
            assert await registry.get(name) == first
            with pytest.raises(FingerprintMismatch) as info:
                await registry.claim(name, "fp-bbb")
            assert "fp-aaa" in str(info.value) and "fp-bbb" in str(info.value)

            # Concurrent first claims: exactly one fingerprint wins, all others are refused.
            race = f"{name}-race"
            results = await asyncio.gather(
                *(registry.claim(race, f"fp-{i}") for i in range(6)), return_exceptions=True
            )
            winners = [r for r in results if not isinstance(r, BaseException)]
            assert len(winners) == 1
            assert all(isinstance(r, FingerprintMismatch) for r in results if r is not winners[0])

    asyncio.run(main())


def test_start_times_out_without_etcd() -> None:
    async def main() -> None:
        endpoint = f"127.0.0.1:{free_port()}"
        with pytest.raises(TimeoutError, match="could not register"):
            await Registration(endpoint, _record("w0")).start(timeout=0.5)
        with pytest.raises(TimeoutError, match="could not read"):
            await Discovery(endpoint, "worker").start(timeout=0.5)

    asyncio.run(main())


def test_connect_rejects_bad_endpoint() -> None:
    with pytest.raises(ValueError, match="host:port"):
        connect("localhost")
