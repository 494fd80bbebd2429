"""Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4, Q1_0: bytes equal ggml's own quantizer, dequantization
equals ggml's ``to_float`` and gguf-py bit for bit.

The oracle is ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base.so`` (tests/ggml_oracle.py),
called with and without an imatrix pointer: Q2_K/Q3_K switch to their ``*_impl`` quantizers with one,
IQ4_NL/IQ4_XS weight their fit with it, and TQ1_0/TQ2_0/MXFP4/Q1_0 ignore it (the same call checks that we
ignore it too). Inputs cover the branches of ggml's code: ordinary weights, zero / constant / one-non-zero /
negative-max blocks, half-integer ties, subnormal and huge magnitudes (off-range ``nearest_int``,
overflowing ``1/d``, f16 scale under/overflow), several shapes, 1 and N threads.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from ggml_oracle import ggml_dequantize, ggml_quantize, row_bytes
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ggufkit.quant.kernels.kquants import cpu_low as kquants_low
from ggufkit.quant.kernels.lowbit import iq4 as iq_nonlinear
from ggufkit.quant.kernels.lowbit import mxfp4, q1_0, ternary

QT = GGMLQuantizationType
TYPES = {
    QT.Q2_K: (kquants_low.quantize_rows_q2_K, kquants_low.dequantize_rows_q2_K),
    QT.Q3_K: (kquants_low.quantize_rows_q3_K, kquants_low.dequantize_rows_q3_K),
    QT.IQ4_NL: (iq_nonlinear.quantize_rows_iq4_nl, iq_nonlinear.dequantize_rows_iq4_nl),
    QT.IQ4_XS: (iq_nonlinear.quantize_rows_iq4_xs, iq_nonlinear.dequantize_rows_iq4_xs),
    QT.TQ1_0: (ternary.quantize_rows_tq1_0, ternary.dequantize_rows_tq1_0),
    QT.TQ2_0: (ternary.quantize_rows_tq2_0, ternary.dequantize_rows_tq2_0),
    QT.MXFP4: (mxfp4.quantize_rows_mxfp4, mxfp4.dequantize_rows_mxfp4),
    QT.Q1_0: (q1_0.quantize_rows_q1_0, q1_0.dequantize_rows_q1_0),
}
#: Types gguf-py 0.19.0 can dequantize (it has no Q1_0).
GGUF_PY_DEQUANT = set(TYPES) - {QT.Q1_0}
#: f16 scale offsets inside a block, for random-byte dequantization inputs (kept finite).
F16_OFFSETS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.IQ4_NL: (0,), QT.IQ4_XS: (0,), QT.TQ1_0: (52,),
               QT.TQ2_0: (64,), QT.MXFP4: (), QT.Q1_0: (0,)}
NO_IMATRIX = np.zeros(0, np.float32)
IDS = {"ids": lambda t: t.name}


def _edge_rows(rng: np.random.Generator) -> np.ndarray:
    """One 256-weight case per row (followed by 256 normal weights), each a corner of ggml's code."""
    b = [np.zeros(256), np.full(256, 0.75), np.full(256, -0.75)]
    one = np.zeros(256)
    one[77] = 3.0
    b.append(one)  # a single non-zero weight
    neg = rng.standard_normal(256) * 0.1
    neg[5] = -4.0
    b.append(neg)  # largest magnitude negative
    b.append(np.where(np.arange(256) % 16 == 0, 2.0, 0.0))  # one non-zero per 16-weight sub-block
    b.append(rng.integers(-8, 9, 256) + 0.5)  # half-integer ties
    b.append(rng.integers(-4, 5, 256) / 4)  # quarter steps: ties of x/d for many scales
    b.append(np.concatenate([np.zeros(128), rng.standard_normal(128)]))  # zero sub-blocks beside data
    b.append(np.concatenate([np.full(32, -1000.0), rng.standard_normal(224) * 1e-3]))  # huge beside tiny
    b.append(rng.standard_normal(256) * 1e-40)  # subnormal: 1/d and nmax/(max - min) overflow to inf
    b.append(rng.standard_normal(256) * 1e-44)  # deep subnormal: MXFP4's exponent wraps below 0
    b.append(rng.standard_normal(256) * 1e30)  # huge: x*x overflows, f16 scales overflow
    b.append(rng.standard_normal(256) * 3e37)  # near FLT_MAX
    b.append(rng.standard_normal(256) * 1e-9)  # tiny: f16 scales underflow
    rows = [np.concatenate([blk, rng.standard_normal(256)]) for blk in b]
    return np.asarray(rows, dtype=np.float32)


def _data(kind: str, rng: np.random.Generator) -> np.ndarray:
    shape = (3, 1024)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "bf16_like":
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    if kind == "student_t":
        return rng.standard_t(2.0, shape).astype(np.float32)
    if kind == "uniform_positive":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if kind == "ternary":  # BitNet-like: already -a, 0, a
        return (rng.integers(-1, 2, shape) * 0.37).astype(np.float32)
    if kind == "scale_1e-6":
        return (rng.standard_normal(shape) * 1e-6).astype(np.float32)
    if kind == "scale_1e3":
        return (rng.standard_normal(shape) * 1e3).astype(np.float32)
    if kind == "small_ints":
        return rng.integers(-4, 5, shape).astype(np.float32)
    if kind == "mostly_zero":
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0.0
        return x
    if kind == "edge_rows":
        return _edge_rows(rng)
    raise AssertionError(kind)


