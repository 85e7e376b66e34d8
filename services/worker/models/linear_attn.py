"""Qwen3-Next's gated DeltaNet (linear attention) over Mamba-pool slots.

A linear-attention layer carries two pieces of per-request state between forwards, both kept
in the Mamba pool at the request's slot:

* ``conv``: the last ``kernel - 1`` inputs of the depthwise causal convolution, ``[C, K-1]``;
* ``ssm``: the gated-delta-rule matrix ``S``, ``[Hv, Dk, Dv]`` (fp32).

Per token ``t`` and value head ``h`` (``q``/``k`` L2-normalised, ``q`` scaled by ``Dk**-0.5``)::

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T      # the delta rule: write only the correction
    o_t = q_t^T S

An extend chunk continues from the stored state and leaves the state after its last token, so
any split of a prompt into chunks (and decode after it) computes the same function as one-shot
prefill (up to fp32 rounding: see ``kernels.gated_delta.gated_delta_extend_torch``). Parameter
names match the Hugging Face checkpoint (``linear_attn.*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv1d import causal_conv1d_extend, causal_conv1d_update
from kernels.gated_delta import gated_delta_extend, gated_delta_step
from services.worker.tp import SINGLE, RowLinear, Tp, column_linear, shard_rows



@dataclass(slots=True)
class StateTrace:
    """The states of some requests after each of their new tokens, through one forward (a verify
    pass of drafts, so that rejected drafts can be dropped without running the kept ones again).

    ``records[slot]``, one entry per linear-attention layer in the order they run: the conv window
    ``[C, Ks + T]`` (the conv state before the pass, then the pass's ``T`` inputs: the state after
    ``n`` tokens is its columns ``n : n + Ks``) and the recurrent state after every token
    ``[T, Hv, Dk, Dv]``. Traced requests' tokens run one at a time in the recurrent form, as decode
    steps run them (``MambaPool.keep_traced`` puts back the state after the kept ones)."""

    slots: frozenset[int]
    records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StateSpans:
    """Where each request's new tokens lie in the flat batch, and the Mamba slot it owns.

    Request ``i`` owns tokens ``cu_seqlens[i]:cu_seqlens[i + 1]`` and slot ``slots[i]``; slots
    are distinct within a batch (two requests never write one state).
    """

    cu_seqlens: tuple[int, ...]
    slots: tuple[int, ...]
    trace: StateTrace | None = None  # requests whose per-token states this forward records

    def __post_init__(self) -> None:
        if len(self.cu_seqlens) != len(self.slots) + 1:
            raise ValueError(
                f"{len(self.slots)} slots need {len(self.slots) + 1} cu_seqlens, got {len(self.cu_seqlens)}"
            )
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"Mamba slots repeat within one batch: {self.slots}")

    def decode_and_extend(self) -> tuple[list[int], list[int]]:
        """Indices of requests with exactly one new token, and of the others."""
        lens = [b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:], strict=False)]
        return [i for i, n in enumerate(lens) if n == 1], [i for i, n in enumerate(lens) if n > 1]


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim, scaled by ``weight`` (not zero-centred), then gated by silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as the reference (rsqrt of sum + eps), so logits match within 1e-4.
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads(num_k: int, num_v: int, tp: Tp) -> tuple[int, int, int, int]:
    """This rank's ``(first key head, key heads, first value head within each key head's group,
    value heads per key head)``: whole key-head groups when the ranks divide the key heads, else
    one key head replicated on ``size / num_k`` ranks, its value heads split among them."""
    r = num_v // num_k
    if num_k % tp.size == 0:
        k0, hk = tp.split(num_k, "linear_num_key_heads")
        return k0, hk, 0, r
    m = tp.size // num_k
    if tp.size % num_k or r % m:
        raise ValueError(
            f"tensor parallel size {tp.size} must divide linear_num_key_heads ({num_k}) or be a multiple of it "
            f"that divides linear_num_value_heads ({num_v})"
        )
    return tp.rank // m, 1, (tp.rank % m) * (r // m), r // m


def _merge(pieces: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Adjacent (start, stop) pieces joined, so a contiguous shard is read in one slice."""
    out: list[tuple[int, int]] = []
    for a, b in pieces:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer; ``forward`` reads and updates Mamba slots in place.

    Tensor parallel: by key heads, each with its ``Hv / Hk`` value heads (the checkpoint groups
    the projections that way), or, with more ranks than key heads, one key head replicated and its
    value heads split (``_heads``): a rank's conv channels, recurrent state, ``dt_bias`` /
    ``A_log`` are those of its heads; ``out_proj`` is row-parallel, all-reduced."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        tp: Tp = SINGLE,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={num_v_heads} must be a multiple of "
                f"linear_num_key_heads={num_k_heads}"
            )
        r = num_v_heads // num_k_heads
        k0, hk, i0, rv = _heads(num_k_heads, num_v_heads, tp)
        v0, hv = k0 * r + i0, hk * rv
        self.tp = tp
        self.hk, self.hv, self.dk, self.dv = hk, hv, head_k_dim, head_v_dim  # this rank's heads
        self.kernel = conv_kernel
        self.key_dim, self.value_dim = hk * head_k_dim, hv * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        dk, dv, g = head_k_dim, head_v_dim, 2 * head_k_dim + 2 * r * head_v_dim  # g: one key head's rows
        qkvz: list[tuple[int, int]] = []
        ba: list[tuple[int, int]] = []
        for j in range(k0, k0 + hk):  # per key head: [q | k | v (its value heads) | z (same)], [b | a]
            base = j * g + 2 * dk
            qkvz += [(j * g, base), (base + i0 * dv, base + (i0 + rv) * dv)]
            qkvz += [(base + (r + i0) * dv, base + (r + i0 + rv) * dv)]
            ba += [(2 * r * j + i0, 2 * r * j + i0 + rv), (2 * r * j + r + i0, 2 * r * j + r + i0 + rv)]
        self.in_proj_qkvz = column_linear(hidden_size, num_k_heads * g, tp, pieces=_merge(qkvz))
        self.in_proj_ba = column_linear(hidden_size, 2 * num_v_heads, tp, pieces=_merge(ba))
        # nn.Conv1d only to keep the checkpoint's parameter name and [C, 1, K] shape.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        if tp.size > 1:  # the conv's channels are [q | k | v] of all heads: three pieces per rank
            full_k = num_k_heads * dk
            shard_rows(
                self.conv1d.weight,
                (k0 * dk, (k0 + hk) * dk),
                (full_k + k0 * dk, full_k + (k0 + hk) * dk),
                (2 * full_k + v0 * dv, 2 * full_k + (v0 + hv) * dv),
            )
            shard_rows(self.dt_bias, (v0, v0 + hv))
            shard_rows(self.A_log, (v0, v0 + hv))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowLinear(num_v_heads * head_v_dim, hidden_size, tp)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.hv, self.dk, self.dv)

    def _split_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Undo the checkpoint's per-key-head grouping of ``in_proj_qkvz`` / ``in_proj_ba``.

        The projections are laid out key-head by key-head, ``[q | k | v (r heads) | z (r heads)]``
        and ``[b (r) | a (r)]`` with ``r = Hv / Hk``; returns the conv input ``[T, C]`` (q, k, v
        flattened in that order), ``z [T, Hv, Dv]``, ``b`` and ``a`` ``[T, Hv]``.
        """
        t, r = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.hk, 2 * r), [r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(
        self, x: torch.Tensor, spans: StateSpans, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """Mix ``x [T, hidden]``; updates ``conv_state[slot]`` / ``ssm_state[slot]`` of every request.

        ``conv_state`` / ``ssm_state`` are this layer's whole pool tensors
        (``[num_slots, *conv_state_shape]`` and ``[num_slots, *ssm_state_shape]``).
        """
        mixed, z, b, a = self._split_projections(x)
        weight = self.conv1d.weight.squeeze(1)
        decode, extend = spans.decode_and_extend()
        cu, slots = spans.cu_seqlens, spans.slots
        # Token rows of the one-token requests (all rows in a pure decode batch: no gather needed).
        dec_tok: torch.Tensor | slice = (
            slice(None)
            if not extend
            else torch.tensor([cu[i] for i in decode], dtype=torch.long, device=x.device)
        )
        dec_slots = torch.tensor([slots[i] for i in decode], dtype=torch.long, device=x.device)
        conv_out = torch.empty_like(mixed)
        if decode:
            conv_out[dec_tok] = causal_conv1d_update(mixed[dec_tok], conv_state, weight, None, dec_slots)
        trace = spans.trace
        traced = [i for i in extend if trace is not None and slots[i] in trace.slots]
        windows: dict[int, torch.Tensor] = {}
        for i in traced:  # the conv state before the pass, then the pass's inputs
            s = slice(cu[i], cu[i + 1])
            windows[i] = torch.cat((conv_state[slots[i]], mixed[s].t().to(conv_state.dtype)), dim=-1)
        for i in extend:
            s = slice(cu[i], cu[i + 1])
            conv_out[s] = causal_conv1d_extend(mixed[s], conv_state, weight, None, slots[i])

        t = x.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # The kernels expect q/k L2-normalised (in fp32, like the reference) and q pre-scaled; each
        # key head serves Hv / Hk consecutive value heads inside the kernel.
        q = _l2norm(q.reshape(t, self.hk, self.dk).float())
        k = _l2norm(k.reshape(t, self.hk, self.dk).float())
        v = v.reshape(t, self.hv, self.dv).float()
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        core = torch.empty_like(v)
        if decode:
            # transformers divides by sqrt(Dk) on its recurrent path and multiplies by Dk**-0.5 on
            # its chunked one; the last ulp matters on small random checkpoints, so do the same.
            q_dec = q[dec_tok] / self.dk**0.5
            core[dec_tok] = gated_delta_step(
                q_dec, k[dec_tok], v[dec_tok], g[dec_tok], beta[dec_tok], ssm_state, dec_slots
            )
        for i in extend:
            s = slice(cu[i], cu[i + 1])
            if i in windows:
                assert trace is not None
                core[s], states = self._stepwise(q[s], k[s], v[s], g[s], beta[s], ssm_state, slots[i])
                trace.records.setdefault(slots[i], []).append((windows[i], states))
                continue
            # Chunked form for extends on the CPU, as transformers computes them.
            q_ext = q[s] * self.dk**-0.5
            core[s] = gated_delta_extend(q_ext, k[s], v[s], g[s], beta[s], ssm_state, slots[i])

        out = self.norm(core.to(x.dtype), z)
        return self.tp.all_reduce(self.out_proj(out.reshape(t, self.value_dim)))

    def _stepwise(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        ssm_state: torch.Tensor, slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's tokens one at a time, as decode steps run them (q divided by sqrt(Dk), the
        recurrent form); returns the outputs and the state after each token ``[T, Hv, Dk, Dv]``."""
        idx = torch.tensor([slot], dtype=torch.long, device=q.device)
        outs, states = [], []
        for j in range(q.shape[0]):
            one = slice(j, j + 1)
            outs.append(gated_delta_step(q[one] / self.dk**0.5, k[one], v[one], g[one], beta[one], ssm_state, idx))
            states.append(ssm_state[slot].clone())
        return torch.cat(outs), torch.stack(states)
