"""The torch code in `kernels/` (each function's reference implementation, which the Triton kernels
are checked against and the CPU runs where no native kernel serves) against naive per-token code and
against the functions Hugging Face's Qwen3-Next runs, plus the launchers' argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn as hf_conv1d_fn,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_update as hf_conv1d_update,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    l2norm as hf_l2norm,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule as hf_chunk_rule,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_recurrent_gated_delta_rule as hf_recurrent_rule,
)

from kernels.attention.launch import decode_attention, extend_attention
from kernels.bitmask import apply_token_bitmask, bitmask_from_allowed, unpack_bitmask
from kernels.conv1d import causal_conv1d_extend, causal_conv1d_update
from kernels.gated_delta import (
    gated_delta_extend,
    gated_delta_extend_loop,
    gated_delta_extend_torch,
    gated_delta_step,
)
from kernels.kv_store import store_kv

ATOL = 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


# --------------------------------------------------------------------------------------------------
# KV store
# --------------------------------------------------------------------------------------------------


def test_store_kv_writes_rows_at_slots_and_nothing_else() -> None:
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([9, 2, 14])
    # k is a slice of a fused projection: strided over tokens, dense inside a token.
    fused = torch.randn(3, 2 * 2 * 8)
    k, v = fused[:, :16].view(3, 2, 8), fused[:, 16:].view(3, 2, 8)
    store_kv(k_cache, v_cache, slots, k, v)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s], k[t]) and torch.equal(v_cache[s], v[t])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


def test_store_kv_drops_negative_slots() -> None:
    """A negative slot is a padding token of a graphed decode (services/worker/cuda_graphs.py):
    nothing is written for it, and the other tokens land where they should."""
    k_cache, v_cache = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    store_kv(k_cache, v_cache, torch.tensor([-1, 5, -1]), k, v, padded=True)
    assert torch.equal(k_cache[5], k[1]) and torch.equal(v_cache[5], v[1])
    others = torch.arange(8) != 5
    assert torch.equal(k_cache[others], before_k[others]) and torch.equal(v_cache[others], before_v[others])


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def naive_token_attention(
    q_tok: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int], scale: float
) -> torch.Tensor:
    """One token ``[Hq, D]`` over the listed slots, in float64, heads expanded by repeat_interleave."""
    group = q_tok.shape[0] // k_cache.shape[1]
    keys = k_cache[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = v_cache[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q_tok.double(), keys) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), values)


def make_pool(
    num_slots: int, num_kv_heads: int, head_dim: int, num_rows: int, row_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    # Scattered, distinct slots; unused tail entries hold garbage that must never be read.
    req_to_token = torch.randperm(num_slots, generator=gen)[: num_rows * row_len].view(num_rows, row_len)
    return k_cache, v_cache, req_to_token.contiguous()


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "starts", "lens"),
    [
        (4, 4, [0], [7]),  # MHA, fresh prefill
        (4, 2, [0, 5, 3], [4, 1, 6]),  # GQA, ragged batch, cached prefixes, an extend of one token
        (8, 2, [11, 0], [1, 1]),  # GQA 4:1, only single-token extends
    ],
)
def test_extend_attention_matches_naive(
    num_q_heads: int, num_kv_heads: int, starts: list[int], lens: list[int]
) -> None:
    head_dim, scale = 16, 16**-0.5
    k_cache, v_cache, req_to_token = make_pool(128, num_kv_heads, head_dim, num_rows=5, row_len=20)
    rows = torch.tensor([3, 0, 4][: len(lens)])
    q = torch.randn(sum(lens), num_q_heads, head_dim)
    out = extend_attention(
        q, k_cache, v_cache, req_to_token, rows, torch.tensor(starts), torch.tensor(lens), scale
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    t = 0
    for row, start, n in zip(rows.tolist(), starts, lens, strict=True):
        for j in range(n):
            slots = req_to_token[row, : start + j + 1].tolist()
            expected = naive_token_attention(q[t], k_cache, v_cache, slots, scale)
            assert rel_err(out[t], expected) < ATOL
            t += 1


def test_extend_attention_equals_sdpa_on_a_fresh_contiguous_sequence() -> None:
    torch.manual_seed(1)
    n, heads, head_dim = 9, 2, 8
    q, k, v = (torch.randn(n, heads, head_dim) for _ in range(3))
    req_to_token = torch.arange(n).view(1, n)
    out = extend_attention(
        q, k, v, req_to_token, torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), head_dim**-0.5
    )
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert rel_err(out, expected) < ATOL


def test_extend_attention_keeps_half_precision_output() -> None:
    k_cache, v_cache, req_to_token = make_pool(64, 2, 16, num_rows=1, row_len=10)
    q = torch.randn(4, 4, 16)
    args = (req_to_token, torch.tensor([0]), torch.tensor([6]), torch.tensor([4]), 0.25)
    out32 = extend_attention(q, k_cache, v_cache, *args)
    out16 = extend_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), *args)
    assert out16.dtype == torch.bfloat16
    assert rel_err(out16, out32) < 2e-2


def test_decode_attention_matches_naive_and_extend_of_one_token() -> None:
    num_q_heads, num_kv_heads, head_dim, scale = 6, 2, 8, 0.3
    k_cache, v_cache, req_to_token = make_pool(100, num_kv_heads, head_dim, num_rows=4, row_len=20)
    rows = torch.tensor([2, 0, 3])
    seq_lens = torch.tensor([1, 17, 6])  # ragged, including a sequence of one token
    q = torch.randn(3, num_q_heads, head_dim)
    out = decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale)
    for b, (row, n) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        expected = naive_token_attention(q[b], k_cache, v_cache, req_to_token[row, :n].tolist(), scale)
        assert rel_err(out[b], expected) < ATOL
    as_extend = extend_attention(
        q, k_cache, v_cache, req_to_token, rows, seq_lens - 1, torch.ones(3, dtype=torch.int64), scale
    )
    assert rel_err(out, as_extend) < ATOL


# --------------------------------------------------------------------------------------------------
# Token bitmask
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab_size", "allowed"),
    [
        (64, {0, 31, 32, 63}),  # word edges, the sign bit of both words
        (65, {64}),  # a last word with a single valid bit
        (70, set(range(70))),  # everything allowed
        (70, set()),  # nothing allowed
        (33, {1, 2, 3, 30, 31}),
    ],
)
def test_bitmask_round_trip_and_apply(vocab_size: int, allowed: set[int]) -> None:
    mask = bitmask_from_allowed(allowed, vocab_size)
    assert mask.dtype == torch.int32 and mask.shape == ((vocab_size + 31) // 32,)
    unpacked = unpack_bitmask(mask.unsqueeze(0), vocab_size)[0]
    assert set(unpacked.nonzero().flatten().tolist()) == allowed

    logits = torch.randn(2, vocab_size)
    expected = logits.clone()
    for i in range(vocab_size):
        if i not in allowed:
            expected[0, i] = float("-inf")
    everything = bitmask_from_allowed(range(vocab_size), vocab_size)
    apply_token_bitmask(logits, torch.stack([mask, everything]))
    assert torch.equal(logits, expected)


def test_bitmask_word_bits_are_little_endian() -> None:
    mask = bitmask_from_allowed({0, 33}, 64)
    assert mask.tolist() == [1, 2]
    assert bitmask_from_allowed({31}, 32).tolist() == [-(2**31)]


def test_bitmask_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="allowed token ids"):
        bitmask_from_allowed({10}, 10)


# --------------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------------


def delta_inputs(
    n: int, num_k_heads: int, num_v_heads: int, dk: int, dv: int, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, num_k_heads, dk, generator=gen)
    k = torch.randn(n, num_k_heads, dk, generator=gen)
    v = torch.randn(n, num_v_heads, dv, generator=gen)
    g = -F.softplus(torch.randn(n, num_v_heads, generator=gen))  # log decay, <= 0
    beta = torch.rand(n, num_v_heads, generator=gen)
    return q, k, v, g, beta


def caller_preprocess(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model does before our kernels: L2-normalise q and k, scale q by Dk ** -0.5."""
    return hf_l2norm(q) / math.sqrt(q.shape[-1]), hf_l2norm(k)


