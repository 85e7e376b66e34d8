"""Speculative decoding with Qwen3-Next's MTP head (``--speculative-algorithm mtp``): the head
drafts from the target's hidden states, the target verifies; output equals transformers on every
path (chunked prefill, prefix hits, overlap, state rollback), the head's KV (its own pool at the
target's slots) is what a from-scratch pass over the same tokens writes, and the pools balance."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config import ConfigError
from services.common.step import ReqInput, StepRequest
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.speculative import SpecConfig
from services.worker.config import WorkerConfig
from services.worker.mtp import MtpDrafter
from services.worker.tiny import MTP_FILE
from tests import sched_harness as h
from tests.reference import hf_greedy

MTP = SpecConfig("mtp", num_draft_tokens=3, max_batch=64, min_accepted=0, adaptive=False)  # never backs off


def _engine(model: Path, kv_bytes: int = 1 << 22, page_size: int = 1) -> h.Engine:
    cfg = h.EngineConfig(device=h.TEST_DEVICE, kv_cache_bytes=kv_bytes, max_rows=8, page_size=page_size, mtp=True)
    return h.Engine(model, cfg)


def _prompts(vocab: int, seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(12, 40))] for _ in range(n)]


def _books(loop: SchedulerLoop) -> None:
    assert loop.batcher is not None and loop.batcher.idle
    loop.batcher.mem.check_idle()


@pytest.mark.parametrize(("overlap", "page_size"), [(True, 1), (False, 1), (True, 4)])
def test_mtp_output_equals_transformers(tiny_qwen3_next: Path, overlap: bool, page_size: int) -> None:
    """Random MTP weights: most drafts are rejected, so the hybrid target's states roll back at
    nearly every verify; chunked prefill (16-token chunks), a second wave on cached prefixes,
    pages of one and of four slots."""
    eng = _engine(tiny_qwen3_next, page_size=page_size)
    assert eng.info.draft_model == "mtp"
    prompts = _prompts(eng.info.vocab_size, seed=3)
    want = [hf_greedy(tiny_qwen3_next, p, 12, stop_at_eos=False) for p in prompts]
    cfg = LoopConfig(max_prefill_tokens=16, overlap=overlap, spec=MTP)
    outs, loop = h.run(eng, [h.Spec(p, 12) for p in prompts], cfg, waves=2)
    assert [o.ids for o in outs] == want + want
    assert sum(o.cached_tokens for o in outs[len(prompts) :]) > 0
    assert loop.batcher is not None and loop.batcher.spec is not None
    c = loop.batcher.spec.counters
    assert c.verify_steps > 0 and c.draft_tokens > c.accepted_tokens, c
    _books(loop)


def test_sampled_output_is_the_same_with_mtp(tiny_qwen3_next: Path) -> None:
    """Seeded sampling: each verify position is sampled as the plain decode at that output index
    would be, so MTP on and off give the same tokens."""
    prompts = _prompts(700, seed=8, n=3)
    specs = [h.Spec(p, 12, temperature=0.8, seed=70 + i) for i, p in enumerate(prompts)]
    plain = h.Engine(tiny_qwen3_next, h.EngineConfig(device=h.TEST_DEVICE, kv_cache_bytes=1 << 22, max_rows=8))
    off, _ = h.run(plain, specs, LoopConfig(max_prefill_tokens=16))
    on, loop = h.run(_engine(tiny_qwen3_next), specs, LoopConfig(max_prefill_tokens=16, spec=MTP))
    assert [o.ids for o in on] == [o.ids for o in off]
    assert loop.batcher is not None and loop.batcher.spec is not None
    assert loop.batcher.spec.counters.verify_steps > 0
    _books(loop)


def test_kept_drafts_with_an_oracle_head(tiny_qwen3_next: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accept path by construction: the head's greedy tokens are replaced (after its forward,
    which still writes its KV) by the target's own continuation, wrong at every third position,
    so verifies keep all drafts, some or none: full accepts, partial ones with state rollback."""
    eng = _engine(tiny_qwen3_next)
    prompt = _prompts(eng.info.vocab_size, seed=4, n=1)[0]
    new = 20
    want = hf_greedy(tiny_qwen3_next, prompt, new, stop_at_eos=False)
    seq = prompt + want
    real = MtpDrafter._forward

    def oracle(self: MtpDrafter, e, want: int):  # type: ignore[no-untyped-def]
        tokens, g = real(self, e, want)
        if want:  # the entry at p predicts the token at p + 2
            at = [s + len(ids) + 1 for s, ids in zip(e.start, e.ids, strict=True)]
            tokens = [seq[p] if p < len(seq) and p % 3 else 1 for p in at]
        return tokens, g

    monkeypatch.setattr(MtpDrafter, "_forward", oracle)
    cfg = LoopConfig(max_prefill_tokens=8, spec=MTP)
    outs, loop = h.run(eng, [h.Spec(prompt, new)], cfg, waves=2)
    assert [o.ids for o in outs] == [want, want]
    assert loop.batcher is not None and loop.batcher.spec is not None
    c = loop.batcher.spec.counters
    assert 0 < c.accepted_tokens < c.draft_tokens, c
    assert c.accepted_tokens >= 0.3 * c.draft_tokens, c
    _books(loop)


