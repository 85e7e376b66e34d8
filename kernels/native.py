"""Native CPU kernels (``kernels/csrc/*.c``), built with the system C compiler and loaded by ctypes.

Torch has no CPU kernel that attends a query to keys scattered over a slot-indexed pool: the torch
path must gather them into a dense copy first, which writes and reads every key and value once more
than the attention itself. ``paged_attend`` reads them in place (``kernels/csrc/paged_decode.c``,
OpenMP over chunks of segments, each slot's K / V row read once for every head and every query
token of its segment: a decode's own range, or a prefix group's shared run for all its decodes).

The library is compiled (fast math in the compile step only, see ``_VARIANTS``) on first use, or
by ``python -m kernels.native``, which ``make install`` runs, into ``kernels/_build/`` (git-ignored;
a temporary folder where that is not writable), named by a hash of the source, the flags, the
compiler and this CPU's feature flags — ``-march=native`` code must never run on another
processor. Without a C compiler, or if the build fails, the launchers report unavailable and the
callers keep the torch path: same results, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SRCS = tuple(
    Path(__file__).with_name("csrc") / name
    for name in ("paged_decode.c", "fused.c", "skinny_linear.c", "gated_delta.c")
)
_COMPILE = ("-O3", "-march=native", "-fopenmp", "-fPIC")
_LINK = ("-shared", "-fopenmp")
# (compile flags, link libraries), tried in order. -ffast-math lets gcc call glibc's vector expf
# (libmvec), but *linking* with it pulls in crtfastmath.o, whose constructor turns on flush-to-zero
# for the process that loads the library: every float would lose its subnormals (hypothesis refuses
# to run then). So fast math is given to the compile step only, never to the link.
_VARIANTS = (
    (("-ffast-math",), ("-lmvec", "-lm")),
    (("-fno-math-errno",), ("-lm",)),
)
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    here = Path(__file__).with_name("_build")
    try:
        here.mkdir(exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "strata-kernels"


def _compile(cc: str, out: Path) -> bool:
    out.parent.mkdir(parents=True, exist_ok=True)
    for flags, libs in _VARIANTS:
        objs = [out.with_suffix(f".{src.stem}.{os.getpid()}.o") for src in _SRCS]
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        steps = [
            *([cc, *_COMPILE, *flags, "-c", "-o", str(obj), str(src)] for src, obj in zip(_SRCS, objs, strict=True)),
            [cc, *_LINK, "-o", str(tmp), *map(str, objs), *libs],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                log.debug("native kernels: %s failed: %s", " ".join(cmd), done.stderr.strip()[:500])
                break
        else:
            for obj in objs:
                obj.unlink(missing_ok=True)
            os.replace(tmp, out)  # atomic: processes building at once never load half a file
            return True
        for obj in objs:
            obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return False


def load() -> ctypes.CDLL | None:
    """The native library, building it if needed; ``None`` (logged once) where it cannot be built."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None or sys.platform != "linux":
            log.warning("native CPU kernels unavailable (no C compiler on linux): attention gathers keys instead")
            return None
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
        flags = [*_COMPILE, *_LINK, *(f for v in _VARIANTS for part in v for f in part)]
        sources = [src.read_text() for src in _SRCS]
        key = hashlib.sha256("\0".join([*sources, *flags, version, _cpu_flags()]).encode()).hexdigest()[:16]
        path = _build_dir() / f"paged_decode-{key}.so"
        if not path.exists() and not _compile(cc, path):
            log.warning("native CPU kernels failed to build with %s: attention gathers keys instead", cc)
            return None
        lib = ctypes.CDLL(str(path))
        if not subnormals_survive():
            log.error("loading %s turned on flush-to-zero for this process; rebuild it without fast math", path)
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        fn = lib.strata_paged_attend_f32
        fn.argtypes = [ptr] * 4 + [i64] + [ptr] * 5 + [i64] * 4 + [f32, ptr, ptr]
        fn.restype = ctypes.c_int
        lib.strata_silu_mul_f32.argtypes = [ptr, ptr, i64]
        lib.strata_add_rms_norm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32]
        lib.strata_rms_norm_rope_f32.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, ptr, i64]
        for name in ("strata_silu_mul_f32", "strata_add_rms_norm_f32", "strata_rms_norm_rope_f32"):
            getattr(lib, name).restype = None
        lib.strata_skinny_linear_f32.argtypes = [ptr] * 4 + [i64] * 3
        lib.strata_skinny_linear_f32.restype = ctypes.c_int
        lib.strata_skinny_linear_pays.argtypes = []
        lib.strata_skinny_linear_pays.restype = ctypes.c_int
        lib.strata_rows_linear_f32.argtypes = [ptr] * 4 + [i64] * 3
        lib.strata_rows_linear_f32.restype = ctypes.c_int
        lib.strata_gated_delta_step_f32.argtypes = [ptr] * 8 + [i64] * 6
        lib.strata_gated_delta_step_f32.restype = ctypes.c_int
        _lib = lib
        return lib


