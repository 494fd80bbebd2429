"""Dynamic work sharing for the parallel row loops of the grid kernels (IQ1/IQ2/IQ3).

Numba's ``prange`` under its OpenMP threading layer (the default on Linux) splits the iterations into one
contiguous range per thread up front (omppool.cpp ``parallel_for``: ``#pragma omp for`` without a
schedule clause, static in libgomp; ``numba.set_parallel_chunksize`` only makes more, still statically
assigned, pieces). A call therefore lasts as long as its slowest thread: on a machine whose cores are also
running other work, the thread that shares its core waits for it while the other thread, done with its
half, sleeps. llama-quantize hands out chunks of rows from a shared counter instead
(src/llama-quant.cpp ``llama_tensor_quantize_impl``: a mutex-guarded ``counter``), so its threads finish
together.

The loops here do the same: ``prange`` over the threads, each thread taking :data:`CHUNK` blocks at a
time from one shared counter (an atomic add) until none are left. The thread count comes in as an
argument, ``n_workers = workers()`` read by the Python caller (``numba.get_num_threads`` inside a kernel
would make it uncachable); more workers than threads is harmless (a late worker finds nothing left)::

    todo = work_counter(total)
    for _w in numba.prange(n_workers):
        ...  # per-thread scratch
        lo, hi = claim(todo)
        while lo < hi:
            for t in range(lo, hi):
                ...  # block t
            lo, hi = claim(todo)

Which thread quantizes a block does not change its bytes (each block is computed from its own input and
written to its own output), so the output stays the same for every thread count and every run.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

#: Blocks handed out at a time: a grid-type block takes tens of microseconds, so the counter is touched
#: rarely, and a thread's tail is at most this many blocks.
CHUNK = 4


@intrinsic
def _fetch_add(typingctx, counter, value):
    """``counter[0] += value`` as one atomic operation (LLVM ``atomicrmw add``); returns the old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64
            and isinstance(value, types.Integer)):
        return None
    sig = types.int64(counter, types.int64)

    def codegen(context, builder, signature, args):
        arr_ty = signature.args[0]
        arr = context.make_array(arr_ty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_ty, arr, [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, args[1], "monotonic")

    return sig, codegen


@numba.njit(cache=True)
def work_counter(total: int) -> np.ndarray:
    """The shared state of one loop over ``total`` blocks: the next unclaimed block at 0, ``total`` at 1
    (int64[16]: 128 bytes, so little else shares the counter's cache line)."""
    todo = np.zeros(16, np.int64)
    todo[1] = total
    return todo


@numba.njit(cache=True, inline="always")
def claim(todo: np.ndarray) -> tuple[int, int]:
    """The next :data:`CHUNK` blocks ``[lo, hi)`` of the loop; ``lo >= hi`` once everything is handed out."""
    lo = _fetch_add(todo, CHUNK)
    return lo, min(lo + CHUNK, todo[1])


def workers() -> int:
    """The worker count to pass to a kernel: Numba's current thread count."""
    return int(numba.get_num_threads())
