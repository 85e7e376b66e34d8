"""``benchmarks/draft_pair.py``: the constructed target / draft pair of ``make bench-spec-draft``
loads in transformers, and with the later layers' output projections at 0 the target computes
exactly what its draft does (those layers add nothing to the residual stream); the constructed
Qwen3-Next of ``make bench-spec-mtp`` at scale 0 has an MTP head that predicts what the target will."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.draft_pair import write_mtp_target, write_pair
from services.scheduler.loop import LoopConfig
from services.scheduler.speculative import SpecConfig
from tests import sched_harness as h
from tests.reference import hf_greedy


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


def _mtp_acceptance(model_dir: Path, prompts: list[list[int]], new: int) -> float:
    """Strata's MTP path on ``model_dir``, greedy: the output equals transformers'; drafts kept / sent."""
    eng = h.Engine(model_dir, h.EngineConfig(device=h.TEST_DEVICE, kv_cache_bytes=1 << 22, max_rows=8, mtp=True))
    spec = SpecConfig("mtp", num_draft_tokens=3, max_batch=64, min_accepted=0, adaptive=False)
    outs, loop = h.run(eng, [h.Spec(p, new) for p in prompts], LoopConfig(spec=spec))
    assert [o.ids for o in outs] == [hf_greedy(model_dir, p, new, stop_at_eos=False) for p in prompts]
    assert loop.batcher is not None and loop.batcher.spec is not None
    c = loop.batcher.spec.counters
    assert c.draft_tokens > 0, c
    return c.accepted_tokens / c.draft_tokens


def test_an_mtp_target_at_scale_zero_keeps_every_draft(tiny_qwen3_next: Path, tmp_path: Path) -> None:
    """Every layer's output projections at 0: the target's next token is a function of its current
    token's embedding, and the head (fc passing the embedding through, the target's final norm)
    computes the same function one position ahead, so Strata's MTP path keeps its drafts."""
    target = tmp_path / "target"
    write_mtp_target(tiny_qwen3_next, target, target_layers=3, scale=0.0)
    source_kinds = json.loads((tiny_qwen3_next / "config.json").read_text())["layer_types"]
    config = json.loads((target / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["layer_types"] == (source_kinds * 3)[:3]
    prompts = [[3 + (7 * i + 13 * j) % 700 for j in range(20 + 5 * i)] for i in range(3)]
    assert _mtp_acceptance(target, prompts, 12) >= 0.95  # rounding may flip a near-tie
    full = tmp_path / "full"  # another directory: transformers' models are cached by path
    write_mtp_target(tiny_qwen3_next, full, target_layers=3, scale=1.0)
    assert _mtp_acceptance(full, prompts[:1], 12) < 0.5  # the layers and the head's own count again


def test_an_mtp_target_needs_a_head(tiny_qwen3: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Qwen3-Next"):
        write_mtp_target(tiny_qwen3, tmp_path / "t", target_layers=2, scale=0.1)