KINDS = ["normal", "bf16_like", "student_t", "uniform_positive", "ternary", "scale_1e-6", "scale_1e3",
         "small_ints", "mostly_zero", "edge_rows"]


def _imatrix(kind: str, n: int, rng: np.random.Generator) -> np.ndarray | None:
    if kind == "none":
        return None
    qw = rng.gamma(0.5, 2.0, n).astype(np.float32)
    if kind == "with_zeros":
        qw[rng.random(n) < 0.3] = 0.0
        qw[256:512] = 0.0  # a whole super-block without importance
    return qw


def _ours(qtype: QT, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    quantize_rows, _ = TYPES[qtype]
    out = np.full((x.shape[0], row_bytes(qtype, x.shape[1])), 0xAA, np.uint8)  # garbage: all bytes written?
    quantize_rows(np.ascontiguousarray(x), NO_IMATRIX if qw is None else qw, out)
    return out


def _assert_same_blocks(qtype: QT, ours: np.ndarray, ref: np.ndarray) -> None:
    type_size = GGML_QUANT_SIZES[qtype][1]
    a, b = ours.reshape(-1, type_size), ref.reshape(-1, type_size)
    bad = np.nonzero((a != b).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} of {len(a)} blocks differ, first {bad[0]}: {a[bad[0]]} != {b[bad[0]]}"


@pytest.mark.parametrize("imatrix", ["none", "positive", "with_zeros"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", list(TYPES), **IDS)
def test_quantize_is_byte_identical_to_ggml_quantize_chunk(qtype: QT, kind: str, imatrix: str) -> None:
    rng = np.random.default_rng([int(qtype), KINDS.index(kind), len(imatrix)])
    x = _data(kind, rng)
    qw = _imatrix(imatrix, x.shape[1], rng)
    with np.errstate(all="ignore"):
        _assert_same_blocks(qtype, _ours(qtype, x, qw), ggml_quantize(x, qtype, qw))


@pytest.mark.parametrize(("n_rows", "n_blocks"), [(1, 1), (5, 1), (1, 16), (7, 3)])
@pytest.mark.parametrize("qtype", list(TYPES), **IDS)
def test_every_row_shape_matches_ggml_with_and_without_imatrix(qtype: QT, n_rows: int, n_blocks: int) -> None:
    n_per_row = n_blocks * GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(n_rows * n_per_row)
    x = (rng.standard_normal((n_rows, n_per_row)) * rng.uniform(0.01, 2.0, (n_rows, 1))).astype(np.float32)
    qw = rng.random(n_per_row).astype(np.float32)
    _assert_same_blocks(qtype, _ours(qtype, x, None), ggml_quantize(x, qtype))
    _assert_same_blocks(qtype, _ours(qtype, x, qw), ggml_quantize(x, qtype, qw))


@pytest.mark.parametrize("qtype", list(TYPES), **IDS)
def test_thread_count_does_not_change_the_bytes(qtype: QT) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 2048)) * 0.05).astype(np.float32)
    qw = rng.random(2048).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = [_ours(qtype, x, None), _ours(qtype, x, qw)]
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = [_ours(qtype, x, None), _ours(qtype, x, qw)]
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one[0], many[0]) and np.array_equal(one[1], many[1])
    _assert_same_blocks(qtype, one[1], ggml_quantize(x, qtype, qw))


def test_mxfp4_exponent_matches_ggml_where_log2_rounds_up_to_an_integer() -> None:
    # floorf(log2f(amax)): for amax just below a power of two log2f can round up to the integer, so the
    # exponent is one more than the binary exponent of amax. Every binade, a few ulps below 2^k.
    k = np.arange(-148, 128)
    j = np.arange(1, 9)
    amax = (np.ldexp(1.0, k)[:, None] * (1 - j[None, :] * 2.0 ** -24)).astype(np.float32).reshape(-1)
    amax = amax[(amax > 0) & np.isfinite(amax)]
    x = np.zeros((amax.size, 32), np.float32)
    x[:, 3] = amax
    x[:, 4] = -amax / 3
    _assert_same_blocks(QT.MXFP4, _ours(QT.MXFP4, x, None), ggml_quantize(x, QT.MXFP4))


