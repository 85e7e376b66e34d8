"""One stack serving the OpenAI-compatible API, shared by the HTTP API's test modules
(``tests/services/test_openai_api.py``, ``test_openai_tools.py``): starting a stack costs seconds.

It starts with the first module that asks for ``openai_stack`` and stops with the last one in the
run that does (so it does not idle through the modules after it). Its tokenizer runs with API
keys, a served model name, ``--tool-call-parser hermes`` and ``--reasoning-parser qwen3``; tests
that need a stack of their own configuration start one.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack

KEY = "sk-test-strata"
MODEL = "qwen3-tiny"


class _Shared:
    stack: Stack | None = None


@pytest.fixture(scope="session")
def _openai_shared() -> Iterator[_Shared]:
    shared = _Shared()
    yield shared
    if shared.stack is not None:  # the run stopped early (-x, ^C)
        shared.stack.stop()


@pytest.fixture(scope="module")
def openai_stack(
    request: pytest.FixtureRequest, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory, _openai_shared: _Shared
) -> Iterator[Stack]:
    if _openai_shared.stack is None:
        _openai_shared.stack = start_stack(
            tiny_qwen3,
            free_port(),
            tmp_path_factory.mktemp("openai"),
            http_port=free_port(),
            tokenizer_args=(
                "--api-key", f"other-key,{KEY}", "--model-name", MODEL,
                "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            ),
            say=lambda _: None,
        )  # fmt: skip
    yield _openai_shared.stack
    items = request.session.items
    last = max(i for i, item in enumerate(items) if getattr(item, "module", None) is request.module)
    if not any("openai_stack" in getattr(item, "fixturenames", ()) for item in items[last + 1 :]):
        _openai_shared.stack.stop()
        _openai_shared.stack = None


@pytest.fixture(scope="module")
def openai_base(openai_stack: Stack) -> str:
    return f"http://{openai_stack.child('tokenizer').extra['http']}"


@pytest.fixture(scope="module")
def openai_client(openai_base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{openai_base}/v1", api_key=KEY, max_retries=0, timeout=120)


def http(url: str, body: dict[str, Any] | bytes | None = None, key: str | None = KEY) -> tuple[int, Any]:
    """POST ``body`` (GET without one); the status and the decoded JSON (or text) answer."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("content-type", "application/json")
    if key is not None:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()