def _mtp_keys(eng: h.Engine, row: int, upto: int) -> torch.Tensor:
    """The head's K of ``row``'s positions ``[0, upto)``."""
    assert isinstance(eng.draft, MtpDrafter)
    slots = eng.req_to_token.table[row, :upto]
    return eng.draft.pool.kv.layer(0)[0][slots].float()


def test_head_kv_follows_every_kept_position(tiny_qwen3_next: Path) -> None:
    """Prefill in chunks, a verify of given drafts that keeps two of three, a verify of the
    head's own drafts, plain decodes: the head's KV of every kept position but the last equals
    that of one prefill over the same tokens (where every entry is written from the target's
    hidden states in one go)."""
    prompt = _prompts(700, seed=5, n=1)[0][:20]
    greedy = hf_greedy(tiny_qwen3_next, prompt, 4, stop_at_eos=False)
    a = _engine(tiny_qwen3_next)
    slots = iter(range(1000))

    def take(n: int) -> list[int]:
        return [next(slots) for _ in range(n)]

    def step(i: int, req: ReqInput) -> list[int]:
        return [o.token_id for o in a.step(StepRequest(i, reqs=[req])).outputs]

    step(1, ReqInput("r", 0, prompt[:7], 0, take(7), mamba_slot=0, sample=False))
    step(2, ReqInput("r", 0, prompt[7:14], 7, take(7), mamba_slot=0, sample=False))
    assert step(3, ReqInput("r", 0, prompt[14:], 14, take(6), mamba_slot=0)) == greedy[:1]
    wrong = (greedy[3] + 1) % 700
    out = step(4, ReqInput("r", 0, [*greedy[:3], wrong], 20, take(4), mamba_slot=0, num_draft=3))
    assert out == greedy[1:4]  # two drafts kept, the third rejected
    tokens = prompt + greedy[:3]
    mine = ReqInput("r", 0, [greedy[3], 0, 0, 0], len(tokens), take(4), mamba_slot=0, num_draft=3, worker_drafts=True)
    out = step(5, mine)
    tokens += mine.input_ids[: len(out)]  # the input and the accepted drafts
    t = out[-1]
    for i in (6, 7):
        (t2,) = step(i, ReqInput("r", 0, [t], len(tokens), take(1), mamba_slot=0))
        tokens.append(t)
        t = t2
    b = _engine(tiny_qwen3_next)
    b.step(StepRequest(1, reqs=[ReqInput("r", 0, tokens, 0, list(range(len(tokens))), mamba_slot=0, sample=False)]))
    n = len(tokens) - 1  # both have written the entries of positions 0 .. n-1; the last is pending
    got, ref = _mtp_keys(a, 0, n), _mtp_keys(b, 0, n)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def test_the_heads_upkeep_writes_kv_without_its_moe(tiny_qwen3_next: Path) -> None:
    """A step where nobody drafts still writes the head's K/V for its kept positions (the test
    above checks it against one prefill), but runs the head's attention output and MoE on no row;
    a drafting step runs them on its drafting rows."""
    eng = _engine(tiny_qwen3_next)
    assert isinstance(eng.draft, MtpDrafter)
    rows: list[int] = []
    eng.draft.head.layers[0].mlp.register_forward_pre_hook(lambda _m, args: rows.append(int(args[0].shape[0])))
    prompt = _prompts(700, seed=9, n=1)[0][:12]
    (t,) = [o.token_id for o in eng.step(StepRequest(1, reqs=[ReqInput("r", 0, prompt, 0, list(range(12)),
                                                                       mamba_slot=0)])).outputs]  # fmt: skip
    (t,) = [o.token_id for o in eng.step(StepRequest(2, reqs=[ReqInput("r", 0, [t], 12, [12], mamba_slot=0)])).outputs]
    assert rows == [0, 0]  # the prefill's and the decode's upkeep: K/V only
    eng.step(StepRequest(3, reqs=[ReqInput("r", 0, [t, 0, 0], 13, [13, 14, 15], mamba_slot=0, num_draft=2,
                                           worker_drafts=True)]))  # fmt: skip
    assert rows[2:4] == [1, 1]  # two drafts, one head pass each, on the drafting row


