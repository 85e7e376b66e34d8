"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and merges (a byte-level BPE token may hold
half a UTF-8 character), so the detokenizer decodes a short window of recent ids and emits only
text that is complete (no trailing U+FFFD). Stop strings may straddle chunks, so text that could
still become the start of a stop string is held back until it cannot.

With the Rust tokenizer at hand (``backend``), the window is the ``tokenizers`` library's own
``DecodeStream``: the same prefix / read-offset method in one call per chunk instead of two decodes
and the slicing in Python (0.6 against 4.2 µs a token here, at one token a chunk). ``decode`` still
serves the end of a stream (``flush``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

Decode = Callable[[Sequence[int]], str]

# Ids kept before the read offset: enough context for merges and byte fallback to decode right.
_CONTEXT_IDS = 6


@dataclass(frozen=True, slots=True)
class Chunk:
    text: str  # new text safe to show
    stopped: bool  # a stop string was found; text ends right before it


class IncrementalDetokenizer:
    """Feed ids as they arrive; get text once it is final."""

    def __init__(
        self,
        decode: Decode,
        stop: Sequence[str] = (),
        prompt_tail: Sequence[int] = (),
        backend: Tokenizer | None = None,
    ) -> None:
        """``decode``: ids to text, special tokens skipped. ``backend``: the Rust tokenizer that
        ``decode`` runs (then a ``DecodeStream`` keeps the window); ``None`` for any other."""
        self._decode = decode
        self._ids: list[int] = list(prompt_tail[-_CONTEXT_IDS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stream = None if backend is None else (DecodeStream(self._primer(), skip_special_tokens=True), backend)
        self._stop = tuple(stop)
        self._pending = ""  # decoded but not yet released (could start a stop string)
        self.text = ""  # everything released so far
        self.stopped = False

    def _primer(self) -> list[int]:
        """The prompt tail the ``DecodeStream`` starts from, without the ids of a character the
        prompt leaves unfinished: given a prefill whose text ends in U+FFFD, the stream keeps no
        prefix and would release the whole tail again with the first token. The echoed prompt
        already shows those ids (as U+FFFD), as a whole decode does."""
        ids = list(self._ids)
        while ids and self._decode(ids).endswith("\ufffd"):
            ids.pop()
        return ids

    def _complete_text(self, ids: Sequence[int]) -> str:
        """New complete text since the last call (``ids`` just appended), advancing the window."""
        if self._stream is not None:
            stream, backend = self._stream
            new = stream.step(backend, list(ids))
            if not new:
                return ""
        else:
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return ""
            new = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset - _CONTEXT_IDS, self._prefix_offset)
        self._read_offset = len(self._ids)
        return new

    def feed(self, ids: Sequence[int]) -> Chunk:
        if self.stopped:
            return Chunk("", True)
        self._ids.extend(ids)
        self._pending += self._complete_text(ids)
        return self._release(final=False)

    def flush(self) -> Chunk:
        """Generation ended: release everything held back (stop strings cannot complete now),
        the text of ids still waiting to complete a character included — as a whole decode
        would show it, with U+FFFD for an unfinished character."""
        if self.stopped:
            return Chunk("", True)
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self._pending += full[len(prefix) :]
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> Chunk:
        if self._stop:
            # Any text that could begin a stop string is still pending, so searching it suffices.
            hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
            if hits:
                out = self._pending[: min(hits)]
                self.text += out
                self._pending = ""
                self.stopped = True
                return Chunk(out, True)
        if final or not self._stop:
            out, self._pending = self._pending, ""
        else:
            keep = self._holdback(self._pending)
            out, self._pending = (
                self._pending[: len(self._pending) - keep],
                self._pending[len(self._pending) - keep :],
            )
        self.text += out
        return Chunk(out, False)

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
