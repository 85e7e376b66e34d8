"""The scheduler builds its grammar service once, whoever asks first (the preload once a worker is
attached, or a grammar) and however many ask at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from services.common.errors import Unavailable
from services.scheduler import server
from services.scheduler.server import SchedulerServicer
from strata.scheduler.v1 import scheduler_pb2 as spb


class _Service:
    """Stands in for ``GrammarService``: slow to build (the real one loads xgrammar, torch and the
    tokenizer), failing the builds listed in ``fail``."""

    built: ClassVar[list[int]] = []
    fail: ClassVar[set[int]] = set()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        n = len(_Service.built)
        _Service.built.append(n)
        time.sleep(0.2)
        if n in _Service.fail:
            raise RuntimeError(f"build {n} failed")

    async def compile(self, constraint: Any) -> Any:
        return SimpleNamespace(matcher=lambda: constraint)


def _servicer(monkeypatch: pytest.MonkeyPatch, fail: set[int], loop: Any = None) -> SchedulerServicer:
    _Service.built, _Service.fail = [], fail
    monkeypatch.setattr(server, "GrammarService", _Service)
    loop = loop or SimpleNamespace(info=SimpleNamespace(vocab_size=100, eos_token_ids=[2]))
    return SchedulerServicer(loop, tokenizer_dir="unused")


def test_grammars_arriving_together_build_the_service_once(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _servicer(monkeypatch, fail=set())

    async def main() -> list[Any]:
        return await asyncio.gather(*(s._matcher(spb.Constraint(regex=f"a{{{i}}}")) for i in range(8)))

    got = asyncio.run(main())
    assert _Service.built == [0]
    assert [m.text for m in got] == [f"a{{{i}}}" for i in range(8)]


def test_a_failed_build_fails_its_waiters_and_the_next_grammar_builds_again(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _servicer(monkeypatch, fail={0})

    async def main() -> tuple[list[Any], Any]:
        first = await asyncio.gather(*(s._matcher(spb.Constraint(regex="a+")) for _ in range(3)),
                                     return_exceptions=True)  # fmt: skip
        return first, await s._matcher(spb.Constraint(regex="b+"))

    first, later = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "build 0" in str(e) for e in first)
    assert _Service.built == [0, 1] and later.text == "b+"


class _Loop:
    """A scheduling loop whose worker attaches at the ``attach_at``-th wait."""

    def __init__(self, attach_at: int) -> None:
        self.info = SimpleNamespace(vocab_size=100, eos_token_ids=[2])
        self.waits = 0
        self.attach_at = attach_at

    async def wait_for_worker(self) -> Any:
        self.waits += 1
        if self.waits < self.attach_at:
            raise Unavailable("no worker connected within 0s")
        return self.info


def test_the_preload_waits_for_a_worker_and_a_grammar_meanwhile_joins_its_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    s = _servicer(monkeypatch, fail=set(), loop=_Loop(attach_at=2))  # one wait times out (0.5 s)
    caplog.set_level("INFO", logger=server.__name__)

    async def main() -> Any:
        preload = asyncio.create_task(s.preload_grammars())
        while not _Service.built:  # the build has started (in its thread)
            await asyncio.sleep(0.01)
        matcher = await s._matcher(spb.Constraint(regex="a+"))
        await preload
        return matcher

    matcher = asyncio.run(main())
    assert s.loop.waits == 2  # type: ignore[attr-defined]
    assert _Service.built == [0] and matcher.text == "a+"
    assert "grammar backend loaded" in caplog.text


def test_a_failed_preload_is_logged_and_the_first_grammar_builds_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    s = _servicer(monkeypatch, fail={0}, loop=_Loop(attach_at=1))

    async def main() -> Any:
        await s.preload_grammars()
        return await s._matcher(spb.Constraint(regex="b+"))

    later = asyncio.run(main())
    assert "grammar backend failed to load (build 0 failed)" in caplog.text
    assert _Service.built == [0, 1] and later.text == "b+"
