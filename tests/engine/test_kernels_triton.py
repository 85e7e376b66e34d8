"""Every Triton kernel in `kernels/`, run by Triton's CPU interpreter, against its torch reference.

Triton picks the interpreter when ``@triton.jit`` decorates a function, that is when a `kernels`
module is first imported, and only if ``TRITON_INTERPRET=1`` is set by then. This pytest process may
already have imported `kernels` without it, so each kernel family runs in a fresh subprocess — this
file run as a script — with the variable set in the child's environment. Production code never reads
the variable. Shapes are small (the interpreter runs every program through numpy) but chosen to cross
block boundaries: several query/key blocks, split state columns, partial last words and channel blocks.

With ``STRATA_TEST_DEVICE=cuda`` (tests/device.py; a lent GPU, ``scripts/gpu_check.sh``) the same cases
run compiled instead: the child makes that device torch's default (every case tensor lives there)
and the interpreter stays off; the bf16 shared kernel, which the interpreter cannot run, runs too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest
import torch

from tests import triton_child
from tests.triton_child import child_main

if TYPE_CHECKING:
    from kernels.attention.prefix_groups import PrefixGroups

ROOT = Path(__file__).resolve().parents[2]
FP32_TOLERANCE = 1e-5
HALF_TOLERANCE = 1e-2
BF16_TOLERANCE = 2e-2  # one bf16 rounding of the output is 2**-8 relative

Results = dict[str, tuple[float, float]]
"""case name -> (relative error of the Triton kernel against the reference, tolerance)."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().clamp_min(1e-30)
    return float((actual.double() - expected.double()).abs().max() / scale)


# --------------------------------------------------------------------------------------------------
# Cases (run in the child process only)
# --------------------------------------------------------------------------------------------------


def cases_kv_store() -> Results:
    from kernels.kv_store import store_kv

    out: Results = {}
    for dtype in (torch.float32, torch.float16):
        k_cache, v_cache = torch.randn(40, 3, 24).to(dtype), torch.randn(40, 3, 24).to(dtype)
        caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
        fused = torch.randn(5, 2 * 3 * 24).to(dtype)  # strided over tokens, like a fused projection
        k, v = fused[:, :72].view(5, 3, 24), fused[:, 72:].view(5, 3, 24)
        slots = torch.tensor([39, 0, 17, 4, 22])
        store_kv(caches[0], caches[1], slots, k, v, impl="torch")
        store_kv(caches[2], caches[3], slots, k, v, impl="triton")
        err = max(rel_err(caches[2], caches[0]), rel_err(caches[3], caches[1]))
        out[f"store_kv/{dtype}"] = (err, 0.0)
        # Negative slots (a graphed decode's padding) are dropped by both: nothing else changes.
        before = [c.clone() for c in caches]
        with_pads = torch.tensor([7, -1, 30, -1, -1])
        store_kv(caches[0], caches[1], with_pads, k, v, impl="torch", padded=True)
        store_kv(caches[2], caches[3], with_pads, k, v, impl="triton", padded=True)
        err = max(rel_err(caches[2], caches[0]), rel_err(caches[3], caches[1]))
        changed = sum(int((c != b).any(dim=(1, 2)).sum()) for c, b in zip(caches, before, strict=True))
        out[f"store_kv/{dtype}/negative_slots_dropped"] = (err + abs(changed - 8), 0.0)  # 2 rows x 4 caches
    return out


def _pool(num_slots: int, kv_heads: int, head_dim: int, rows: int, row_len: int, dtype: torch.dtype):
    k_cache = torch.randn(num_slots, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim).to(dtype)
    req_to_token = torch.randperm(num_slots)[: rows * row_len].view(rows, row_len).contiguous()
    return k_cache, v_cache, req_to_token