def subnormals_survive() -> bool:
    """False when this thread flushes subnormal floats to zero (what a fast-math library's
    constructor does to the process that loads it)."""
    tiny = float.fromhex("0x1p-1022")  # the smallest normal double
    return tiny / 4 > 0.0


def paged_decode_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and load() is not None


def paged_attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, seg_starts: torch.Tensor,
    seg_ends: torch.Tensor, seg_ptr: torch.Tensor, seg_tokens: torch.Tensor, scale: float, out: torch.Tensor,
    lse: torch.Tensor, causal: torch.Tensor | None = None,
) -> None:
    """Queries over segments of slots read in place, whole or causally (``kernels/csrc/paged_decode.c``).

    ``q [T, Hq, D]``, ``k_cache, v_cache [S, Hkv, D]`` fp32 CPU; ``slots`` int64, any shape,
    contiguous: segment ``s`` reads its flat elements ``seg_starts[s]:seg_ends[s]`` (a concatenation
    of ranges, or the slot table itself with each segment pointing into a row) and is attended by the
    tokens ``seg_tokens[seg_ptr[s]:seg_ptr[s + 1]]`` (indices into ``q``). Writes, for every token
    some segment names, the attention over all its segments' slots into ``out [T, Hq, D]`` and its
    log-sum-exp into ``lse [T, Hq]`` (both fp32); other rows are left as they were. Each range is
    non-empty and inside ``slots`` and every slot ``< S``: the caller's plan guarantees it, nothing
    is checked per slot.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available (see kernels.native)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("lse", lse)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor, got {t.dtype} on {t.device}")
    named = [("slots", slots), ("starts", seg_starts), ("ends", seg_ends), ("seg_ptr", seg_ptr),
             ("seg_tokens", seg_tokens)] + ([("causal", causal)] if causal is not None else [])
    for name, t in named:
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
    tokens, hq, d = q.shape
    hkv = k_cache.shape[1]
    nseg = seg_starts.numel()
    if k_cache.shape[2] != d or hq % hkv or seg_ends.numel() != nseg or seg_ptr.numel() != nseg + 1 \
            or v_cache.shape != k_cache.shape or out.shape != q.shape or lse.shape != q.shape[:2] \
            or (causal is not None and causal.numel() != nseg):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"{nseg} starts, {seg_ends.numel()} ends, {seg_ptr.numel()} segment pointers")
    if nseg == 0:
        return
    rc = lib.strata_paged_attend_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), nseg, seg_starts.data_ptr(),
        seg_ends.data_ptr(), seg_ptr.data_ptr(), seg_tokens.data_ptr(), None if causal is None else causal.data_ptr(),
        tokens, hq, hkv, d, float(scale),
        out.data_ptr(), lse.data_ptr(),
    )
    if rc == -2:
        raise ValueError(f"seg_tokens names a token outside q's {tokens}")
    if rc != 0:
        raise MemoryError("native paged attention could not allocate its scratch buffers")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("native CPU kernels:", "built" if load() is not None else "UNAVAILABLE (torch path will be used)")
