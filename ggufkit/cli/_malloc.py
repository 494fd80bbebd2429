"""Process-wide allocator tuning for the evaluation commands (``ppl``, ``imatrix``), made by the CLI only.

A forward pass allocates and frees tens of megabytes per layer (dequantized weights, activations). glibc
serves such blocks with fresh ``mmap`` pages and returns them on ``free``, so every pass zero-fills them
again in the kernel: ~10 % of a CPU ``ppl`` run's time as system time. Raising the mmap and trim thresholds
keeps freed blocks in the heap for reuse; they are not given back until the process ends. The cost is a higher
peak where block sizes vary: on a DeepSeek-V3-shaped Q4_K_M model (benchmarks/bench_eval_big.py) one ppl run
peaked at 9.5 GiB with it against 5.6 GiB without, as freed blocks of one size could not serve the next. Without
glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30


def keep_freed_memory() -> None:
    """Ask glibc's malloc to reuse freed large blocks instead of unmapping them (best effort)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not mallopt(_M_MMAP_THRESHOLD, _THRESHOLD):
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc caps the threshold at HEAP_MAX_SIZE / 2 on some versions
    mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
