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

Q6_K, measured 2026-11-27 on a shared 2-core "Intel(R) Xeon(R) Processor" (AVX2, AVX-512 F/BW/CD/DQ/VL/
IFMA/VBMI/VNNI/BF16/FP16; LLVM picks 256-bit vectors for it), load average 1.3-2.2 (other jobs on both
cores), 4096 x 4096 F16 weights (sigma 0.02), from F16 on both sides (ggml: ``ggml_fp16_to_fp32_row`` then
``ggml_quantize_chunk`` on N row chunks from N Python threads; ggufkit: ``ggufkit.quant.quantize``).
Where the time went before (1 thread, stripped-down copies of the kernel on fixed data, ms for the 16.8M
weights): widening to a float32 copy 11, gathering x, x^2 and x^3 into lanes 30, the lane fits
(``make_qx_quants_lanes``) 168, copying the quants back into blocks 15, ``_q6k_finish_block`` per block
118 (a call taking five arrays, two passes over each sub-block, the packing): ~350. The kernel now runs
``ggufkit.quant.kernels.kquants.q6k_chunk.q6k_chunk``: the fits with ``q3k_cpu._qx_lanes`` (two trial scales per pass, no
masked stores), the int8 scales per block, the requantization in lane layout (one division and a select
per weight; a block with a quotient off round_clamp's range goes to the scalar block function), one
transposition back, byte packing; F16 rows are widened one at a time inside the row loop
(``ggufkit.quant.kernels.kquants.cpu_f16``). After (same method, load 1.7, ms): gather and weights 16, fits 111,
scales 5, requantization 7, transposition 7, packing 3: ~150, plus ~10 of widening. The fits are now 3/4
of the time; a Q6_K-only fit rounding with ``rint`` and keeping only the clamps that can act (9 pairs of
trial scales: none for is <= -6, the upper one up to is = 4) measured the same (92.1 vs 92.8, 178.7 vs
171.3 ms per 1M lanes, in cache: ``vroundps`` is two uops, as the add/subtract of 1.5*2^23) and was left out.
A/B in one process (main's kernel with its two-pass F16 path, the new path and ggml alternating, 9 rounds,
median of the per-round ratios ggufkit / ggml; in brackets best time over best time), bytes equal on all
three in every round; imatrix uniform in [0.01, 2.01):

=======  ============================  ============================
path     1 thread, before -> after     2 threads, before -> after
=======  ============================  ============================
ref      0.38 (0.39) -> 0.25 (0.23)    0.41 (0.38) -> 0.24 (0.25)
imatrix  0.56 (0.40) -> 0.29 (0.24)    0.42 (0.37) -> 0.28 (0.24)
=======  ============================  ============================

(An earlier round of the same A/B at load 1.7-1.8: ref 0.40 -> 0.21 / 0.44 -> 0.26, imatrix 0.45 -> 0.31 /
0.41 -> 0.24 at 1 / 2 threads.) The Q6_K tensors of the presets (Q4_K_M's attn_v, ffn_down, output) take
the same fused kernel, from F16 sources with at least 64 rows (``dispatch._FUSED_MIN_ROWS``), and
``quantize_rows_q6_K`` (the same ``q6k_chunk``) otherwise.
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

from ggufkit.quant.kernels.kquants import cpu as kquants

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
