"""docs/operations.md lists every flag of every service and of `strata up`, and every metric."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.cli import build_parser
from services.common.metrics import MetricFactory
from services.kvstore.backends import MemoryBackend
from services.kvstore.config import KVStoreConfig
from services.kvstore.server import backend_gauges
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import TokenizerMetrics
from services.worker.config import WorkerConfig
from services.worker.server import WorkerMetrics

DOC = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


@pytest.mark.parametrize("cls", [TokenizerConfig, SchedulerConfig, WorkerConfig, KVStoreConfig])
def test_every_service_flag_is_documented(cls: type) -> None:
    missing = [f.name for f in dataclasses.fields(cls) if f"`--{f.name.replace('_', '-')}`" not in DOC]
    assert not missing, f"{cls.__name__}: {missing}"


def test_every_up_flag_is_documented() -> None:
    up = build_parser()._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    flags = [a.option_strings[0] for a in up._actions if a.option_strings and a.dest != "help"]
    assert not [f for f in flags if f"`{f}" not in DOC]


def test_every_metric_is_documented() -> None:
    registries = [CollectorRegistry() for _ in range(3)]
    TokenizerMetrics(registries[0], "m")
    SchedulerMetrics(registries[1])
    WorkerMetrics(registries[2])
    for service in ("kvstore", "worker_outbox"):
        registries.append(CollectorRegistry())
        backend_gauges(MetricFactory(registries[-1], service), MemoryBackend(1 << 20))
    names = {c._name for r in registries for c in r._names_to_collectors.values()}  # type: ignore[attr-defined]
    assert len(names) > 30
    assert not sorted(n for n in names if f"`{n}" not in DOC)
