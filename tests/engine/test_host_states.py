"""The host / L3 tier for Mamba states (hybrid models), worker side: ``StateBackup`` /
``StateLoad`` and ``states=True`` L3 ops on the real tiny Qwen3-Next engine round-trip real
recurrent states bit for bit, run in op order, and bad ops are refused (naming the field and the
value) before any op runs. The kvstore port is ``tests.engine.test_host_ops.FakePort`` (a unit test of
the engine's side)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import ConfigError
from services.common.step import (
    JobResult,
    L3Get,
    L3Put,
    MambaCopy,
    MambaReset,
    PoolResize,
    ReqInput,
    StateBackup,
    StateLoad,
    StepError,
    StepRequest,
)
from services.worker.config import WorkerConfig
from services.worker.engine import Engine, EngineConfig
from services.worker.host_states import HostStatePool
from services.worker.mamba_pool import MambaPool, MambaSpec
from services.worker.server import engine_config
from tests.engine.test_host_ops import FakePort

MAMBA_SLOTS = 8
HOST_BYTES = 1 << 20


def _key(i: int) -> bytes:
    return (1000 + i).to_bytes(32, "little")


def _state(pool: MambaPool, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for pair in zip(pool.conv, pool.ssm, strict=True) for t in pair]


def _bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _scribble(pool: MambaPool, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in (*pool.conv, *pool.ssm):
        t[slot].copy_(torch.randn(t[slot].shape, generator=g).to(t.dtype))


@pytest.fixture(scope="module")
def port() -> FakePort:
    return FakePort()


@pytest.fixture(scope="module")
def engine(tiny_qwen3_next: Path, port: FakePort) -> Engine:
    cfg = EngineConfig(
        kv_cache_bytes=1 << 20, max_rows=4, mamba_slots=MAMBA_SLOTS, host_cache_bytes=HOST_BYTES, host_page_tokens=4
    )
    return Engine(tiny_qwen3_next, cfg, port)


@pytest.fixture(scope="module")
def prefilled(engine: Engine) -> list[torch.Tensor]:
    """Mamba slot 0 after a 12-token prefill (a real recurrent state); returns a copy of it."""
    ids = [(7 * i + 3) % engine.info.vocab_size for i in range(12)]
    req = ReqInput("a", 0, ids, 0, list(range(len(ids))), mamba_slot=0)
    engine.step(StepRequest(1, ops=[MambaReset(0)], reqs=[req]))
    assert engine.mamba is not None
    state = _state(engine.mamba, 0)
    assert all(bool(t.any()) for t in state)  # every layer's conv and ssm were written
    return state


def _mamba(engine: Engine) -> MambaPool:
    assert engine.mamba is not None
    return engine.mamba


def _host(engine: Engine) -> HostStatePool:
    assert engine.host is not None and engine.host.states is not None
    return engine.host.states


def test_backup_scribble_load_is_bit_exact(engine: Engine, prefilled: list[torch.Tensor]) -> None:
    mamba = _mamba(engine)
    r = engine.step(StepRequest(2, ops=[StateBackup(1, (0,), (5,))]))
    assert r.jobs == [JobResult(1, True, 1)]
    _scribble(mamba, 0, seed=1)
    assert not _bit_equal(_state(mamba, 0), prefilled)
    r = engine.step(StepRequest(3, ops=[StateLoad(2, (5,), (3,))]))
    assert r.jobs == [JobResult(2, True, 1)]
    assert _bit_equal(_state(mamba, 3), prefilled)
    mamba.copy(3, 0)  # restore slot 0 for the other tests


def test_many_states_in_and_out_of_order(engine: Engine, prefilled: list[torch.Tensor]) -> None:
    mamba = _mamba(engine)
    _scribble(mamba, 1, seed=2)
    one = _state(mamba, 1)
    # Host states as an ascending run, then scattered; loads into slots in a different order.
    ops = [StateBackup(1, (0, 1), (10, 11)), StateBackup(2, (1, 0), (4, 2))]
    r = engine.step(StepRequest(4, ops=list(ops)))
    assert r.jobs == [JobResult(1, True, 2), JobResult(2, True, 2)]
    r = engine.step(StepRequest(5, ops=[StateLoad(3, (11, 10), (6, 7)), StateLoad(4, (2, 4), (5, 4))]))
    assert r.jobs == [JobResult(3, True, 2), JobResult(4, True, 2)]
    assert _bit_equal(_state(mamba, 6), one) and _bit_equal(_state(mamba, 7), prefilled)
    assert _bit_equal(_state(mamba, 5), prefilled) and _bit_equal(_state(mamba, 4), one)


def test_state_backup_reads_the_pool_as_earlier_ops_left_it(engine: Engine, prefilled: list[torch.Tensor]) -> None:
    mamba = _mamba(engine)
    _scribble(mamba, 2, seed=3)
    # The backup sees the copy made just before it, not what slot 2 held at the step's start,
    # nor the reset that follows it.
    r = engine.step(StepRequest(6, ops=[MambaCopy(0, 2), StateBackup(1, (2,), (8,)), MambaReset(2)]))
    assert r.jobs == [JobResult(1, True, 1)]
    assert not bool(mamba.ssm[0][2].any())
    # A load followed by a copy out of the loaded slot, in the same step.
    engine.step(StepRequest(7, ops=[StateLoad(2, (8,), (2,)), MambaCopy(2, 1)]))
    assert _bit_equal(_state(mamba, 1), prefilled)


def test_l3_round_trip_of_states(engine: Engine, port: FakePort, prefilled: list[torch.Tensor]) -> None:
    mamba, host = _mamba(engine), _host(engine)
    r = engine.step(
        StepRequest(8, ops=[StateBackup(1, (0,), (3,)), L3Put(2, (3,), (_key(1),), states=True)])
    )
    assert r.jobs == [JobResult(1, True, 1), JobResult(2, True, 1)]
    assert len(port.pages[_key(1)]) == host.bytes_per_state == mamba.bytes_per_slot
    host.states.random_(0, 256)  # the host copy is gone: only L3 has the bytes now
    r = engine.step(StepRequest(9, ops=[L3Get(3, (_key(1), _key(2)), (12, 13), states=True)]))
    assert r.jobs == [JobResult(3, False, 1)]  # the second key is missing: one leading state
    r = engine.step(StepRequest(10, ops=[StateLoad(4, (12,), (6,))]))
    assert r.jobs == [JobResult(4, True, 1)]
    assert _bit_equal(_state(mamba, 6), prefilled)


def test_a_put_sends_the_state_as_it_was_when_the_op_ran(engine: Engine, port: FakePort) -> None:
    mamba, host = _mamba(engine), _host(engine)
    _scribble(mamba, 1, seed=4)
    engine.step(StepRequest(11, ops=[StateBackup(1, (0,), (7,))]))
    first = bytes(host.state_bytes(7))
    r = engine.step(StepRequest(12, ops=[L3Put(2, (7,), (_key(3),), states=True), StateBackup(3, (1,), (7,))]))
    assert r.jobs == [JobResult(2, True, 1), JobResult(3, True, 1)]
    assert port.pages[_key(3)] == first != bytes(host.state_bytes(7))


def test_a_state_of_the_wrong_size_is_a_short_job(engine: Engine, port: FakePort) -> None:
    host = _host(engine)
    engine.step(StepRequest(13, ops=[StateBackup(1, (0,), (0,)), L3Put(2, (0,), (_key(4),), states=True)]))
    port.pages[_key(5)] = port.pages[_key(4)][:-4]  # truncated
    assert engine.host is not None
    port.pages[_key(6)] = bytes(engine.host.pool.page_bytes(0))  # a KV page, not a state
    host.states[14:16].fill_(7)
    r = engine.step(StepRequest(14, ops=[L3Get(3, (_key(5), _key(4)), (14, 15), states=True)]))
    assert r.jobs == [JobResult(3, False, 0)]  # a damaged first state ends the run
    r = engine.step(StepRequest(15, ops=[L3Get(4, (_key(4), _key(6)), (14, 15), states=True)]))
    assert r.jobs == [JobResult(4, False, 1)]
    assert bytes(host.state_bytes(14)) == port.pages[_key(4)]
    assert bool((host.states[15] == 7).all())  # not written


@pytest.mark.parametrize(
    ("op", "match"),
    [
        (StateBackup(1, (0, 1), (0,)), r"ops\[1\] \(StateBackup\): 1 host states need as many Mamba slots, got 2"),
        (StateBackup(1, (MAMBA_SLOTS,), (0,)), rf"StateBackup\)\.slots: Mamba slot {MAMBA_SLOTS} outside \[0, 8\)"),
        (StateLoad(1, (0,), (-1,)), r"StateLoad\)\.slots: Mamba slot -1 outside"),
        (StateLoad(1, (10**6,), (0,)), r"StateLoad\)\.host_states: host state 1000000 outside \[0, \d+\)"),
        (StateBackup(1, (0, 1), (3, 3)), r"StateBackup\)\.host_states: 3 repeats"),
        (StateLoad(1, (0, 1), (2, 2)), r"StateLoad\)\.slots: 2 repeats"),
        (L3Put(1, (10**6,), (_key(1),), states=True), r"L3Put\)\.host_pages: host state 1000000 outside .*states=True"),
        (L3Get(1, (_key(1), _key(2)), (4, 4), states=True), "each host state is written once"),
        (L3Get(1, (_key(1),), (4, 5), states=True), "1 keys for 2 host states"),
        (L3Put(1, (0,), (b"short",), states=True), r"keys\[0\]: a key is 32 bytes"),
    ],
)
def test_bad_state_ops_are_refused_before_anything_runs(engine: Engine, op: object, match: str) -> None:
    host = _host(engine)
    host.states[0].fill_(7)
    ok = StateBackup(99, (0,), (0,))  # valid, but must not run: a later op is bad
    with pytest.raises(StepError, match=match):
        engine.step(StepRequest(20, ops=[ok, op]))  # type: ignore[list-item]
    assert bool((host.states[0] == 7).all())


def test_state_ops_see_an_earlier_resize_of_the_mamba_pool(engine: Engine) -> None:
    shrink = PoolResize(engine.kv.num_slots, 4)
    with pytest.raises(StepError, match=r"ops\[1\] \(StateLoad\)\.slots: Mamba slot 5 outside \[0, 4\)"):
        engine.step(StepRequest(21, ops=[shrink, StateLoad(1, (0,), (5,))]))
    assert _mamba(engine).num_slots == MAMBA_SLOTS


def test_worker_info_describes_the_state_pool(engine: Engine, tiny_qwen3_next: Path) -> None:
    info, host, mamba = engine.info, _host(engine), _mamba(engine)
    assert info.host_states == host.num_states == int(HOST_BYTES * 0.25) // mamba.bytes_per_slot > 0
    assert info.state_layout == f"{host.layout}/tp0of1"
    spec = mamba.spec
    assert info.state_layout.startswith(f"state-first/L{spec.num_layers}/conv")
    assert engine.host is not None
    assert info.host_pages == (HOST_BYTES - int(HOST_BYTES * 0.25)) // engine.host.pool.bytes_per_page
    # Another share moves bytes between the two host pools; the layout does not change.
    other = Engine(tiny_qwen3_next, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2, mamba_slots=4,
                                                 host_cache_bytes=HOST_BYTES, host_state_share=0.5))
    assert other.info.host_states == (HOST_BYTES // 2) // mamba.bytes_per_slot
    assert other.info.state_layout == info.state_layout and not other.info.l3


def test_a_budget_too_small_for_one_state_is_refused(tiny_qwen3_next: Path) -> None:
    cfg = EngineConfig(kv_cache_bytes=1 << 20, max_rows=2, mamba_slots=4, host_cache_bytes=64 << 10,
                       host_state_share=0.01)
    with pytest.raises(ValueError, match=r"host_state_share=0.01 .* holds no Mamba state: one state needs \d+ bytes"):
        Engine(tiny_qwen3_next, cfg)


@pytest.mark.parametrize("share", [0.0, 1.0, -0.5, 1.5])
def test_host_state_share_is_validated(share: float) -> None:
    with pytest.raises(ValueError, match=rf"host_state_share .* must be > 0 and < 1, got {share}"):
        EngineConfig(host_state_share=share)
    with pytest.raises(ConfigError, match="host_state_share: must be > 0 and < 1"):
        WorkerConfig(model="m", host_state_share=share).validate()
    assert engine_config(WorkerConfig(model="m", host_state_share=0.4)).host_state_share == 0.4


def test_a_dense_worker_refuses_state_ops(tiny_qwen3: Path) -> None:
    message = r"this worker has no host state pool \(a hybrid model started with --host-cache-bytes has one\)"
    dense = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2, host_cache_bytes=1 << 20), FakePort())
    assert dense.info.host_pages > 0 and dense.info.l3
    assert dense.info.host_states == 0 and dense.info.state_layout == ""
    for op, where in (
        (StateBackup(1, (0,), (0,)), r"ops\[0\] \(StateBackup\): "),
        (StateLoad(1, (0,), (0,)), r"ops\[0\] \(StateLoad\): "),
        (L3Put(1, (0,), (_key(1),), states=True), r"ops\[0\] \(L3Put\)\.states: "),
        (L3Get(1, (_key(1),), (0,), states=True), r"ops\[0\] \(L3Get\)\.states: "),
    ):
        with pytest.raises(StepError, match=where + message):
            dense.step(StepRequest(1, ops=[op]))
    plain = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2))
    with pytest.raises(StepError, match=message):
        plain.step(StepRequest(1, ops=[StateLoad(1, (0,), (0,))]))


# --- HostStatePool alone: mixed dtypes whose fields are not word-aligned in a state ---------------

SPEC = MambaSpec(num_layers=3, conv_shape=(3, 3), ssm_shape=(2, 3, 5), conv_dtype=torch.bfloat16)


def test_pool_round_trips_mixed_dtypes_bit_for_bit() -> None:
    pool = MambaPool(6, SPEC)
    for s in range(6):
        _scribble(pool, s, seed=10 + s)
    before = [_state(pool, s) for s in range(6)]
    host = HostStatePool(5, SPEC)
    assert host.bytes_per_state == SPEC.bytes_per_slot == 3 * (9 * 2 + 30 * 4)  # 18-byte conv: no padding
    host.backup(pool, [4, 1, 0], [3, 0, 2])
    blob = bytes(host.state_bytes(0))
    host.write_state(4, blob)
    for s in range(6):
        _scribble(pool, s, seed=99)
    host.load([2, 4, 3], pool, [5, 2, 0])
    assert _bit_equal(_state(pool, 5), before[0])
    assert _bit_equal(_state(pool, 2), before[1])
    assert _bit_equal(_state(pool, 0), before[4])
    # Field order is conv0, ssm0, conv1, ...: the first bytes are slot 1's conv of layer 0.
    assert blob[:18] == before[1][0].contiguous().view(torch.uint8).numpy().tobytes()


def test_pool_errors_are_precise() -> None:
    with pytest.raises(ValueError, match=r"budget of 100 bytes holds no Mamba state: one state needs 414 bytes"):
        HostStatePool.from_budget(100, SPEC)
    assert HostStatePool.from_budget(1000, SPEC).num_states == 2
    host, pool = HostStatePool(2, SPEC), MambaPool(2, SPEC)
    with pytest.raises(ValueError, match="state data is 3 bytes, a host state is 414"):
        host.write_state(0, b"abc")
    with pytest.raises(IndexError, match=r"host state 2 out of range \[0, 2\)"):
        host.state_bytes(2)
    with pytest.raises(ValueError, match="2 host states need 2 Mamba slots, got 1"):
        host.backup(pool, [0], [0, 1])
    with pytest.raises(ValueError, match="slots repeat"):
        host.load([0, 1], pool, [1, 1])
    other = MambaPool(2, MambaSpec(num_layers=3, conv_shape=(3, 3), ssm_shape=(2, 3, 5)))
    with pytest.raises(ValueError, match="does not match the host state pool"):
        host.backup(other, [0], [0])
