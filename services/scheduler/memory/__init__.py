"""The scheduler's view of one worker's memory, composed: see ``core.py`` (the life of a request's
memory), ``factory.py`` (what is composed for which worker) and ``ops.py`` (the order of a step's
cache ops)."""

from services.scheduler.memory.core import Memory, Usage
from services.scheduler.memory.factory import MemoryConfig, build_memory, device_memory
from services.scheduler.memory.host import HiConfig

__all__ = ["HiConfig", "Memory", "MemoryConfig", "Usage", "build_memory", "device_memory"]
