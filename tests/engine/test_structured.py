"""Structured output: xgrammar masks through the real scheduler and engine.

At temperature 1 on a random model, every constrained output must still parse and validate (JSON
schema) or fully match (regex, EBNF), and finish by the grammar rather than by length.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import pytest

from services.common.errors import InvalidArgument
from services.scheduler.grammar import Constraint, GrammarService
from services.scheduler.loop import LoopConfig
from tests import sched_harness as h

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cache", "page", "slot"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,6}@(cache|page)\.(com|org)"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
EBNF_RE = r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)"


@pytest.fixture(scope="module")
def eng(tiny_qwen3: Path) -> h.Engine:
    return h.engine(tiny_qwen3, kv_cache_bytes=1 << 22, max_rows=64)


@pytest.fixture(scope="module")
def grammars(tiny_qwen3: Path, eng: h.Engine) -> GrammarService:
    return GrammarService(str(tiny_qwen3), eng.info.vocab_size, stop_token_ids=list(eng.info.eos_token_ids))


def _compile(svc: GrammarService, kind: str, text: str):  # type: ignore[no-untyped-def]
    return asyncio.run(svc.compile(Constraint(kind, text)))  # type: ignore[arg-type]


def _run(eng: h.Engine, svc: GrammarService, kind: str, text: str, n: int, tok) -> list[str]:  # type: ignore[no-untyped-def]
    compiled = _compile(svc, kind, text)
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    # JSON allows up to 32 whitespace characters per gap, which a random model loves: 600 tokens
    # is above the longest output these grammars allow, so every request must end by the grammar.
    specs = [
        h.Spec(prompt, max_new_tokens=600, ignore_eos=False, temperature=1.0, seed=1000 + i, grammar=compiled.matcher())
        for i in range(n)
    ]
    outs, loop = h.run(eng, specs, LoopConfig(cache="radix", max_running=64))
    assert all(o.finish == "stop" for o in outs), [o.finish for o in outs]
    assert loop.batcher is not None
    loop.batcher.mem.check_idle()
    return [tok.decode(o.ids, skip_special_tokens=True) for o in outs]


def test_json_schema_outputs_validate(eng: h.Engine, grammars: GrammarService, tiny_qwen3: Path) -> None:
    from tests.reference import hf_tokenizer

    texts = _run(eng, grammars, "json_schema", json.dumps(SCHEMA), 60, hf_tokenizer(str(tiny_qwen3)))
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_regex_and_ebnf_outputs_match(eng: h.Engine, grammars: GrammarService, tiny_qwen3: Path) -> None:
    from tests.reference import hf_tokenizer

    tok = hf_tokenizer(str(tiny_qwen3))
    for t in _run(eng, grammars, "regex", REGEX, 30, tok):
        assert re.fullmatch(REGEX, t), t
    for t in _run(eng, grammars, "ebnf", EBNF, 30, tok):
        assert re.fullmatch(EBNF_RE, t), t


@pytest.mark.parametrize(
    ("kind", "text"),
    [("json_schema", "{not json"), ("json_schema", '{"type": "nonsense"}'), ("regex", "a(b"), ("ebnf", "root ::= (")],
)
def test_invalid_grammar_is_invalid_argument(grammars: GrammarService, kind: str, text: str) -> None:
    with pytest.raises(InvalidArgument, match=f"constraint.{kind}"):
        _compile(grammars, kind, text)


def test_grammar_outputs_equal_with_overlap_on_and_off(
    eng: h.Engine, grammars: GrammarService, tiny_qwen3: Path
) -> None:
    from tests.reference import hf_tokenizer

    tok = hf_tokenizer(str(tiny_qwen3))
    compiled = _compile(grammars, "regex", REGEX)
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    outs = {}
    late = {}
    for overlap in (True, False):
        specs = [
            h.Spec(prompt, 64, ignore_eos=False, temperature=1.0, seed=i, grammar=compiled.matcher()) for i in range(8)
        ]
        # Unconstrained neighbours keep overlap busy around the constrained requests.
        specs += [h.Spec(prompt, 20, temperature=1.0, seed=50 + i) for i in range(4)]
        res, loop = h.run(eng, specs, LoopConfig(overlap=overlap))
        outs[overlap] = [o.ids for o in res]
        assert loop.batcher is not None
        late[overlap] = loop.batcher.late_masks_sent
    assert outs[True] == outs[False]
    # With overlap, constrained decodes ran ahead of their masks (the worker waited for them).
    assert late[True] > 0 and late[False] == 0, late


def test_bounded_json_string_refuses_surrogate_bytes(grammars: GrammarService, tiny_qwen3: Path) -> None:
    """ED A9 81 encodes U+DA41, a surrogate: not valid UTF-8, so no JSON string may contain it."""
    from tests.reference import hf_tokenizer

    tok = hf_tokenizer(str(tiny_qwen3))
    m = _compile(grammars, "json_schema", json.dumps(SCHEMA)).matcher()
    for t in tok.encode('{"name": "', add_special_tokens=False):
        assert m.accept(t)
    byte_tokens = tok.convert_tokens_to_ids(["í", "©", "Ł"])  # byte-level BPE spellings of ED A9 81
    assert not all(m.accept(t) for t in byte_tokens)
