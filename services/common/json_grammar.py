"""What every JSON grammar Strata hands to xgrammar shares: bounded whitespace, valid strings.

The scheduler compiles ``json_schema`` constraints with it (``services/scheduler/grammar.py``),
the scheduler builds tool-call grammars with it (``services/scheduler/tool_grammar.py``).
"""

from __future__ import annotations

import re

# JSON output may use any whitespace, but at most this many characters between two elements:
# enough for pretty-printing a deep document, and it stops a model from looping on whitespace
# forever (a known failure of unbounded `any_whitespace`).
JSON_MAX_WHITESPACE = 32

# xgrammar <= 0.2.8 lowers a string with minLength/maxLength to `X{m,n}` over this one class
# (mlc-ai/xgrammar#800): it admits raw U+0000-U+001F, which JSON forbids in strings (strict
# parsers reject the output), and no escapes. We swap in one JSON character, escapes included;
# once xgrammar emits something else this matches nothing and the grammar is used as is.
# Surrogates (U+D800-U+DFFF) are excluded too: their 3-byte forms are not valid UTF-8, and a
# byte-level vocabulary can spell them (a random model did: ED A9 81 inside a name).
_BOUNDED_STRING_CHAR = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = (
    r'(([^\0-\x1f\"\\\uD800-\uDFFF]) | ("\\" [\"\\/bfnrt]) '
    r'| ("\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
)


def valid_json_strings(ebnf: str) -> str:
    """``ebnf`` (as ``str(xgrammar.Grammar)`` prints it) with length-bounded JSON strings made of
    valid JSON characters."""
    return _BOUNDED_STRING_CHAR.sub(lambda m: f"{m.group(1)} ::= {_JSON_CHAR}", ebnf)
