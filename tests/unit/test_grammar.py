"""Grammar service and matcher: compile cache, errors, mask format, and masked decodes that match."""

from __future__ import annotations

import asyncio
import json
import re
import struct
from pathlib import Path
from typing import Annotated, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kernels.bitmask import apply_token_bitmask, bitmask_words, unpack_bitmask
from services.common.errors import InvalidArgument
from services.scheduler.grammar import CompiledGrammar, Constraint, GrammarService, Matcher

# Larger than the tiny tokenizer (768 ids) and not a multiple of 32: ids 768..809 are model
# padding, bits 810..831 of the last word lie past the vocabulary.
VOCAB = 810
EOS = 2
SEEDS = range(20)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_qwen3))


@pytest.fixture(scope="module")
def service(tokenizer: PreTrainedTokenizerBase) -> GrammarService:
    return GrammarService(tokenizer, VOCAB, stop_token_ids=[EOS])


def allowed_ids(mask: bytes) -> set[int]:
    """Unpack by the documented format: little-endian int32 words, bit i of word w = id 32w+i."""
    words = struct.unpack(f"<{len(mask) // 4}i", mask)
    return {32 * w + i for w, word in enumerate(words) for i in range(32) if (word >> i) & 1}


def masked_decode(matcher: Matcher, seed: int, max_steps: int = 400) -> list[int]:
    """Greedy decode over seeded random logits under the matcher's masks; ids up to the stop token."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        mask = matcher.bitmask()
        logits = torch.randn(1, VOCAB, generator=gen)
        apply_token_bitmask(logits, torch.frombuffer(bytearray(mask), dtype=torch.int32).view(1, -1))
        tok = int(logits.argmax())
        assert tok < 768, f"padding id {tok} was allowed"
        assert matcher.accept(tok), f"token {tok} sampled under the mask was rejected"
        ids.append(tok)
        if matcher.is_terminated():
            return ids
    raise AssertionError(f"seed {seed}: no termination after {max_steps} tokens")


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    assert isinstance(text, str)
    return text


def compile_now(service: GrammarService, kind: str, text: str) -> CompiledGrammar:
    return service.compile_blocking(Constraint(kind, text))  # type: ignore[arg-type]


# -- compile cache -------------------------------------------------------------------------------


def test_same_constraint_compiled_once(tokenizer: PreTrainedTokenizerBase) -> None:
    svc = GrammarService(tokenizer, VOCAB)

    async def run() -> tuple[CompiledGrammar, CompiledGrammar]:
        a = await svc.compile(Constraint("regex", "[0-9]+"))
        b = await svc.compile(Constraint("regex", "[0-9]+"))
        return a, b

    a, b = asyncio.run(run())
    assert a is b
    stats = svc.stats()
    assert (stats.compiles, stats.hits, stats.size) == (1, 1, 1)
    assert stats.bytes > 0


def test_lru_is_bounded_and_evicts_least_recent(tokenizer: PreTrainedTokenizerBase) -> None:
    svc = GrammarService(tokenizer, VOCAB, cache_size=2)
    a, b, c = (Constraint("regex", p) for p in ("a+", "b+", "c+"))

    async def run() -> None:
        first_a = await svc.compile(a)
        await svc.compile(b)
        assert await svc.compile(a) is first_a  # a is now the most recent
        await svc.compile(c)  # evicts b
        assert svc.stats().size == 2
        assert await svc.compile(a) is first_a
        await svc.compile(b)  # compiled again, evicts c

    asyncio.run(run())
    stats = svc.stats()
    assert (stats.compiles, stats.hits, stats.evictions, stats.size) == (4, 2, 2, 2)


def test_concurrent_compiles_of_one_grammar_share_one_compile(tokenizer: PreTrainedTokenizerBase) -> None:
    svc = GrammarService(tokenizer, VOCAB)
    schema = Constraint(
        "json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    other = Constraint("regex", "[a-z]{3}")

    async def run() -> list[CompiledGrammar]:
        return await asyncio.gather(*[svc.compile(schema) for _ in range(8)], svc.compile(other))

    results = asyncio.run(run())
    assert all(r is results[0] for r in results[:8])
    assert results[8] is not results[0]
    stats = svc.stats()
    assert (stats.compiles, stats.joins, stats.size) == (2, 7, 2)


def test_cancelled_caller_does_not_cancel_the_shared_compile(tokenizer: PreTrainedTokenizerBase) -> None:
    svc = GrammarService(tokenizer, VOCAB)
    c = Constraint("regex", "(ab)+")

    async def run() -> CompiledGrammar:
        first = asyncio.create_task(svc.compile(c))
        await asyncio.sleep(0)  # the compile is now in flight
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await svc.compile(c)

    assert asyncio.run(run()).constraint == c
    assert svc.stats().compiles == 1


def test_a_queued_compile_nobody_waits_for_never_runs(tokenizer: PreTrainedTokenizerBase) -> None:
    """Both compile threads busy with slow grammars; a third, queued, loses its only caller: it is
    dropped before it starts, and the busy ones still finish and are cached."""
    svc = GrammarService(tokenizer, VOCAB)
    slow = [Constraint("regex", f"(a|b){{1,{2000 + i}}}c") for i in range(2)]
    queued = Constraint("regex", "(x|y)+z")

    async def run() -> None:
        busy = [asyncio.create_task(svc.compile(c)) for c in slow]
        await asyncio.sleep(0.05)  # both are running in the pool now
        waiter = asyncio.create_task(svc.compile(queued))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.gather(*busy)

    asyncio.run(run())
    stats = svc.stats()
    assert (stats.cancelled, stats.compiles) == (1, 2)


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "text", "reason"),
    [
        ("json_schema", '{"type": "object",', "not valid JSON"),
        ("json_schema", '{"type": "foo"}', 'Unsupported type "foo"'),
        ("regex", "a(b", "parenthesis is not closed"),
        ("regex", "[z-a]", ""),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("ebnf", 'root ::= ("a"', ""),
    ],
)
def test_invalid_constraint_names_the_field(
    tokenizer: PreTrainedTokenizerBase, kind: str, text: str, reason: str
) -> None:
    svc = GrammarService(tokenizer, VOCAB)

    async def run() -> list[BaseException | CompiledGrammar]:
        c = Constraint(kind, text)  # type: ignore[arg-type]
        return list(await asyncio.gather(svc.compile(c), svc.compile(c), return_exceptions=True))

    errors = asyncio.run(run())
    for err in errors:
        assert isinstance(err, InvalidArgument)
        message = str(err)
        assert message.startswith(f"constraint.{kind}: "), message
        assert reason in message
        assert "/project/cpp" not in message and len(message) < 500
    stats = svc.stats()
    assert (stats.compiles, stats.failures, stats.size) == (0, 1, 0)


def test_unknown_kind_is_invalid(service: GrammarService) -> None:
    with pytest.raises(InvalidArgument, match=r"^constraint: unknown kind 'lark'"):
        asyncio.run(service.compile(Constraint("lark", "start: 'a'")))  # type: ignore[arg-type]


def test_bad_service_arguments(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        GrammarService(tokenizer, VOCAB, stop_token_ids=[VOCAB])
    with pytest.raises(ValueError, match="cache_size"):
        GrammarService(tokenizer, VOCAB, cache_size=0)


def test_service_loads_a_tokenizer_directory_with_its_eos(tiny_qwen3: Path) -> None:
    svc = GrammarService(tiny_qwen3, 768)
    assert svc.stop_token_ids == (EOS,)  # <|im_end|>, the tokenizer's eos
    assert len(compile_now(svc, "regex", "x").matcher().bitmask()) == 24 * 4


# -- mask format -----------------------------------------------------------------------------


def test_bitmask_bit_order_and_contents(service: GrammarService, tokenizer: PreTrainedTokenizerBase) -> None:
    m = compile_now(service, "regex", "abc").matcher()
    mask = m.bitmask()
    assert isinstance(mask, bytes) and len(mask) == bitmask_words(VOCAB) * 4 == 26 * 4
    allowed = allowed_ids(mask)
    expected = {
        t
        for t in range(len(tokenizer))
        if t not in tokenizer.all_special_ids and (s := decode(tokenizer, [t])) and "abc".startswith(s)
    }
    assert allowed == expected and tokenizer.encode("a", add_special_tokens=False)[0] in allowed
    # The worker's unpacking (kernels.bitmask) reads the same ids.
    words = torch.frombuffer(bytearray(mask), dtype=torch.int32).view(1, -1)
    assert set(unpack_bitmask(words, VOCAB)[0].nonzero().flatten().tolist()) == allowed


def test_padding_ids_and_special_tokens_are_never_allowed(service: GrammarService) -> None:
    m = compile_now(service, "regex", "(.|\n)*").matcher()  # any text at all
    allowed = allowed_ids(m.bitmask())
    assert max(allowed) < 768  # no model-padding id, no bit past the vocabulary
    assert {0, 1} & allowed == set()  # <|endoftext|>, <|im_start|>
    assert EOS in allowed  # the empty text is a complete match
    assert not m.accept(800) and not m.accept(VOCAB + 5) and not m.accept(-1)


def test_stop_token_only_after_complete_match(
    service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    m = compile_now(service, "regex", "ab").matcher()
    a, b = (tokenizer.encode(s, add_special_tokens=False)[0] for s in "ab")
    assert EOS not in allowed_ids(m.bitmask())
    assert not m.accept(EOS) and not m.accept(b)  # rejected, state unchanged
    assert m.accept(a) and m.accept(b) and m.is_completed() and not m.is_terminated()
    assert allowed_ids(m.bitmask()) == {EOS}  # the grammar can only end
    assert m.accept(EOS) and m.is_terminated()
    with pytest.raises(RuntimeError, match="terminated"):
        m.bitmask()


def test_rollback_restores_earlier_masks(service: GrammarService, tokenizer: PreTrainedTokenizerBase) -> None:
    m = compile_now(service, "regex", "a[bc]d").matcher()
    a, b = (tokenizer.encode(s, add_special_tokens=False)[0] for s in "ab")
    start = m.bitmask()
    assert m.accept(a)
    after_a = m.bitmask()
    assert m.accept(b) and m.num_accepted == 2
    m.rollback(1)
    assert m.bitmask() == after_a
    with pytest.raises(ValueError, match="only 1 accepted"):
        m.rollback(2)
    m.rollback(1)
    assert m.bitmask() == start and m.num_accepted == 0


def test_drafts_are_cut_and_masked_without_moving_the_matcher(
    service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Speculative decoding under a grammar: drafts end before the first token it rejects and
    before one that would end it; ``bitmasks`` gives the mask at every verify position, each as
    stepping the matcher would, and leaves the state where it was."""
    m = compile_now(service, "regex", "a[bc]d").matcher()
    a, b, c, d = (tokenizer.encode(s, add_special_tokens=False)[0] for s in "abcd")
    assert m.accepted_prefix([a, b, d, EOS, a]) == 3  # EOS would end the grammar: no mask after it
    assert m.accepted_prefix([a, d, b]) == 1 and m.accepted_prefix([d]) == 0 and m.accepted_prefix([]) == 0
    assert m.num_accepted == 0
    stepped = [m.bitmask()]
    for tok in (a, c):
        assert m.accept(tok)
        stepped.append(m.bitmask())
    m.rollback(2)
    assert m.bitmasks([a, c]) == b"".join(stepped) and m.bitmasks([]) == stepped[0]
    with pytest.raises(ValueError, match=f"rejects token {d} at offset 1"):
        m.bitmasks([a, d])
    assert m.num_accepted == 0 and m.bitmask() == stepped[0]
    assert m.accept(a) and m.accepted_prefix([b, d]) == 2 and m.num_accepted == 1

