"""The worker's memory report (``GetMemory``, the soaks' probe) must not change what it measures:
it finds the tensors frozen at start-up (``settle_heap``) without thawing and refreezing the heap,
which froze for good whatever was alive at that moment (issue #29: under load the worker grew by
tens of KiB per report, the soaks' own probe)."""

from __future__ import annotations

import gc
import weakref

import torch

from services.worker import memory_report


class _Node:
    """A weak-referenceable object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: object = None


def test_frozen_tensors_are_counted_and_a_report_freezes_nothing() -> None:
    weights = torch.ones(1000)
    gc.collect()  # earlier tests' garbage goes first: the counts below compare like with like
    before = gc.get_freeze_count()
    memory_report.remember_frozen()
    gc.freeze()
    try:
        assert gc.get_freeze_count() > before
        counted = memory_report.tensors()
        assert counted.nbytes >= weights.numel() * 4  # found although frozen out of gc.get_objects()

        # A cycle alive during a report (a step's objects, the report's own RPC) is collected
        # once it is garbage: the report froze nothing.
        node = _Node()
        node.other = node
        alive = weakref.ref(node)
        frozen = gc.get_freeze_count()
        memory_report.report()
        # Never more (a report that froze would add the cycle and the report's own objects); one
        # fewer happens, when a frozen object left over from earlier tests is freed meanwhile.
        assert gc.get_freeze_count() <= frozen
        del node
        gc.collect()
        assert alive() is None
        assert memory_report.tensors() == counted  # the frozen tensors are still there, once each
    finally:
        gc.unfreeze()
