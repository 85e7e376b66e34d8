"""Frozen configs reject what they do not know; compose.yaml is valid compose."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, add_arguments, build_config, from_args, load_file, to_args
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

REPO = Path(__file__).resolve().parent.parent


def test_unknown_key_is_rejected_with_its_name() -> None:
    with pytest.raises(ConfigError, match="kv_cache_bites"):
        build_config(WorkerConfig, {"model": "m", "kv_cache_bites": 1})


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ConfigError, match="cache"):
        build_config(SchedulerConfig, {"etcd": "x", "cache": "lru"})
    with pytest.raises(ConfigError, match="max_rows"):
        build_config(WorkerConfig, {"model": "m", "max_rows": "many"})
    with pytest.raises(ConfigError, match="etcd or worker"):
        build_config(SchedulerConfig, {})


def test_file_then_flags_and_frozen(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(yaml.safe_dump({"model": "m", "max-rows": 8, "kv_cache_bytes": 1024}))
    assert load_file(f)["max_rows"] == 8
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerConfig)
    cfg = from_args(WorkerConfig, parser.parse_args(["--config", str(f), "--max-rows", "16"]))
    assert (cfg.max_rows, cfg.kv_cache_bytes) == (16, 1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_rows = 1  # type: ignore[misc]
    again = from_args(WorkerConfig, parser.parse_args(to_args(cfg)))
    assert again == cfg


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_compose_file_is_valid() -> None:
    out = subprocess.run(
        ["docker-compose", "-f", str(REPO / "compose.yaml"), "config"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert set(services) == {"etcd", "kvstore", "worker", "scheduler", "tokenizer"}
    assert services["tokenizer"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    for name in ("kvstore", "worker", "scheduler", "tokenizer"):
        assert "healthcheck" in services[name]
