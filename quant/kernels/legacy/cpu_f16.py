"""F16-input CPU entry points for the legacy types: widen and quantize in one parallel pass.

Most checkpoints are F16. Widening a whole slab to float32 first costs one more parallel pass and 3x the
slab's memory traffic (read 2 bytes, write 4, read 4 again); these kernels widen one row at a time into a
cache-resident scratch row inside the same ``prange`` loop, then run the block functions of
:mod:`ggufkit.quant.kernels.legacy.cpu` on it. The widening is exact (:func:`ggufkit.quant.kernels.fp.widen_f16_row`), so the
bytes are those of the float32 kernels. Rows holding inf/NaN are flagged in ``bad_rows`` and left unquantized:
the dispatcher (:func:`ggufkit.quant.quantize`) raises for them.

Kernel contract: ``quantize_f16_rows_<t>(h: uint16[n_rows, n], qw: float32[k], out: uint8[n_rows, row_bytes],
bad_rows: uint8[n_rows]) -> None`` with ``qw`` as in the float32 kernels (``k == 0``: no imatrix).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ggufkit.quant.kernels.fp import widen_f16_row
from ggufkit.quant.kernels.legacy.cpu import (
    QK,
    q4_0_imat_block_cpu,
    q4_0_ref_block,
    q4_1_imat_block_cpu,
    q4_1_ref_block,
    q5_0_imat_block_cpu,
    q5_0_ref_block,
    q5_1_imat_block_cpu,
    q5_1_ref_block,
    q8_0_ref_block,
    row_sigma2,
)
from ggufkit.quant.kernels.legacy.fit import NL, NL3
from ggufkit.quant.kernels.legacy.ref import (
    q4_0_ref_row,
    q4_1_ref_row,
    q5_0_ref_row,
    q5_1_ref_row,
    q8_0_ref_row,
)

_jit = numba.njit(cache=True, fastmath=False, error_model="numpy")
_jit_par = numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)


#: Type codes of :func:`_f16_rows` (each entry point passes a constant, so its branch is resolved per row).
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 0, 1, 2, 3, 4


@_jit_par
def _f16_rows(code: int, h: np.ndarray, qw: np.ndarray, out: np.ndarray,
              bad_rows: np.ndarray) -> None:
    """Widen each row and quantize it with the reference blocks, or the imatrix blocks when qw is given
    (ggml's quantize_q8_0 ignores the imatrix)."""
    nb = h.shape[1] // QK
    use_qw = qw.shape[0] > 0 and code != _Q8_0
    for r in prange(h.shape[0]):
        x = np.empty((1, h.shape[1]), np.float32)
        bad_rows[r] = widen_f16_row(h[r], x[0])
        if bad_rows[r]:
            continue
        o = out[r:r + 1]
        if not use_qw:
            # the vectorized rows of legacy_ref; a block with a degenerate scale goes through the shared block
            xr = x[0]
            o_r = out[r]
            bad = np.zeros(nb, np.uint8)
            if code == _Q8_0:
                any_bad = q8_0_ref_row(xr, o_r, bad)
            elif code == _Q4_0:
                any_bad = q4_0_ref_row(xr, o_r, bad)
            elif code == _Q4_1:
                any_bad = q4_1_ref_row(xr, o_r, bad)
            elif code == _Q5_0:
                any_bad = q5_0_ref_row(xr, o_r, bad)
            else:
                any_bad = q5_1_ref_row(xr, o_r, bad)
            for b in range(nb):
                if not any_bad:
                    break
                if bad[b]:
                    if code == _Q8_0:
                        q8_0_ref_block(x, 0, b, o)
                    elif code == _Q4_0:
                        q4_0_ref_block(x, 0, b, o)
                    elif code == _Q4_1:
                        q4_1_ref_block(x, 0, b, o)
                    elif code == _Q5_0:
                        q5_0_ref_block(x, 0, b, o)
                    else:
                        q5_1_ref_block(x, 0, b, o)
            continue
        w = np.empty(QK, np.float32)
        L = np.empty(QK, np.int32)
        Laux = np.empty(QK, np.int32)
        lanes = np.empty((3, NL), np.float32)
        lanes3 = np.empty((7, NL3), np.float32)
        s2 = row_sigma2(x, 0)
        for b in range(nb):
            # the _0 types pass L twice, as ggml's quantize_row_q4_0_impl has no auxiliary buffer
            if code == _Q4_0:
                q4_0_imat_block_cpu(x, 0, b, qw, s2, w, L, lanes, o)
            elif code == _Q4_1:
                q4_1_imat_block_cpu(x, 0, b, qw, s2, w, L, Laux, lanes3, o)
            elif code == _Q5_0:
                q5_0_imat_block_cpu(x, 0, b, qw, s2, w, L, lanes, o)
            else:
                q5_1_imat_block_cpu(x, 0, b, qw, s2, w, L, Laux, lanes3, o)


# One cacheable entry point per type (the registry names them); the contract is in the module docstring.
@_jit
def quantize_f16_rows_q4_0(h: np.ndarray, qw: np.ndarray, out: np.ndarray,
                           bad_rows: np.ndarray) -> None:
    """Q4_0 from f16 bits h: uint16[n_rows, n]; bad_rows: uint8[n_rows] out."""
    _f16_rows(_Q4_0, h, qw, out, bad_rows)


@_jit
def quantize_f16_rows_q4_1(h: np.ndarray, qw: np.ndarray, out: np.ndarray,
                           bad_rows: np.ndarray) -> None:
    """Q4_1 from f16 bits; arguments as :func:`quantize_f16_rows_q4_0`."""
    _f16_rows(_Q4_1, h, qw, out, bad_rows)


@_jit
def quantize_f16_rows_q5_0(h: np.ndarray, qw: np.ndarray, out: np.ndarray,
                           bad_rows: np.ndarray) -> None:
    """Q5_0 from f16 bits; arguments as :func:`quantize_f16_rows_q4_0`."""
    _f16_rows(_Q5_0, h, qw, out, bad_rows)


@_jit
def quantize_f16_rows_q5_1(h: np.ndarray, qw: np.ndarray, out: np.ndarray,
                           bad_rows: np.ndarray) -> None:
    """Q5_1 from f16 bits; arguments as :func:`quantize_f16_rows_q4_0`."""
    _f16_rows(_Q5_1, h, qw, out, bad_rows)


@_jit
def quantize_f16_rows_q8_0(h: np.ndarray, qw: np.ndarray, out: np.ndarray,
                           bad_rows: np.ndarray) -> None:
    """Q8_0 from f16 bits (qw ignored, as ggml); arguments as :func:`quantize_f16_rows_q4_0`."""
    _f16_rows(_Q8_0, h, qw, out, bad_rows)
