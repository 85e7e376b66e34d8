"""``benchmarks/draft_pair.py``: the constructed target / draft pair of ``make bench-spec-draft``
loads in transformers, and with the later layers' output projections at 0 the target computes
exactly what its draft does (those layers add nothing to the residual stream)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.draft_pair import write_pair


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits[0]


def test_a_pair_at_scale_zero_is_the_draft_twice(tiny_qwen3: Path, tmp_path: Path) -> None:
    target, draft = tmp_path / "target", tmp_path / "draft"
    write_pair(tiny_qwen3, target, draft, draft_layers=1, target_layers=5, scale=0.0)
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 5
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    ids = torch.tensor([[3, 17, 5, 9, 40, 22, 8]])
    torch.testing.assert_close(_logits(target, ids), _logits(draft, ids), rtol=0, atol=1e-5)
    write_pair(tiny_qwen3, target, draft, draft_layers=1, target_layers=5, scale=1.0)
    assert (_logits(target, ids) - _logits(draft, ids)).abs().max() > 1e-3  # the later layers count again


def test_a_pair_needs_more_target_layers_than_draft_layers(tiny_qwen3: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--target-layers must exceed"):
        write_pair(tiny_qwen3, tmp_path / "t", tmp_path / "d", draft_layers=2, target_layers=2, scale=0.1)
