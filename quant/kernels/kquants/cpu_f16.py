"""F16-input CPU entry point for Q6_K: widen and quantize in one parallel pass.

As :mod:`ggufkit.quant.kernels.legacy.cpu_f16` does for the legacy types: each row is widened
(:func:`ggufkit.quant.kernels.fp.widen_f16_row`, exact) into cache-resident scratch inside the ``prange``
loop and quantized from there by :func:`ggufkit.quant.kernels.kquants.q6k_chunk.q6k_chunk`, so no float32 copy of the whole
tensor is written and read back; the bytes are those of :func:`ggufkit.quant.kernels.kquants.cpu.quantize_rows_q6_K`.
Rows holding inf/NaN are flagged in ``bad_rows`` and left unquantized (the dispatcher raises for them).

Kernel contract (as legacy_f16's): ``quantize_f16_rows_q6_K(h: uint16[n_rows, n], qw: float32[k],
out: uint8[n_rows, row_bytes], bad_rows: uint8[n_rows]) -> None``, ``k == 0`` for no imatrix.
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.quant.kernels.fp import widen_f16_row
from ggufkit.quant.kernels.kquants.cpu import Q6_K_BYTES, QK_K, q6k_quantize_block
from ggufkit.quant.kernels.kquants.q6k_chunk import CHUNK, SCRATCH_ROWS, q6k_chunk


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_f16_rows_q6_K(h: np.ndarray, qw: np.ndarray, out: np.ndarray, bad_rows: np.ndarray) -> None:
    """Q6_K from f16 bits h: uint16[n_rows, n]; bad_rows: uint8[n_rows] out (1: the row holds inf/NaN).

    A parallel step takes enough rows for ``q6k_cpu.CHUNK`` blocks (one row of 16 blocks or more; several
    short rows), so short rows still fill the lanes. A step with an inf/NaN row quantizes nothing (the
    dispatcher raises for the first flagged row).
    """
    n_rows, n = h.shape
    nb = n // QK_K
    use_qw = qw.shape[0] > 0
    g = max(1, CHUNK // nb)  # rows per step
    for it in numba.prange((n_rows + g - 1) // g):
        r0 = it * g
        nr = min(n_rows, r0 + g) - r0
        x = np.empty((nr, n), np.float32)
        n_bad = 0
        for k in range(nr):
            bad_rows[r0 + k] = widen_f16_row(h[r0 + k], x[k])
            n_bad += bad_rows[r0 + k]
        if n_bad:
            continue
        o = out[r0:r0 + nr]
        buf = np.empty(SCRATCH_ROWS * 16 * CHUNK, np.float32)
        lq = np.empty(QK_K * CHUNK, np.uint8)
        bad = np.empty(CHUNK, np.int64)
        total = nr * nb
        for t0 in range(0, total, CHUNK):
            nblk = min(total, t0 + CHUNK) - t0
            q6k_chunk(x, qw, o, t0, nblk, buf, lq, bad)
            for k in range(nblk):
                if bad[k] != 0:  # the scalar block, with ggml's exact nearest_int
                    r = (t0 + k) // nb
                    b = t0 + k - r * nb
                    q6k_quantize_block(x[r, b * QK_K:(b + 1) * QK_K], qw[b * QK_K:(b + 1) * QK_K], use_qw,
                                       o[r, b * Q6_K_BYTES:(b + 1) * Q6_K_BYTES], np.empty(QK_K, np.uint8),
                                       np.empty(16, np.float32), np.empty(64, np.float32))
