"""Gated delta rule (the linear attention of Qwen3-Next), recurrent form, over a pool of states.

Per value head, with state ``S [Dk, Dv]`` (fp32) and one token's ``q, k [Dk]``, ``v [Dv]``, ``g <= 0``
(log of the decay) and ``beta`` (write strength)::

    S <- S * exp(g)
    u  = k^T S                 # what the state already predicts for k, [Dv]
    d  = beta * (v - u)        # the delta-rule correction
    S <- S + k (x) d           # outer product [Dk, Dv]
    o  = q^T S                 # [Dv]

This is Hugging Face's ``torch_recurrent_gated_delta_rule`` with its two preprocessing steps moved to
the caller: **q and k must already be L2-normalised and q already scaled by ``Dk ** -0.5``** (what
``use_qk_l2norm_in_kernel=True`` plus its fixed query scaling do there). Grouped value heads: with
``Hk`` key heads and ``Hv`` value heads (``Hv % Hk == 0``), value head ``h`` reads key head
``h // (Hv // Hk)``, as ``repeat_interleave`` does in transformers.

The state pool is ``[N, Hv, Dk, Dv]`` fp32, contiguous; a request owns one index of it.
"""

from __future__ import annotations

import torch
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
from kernels.native import load

# --------------------------------------------------------------------------------------------------
# Torch references
# --------------------------------------------------------------------------------------------------


def _recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step for a batch of heads; s is ``[..., Dk, Dv]``, g and beta ``[...]``.

    All fp32, key heads already expanded to value heads. Same operation order as transformers, so the
    two agree to the last few ulps.
    """
    s = s * g.exp()[..., None, None]
    u = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - u) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2), s


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """``[..., Hk, Dk]`` → fp32 ``[..., Hv, Dk]`` (each key head serves Hv // Hk consecutive value heads)."""
    rep = num_v_heads // x.shape[-2]
    x = x.float()
    return x if rep == 1 else x.repeat_interleave(rep, dim=-2)


def gated_delta_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`gated_delta_step`, vectorised over the batch."""
    num_v_heads = v.shape[1]
    qf, kf = _expand_heads(q, num_v_heads), _expand_heads(k, num_v_heads)
    out, new_state = _recurrent(qf, kf, v.float(), g.float(), beta.float(), state[state_indices])
    state.index_copy_(0, state_indices, new_state)
    return out.to(q.dtype)


def gated_delta_extend_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_index: int,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Reference of :func:`gated_delta_extend` in chunked form: a few matmuls per chunk of tokens.

    Inside a chunk, with ``G_t`` the cumulative log decay since the chunk start and ``S0`` the state
    before it, unrolling the recurrence gives ``S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t-G_s} k_s d_s^T``.
    Substituting into ``d_t = beta_t (v_t - (e^{g_t} S_{t-1})^T k_t)`` gives a unit lower-triangular
    system ``(I + A) D = beta (V - e^G K S0)`` with ``A[t, s] = beta_t e^{G_t-G_s} k_t.k_s`` (s < t);
    outputs and the next state follow from ``D``. Every exponent is ``<= 0``: nothing overflows.
    """
    num_v_heads = v.shape[1]
    # [H, T, *] so that every product below is a batched matmul over heads.
    qf, kf = (_expand_heads(x, num_v_heads).transpose(0, 1) for x in (q, k))
    vf, gf, bf = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    s = state[state_index]  # [H, Dk, Dv]
    outs = []
    for c0 in range(0, q.shape[0], chunk_size):
        qc, kc, vc = qf[:, c0 : c0 + chunk_size], kf[:, c0 : c0 + chunk_size], vf[:, c0 : c0 + chunk_size]
        gc, bc = gf[:, c0 : c0 + chunk_size], bf[:, c0 : c0 + chunk_size]
        n = qc.shape[1]
        cum = gc.cumsum(dim=-1)  # [H, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # e^{G_t - G_s} for s <= t, 0 above the diagonal (masked before exp so it cannot overflow).
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        a = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))
        # unitriangular: the solver takes the diagonal of I + A as ones and reads only A's lower part.
        delta = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        outs.append(cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ delta)
        tail = (cum[:, -1:] - cum).exp()[:, :, None]  # decay from each token to the chunk end
        s = cum[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(-1, -2) @ delta
    state[state_index] = s
    if not outs:
        return torch.empty(v.shape, dtype=q.dtype, device=v.device)
    return torch.cat(outs, dim=1).transpose(0, 1).to(q.dtype)


def gated_delta_extend_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_index: int,
) -> torch.Tensor:
    """The recurrence token by token: the plainest statement of the math, kept for the tests."""
    num_v_heads = v.shape[1]
    qf, kf = _expand_heads(q, num_v_heads), _expand_heads(k, num_v_heads)
    vf, gf, bf = v.float(), g.float(), beta.float()
    s = state[state_index]
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        out[t], s = _recurrent(qf[t], kf[t], vf[t], gf[t], bf[t], s)
    state[state_index] = s
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _delta_update(s, q_vec, k_vec, v_vec, g_t, beta_t):
    # s [BLOCK_K, BLOCK_V] is one column slab of a head's state: columns of S evolve independently,
    # so programs may split Dv freely while each holds the whole Dk extent.
    s = s * tl.exp(g_t)
    u = tl.sum(s * k_vec[:, None], 0)
    delta = (v_vec - u) * beta_t
    s = s + k_vec[:, None] * delta[None, :]
    out = tl.sum(s * q_vec[:, None], 0)
    return out, s


