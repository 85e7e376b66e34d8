"""What the tool-call parsers share (``tool_parsers.py`` describes the formats): the deltas they
return, and ``BlockParser``, which releases the content outside ``<tool_call>`` blocks and leaves
the inside of a block to the format."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol

from services.tokenizer.reasoning import partial_suffix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of the ``index``-th call: its first delta has ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(Protocol):
    """Feed an answer's text in order, then ``finish`` once; each returns what became final."""

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class BlockParser:
    """What both formats share: content outside ``<tool_call>`` blocks, with the whitespace around
    blocks dropped and a partial open tag held back; subclasses read the inside of a block."""

    def __init__(self, opens: tuple[str, ...] = (CALL_OPEN,)) -> None:
        self._opens = opens
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace right after a call is dropped
        self._calls = 0

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step_call(out) if self._in_call else self._step_text(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:
            self._end_call(out, closed=False)
        elif not self._after_call:
            out.content += self._buf.rstrip() if self._calls else self._buf
        self._buf = ""
        return out

    # -- text between calls ---------------------------------------------------------------------
    def _step_text(self, out: Parsed) -> bool:
        """Release content up to the next call; True if a call started."""
        buf = self._buf
        if self._after_call:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._after_call = False
        starts = [(i, tag) for tag in self._opens if (i := buf.find(tag)) >= 0]
        if starts:
            i, tag = min(starts)
            out.content += buf[:i].rstrip()
            self._buf = buf[i + len(tag) :]
            self._in_call = True
            self._begin_call(tag)
            return True
        hold = max(partial_suffix(buf, tag) for tag in self._opens)
        keep = len(buf[: len(buf) - hold].rstrip())  # trailing whitespace may precede a call
        out.content += buf[:keep]
        self._buf = buf[keep:]
        return False

    # -- inside a call --------------------------------------------------------------------------
    def _begin_call(self, tag: str) -> None:
        """A call opened with ``tag`` (consumed from the buffer)."""
        raise NotImplementedError

    def _step_call(self, out: Parsed) -> bool:
        """Read what ``self._buf`` holds of the current call; True once it closed."""
        raise NotImplementedError

    def _end_call(self, out: Parsed, closed: bool) -> None:
        """The call ended (``closed``: by its close tag; else the answer ended inside it)."""
        raise NotImplementedError

    def _close(self, rest: str, called: bool = True) -> None:
        """The block ended; ``rest`` is the text after it (whose leading whitespace is dropped if
        the block was a call)."""
        self._in_call, self._after_call, self._buf = False, called, rest

    def _not_a_call(self, out: Parsed, tag: str) -> bool:
        """The block is not a call: its open tag is content, and the text after it is read again."""
        out.content += tag
        self._in_call = False
        return True
