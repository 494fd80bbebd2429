"""Q4_K / Q5_K / Q6_K kernels: bytes equal ggml's own quantizer, dequantization equals gguf-py and ggml.

The oracle is ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base.so`` (tests/ggml_oracle.py):
the reference quantizers without an imatrix, the weighted ``*_impl`` variants with one. Inputs cover the
data kinds that exercised distinct branches in ggml's code (reference/quant.md §3, §9): ordinary weights,
tiny and huge magnitudes (off-range ``nearest_int``, f16 under/overflow of the super-scales), subnormals,
all-zero / constant / one-non-zero / negative-max blocks, half-integer ties.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from ggml_oracle import ggml_dequantize, ggml_quantize, row_bytes
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ggufkit.quant.kernels.kquants import cpu as kquants

QT = GGMLQuantizationType
KTYPES = {
    QT.Q4_K: (kquants.quantize_rows_q4_K, kquants.dequantize_rows_q4_K),
    QT.Q5_K: (kquants.quantize_rows_q5_K, kquants.dequantize_rows_q5_K),
    QT.Q6_K: (kquants.quantize_rows_q6_K, kquants.dequantize_rows_q6_K),
}
NO_IMATRIX = np.zeros(0, np.float32)


def _edge_blocks(rng: np.random.Generator) -> np.ndarray:
    """One 256-weight block per corner case, each in a row of its own (rows of 512: case + normal)."""
    b = []
    b.append(np.zeros(256))  # all zero: Q6_K writes 210 zero bytes, Q4_K/Q5_K keep L = 0
    b.append(np.full(256, 0.75))  # constant positive
    b.append(np.full(256, -0.75))  # constant negative: min == max after the min <= 0 clamp
    one = np.zeros(256)
    one[77] = 3.0
    b.append(one)  # a single non-zero weight
    neg = rng.standard_normal(256) * 0.1
    neg[5] = -4.0
    b.append(neg)  # largest magnitude is negative
    b.append(np.where(np.arange(256) % 32 == 0, 2.0, 0.0))  # one non-zero per sub-block
    b.append(rng.integers(-8, 9, 256) + 0.5)  # half-integer ties
    b.append(np.concatenate([np.zeros(128), rng.standard_normal(128)]))  # zero sub-blocks beside data
    b.append(np.concatenate([np.full(32, -1000.0), rng.standard_normal(224) * 1e-3]))  # huge min, tiny scale
    b.append(rng.standard_normal(256) * 1e-40)  # subnormal weights: nmax / (max - min) overflows to inf
    b.append(rng.standard_normal(256) * 1e30)  # huge: the f16 super-scale overflows to inf
    b.append(rng.standard_normal(256) * 1e-9)  # tiny: f16 super-scale underflows to 0 or a subnormal
    rows = [np.concatenate([blk, rng.standard_normal(256)]) for blk in b]
    return np.asarray(rows, dtype=np.float32)


def _data(kind: str, rng: np.random.Generator) -> np.ndarray:
    shape = (3, 1024)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "bf16_like":  # typical LLM weights stored in bf16, 0.02 sigma
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    if kind == "student_t":  # heavy tails: one outlier dominates its block
        return rng.standard_t(2.0, shape).astype(np.float32)
    if kind == "uniform_positive":  # min > 0 is clamped to 0
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if kind == "scale_1e-6":
        return (rng.standard_normal(shape) * 1e-6).astype(np.float32)
    if kind == "scale_1e3":
        return (rng.standard_normal(shape) * 1e3).astype(np.float32)
    if kind == "small_ints":
        return rng.integers(-4, 5, shape).astype(np.float32)
    if kind == "sixteenths":
        return (rng.integers(-64, 65, shape) / 16).astype(np.float32)
    if kind == "mostly_zero":
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0.0
        return x
    if kind == "edge_blocks":
        return _edge_blocks(rng)
    raise AssertionError(kind)


KINDS = ["normal", "bf16_like", "student_t", "uniform_positive", "scale_1e-6", "scale_1e3", "small_ints",
         "sixteenths", "mostly_zero", "edge_blocks"]


def _imatrix(kind: str, n: int, rng: np.random.Generator) -> np.ndarray | None:
    if kind == "none":
        return None
    qw = rng.gamma(0.5, 2.0, n).astype(np.float32)  # positive, skewed like real activations
    if kind == "with_zeros":
        qw[rng.random(n) < 0.3] = 0.0
        qw[256:512] = 0.0  # a whole super-block without importance: make_qp_quants sees zero weights
    return qw


def _ours(qtype: QT, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    quantize_rows, _ = KTYPES[qtype]
    out = np.full((x.shape[0], row_bytes(qtype, x.shape[1])), 0xAA, np.uint8)  # garbage: all bytes written?
    quantize_rows(np.ascontiguousarray(x), NO_IMATRIX if qw is None else qw, out)
    return out


def _assert_same_blocks(qtype: QT, ours: np.ndarray, ref: np.ndarray) -> None:
    type_size = row_bytes(qtype, 256)
    a, b = ours.reshape(-1, type_size), ref.reshape(-1, type_size)
    bad = np.nonzero((a != b).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} of {len(a)} blocks differ, first {bad[0]}: {a[bad[0]]} != {b[bad[0]]}"


@pytest.mark.parametrize("imatrix", ["none", "positive", "with_zeros"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", list(KTYPES), ids=lambda t: t.name)
def test_quantize_is_byte_identical_to_ggml_quantize_chunk(qtype: QT, kind: str, imatrix: str) -> None:
    rng = np.random.default_rng([int(qtype), KINDS.index(kind), len(imatrix)])
    x = _data(kind, rng)
    qw = _imatrix(imatrix, x.shape[1], rng)
    _assert_same_blocks(qtype, _ours(qtype, x, qw), ggml_quantize(x, qtype, qw))


@pytest.mark.parametrize(("n_rows", "n_per_row"), [(1, 256), (5, 256), (1, 4096), (7, 768)])
@pytest.mark.parametrize("qtype", list(KTYPES), ids=lambda t: t.name)
def test_every_row_shape_matches_ggml_with_and_without_imatrix(qtype: QT, n_rows: int, n_per_row: int) -> None:
    rng = np.random.default_rng(n_rows * n_per_row)
    x = (rng.standard_normal((n_rows, n_per_row)) * rng.uniform(0.01, 2.0, (n_rows, 1))).astype(np.float32)
    qw = rng.random(n_per_row).astype(np.float32)
    _assert_same_blocks(qtype, _ours(qtype, x, None), ggml_quantize(x, qtype))
    _assert_same_blocks(qtype, _ours(qtype, x, qw), ggml_quantize(x, qtype, qw))


@pytest.mark.parametrize("qtype", list(KTYPES), ids=lambda t: t.name)
def test_thread_count_does_not_change_the_bytes(qtype: QT) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 2048)) * 0.05).astype(np.float32)
    qw = rng.random(2048).astype(np.float32)
    n_max = numba.config.NUMBA_NUM_THREADS
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = [_ours(qtype, x, None), _ours(qtype, x, qw)]
        numba.set_num_threads(n_max)
        many = [_ours(qtype, x, None), _ours(qtype, x, qw)]
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one[0], many[0]) and np.array_equal(one[1], many[1])
    _assert_same_blocks(qtype, one[0], ggml_quantize(x, qtype))


def _dequant_inputs(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Quantized real data plus random bytes (every scale/quant bit pattern; f16 d kept finite)."""
    x = np.concatenate([_data("normal", rng), _data("edge_blocks", rng)[:, :1024 // 2].reshape(-1, 1024)])
    real = _ours(qtype, x, None).reshape(-1, row_bytes(qtype, 256))
    noise = rng.integers(0, 256, (24, row_bytes(qtype, 256)), dtype=np.uint8)
    d_offsets = (208,) if qtype == QT.Q6_K else (0, 2)
    for off in d_offsets:  # exponent bits below all-ones: no inf/NaN super-scales
        noise[:, off + 1] &= 0x7B
    return np.concatenate([real, noise])


# Blocks from the huge-weight rows carry d = inf; gguf-py's numpy then warns about inf * 0 (NaN), as intended.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("qtype", list(KTYPES), ids=lambda t: t.name)
def test_dequantize_equals_gguf_py_and_ggml(qtype: QT) -> None:
    blocks = _dequant_inputs(qtype, np.random.default_rng(int(qtype)))
    n_blocks = blocks.shape[0]
    _, dequantize_rows = KTYPES[qtype]
    ours = np.full((n_blocks, 256), np.nan, np.float32)
    dequantize_rows(blocks, ours)
    expected = gguf_dequantize(blocks, qtype).reshape(n_blocks, 256)
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(ours.view(np.uint32), ggml_dequantize(blocks, qtype, (n_blocks, 256)).view(np.uint32))


def test_nearest_int_reproduces_ggml_bit_trick_off_its_asserted_range() -> None:
    # ggml's nearest_int, evaluated with numpy's IEEE float32 addition and a bit view: the definition,
    # including the inputs its disabled assert excludes (which subnormal/huge blocks do reach).
    from ggufkit.quant.kernels.kquants.subroutines import nearest_int_full

    rng = np.random.default_rng(3)
    v = np.concatenate([
        rng.normal(0, 40, 200), rng.uniform(-4194303, 4194303, 50), [0.5, 1.5, 2.5, -0.5, -2.5, 4194303.0],
        10.0 ** rng.uniform(6.7, 38, 100) * rng.choice([-1, 1], 100),  # beyond 2^22: "garbage" results
        [np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-45, -1e-45, 0.0, -0.0],
    ]).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        s = v + np.float32(12582912.0)
    expected = (s.view(np.int32) & 0x7FFFFF) - 0x400000
    got = np.array([nearest_int_full(t) for t in v])
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("imatrix", ["none", "positive"])
def test_q6_k_blocks_the_lanes_hand_back_take_the_scalar_path(imatrix: str) -> None:
    # Weights ~1e9 overflow the f16 super-scale to inf; a sub-block of ~1e-3 beside them gets the int8 scale 0,
    # so d*scale = inf*0 = NaN and ggml's x/(d*scale) reaches nearest_int as NaN: the lane kernel
    # (quant/kernels/kquants/q6k_chunk.py) must hand such blocks back (``bad``) to the exact scalar block function.
    from ggufkit.quant.kernels.kquants.q6k_chunk import SCRATCH_ROWS, q6k_chunk

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 1024)) * 1e9).astype(np.float32)
    x[0, 16:32] = rng.standard_normal(16) * 1e-3
    x[2, 3 * 256 + 240:] = rng.standard_normal(16) * 1e-3
    x[1] = rng.standard_normal(1024)  # ordinary blocks between them
    qw = _imatrix(imatrix, 1024, rng)
    bad = np.zeros(12, np.int64)
    q6k_chunk(x, NO_IMATRIX if qw is None else qw, np.zeros((3, 4 * 210), np.uint8), 0, 12,
              np.empty(SCRATCH_ROWS * 16 * 12, np.float32), np.empty(12 * 256, np.uint8), bad)
    assert list(np.nonzero(bad)[0]) == [0, 11]
    _assert_same_blocks(QT.Q6_K, _ours(QT.Q6_K, x, qw), ggml_quantize(x, QT.Q6_K, qw))
