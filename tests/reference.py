"""The reference of truth: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model_dir: Path | str, ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """transformers' generate, greedy; the new ids only (eos included when it stops there)."""
    model = hf_model(str(model_dir))
    kwargs: dict[str, object] = {}
    if not stop_at_eos:
        kwargs["eos_token_id"] = None
        kwargs["pad_token_id"] = 0
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()