def test_mxfp4_codes_match_ggml_at_and_beside_every_midpoint_in_every_binade() -> None:
    # The CPU kernel picks a code by comparing |x| with the midpoints of the code values; ggml takes the
    # first code of least rounded |kvalue*d - x|. Weights on, and 1-2 ulps beside, every midpoint and code
    # value, both signs, for block maxima in every binade (subnormal scales and wrapped exponents too).
    rows = []
    for k in range(-149, 128):
        for top in (1.5, 1.9990234375):
            amax = np.float32(np.ldexp(top, k))
            if amax == 0 or not np.isfinite(amax):
                continue
            e = (int(np.floor(np.log2(np.float64(amax)))) - 2 + 127) % 256
            d = np.float32(np.ldexp(1.0, e - 128))
            with np.errstate(over="ignore"):  # a wrapped exponent's huge d: marks above amax are dropped below
                marks = np.array([0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12], np.float32) * d
            up, down = np.nextafter(marks, np.float32(np.inf)), np.nextafter(marks, np.float32(0))
            v = np.concatenate([marks, up, down, np.nextafter(up, np.float32(np.inf)),
                                np.nextafter(down, np.float32(0))])
            v = v[(v <= amax) & (v > 0)]
            v = np.concatenate([v, -v])
            for i in range(0, v.size, 31):
                row = np.zeros(32, np.float32)
                row[0] = amax
                row[1:1 + v[i:i + 31].size] = v[i:i + 31]
                rows.append(row)
    x = np.stack(rows)
    _assert_same_blocks(QT.MXFP4, _ours(QT.MXFP4, x, None), ggml_quantize(x, QT.MXFP4))


def _best_index_int8(values: np.ndarray, x: np.float32) -> int:
    """ggml-quants.c best_index_int8, step for step in float32 (the oracle for the midpoint form)."""
    if x <= values[0]:
        return 0
    if x >= values[-1]:
        return len(values) - 1
    ml, mu = 0, len(values) - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if np.float32(x - values[mu - 1]) < np.float32(values[mu] - x) else mu


def test_iq4_nearest_index_flips_exactly_at_each_midpoint() -> None:
    # best_index_iq4 counts the midpoints x reaches instead of bisecting. That is exact because the C's choice
    # between neighbours lo <= x < hi, fl(x - lo) < fl(hi - x), is monotone in x: it must flip at the
    # midpoint itself, so the float just below each midpoint picks lo and the midpoint picks hi.
    values = iq_nonlinear.KVALUES_IQ4NL
    with np.errstate(invalid="ignore"):
        for lo, hi, mid in zip(values[:-1], values[1:], iq_nonlinear._MID_IQ4NL):
            below = np.nextafter(mid, np.float32(-np.inf))
            assert np.float32(below - lo) < np.float32(hi - below)
            assert not np.float32(mid - lo) < np.float32(hi - mid)
        marks = np.concatenate([values, iq_nonlinear._MID_IQ4NL, [0.0, 1e-30, -1e-30, 1e30, -1e30]]).astype(np.float32)
        near = [marks]
        for direction in (np.inf, -np.inf):
            step = marks
            for _ in range(3):
                step = np.nextafter(step, np.float32(direction))
                near.append(step)
        rng = np.random.default_rng(0)
        probes = np.concatenate([*near, rng.uniform(-140, 130, 4000).astype(np.float32),
                                 np.array([np.inf, -np.inf, np.nan], np.float32)])
        for x in probes:
            want = _best_index_int8(values, x)
            assert iq_nonlinear.best_index_iq4(x) == want, x
            assert iq_nonlinear._nearest_value(x) == values[want], x


def _dequant_inputs(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Blocks of quantized real data plus random bytes (every quant/scale pattern; f16 scales finite)."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    with np.errstate(all="ignore"):
        real = [_ours(qtype, _data(kind, rng), None).reshape(-1, type_size) for kind in ("normal", "edge_rows")]
    noise = rng.integers(0, 256, (48, type_size), dtype=np.uint8)
    for off in F16_OFFSETS[qtype]:  # exponent bits below all-ones: no inf/NaN scales
        noise[:, off + 1] &= 0x7B
    return np.concatenate([*real, noise])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("qtype", list(TYPES), **IDS)
def test_dequantize_equals_ggml_and_gguf_py(qtype: QT) -> None:
    blocks = _dequant_inputs(qtype, np.random.default_rng(int(qtype)))
    n_blocks = blocks.shape[0]
    block = GGML_QUANT_SIZES[qtype][0]
    _, dequantize_rows = TYPES[qtype]
    ours = np.full((n_blocks, block), np.nan, np.float32)
    dequantize_rows(blocks, ours)
    want = ggml_dequantize(blocks, qtype, (n_blocks, block))
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))
    if qtype in GGUF_PY_DEQUANT:
        expected = gguf_dequantize(blocks, qtype).reshape(n_blocks, block)
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


def test_info_and_verify_read_files_holding_every_new_type(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from cli_helpers import invoke

    from ggufkit.format import Metadata, TensorSpec, write_gguf
    from ggufkit.format.values import VT

    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    specs = [TensorSpec(f"w.{t.name}", t, (2, 512)) for t in TYPES]
    write_gguf(tmp_path / "m.gguf", meta, specs, [_ours(t, x, None) for t in TYPES])
    info = invoke("info", str(tmp_path / "m.gguf"), "--json")
    assert info.exit_code == 0, info.output
    text = json.dumps(json.loads(info.stdout))
    assert all(t.name in text for t in TYPES)
    verify = invoke("verify", str(tmp_path / "m.gguf"), "--json")
    assert verify.exit_code == 0, verify.output
