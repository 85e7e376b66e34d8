"""The tiny checkpoint generator: loadable by transformers, deterministic, usable for greedy tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.worker.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3-next", "tiny", tmp_path_factory.mktemp("next"))


def test_files_and_config(qwen3: Path) -> None:
    names = {p.name for p in qwen3.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((qwen3 / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert (config["head_dim"], config["max_position_embeddings"]) == (16, 2048)
    assert 512 <= config["vocab_size"] <= 1024
    gen = json.loads((qwen3 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]
    assert all(t.dtype == torch.float32 for t in load_file(qwen3 / "model.safetensors").values())


def test_tokenizer_loads_with_chat_template(qwen3: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == json.loads((qwen3 / "config.json").read_text())["eos_token_id"]
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    text = 'The quick river, said Alice: {"age": 42} \u00e9t\u00e9 \U0001f600!'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_same_seed_same_bytes_other_seed_differs(qwen3: Path, tmp_path: Path) -> None:
    again = write_tiny_checkpoint("qwen3", "tiny", tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (qwen3 / name).read_bytes(), name
    other = write_tiny_checkpoint("qwen3", "tiny", tmp_path / "other", seed=1)
    a, b = load_file(qwen3 / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_logit_margins_are_not_flat(qwen3: Path) -> None:
    """Greedy comparisons need the top-1 logit to beat the runner-up by far more than fp32 noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top = model(ids).logits.topk(2, dim=-1).values
    margin = (top[..., 0] - top[..., 1]).flatten()
    assert float((margin > 1e-3).float().mean()) > 0.99


def test_qwen3_next_is_hybrid_and_loads(qwen3_next: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((qwen3_next / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert {"linear_attention", "full_attention"} == set(config["layer_types"])
    assert config["num_experts"] > config["num_experts_per_tok"] >= 1
    assert config["shared_expert_intermediate_size"] > 0
    model = AutoModelForCausalLM.from_pretrained(qwen3_next).eval()
    tok = AutoTokenizer.from_pretrained(qwen3_next)
    ids = tok("Hello world, the sea is blue.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_qwen3_next_carries_an_mtp_head(qwen3_next: Path, tmp_path: Path) -> None:
    """Random ``mtp.*`` weights in the released checkpoints' layout, in a file of their own that
    transformers does not read; completing an older checkpoint writes the same bytes."""
    import shutil

    from services.worker.models.qwen3_next_mtp import mtp_problem
    from services.worker.tiny import MTP_FILE, add_mtp_head

    config = json.loads((qwen3_next / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and mtp_problem(qwen3_next) is None
    head = load_file(qwen3_next / MTP_FILE)
    hidden = config["hidden_size"]
    assert all(n.startswith("mtp.") for n in head) and head["mtp.fc.weight"].shape == (hidden, 2 * hidden)
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight"} <= set(head)  # fmt: skip
    assert not any(n.startswith("mtp.") for n in load_file(qwen3_next / "model.safetensors"))
    older = tmp_path / "older"
    shutil.copytree(qwen3_next, older)
    (older / MTP_FILE).unlink()
    (older / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_nextn_predict_layers"}))
    assert mtp_problem(older) is not None
    assert add_mtp_head(older) and not add_mtp_head(older)
    for name in (MTP_FILE, "config.json"):
        assert (older / name).read_bytes() == (qwen3_next / name).read_bytes(), name


def test_rejects_unknown_arch_and_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        write_tiny_checkpoint("gpt2", "tiny", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size"):
        write_tiny_checkpoint("qwen3", "huge", tmp_path)  # type: ignore[arg-type]