def cases_attention() -> Results:
    from kernels.attention.launch import decode_attention, extend_attention

    out: Results = {}
    extend_cases = {
        # name: (Hq, Hkv, D, start_pos, extend_lens, dtype)
        "extend/mha": (2, 2, 16, [0], [9], torch.float32),
        "extend/gqa_ragged_prefix": (4, 2, 16, [5, 0, 3], [3, 1, 6], torch.float32),
        "extend/multi_block": (2, 1, 24, [10], [70], torch.float32),  # 2 query and 2 key blocks, D pad
        "extend/fp16": (4, 2, 16, [4, 0], [5, 7], torch.float16),
    }
    for name, (hq, hkv, d, starts, lens, dtype) in extend_cases.items():
        k_cache, v_cache, req_to_token = _pool(300, hkv, d, 3, 90, dtype)
        rows = torch.tensor([2, 0, 1][: len(lens)])
        q = torch.randn(sum(lens), hq, d).to(dtype)
        args = (q, k_cache, v_cache, req_to_token, rows, torch.tensor(starts), torch.tensor(lens), d**-0.5)
        ref = extend_attention(*args, impl="torch")
        tri = extend_attention(*args, impl="triton")
        tol = HALF_TOLERANCE if dtype == torch.float16 else FP32_TOLERANCE
        out[name] = (rel_err(tri, ref), tol)

    decode_cases = {
        # name: (Hq, Hkv, D, seq_lens)
        "decode/gqa_ragged": (6, 2, 16, [1, 9, 70]),  # one token, one block, two blocks
        "decode/mha_d24": (2, 2, 24, [33, 5]),
    }
    for name, (hq, hkv, d, seq_lens) in decode_cases.items():
        k_cache, v_cache, req_to_token = _pool(300, hkv, d, 3, 80, torch.float32)
        rows = torch.tensor([1, 2, 0][: len(seq_lens)])
        # q as a slice of a wider projection: strided over requests, dense per head.
        q = torch.randn(len(seq_lens), 2 * hq * d)[:, : hq * d].view(len(seq_lens), hq, d)
        seq = torch.tensor(seq_lens)
        ref = decode_attention(q, k_cache, v_cache, req_to_token, rows, seq, 0.2, impl="torch")
        tri = decode_attention(q, k_cache, v_cache, req_to_token, rows, seq, 0.2, impl="triton")
        out[name] = (rel_err(tri, ref), FP32_TOLERANCE)
    return out


DECODE_CASES = {
    # name: (Hq, Hkv, D, dtype, seq_lens, kv_start (tail pass) or None (flat), splits or None (default)).
    # Keys per block (BLOCK_N): bf16 128 at D 64, 64 at D 128; fp32 64 at D <= 64, 16 at D 128. Each
    # split takes whole blocks, so a range of fewer keys than splits x block leaves the last splits empty.
    "g1_d64_fp32_b1": (2, 2, 64, torch.float32, [300], None, 4),  # 5 blocks, 2 a split: the last empty
    "g2_d128_bf16_b1": (4, 2, 128, torch.bfloat16, [200], None, 5),  # 4 blocks over 5 splits: one empty
    "g4_d64_bf16_short": (8, 2, 64, torch.bfloat16, [1, 2, 7, 150], None, None),  # shorter than the splits
    "g8_d24_fp32_one_split": (8, 1, 24, torch.float32, [2, 70, 33], None, 1),  # written directly, D padded
    "g8_d128_fp32_b2": (8, 1, 128, torch.float32, [5, 150], None, 8),  # 10 blocks, 2 a split, 3 splits empty
    "g4_d64_fp32_one_split": (4, 1, 64, torch.float32, [130, 64], None, 1),  # 3 blocks, an exact block
    "tail/g1_d128_bf16_b1": (2, 2, 128, torch.bfloat16, [203], [37], 3),  # the range starts mid-block
    "tail/g2_d64_fp32": (4, 2, 64, torch.float32, [3, 75, 230], [0, 10, 100], 4),  # 3 keys over 4 splits
    "tail/g8_d64_bf16_one_split": (8, 1, 64, torch.bfloat16, [20, 180], [19, 5], 1),  # one key; two blocks
    "tail/g4_d24_fp32": (8, 2, 24, torch.float32, [9, 50], [4, 0], None),
}


