"""Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and F16/BF16/F32 against ggml's own quantizer (ctypes, libggml-base.so).

Oracles: ``ggml_quantize_chunk`` (reference path without an imatrix, ``*_impl`` with one) and ggml's
``to_float`` for dequantization (tests/ggml_oracle.py), plus ``gguf.quants`` (numpy) for the types it has.
Every case is generated here; the edge rows are there on purpose (all-zero blocks, constants, one
non-zero, subnormals, huge magnitudes, negative maxima, exact .5 ties).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from ggml_oracle import ggml_dequantize, ggml_quantize
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from ggufkit.errors import DeviceUnavailableError, QuantizationError, UsageError
from ggufkit.quant import KERNELS, cuda_available, dequantize, quantize, resolve_device
from ggufkit.quant.kernels import fp as qfp

LEGACY = [t for t, k in KERNELS.items() if k.family == "legacy"]
N = 256  # row length: 8 blocks


def _rows(kind: str, rng: np.random.Generator, rows: int = 6) -> np.ndarray:
    shape = (rows, N)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "bf16_like":  # weights that came from a bf16 checkpoint: low 16 bits zero
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    if kind == "student_t":
        return rng.standard_t(3, shape).astype(np.float32)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "constant":
        return np.full(shape, np.float32(-0.37))
    if kind == "one_nonzero":
        x = np.zeros(shape, np.float32)
        x[:, 5::32] = rng.standard_normal((rows, N // 32)).astype(np.float32)
        return x
    if kind == "negative_max":
        return -np.abs(rng.standard_normal(shape)).astype(np.float32)
    if kind == "ties":  # small integers and multiples of 1/16: x*id lands on .5 exactly
        x = rng.integers(-16, 17, shape).astype(np.float32)
        x[rows // 2:] /= 16
        return x
    if kind == "tiny":
        return (rng.standard_normal(shape) * 1e-9).astype(np.float32)
    if kind == "subnormal":  # scale 1/d overflows to inf in f32
        return (rng.standard_normal(shape) * 1e-41).astype(np.float32)
    if kind == "huge":  # sums of squares overflow; Q4_1's max-min overflows
        return rng.uniform(-3e38, 3e38, shape).astype(np.float32)
    if kind == "sparse":  # 90 % zeros
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0
        return x
    raise AssertionError(kind)


KINDS = ["normal", "bf16_like", "student_t", "zeros", "constant", "one_nonzero", "negative_max", "ties",
         "tiny", "subnormal", "huge", "sparse"]


def _all_kinds(seed: int) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    parts = [_rows(k, rng) for k in KINDS]
    labels = [k for k, p in zip(KINDS, parts) for _ in range(p.shape[0])]
    return np.concatenate(parts), labels


def _mismatching_kinds(a: np.ndarray, b: np.ndarray, labels: list[str]) -> list[str]:
    bad = (a != b).any(axis=1)
    return sorted({labels[i] for i in np.nonzero(bad)[0]})


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_cpu_kernel_bytes_equal_ggml_quantize_chunk(qtype: T, with_imatrix: bool) -> None:
    x, labels = _all_kinds(seed=int(qtype))
    imatrix = np.random.default_rng(7).uniform(0.0, 4.0, N).astype(np.float32) if with_imatrix else None
    if imatrix is not None:
        imatrix[::17] = 0.0  # unused columns are common in real imatrix files
    expected = ggml_quantize(x, qtype, imatrix)
    got = quantize(x, qtype, imatrix=imatrix)
    assert got.shape == expected.shape
    assert _mismatching_kinds(got, expected, labels) == []


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_thread_count_does_not_change_bytes_and_is_restored(qtype: T) -> None:
    x = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    imatrix = np.random.default_rng(4).uniform(0.1, 2.0, 512).astype(np.float32)
    before = numba.get_num_threads()
    one = quantize(x, qtype, imatrix=imatrix, threads=1)
    assert numba.get_num_threads() == before
    many = quantize(x, qtype, imatrix=imatrix, threads=numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(one, many)
    assert np.array_equal(one, ggml_quantize(x, qtype, imatrix))


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_reference_path_agrees_with_gguf_quants(qtype: T) -> None:
    x, labels = _all_kinds(seed=100 + int(qtype))
    keep = [i for i, k in enumerate(labels) if k not in ("subnormal", "huge")]  # numpy warns/overflows there
    x = x[keep]
    with np.errstate(all="ignore"):
        expected = gguf_quants.quantize(x, qtype)
    assert np.array_equal(quantize(x, qtype), expected)


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_dequantize_equals_gguf_and_ggml(qtype: T) -> None:
    rng = np.random.default_rng(11)
    x, _ = _all_kinds(seed=200 + int(qtype))
    raw = ggml_quantize(x, qtype)
    # Also arbitrary bytes: every f16 scale, including inf and NaN, and every quant pattern.
    noise = rng.integers(0, 256, (8, raw.shape[1]), dtype=np.uint8)
    raw = np.concatenate([raw, noise])
    shape = (raw.shape[0], N)
    got = dequantize(raw, qtype, shape)
    with np.errstate(all="ignore"):
        via_gguf = gguf_quants.dequantize(raw, qtype)
    via_ggml = ggml_dequantize(raw, qtype, shape)
    for other in (via_gguf, via_ggml):
        same = (got.view(np.uint32) == other.view(np.uint32)) | (np.isnan(got) & np.isnan(other))
        assert same.all()


def test_q4_0_and_q5_0_all_zero_block_store_negative_zero_scale() -> None:
    zeros = np.zeros((1, 32), np.float32)
    q4 = quantize(zeros, T.Q4_0)[0]
    assert q4[:2].tolist() == [0x00, 0x80] and (q4[2:] == 0x88).all()
    q5 = quantize(zeros, T.Q5_0)[0]
    assert q5[:2].tolist() == [0x00, 0x80] and (q5[2:6] == 0xFF).all() and (q5[6:] == 0).all()


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_targets_equal_ggml(qtype: T) -> None:
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    edge = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 6.1035156e-05, 2.9802322e-08,
                     2.9802326e-08, 1.0009765625, 1.00048828125, 1e-45, 3.4e38], np.float32)
    # BF16 rounding: ties to even (down, up), a carry into the exponent, the largest float32 (-> inf),
    # subnormal ties.
    bf16_edges = np.array([0x3F808000, 0x3F818000, 0x3FFF8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x80018000,
                           0x3F80FFFF, 0x3F807FFF], np.uint32).view(np.float32)
    edge = np.concatenate([edge, bf16_edges])
    x = np.concatenate([edge, x[: (x.size // 32) * 32 - edge.size]]).reshape(-1, 32)
    assert np.array_equal(quantize(x, qtype), ggml_quantize(x, qtype))
    assert np.array_equal(dequantize(quantize(x, qtype), qtype, x.shape).view(np.uint32),
                          ggml_dequantize(ggml_quantize(x, qtype), qtype, x.shape).view(np.uint32))
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # F16 input: widened, then converted
    halves = halves[(halves & 0x7C00) != 0x7C00].view(np.float16)[: 63488 // 32 * 32].reshape(-1, 32)
    assert np.array_equal(quantize(halves, qtype), ggml_quantize(halves.astype(np.float32), qtype))


def test_fp16_helper_equals_numpy_rne_on_random_bit_patterns() -> None:
    rng = np.random.default_rng(9)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]

    @numba.njit(cache=False)  # test-local helper; caching a closure-free test function buys nothing
    def convert(a: np.ndarray) -> np.ndarray:
        out = np.empty(a.size, np.uint16)
        for i in range(a.size):
            out[i] = qfp.fp32_to_fp16(a[i])
        return out

    with np.errstate(over="ignore"):
        assert np.array_equal(convert(x), x.astype(np.float16).view(np.uint16))
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    back = np.array([qfp.fp16_to_fp32(h) for h in halves[::7]], np.float32)
    ref = halves[::7].view(np.float16).astype(np.float32)
    assert np.array_equal(back.view(np.uint32)[~np.isnan(ref)], ref.view(np.uint32)[~np.isnan(ref)])


def test_nearest_int_reproduces_ggml_bit_trick_even_out_of_range() -> None:
    rng = np.random.default_rng(10)
    vals = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    vals = np.concatenate([vals[np.isfinite(vals)], np.float32([2.5, -2.5, 3.5, 4194303.5, np.inf, -np.inf])])
    with np.errstate(all="ignore"):
        s = (vals + np.float32(12582912.0)).view(np.uint32).astype(np.int64)
    expected = (s & 0x7FFFFF) - 0x400000
    assert [qfp.nearest_int(v) for v in vals] == expected.tolist()
    assert qfp.roundf(np.float32(0.49999997)) == 0 and qfp.roundf(np.float32(-2.5)) == -3


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("qtype", [*LEGACY, T.F16], ids=lambda t: t.name)
def test_non_finite_input_raises_quantization_error_naming_the_tensor(qtype: T, bad: float) -> None:
    x = np.ones((2, 64), np.float32)
    x[1, 33] = bad
    with pytest.raises(QuantizationError, match=r"blk\.0\.attn_q\.weight.*non-finite.*index 97"):
        quantize(x, qtype, name="blk.0.attn_q.weight")


def test_bad_arguments_raise_typed_errors() -> None:
    x = np.ones((2, 64), np.float32)
    with pytest.raises(QuantizationError, match="row length 48 is not a multiple of Q4_0's block size 32"):
        quantize(np.ones((2, 48), np.float32), T.Q4_0)
    with pytest.raises(QuantizationError, match="imatrix has 32 values, the rows have 64"):
        quantize(x, T.Q4_1, imatrix=np.ones(32, np.float32))
    with pytest.raises(UsageError, match="cannot quantize to Q8_K"):
        quantize(x, T.Q8_K)
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        quantize(x, T.Q8_0, device="tpu")
    with pytest.raises(UsageError, match="threads must be an integer"):
        quantize(x, T.Q8_0, threads=0)
    with pytest.raises(UsageError, match="float32 or float16"):
        quantize(x.astype(np.int32), T.Q8_0)
    with pytest.raises(QuantizationError, match="do not hold a tensor of shape"):
        dequantize(np.zeros(35, np.uint8), T.Q8_0, (1, 32))


def test_device_choice_follows_numba_cuda_availability() -> None:
    if cuda_available():
        assert resolve_device("auto") == "cuda" and resolve_device("cuda") == "cuda"
    else:
        assert resolve_device("auto") == "cpu"
        with pytest.raises(DeviceUnavailableError, match="no CUDA GPU"):
            quantize(np.ones((1, 32), np.float32), T.Q8_0, device="cuda")
    assert resolve_device("cpu") == "cpu"


def test_leading_dimensions_are_kept_and_empty_tensors_work() -> None:
    x = np.random.default_rng(12).standard_normal((3, 4, 64)).astype(np.float32)
    q = quantize(x, T.Q5_1)
    assert q.shape == (3, 4, 48)
    assert np.array_equal(q.reshape(12, 48), ggml_quantize(x.reshape(12, 64), T.Q5_1))
    assert dequantize(q, T.Q5_1, x.shape).shape == x.shape
    assert quantize(np.zeros((0, 64), np.float32), T.Q4_0).shape == (0, 36)
    f16 = x.astype(np.float16)
    assert np.array_equal(quantize(f16, T.Q8_0).reshape(12, 34 * 2),
                          ggml_quantize(f16.astype(np.float32).reshape(12, 64), T.Q8_0))
