"""Which model class serves which Hugging Face architecture, and what every model class provides.

A model class is an ``nn.Module`` built from the raw ``config.json`` dict
(``cls(hf_config: dict[str, Any])``) whose ``state_dict`` names equal the checkpoint's tensor names
(after the optional ``convert_checkpoint`` hook), so the loader can match tensors by name. The
loader builds it on the ``meta`` device, so ``__init__`` must not compute tensor values: anything
derived (rotary tables) is computed lazily on first use. Weights that are tied are the same
``nn.Parameter`` object under two names; the loader fills either from whichever name the checkpoint
has. Tensor parallelism: ``cls(hf_config, tp)`` builds rank ``tp.rank``'s shard, its parameters
marked with the slice of the checkpoint tensor they hold (``services.worker.tp``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from services.worker.batch import ForwardBatch, ForwardContext
    from services.worker.tp import Tp


@runtime_checkable
class CausalLM(Protocol):
    """What the engine needs from a model.

    ``forward(batch, ctx)`` stores this batch's K/V (full-attention layers) at ``batch.out_slots``
    and attends through ``ctx.attn``, updates Mamba state in ``ctx.mamba`` (hybrid models), and
    returns logits ``[len(batch.logit_index), vocab_size]`` for the tokens ``batch.logit_index``
    names. Hybrid models additionally expose ``mamba_spec`` (a ``MambaSpec``); models may define
    ``convert_checkpoint(tensors: dict[str, Tensor]) -> dict[str, Tensor]`` to rename / fuse
    checkpoint tensors before they are matched against ``state_dict``.
    """

    vocab_size: int
    num_kv_layers: int  # full-attention layers (KV pool layers)
    num_kv_heads: int  # this rank's KV heads (tensor parallelism: its shard)
    head_dim: int

    def forward(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor: ...


# architecture name -> "module:Class", imported on first use so that a dense-only deployment
# never imports the hybrid model code.
_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "services.worker.models.qwen3:Qwen3ForCausalLM",
    "LlamaForCausalLM": "services.worker.models.qwen3:LlamaForCausalLM",
    "Qwen3NextForCausalLM": "services.worker.models.qwen3_next:Qwen3NextForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    """The model class for a ``config.json`` ``architectures[0]`` value.

    Raises ``ValueError`` naming the architecture and the supported ones when it is unknown.
    """
    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise ValueError(
            f"unsupported architecture {architecture!r} in config.json; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls: type[nn.Module] = getattr(module, class_name)
    return cls


def build_model(hf_config: dict[str, Any], tp: Tp | None = None) -> nn.Module:
    """Instantiate (on the current default device) the model ``hf_config`` describes; with ``tp``,
    this rank's shard of it (see ``services.worker.tp``)."""
    archs = hf_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError("config.json has no 'architectures' list naming the model class")
    cls: Any = model_class(archs[0])
    return cls(hf_config) if tp is None or tp.size == 1 else cls(hf_config, tp)
