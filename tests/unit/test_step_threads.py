"""The threads a CPU forward runs on (services/worker/step_threads.py): the work estimate from a
model's shapes, counted by hand, and the switch it drives."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from services.worker.batch import BatchInput
from services.worker.step_threads import BYTE_FLOPS, StepCost, StepThreads


class _Lm(nn.Module):
    """An embedding of 10 × 4, two linear layers (4 → 6 with a bias, 6 → 4) and an LM head 4 → 10."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4, bias=False)
        self.norm = nn.LayerNorm(4)  # 1-D weights: not a product
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


def _batch(starts: list[int], lens: list[int], logits: list[int]) -> BatchInput:
    ids = [[1] * n for n in lens]
    return BatchInput(list(range(len(lens))), starts, ids, ids, None, logits)


@pytest.mark.parametrize("tied", [False, True])
def test_the_cost_counts_the_linear_layers_the_head_and_attention(tied: bool) -> None:
    cost = StepCost.of(_Lm(tied), q_heads=3, head_dim=8, attention_layers=2)
    body = 4 * 6 + 6 * 4  # the two products' weights; the embedding, the bias and the norm are not
    assert cost == StepCost(
        token=2 * body, logit=2 * 40, pair=4 * 3 * 8 * 2, body_read=BYTE_FLOPS * 4 * body, head_read=BYTE_FLOPS * 4 * 40
    )
    # Two decodes after 5 and 9 cached tokens, and a chunk of 3 new tokens after 2 cached: 5 new
    # tokens; attention pairs 6 + 10 + (3 × 2 + 1 + 2 + 3); logits for the decodes and the chunk's last.
    work = cost.flops(_batch([5, 9, 2], [1, 1, 3], [1, 1, 1]), cap=1 << 40)
    assert work == 5 * cost.token + cost.body_read + 3 * cost.logit + cost.head_read + (6 + 10 + 12) * cost.pair
    # A chunk that samples nothing (a prompt's first chunk of several) does not read the head.
    assert cost.flops(_batch([0], [4], [0]), cap=1 << 40) == 4 * cost.token + cost.body_read + 10 * cost.pair
    # Past the cap the attention is not counted: any figure at or above it will do.
    assert cost.flops(_batch([1000], [1], [1]), cap=1) >= 1


@pytest.fixture
def threads() -> Iterator[int]:
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_small_steps_run_on_one_thread_and_large_ones_on_all(threads: int) -> None:
    cost = StepCost(token=1000, logit=0, pair=0, body_read=0, head_read=0)
    switch = StepThreads(cost, threads=2, serial_below=10_000)
    assert switch.fit(_batch([0] * 9, [1] * 9, [1] * 9)) == 1  # 9,000 < 10,000
    assert torch.get_num_threads() == 1
    assert switch.fit(_batch([0] * 10, [1] * 10, [1] * 10)) == 2  # 10,000: all threads
    assert torch.get_num_threads() == 2
    assert switch.serial_steps == 1
    # One thread to begin with: nothing to save.
    alone = StepThreads(cost, threads=1, serial_below=10_000)
    assert alone.fit(_batch([0], [1], [1])) == 1
    assert alone.serial_steps == 0
