"""The torch path of the cascade decode (``kernels.attention.launch``) on the CPU, no interpreter.

The cascade is exact: a decode batch whose rows really share leading slots gives the flat reference
decode's result, with the groups given by hand (each with a member that leaves the others part-way,
so the group shares less than most of its members hold in common) or found by
``find_prefix_groups``, and without groups. The launcher rejects bad arguments with a ``ValueError``
that names the argument. The Triton kernels themselves run in ``tests/engine/test_kernels_triton.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.attention.launch import cascade_decode_attention
from kernels.attention.merge import merge_states
from kernels.attention.prefix_groups import find_prefix_groups
from kernels.attention.reference import decode_attention_torch, shared_prefix_decode_torch, tail_decode_torch
from tests.engine.test_kernels_triton import (
    BF16_TOLERANCE,
    CASCADE_CASES,
    CASCADE_OVERHANG,
    FP32_TOLERANCE,
    HALF_TOLERANCE,
    CascadeBatch,
    cascade_batch,
    rel_err,
)

SCALE = 0.3
TOLERANCE = {torch.float32: FP32_TOLERANCE, torch.float16: HALF_TOLERANCE, torch.bfloat16: BF16_TOLERANCE}


def batch_of(name: str, dtype: torch.dtype | None = None) -> CascadeBatch:
    hq, hkv, d, case_dtype, spec, alone, tail_step = CASCADE_CASES[name]
    return cascade_batch(hq, hkv, d, dtype or case_dtype, spec, alone, tail_step)


def flat(c: CascadeBatch) -> torch.Tensor:
    return decode_attention_torch(c.q, c.k_cache, c.v_cache, c.req_to_token, c.rows, c.seq_lens, SCALE)


def args_of(c: CascadeBatch) -> tuple[torch.Tensor, ...]:
    return c.q, c.k_cache, c.v_cache, c.req_to_token, c.rows


@pytest.mark.parametrize("name", sorted(CASCADE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_cascade_equals_the_flat_reference(name: str, dtype: torch.dtype) -> None:
    c = batch_of(name, dtype)
    expected = flat(c)
    for groups in (c.groups, None):
        got = cascade_decode_attention(*args_of(c), c.seq_lens, groups, SCALE, impl="torch")
        assert got.dtype == dtype and got.shape == c.q.shape
        assert rel_err(got, expected) <= TOLERANCE[dtype]


def test_a_member_that_leaves_its_group_early_is_exact() -> None:
    c = batch_of("gqa2_three_groups")
    table, rows = c.req_to_token, c.rows
    for g in range(c.groups.num_groups):
        *stay, leaver = c.groups.group(g)
        shared = c.groups.shared_lens[g]
        # The inputs are what the test claims: every member holds the group's run, the members that
        # stay hold CASCADE_OVERHANG more slots in common, and the leaver differs right after the run.
        lead = table[rows[stay[0]]]
        for b in [*stay, leaver]:
            assert torch.equal(table[rows[b], :shared], lead[:shared])
        for b in stay:
            assert torch.equal(table[rows[b], : shared + CASCADE_OVERHANG], lead[: shared + CASCADE_OVERHANG])
        assert table[rows[leaver], shared] != lead[shared]
    got = cascade_decode_attention(*args_of(c), c.seq_lens, c.groups, SCALE, impl="torch")
    assert rel_err(got, flat(c)) <= FP32_TOLERANCE


def test_groups_found_by_find_prefix_groups_are_exact() -> None:
    c = batch_of("gqa2_three_groups")
    # A decode's own new token (its last position) is never shared.
    found = find_prefix_groups(c.req_to_token, c.rows.tolist(), (c.seq_lens - 1).tolist(), min_shared=1)
    assert found is not None and found.num_groups >= 3
    got = cascade_decode_attention(*args_of(c), c.seq_lens, found, SCALE, impl="torch")
    assert rel_err(got, flat(c)) <= FP32_TOLERANCE


def test_shared_and_tail_passes_merge_into_the_whole_attention() -> None:
    c = batch_of("gqa8_two_query_blocks")
    o_s, lse_s = shared_prefix_decode_torch(*args_of(c), c.groups, SCALE)
    o_t, lse_t = tail_decode_torch(*args_of(c), c.groups.kv_start_t, c.seq_lens, SCALE)
    whole_o, whole_lse = tail_decode_torch(*args_of(c), torch.zeros_like(c.seq_lens), c.seq_lens, SCALE)
    merged_o, merged_lse = merge_states(o_t, lse_t, o_s, lse_s)
    assert rel_err(merged_o, whole_o) <= FP32_TOLERANCE
    assert rel_err(merged_lse, whole_lse) <= FP32_TOLERANCE
    # The whole pass's LSE is the log-sum-exp of the scaled scores, computed here in float64.
    b, h = c.groups.members[0], 3
    slots = c.req_to_token[c.rows[b], : c.seq_lens[b]]
    kv_head = h // (c.q.shape[1] // c.k_cache.shape[1])
    scores = c.k_cache[slots, kv_head].double() @ c.q[b, h].double() * SCALE
    assert math.isclose(float(whole_lse[b, h]), float(torch.logsumexp(scores, 0)), rel_tol=1e-6)


def test_requests_in_no_group_get_an_empty_shared_pass_and_merge_to_their_tail() -> None:
    c = batch_of("gqa2_three_groups")
    o_s, lse_s = shared_prefix_decode_torch(*args_of(c), c.groups, SCALE)
    lone = [b for b, start in enumerate(c.groups.kv_start) if start == 0]
    assert lone and bool((o_s[lone] == 0).all()) and bool((lse_s[lone] == -math.inf).all())
    o_t, lse_t = tail_decode_torch(*args_of(c), c.groups.kv_start_t, c.seq_lens, SCALE)
    merged_o, merged_lse = merge_states(o_t[lone], lse_t[lone], o_s[lone], lse_s[lone])
    assert torch.equal(merged_o, o_t[lone]) and torch.equal(merged_lse, lse_t[lone])


def _bad(**changes: Any) -> Callable[[CascadeBatch], dict[str, Any]]:
    """Launcher keyword arguments of a valid batch with ``changes`` applied (callables get the batch)."""

    def make(c: CascadeBatch) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "q": c.q, "k_cache": c.k_cache, "v_cache": c.v_cache, "req_to_token": c.req_to_token,
            "rows": c.rows, "seq_lens": c.seq_lens, "groups": c.groups, "scale": SCALE, "impl": "torch",
        }  # fmt: skip
        kw.update({k: v(c) if callable(v) else v for k, v in changes.items()})
        return kw

    return make


BAD_ARGUMENTS = [
    # (case id, the argument the message must begin with, the bad call)
    ("q_2d", "q", _bad(q=lambda c: c.q[:, 0])),
    ("q_int", "q", _bad(q=lambda c: c.q.to(torch.int32))),
    ("q_batch", "q", _bad(q=lambda c: c.q[:-1])),
    ("q_heads_not_a_multiple", "q", _bad(q=lambda c: c.q[:, :3])),
    ("k_cache_dtype", "k_cache", _bad(k_cache=lambda c: c.k_cache.half())),
    ("v_cache_shape", "v_cache", _bad(v_cache=lambda c: c.v_cache[:-1])),
    ("req_to_token_int32", "req_to_token", _bad(req_to_token=lambda c: c.req_to_token.int())),
    ("rows_int32", "rows", _bad(rows=lambda c: c.rows.int())),
    ("seq_lens_length", "seq_lens", _bad(seq_lens=lambda c: c.seq_lens[:-1])),
    ("groups_of_another_batch", "groups",
     _bad(groups=lambda c: cascade_batch(4, 2, 16, torch.float32, [(2, 20)], [], 1).groups)),
    ("scale_negative", "scale", _bad(scale=-1.0)),
    ("impl_unknown", "impl", _bad(impl="cuda")),
]  # fmt: skip


@pytest.mark.parametrize(("argument", "make"), [pytest.param(a, m, id=i) for i, a, m in BAD_ARGUMENTS])
def test_launcher_errors_name_the_argument(argument: str, make: Callable[[CascadeBatch], dict[str, Any]]) -> None:
    kwargs = make(batch_of("gqa2_three_groups"))
    with pytest.raises(ValueError, match=rf"^{argument} "):
        cascade_decode_attention(**kwargs)
