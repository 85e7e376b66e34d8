"""Where the kvstore keeps pages: a byte-capped, LRU-evicting map from key to opaque bytes.

Two backends share one contract (``Backend``): ``MemoryBackend`` keeps pages in process memory;
``FileBackend`` keeps one file per page under a directory and survives restarts. Neither knows
about protobuf or requests.

Accounting: ``used_bytes`` is the sum of the *data* sizes of stored pages. Keys (at most 256
bytes, usually 32) and per-entry bookkeeping are not counted: they are under 1% of a real KV page,
and counting data only keeps ``used_bytes`` equal to what a client stored. Invariant, after every
call: ``used_bytes <= capacity_bytes``.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

from services.common.errors import InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 1
MAX_KEY_BYTES = 256


class PutResult(NamedTuple):
    stored: int  # pages stored, new or replaced
    evicted: int  # pages evicted to make room


@dataclass(frozen=True, slots=True)
class BackendStats:
    used_bytes: int
    capacity_bytes: int
    pages: int
    hits: int
    misses: int
    evictions: int
    backend: str


def check_key(key: bytes, where: str) -> None:
    """Raise InvalidArgument unless ``key`` is 1..256 bytes; ``where`` names it ("key 3")."""
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument(
            f"{where}: key is {len(key)} bytes; keys must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes"
        )


def check_keys(keys: Sequence[bytes]) -> None:
    for i, key in enumerate(keys):
        check_key(key, f"key {i}")


class Backend(ABC):
    """A capacity-bounded, LRU page store.

    Every method is thread-safe (an internal lock guards the index), so a server may call a
    ``blocking`` backend from worker threads. Recency: ``put_many`` and a hit in ``get_many``
    make a page most recently used; ``exists_prefix`` is a probe and changes neither recency nor
    the hit / miss counters, so asking "how much is cached?" never keeps a page alive.
    """

    kind: ClassVar[str]
    # True when calls do disk I/O: an asyncio server should run them off the event loop.
    blocking: ClassVar[bool]

    def __init__(self, capacity_bytes: int, *, max_page_bytes: int | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # Largest page accepted: never more than the whole capacity.
        self.max_page_bytes = min(capacity_bytes, max_page_bytes or capacity_bytes)
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    def _check_pages(self, pages: Sequence[tuple[bytes, bytes]]) -> None:
        """Validate a whole batch before any of it is stored: a batch is refused as a unit."""
        for i, (key, data) in enumerate(pages):
            check_key(key, f"page {i}")
            if len(data) > self.max_page_bytes:
                limit = "capacity" if self.max_page_bytes == self.capacity_bytes else "page limit"
                raise InvalidArgument(
                    f"page {i}: {len(data)} bytes exceeds the store's {limit} of {self.max_page_bytes} bytes"
                )

    def _stats(self, used_bytes: int, pages: int) -> BackendStats:
        return BackendStats(
            used_bytes, self.capacity_bytes, pages, self._hits, self._misses, self._evictions, self.kind
        )

    @abstractmethod
    def put_many(self, pages: Sequence[tuple[bytes, bytes]]) -> PutResult:
        """Store ``(key, data)`` pages in order, replacing existing keys and evicting least
        recently used pages to stay under capacity (a page may evict one stored earlier in the
        same batch when the batch exceeds the capacity). Raises InvalidArgument, storing nothing,
        if any key is not 1..256 bytes or any page exceeds ``max_page_bytes``."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The data of each key in order, None where missing; counts hits and misses."""

    @abstractmethod
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (does not refresh recency or count hits)."""

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many keys, from the first, are present without a gap (0..len(keys))."""
        flags = self.present(keys)
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove the keys; missing keys are ignored. Returns how many were removed."""

    @abstractmethod
    def stats(self) -> BackendStats: ...


class MemoryBackend(Backend):
    """Pages in an OrderedDict, least recently used first. Stores ``bytes`` by reference (no copy)."""

    kind = "memory"
    blocking = False

    def __init__(self, capacity_bytes: int, *, max_page_bytes: int | None = None) -> None:
        super().__init__(capacity_bytes, max_page_bytes=max_page_bytes)
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0

    def put_many(self, pages: Sequence[tuple[bytes, bytes]]) -> PutResult:
        self._check_pages(pages)
        evicted = 0
        with self._lock:
            for key, data in pages:
                # Own immutable bytes: a caller's bytearray must not change a stored page later.
                value = data if type(data) is bytes else bytes(data)
                old = self._pages.pop(key, None)
                if old is not None:
                    self._used -= len(old)
                while self._used + len(value) > self.capacity_bytes:
                    _, victim = self._pages.popitem(last=False)
                    self._used -= len(victim)
                    evicted += 1
                self._pages[key] = value
                self._used += len(value)
            self._evictions += evicted
        return PutResult(stored=len(pages), evicted=evicted)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._pages.get(key)
                if value is None:
                    self._misses += 1
                else:
                    self._hits += 1
                    self._pages.move_to_end(key)
                out.append(value)
        return out

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._pages for key in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                value = self._pages.pop(key, None)
                if value is not None:
                    self._used -= len(value)
                    removed += 1
        return removed

    def stats(self) -> BackendStats:
        with self._lock:
            return self._stats(self._used, len(self._pages))


# One page file: header, key, data. The CRC covers key and data, so a torn or bit-rotted file
# reads as a miss instead of as someone else's KV.
_MAGIC = b"SKV1"
_HEADER = struct.Struct("<4sHQI")  # magic, key length, data length, crc32(key + data)


class FileBackend(Backend):
    """One file per page under ``root/pages``, named by the SHA-256 of the key.

    Writes go to ``root/tmp`` and are renamed into place, so a reader (or a restart) sees a
    whole page or none. Pages are not fsynced: this is a cache, a page lost to a power cut is a
    miss, and the checksum turns a torn file into a miss too. The index (key → size, LRU order)
    lives in memory and is rebuilt from the files' headers at start, oldest mtime first; a hit
    touches the file's mtime so the order survives restarts. Files with a bad header are deleted
    at start; a checksum mismatch is found on read, and the page is deleted and counted as a miss.
    """

    kind = "file"
    blocking = True

    def __init__(self, root: str | Path, capacity_bytes: int, *, max_page_bytes: int | None = None) -> None:
        super().__init__(capacity_bytes, max_page_bytes=max_page_bytes)
        self._root = Path(root)
        self._pages_dir = self._root / "pages"
        self._tmp_dir = self._root / "tmp"
        self._pages_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._used = 0
        self._tmp_seq = 0
        self._rebuild()

    def _path(self, key: bytes) -> Path:
        return self._pages_dir / (hashlib.sha256(key).hexdigest() + ".page")

    def _rebuild(self) -> None:
        for leftover in self._tmp_dir.iterdir():  # writes interrupted by the last shutdown
            leftover.unlink(missing_ok=True)
        found: list[tuple[int, bytes, int]] = []
        for path in self._pages_dir.glob("*.page"):
            entry = self._read_header(path)
            if entry is None:
                log.warning("kvstore: deleting malformed page file %s", path)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime_ns, *entry))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        with self._lock:
            self._evict_to_fit(0)  # the capacity may have been lowered since the last run

    def _read_header(self, path: Path) -> tuple[bytes, int] | None:
        """(key, data size) of a page file, or None if it is not one of ours or is truncated."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return None
                magic, key_len, data_len, _ = _HEADER.unpack(head)
                key = f.read(key_len)
            total = path.stat().st_size
        except OSError:
            return None
        ok = magic == _MAGIC and len(key) == key_len and total == _HEADER.size + key_len + data_len
        return (key, data_len) if ok and path == self._path(key) else None

    def _evict_to_fit(self, incoming: int) -> int:
        """Evict LRU pages until ``incoming`` more bytes fit; the caller holds the lock."""
        evicted = 0
        while self._used + incoming > self.capacity_bytes:
            victim, size = self._index.popitem(last=False)
            self._path(victim).unlink(missing_ok=True)
            self._used -= size
            evicted += 1
        self._evictions += evicted
        return evicted

    def _write_tmp(self, key: bytes, data: bytes) -> Path:
        with self._lock:
            self._tmp_seq += 1
            tmp = self._tmp_dir / f"{os.getpid()}-{self._tmp_seq}.tmp"
        crc = zlib.crc32(data, zlib.crc32(key))
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(key), len(data), crc))
                f.write(key)
                f.write(data)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(f"kvstore disk under {self._root} is full: {e.strerror}") from e
            raise
        return tmp

    def put_many(self, pages: Sequence[tuple[bytes, bytes]]) -> PutResult:
        self._check_pages(pages)
        evicted = 0
        for key, data in pages:
            tmp = self._write_tmp(key, data)  # the slow part, outside the lock
            with self._lock:
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old
                evicted += self._evict_to_fit(len(data))
                try:
                    os.replace(tmp, self._path(key))
                except OSError:
                    # Keep disk and index agreeing: the key's old file is no longer indexed.
                    tmp.unlink(missing_ok=True)
                    self._path(key).unlink(missing_ok=True)
                    raise
                self._index[key] = len(data)
                self._used += len(data)
        return PutResult(stored=len(pages), evicted=evicted)

    def _read(self, key: bytes) -> bytes | None:
        """The page's data, or None if it vanished (evicted meanwhile) or fails its checksum."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                magic, key_len, data_len, crc = _HEADER.unpack(f.read(_HEADER.size))
                stored_key = f.read(key_len)
                data = f.read(data_len)
            os.utime(path)  # recency that survives a restart
        except (OSError, struct.error):
            return None
        whole = magic == _MAGIC and stored_key == key and len(data) == data_len
        if whole and zlib.crc32(data, zlib.crc32(key)) == crc:
            return data
        log.warning("kvstore: page file %s fails its checksum; deleting it", path)
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                path.unlink(missing_ok=True)
        return None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            with self._lock:
                present = key in self._index
                if present:
                    self._index.move_to_end(key)
            value = self._read(key) if present else None
            with self._lock:
                if value is None:
                    self._misses += 1
                else:
                    self._hits += 1
            out.append(value)
        return out

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                size = self._index.pop(key, None)
                if size is not None:
                    self._path(key).unlink(missing_ok=True)
                    self._used -= size
                    removed += 1
        return removed

    def stats(self) -> BackendStats:
        with self._lock:
            return self._stats(self._used, len(self._index))
