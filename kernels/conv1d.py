"""Short causal depthwise convolution of Qwen3-Next's linear-attention layers, with a rolling state.

For channel ``c`` with taps ``weight[c, 0..K-1]`` the output at token ``t`` is
``act(bias[c] + sum_j weight[c, j] * x[t - (K - 1) + j, c])``; inputs before the request's first token
come from its conv state, and after a call the state holds the most recent inputs.

State pool: ``[N, C, Ks]`` with the oldest input first, where ``Ks`` is ``K`` (what transformers'
Qwen3-Next cache keeps: its ``conv_kernel_size`` last inputs) or ``K - 1`` (the minimum; the oldest
column of a ``K``-wide state is never read). Both are accepted. A new request starts from zeros (the
caller clears its row), which equals transformers' left zero padding.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    Impl,
    check_contiguous,
    check_dtype,
    check_index,
    check_inner_contiguous,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
    state_index_value,
    use_triton,
)

Activation = Literal["silu", "swish"] | None
"""``silu`` (alias ``swish``, Hugging Face's name for the same function) or no activation."""

# --------------------------------------------------------------------------------------------------
# Torch references
# --------------------------------------------------------------------------------------------------


def _activate(out: torch.Tensor, activation: Activation) -> torch.Tensor:
    return F.silu(out) if activation is not None else out


def causal_conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: Activation = "silu",
) -> torch.Tensor:
    """Reference of :func:`causal_conv1d_update`, vectorised over the batch (fp32 arithmetic)."""
    state_len, kernel = conv_state.shape[-1], weight.shape[1]
    window = torch.cat([conv_state[state_indices], x.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    conv_state.index_copy_(0, state_indices, window[..., -state_len:])
    out = (window[..., -kernel:].float() * weight.float()).sum(dim=-1)
    if bias is not None:
        out = out + bias.float()
    return _activate(out, activation).to(x.dtype)


def causal_conv1d_extend_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_index: int,
    activation: Activation = "silu",
) -> torch.Tensor:
    """Reference of :func:`causal_conv1d_extend`: one grouped ``conv1d`` over state + new inputs."""
    num_tokens, channels = x.shape
    if num_tokens == 0:  # nothing to convolve; the state stays as it is
        return torch.empty_like(x)
    state_len = conv_state.shape[-1]
    full = torch.cat([conv_state[state_index], x.t().to(conv_state.dtype)], dim=-1)  # [C, Ks + T]
    conv_state[state_index] = full[:, -state_len:]
    out = F.conv1d(
        full.float().unsqueeze(0),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=channels,
    )[0, :, -num_tokens:]
    return _activate(out, activation).t().to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _update_kernel(
    x, conv_state, weight, bias, state_indices, out, stride_xb, stride_ob,
    C: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Program = (request b, BLOCK_C channels). Channel c stays in the same lane for every load and
    # store below, so the in-place shift of the state needs no barrier.
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    idx = tl.load(state_indices + b)
    base = conv_state + idx * (C * KS) + offs_c * KS
    x_t = tl.load(x + b * stride_xb + offs_c, mask=c_mask, other=0.0)
    if HAS_BIAS:  # noqa: SIM108 - a constexpr branch reads clearer in Triton
        acc = tl.load(bias + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_C], tl.float32)
    # Taps 0..K-2 read the last K-1 state columns; tap K-1 reads the new input.
    for j in tl.static_range(K - 1):
        col = tl.load(base + (KS - (K - 1) + j), mask=c_mask, other=0.0).to(tl.float32)
        acc += col * tl.load(weight + offs_c * K + j, mask=c_mask, other=0.0).to(tl.float32)
    acc += x_t.to(tl.float32) * tl.load(weight + offs_c * K + (K - 1), mask=c_mask, other=0.0).to(tl.float32)
    # Shift left by one: column i+1 is read before anything overwrites it (ascending order).
    for i in tl.static_range(KS - 1):
        tl.store(base + i, tl.load(base + i + 1, mask=c_mask), mask=c_mask)
    tl.store(base + (KS - 1), x_t.to(conv_state.dtype.element_ty), mask=c_mask)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + b * stride_ob + offs_c, acc.to(out.dtype.element_ty), mask=c_mask)


