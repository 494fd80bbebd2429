"""K-quant kernel speed: ggufkit's Numba CPU kernels vs ggml's quantizer vs gguf-py, per type.

One run, side by side, on the same ~100M weights (F16-rounded normal data, 0.02 sigma, rows of 4096,
converted to f32 once, outside the timings), all at the same thread count:

* ``ggufkit``: ``quantize_rows_q{4,5,6}_K`` with ``numba.set_num_threads(THREADS)`` (compiled and cached
  by a warm-up on a few rows first);
* ``ggml``: ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base.so`` through ctypes, the rows
  split into ``THREADS`` equal chunks run on ``THREADS`` Python threads (ctypes releases the GIL), which is
  how llama-quantize splits a tensor;
* ``gguf-py``: it has no K-quant quantizer (reference/quant.md §5), so the comparison there is
  dequantization: ``gguf.quants.dequantize`` (numpy) vs ``dequantize_rows_*``.

Run::

    python -m pytest benchmarks/bench_quant_kquants.py --benchmark-enable -s -p no:cacheprovider

The last test prints the ratios (other tool's time / ggufkit's time: above 1 means ggufkit is faster).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ggml_oracle import ggml_quantize, row_bytes

from ggufkit.quant import kquants

QT = GGMLQuantizationType
THREADS = 2
N_PER_ROW = 4096
#: 100.1M weights; BENCH_ROWS overrides it for a quick smoke run.
N_ROWS = int(os.environ.get("BENCH_ROWS", 24_448))
KERNELS = {
    QT.Q4_K: (kquants.quantize_rows_q4_K, kquants.dequantize_rows_q4_K),
    QT.Q5_K: (kquants.quantize_rows_q5_K, kquants.dequantize_rows_q5_K),
    QT.Q6_K: (kquants.quantize_rows_q6_K, kquants.dequantize_rows_q6_K),
}
NO_IMATRIX = np.zeros(0, np.float32)
_TIMES: dict[tuple[str, str], float] = {}
_OUT: dict[tuple[str, QT], np.ndarray] = {}


@pytest.fixture(scope="module")
def weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    f16 = (rng.standard_normal((N_ROWS, N_PER_ROW), dtype=np.float32) * np.float32(0.02)).astype(np.float16)
    x = f16.astype(np.float32)
    numba.set_num_threads(THREADS)
    for qtype, (quantize_rows, dequantize_rows) in KERNELS.items():  # compile or load from the cache
        out = np.empty((4, row_bytes(qtype, N_PER_ROW)), np.uint8)
        quantize_rows(x[:4], NO_IMATRIX, out)
        dequantize_rows(out, np.empty((4, N_PER_ROW), np.float32))
    return x


def _run(benchmark, key: tuple[str, str], fn) -> None:
    start = time.perf_counter()
    benchmark.pedantic(fn, rounds=1, iterations=1)
    _TIMES[key] = time.perf_counter() - start


def _ggml_threaded(x: np.ndarray, qtype: QT) -> np.ndarray:
    parts: list[np.ndarray | None] = [None] * THREADS
    bounds = np.linspace(0, x.shape[0], THREADS + 1).astype(int)

    def work(i: int) -> None:
        parts[i] = ggml_quantize(x[bounds[i]:bounds[i + 1]], qtype)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return np.concatenate(parts)


@pytest.mark.parametrize("qtype", list(KERNELS), ids=lambda t: t.name)
def test_quantize_ggufkit(benchmark, weights, qtype):
    quantize_rows, _ = KERNELS[qtype]
    out = np.empty((N_ROWS, row_bytes(qtype, N_PER_ROW)), np.uint8)
    benchmark.group = f"quantize {qtype.name}"
    _run(benchmark, ("ggufkit", f"quantize {qtype.name}"), lambda: quantize_rows(weights, NO_IMATRIX, out))
    _OUT[("ggufkit", qtype)] = out


@pytest.mark.parametrize("qtype", list(KERNELS), ids=lambda t: t.name)
def test_quantize_ggml(benchmark, weights, qtype):
    benchmark.group = f"quantize {qtype.name}"
    result: list[np.ndarray] = []
    _run(benchmark, ("ggml", f"quantize {qtype.name}"), lambda: result.append(_ggml_threaded(weights, qtype)))
    ours = _OUT.get(("ggufkit", qtype))
    if ours is not None:  # the speed comparison is only fair if both produced the same bytes
        assert np.array_equal(ours, result[0])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_dequantize_ggufkit(benchmark, weights, qtype):
    _, dequantize_rows = KERNELS[qtype]
    blocks = _OUT.get(("ggufkit", qtype))
    if blocks is None:
        blocks = ggml_quantize(weights, qtype)
    y = np.empty(weights.shape, np.float32)
    benchmark.group = f"dequantize {qtype.name}"
    _run(benchmark, ("ggufkit", f"dequantize {qtype.name}"), lambda: dequantize_rows(blocks, y))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_dequantize_gguf_py(benchmark, weights, qtype):
    from gguf.quants import dequantize

    blocks = _OUT.get(("ggufkit", qtype))
    if blocks is None:
        blocks = ggml_quantize(weights, qtype)
    benchmark.group = f"dequantize {qtype.name}"
    _run(benchmark, ("gguf-py", f"dequantize {qtype.name}"), lambda: dequantize(blocks, qtype))


def test_report_ratios():
    lines = [f"{THREADS} threads, {N_ROWS * N_PER_ROW / 1e6:.0f}M weights",
             f"{'operation':16} {'ggufkit s':>10} {'other':>8} {'other s':>9} {'ratio':>7} {'ggufkit Mw/s':>13}"]
    for (tool, op), secs in sorted(_TIMES.items(), key=lambda kv: kv[0][1]):
        if tool == "ggufkit":
            continue
        ours = _TIMES.get(("ggufkit", op))
        if ours is None:
            continue
        lines.append(f"{op:16} {ours:10.2f} {tool:>8} {secs:9.2f} {secs / ours:7.2f} "
                     f"{N_ROWS * N_PER_ROW / ours / 1e6:13.1f}")
    print("\n" + "\n".join(lines))
