"""CPU engines: ask glibc's malloc to keep freed memory for reuse.

Every step allocates large temporaries (logits, their softmax, a batch's activations) and frees them. By default
glibc serves blocks past a dynamic threshold (at most 32 MiB) with a fresh mmap, and hands a freed heap top back to
the kernel, so the next step touches new pages and page-faults on every 4 KiB of them. On this project's machines
that costs more than the arithmetic: one softmax over 256 x 4,096 logits 2.7 ms instead of 1.6 ms, filling
[256, 152,000] fp32 logits 88 ms instead of 7 ms (bench/RESULTS.md, session 16). With both thresholds raised to
1 GiB, such blocks come from the heap and stay there once freed (vLLM's CPU guide gets the same by preloading
tcmalloc). The cost: the process keeps up to 1 GiB of freed memory instead of returning it.

Skipped when the user chose for themselves (a MALLOC_*_ setting in the environment, or STREAMER_CPU_MALLOC=0),
and off glibc (another libc, or an allocator such as tcmalloc or jemalloc preloaded, which mallopt does not reach).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to KEEP_BYTES, once per process. True when they are raised."""
    global _applied
    if _applied:
        return True
    if os.environ.get("STREAMER_CPU_MALLOC", "1") == "0" or any(k in os.environ for k in _USER_SETTINGS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or _preloaded_allocator():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    if _applied:
        logger.info("glibc malloc keeps up to %d MiB of freed memory for reuse (STREAMER_CPU_MALLOC=0: off)",
                    KEEP_BYTES >> 20)
    return _applied


def _preloaded_allocator() -> bool:
    preload = os.environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc"))
