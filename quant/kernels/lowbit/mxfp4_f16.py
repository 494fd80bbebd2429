"""F16-input CPU entry point for MXFP4: widen and quantize in one parallel pass (as
:mod:`ggufkit.quant.kernels.legacy.cpu_f16` does for the legacy types; same kernel contract).

MXFP4's own work per weight is a few compares, so a separate widening pass (read 2 bytes, write 4, read 4
again) was a large share of an F16 tensor's time. Each row is widened exactly (:func:`ggufkit.quant.kernels.fp.widen_f16_row`)
into a scratch row and quantized by :func:`ggufkit.quant.kernels.lowbit.mxfp4.quantize_row_mxfp4`, so the bytes are the float32
kernel's. ``qw`` is ignored, as ggml ignores the imatrix for MXFP4.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ggufkit.quant.kernels.fp import widen_f16_row
from ggufkit.quant.kernels.lowbit.mxfp4 import QK_MXFP4, quantize_row_mxfp4


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def quantize_f16_rows_mxfp4(h: np.ndarray, qw: np.ndarray, out: np.ndarray, bad_rows: np.ndarray) -> None:
    """MXFP4 from f16 bits ``h`` uint16[n_rows, n]; rows with inf/NaN are flagged in ``bad_rows`` uint8[n_rows]
    and left unquantized (the dispatcher raises for them)."""
    n = h.shape[1]
    for r in prange(h.shape[0]):
        x = np.empty(n, np.float32)
        bad_rows[r] = widen_f16_row(h[r], x)
        if not bad_rows[r]:
            quantize_row_mxfp4(x, out[r], np.empty(n // QK_MXFP4, np.int32))