def test_mtp_needs_a_qwen3_next_checkpoint_with_the_head(
    tiny_qwen3: Path, tiny_qwen3_next: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"speculative_mtp: .*needs a Qwen3-Next checkpoint"):
        WorkerConfig(model=str(tiny_qwen3), speculative_mtp=True).validate()
    headless = tmp_path / "headless"
    shutil.copytree(tiny_qwen3_next, headless)
    (headless / MTP_FILE).unlink()
    with pytest.raises(ConfigError, match=r"speculative_mtp: .*has no MTP head"):
        WorkerConfig(model=str(headless), speculative_mtp=True).validate()
    WorkerConfig(model=str(tiny_qwen3_next), speculative_mtp=True).validate()
    # Without MTP the head's tensors are simply not loaded: the headless copy serves alike.
    assert h.Engine(headless, h.EngineConfig(kv_cache_bytes=1 << 20, max_rows=2)).info.draft_model == ""


def test_strata_up_mtp(tiny_qwen3: Path, tiny_qwen3_next: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``strata up --speculative-algorithm mtp``: the worker gets --speculative-mtp; a checkpoint
    without the head is refused before anything starts."""
    from services.cli import _stack_args, build_parser, main

    args = build_parser().parse_args(["up", "--model", str(tiny_qwen3_next), "--speculative-algorithm", "mtp"])
    args.tls_files, args.run_dir_path = None, "."
    a = _stack_args(args)
    sched = a["scheduler"]
    assert "--speculative-mtp" in a["worker"] and sched[sched.index("--speculative-algorithm") + 1] == "mtp"
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--model", str(tiny_qwen3), "--speculative-algorithm", "mtp"])
    assert exit_.value.code == 2
    assert "--speculative-algorithm mtp: " in capsys.readouterr().err


def test_a_worker_without_the_head_decodes_plainly(tiny_qwen3_next: Path) -> None:
    """The scheduler asks for MTP, the worker has no head: speculation is off, output unchanged."""
    eng = h.Engine(tiny_qwen3_next, h.EngineConfig(device=h.TEST_DEVICE, kv_cache_bytes=1 << 20, max_rows=2))
    prompt = _prompts(eng.info.vocab_size, seed=6, n=1)[0]
    outs, loop = h.run(eng, [h.Spec(prompt, 6)], LoopConfig(spec=MTP))
    assert loop.batcher is not None and loop.batcher.spec is None
    assert outs[0].ids == hf_greedy(tiny_qwen3_next, prompt, 6, stop_at_eos=False)


def test_head_logits_equal_transformers_layers(tiny_qwen3_next: Path) -> None:
    """The head against the same math assembled from transformers' own Qwen3-Next modules (a
    full-attention decoder layer, its RMSNorm, rotary and LM head; transformers has no MTP head):
    fc over concat(normed embedding of the token at p + 1, normed final hidden state at p)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    from services.worker.batch import BatchInput, ForwardBatch
    from tests.reference import hf_model

    hf: Any = hf_model(str(tiny_qwen3_next))
    cfg = hf.config
    mtp = load_file(str(tiny_qwen3_next / MTP_FILE))
    n_hidden = cfg.hidden_size
    layer = Qwen3NextDecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
    state = {k.removeprefix("mtp.layers.0."): v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    experts = range(cfg.num_experts)  # transformers holds the experts fused: [E, 2I, H] (gate | up), [E, H, I]
    state["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat((state.pop(f"mlp.experts.{i}.gate_proj.weight"), state.pop(f"mlp.experts.{i}.up_proj.weight")))
        for i in experts
    ])  # fmt: skip
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{i}.down_proj.weight") for i in experts])
    layer.load_state_dict(state)
    norms: dict[str, Any] = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3NextRMSNorm(n_hidden, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": mtp[f"mtp.{name}.weight"]})
    fc = torch.nn.Linear(2 * n_hidden, n_hidden, bias=False)
    fc.load_state_dict({"weight": mtp["mtp.fc.weight"]})
    ids = _prompts(700, seed=7, n=1)[0][:24]
    n = len(ids)
    with torch.inference_mode():
        last = hf.model(input_ids=torch.tensor([ids])).last_hidden_state  # after the final norm
        e = norms["pre_fc_norm_embedding"](hf.model.embed_tokens(torch.tensor([ids[1:]])))
        x = fc(torch.cat((e, norms["pre_fc_norm_hidden"](last[:, :-1])), dim=-1))
        pos = torch.arange(n - 1)[None]
        mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        want = hf.lm_head(norms["norm"](x))[0]

        eng = _engine(tiny_qwen3_next)
        assert isinstance(eng.draft, MtpDrafter)
        d = eng.draft
        inp = eng._batch_input([ReqInput("r", 0, ids, 0, list(range(n)), mamba_slot=0, sample=False)])
        model: Any = eng.model
        _, hidden = model.forward_hidden(ForwardBatch.build(inp, eng.device, eng.attn), eng._ctx)
        entries = BatchInput([0], [0], [ids[1:]], [list(range(n - 1))], None, [n - 1])  # every row's output
        g = d.head(ForwardBatch.build(entries, eng.device, d.pool.attn), d.pool.ctx, hidden[:-1])
        got = d.head.logits(g).cpu()
    # The hybrid's fp32 bar on a GPU is 2e-4 (test_engine_device.py: Triton kernels round otherwise
    # than transformers on the CPU); on the CPU, 1e-4.
    tol = 1e-4 if h.TEST_DEVICE == "cpu" else 2e-4
    assert torch.allclose(got, want, atol=tol, rtol=0), (got - want).abs().max()


def test_mtp_with_elastic_pools(tiny_qwen3_next: Path) -> None:
    """The head's pool follows every PoolResize of the target's (the same slots, grown and shrunk
    by the orchestrator under load and when idle); output still equals transformers."""
    import asyncio

    kv_b = _engine(tiny_qwen3_next).info.bytes_per_slot
    eng = h.Engine(tiny_qwen3_next, h.EngineConfig(
        device=h.TEST_DEVICE, kv_cache_bytes=256 * kv_b, max_rows=8, mamba_slots=8, kv_max_bytes=8192 * kv_b,
        mamba_max_slots=64, mtp=True,
    ))  # fmt: skip
    if eng.info.slot_granularity > 128:
        pytest.skip("the device's pool pages are coarser than this workload's pool")
    assert isinstance(eng.draft, MtpDrafter)
    budget = 4096 * kv_b + 32 * eng.info.bytes_per_mamba_slot
    cfg = LoopConfig(max_prefill_tokens=64, elastic_budget_bytes=budget, elastic_idle_s=0.2, elastic_min_kv_slots=128,
                     spec=MTP)  # fmt: skip
    rng = random.Random(9)
    prompts = [[rng.randrange(3, eng.info.vocab_size) for _ in range(rng.randrange(60, 120))] for _ in range(6)]
    sizes: list[int] = []

    async def body(loop: SchedulerLoop) -> list[h.Outcome]:
        outs = await asyncio.gather(*(h.one(loop, f"r{i}", h.Spec(p, 8)) for i, p in enumerate(prompts)))
        sizes.append(eng.kv.num_slots)
        await asyncio.sleep(1.0)  # idle: the loop gives memory back
        sizes.append(eng.kv.num_slots)
        return list(outs)

    outs, loop = h.serve(eng, cfg, body)
    assert [o.ids for o in outs] == [hf_greedy(tiny_qwen3_next, p, 8, stop_at_eos=False) for p in prompts]
    assert loop.batcher is not None and loop.batcher.elastic is not None and loop.batcher.elastic.resizes > 0
    assert sizes[0] > 256 and sizes[1] < sizes[0] and eng.draft.pool.kv.num_slots == eng.kv.num_slots, sizes
    _books(loop)


def test_the_kv_budget_covers_the_head_pool(tiny_qwen3_next: Path) -> None:
    """kv_cache_bytes holds the target's pool and the head's (one more attention layer per slot):
    the bytes per slot the scheduler plans with count both, and so do the committed bytes."""
    budget = 1 << 20
    plain = h.Engine(tiny_qwen3_next, h.EngineConfig(device=h.TEST_DEVICE, kv_cache_bytes=budget, max_rows=2))
    eng = h.Engine(tiny_qwen3_next, h.EngineConfig(device=h.TEST_DEVICE, kv_cache_bytes=budget, max_rows=2, mtp=True))
    assert isinstance(eng.draft, MtpDrafter)
    target, head = plain.info.bytes_per_slot, eng.draft.pool.kv.bytes_per_slot
    assert eng.info.bytes_per_slot == target + head and head * plain.model.num_kv_layers == target
    assert eng.kv.num_slots == eng.draft.pool.kv.num_slots <= budget // (target + head) < plain.kv.num_slots
    result = eng.step(StepRequest(1))
    assert result.kv_committed_bytes == eng.kv.committed_bytes + eng.draft.pool.kv.committed_bytes
