"""Load a Hugging Face model directory with our own model code, and fingerprint it.

A directory holds ``config.json``, weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, optional ``generation_config.json`` and tokenizer files. The
model class comes from ``config.json``'s ``architectures[0]`` through the registry; tensors are
matched to the model's ``state_dict`` by name, strictly: a missing, mis-shaped or unexpected tensor
is a ``LoadError`` naming it. Nothing is silently left at random init. A model class may name
``optional_checkpoint_prefixes`` (Qwen3-Next: ``mtp.``): tensors under them belong to an optional
head that its own loader reads when asked for (``models/qwen3_next_mtp.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from services.worker.models.registry import build_model
from services.worker.tp import SINGLE, Shard, Tp

INDEX_FILE = "model.safetensors.index.json"
# Files whose bytes define the model as far as a client can tell (weights are added separately).
_FINGERPRINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
# Old checkpoints store rotary tables that every modern implementation recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LoadError(ValueError):
    """The directory cannot be loaded as the model it claims to be."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: dict[str, Any]
    architecture: str
    eos_token_ids: tuple[int, ...]


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise LoadError(f"{model_dir} has no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoadError(f"{path} must hold a JSON object")
    return config


def eos_token_ids(model_dir: Path, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids: ``generation_config.json`` wins over ``config.json`` (as in transformers)."""
    gen_path = Path(model_dir) / "generation_config.json"
    value = None
    if gen_path.is_file():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
    if value is None:
        value = hf_config.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir`` (shards from the index when there is one)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise LoadError(f"{index} lists shard {f.name}, which does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir} has no *.safetensors weights")
    return files


def read_tensors(
    model_dir: Path, dtype: torch.dtype, shards: dict[str, Shard] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of every weight file (those whose name ``keep`` accepts), floating ones
    converted to ``dtype`` (on the CPU).

    ``shards``: tensors of which only a slice is wanted (tensor parallelism); only that slice is
    read from the file."""
    tensors: dict[str, torch.Tensor] = {}
    shards = shards or {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep is not None and not keep(name):
                    continue
                if name in tensors:
                    raise LoadError(f"tensor {name!r} appears in more than one weight file ({path.name})")
                shard = shards.get(name)
                if shard is None:
                    t = f.get_tensor(name)
                else:
                    part = f.get_slice(name)
                    shape = tuple(part.get_shape())
                    if shard.dim >= len(shape) or max(b for _, b in shard.pieces) > shape[shard.dim]:
                        raise LoadError(f"tensor {name!r} of shape {shape} cannot hold this rank's shard {shard}")
                    t = shard.take(shape, part)
                tensors[name] = t.to(dtype) if t.is_floating_point() else t
    return tensors


@contextmanager
def skeleton() -> Iterator[None]:
    """Build modules on ``meta`` with ``torch.nn.init``'s functions as no-ops: every weight is
    filled from the checkpoint afterwards, and on ``meta`` the first init call imports torch's
    Python decompositions to initialise nothing (2.1 of a tiny model's 2.2 s of building, most of
    a worker's start after importing torch)."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, _unchanged)
    try:
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def load_model(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu", tp: Tp = SINGLE
) -> LoadedModel:
    """Build the model ``config.json`` names and fill every weight from the checkpoint.

    ``tp``: build this rank's shard of the model and read only its slices of the weights.

    Raises ``LoadError`` (a ``ValueError``) for an unsupported architecture, a missing tensor, a
    tensor of the wrong shape, or a checkpoint tensor the model has no place for.
    """
    model_dir = Path(model_dir)
    hf_config = read_config(model_dir)
    try:
        with skeleton():
            model = build_model(hf_config, tp)
    except LoadError:
        raise
    except ValueError as e:
        raise LoadError(f"{model_dir}: {e}") from e
    shards = {n: p.tp_shard for n, p in model.state_dict(keep_vars=True).items() if hasattr(p, "tp_shard")}
    # Optional heads (Qwen3-Next's ``mtp.*``) are loaded by their own loader when asked for.
    optional: tuple[str, ...] = getattr(model, "optional_checkpoint_prefixes", ())
    tensors = read_tensors(model_dir, dtype, shards, keep=lambda n: not n.startswith(optional))
    convert = getattr(model, "convert_checkpoint", None)
    if convert is not None:
        tensors = convert(tensors)
    _fill(model, tensors, torch.device(device))
    model.eval()
    arch = hf_config["architectures"][0]
    return LoadedModel(model, hf_config, arch, eos_token_ids(model_dir, hf_config))


def fill_module(module: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill ``module`` (built on ``meta``) from ``tensors`` by its ``state_dict`` names, strictly:
    ``LoadError`` for a missing, mis-shaped or unexpected tensor."""
    _fill(module, tensors, device)


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    # Group state_dict names by tensor identity: tied weights are one Parameter under several names.
    groups: dict[int, list[str]] = {}
    targets: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        targets[id(t)] = t
    known = {name for names in groups.values() for name in names}
    unexpected = sorted(n for n in tensors if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise LoadError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {_few(unexpected)}")
    missing: list[str] = []
    for key, names in groups.items():
        present = [n for n in names if n in tensors]
        if not present:
            missing.append(" = ".join(names))
            continue
        want = tuple(targets[key].shape)
        for n in present:
            if tuple(tensors[n].shape) != want:
                raise LoadError(f"tensor {n!r} has shape {tuple(tensors[n].shape)}, the model expects {want}")
        value = tensors[present[-1]].to(device)
        is_param = isinstance(targets[key], nn.Parameter)
        new = nn.Parameter(value, requires_grad=False) if is_param else value
        for n in names:
            _assign(model, n, new)
    if missing:
        raise LoadError(f"checkpoint is missing {len(missing)} tensor(s): {_few(sorted(missing))}")
    leftover = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if leftover:  # a model broke the registry contract (a tensor outside state_dict)
        raise RuntimeError(f"model tensors not covered by the checkpoint contract: {_few(leftover)}")


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if leaf in module._parameters:
        module._parameters[leaf] = value  # type: ignore[assignment]
    else:
        module._buffers[leaf] = value


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def fingerprint(model_dir: Path) -> str:
    """sha256 (hex) over config, generation config, tokenizer files and weight bytes.

    File digests are cached by (path, size, mtime, inode), so a second call on an unchanged
    directory reads no weight bytes.
    """
    model_dir = Path(model_dir).resolve()
    h = hashlib.sha256()
    files = [model_dir / n for n in _FINGERPRINT_FILES if (model_dir / n).is_file()]
    index = model_dir / INDEX_FILE
    files += [index] if index.is_file() else []
    files += weight_files(model_dir)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0".encode())
        h.update(_file_digest(str(f), st.st_size, st.st_mtime_ns, st.st_ino))
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int, inode: int) -> bytes:
    # size / mtime / inode are only cache keys: a rewritten file gets a fresh digest.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.digest()
