"""STRATA_TRACEMALLOC_S: the opt-in allocation tracer reports growth by site, and stays off unless asked."""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc

import pytest

from services.common import heap_trace


def test_off_unless_asked() -> None:
    assert heap_trace.start_from_environment("scheduler", {}) is None
    assert heap_trace.start_from_environment("scheduler", {heap_trace.ENV: "soon"}) is None
    assert heap_trace.start_from_environment("scheduler", {heap_trace.ENV: "0"}) is None
    only = {heap_trace.ENV: "60", heap_trace.ONLY_ENV: "tokenizer, kvstore"}
    assert heap_trace.start_from_environment("scheduler", only) is None


def test_reports_the_site_that_grows(caplog: pytest.LogCaptureFixture) -> None:
    kept: list[bytes] = []
    stop = threading.Event()
    tracemalloc.start(heap_trace.FRAMES)
    try:
        with caplog.at_level(logging.INFO, logger=heap_trace.__name__):
            t = threading.Thread(target=heap_trace._report, args=(0.2, stop))
            t.start()
            time.sleep(0.3)  # the baseline is taken
            for _ in range(2000):
                kept.append(bytes(1000))  # ~2 MB kept alive at this line
            time.sleep(0.4)
            stop.set()
            t.join(5)
    finally:
        tracemalloc.stop()
    text = caplog.text
    assert "baseline" in text and "heap in use" in text
    assert "test_heap_trace.py" in text.split("top growth:", 1)[1]  # the growing line is named
    assert len(kept) == 2000
