"""pytest fixtures that run a real etcd server (Debian's etcd-server) on free local ports.

- ``etcd_process``: function-scoped ``EtcdProcess`` (tests that stop/restart etcd need the handle).
- ``etcd_endpoint``: function-scoped ``"127.0.0.1:PORT"`` of a fresh, empty etcd.
- ``etcd_session_endpoint``: one etcd shared by the whole session; tests using it must pick unique
  key names (e.g. a uuid in the instance id or model name) because state carries over.

Import them into a conftest.py or a test module: ``from tests.etcd_fixture import etcd_endpoint``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.etcd_proc import EtcdError, EtcdProcess, free_port


def _spawn(base: object, attempts: int = 3) -> EtcdProcess:
    # free_port() is racy with other processes picking ports; a collision makes etcd exit, so retry.
    for attempt in range(attempts):
        proc = EtcdProcess(f"{base}/etcd-data-{attempt}", free_port(), free_port())
        try:
            proc.start()
            return proc
        except EtcdError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def etcd_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    proc = _spawn(tmp_path_factory.mktemp("etcd"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def etcd_endpoint(etcd_process: EtcdProcess) -> str:
    return etcd_process.endpoint


@pytest.fixture(scope="session")
def etcd_session_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = _spawn(tmp_path_factory.mktemp("etcd-session"))
    try:
        yield proc.endpoint
    finally:
        proc.stop()
