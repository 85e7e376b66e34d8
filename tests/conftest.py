"""Shared fixtures: a real etcd, the tiny checkpoints (generated once), free ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.etcd_fixture import etcd_endpoint, etcd_process, etcd_session_endpoint  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    """`make models` writes models/<arch>-tiny; a bare `pytest` run generates its own copy."""
    from services.worker.tiny import add_mtp_head, refresh_chat_template, write_tiny_checkpoint

    made = REPO / "models" / f"{arch}-tiny"
    if (made / "config.json").exists():
        refresh_chat_template(made)  # written before the template changed: only the template is stale
        if arch == "qwen3-next":
            add_mtp_head(made)  # written before the MTP head existed: only the head is missing
        return made

    return write_tiny_checkpoint(arch, "tiny", tmp_path_factory.mktemp(f"{arch}-tiny"))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "qwen3-next")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """In-process engines share 2 cores with the service processes the e2e tests start; one
    intra-op thread each keeps step times steady (a tiny decode step: ~4 ms vs ~270 ms contended)."""
    import torch

    torch.set_num_threads(1)


TIERS = {"services": 0, "engine": 1, "unit": 2}  # run order: the long files first


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The services tier first, then engine, then unit (each in file order): under `make test`'s
    two processes (pytest-xdist, whole files) the many short files at the end fill the time while
    the other process finishes a long one, instead of one long file running alone at the end."""
    items.sort(key=lambda item: TIERS.get(item.path.parent.name, len(TIERS)))


def pytest_configure(config: pytest.Config) -> None:
    """``STRATA_TEST_DEVICE`` (tests/device.py) names a device this machine has, or nothing runs."""
    from tests.device import check_test_device

    problem = check_test_device()
    if problem is not None:
        raise pytest.UsageError(problem)
