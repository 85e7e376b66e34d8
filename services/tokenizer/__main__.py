"""``python -m services.tokenizer [flags]``: the tokenizer service in a process without torch
(``services/tokenizer/torchless.py``); what ``strata up`` and ``strata serve tokenizer`` run."""

from services.tokenizer.torchless import hide_torch

hide_torch()

from services.tokenizer.server import main  # noqa: E402  (after hide_torch, which must come first)

main()