def cases_decode() -> Results:
    """The flat decode and the cascade's tail pass (one kernel) over their split of the keys: forced
    and default split counts (on the CPU: 3), every GQA group size the models use, and sequences
    shorter than a block and than the split count."""
    from kernels.attention.reference import decode_attention_torch, tail_decode_torch
    from kernels.attention.triton import decode_triton, tail_decode_triton

    out: Results = {}
    for name, (hq, hkv, d, dtype, seq_lens, kv_start, splits) in DECODE_CASES.items():
        k_cache, v_cache, req_to_token = _pool(1300, hkv, d, 4, 310, dtype)
        batch = len(seq_lens)
        rows = torch.tensor([3, 1, 0, 2][:batch])
        # q as a slice of a wider projection: strided over requests, dense per head.
        q = torch.randn(batch, 2 * hq * d)[:, : hq * d].to(dtype).view(batch, hq, d)
        seq = torch.tensor(seq_lens)
        args = (q, k_cache, v_cache, req_to_token, rows)
        tol = BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE
        if kv_start is None:
            ref = decode_attention_torch(*args, seq, 0.2)
            tri = decode_triton(*args, seq, 0.2, num_splits=splits)
            err = rel_err(tri, ref) if tri.dtype == dtype else math.inf
        else:
            start = torch.tensor(kv_start)
            o_ref, lse_ref = tail_decode_torch(*args, start, seq, 0.2)
            o_tri, lse_tri = tail_decode_triton(*args, start, seq, 0.2, num_splits=splits)
            err = max(rel_err(o_tri, o_ref), rel_err(lse_tri, lse_ref))
        out[f"decode/{name}"] = (err, tol)
    # An empty range (kv_start == seq_len) gives what the reference gives, o = 0 and lse = -inf (a
    # pass the LSE merge ignores), with one split and with several, empty or not.
    k_cache, v_cache, req_to_token = _pool(300, 1, 16, 2, 100, torch.float32)
    q, rows, seq = torch.randn(2, 2, 16), torch.tensor([1, 0]), torch.tensor([40, 7])
    for splits in (1, 4):
        o, lse = tail_decode_triton(q, k_cache, v_cache, req_to_token, rows, seq, seq, 0.2, num_splits=splits)
        empty = bool((o == 0).all()) and bool((lse == float("-inf")).all())
        out[f"decode/tail/empty_range/splits={splits}"] = (0.0 if empty else math.inf, 0.0)
    return out


