"""Loading Hugging Face directories with our own code: strict tensor matching, shards, ties, dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.loader import LoadError, fingerprint, load_model
from services.worker.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"))


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loads_every_tensor_exactly(tiny: Path) -> None:
    loaded = load_model(tiny)
    assert loaded.architecture == "Qwen3ForCausalLM"
    assert loaded.eos_token_ids == (json.loads((tiny / "config.json").read_text())["eos_token_id"],)
    stored = load_file(tiny / "model.safetensors")
    ours = loaded.model.state_dict()
    assert set(ours) == set(stored)
    for name, t in stored.items():
        assert torch.equal(ours[name], t), name
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_dtype_conversion(tiny: Path) -> None:
    loaded = load_model(tiny, dtype=torch.bfloat16)
    stored = load_file(tiny / "model.safetensors")
    for name, t in loaded.model.state_dict().items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, stored[name].to(torch.bfloat16)), name


def test_sharded_equals_single_file(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = copy_of(tiny, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    single = load_model(tiny).model.state_dict()
    multi = load_model(sharded).model.state_dict()
    assert set(single) == set(multi)
    for name in single:
        assert torch.equal(single[name], multi[name]), name


def test_tied_embeddings_share_one_parameter(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path).model
    lm_head, embed = model.get_submodule("lm_head"), model.get_submodule("model.embed_tokens")
    assert lm_head.weight is embed.weight
    assert lm_head.weight.device.type == "cpu"


def rewrite_weights(path: Path, edit: object) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, path / "model.safetensors")


def test_unsupported_architecture(tiny: Path, tmp_path: Path) -> None:
    d = copy_of(tiny, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"unsupported architecture 'GPT2LMHeadModel'.*Qwen3ForCausalLM"):
        load_model(d)


def test_missing_tensor(tiny: Path, tmp_path: Path) -> None:
    d = copy_of(tiny, tmp_path / "m")
    rewrite_weights(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(LoadError, match=r"missing 1 tensor.*'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_model(d)


def test_wrong_shape(tiny: Path, tmp_path: Path) -> None:
    d = copy_of(tiny, tmp_path / "m")

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:100].clone()

    rewrite_weights(d, shrink)
    pattern = r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(100, 64\).*\(128, 64\)"
    with pytest.raises(LoadError, match=pattern):
        load_model(d)


def test_unexpected_tensor(tiny: Path, tmp_path: Path) -> None:
    d = copy_of(tiny, tmp_path / "m")
    rewrite_weights(d, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(3)}))
    with pytest.raises(LoadError, match=r"unexpected tensor.*'model\.layers\.9\.extra\.weight'"):
        load_model(d)


def test_missing_files(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(LoadError, match=r"no config\.json"):
        load_model(tmp_path)
    d = copy_of(tiny, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=r"no \*\.safetensors"):
        load_model(d)


def test_fingerprint_is_stable_and_content_addressed(tiny: Path, tmp_path: Path) -> None:
    first = fingerprint(tiny)
    assert first == fingerprint(tiny)
    same = copy_of(tiny, tmp_path / "same")
    assert fingerprint(same) == first  # a copy is the same model
    tok_changed = copy_of(tiny, tmp_path / "tok")
    cfg = json.loads((tok_changed / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages }}"
    (tok_changed / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert fingerprint(tok_changed) != first
    weights_changed = copy_of(tiny, tmp_path / "w")
    rewrite_weights(weights_changed, lambda t: t["lm_head.weight"].mul_(2))
    assert fingerprint(weights_changed) != first
