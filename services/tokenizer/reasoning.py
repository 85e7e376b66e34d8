"""Qwen3's reasoning split (``--reasoning-parser qwen3``): the ``<think>…</think>`` block that opens
an answer becomes ``reasoning_content``, the rest ``content``.

The parser is incremental — text arrives as the detokenizer releases it — and the whole-answer
split is the same parser fed once, so a streamed answer joins to exactly what a non-streamed one
returns. Text that could still turn into a tag (``</thi``) and whitespace that would be trimmed
(the newlines around the block) are held back until the next text decides.

Rules, in order:

- leading whitespace then ``<think>`` opens the block; anything else first means there is no block
  and the whole answer is content, unchanged;
- a prompt that already opened the block (``reasoning_open``) starts inside it;
- ``</think>`` closes it; the reasoning is trimmed of the whitespace at both ends, and the
  whitespace after the close tag is dropped;
- an answer that ends inside the block (cut by ``max_tokens``) is all reasoning.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ReasoningFormat = Literal["none", "qwen3"]


class Split(NamedTuple):
    reasoning: str
    content: str


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (templates that start the answer's
    reasoning themselves, such as Qwen3-2507's thinking models)."""
    opened = prompt.rfind(THINK_OPEN)
    return opened >= 0 and prompt.find(THINK_CLOSE, opened) < 0


def prompt_closes_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends right after a closed think block (``enable_thinking=false``):
    the answer has no reasoning."""
    return prompt.rstrip().endswith(THINK_CLOSE)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Splits one answer; feed its text in order, then ``finish``. Not thread-safe."""

    __slots__ = ("_buf", "_started", "_state")

    def __init__(self, reasoning_open: bool = False) -> None:
        # start: before the answer's first visible text; think: inside the block; after: between
        # </think> and the content; content: everything passes through.
        self._state: Literal["start", "think", "after", "content"] = "think" if reasoning_open else "start"
        self._buf = ""  # text held back
        self._started = False  # reasoning text released (its leading whitespace is trimmed until then)

    @property
    def in_content(self) -> bool:
        """Past the reasoning (or there was none): all further text is content, as it comes."""
        return self._state == "content"

    def feed(self, text: str) -> Split:
        if self._state == "content":
            return Split("", text)
        self._buf += text
        reasoning, content = [], []
        while True:
            buf = self._buf
            if self._state == "start":
                head = buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self._state, self._buf = "think", head[len(THINK_OPEN) :]
                    continue
                if THINK_OPEN.startswith(head):  # nothing visible yet, or part of the tag: wait
                    break
                self._state, self._buf = "content", ""
                content.append(buf)
            elif self._state == "think":
                if not self._started:
                    buf = buf.lstrip()
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(buf[:end].rstrip())
                    self._state, self._buf = "after", buf[end + len(THINK_CLOSE) :]
                    continue
                # Hold a partial close tag and the whitespace before it (trimmed if the block ends).
                keep = len(buf[: len(buf) - partial_suffix(buf, THINK_CLOSE)].rstrip())
                reasoning.append(buf[:keep])
                self._buf = buf[keep:]
                self._started = self._started or keep > 0
            else:  # after
                head = buf.lstrip()
                self._buf = ""
                if head:
                    self._state = "content"
                    content.append(head)
            break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """The answer ended: release what was held back."""
        state, buf = self._state, self._buf
        self._buf = ""
        if state == "start":
            self._state = "content"
            return Split("", buf)
        if state == "think":
            return Split(buf.rstrip(), "")
        return Split("", "")
