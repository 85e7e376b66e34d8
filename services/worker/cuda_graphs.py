"""CUDA graphs for decode steps: a step's kernel launches recorded once per batch size and replayed.

On a GPU a decode step of a small model is bound by the host, not the device: on an H100 (bf16,
1k tokens of KV per request) a step of the bench model kept the GPU busy 0.4-0.6 ms of its 6 ms,
one of the 0.6B-shaped model 1.7 ms of 27 ms, the rest being Python and some 140-480 kernel
launches of 12-80 µs of host time each (docs/benchmarks.md, "GPU"). A graph replays all of them in
one launch.

Which forwards: a pure decode (one new token and one logit per request: no drafts, no prompt
logprobs), on a model without Mamba state, whose attention plan is empty (the flat decode kernel:
``TritonAttention`` when no prefix group formed), with at most ``max_batch`` requests. Everything
else runs eagerly, as before.

Buckets: a batch of ``n`` runs the graph of the smallest bucket ``>= n`` (``buckets``), recorded the
first time a batch needs it, on the step that needs it. The rows past ``n`` are padding: input id
0 at position 0, attending to the first request's first slot (``seq_len`` 1, so any pool size
keeps it in bounds), with KV slot -1, which ``kernels.kv_store`` drops. Their logits are cut off.

Static buffers: the graph reads its inputs from one ``[5, max_batch]`` int64 tensor (ids,
positions, slots, rows, seq_lens) and writes its logits into one ``[max_batch, vocab]`` tensor; every
bucket's graph is a view of them, and the graphs share one memory pool. The KV pool, the slot table
and the weights never move (elastic resizes keep every address), so a recorded graph stays valid.

Results equal the eager forward up to rounding: the padded batch may take other GEMM and split
choices than the batch alone (greedy output and the fp32 bars of the tests are unchanged).

``capture``: how a bucket's forward becomes a replay. ``cuda_capture`` records a CUDA graph; the
CPU tests pass ``eager_capture``, which replays by calling the forward again on the same static
buffers, so every part but the recording itself (buckets, padding, dropped slots, views) is tested
against transformers where no GPU is.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.worker.attention import NO_META
from services.worker.batch import BatchInput, ForwardBatch, ForwardContext

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from services.worker.models.registry import CausalLM

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]

# The buckets' sizes: powers of two to 8, then 12, steps of 8 to 64, of 16 to 128, of 32 to 256 and
# of 64 beyond: a batch pads by at most 3 rows or a third of its bucket.
_SMALL = (1, 2, 4, 8, 12)
_FIELDS = 5  # ids, positions, slots, rows, seq_lens


def buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes that get a graph, up to and including ``max_batch``."""
    sizes = [b for b in _SMALL if b < max_batch]
    for start, stop, step in ((16, 64, 8), (64, 128, 16), (128, 256, 32), (256, max_batch, 64)):
        sizes += range(start, min(stop, max_batch), step)
    return (*sorted(set(sizes)), max_batch)


def cuda_capture(pool: _POOL_HANDLE) -> Capture:
    """Record ``forward`` as a CUDA graph in ``pool`` (``torch.cuda.graph_pool_handle()``), after
    two eager runs on a side stream (Triton compiles and autotunes there, allocations settle). The
    eager runs write this step's KV, the same values the replay writes again."""

    def capture(forward: Callable[[], torch.Tensor]) -> Replay:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the host tier's copies may run on another thread while this one records.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def eager_capture(forward: Callable[[], torch.Tensor]) -> Replay:
    """No recording: each replay runs ``forward`` again (the CPU tests of everything else)."""
    return forward


class DecodeGraphs:
    """The engine's decode graphs (module docstring). Not thread-safe, like the engine."""

    def __init__(
        self, model: CausalLM, ctx: ForwardContext, device: torch.device, max_batch: int, capture: Capture
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"DecodeGraphs.max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.ctx = ctx
        self.max_batch = max_batch
        self.buckets = buckets(max_batch)
        self._capture = capture
        self._inputs = torch.zeros((_FIELDS, max_batch), dtype=torch.int64, device=device)
        self._ones = torch.ones(max_batch, dtype=torch.int64, device=device)
        self._arange = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self._logits: torch.Tensor | None = None  # [max_batch, vocab], made by the first recording
        self._replays: dict[int, Replay] = {}
        self.replays = 0  # forwards served by a graph (metrics, tests)

    def fits(self, inp: BatchInput) -> bool:
        """Whether this forward is one the graphs serve (before its attention is planned)."""
        n = len(inp.rows)
        return (
            0 < n <= self.max_batch
            and inp.mamba_slots is None
            and all(w == 1 for w in inp.want_logits)
            and all(len(ids) == 1 for ids in inp.input_ids)
        )

    def run(self, inp: BatchInput) -> torch.Tensor:
        """The logits ``[n, vocab]`` of a batch that ``fits`` and whose attention plan is empty: the
        padded bucket's graph replayed (recorded first if this is its first batch). A view of the
        static output, valid until the next replay."""
        n = len(inp.rows)
        size = self.buckets[bisect.bisect_left(self.buckets, n)]
        pad = size - n
        row0 = inp.rows[0]
        host = array("q", [ids[0] for ids in inp.input_ids])
        host.extend([0] * pad)
        host.extend(inp.start_pos)
        host.extend([0] * pad)
        host.extend(slots[0] for slots in inp.out_slots)
        host.extend([-1] * pad)
        host.extend(inp.rows)
        host.extend([row0] * pad)
        host.extend(s + 1 for s in inp.start_pos)
        host.extend([1] * pad)
        self._inputs[:, :size].copy_(torch.frombuffer(host, dtype=torch.int64).view(_FIELDS, size))
        replay = self._replays.get(size)
        if replay is None:
            replay = self._replays[size] = self._capture(self._forward(size))
        self.replays += 1
        return replay()[:n]

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a ``size``-row decode over views of the static buffers."""
        ids, positions, slots, rows, seq_lens = self._inputs[:, :size]
        ones = self._ones[:size]
        batch = ForwardBatch(
            input_ids=ids, positions=positions, out_slots=slots, rows=rows, start_pos=positions, extend_lens=ones,
            seq_lens=seq_lens, cu_seqlens=self._arange[: size + 1], logit_index=self._arange[:size], mamba_slots=None,
            start_pos_list=[0] * size, extend_lens_list=[1] * size, attn=NO_META, padded=True,
        )  # fmt: skip

        def forward() -> torch.Tensor:
            logits = self.model.forward(batch, self.ctx)
            if self._logits is None:
                self._logits = torch.empty((self.max_batch, logits.shape[1]), dtype=logits.dtype, device=logits.device)
            out = self._logits[:size]
            out.copy_(logits)
            return out

        return forward
