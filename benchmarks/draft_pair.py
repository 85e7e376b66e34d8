"""A target / draft checkpoint pair that agree about as often as a trained pair does.

    make bench-spec-draft        (python -m benchmarks.draft_pair, then benchmarks.spec --draft-model)

Every checkpoint here has random weights, so a smaller model of the same vocabulary agrees with
a target about as often as chance, and draft-model speculation would be measured only where it
fails. This writes a pair whose agreement is set by construction instead:

- the **draft** is the first ``--draft-layers`` decoder layers of ``--source``, with its
  embeddings, final norm and LM head;
- the **target** has ``--target-layers`` decoder layers: the draft's, then the source's layers
  after them, repeated in order as often as needed, with the output projections of every layer
  past the draft's (attention ``o_proj`` and MLP ``down_proj``) multiplied by ``--scale``: those
  layers run at full cost, but only nudge the residual stream the draft's layers leave.

The draft's share of the target's cost is about what a served pair has (Qwen3-0.6B drafting for
Qwen3-8B: ~8 % of the weights read a token): on the bench model's shapes a 1-layer draft reads
~7.4 M parameters a token (its layer and LM head) against ~54 M for a 16-layer target. The smaller
``--scale``, the more often the draft's greedy token is the target's (measured by transformers on
the written pair: ``python -m benchmarks.draft_pair`` prints it). Both are ordinary Hugging Face
checkpoints (the source's tokenizer files copied), loaded like any other. What this measures is
the speed of the draft path (the draft's forwards, the target's verify pass, rollback) at a given
agreement, not how well a real small model predicts a real large one.

``--mtp`` writes the same kind of pair for Qwen3-Next's multi-token-prediction head
(``make bench-spec-mtp``): one checkpoint, ``--target`` (default ``models/qwen3-next-bench-mtp``),
whose ``--target-layers`` layers are ``--source``'s (a Qwen3-Next with an MTP head), repeated in
order, every one with its output projections (``linear_attn.out_proj``, ``self_attn.o_proj``, the
experts' and the shared expert's ``down_proj``) multiplied by ``--scale``, so that the target's
next token is mostly a function of its current token's embedding. The head is given the same
function: its ``fc`` passes the normed embedding of the token at ``p + 1`` through and drops the
hidden state (``[I | 0]``), its decoder layer's output projections are scaled alike, and its final
norm is the target's. At scale 0 the head's token at ``p + 2`` is the target's own (up to rounding:
the head normalises the embedding twice), and the larger the scale the more the target's layers
and the head's own move each away from it. transformers has no MTP head, so the agreement is what
the spec bench measures: its acceptance column, from the scheduler's metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent


def _layer(name: str) -> int | None:
    """The decoder layer a weight belongs to (``model.layers.<i>.``), else None."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 2 else None


# A layer's output projections: what it adds to the residual stream goes through one of these.
OUT_PROJ = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight")


def _scaled(name: str, w: torch.Tensor, scale: float) -> torch.Tensor:
    return w * scale if name.endswith(OUT_PROJ) else w.clone()


