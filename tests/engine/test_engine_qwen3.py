"""The worker engine on the tiny Qwen3 (fp32; on the test device, tests/device.py, default the CPU)
against transformers (fp32, CPU), on every cache path.

Logits must match transformers within 1e-4 (cold prefill, prefix hit, chunked prefill, decode,
and all of them mixed in one batch); greedy output must equal ``generate``; a malformed step is a
``StepError`` that leaves every pool untouched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels.linear import PACKED, PACKED_STEPS, STEPS
from services.common.step import (
    GREEDY,
    MambaCopy,
    MambaReset,
    ReleaseRow,
    ReqInput,
    SamplingParams,
    StepError,
    StepRequest,
)
from services.worker.engine import Engine, EngineConfig
from services.worker.sampler import SamplerInput, sample
from services.worker.tiny import write_tiny_checkpoint
from tests.device import TEST_DEVICE

TOL = 1e-4
MAX_ROWS = 8


@dataclass
class Ckpt:
    path: Path
    hf: torch.nn.Module


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Ckpt:
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Norm weights are all 1 after init; randomise them (saved back) so that a norm applied to the
    # wrong tensor, or not at all, changes the logits.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(path)
    hf.eval()
    return Ckpt(path, hf)


@pytest.fixture
def engine(ckpt: Ckpt) -> Engine:
    cfg = EngineConfig(device=TEST_DEVICE, kv_cache_bytes=2 << 20, max_rows=MAX_ROWS, max_context=512)
    return Engine(ckpt.path, cfg)


def ref_logits(ckpt: Ckpt, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.hf(torch.tensor([ids])).logits[0].float()


def prompt(seed: int, n: int, vocab: int = 768) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Slots:
    """A trivial slot allocator for the tests (the scheduler's job in production)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)  # slot 0 is never handed out: catches "all zero" bugs

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def extend(rid: str, row: int, ids: list[int], start: int, slots: list[int], **kw: object) -> ReqInput:
    return ReqInput(rid, row, ids, start, slots, **kw)  # type: ignore[arg-type]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a.cpu() - b.cpu()).abs().max())


def test_cold_prefill_matches_transformers(engine: Engine, ckpt: Ckpt) -> None:
    ids = prompt(0, 57)
    got = engine.forward_logits(StepRequest(0, reqs=[extend("a", 0, ids, 0, Slots().take(57))]))
    assert max_diff(got, ref_logits(ckpt, ids)) < TOL


def test_prefix_hit_reuses_another_requests_kv(engine: Engine, ckpt: Ckpt) -> None:
    slots = Slots()
    first = prompt(1, 40)
    first_slots = slots.take(40)
    engine.forward_logits(StepRequest(0, reqs=[extend("a", 0, first, 0, first_slots)]))
    second = first[:25] + prompt(2, 18)
    got = engine.forward_logits(
        StepRequest(1, reqs=[extend("b", 1, second[25:], 25, slots.take(18), prefix_slots=first_slots[:25])])
    )
    assert max_diff(got, ref_logits(ckpt, second)[25:]) < TOL


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(engine: Engine, ckpt: Ckpt, chunk: int) -> None:
    ids = prompt(3, 150)
    slots = Slots()
    parts = []
    for step, start in enumerate(range(0, len(ids), chunk)):
        piece = ids[start : start + chunk]
        req = extend("a", 2, piece, start, slots.take(len(piece)), sample=False)
        parts.append(engine.forward_logits(StepRequest(step, reqs=[req])))
    assert max_diff(torch.cat(parts), ref_logits(ckpt, ids)) < TOL


def test_decode_steps(engine: Engine, ckpt: Ckpt) -> None:
    ids = prompt(4, 30)
    slots = Slots()
    engine.forward_logits(StepRequest(0, reqs=[extend("a", 0, ids[:20], 0, slots.take(20))]))
    ref = ref_logits(ckpt, ids)
    for pos in range(20, 30):
        got = engine.forward_logits(StepRequest(pos, reqs=[extend("a", 0, [ids[pos]], pos, slots.take(1))]))
        assert max_diff(got[0], ref[pos]) < TOL


def test_mixed_batch_of_every_path(engine: Engine, ckpt: Ckpt) -> None:
    slots = Slots()
    base, chunked, decoding = prompt(5, 33), prompt(6, 70), prompt(7, 12)
    base_slots = slots.take(33)
    engine.forward_logits(StepRequest(0, reqs=[extend("base", 0, base, 0, base_slots)]))
    engine.forward_logits(StepRequest(1, reqs=[extend("chunk", 1, chunked[:30], 0, slots.take(30))]))
    engine.forward_logits(StepRequest(2, reqs=[extend("dec", 2, decoding[:11], 0, slots.take(11))]))
    cold = prompt(8, 21)
    hit = base[:16] + prompt(9, 9)
    reqs = [
        extend("cold", 3, cold, 0, slots.take(21)),
        extend("dec", 2, decoding[11:], 11, slots.take(1)),
        extend("hit", 4, hit[16:], 16, slots.take(9), prefix_slots=base_slots[:16]),
        extend("chunk", 1, chunked[30:], 30, slots.take(40)),
    ]
    got = engine.forward_logits(StepRequest(3, reqs=reqs))
    want = torch.cat(
        [
            ref_logits(ckpt, cold),
            ref_logits(ckpt, decoding)[11:],
            ref_logits(ckpt, hit)[16:],
            ref_logits(ckpt, chunked)[30:],
        ]
    )
    assert max_diff(got, want) < TOL


def test_last_layer_runs_only_the_rows_that_give_logits(engine: Engine, ckpt: Ckpt) -> None:
    """A step of a cold prompt, a prefix hit, a chunk that gives no logits and a decode: the last
    layer's MLP sees only the three rows that are sampled, every logprob still matches transformers,
    and the KV that the unsampled rows stored is what a later step needs (the silent chunk's
    continuation matches too)."""
    slots = Slots()
    base, decoding, chunked = prompt(20, 33), prompt(21, 12), prompt(22, 50)
    base_slots = slots.take(33)
    engine.forward_logits(StepRequest(0, reqs=[extend("base", 0, base, 0, base_slots)]))
    engine.forward_logits(StepRequest(1, reqs=[extend("dec", 1, decoding[:11], 0, slots.take(11))]))
    cold, hit = prompt(23, 21), base[:16] + prompt(24, 9)
    reqs = [
        extend("cold", 2, cold, 0, slots.take(21), return_logprobs=True, top_logprobs=2),
        extend("chunk", 3, chunked[:30], 0, slots.take(30), sample=False),
        extend("dec", 1, decoding[11:], 11, slots.take(1), return_logprobs=True, top_logprobs=2),
        extend("hit", 4, hit[16:], 16, slots.take(9), prefix_slots=base_slots[:16], return_logprobs=True,
               top_logprobs=2),
    ]
    mlp_rows: list[int] = []
    last = engine.model.model.layers[-1].mlp  # type: ignore[union-attr,index]
    hook = last.register_forward_hook(lambda _m, args, _out: mlp_rows.append(args[0].shape[0]))
    try:
        result = engine.step(StepRequest(2, reqs=reqs))
    finally:
        hook.remove()
    assert mlp_rows == [3]
    for out, ids in zip(result.outputs, (cold, decoding, hit), strict=True):
        want = torch.log_softmax(ref_logits(ckpt, ids)[-1], dim=-1)
        assert out.logprob is not None
        assert abs(out.logprob.logprob - float(want[out.token_id])) < TOL
        for tok, lp in out.logprob.top:
            assert abs(lp - float(want[tok])) < TOL
    got = engine.forward_logits(StepRequest(3, reqs=[extend("chunk", 3, chunked[30:], 30, slots.take(20))]))
    assert max_diff(got, ref_logits(ckpt, chunked)[30:]) < TOL


def run_greedy(engine: Engine, prompts: list[list[int]], steps: int, overlap: bool) -> list[list[int]]:
    """Prefill every prompt in one step, then decode them together, like a scheduler would."""
    slots = Slots()
    out: list[list[int]] = [[] for _ in prompts]
    reqs = [extend(f"r{i}", i, p, 0, slots.take(len(p))) for i, p in enumerate(prompts)]
    for step in range(steps):
        result = engine.step(StepRequest(step, reqs=reqs))
        assert [o.row for o in result.outputs] == list(range(len(prompts)))
        for o in result.outputs:
            out[o.row].append(o.token_id)
        reqs = [
            ReqInput(
                f"r{i}", i, [] if overlap else [out[i][-1]], len(p) + step, slots.take(1),
                use_last_sample=overlap, output_index=step + 1,
            )
            for i, p in enumerate(prompts)
        ]
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_64_tokens_equals_generate(engine: Engine, ckpt: Ckpt, overlap: bool) -> None:
    prompts = [prompt(10, 13), prompt(11, 29)]
    got = run_greedy(engine, prompts, 64, overlap)
    for p, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            # eos_token_id=None: the eos token is an ordinary token on both sides (no early stop).
            ref = ckpt.hf.generate(  # type: ignore[operator]
                torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
        assert len(ref) == 64
        assert tokens == ref
    assert len(set(got[0])) > 8  # a real sequence, not one token repeated


@pytest.mark.parametrize("packed", ["on", "off"])
def test_decode_with_packed_weights_matches_transformers(ckpt: Ckpt, packed: str) -> None:
    """Decode steps and prefill chunks multiply with oneDNN-packed copies of the weights
    (``packed_weights``, CPU fp32: kernels/linear.py) or with MKL on the plain ones; either way
    within the bar of transformers, and greedy output equal to ``generate``."""
    cfg = EngineConfig(device=TEST_DEVICE, kv_cache_bytes=2 << 20, max_rows=MAX_ROWS, max_context=512,
                       packed_weights=packed)  # fmt: skip
    engine = Engine(ckpt.path, cfg)
    has_copies = [hasattr(p, PACKED) for name, p in engine.model.named_parameters() if name.endswith("proj.weight")]
    assert has_copies and all(has_copies) == (packed == "on" and TEST_DEVICE == "cpu"), has_copies
    steps = {getattr(p, PACKED_STEPS, None) for name, p in engine.model.named_parameters() if hasattr(p, PACKED)}
    assert steps <= {STEPS}  # "on": decode steps and prefill chunks
    test_decode_steps(engine, ckpt)
    test_greedy_64_tokens_equals_generate(engine, ckpt, overlap=False)


@pytest.mark.parametrize("serial_mflops", [0.0, 1e9])
def test_forwards_on_one_thread_or_on_all_match_transformers(ckpt: Ckpt, serial_mflops: float) -> None:
    """A CPU forward below ``serial_step_mflops`` runs on one thread (services/worker/step_threads.py).
    On two threads (the suite itself runs on one, where the switch has nothing to do): every forward
    on both (0), or every one on one (1e9), within the bar of transformers, and greedy output equal
    to ``generate``."""
    before = torch.get_num_threads()
    cfg = EngineConfig(device=TEST_DEVICE, kv_cache_bytes=2 << 20, max_rows=MAX_ROWS, max_context=512,
                       serial_step_mflops=serial_mflops, threads=2)  # fmt: skip
    try:
        engine = Engine(ckpt.path, cfg)
        test_decode_steps(engine, ckpt)
        test_greedy_64_tokens_equals_generate(engine, ckpt, overlap=False)
        switch = engine._threads
        if TEST_DEVICE != "cpu" or not serial_mflops:
            assert switch is None and torch.get_num_threads() == 2
        else:
            assert switch is not None and switch.serial_steps > 64 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_penalised_sampling_uses_prompt_and_output_history(engine: Engine, ckpt: Ckpt) -> None:
    params = SamplingParams(
        temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2
    )
    ids = prompt(12, 20)
    slots = Slots()
    req = extend("p", 0, ids, 0, slots.take(20), sampling=params, seed=42, history_ids=ids)
    seq, got, want = list(ids), [], []
    for step in range(12):
        token = engine.step(StepRequest(step, reqs=[req])).outputs[0].token_id
        logits = ref_logits(ckpt, seq)[-1:].clone()
        want.append(sample(logits, [SamplerInput(params, 42, step, list(seq), None, False, 0)])[0].token_id)
        got.append(token)
        seq.append(token)
        req = extend(
            "p", 0, [token], len(seq) - 1, slots.take(1), sampling=params, seed=42, output_index=step + 1
        )
    assert got == want


def test_bitmask_logprobs_and_timings(engine: Engine) -> None:
    vocab = engine.info.vocab_size
    words = torch.zeros(-(-vocab // 32), dtype=torch.int32)
    words[123 // 32] = 1 << (123 % 32)
    req = extend("m", 0, prompt(13, 9), 0, Slots().take(9), token_bitmask=words.numpy().tobytes(),
                 return_logprobs=True, top_logprobs=3)
    first = engine.step(StepRequest(0, reqs=[req]))
    out = first.outputs[0]
    assert out.token_id == 123 and out.logprob is not None
    assert out.logprob.logprob == pytest.approx(0.0, abs=1e-6)  # the only allowed token
    assert first.forward_s > 0 and first.sample_s > 0 and first.idle_s == 0.0
    silent = extend("m", 0, [5], 9, [500], sample=False)
    second = engine.step(StepRequest(1, reqs=[silent]))
    assert second.outputs == [] and second.idle_s > 0


def test_info(engine: Engine) -> None:
    info = engine.info
    assert (info.architecture, info.vocab_size, info.context_length) == ("Qwen3ForCausalLM", 768, 512)
    assert info.eos_token_ids == (2,) and not info.hybrid and info.num_mamba_slots == 0
    assert info.bytes_per_slot == 2 * 4 * 2 * 16 * 4  # K+V, 4 layers, 2 kv heads, head_dim 16, fp32
    assert info.num_slots == (2 << 20) // info.bytes_per_slot
    assert len(info.fingerprint) == 64


def bad_steps(engine: Engine) -> dict[str, StepRequest]:
    """Each step has a valid request first, so refusing it must undo nothing because nothing ran."""
    s, vocab, rows, ctx = engine.info.num_slots, engine.info.vocab_size, MAX_ROWS, 512

    def step(bad: ReqInput, ops: list | None = None) -> StepRequest:  # type: ignore[type-arg]
        return StepRequest(9, ops=ops or [], reqs=[extend("ok", 1, [1, 2, 3], 0, [700, 701, 702]), bad])

    return {
        "row": step(extend("x", rows, [1], 0, [800])),
        "negative row": step(extend("x", -1, [1], 0, [800])),
        "duplicate row": step(extend("x", 1, [1], 0, [800])),
        "slot": step(extend("x", 2, [1, 2], 0, [800, s])),
        "negative slot": step(extend("x", 2, [1], 0, [-1])),
        "prefix slot": step(extend("x", 2, [1], 2, [800], prefix_slots=[3, s + 5])),
        "slot reused in step": step(extend("x", 2, [1], 0, [701])),
        "new_slots length": step(extend("x", 2, [1, 2, 3], 0, [800, 801])),
        "prefix_slots length": step(extend("x", 2, [1], 3, [800], prefix_slots=[5, 6])),
        "start beyond row": step(extend("x", 2, [1], 4, [800])),
        "context": step(extend("x", 2, [1, 2], ctx - 1, [800, 801], prefix_slots=list(range(ctx - 1)))),
        "token >= vocab": step(extend("x", 2, [1, vocab], 0, [800, 801])),
        "negative token": step(extend("x", 2, [-3], 0, [800])),
        "empty input": step(extend("x", 2, [], 0, [])),
        "bitmask length": step(extend("x", 2, [1], 0, [800], token_bitmask=b"\xff" * 8)),
        "bitmask empty": step(extend("x", 2, [1], 0, [800], token_bitmask=bytes(4 * (-(-vocab // 32))))),
        "no last sample": step(ReqInput("x", 2, [], 0, [800], use_last_sample=True)),
        "mamba slot on dense": step(extend("x", 2, [1], 0, [800], mamba_slot=0)),
        "mamba op on dense": step(extend("x", 2, [1], 0, [800]), ops=[MambaReset(0)]),
        "release row range": step(extend("x", 2, [1], 0, [800]), ops=[ReleaseRow(rows)]),
        "top_logprobs": step(extend("x", 2, [1], 0, [800], top_logprobs=99)),
        "history token": step(extend("x", 2, [1], 0, [800], history_ids=[vocab + 1])),
    }


def test_bad_steps_raise_and_leave_pools_untouched(engine: Engine) -> None:
    # Row 0 holds a sampled sequence; every bad step below also tries to release it first.
    engine.step(StepRequest(0, reqs=[extend("keep", 0, [4, 5, 6], 0, [10, 11, 12])]))
    for name, req in bad_steps(engine).items():
        req.ops.insert(0, ReleaseRow(0))
        k0, v3 = engine.kv.k[0].clone(), engine.kv.v[3].clone()
        table = engine.req_to_token.table.clone()
        with pytest.raises(StepError) as err:
            engine.step(req)
        assert str(err.value), name
        assert torch.equal(engine.kv.k[0], k0), name
        assert torch.equal(engine.kv.v[3], v3), name
        assert torch.equal(engine.req_to_token.table, table), name
    # Row 0 survived every refused ReleaseRow: its last sample still drives an overlap decode.
    ok = engine.step(StepRequest(1, reqs=[ReqInput("keep", 0, [], 3, [13], use_last_sample=True)]))
    assert len(ok.outputs) == 1


def test_error_messages_name_the_problem(engine: Engine) -> None:
    steps = bad_steps(engine)
    for name, fragment in [
        ("row", "row=8 out of range [0, 8)"),
        ("slot", f"new_slots has slot {engine.info.num_slots}"),
        ("new_slots length", "new_slots has 2 entries for 3 new tokens"),
        ("token >= vocab", "input_ids has token 768 outside [0, 768)"),
        ("no last sample", "use_last_sample but the row has no previous sample"),
        ("bitmask length", "token_bitmask has 8 bytes, expected 96"),
        ("context", "exceeds max_context 512"),
    ]:
        with pytest.raises(StepError, match=r"request 'x'") as err:
            engine.step(steps[name])
        assert fragment in str(err.value), (name, str(err.value))


def test_release_row_forgets_last_sample(engine: Engine) -> None:
    engine.step(StepRequest(0, reqs=[extend("a", 0, [4, 5], 0, [1, 2], sampling=GREEDY)]))
    with pytest.raises(StepError, match="no previous sample"):
        decode = ReqInput("a", 0, [], 2, [3], use_last_sample=True)
        engine.step(StepRequest(1, ops=[ReleaseRow(0)], reqs=[decode]))
    engine.step(StepRequest(2, ops=[ReleaseRow(0)]))
    with pytest.raises(StepError, match="no previous sample"):
        engine.step(StepRequest(3, reqs=[ReqInput("a", 0, [], 2, [3], use_last_sample=True)]))


def test_llama_checkpoint_matches(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=True,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    engine = Engine(tmp_path, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2))
    ids = prompt(14, 40, vocab=300)
    slots = Slots()
    got = engine.forward_logits(StepRequest(0, reqs=[extend("l", 0, ids[:30], 0, slots.take(30))]))
    got2 = engine.forward_logits(StepRequest(1, reqs=[extend("l", 0, ids[30:], 30, slots.take(10))]))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert max_diff(torch.cat([got, got2]), want) < TOL


def test_hybrid_model_gets_a_mamba_pool_and_needs_mamba_slots(tmp_path: Path) -> None:
    """The engine side of Qwen3-Next: pool sizing, Mamba ops in order, mamba_slot required."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint("qwen3-next", "tiny", tmp_path)
    engine = Engine(path, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2))
    assert engine.info.hybrid and engine.info.num_mamba_slots == 3 * 2
    assert engine.mamba is not None and engine.info.bytes_per_mamba_slot == engine.mamba.bytes_per_slot
    ids = prompt(15, 24)
    with pytest.raises(StepError, match="needs mamba_slot"):
        engine.step(StepRequest(0, reqs=[extend("h", 0, ids, 0, Slots().take(24))]))
    slots = Slots()
    first = engine.forward_logits(
        StepRequest(0, ops=[MambaReset(1)], reqs=[extend("h", 0, ids[:20], 0, slots.take(20), mamba_slot=1)])
    )
    # Fork the state (as a checkpoint into the cache would), then continue from the copy.
    tail = extend("h", 0, ids[20:], 20, slots.take(4), mamba_slot=4)
    rest = engine.forward_logits(StepRequest(1, ops=[MambaCopy(1, 4)], reqs=[tail]))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0]
    assert max_diff(torch.cat([first, rest]), want) < TOL
