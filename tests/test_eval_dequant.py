"""The evaluator's torch dequantization equals gguf-py's (and ggml's) bit for bit, for every supported type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_oracle import ggml_dequantize, ggml_quantize, ggml_requires_imatrix
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from ggufkit.errors import EvaluationError
from ggufkit.eval.dequant import DEQUANTIZERS, dequantize
from ggufkit.quant.registry import KERNELS

#: Every block type: torch kernels where the evaluator has one, the quantizer's Numba dequantizer for the rest.
BLOCK_TYPES = sorted({t for t in DEQUANTIZERS if t not in (Q.F32, Q.F16, Q.BF16)} | set(KERNELS), key=int)
#: Types gguf-py 0.19.0 cannot dequantize: compared with ggml's to_float only.
NO_GGUF_PY = {Q.Q1_0}
#: Byte offsets of the f16 scales in a block, where not (0,) (MXFP4 has none: its byte 1 is quants).
#: IQ1_M spreads its f16 scale over the top nibbles of scales[] (bytes 48..55): masking byte 55 (offset 54 + 1)
#: clears the sign and the top exponent bit.
F16_OFFSETS = {Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.IQ1_M: (54,)}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_every_type_the_issue_names_has_a_kernel() -> None:
    wanted = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert wanted <= set(DEQUANTIZERS)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_blocks_from_ggmls_quantizer_dequantize_exactly_as_gguf_py_and_ggml(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 10, (6, 1)).astype(np.float32)
    x[0] = 0.0  # an all-zero row
    x[1, 1:] = 0.0  # one non-zero value
    # the grid types need an importance matrix in ggml: a constant one
    raw = ggml_quantize(x, qtype, np.ones(512, np.float32) if ggml_requires_imatrix(qtype) else None)
    got = dequantize(torch.from_numpy(raw), qtype, 512).numpy()
    if qtype not in NO_GGUF_PY:
        np.testing.assert_array_equal(_bits(got), _bits(gguf_dequantize(raw, qtype)))
    np.testing.assert_array_equal(_bits(got), _bits(ggml_dequantize(raw, qtype, (6, 512))))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_bytes_cover_every_bit_pattern_and_still_match_gguf_py(qtype: Q) -> None:
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(100 + int(qtype))
    raw = rng.integers(0, 256, (64, 2 * size), dtype=np.uint8)
    # Keep the f16 scales finite so that NaN payloads do not depend on the operation order.
    for off in F16_OFFSETS.get(qtype, (0, 2) if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K) else (0,)):
        for b in range(2):
            raw[:, b * size + off + 1] &= 0x3B
    with np.errstate(all="ignore"):
        want = (ggml_dequantize(raw, qtype, (64, 2 * block)) if qtype in NO_GGUF_PY
                else gguf_dequantize(raw, qtype))
    got = dequantize(torch.from_numpy(raw), qtype, 2 * block).numpy()
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_types_widen_exactly(qtype: Q) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    raw = ggml_quantize(x, qtype)
    got = dequantize(torch.from_numpy(raw), qtype, 64).numpy()
    np.testing.assert_array_equal(_bits(got), _bits(gguf_dequantize(raw, qtype)))


def test_an_unsupported_type_is_a_clear_error() -> None:
    with pytest.raises(EvaluationError, match="Q8_1 is not supported by the evaluator"):
        dequantize(torch.zeros((1, 36), dtype=torch.uint8), Q.Q8_1, 32)


def test_a_byte_count_that_does_not_fit_the_row_length_is_refused() -> None:
    with pytest.raises(EvaluationError, match="do not hold 1 rows of 64 Q8_0 values"):
        dequantize(torch.zeros((1, 34), dtype=torch.uint8), Q.Q8_0, 64)
