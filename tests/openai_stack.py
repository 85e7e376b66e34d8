"""One stack serving the OpenAI-compatible API, shared by the HTTP API's test modules
(``tests/services/test_openai_api.py``, ``test_openai_tools.py``): starting a stack costs seconds.

It is one of ``tests/shared_stacks.py``'s: it starts with the first module that asks for
``openai_stack`` and stops after the last one in the run that does. Its tokenizer runs with API
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

from services.supervisor import Stack
from tests.shared_stacks import shared_stack

KEY = "sk-test-strata"
MODEL = "qwen3-tiny"


@pytest.fixture(scope="module")
def openai_stack(
    request: pytest.FixtureRequest, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory,
    _shared_stacks: dict[str, Stack],
) -> Iterator[Stack]:  # fmt: skip
    yield from shared_stack(request, _shared_stacks, tiny_qwen3, tmp_path_factory, tokenizer_args=(
        "--api-key", f"other-key,{KEY}", "--model-name", MODEL,
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
    ))  # fmt: skip


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
