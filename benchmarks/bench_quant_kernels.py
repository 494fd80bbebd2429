"""Kernel throughput per type: ggufkit CPU kernels vs ggml's quantizer vs gguf-py's numpy quantizers.

One run, side by side, on the same F16 tensor of about 100M weights (24576 rows x 4096), every tool
starting from that F16 array (the F16 -> f32 conversion is inside each timing):

* ``ggufkit_N``: :func:`ggufkit.quant.quantize` with ``threads=N`` (all cores Numba was given);
* ``ggufkit_1``: the same at one thread;
* ``ggml_1``: ``ggml_fp16_to_fp32_row`` then ``ggml_quantize_chunk`` (ctypes, libggml-base.so of
  llama-cpp-python 0.3.36) on all rows in one call: single-threaded, as one llama-quantize worker;
* ``ggml_N``: the same on N row chunks from N Python threads (ctypes releases the GIL), which is how
  llama-quantize splits a tensor across its threads (it widens F16 on its threads too);
* ``gguf_py``: ``gguf.quants.quantize`` (numpy), for the types it has (no K-quants).

Kernels are compiled and cached by a warm-up on a tiny array first. Each timing is over the whole array: three rounds, the fastest is reported. Run::

    python -m pytest benchmarks/bench_quant_kernels.py --benchmark-enable -s -p no:cacheprovider

The last test prints M weights/s per tool and the ratios (ggml time / ggufkit time at equal threads,
gguf-py time / ggufkit time).
"""

from __future__ import annotations

import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ggml_oracle import libggml, row_bytes

from ggufkit.quant import KERNELS, quantize

# 100.7M weights; GGUFKIT_BENCH_ROWS shrinks it for a smoke run.
ROWS, N_PER_ROW = int(os.environ.get("GGUFKIT_BENCH_ROWS", 24576)), 4096
THREADS = numba.config.NUMBA_NUM_THREADS
GGUF_PY = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
TOOLS = ["ggufkit_N", "ggufkit_1", "ggml_1", "ggml_N", "gguf_py"]
# Reference paths only: the grid types need an imatrix (benchmarks/bench_quant_iq.py times them).
REF_TYPES = [q for q, k in KERNELS.items() if not k.needs_imatrix]
_TIMES: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def f16_weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    out = np.empty((ROWS, N_PER_ROW), np.float16)
    for i in range(0, ROWS, 2048):  # in slabs: no 800 MB float64 temporary
        out[i:i + 2048] = rng.standard_normal((min(2048, ROWS - i), N_PER_ROW), dtype=np.float32) * 0.02
    for qtype in REF_TYPES:  # compile (or load from cache) every kernel before timing
        quantize(out[:2].astype(np.float32), qtype)
    return out


def _ggml(x16: np.ndarray, qtype: T, threads: int) -> np.ndarray:
    # Each chunk widens its own rows with ggml's F16 to_float (ggml_fp16_to_fp32_row), as llama-quantize's
    # llama_tensor_dequantize_impl does on its worker threads (numpy's single-threaded cast is slower and
    # would flatter ggufkit).
    x16 = np.ascontiguousarray(x16)
    x = np.empty(x16.shape, np.float32)
    out = np.empty((x.shape[0], row_bytes(qtype, x.shape[1])), np.uint8)
    lib = libggml()
    lib.ggml_fp16_to_fp32_row.restype = None
    lib.ggml_fp16_to_fp32_row.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    bounds = np.linspace(0, x.shape[0], threads + 1).astype(int)

    def chunk(i: int) -> None:
        r0, r1 = int(bounds[i]), int(bounds[i + 1])
        lib.ggml_fp16_to_fp32_row(x16.ctypes.data + r0 * x.shape[1] * 2, x.ctypes.data + r0 * x.shape[1] * 4,
                                  (r1 - r0) * x.shape[1])
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, r0 * x.shape[1], r1 - r0,
                                x.shape[1], None)

    if threads == 1:
        chunk(0)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(chunk, range(threads)))
    return out


def _run(tool: str, x16: np.ndarray, qtype: T) -> np.ndarray:
    if tool == "ggufkit_N":
        return quantize(x16, qtype, threads=THREADS)
    if tool == "ggufkit_1":
        return quantize(x16, qtype, threads=1)
    if tool == "ggml_1":
        return _ggml(x16, qtype, 1)
    if tool == "ggml_N":
        return _ggml(x16, qtype, THREADS)
    return gguf_quants.quantize(x16.astype(np.float32), qtype)


CASES = [(q, tool) for q in REF_TYPES for tool in TOOLS if tool != "gguf_py" or q in GGUF_PY]


@pytest.mark.parametrize(("qtype", "tool"), CASES, ids=[f"{q.name}-{tool}" for q, tool in CASES])
def test_kernel_throughput(benchmark, f16_weights: np.ndarray, qtype: T, tool: str) -> None:
    benchmark.group = qtype.name
    out = benchmark.pedantic(_run, args=(tool, f16_weights, qtype), rounds=3, iterations=1)
    assert out.shape == (ROWS, row_bytes(qtype, N_PER_ROW))
    _TIMES[(qtype.name, tool)] = benchmark.stats.stats.min  # least disturbed by other load


def test_print_ratios() -> None:
    if not _TIMES:
        return  # benchmarks disabled (the default): nothing was timed
    n = ROWS * N_PER_ROW
    lines = [f"\nkernel throughput, {n / 1e6:.0f}M weights from F16, N = {THREADS} threads (M weights/s; ratios "
             "= other tool's time / ggufkit's time at the same thread count)"]
    for qtype in REF_TYPES:
        t = {tool: _TIMES.get((qtype.name, tool)) for tool in TOOLS}
        speeds = "  ".join(f"{tool} {n / v / 1e6:7.1f}" for tool, v in t.items() if v)
        ratios = []
        if t["ggml_1"] and t["ggufkit_1"]:
            ratios.append(f"vs ggml@1 {t['ggml_1'] / t['ggufkit_1']:.2f}x")
        if t["ggml_N"] and t["ggufkit_N"]:
            ratios.append(f"vs ggml@N {t['ggml_N'] / t['ggufkit_N']:.2f}x")
        if t["gguf_py"] and t["ggufkit_N"]:
            ratios.append(f"vs gguf-py {t['gguf_py'] / t['ggufkit_N']:.1f}x")
        lines.append(f"{qtype.name:5s} {speeds}  |  {', '.join(ratios)}")
    print("\n".join(lines))
