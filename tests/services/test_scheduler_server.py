"""The scheduler process never outlives its scheduling loop: if the loop task ends by itself,
``serve`` stops the server and raises (the process exits non-zero, to be restarted) instead of
accepting requests that nothing would run."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler import server
from services.scheduler.config import SchedulerConfig
from services.scheduler.loop import SchedulerLoop


def test_serve_exits_when_its_loop_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_run(self: SchedulerLoop, stop: asyncio.Event) -> None:
        await asyncio.sleep(0.05)
        raise ValueError("boom")

    monkeypatch.setattr(SchedulerLoop, "run", broken_run)
    cfg = SchedulerConfig(port=0, metrics_port=-1, l3_lookup=False)

    async def main() -> None:
        await asyncio.wait_for(server.serve(cfg, asyncio.Event()), 30)

    with pytest.raises(RuntimeError, match=r"scheduling loop stopped unexpectedly: ValueError\('boom'\)"):
        asyncio.run(main())


def test_serve_returns_on_stop() -> None:
    cfg = SchedulerConfig(port=0, metrics_port=-1, l3_lookup=False)

    async def main() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(server.serve(cfg, stop, ready))
        await asyncio.wait_for(ready.wait(), 30)
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
