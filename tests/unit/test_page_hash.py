"""Chained page hashes: determinism, the prefix property, namespace isolation, whole pages only,
and a pinned vector (the hashes are L3's key format: they must not change by accident)."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.page_hash import (
    HASH_BYTES,
    HashNamespace,
    PageHashChain,
    extend_hashes,
    page_hashes,
    state_key,
)

NS = HashNamespace("fp-tiny", "page-first/L2/H1/D4/float32/P4")
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def test_known_vector() -> None:
    hashes = page_hashes(list(range(10)), 4, NS)
    assert [h.hex() for h in hashes] == [
        "371b8e2e1437c7a6252f3b4e1623a7d41355f7bb1496a8cefa3fc5ed96024a6b",
        "3103f3554d419760571e0141bbfd4a58a524bfe82b3b68b52ef2e417aa2f1572",
    ]
    # The same chain written out from the documented definition.
    h0 = hashlib.sha256(NS.seed + struct.pack("<4I", 0, 1, 2, 3)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert hashes == [h0, h1]


def test_state_keys_follow_their_page_and_layout() -> None:
    h = page_hashes(list(range(8)), 4, NS)
    k = state_key(h[1], "mamba/L1/f32")
    assert len(k) == HASH_BYTES and k not in h
    assert k == state_key(page_hashes(list(range(8)), 4, NS)[1], "mamba/L1/f32")  # deterministic
    assert k != state_key(h[0], "mamba/L1/f32") and k != state_key(h[1], "mamba/L1/bf16")
    with pytest.raises(ValueError, match="32 bytes"):
        state_key(b"short", "mamba/L1/f32")
    with pytest.raises(ValueError, match="state_layout"):
        state_key(h[1], "")


def test_deterministic_and_sized() -> None:
    tokens = [7, 1, 2**32 - 1, 0, 99, 5, 5, 5]
    again = HashNamespace("fp-tiny", "page-first/L2/H1/D4/float32/P4")
    assert page_hashes(tokens, 2, NS) == page_hashes(list(tokens), 2, again)
    assert all(len(h) == HASH_BYTES for h in page_hashes(tokens, 2, NS))


@settings(max_examples=50, deadline=None)
@given(tokens=token_lists, cut=st.integers(0, 200), page_size=st.integers(1, 9))
def test_prefix_property_and_partial_tail_excluded(tokens: list[int], cut: int, page_size: int) -> None:
    full = page_hashes(tokens, page_size, NS)
    assert len(full) == len(tokens) // page_size
    prefix = page_hashes(tokens[:cut], page_size, NS)
    assert prefix == full[: len(prefix)]
    # Tokens after the last whole page do not change any hash.
    assert page_hashes([*tokens, 1, 2, 3][: len(full) * page_size + page_size - 1], page_size, NS) == full


def test_a_changed_token_changes_its_page_and_every_later_one() -> None:
    tokens = list(range(32))
    base = page_hashes(tokens, 8, NS)
    tokens[9] = 1000  # page 1
    changed = page_hashes(tokens, 8, NS)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], changed[1:], strict=True))


@pytest.mark.parametrize(
    "other",
    [
        HashNamespace("fp-other", NS.layout),
        HashNamespace(NS.model_fingerprint, "page-first/L2/H1/D4/bfloat16/P4"),
        HashNamespace(NS.model_fingerprint, NS.layout, tp_rank=1, tp_size=2),
        HashNamespace(NS.model_fingerprint, NS.layout, tp_rank=0, tp_size=2),
        HashNamespace(NS.model_fingerprint, NS.layout, cache_salt="tenant-a"),
    ],
)
def test_namespace_changes_every_hash(other: HashNamespace) -> None:
    tokens = list(range(64))
    mine, theirs = page_hashes(tokens, 4, NS), page_hashes(tokens, 4, other)
    assert not set(mine) & set(theirs)


def test_fields_are_length_prefixed() -> None:
    a = HashNamespace("ab", "c")
    b = HashNamespace("a", "bc")
    assert a.seed != b.seed


@settings(max_examples=50, deadline=None)
@given(tokens=token_lists, chunks=st.lists(st.integers(0, 30), max_size=20), page_size=st.integers(1, 7))
def test_incremental_chain_equals_one_shot(tokens: list[int], chunks: list[int], page_size: int) -> None:
    chain = PageHashChain(NS, page_size)
    pos = 0
    completed: list[bytes] = []
    for n in [*chunks, len(tokens)]:
        completed += chain.extend(tokens[pos : pos + n])
        pos = min(pos + n, len(tokens))
    expected = page_hashes(tokens, page_size, NS)
    assert chain.hashes == completed == expected
    assert chain.num_tokens == len(tokens)
    # Extending from a known parent hashes only the new pages.
    if len(expected) >= 2:
        k = len(expected) // 2
        assert extend_hashes(expected[k - 1], tokens[k * page_size :], page_size) == expected[k:]


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="uint32"):
        page_hashes([1, -1], 1, NS)
    with pytest.raises(ValueError, match="uint32"):
        page_hashes([2**32], 1, NS)
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0, NS)
    with pytest.raises(ValueError, match="tp_rank"):
        HashNamespace("fp", "layout", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="fingerprint"):
        HashNamespace("", "layout")
    with pytest.raises(ValueError, match="32 bytes"):
        extend_hashes(b"short", [1, 2], 1)