@pytest.mark.parametrize(("num_k_heads", "num_v_heads"), [(2, 2), (2, 4)])
def test_gated_delta_step_matches_transformers(num_k_heads: int, num_v_heads: int) -> None:
    batch, dk, dv = 3, 16, 8
    q, k, v, g, beta = delta_inputs(batch, num_k_heads, num_v_heads, dk, dv, seed=0)
    pool = torch.randn(6, num_v_heads, dk, dv)
    indices = torch.tensor([5, 0, 3])
    before = pool.clone()
    qn, kn = caller_preprocess(q, k)
    out = gated_delta_step(qn, kn, v, g, beta, pool, indices)
    # transformers takes [batch, seq, heads, dim]: our batch is its batch, with a sequence of one.
    hf_out, hf_state = hf_recurrent_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
        initial_state=before[indices], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert rel_err(out, hf_out[:, 0]) < ATOL
    assert hf_state is not None and rel_err(pool[indices], hf_state) < ATOL
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize(("num_k_heads", "num_v_heads", "length"), [(2, 2, 1), (1, 2, 9)])
def test_gated_delta_extend_matches_transformers(num_k_heads: int, num_v_heads: int, length: int) -> None:
    dk, dv = 8, 16
    q, k, v, g, beta = delta_inputs(length, num_k_heads, num_v_heads, dk, dv, seed=1)
    pool = torch.zeros(3, num_v_heads, dk, dv)
    qn, kn = caller_preprocess(q, k)
    out = gated_delta_extend(qn, kn, v, g, beta, pool, 1)
    for hf_rule in (hf_recurrent_rule, hf_chunk_rule):
        hf_out, hf_state = hf_rule(
            q[None], k[None], v[None], g[None], beta[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert rel_err(out, hf_out[0]) < ATOL
        assert hf_state is not None and rel_err(pool[1], hf_state[0]) < ATOL
    assert torch.count_nonzero(pool[[0, 2]]) == 0


@pytest.mark.parametrize("decay_scale", [1.0, 30.0])  # 30: the state is forgotten within a few tokens
def test_gated_delta_chunked_reference_equals_token_loop_over_several_chunks(decay_scale: float) -> None:
    q, k, v, g, beta = delta_inputs(150, 1, 2, 16, 8, seed=3)  # chunks of 64, 64 and 22
    qn, kn = caller_preprocess(q, k)
    pool = torch.randn(2, 2, 16, 8)
    chunked_pool, loop_pool = pool.clone(), pool.clone()
    chunked = gated_delta_extend_torch(qn, kn, v, g * decay_scale, beta, chunked_pool, 1)
    looped = gated_delta_extend_loop(qn, kn, v, g * decay_scale, beta, loop_pool, 1)
    assert torch.isfinite(chunked).all()
    assert rel_err(chunked, looped) < ATOL
    assert rel_err(chunked_pool, loop_pool) < ATOL


def test_gated_delta_extend_of_zero_tokens_leaves_the_state() -> None:
    q, k, v, g, beta = delta_inputs(0, 1, 1, 4, 4, seed=0)
    pool = torch.randn(1, 1, 4, 4)
    before = pool.clone()
    assert gated_delta_extend(q, k, v, g, beta, pool, 0).shape == (0, 1, 4)
    assert torch.equal(pool, before)


def test_gated_delta_extend_then_steps_equals_one_long_extend() -> None:
    q, k, v, g, beta = delta_inputs(7, 2, 2, 8, 8, seed=2)
    qn, kn = caller_preprocess(q, k)
    whole, pieces = torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8)
    expected = gated_delta_extend(qn, kn, v, g, beta, whole, torch.tensor(0))
    first = gated_delta_extend(qn[:4], kn[:4], v[:4], g[:4], beta[:4], pieces, 0)
    rest = [
        gated_delta_step(qn[t : t + 1], kn[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                         pieces, torch.tensor([0]))
        for t in range(4, 7)
    ]  # fmt: skip
    assert rel_err(torch.cat([first, *rest]), expected) < ATOL
    assert rel_err(pieces, whole) < ATOL


# --------------------------------------------------------------------------------------------------
# Causal conv1d
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv1d_update_matches_transformers(with_bias: bool) -> None:
    torch.manual_seed(3)
    batch, channels, kernel = 3, 10, 4
    pool = torch.randn(5, channels, kernel)  # transformers keeps K columns
    indices = torch.tensor([4, 1, 2])
    before = pool.clone()
    x, weight = torch.randn(batch, channels), torch.randn(channels, kernel)
    bias = torch.randn(channels) if with_bias else None
    out = causal_conv1d_update(x, pool, weight, bias, indices)
    hf_state = before[indices].clone()
    hf_out = hf_conv1d_update(x[:, :, None], hf_state, weight, bias, "silu")
    assert rel_err(out, hf_out[:, :, 0]) < ATOL
    assert torch.equal(pool[indices], hf_state)
    assert torch.equal(pool[[0, 3]], before[[0, 3]])


def test_conv1d_state_of_k_minus_1_columns_gives_the_same_outputs() -> None:
    torch.manual_seed(4)
    channels, kernel = 6, 4
    wide, narrow = torch.zeros(1, channels, kernel), torch.zeros(1, channels, kernel - 1)
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    x = torch.randn(9, channels)
    a = causal_conv1d_extend(x[:5], wide, weight, bias, 0)
    b = causal_conv1d_extend(x[:5], narrow, weight, bias, 0)
    assert torch.equal(a, b)
    for t in range(5, 9):
        a = causal_conv1d_update(x[t : t + 1], wide, weight, bias, torch.tensor([0]))
        b = causal_conv1d_update(x[t : t + 1], narrow, weight, bias, torch.tensor([0]))
        assert torch.equal(a, b)
    assert torch.equal(wide[0, :, 1:], narrow[0])


@pytest.mark.parametrize("length", [1, 2, 9])
def test_conv1d_extend_matches_transformers_and_continues(length: int) -> None:
    torch.manual_seed(5)
    channels, kernel = 8, 4
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    x = torch.randn(length + 3, channels)
    pool = torch.zeros(2, channels, kernel)
    # First chunk from a fresh (zero) state, as transformers' prefill with left zero padding.
    out = causal_conv1d_extend(x[:length], pool, weight, bias, 1)
    hf_out = hf_conv1d_fn(x[None, :length].transpose(1, 2), weight, bias, activation="silu")
    assert rel_err(out, hf_out[0].t()) < ATOL
    padded = F.pad(x[:length].t(), (kernel, 0))
    assert torch.equal(pool[1], padded[:, -kernel:])
    # Continuing from the state equals convolving the whole sequence at once.
    more = causal_conv1d_extend(x[length:], pool, weight, bias, torch.tensor([1]))
    whole = hf_conv1d_fn(x[None].transpose(1, 2), weight, bias, activation="silu")[0].t()
    assert rel_err(more, whole[length:]) < ATOL
    assert torch.count_nonzero(pool[0]) == 0


def test_conv1d_extend_of_zero_tokens_leaves_the_state() -> None:
    pool = torch.randn(1, 4, 3)
    before = pool.clone()
    out = causal_conv1d_extend(torch.empty(0, 4), pool, torch.randn(4, 4), None, 0, activation=None)
    assert out.shape == (0, 4) and torch.equal(pool, before)


# --------------------------------------------------------------------------------------------------
# Launcher validation
# --------------------------------------------------------------------------------------------------


def _attention_args() -> dict[str, object]:
    k_cache, v_cache, req_to_token = make_pool(32, 2, 8, num_rows=2, row_len=8)
    return {
        "q": torch.randn(3, 4, 8), "k_cache": k_cache, "v_cache": v_cache, "req_to_token": req_to_token,
        "rows": torch.tensor([0]), "start_pos": torch.tensor([0]), "extend_lens": torch.tensor([3]),
        "scale": 0.5,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("q", torch.randn(3, 4, 8).half(), r"^k_cache must have the dtype of q"),
        ("q", torch.randn(3, 3, 8), r"^q heads \(3\) must be a multiple of k_cache KV heads \(2\)"),
        ("q", torch.randn(3, 4, 16)[:, :, ::2], r"^q must be contiguous in its last 1 dimension"),
        ("k_cache", torch.randn(32, 8, 2).transpose(1, 2), r"^k_cache must be contiguous"),
        ("v_cache", torch.randn(31, 2, 8), r"^v_cache must have shape \[S, Hkv, D\]"),
        ("req_to_token", torch.zeros(2, 8, dtype=torch.int32), r"^req_to_token must have dtype in \(int64\)"),
        ("rows", torch.tensor([0.0]), r"^rows must have dtype"),
        ("start_pos", torch.tensor([0, 0]), r"^start_pos must have length 1"),
        ("extend_lens", torch.tensor([[3]]), r"^extend_lens must be 1-D"),
        ("scale", -1.0, r"^scale must be a positive number"),
    ],
)
def test_extend_attention_rejects_bad_arguments(name: str, bad: object, message: str) -> None:
    args = _attention_args()
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        extend_attention(**args)  # type: ignore[arg-type]


def test_decode_attention_rejects_bad_seq_lens_and_batch() -> None:
    k_cache, v_cache, req_to_token = make_pool(32, 2, 8, num_rows=2, row_len=8)
    q, rows = torch.randn(2, 4, 8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"^seq_lens "):
        decode_attention(
            q, k_cache, v_cache, req_to_token, rows, torch.tensor([1, 2], dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="q must have one token per request"):
        decode_attention(q, k_cache, v_cache, req_to_token, rows[:1], torch.tensor([1]), 1.0)


def test_store_kv_rejects_bad_arguments() -> None:
    k_cache, v_cache = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    k = torch.randn(2, 2, 4)
    with pytest.raises(ValueError, match=r"^slots "):
        store_kv(k_cache, v_cache, torch.tensor([1, 2], dtype=torch.int32), k, k)
    with pytest.raises(ValueError, match=r"^v must have the dtype"):
        store_kv(k_cache, v_cache, torch.tensor([1, 2]), k, k.double())
    with pytest.raises(ValueError, match=r"^k must"):
        store_kv(k_cache, v_cache, torch.tensor([1, 2]), torch.randn(2, 4, 2).transpose(1, 2), k)
    with pytest.raises(ValueError, match=r"^v_cache "):
        store_kv(k_cache, torch.zeros(8, 2, 5), torch.tensor([1, 2]), k, k)


def test_bitmask_rejects_bad_arguments() -> None:
    logits = torch.randn(2, 40)
    with pytest.raises(ValueError, match=r"^bitmask "):
        apply_token_bitmask(logits, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^bitmask "):
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^logits "):
        apply_token_bitmask(logits.long(), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^logits "):
        apply_token_bitmask(torch.randn(40, 2).t(), torch.zeros(2, 2, dtype=torch.int32))


def test_gated_delta_rejects_bad_arguments() -> None:
    q, k, v, g, beta = delta_inputs(2, 2, 4, 8, 8, seed=0)
    pool, idx = torch.zeros(3, 4, 8, 8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"^state "):
        gated_delta_step(q, k, v, g, beta, pool.double(), idx)
    with pytest.raises(ValueError, match=r"^state "):
        gated_delta_step(q, k, v, g, beta, torch.zeros(3, 4, 8, 4), idx)
    with pytest.raises(ValueError, match=r"^state_indices "):
        gated_delta_step(q, k, v, g, beta, pool, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"^v heads"):
        gated_delta_step(q, k, torch.randn(2, 3, 8), g[:, :3], beta[:, :3], pool[:, :3], idx)
    with pytest.raises(ValueError, match=r"^beta "):
        gated_delta_step(q, k, v, g, beta[:, :2], pool, idx)
    with pytest.raises(ValueError, match=r"^state_index "):
        gated_delta_extend(q, k, v, g, beta, pool, 3)


def test_conv1d_rejects_bad_arguments() -> None:
    x, weight = torch.randn(2, 6), torch.randn(6, 4)
    pool, idx = torch.zeros(3, 6, 4), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"^conv_state "):
        causal_conv1d_update(x, torch.zeros(3, 6, 2), weight, None, idx)
    with pytest.raises(ValueError, match=r"^conv_state "):
        causal_conv1d_update(x, pool.half(), weight, None, idx)
    with pytest.raises(ValueError, match=r"^weight "):
        causal_conv1d_update(x, pool, torch.randn(4, 6).t(), None, idx)
    with pytest.raises(ValueError, match=r"^bias "):
        causal_conv1d_update(x, pool, weight, torch.randn(5), idx)
    with pytest.raises(ValueError, match=r"^activation "):
        causal_conv1d_update(x, pool, weight, None, idx, activation="gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^state_index "):
        causal_conv1d_extend(x, pool, weight, None, torch.tensor([0, 1]))
