"""Grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): bytes equal ggml's own quantizer,
dequantization equals gguf-py and ggml bit for bit, tables equal the ones ggml builds.

The oracle is ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base.so`` (tests/ggml_oracle.py),
which calls ``ggml_quantize_init`` (building the grid maps and neighbour lists) itself. IQ2_XXS, IQ2_XS and
IQ1_S have no quantizer without an imatrix (``ggml_quantize_requires_imatrix``: ggml asserts), so they are
compared with one only and must refuse without. Inputs are small: the grid searches are slow in ggml too.
"""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest
from ggml_oracle import ggml_dequantize, ggml_quantize, ggml_requires_imatrix, row_bytes
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from llama_cpp_sources import llama_cpp_dir

from ggufkit.errors import QuantizationError
from ggufkit.quant import KERNELS, dequantize, quantize
from ggufkit.quant.kernels.iq.grids import iq_tables

QT = GGMLQuantizationType
GRID_TYPES = [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M]
NEEDS_IMATRIX = {QT.IQ2_XXS, QT.IQ2_XS, QT.IQ1_S}
NO_IMATRIX = np.zeros(0, np.float32)


def _kernels(qtype: QT):
    return KERNELS[qtype].cpu()


def _edge_rows(rng: np.random.Generator) -> np.ndarray:
    """One 256-weight block per corner case, each followed by an ordinary block (rows of 512)."""
    b = [np.zeros(256), np.full(256, 0.75), np.full(256, -0.75)]
    one = np.zeros(256)
    one[77] = 3.0
    b.append(one)  # a single non-zero weight
    neg = rng.standard_normal(256) * 0.1
    neg[5] = -4.0
    b.append(neg)  # largest magnitude is negative
    b.append(np.where(np.arange(256) % 32 == 0, 2.0, 0.0))  # one non-zero per sub-block
    b.append(rng.integers(-8, 9, 256) + 0.5)  # half-integer ties (also equal values for the IQ1 sorts)
    b.append(np.concatenate([np.zeros(128), rng.standard_normal(128)]))  # zero sub-blocks beside data
    b.append(np.concatenate([np.full(32, -1000.0), rng.standard_normal(224) * 1e-3]))  # one huge sub-block
    b.append(rng.standard_normal(256) * 1e-40)  # subnormal weights
    b.append(rng.standard_normal(256) * 1e-9)  # tiny: under the GROUP_MAX_EPS thresholds of some types
    b.append(rng.standard_normal(256) * 1e12)  # huge (from ~1e13 on, weighted distances overflow: ggml aborts)
    rows = [np.concatenate([blk, rng.standard_normal(256)]) for blk in b]
    return np.asarray(rows, dtype=np.float32)


def _data(kind: str, rng: np.random.Generator) -> np.ndarray:
    shape = (2, 512)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "bf16_like":
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    if kind == "student_t":
        return rng.standard_t(2.0, shape).astype(np.float32)
    if kind == "uniform_positive":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if kind == "small_ints":  # many equal values
        return rng.integers(-4, 5, shape).astype(np.float32)
    if kind == "mostly_zero":
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0.0
        return x
    if kind == "edge_blocks":
        return _edge_rows(rng)
    raise AssertionError(kind)


KINDS = ["normal", "bf16_like", "student_t", "uniform_positive", "small_ints", "mostly_zero", "edge_blocks"]


def _imatrix(kind: str, n: int, rng: np.random.Generator) -> np.ndarray | None:
    if kind == "none":
        return None
    qw = rng.gamma(0.5, 2.0, n).astype(np.float32)
    if kind == "with_zeros":
        qw[rng.random(n) < 0.3] = 0.0
        qw[256:512] = 0.0  # a whole super-block without importance
    return qw


def _ours(qtype: QT, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    quantize_rows, _ = _kernels(qtype)
    out = np.full((x.shape[0], row_bytes(qtype, x.shape[1])), 0xAA, np.uint8)  # every byte must be written
    quantize_rows(np.ascontiguousarray(x), NO_IMATRIX if qw is None else qw, out)
    return out


def _assert_same_blocks(qtype: QT, ours: np.ndarray, ref: np.ndarray) -> None:
    size = row_bytes(qtype, 256)
    a, b = ours.reshape(-1, size), ref.reshape(-1, size)
    bad = np.nonzero((a != b).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} of {len(a)} blocks differ, first {bad[0]}: {a[bad[0]]} != {b[bad[0]]}"


def _cases() -> list[tuple[QT, str, str]]:
    return [(t, k, w) for t in GRID_TYPES for k in KINDS for w in ("none", "positive", "with_zeros")
            if not (w == "none" and t in NEEDS_IMATRIX)]


@pytest.mark.parametrize(("qtype", "kind", "imatrix"), _cases(), ids=lambda v: getattr(v, "name", v))
def test_quantize_is_byte_identical_to_ggml_quantize_chunk(qtype: QT, kind: str, imatrix: str) -> None:
    rng = np.random.default_rng([int(qtype), KINDS.index(kind), len(imatrix)])
    x = _data(kind, rng)
    qw = _imatrix(imatrix, x.shape[1], rng)
    _assert_same_blocks(qtype, _ours(qtype, x, qw), ggml_quantize(x, qtype, qw))


@pytest.mark.parametrize(("n_rows", "n_per_row"), [(1, 256), (3, 768)])
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_row_shapes_match_ggml(qtype: QT, n_rows: int, n_per_row: int) -> None:
    rng = np.random.default_rng(n_rows * n_per_row + int(qtype))
    x = (rng.standard_normal((n_rows, n_per_row)) * rng.uniform(0.01, 2.0, (n_rows, 1))).astype(np.float32)
    qw = rng.random(n_per_row).astype(np.float32)
    _assert_same_blocks(qtype, _ours(qtype, x, qw), ggml_quantize(x, qtype, qw))
    if qtype not in NEEDS_IMATRIX:
        _assert_same_blocks(qtype, _ours(qtype, x, None), ggml_quantize(x, qtype))


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_thread_count_does_not_change_the_bytes(qtype: QT) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    qw = rng.random(512).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _ours(qtype, x, qw)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = _ours(qtype, x, qw)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one, many)
    _assert_same_blocks(qtype, one, ggml_quantize(x, qtype, qw))


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_imatrix_requirement_is_ggmls(qtype: QT) -> None:
    assert (qtype in NEEDS_IMATRIX) == ggml_requires_imatrix(qtype)
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    if qtype in NEEDS_IMATRIX:
        with pytest.raises(QuantizationError, match="importance matrix"):
            quantize(x, qtype)
    else:  # the public API routes to the same kernel
        assert np.array_equal(quantize(x, qtype), ggml_quantize(x, qtype))


