"""Frozen per-service configuration, built once at start from a file and command-line flags.

Each service declares a ``@dataclass(frozen=True, slots=True)`` of plain fields (str, int, float,
bool, Literal[...], ``X | None``). ``add_arguments`` turns its fields into ``--kebab-case`` flags and
``build_config`` merges defaults ← file (YAML or JSON) ← flags, rejecting unknown keys and values
of the wrong type. Nothing reads configuration from environment variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(key: str, value: Any) -> int:
    """A byte count: an integer, or a number with a unit (``64MiB``, ``2GiB``, ``1.5GB``, ``512k``;
    K/M/G/T and KiB/MiB/... are powers of 1024, KB/MB/... of 1000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{key}: expected bytes such as 67108864, 64MiB or 2GiB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (from YAML, JSON or a flag string) to the field type ``tp``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0])
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int and key.endswith("_bytes"):
        return parse_bytes(key, value)
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            out = tp(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}") from e
        if tp is int and isinstance(value, float) and value != out:
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return out
    if tp is str:
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add ``--config FILE`` and one flag per field of ``cls`` (default: not given)."""
    parser.add_argument("--config", default=None, help="YAML or JSON file with the same keys as the flags")
    for f in dataclasses.fields(cls):
        doc = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(_flag(f.name), dest=f.name, default=None, help=f"{doc} (default: {default})")


def load_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_config(cls: type[T], values: dict[str, Any]) -> T:
    """Build a frozen ``cls`` from ``values``; unknown keys and bad values raise ConfigError."""
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown configuration key(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}"
        )
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    try:
        cfg = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(str(e)) from e
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Defaults ← ``--config`` file ← flags that were given."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_file(args.config))
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return build_config(cls, values)


def to_args(cfg: Any) -> list[str]:
    """The flags that rebuild ``cfg`` (used by ``strata up`` to start child services)."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None:
            continue
        out += [_flag(f.name), str(v).lower() if isinstance(v, bool) else str(v)]
    return out


def model_dir_problem(path: str) -> str | None:
    """Why ``path`` is not a Hugging Face model directory (None if it is), with the nearest
    sibling name when it looks mistyped."""
    p = Path(path)
    if (p / "config.json").is_file():
        return None
    if not p.exists():
        parent = p.parent if str(p.parent) else Path(".")
        names = [c.name for c in parent.iterdir() if (c / "config.json").is_file()] if parent.is_dir() else []
        near = difflib.get_close_matches(p.name, names, n=1)
        hint = f"; did you mean {parent / near[0]}?" if near else ""
        return f"{path}: no such directory{hint}"
    return f"{path}: not a Hugging Face model directory (it has no config.json)"
