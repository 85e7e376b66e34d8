"""What the tokenizer service needs from a model directory: the tokenizer and a few limits."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class ModelCard:
    name: str
    architecture: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    hybrid: bool


def _eos(model_dir: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    ids: Any = cfg.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


def read_card(model_dir: Path, name: str = "") -> ModelCard:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    arch = (cfg.get("architectures") or ["unknown"])[0]
    return ModelCard(
        name=name or model_dir.resolve().name,
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=_eos(model_dir, cfg),
        hybrid="layer_types" in cfg and "linear_attention" in cfg["layer_types"],
    )


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))
