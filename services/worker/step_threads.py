"""How many threads a CPU forward runs on: one, when its work is too small to pay for the rest.

A forward enters dozens of parallel regions (every GEMM, the attention, the elementwise chains).
Each region's team has to wake, split the work and meet again; when the work of the whole step is
a few tens of MFLOPs (a one-layer model's 256 decodes), the second thread saves no time and costs
CPU, and on a host whose cores the front and the scheduler share, the team waits for a thread the
OS has given to them. Measured on the 2-core VM (docs/benchmarks.md): the null model's control
plane at 256 streams went from 54-65 to 35-43 µs of worker CPU per token on one thread.

A step that streams its weights from memory is another matter: a bench-size model's one decode
does ~60 MFLOPs but reads 118 MB of weights, and two threads read them faster than one (served
one-stream decode: 15 ms a token on two threads, 22 ms on one). So the estimate (``StepCost``)
counts what the step must do from the model's shapes: the FLOPs of its linear layers per new
token, of its LM head per row of logits and of attention per (query, key) pair, plus
``BYTE_FLOPS`` per byte of the weights it multiplies with (read once per step). Below
``serial_below`` the step runs on one thread, otherwise on all (``torch.set_num_threads``, which
sets MKL's threads and the OpenMP team of the calling thread, and so the native kernels').
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import nn

from services.worker.batch import BatchInput

# Reading a byte of weights from memory on one core takes about as long as 10 FLOPs of a GEMM
# (~10 GB/s against ~100 GFLOP/s on the 2-core VM).
BYTE_FLOPS = 10


@dataclass(frozen=True, slots=True)
class StepCost:
    """The work of a forward in FLOPs, from the model's shapes (a lower bound: norms, rotary,
    recurrent state updates, the K/V read and stacked expert weights are left out)."""

    token: int  # per new token: 2 × the weights of every linear layer but the LM head
    logit: int  # per row of logits: 2 × the LM head's weights
    pair: int  # per (query, key) pair: 4 × query heads × head_dim × full-attention layers
    body_read: int  # per step: BYTE_FLOPS × the bytes of those linear layers' weights
    head_read: int  # per step with logits: BYTE_FLOPS × the LM head's bytes

    @classmethod
    def of(cls, model: nn.Module, q_heads: int, head_dim: int, attention_layers: int) -> StepCost:
        """``q_heads``: this rank's query heads (its shard under tensor parallelism)."""
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        body = [p for p in model.parameters() if p.dim() == 2 and p is not head and id(p) not in embeddings]
        head_size = 0 if head is None else head.numel()
        return cls(
            token=2 * sum(p.numel() for p in body),
            logit=2 * head_size,
            pair=4 * q_heads * head_dim * attention_layers,
            body_read=BYTE_FLOPS * sum(p.numel() * p.element_size() for p in body),
            head_read=0 if head is None else BYTE_FLOPS * head_size * head.element_size(),
        )

    def flops(self, inp: BatchInput, cap: int) -> int:
        """The step's work, or any figure >= ``cap`` once it is clear that it reaches it."""
        lens = list(map(len, inp.input_ids))
        logits = sum(inp.want_logits)
        work = sum(lens) * self.token + self.body_read + (logits * self.logit + self.head_read if logits else 0)
        if work >= cap:
            return work
        # Each new token attends to the cached tokens before its chunk and causally within it.
        pairs = sum(map(operator.mul, inp.start_pos, lens)) + sum(n * (n + 1) // 2 for n in lens)
        return work + pairs * self.pair


class StepThreads:
    """Sets the calling thread's intra-op threads before each forward: 1 below ``serial_below``
    (``StepCost.flops``), ``threads`` from there on. Changes only when the choice does."""

    def __init__(self, cost: StepCost, threads: int, serial_below: int) -> None:
        self.cost = cost
        self.threads = threads
        self.serial_below = serial_below
        self.serial_steps = 0  # forwards run on one thread so far
        self._now = 0  # the count set last; 0 = none set yet

    def fit(self, inp: BatchInput) -> int:
        """Set the threads for the forward of ``inp``; returns the count."""
        want = self.threads
        if self.threads > 1 and self.cost.flops(inp, self.serial_below) < self.serial_below:
            want = 1
            self.serial_steps += 1
        if want != self._now:
            torch.set_num_threads(want)
            self._now = want
        return want