def _load(source: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        weights |= load_file(str(f))
    return weights


def _write(source: Path, out: Path, config: dict[str, Any], files: dict[str, dict[str, torch.Tensor]]) -> None:
    """``out`` gets ``config``, the ``files`` of tensors, and ``source``'s other files (tokenizer ...)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    for old in out.glob("*.safetensors"):
        old.unlink()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})


def write_mtp_target(source: Path, target: Path, target_layers: int, scale: float) -> None:
    """A Qwen3-Next checkpoint whose MTP head agrees with it by construction (the module docstring)."""
    from services.worker.models.qwen3_next_mtp import PREFIX, mtp_problem
    from services.worker.tiny import MTP_FILE

    if problem := mtp_problem(source):
        raise ValueError(problem)
    if target_layers < 1:
        raise ValueError(f"--target-layers must be >= 1, got {target_layers}")
    config = json.loads((source / "config.json").read_text())
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    weights = _load(source)
    body = {n: w for n, w in weights.items() if _layer(n) is None and not n.startswith(PREFIX)}
    for j in range(target_layers):  # the source's layers in order, repeated, every one scaled
        prefix = f"model.layers.{j % layers}."
        for name, w in weights.items():
            if name.startswith(prefix):
                body[f"model.layers.{j}." + name[len(prefix):]] = _scaled(name, w, scale)
    head = {n: _scaled(n, w, scale) for n, w in weights.items() if n.startswith(PREFIX)}
    # fc(concat(e, h)): the embedding's half is the identity, the hidden state's half zero.
    head[PREFIX + "fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    head[PREFIX + "pre_fc_norm_embedding.weight"] = torch.zeros(hidden)  # zero-centred: a gain of 1
    head[PREFIX + "norm.weight"] = body["model.norm.weight"].clone()  # the target's logit gain
    kinds = [config["layer_types"][j % layers] for j in range(target_layers)]
    config_n = {**config, "num_hidden_layers": target_layers, "layer_types": kinds}
    _write(source, target, config_n, {"model.safetensors": body, MTP_FILE: head})


def write_pair(source: Path, target: Path, draft: Path, draft_layers: int, target_layers: int, scale: float) -> None:
    config = json.loads((source / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    if not 0 < draft_layers < layers:
        raise ValueError(f"--draft-layers must be in 1..{layers - 1} for {source} ({layers} layers), "
                         f"got {draft_layers}")
    if target_layers <= draft_layers:
        raise ValueError(f"--target-layers must exceed --draft-layers ({draft_layers}), got {target_layers}")
    if isinstance(config.get("layer_types"), list) and len(set(config["layer_types"])) > 1:
        kinds = sorted(set(config["layer_types"]))
        raise ValueError(f"{source}: layers of several types ({kinds}); a dense source only")
    weights = _load(source)
    shared = {name: w for name, w in weights.items() if _layer(name) is None}
    kept = shared | {name: w for name, w in weights.items() if (i := _layer(name)) is not None and i < draft_layers}
    deep = dict(kept)
    later = list(range(draft_layers, layers))
    for j in range(draft_layers, target_layers):  # the source's later layers, repeated, scaled
        src = later[(j - draft_layers) % len(later)]
        prefix = f"model.layers.{src}."
        for name, w in weights.items():
            if name.startswith(prefix):
                deep[f"model.layers.{j}." + name[len(prefix):]] = _scaled(name, w, scale)
    for out, tensors, n in ((target, deep, target_layers), (draft, kept, draft_layers)):
        if isinstance(config.get("layer_types"), list):  # one type (checked above), n of them
            config_n = {**config, "num_hidden_layers": n, "layer_types": config["layer_types"][:1] * n}
        else:
            config_n = {**config, "num_hidden_layers": n}
        _write(source, out, config_n, {"model.safetensors": tensors})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mtp", action="store_true", help="write a Qwen3-Next target for its own MTP head instead")
    p.add_argument("--source", type=Path, default=None,
                   help="default: models/qwen3-bench (--mtp: models/qwen3-next-bench)")
    p.add_argument("--target", type=Path, default=None,
                   help="default: models/qwen3-bench-target (--mtp: models/qwen3-next-bench-mtp)")
    p.add_argument("--draft", type=Path, default=ROOT / "models" / "qwen3-bench-draft")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--target-layers", type=int, default=16)
    p.add_argument("--scale", type=float, default=None,
                   help="the later layers' output projections, multiplied (default 0.015; --mtp: 0.001)")
    p.add_argument("--check", type=int, default=4, help="prompts to measure the pair's greedy agreement on (0: none)")
    a = p.parse_args(argv)
    models = ROOT / "models"
    source = a.source or models / ("qwen3-next-bench" if a.mtp else "qwen3-bench")
    target = a.target or models / ("qwen3-next-bench-mtp" if a.mtp else "qwen3-bench-target")
    scale = a.scale if a.scale is not None else (0.001 if a.mtp else 0.015)
    try:
        if a.mtp:
            write_mtp_target(source, target, a.target_layers, scale)
        else:
            write_pair(source, target, a.draft, a.draft_layers, a.target_layers, scale)
    except (ValueError, OSError) as e:
        print(f"draft_pair: {e}", file=sys.stderr)
        return 2
    if a.mtp:
        print(f"wrote {target} ({a.target_layers} layers and its MTP head), scale {scale}; its agreement is the "
              "acceptance benchmarks.spec --sides off,mtp measures")  # fmt: skip
        return 0
    print(f"wrote {target} ({a.target_layers} layers) and {a.draft} (its first {a.draft_layers}), scale {scale}")
    if a.check:
        print(f"the draft's greedy token is the target's on {agreement(target, a.draft, a.check):.2f} of the "
              "target's greedy continuations (transformers, 256-token random prompts, 64 tokens each)")  # fmt: skip
    return 0


def agreement(target: Path, draft: Path, prompts: int, seed: int = 0) -> float:
    """How often the draft's argmax equals the target's along the target's own greedy continuations."""
    import transformers  # heavy: only when checking

    t = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    d = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    vocab = int(t.config.vocab_size)
    rng = random.Random(seed)
    same = total = 0
    with torch.no_grad():
        for _ in range(prompts):
            ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(256)]])
            seq = t.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
            want = t(seq).logits[0, 255:-1].argmax(-1)
            got = d(seq).logits[0, 255:-1].argmax(-1)
            same += int((want == got).sum())
            total += want.numel()
    return same / total


if __name__ == "__main__":
    sys.exit(main())
