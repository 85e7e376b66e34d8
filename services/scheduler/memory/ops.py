"""The order of a step's cache ops, decided here and only here.

The worker runs a step's ops one after another, in list order, before the step's forward; every op
and forward runs in step order. That order is what keeps the pools correct without any lock on the
worker: an op that reads or overwrites a slot is always placed after the op or forward that
produced what it must see, and before the first one that may overwrite it.

    0. evicted copies     write_back: device pages and states the tree evicted while this step was
                          planned are copied to the host before anything can overwrite them
                          (a load, a copy, the forward) or release them (a shrink)
    1. pool resizes       later ops and this step's inputs may use a grown pool (a shrink is only
                          sent once nothing above the new size is held, so nothing below reads it)
    2. fork copies        working state -> fork, planned with the *previous* step: that step's
                          forward brought the working state to the checkpoint; this step's forward
                          moves it on, so the copy must come before it
    3. host ops           loads, backups, L3 puts and gets. After the forks, because a backup may
                          read a fork the tree just took (a checkpoint is backed up once it holds
                          its state); before the state copies and the forward, because those read
                          what a load brought back
    4. state copies       this plan's copy-on-write from matched (maybe just loaded) states into
                          working states, and resets of fresh working states
    5. row releases       rows of requests that ended; nothing later in the step reads them
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.step import CacheOp


def step_ops(
    evicted: Sequence[CacheOp],
    resize: Sequence[CacheOp],
    forks: Sequence[CacheOp],
    host: Sequence[CacheOp],
    states: Sequence[CacheOp],
    rows: Sequence[CacheOp],
) -> list[CacheOp]:
    """One step's ops in the order the module docstring explains."""
    return [*evicted, *resize, *forks, *host, *states, *rows]