@triton.jit
def _extend_kernel(
    x, state, weight, bias, out, num_tokens, stride_xt, stride_ot,
    C: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Program = (BLOCK_T tokens, BLOCK_C channels), all independent: input position p < 0 is read
    # from state column KS + p. The state itself is rewritten by a second launch, after every
    # program of this one has read it. `state` points at the request's [C, KS] state.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = offs_t < num_tokens
    c_mask = offs_c < C
    if HAS_BIAS:
        b_vec = tl.load(bias + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32) + b_vec[None, :]
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        pos = offs_t - (K - 1) + j
        in_x = (pos >= 0) & t_mask
        in_state = (pos < 0) & t_mask
        xv = tl.load(
            x + pos[:, None] * stride_xt + offs_c[None, :], mask=in_x[:, None] & c_mask[None, :], other=0.0
        )
        sv = tl.load(
            state + offs_c[None, :] * KS + (KS + pos)[:, None],
            mask=in_state[:, None] & c_mask[None, :],
            other=0.0,
        )
        w = tl.load(weight + offs_c * K + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    o_ptrs = out + offs_t[:, None] * stride_ot + offs_c[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _extend_state_kernel(
    x, state, num_tokens, stride_xt, C: tl.constexpr, KS: tl.constexpr, BLOCK_C: tl.constexpr
):
    # New column i holds input position T - KS + i: from x when >= 0, else old column T + i. Columns
    # are rewritten in ascending order and old column T + i > i is read before it could be replaced.
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    for i in tl.static_range(KS):
        pos = num_tokens - KS + i
        from_x = tl.load(x + pos * stride_xt + offs_c, mask=c_mask & (pos >= 0), other=0.0)
        from_s = tl.load(state + offs_c * KS + (num_tokens + i), mask=c_mask & (pos < 0), other=0.0)
        val = tl.where(pos >= 0, from_x.to(state.dtype.element_ty), from_s)
        tl.store(state + offs_c * KS + i, val, mask=c_mask)


def _update_triton(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    state_indices: torch.Tensor, activation: Activation,
) -> torch.Tensor:  # fmt: skip
    batch, channels = x.shape
    out = torch.empty_like(x)
    if batch == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    grid = (batch, triton.cdiv(channels, block_c))
    _update_kernel[grid](
        x, conv_state, weight, x if bias is None else bias, state_indices, out, x.stride(0), out.stride(0),
        C=channels, K=weight.shape[1], KS=conv_state.shape[2], HAS_BIAS=bias is not None,
        SILU=activation is not None, BLOCK_C=block_c,
    )  # fmt: skip
    return out


def _extend_triton(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    state_index: int, activation: Activation,
) -> torch.Tensor:  # fmt: skip
    num_tokens, channels = x.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    state = conv_state[state_index]
    block_t, block_c = 16, min(128, triton.next_power_of_2(channels))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))
    _extend_kernel[grid](
        x, state, weight, x if bias is None else bias, out, num_tokens, x.stride(0), out.stride(0),
        C=channels, K=weight.shape[1], KS=conv_state.shape[2], HAS_BIAS=bias is not None,
        SILU=activation is not None, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip
    # Same stream, so this launch starts after every program above has read the old state.
    _extend_state_kernel[(triton.cdiv(channels, block_c),)](
        x, state, num_tokens, x.stride(0), C=channels, KS=conv_state.shape[2], BLOCK_C=block_c
    )
    return out


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_inputs(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    activation: Activation, lead: str,
) -> None:  # fmt: skip
    check_ndim("x", x, 2, f"[{lead}, C]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_inner_contiguous("x", x, dims=1)
    channels = x.shape[1]
    check_ndim("weight", weight, 2, "[C, K]")
    if weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [C, K] with C = {channels}, got {tuple(weight.shape)}")
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_contiguous("weight", weight)
    kernel = weight.shape[1]
    if bias is not None:
        check_shape("bias", bias, (channels,), "[C]")
        check_dtype("bias", bias, FLOAT_DTYPES)
        check_contiguous("bias", bias)
    check_ndim("conv_state", conv_state, 3, "[N, C, Ks]")
    if conv_state.shape[1] != channels or conv_state.shape[2] not in (kernel - 1, kernel):
        raise ValueError(
            f"conv_state must have shape [N, C, Ks] with C = {channels} and Ks = {kernel - 1} or "
            f"{kernel}, got {tuple(conv_state.shape)}"
        )
    if conv_state.shape[2] == 0:
        raise ValueError("conv_state must keep at least one column (weight has K = 1 tap)")
    check_same_dtype("conv_state", conv_state, "x", x)
    check_contiguous("conv_state", conv_state)
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: Activation = "silu",
    impl: Impl = "auto",
) -> torch.Tensor:
    """One decode step of the causal conv for a batch of requests; rolls their states in place.

    Args:
        x: ``[B, C]`` this step's inputs (channel dimension dense, row stride free).
        conv_state: ``[N, C, Ks]`` contiguous pool in x's dtype, ``Ks`` in ``{K - 1, K}``.
        weight: ``[C, K]`` contiguous taps (``conv1d.weight.squeeze(1)``); bias: ``[C]`` or None.
        state_indices: ``[B]`` int64, distinct.
        activation: ``silu``/``swish`` or None.
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Returns:
        ``[B, C]`` in x's dtype (fp32 arithmetic).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    _check_inputs(x, conv_state, weight, bias, activation, "B")
    check_index("state_indices", state_indices, x.shape[0])
    check_same_device(x=x, conv_state=conv_state, weight=weight, bias=bias, state_indices=state_indices)
    if use_triton(impl, x):
        return _update_triton(x, conv_state, weight, bias, state_indices, activation)
    return causal_conv1d_update_torch(x, conv_state, weight, bias, state_indices, activation)


def causal_conv1d_extend(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_index: int | torch.Tensor,
    activation: Activation = "silu",
    impl: Impl = "auto",
) -> torch.Tensor:
    """The causal conv over ``T`` consecutive inputs of one request, continuing from its state.

    Args:
        x: ``[T, C]`` inputs (channel dimension dense, row stride free).
        conv_state, weight, bias, activation, impl: as in :func:`causal_conv1d_update`.
        state_index: the request's row of the pool (int or one-element integer tensor). Before the
            call it holds the inputs preceding ``x`` (zeros for a new request); after it, the last
            ``Ks`` inputs of state + ``x``.

    Returns:
        ``[T, C]`` in x's dtype (fp32 arithmetic).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout, device or index is wrong.
    """
    _check_inputs(x, conv_state, weight, bias, activation, "T")
    check_same_device(x=x, conv_state=conv_state, weight=weight, bias=bias)
    index = state_index_value(state_index, conv_state.shape[0])
    if use_triton(impl, x):
        return _extend_triton(x, conv_state, weight, bias, index, activation)
    return causal_conv1d_extend_torch(x, conv_state, weight, bias, index, activation)
