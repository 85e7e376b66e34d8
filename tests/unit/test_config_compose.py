"""Frozen configs reject what they do not know; compose.yaml (and its TLS overlay) is valid compose."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import (
    ConfigError,
    add_arguments,
    build_config,
    from_args,
    load_file,
    model_dir_problem,
    to_args,
)
from services.common.telemetry import from_environment
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]


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
    strata = ("kvstore", "worker", "scheduler", "worker-1", "scheduler-1", "tokenizer")
    assert set(services) == {"etcd", *strata}
    for s in ("scheduler", "scheduler-1"):
        assert services["tokenizer"]["depends_on"][s]["condition"] == "service_healthy"
    for name in strata:
        assert "healthcheck" in services[name]
    # Each scheduler drives its own replica's worker; instance ids are distinct.
    for s, w in (("scheduler", "worker"), ("scheduler-1", "worker-1")):
        command = services[s]["command"]
        assert command[command.index("--worker") + 1] == f"{w}:50060"
        assert w in services[s]["depends_on"]
    ids = [services[n]["command"][services[n]["command"].index("--instance-id") + 1] for n in strata[1:5]]
    assert len(set(ids)) == 4, ids
    # The OpenAI port is published, and every service serves metrics inside the network.
    assert any("8000" in str(p) for p in services["tokenizer"]["ports"])
    for name in strata:
        command = services[name]["command"]
        assert command[command.index("--metrics-port") + 1] == "9100", name
        assert "9100" in [str(e) for e in services[name]["expose"]], name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_compose_tls_overlay_encrypts_every_hop(tmp_path: Path) -> None:
    """compose.tls.yaml on top of compose.yaml: every service speaks mutual TLS with etcd and the
    others under its service name, its health check too; `make compose-certs` covers those names."""
    out = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "-f", "compose.tls.yaml", "config"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    etcd = services["etcd"]["command"]
    assert "--client-cert-auth" in etcd and "--listen-client-urls=https://0.0.0.0:2379" in etcd
    strata = [n for n in services if n != "etcd"]
    assert len(strata) == 6
    for name in strata:
        command, check = services[name]["command"], services[name]["healthcheck"]["test"]
        flag = lambda f, c=command: c[c.index(f) + 1]  # noqa: E731
        assert flag("--etcd") == "https://etcd:2379", name
        assert flag("--advertise-host") == name, name
        assert (flag("--tls-cert"), flag("--tls-key"), flag("--tls-ca")) == (
            "/tls/service.pem", "/tls/service.key", "/tls/ca.pem"
        ), name  # fmt: skip
        assert "--tls-ca" in check and "--tls-cert" in check, name
        assert any(str(v).endswith(":/tls:ro") or "/tls" in str(v) for v in services[name]["volumes"]), name
        assert "/model" in str(services[name]["volumes"]) or name != "worker", name
    # the certificate `make compose-certs` writes is for every service name
    from cryptography import x509

    from services.common.tls import make_dev_certs

    recipe = (REPO / "Makefile").read_text().split("COMPOSE_HOSTS := ", 1)[1].split("\n", 1)[0].split()
    files = make_dev_certs(tmp_path, recipe)
    cert = x509.load_pem_x509_certificate(Path(files.cert).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"etcd", *strata} <= set(names), names


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_compose_pd_overlay_gives_each_replica_a_role() -> None:
    """compose.pd.yaml on top of compose.yaml: one prefill and one decode replica (issue #31), the
    rest of each scheduler's command as in the base file, the hierarchical cache on both workers,
    an outbox on the prefill one's."""
    base, pd = (
        yaml.safe_load(subprocess.run(["docker-compose", *files, "config"], capture_output=True, text=True,
                                      cwd=REPO, check=True).stdout)["services"]
        for files in (["-f", "compose.yaml"], ["-f", "compose.yaml", "-f", "compose.pd.yaml"])
    )  # fmt: skip
    assert set(pd) == set(base)
    for name, role in (("scheduler", "prefill"), ("scheduler-1", "decode")):
        command = pd[name]["command"]
        assert command[command.index("--role") + 1] == role
        assert command[: command.index("--role")] == base[name]["command"], name
    for name in ("worker", "worker-1"):
        assert pd[name]["command"][pd[name]["command"].index("--l3") + 1] == "true"
    # the direct hand-over: the prefill worker keeps an outbox, the rest of its command as in the base
    command = pd["worker"]["command"]
    assert command[: command.index("--outbox-bytes")] == base["worker"]["command"]
    assert int(command[command.index("--outbox-bytes") + 1]) > 0 and "--outbox-bytes" not in pd["worker-1"]["command"]


@pytest.mark.parametrize(
    ("text", "want"),
    [("67108864", 64 << 20), ("64MiB", 64 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("512k", 512 << 10)],
)
def test_byte_sizes_take_units(text: str, want: int) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerConfig)
    cfg = from_args(WorkerConfig, parser.parse_args(["--model", "m", "--kv-cache-bytes", text]))
    assert cfg.kv_cache_bytes == want


def test_bad_byte_size_names_the_key() -> None:
    with pytest.raises(ConfigError, match="host_cache_bytes: expected bytes such as"):
        build_config(WorkerConfig, {"model": "m", "host_cache_bytes": "lots"})


def test_mistyped_model_dir_is_named(tmp_path: Path) -> None:
    (tmp_path / "qwen3-tiny").mkdir()
    (tmp_path / "qwen3-tiny" / "config.json").write_text("{}")
    assert model_dir_problem(str(tmp_path / "qwen3-tiny")) is None
    assert "did you mean" in (model_dir_problem(str(tmp_path / "qwen3-tinny")) or "")
    assert "no config.json" in (model_dir_problem(str(tmp_path)) or "")
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "worker", "--model", str(tmp_path / "qwen3-tinny")],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"did you mean {tmp_path / 'qwen3-tiny'}?" in out.stderr


def test_cli_errors_are_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "hi", "--address", "127.0.0.1:1"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("strata generate: UNAVAILABLE:") and out.stderr.count("\n") == 1


def test_otel_environment_fills_unset_flags() -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert from_environment("none", "", env) == ("otlp", "collector:4317")
    assert from_environment("file", "/tmp/x", env) == ("file", "/tmp/x")  # a flag wins
    assert from_environment("otlp", "", {}) == ("otlp", "localhost:4317")
    assert from_environment("console", "", {"OTEL_SDK_DISABLED": "true"}) == ("none", "")