class CascadeBatch(NamedTuple):
    """A decode batch whose rows really share leading slots (see :func:`cascade_batch`)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    groups: PrefixGroups


# Every member of a group but the last shares this many slots more than the group's shared length;
# the last member leaves the others there, so the group can only share the shorter run and the other
# members find the rest of their common run in their own (tail) pass.
CASCADE_OVERHANG = 5


def cascade_batch(
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    spec: list[tuple[int, int]],
    alone: list[int],
    tail_step: int,
    seed: int = 0,
) -> CascadeBatch:
    """``spec`` = [(members, shared length)] per group; ``alone`` = lengths of requests in no group.

    Member ``i`` of a group owns ``1 + i * tail_step`` slots after the common run (the new token
    last). Requests own rows in a shuffled order (a kernel that confuses batch index and row fails),
    entries past ``seq_len`` hold stale but valid slots, and ``q`` is strided over requests like one
    slice of a fused projection.
    """
    from kernels.attention.prefix_groups import PrefixGroups

    device = torch.get_default_device()  # the CPU, or the GPU the child runs the cases on
    g = torch.Generator(device=device).manual_seed(seed)
    layouts: list[list[int]] = []  # each request's slots, filled below
    groups: list[tuple[list[int], int]] = []
    need = sum(alone)
    for n, shared in spec:
        need += shared + CASCADE_OVERHANG + sum(CASCADE_OVERHANG + 1 + i * tail_step for i in range(n))
    num_slots = need + 16
    free = torch.randperm(num_slots, generator=g).tolist()
    for n, shared in spec:
        head = [free.pop() for _ in range(shared + CASCADE_OVERHANG)]
        members = []
        for i in range(n):
            common = shared if i == n - 1 else shared + CASCADE_OVERHANG
            own = [free.pop() for _ in range(1 + i * tail_step + (CASCADE_OVERHANG if i == n - 1 else 0))]
            members.append(len(layouts))
            layouts.append(head[:common] + own)
        groups.append((members, shared))
    layouts.extend([free.pop() for _ in range(n)] for n in alone)

    batch = len(layouts)
    width = max(len(slots) for slots in layouts) + 3
    table = torch.randint(num_slots, (batch + 2, width), generator=g)  # stale entries and unused rows
    rows = torch.randperm(batch + 2, generator=g)[:batch]
    for b, slots in enumerate(layouts):
        table[rows[b], : len(slots)] = torch.tensor(slots)
    q = torch.randn(batch, 2 * hq * d, generator=g)[:, : hq * d].to(dtype).view(batch, hq, d)
    return CascadeBatch(
        q=q,
        k_cache=torch.randn(num_slots, hkv, d, generator=g).to(dtype),
        v_cache=torch.randn(num_slots, hkv, d, generator=g).to(dtype),
        req_to_token=table,
        rows=rows,
        seq_lens=torch.tensor([len(slots) for slots in layouts]),
        groups=PrefixGroups.from_lists(groups, batch, device),
    )


CASCADE_CASES = {
    # name: (Hq, Hkv, D, dtype, [(group members, shared length)], lengths of lone requests, tail step).
    # Shared kernel blocks: BLOCK_N = 32 keys, BLOCK_Q = 16 or 32 query rows; tail kernel: 64 keys (fp32)
    # or 128 (16-bit), split 3 ways on the CPU.
    "gqa2_three_groups": (4, 2, 16, torch.float32, [(5, 37), (2, 20), (3, 64)], [45], 3),
    "mha_d24_long_tails": (2, 2, 24, torch.float32, [(4, 33)], [70], 21),  # tails of 6..74 keys, D padded
    "gqa8_two_query_blocks": (8, 1, 16, torch.float32, [(5, 70)], [3], 2),  # 40 query rows, 3 key blocks
    "gqa4_fp16": (8, 2, 16, torch.float16, [(3, 40), (2, 17)], [45], 3),
    "gqa2_bf16": (4, 2, 16, torch.bfloat16, [(2, 29), (3, 50)], [9], 4),
}


def cases_cascade() -> Results:
    """The cascade decode: its two Triton kernels against their torch references, and the whole
    cascade (Triton, then torch; with its groups and without) against the flat reference decode."""
    from kernels.attention.launch import cascade_decode_attention
    from kernels.attention.reference import decode_attention_torch, shared_prefix_decode_torch, tail_decode_torch
    from kernels.attention.triton import shared_prefix_decode_triton, tail_decode_triton

    out: Results = {}
    for name, (hq, hkv, d, dtype, spec, alone, tail_step) in CASCADE_CASES.items():
        c = cascade_batch(hq, hkv, d, dtype, spec, alone, tail_step)
        tol = {torch.float16: HALF_TOLERANCE, torch.bfloat16: BF16_TOLERANCE}.get(dtype, FP32_TOLERANCE)
        args = (c.q, c.k_cache, c.v_cache, c.req_to_token, c.rows)
        # The interpreter multiplies the raw bits of bf16 `tl.dot` operands (triton-lang/triton#11584,
        # "not supported yet"), so the bf16 shared kernel is only compiled (see compile_for_sm90), or
        # run on a GPU.
        dot_ok = dtype != torch.bfloat16 or c.q.is_cuda
        if dot_ok:
            members = c.groups.members_t
            o_ref, lse_ref = shared_prefix_decode_torch(*args, c.groups, 0.3)
            o_tri, lse_tri = shared_prefix_decode_triton(*args, c.groups, 0.3)
            err = max(rel_err(o_tri[members], o_ref[members]), rel_err(lse_tri[members], lse_ref[members]))
            out[f"cascade/{name}/shared"] = (err, tol)
            lone = torch.tensor([b for b, start in enumerate(c.groups.kv_start) if start == 0])
            untouched = float(o_tri[lone].abs().max()) + float(lse_tri[lone].isfinite().any())
            out[f"cascade/{name}/shared_leaves_lone_requests"] = (untouched, 0.0)
        o_ref, lse_ref = tail_decode_torch(*args, c.groups.kv_start_t, c.seq_lens, 0.3)
        o_tri, lse_tri = tail_decode_triton(*args, c.groups.kv_start_t, c.seq_lens, 0.3)
        out[f"cascade/{name}/tail"] = (max(rel_err(o_tri, o_ref), rel_err(lse_tri, lse_ref)), tol)
        flat = decode_attention_torch(*args, c.seq_lens, 0.3)
        for impl in ("triton", "torch"):
            for label, groups in (("groups", c.groups), ("no_groups", None)):
                if impl == "triton" and groups is not None and not dot_ok:
                    continue
                got = cascade_decode_attention(*args, c.seq_lens, groups, 0.3, impl=impl)
                err = rel_err(got, flat) if got.dtype == c.q.dtype else math.inf
                out[f"cascade/{name}/{impl}_{label}_vs_flat"] = (err, tol)
    return out


def cases_backend() -> Results:
    """The worker's Triton attention backend (the GPU path, run here on CPU tensors by the
    interpreter) against the reference backend over the same pool: a pure decode batch in which
    prefix groups form (the cascade decode), the same batch with groups off (the flat decode), and a
    mixed batch of prefill chunks and decodes (the flat extend)."""
    from services.worker.attention import ReferenceAttention, TritonAttention
    from services.worker.batch import BatchInput, ForwardBatch
    from services.worker.pools import KVPool, ReqToTokenTable

    hq, hkv, d = 4, 2, 16
    device = torch.get_default_device()
    kv = KVPool(1, 400, hkv, d, torch.float32, device)
    table = ReqToTokenTable(8, 128, device)
    prefix = list(range(100, 140))  # 40 slots shared by rows 0-2; row 3 alone
    table.write_runs([(0, 0, prefix), (1, 0, prefix), (2, 0, prefix), (3, 0, list(range(200, 230)))])
    reference = ReferenceAttention(kv, table)
    out: Results = {}
    batches = {
        # name: (rows, start_pos, new tokens per request)
        "decode": ([0, 1, 2, 3], [40, 40, 40, 30], [1, 1, 1, 1]),
        "mixed": ([0, 1, 2, 3], [40, 40, 40, 30], [3, 1, 6, 1]),
    }
    next_slot = iter(range(300, 400))
    for name, (rows, starts, lens) in batches.items():
        new = [[next(next_slot) for _ in range(n)] for n in lens]
        table.write_runs(list(zip(rows, starts, new, strict=True)))
        inp = BatchInput(rows, starts, [[1] * n for n in lens], new, None, [1] * len(rows))
        t = sum(lens)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        want = reference.forward(q, k, v, 0, ForwardBatch.build(inp, device, reference), 0.25)
        for cascade in (True, False):
            backend = TritonAttention(kv, table, cascade)
            batch = ForwardBatch.build(inp, device, backend)
            grouped = batch.attn.groups is not None
            out[f"backend/{name}/cascade={cascade}/groups_formed"] = (0.0 if grouped == cascade else math.inf, 0.0)
            got = backend.forward(q, k, v, 0, batch, 0.25)
            out[f"backend/{name}/cascade={cascade}"] = (rel_err(got, want), FP32_TOLERANCE)
    return out


def cases_bitmask() -> Results:
    from kernels.bitmask import apply_token_bitmask, bitmask_from_allowed

    out: Results = {}
    for vocab in (32, 65, 1030):  # an exact word, one bit in the last word, two programs per row
        allowed = [{0, 31, vocab - 1}, set(range(0, vocab, 3)), set(), set(range(vocab))]
        logits = torch.randn(len(allowed), vocab)
        mask = torch.stack([bitmask_from_allowed(a, vocab) for a in allowed]).to(logits.device)
        ref, tri = logits.clone(), logits.clone()
        apply_token_bitmask(ref, mask, impl="torch")
        apply_token_bitmask(tri, mask, impl="triton")
        same = torch.equal(ref, tri)  # -inf entries make a relative error meaningless: compare exactly
        out[f"bitmask/V={vocab}"] = (0.0 if same else math.inf, 0.0)
    return out


def cases_gated_delta() -> Results:
    import torch.nn.functional as F

    from kernels.gated_delta import gated_delta_extend, gated_delta_step

    def inputs(n: int, hk: int, hv: int, dk: int, dv: int):
        q = F.normalize(torch.randn(n, hk, dk), dim=-1) / math.sqrt(dk)
        k = F.normalize(torch.randn(n, hk, dk), dim=-1)
        return q, k, torch.randn(n, hv, dv), -F.softplus(torch.randn(n, hv)), torch.rand(n, hv)

    out: Results = {}
    step_cases = {"step/gva": (3, 2, 4, 16, 8), "step/split_dv": (2, 1, 1, 128, 64)}
    for name, (b, hk, hv, dk, dv) in step_cases.items():
        q, k, v, g, beta = inputs(b, hk, hv, dk, dv)
        pool = torch.randn(5, hv, dk, dv)
        ref_pool, tri_pool = pool.clone(), pool.clone()
        idx = torch.tensor([4, 0, 2][:b])
        ref = gated_delta_step(q, k, v, g, beta, ref_pool, idx, impl="torch")
        tri = gated_delta_step(q, k, v, g, beta, tri_pool, idx, impl="triton")
        out[name] = (max(rel_err(tri, ref), rel_err(tri_pool, ref_pool)), FP32_TOLERANCE)
    extend_cases = {"extend/t1": (1, 2, 2, 16, 16), "extend/gva_t9": (9, 1, 2, 16, 8),
                    "extend/split_dv": (4, 1, 1, 128, 64)}  # fmt: skip
    for name, (t, hk, hv, dk, dv) in extend_cases.items():
        q, k, v, g, beta = inputs(t, hk, hv, dk, dv)
        pool = torch.randn(3, hv, dk, dv)
        ref_pool, tri_pool = pool.clone(), pool.clone()
        ref = gated_delta_extend(q, k, v, g, beta, ref_pool, 1, impl="torch")
        tri = gated_delta_extend(q, k, v, g, beta, tri_pool, 1, impl="triton")
        out[name] = (max(rel_err(tri, ref), rel_err(tri_pool, ref_pool)), FP32_TOLERANCE)
    return out


def cases_conv1d() -> Results:
    from kernels.conv1d import causal_conv1d_extend, causal_conv1d_update

    out: Results = {}
    channels, kernel = 150, 4  # two channel blocks for the extend kernel, a partial last one
    weight = torch.randn(channels, kernel)
    for state_len in (kernel, kernel - 1):
        for bias in (torch.randn(channels), None):
            tag = f"Ks={state_len},bias={bias is not None}"
            pool = torch.randn(4, channels, state_len)
            ref_pool, tri_pool = pool.clone(), pool.clone()
            x, idx = torch.randn(3, channels), torch.tensor([3, 0, 1])
            ref = causal_conv1d_update(x, ref_pool, weight, bias, idx, impl="torch")
            tri = causal_conv1d_update(x, tri_pool, weight, bias, idx, impl="triton")
            out[f"update/{tag}"] = (max(rel_err(tri, ref), rel_err(tri_pool, ref_pool)), FP32_TOLERANCE)
            for length in (1, 2, 20):  # shorter than the state, and more than one token block
                x = torch.randn(length, channels)
                ref = causal_conv1d_extend(x, ref_pool, weight, bias, 2, activation=None, impl="torch")
                tri = causal_conv1d_extend(x, tri_pool, weight, bias, 2, activation=None, impl="triton")
                err = max(rel_err(tri, ref), rel_err(tri_pool, ref_pool))
                out[f"extend/{tag},T={length}"] = (err, FP32_TOLERANCE)
    return out


_INDEX_ARGS = {
    "slots",
    "rows",
    "start_pos",
    "extend_lens",
    "q_starts",
    "req_to_token",
    "seq_lens",
    "state_indices",
    "members",
    "group_starts",
    "shared_lens",
    "kv_start",
}


def compile_for_sm90() -> dict[str, str]:
    """Compile every kernel to a Hopper cubin with the ptxas bundled in the triton wheel (no GPU needed).

    The interpreter does not catch GPU-only failures (layouts, shared memory, specialisation of
    arguments equal to 1), and no GPU is guaranteed here. Returns kernel -> "ok" or the error.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from kernels import bitmask, conv1d, gated_delta, kv_store
    from kernels.attention import triton as attention

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4}).__dict__

    def arg_type(name: str, dtype: str, kernel_name: str = "") -> str:
        if name.startswith("stride") or name in ("num_tokens", "vocab_size"):
            return "i32"
        if name in ("lse", "part_o", "part_lse"):
            return "*fp32"
        if name == "o" and kernel_name.startswith("cascade"):
            return "*fp32"
        if name == "scale_log2e":
            return "fp32"
        if name in _INDEX_ARGS:
            return "*i64"
        return {"bitmask": "*i32", "state": "*fp32", "g": "*fp32"}.get(name, "*" + dtype)

    conv = {"C": 300, "K": 4, "HAS_BIAS": True, "SILU": True, "BLOCK_C": 128}
    delta = {"REP": 2, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32}
    decode = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_G": 16, "BLOCK_N": 64, "UPCAST": False}
    kernels = {
        "store_kv": (kv_store._store_kv_kernel, {"ROW": 1024, "BLOCK": 1024}),
        "extend_attention": (attention._extend_kernel,
                             {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 64, "BLOCK_N": 64}),
        # One decode kernel, two variants: the flat decode, and the cascade's tail (start offset, LSE).
        "decode_attention": (attention._decode_kernel, {**decode, "HAS_START": False, "STORE_LSE": False}),
        "cascade_shared": (attention._shared_kernel,
                           {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_Q": 32, "BLOCK_N": 32}),
        "cascade_tail": (attention._decode_kernel, {**decode, "HAS_START": True, "STORE_LSE": True}),
        "decode_merge": (attention._decode_merge_kernel,
                         {"NUM_SPLITS": 5, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 8, "STORE_LSE": True}),
        "bitmask": (bitmask._apply_bitmask_kernel, {"BLOCK": 1024}),
        "delta_step": (gated_delta._step_kernel, {**delta, "H": 32}),
        # num_tokens == 1 is specialised to a constant on a GPU: compile that variant too.
        "delta_extend_t1": (gated_delta._extend_kernel, {**delta, "num_tokens": 1}),
        "conv_update": (conv1d._update_kernel, {**conv, "KS": 4}),
        "conv_extend_t1": (conv1d._extend_kernel, {**conv, "KS": 3, "BLOCK_T": 16, "num_tokens": 1}),
        "conv_extend_state": (conv1d._extend_state_kernel, {"C": 300, "KS": 3, "BLOCK_C": 128}),
    }  # fmt: skip
    out = {}
    for name, (kernel, constexprs) in kernels.items():
        signature = {
            arg: "constexpr" if arg in constexprs else arg_type(arg, "bf16", name) for arg in kernel.arg_names
        }
        try:
            triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)
            out[name] = "ok"
        except Exception as exc:  # report every kernel, not just the first failure
            out[name] = f"{type(exc).__name__}: {exc}"[:2000]
    return out


FAMILIES: dict[str, Callable[[], Results]] = {
    "kv_store": cases_kv_store,
    "attention": cases_attention,
    "decode": cases_decode,
    "cascade": cases_cascade,
    "backend": cases_backend,
    "bitmask": cases_bitmask,
    "gated_delta": cases_gated_delta,
    "conv1d": cases_conv1d,
}


# --------------------------------------------------------------------------------------------------
# The tests (parent process)
# --------------------------------------------------------------------------------------------------


def run_family(request: pytest.FixtureRequest, family: str) -> Results:
    from tests.device import TEST_DEVICE

    results = triton_child.family(request, family, interpret=TEST_DEVICE == "cpu")
    return {name: (err, tol) for name, (err, tol) in results.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_kernel_matches_torch_reference(request: pytest.FixtureRequest, family: str) -> None:
    results = run_family(request, family)
    assert results, "no case ran"
    failures = {name: err for name, (err, tol) in results.items() if not err <= tol}
    assert not failures, f"relative errors over tolerance: {failures}"


def test_triton_kernels_compile_for_a_hopper_gpu() -> None:
    results = triton_child.run(__file__, "compile", interpret=False)
    assert len(results) == 12
    assert all(status == "ok" for status in results.values()), results


if __name__ == "__main__":
    child_main(FAMILIES, compile_for_sm90)