# -- masked decoding -------------------------------------------------------------------------


REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(yes|no)(, (yes|no)){0,4}",
    r"\(\d{1,3}(\.\d{1,2})?\)",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_masked_decode_matches_regex(
    service: GrammarService, tokenizer: PreTrainedTokenizerBase, pattern: str
) -> None:
    compiled = compile_now(service, "regex", pattern)
    for seed in SEEDS:
        ids = masked_decode(compiled.matcher(), seed)
        assert ids[-1] == EOS and EOS not in ids[:-1]
        text = decode(tokenizer, ids[:-1])
        assert re.fullmatch(pattern, text), (seed, text)


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Annotated[str, Field(min_length=1, max_length=6)]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=130)]
    admin: bool
    role: Literal["user", "owner", "guest"]
    tags: Annotated[list[Literal["a", "b", "c"]], Field(max_length=3)]
    address: Address
    nickname: Annotated[str, Field(max_length=4)] | None = None


def test_masked_decode_is_valid_json_for_the_schema(
    service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    compiled = compile_now(service, "json_schema", json.dumps(Person.model_json_schema()))
    for seed in SEEDS:
        ids = masked_decode(compiled.matcher(), seed)
        assert ids[-1] == EOS
        text = decode(tokenizer, ids[:-1])
        assert isinstance(json.loads(text), dict), text
        Person.model_validate_json(text, strict=True)


EBNF = """
root ::= "[" item ("," item)* "]"
item ::= [0-9]+ | "x" | "(" item ")"
"""
EBNF_FLAT = re.compile(r"\[(\(*([0-9]+|x)\)*)(,\(*([0-9]+|x)\)*)*\]")


def test_masked_decode_follows_ebnf(service: GrammarService, tokenizer: PreTrainedTokenizerBase) -> None:
    compiled = compile_now(service, "ebnf", EBNF)
    for seed in SEEDS:
        ids = masked_decode(compiled.matcher(), seed)
        text = decode(tokenizer, ids[:-1])
        assert EBNF_FLAT.fullmatch(text), (seed, text)
        for item in text[1:-1].split(","):  # parentheses balance around each item
            assert len(item) - len(item.lstrip("(")) == len(item) - len(item.rstrip(")")), text


def accepts_text(tokenizer: PreTrainedTokenizerBase, compiled: CompiledGrammar, text: str) -> bool:
    """Whether a fresh matcher accepts the tokens of ``text`` and then the stop token."""
    m = compiled.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept(t) for t in ids) and m.accept(EOS) and m.is_terminated()


def test_length_bounded_json_strings_are_valid_json(
    service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Works around mlc-ai/xgrammar#800: raw control characters rejected, escapes accepted."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    compiled = compile_now(service, "json_schema", json.dumps(schema))
    assert accepts_text(tokenizer, compiled, '{"s": "abcd"}')
    assert accepts_text(tokenizer, compiled, '{"s": "a\\"\\\\\\u00e9"}')  # 4 characters
    assert not accepts_text(tokenizer, compiled, '{"s": "abcde"}')
    assert not accepts_text(tokenizer, compiled, '{"s": "a\tb"}')
    assert not accepts_text(tokenizer, compiled, '{"s": "a\x01b"}')