@triton.jit
def _step_kernel(
    q, k, v, g, beta, state, state_indices, o,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
    stride_ob, stride_oh,
    REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, H: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # Program = (request b, value head h, BLOCK_V columns of the state).
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    kh = h // REP
    idx = tl.load(state_indices + b)
    q_vec = tl.load(q + b * stride_qb + kh * stride_qh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    k_vec = tl.load(k + b * stride_kb + kh * stride_kh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    v_vec = tl.load(v + b * stride_vb + h * stride_vh + offs_v, mask=v_mask, other=0.0).to(tl.float32)
    g_t = tl.load(g + b * stride_gb + h).to(tl.float32)
    beta_t = tl.load(beta + b * stride_betab + h).to(tl.float32)
    s_ptrs = state + (idx * H + h) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    out, s = _delta_update(s, q_vec, k_vec, v_vec, g_t, beta_t)
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(o + b * stride_ob + h * stride_oh + offs_v, out.to(o.dtype.element_ty), mask=v_mask)


@triton.jit
def _extend_kernel(
    q, k, v, g, beta, state, o, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
    stride_ot, stride_oh,
    REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # Program = (value head h, BLOCK_V state columns); the state slab stays in registers for the
    # whole sequence and is written back once. `state` points at the request's [Hv, Dk, Dv] state.
    h = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    kh = h // REP
    s_ptrs = state + h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    for t in range(num_tokens):
        q_vec = tl.load(q + t * stride_qt + kh * stride_qh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        k_vec = tl.load(k + t * stride_kt + kh * stride_kh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        v_vec = tl.load(v + t * stride_vt + h * stride_vh + offs_v, mask=v_mask, other=0.0).to(tl.float32)
        g_t = tl.load(g + t * stride_gt + h).to(tl.float32)
        beta_t = tl.load(beta + t * stride_betat + h).to(tl.float32)
        out, s = _delta_update(s, q_vec, k_vec, v_vec, g_t, beta_t)
        tl.store(o + t * stride_ot + h * stride_oh + offs_v, out.to(o.dtype.element_ty), mask=v_mask)
    tl.store(s_ptrs, s, mask=s_mask)


def _blocks(dk: int, dv: int) -> tuple[int, int]:
    # The whole Dk extent per program; Dv split so that a slab is at most 4096 fp32 registers.
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 4096 // block_k))
    return block_k, block_v


def _step_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    batch, num_v_heads, dv = v.shape
    dk = q.shape[2]
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    if batch == 0:
        return o
    block_k, block_v = _blocks(dk, dv)
    grid = (batch, num_v_heads, triton.cdiv(dv, block_v))
    _step_kernel[grid](
        q, k, v, g, beta, state, state_indices, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), o.stride(0), o.stride(1),
        REP=num_v_heads // q.shape[1], DK=dk, DV=dv, H=num_v_heads, BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return o


def _extend_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_index: int,
) -> torch.Tensor:  # fmt: skip
    num_tokens, num_v_heads, dv = v.shape
    dk = q.shape[2]
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    block_k, block_v = _blocks(dk, dv)
    grid = (num_v_heads, triton.cdiv(dv, block_v))
    _extend_kernel[grid](
        q, k, v, g, beta, state[state_index], o, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), o.stride(0), o.stride(1),
        REP=num_v_heads // q.shape[1], DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return o


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, lead: str,
) -> None:  # fmt: skip
    check_ndim("q", q, 3, f"[{lead}, Hk, Dk]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_shape("k", k, q.shape, f"[{lead}, Hk, Dk]")
    check_same_dtype("k", k, "q", q)
    check_ndim("v", v, 3, f"[{lead}, Hv, Dv]")
    check_same_dtype("v", v, "q", q)
    n, num_k_heads, dk = q.shape
    if v.shape[0] != n:
        raise ValueError(f"v must have {n} rows like q, got shape {tuple(v.shape)}")
    num_v_heads, dv = v.shape[1], v.shape[2]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"v heads ({num_v_heads}) must be a multiple of q/k heads ({num_k_heads})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, t, dims=1)
    for name, t in (("g", g), ("beta", beta)):
        check_shape(name, t, (n, num_v_heads), f"[{lead}, Hv]")
        check_dtype(name, t, FLOAT_DTYPES)
        check_inner_contiguous(name, t, dims=1)
    check_ndim("state", state, 4, "[N, Hv, Dk, Dv]")
    if tuple(state.shape[1:]) != (num_v_heads, dk, dv):
        raise ValueError(
            f"state must have shape [N, Hv, Dk, Dv] = [N, {num_v_heads}, {dk}, {dv}], "
            f"got {tuple(state.shape)}"
        )
    check_dtype("state", state, (torch.float32,))
    check_contiguous("state", state)


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    impl: Impl = "auto",
) -> torch.Tensor:
    """One decode step of the gated delta rule for a batch of requests; updates ``state`` in place.

    Args:
        q, k: ``[B, Hk, Dk]``, **already L2-normalised, q already scaled by** ``Dk ** -0.5``.
        v: ``[B, Hv, Dv]`` in q's dtype, ``Hv % Hk == 0``. Last dimensions dense, other strides free.
        g: ``[B, Hv]`` log decay (``<= 0``); beta: ``[B, Hv]`` write strength (sigmoid output).
        state: ``[N, Hv, Dk, Dv]`` fp32 contiguous pool; rows ``state_indices`` are read and written.
        state_indices: ``[B]`` int64, distinct (two requests never share a live state).
        impl: ``auto`` runs the Triton kernel on CUDA tensors, the native one on fp32 CPU tensors
            (``kernels/csrc/gated_delta.c``, where the library builds) and the torch reference
            otherwise; ``torch`` always the reference.

    Returns:
        ``[B, Hv, Dv]`` in q's dtype (all arithmetic in fp32).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    _check_inputs(q, k, v, g, beta, state, "B")
    check_index("state_indices", state_indices, q.shape[0])
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices)
    if use_triton(impl, q):
        return _step_triton(q, k, v, g, beta, state, state_indices)
    if impl == "auto" and (out := _step_native(q, k, v, g, beta, state, state_indices)) is not None:
        return out
    return gated_delta_step_torch(q, k, v, g, beta, state, state_indices)


def _step_native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor | None:
    """The native CPU kernel on checked inputs; None where it does not apply (not fp32 on the CPU,
    no library, a head wider than its buffers): the caller takes the torch path."""
    if q.device.type != "cpu" or not all(t.dtype == torch.float32 for t in (q, k, v, g, beta)):
        return None
    lib = load()
    if lib is None:
        return None
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty_like(v)
    (b, hk, dk), (hv, dv) = q.shape, v.shape[1:]
    rc = lib.strata_gated_delta_step_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(),
        state_indices.data_ptr(), out.data_ptr(), b, hk, hv, dk, dv, state.shape[0],
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"state_indices must be in [0, {state.shape[0]}), got {state_indices.tolist()}")
    return out if rc == 0 else None


def gated_delta_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_index: int | torch.Tensor,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Run the gated delta rule over ``T`` consecutive tokens of one request; updates its state in place.

    Args:
        q, k: ``[T, Hk, Dk]``; v: ``[T, Hv, Dv]``; g, beta: ``[T, Hv]`` — as in :func:`gated_delta_step`
            (q/k normalised and q scaled by the caller).
        state: ``[N, Hv, Dk, Dv]`` fp32 pool; ``state[state_index]`` is the state before the first
            token (zeros for a new request: the caller clears it) and after the call the state after
            the last one.
        state_index: the request's row of the pool (an int or a one-element integer tensor).
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Returns:
        ``[T, Hv, Dv]`` in q's dtype.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout, device or index is wrong.
    """
    _check_inputs(q, k, v, g, beta, state, "T")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state)
    index = state_index_value(state_index, state.shape[0])
    if use_triton(impl, q):
        return _extend_triton(q, k, v, g, beta, state, index)
    return gated_delta_extend_torch(q, k, v, g, beta, state, index)
