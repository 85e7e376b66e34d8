"""Stacks shared by several test modules: starting one costs ~10 s of CPU on the 2 cores (each
service imports torch, transformers or grpc), so modules that only send requests share one.

A shared stack starts with the first module that asks for its fixture and stops with the last
module of the run that does (so it does not idle through the modules after it). Tests that kill,
freeze or reconfigure a service start a stack of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack


@pytest.fixture(scope="session")
def _shared_stacks() -> Iterator[dict[str, Stack]]:
    stacks: dict[str, Stack] = {}
    yield stacks
    for stack in stacks.values():  # the run stopped early (-x, ^C)
        stack.stop()


def shared_stack(
    request: pytest.FixtureRequest, stacks: dict[str, Stack], model: Path, run_dirs: pytest.TempPathFactory,
    tokenizer_args: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """The body of a module-scoped fixture: the stack named after the fixture (``model``, gRPC and
    HTTP fronts, ``tokenizer_args``), started if no earlier module did, stopped after this module if
    no later one of the run asks for it."""
    name = request.fixturename
    assert name is not None  # called from a fixture
    if name not in stacks:
        stacks[name] = start_stack(model, free_port(), run_dirs.mktemp(name), http_port=free_port(),
                                   tokenizer_args=tokenizer_args, say=lambda _: None,
                                   grammar_preload=False)  # fmt: skip
    yield stacks[name]
    items = request.session.items
    last = max(i for i, item in enumerate(items) if getattr(item, "module", None) is request.module)
    if not any(name in getattr(item, "fixturenames", ()) for item in items[last + 1 :]):
        stacks.pop(name).stop()


@pytest.fixture(scope="module")
def plain_stack(
    request: pytest.FixtureRequest, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory,
    _shared_stacks: dict[str, Stack],
) -> Iterator[Stack]:  # fmt: skip
    """Tiny Qwen3, every service at its defaults, no API key, gRPC and HTTP fronts."""
    yield from shared_stack(request, _shared_stacks, tiny_qwen3, tmp_path_factory)