def _dequant_inputs(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Quantized real data plus random bytes (every index/sign/scale pattern; f16 scales kept finite)."""
    x = np.concatenate([_data("normal", rng), _data("edge_blocks", rng)])
    real = _ours(qtype, x, rng.random(x.shape[1]).astype(np.float32)).reshape(-1, row_bytes(qtype, 256))
    noise = rng.integers(0, 256, (16, row_bytes(qtype, 256)), dtype=np.uint8)
    if qtype == QT.IQ1_M:
        noise[:, 55] &= 0x7B  # the f16 super-scale's exponent is the top nibble of the last scale word
    else:
        noise[:, 1] &= 0x7B
    return np.concatenate([real, noise])


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_py_and_ggml(qtype: QT) -> None:
    blocks = _dequant_inputs(qtype, np.random.default_rng(int(qtype)))
    n = blocks.shape[0]
    _, dequantize_rows = _kernels(qtype)
    ours = np.full((n, 256), np.nan, np.float32)
    dequantize_rows(blocks, ours)
    expected = gguf_dequantize(blocks, qtype).reshape(n, 256)
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(ours.view(np.uint32), ggml_dequantize(blocks, qtype, (n, 256)).view(np.uint32))
    assert np.array_equal(dequantize(blocks, qtype, (n, 256)), ours)  # the public API


def _c_table(src: str, name: str) -> np.ndarray:
    m = re.search(r"static const uint16_t " + name + r"\[[^\]]*\] = \{(.*?)\};", src, re.S)
    assert m is not None, name
    return np.array([int(v) for v in m.group(1).split(",") if v.strip()], dtype=np.uint16)


@pytest.mark.parametrize(("qtype", "c_name"), [
    (QT.IQ2_XXS, "kgrid_2bit_256"), (QT.IQ2_XS, "kgrid_2bit_512"), (QT.IQ2_S, "kgrid_2bit_1024"),
    (QT.IQ1_S, "kgrid_1bit_2048"), (QT.IQ3_XXS, "kgrid_256"), (QT.IQ3_S, "kgrid_512"),
], ids=lambda v: getattr(v, "name", v))
def test_grids_from_gguf_py_equal_ggmls_kgrid_tables(qtype: QT, c_name: str) -> None:
    # The grids come from gguf-py's dequantizer data; ggml's quantizer builds its own from these tables.
    src = (llama_cpp_dir() / "ggml" / "src" / "ggml-quants.c").read_text()
    t = iq_tables(qtype)
    assert np.array_equal(t.kgrid, _c_table(src, c_name))
    # every off-grid point has at least one neighbour, and every neighbour is a grid index
    off = t.kmap[t.kmap < 0]
    starts = -off - 1
    assert (t.neighbours[starts] > 0).all()


_GGML_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from ggml_oracle import ggml_quantize
from gguf import GGMLQuantizationType
x = (np.random.default_rng(1).standard_normal((1, 256)) * 1e16).astype(np.float32)
ggml_quantize(x, GGMLQuantizationType[sys.argv[1]], np.ones(256, np.float32))
"""


@pytest.mark.parametrize("qtype", [QT.IQ2_XS, QT.IQ3_S], ids=lambda t: t.name)
def test_rows_on_which_ggml_aborts_are_refused(qtype: QT) -> None:
    # |x| ~ 1e16: the weighted squared distances overflow to inf, no grid point is "closer than FLT_MAX"
    # and ggml stops with GGML_ASSERT(grid_index >= 0); ggufkit raises instead of writing anything.
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _GGML_CHILD, qtype.name, str(Path(__file__).parent)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "GGML_ASSERT(grid_index >= 0)" in proc.stderr
    x = (np.random.default_rng(1).standard_normal((1, 256)) * 1e16).astype(np.float32)
    with pytest.raises(QuantizationError, match="cannot be quantized"):
        quantize(x, qtype, imatrix=np.ones(256, np.float32))
