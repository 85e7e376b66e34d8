"""Tool calls out of a model's answer text (``--tool-call-parser``), incrementally.

Two formats, as Qwen3 models write them:

- ``hermes`` (Qwen3, Qwen3-Next)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``qwen3_coder`` (Qwen3-Coder)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

A parser is fed the answer's text in order and returns what became final: content (text outside
calls) and ``ToolCallDelta``s — a call's id and name first, then fragments of its arguments, as
OpenAI streams ``delta.tool_calls``. A whole answer is the same parser fed once, so the streamed
fragments of a call always join to the arguments of the non-streamed call.

The arguments of a ``hermes`` call are the model's own JSON text for the value of ``"arguments"``,
byte for byte (streamed as it arrives); those of a ``qwen3_coder`` call are a JSON object built from
its parameters, each value converted by the type its tool's schema gives (streamed a parameter at a
time). Text that could still become a tag is held back, and so is the whitespace around calls,
which is dropped. A ``<tool_call>`` block that cannot be read as a call stays in the content as
written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from services.tokenizer.hermes_parser import HermesParser
from services.tokenizer.qwen3_coder_parser import Qwen3CoderParser
from services.tokenizer.tool_blocks import Parsed, ToolCallDelta, ToolParser

__all__ = ["Parsed", "ToolCallDelta", "ToolFormat", "ToolParser", "make_parser"]

ToolFormat = Literal["hermes", "qwen3_coder"]


def make_parser(fmt: ToolFormat, schemas: Mapping[str, Mapping[str, Any]]) -> ToolParser:
    """``schemas``: each tool's parameters schema by name (``qwen3_coder`` types values by it)."""
    return HermesParser() if fmt == "hermes" else Qwen3CoderParser(schemas)
