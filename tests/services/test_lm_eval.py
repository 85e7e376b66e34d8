"""lm-evaluation-harness against Strata (issue #28): its ``local-completions`` model over Strata's
``/v1/completions`` (echo + logprobs: the prompt scored in the forward that prefills it) computes
the same loglikelihoods as its ``hf`` backend on the same checkpoint, on a multiple-choice task
over a committed jsonl (``benchmarks/lm_eval/``; nothing downloaded). Marked slow (~30 s with
lm-eval's imports and its hf run) and skipped without the ``eval`` extra; ``make eval`` runs it on a
stack of its own. Here it uses the shared OpenAI stack (``tests/openai_stack.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.openai_stack import KEY, MODEL

pytestmark = pytest.mark.slow


def test_local_completions_equal_the_hf_backend(
    openai_base: str, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lm_eval")
    from benchmarks.lm_eval_compare import TOLERANCE, run

    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # lm-eval's API models send it as the bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run(tiny_qwen3, openai_base, MODEL)
    assert result.requests == 4 * result.docs == 96
    assert result.max_abs_delta <= TOLERANCE, result
    assert result.greedy_equal and result.strata == result.hf, result
