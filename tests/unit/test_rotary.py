"""Rotary cos / sin from the CPU table (services/worker/models/layers.py) equal those computed
per call, bit for bit, before and after the table grows."""

from __future__ import annotations

import torch

from services.worker.models.layers import RotaryEmbedding


def test_the_table_gives_the_computed_cos_and_sin_and_grows_past_its_end() -> None:
    rotary = RotaryEmbedding(head_dim=64, rotary_dim=64, theta=1_000_000.0)
    for positions in ([0, 1, 7, 4095], [3, 9000, 12], [40_000], list(range(100))):
        pos = torch.tensor(positions)
        got = rotary.cos_sin(pos)
        want = rotary._compute(pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), positions
    table = rotary._table
    assert table is not None and table[0].shape == (40_001, 32)  # grown to the position asked for
    assert rotary.cos_sin(torch.empty(0, dtype=torch.int64))[0].shape == (0, 32)
