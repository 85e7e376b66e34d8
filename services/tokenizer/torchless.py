"""The tokenizer's process runs without torch.

Nothing the tokenizer does needs torch: its tokenizers are the ``tokenizers`` library's, chat
templates are jinja, and grammars (tool calls included) are compiled by the scheduler. But
transformers imports torch whenever it is installed (``AutoTokenizer`` loads the model's config
class, whose module imports torch for rotary embeddings): ~2.7 s of CPU and ~200 MiB of memory
at every start of every tokenizer process. ``hide_torch`` gives the process the view of an
install without torch, a setup transformers supports (tokenizers, configs and files only).
"""

from __future__ import annotations

import os
import sys


def hide_torch() -> None:
    """Make ``import torch`` fail and ``find_spec("torch")`` answer None in this process; call it
    before anything imports transformers. A no-op where torch is already loaded (a test process
    that runs the tokenizer in-process)."""
    if "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" notice
