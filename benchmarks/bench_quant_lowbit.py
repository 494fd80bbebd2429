"""Kernel time of Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 and Q1_0: ggufkit vs ggml, in process.

Both sides quantize the same float32 tensor (default 4096 rows x 4096 = 16.8M weights, from F16 values of
sigma 0.02) at the same thread count, without and with an imatrix:

* ggufkit: the type's CPU kernel from ``ggufkit.quant.KERNELS`` with Numba's thread count set to N;
* ggml: ``ggml_quantize_chunk`` (ctypes, libggml-base.so of llama-cpp-python 0.3.36) on N row chunks from N
  Python threads (ctypes releases the GIL), as llama-quantize splits a tensor across its threads.

Each timing is the best of ``--rounds``; the bytes of both sides are compared. Both sides take the float32
array as it is: no F16 widening is timed on either side (``benchmarks/bench_quant_kernels.py`` times the
whole path from F16, ggml widening with its own ``ggml_fp16_to_fp32_row`` as llama-quantize does). Ratio = ggufkit's time /
ggml's time (lower is better; the issue's target is <= 0.5). Run::

    python benchmarks/bench_quant_lowbit.py [--rows 4096] [--threads N] [--rounds 2] [--types Q2_K,Q3_K]

``--types`` takes any type of ``ggufkit.quant.KERNELS`` (the legacy types too; the grid types only with
their imatrix, since ggml has no reference quantizer for them).

Measured 2026-11-27 on a shared 2-core "Intel(R) Xeon(R) Processor" (AVX2, AVX-512 F/BW/CD/DQ/VL/IFMA/VBMI/
VNNI/BF16/FP16), with the load average at 9-14 throughout (other jobs on both cores), so single timings
vary by up to 2x between runs; 1 thread each side, from the same F16 array (``ggufkit.quant.quantize`` on
the F16 array vs ``ggml_quantize_chunk`` on its f32 widening, widening inside the timing), imatrix
uniform in [0.01, 2.01), ratio = ggufkit time / ggml time, bytes equal in every run:

=======  =======  ==================  ====================================
type     path     before (8M weights)  after (4M, median of 5 paired runs)
=======  =======  ==================  ====================================
Q4_0     imatrix  1.81                0.42
Q4_1     imatrix  1.03                0.50
Q5_0     imatrix  1.93                0.40
Q5_1     imatrix  1.42                0.43
=======  =======  ==================  ====================================

At 2 threads after the change: Q4_0 0.38-0.39, Q4_1 0.37-0.47, Q5_0 0.39-0.81 (one disturbed run),
Q5_1 0.44-0.47. The change: ggml's make_qx_quants / make_qkx3_quants try 19 / 37 trial scales one after
another; ggufkit.quant.kernels.legacy.fit evaluates them as vector lanes (same float32 operations per trial,
same order of decisions). The legacy reference paths and Q8_0 (which ignores the imatrix) were not
changed (Q4_0-Q5_1 reference 0.6-1.0, Q8_0 0.33-0.69 in these runs: memory and load bound), nor were the K-quant, IQ and low-bit kernels (before, same conditions: Q2_K 0.29-0.32,
Q3_K 0.71 ref / 0.20 imatrix, Q4_K-Q6_K 0.21-0.41, IQ4_NL/IQ4_XS 0.30-0.37, TQ1_0/TQ2_0 0.41-0.54,
MXFP4 0.60-0.66, Q1_0 0.15-0.21, IQ2_XXS 0.31, IQ2_XS 0.28, IQ2_S 0.07, IQ1_S 0.02, IQ3_XXS 0.85-1.0,
IQ3_S 0.7-1.6, IQ1_M 0.90).

Remeasured 2026-11-27 on the same machine, load average 3.5-4.3, 4.2M weights (1024 rows), ggufkit and
ggml alternating round by round (7 rounds, median ratio of wall time; in brackets the ratio of process CPU
time), after the TQ1_0/TQ2_0, MXFP4 and Q3_K reference kernels were reworked and Numba's OpenMP pool was
started with the passive wait policy (``ggufkit.quant.dispatch.start_numba_threads``: libgomp's spinning
threads had made 2 threads slower than 1 on the loaded machine, TQ1_0 0.84 at 2 threads from F16):

=======  ============================  ============================
type     f32 kernel, 1 / 2 threads     from F16 (``quantize``), 1 / 2
=======  ============================  ============================
TQ1_0    0.07 (0.11) / 0.17 (0.12)     0.23 (0.22) / 0.22 (0.21)
TQ2_0    0.05 (0.12) / 0.10 (0.10)     0.20 (0.18) / 0.22 (0.19)
MXFP4    0.23 (0.24) / 0.23 (0.29)     0.34 (0.33) / 0.29 (0.33)
Q3_K     0.68 (0.72) / 0.59 (0.57)     0.56 (0.56) / 0.53 (0.54)
=======  ============================  ============================

This script itself (best of 3, one side after the other, 2 threads): TQ1_0 0.10, TQ2_0 0.06, MXFP4
0.22, Q3_K ref 0.49. Q3_K's reference path stayed above 0.5: of its ~8 ms per 1M weights (1 thread, quiet
machine) the lane fit took ~4.5 (group maxima ~1.5, first rounding ~0.4, first refinement pass ~0.9, the
later passes on the compacted lanes ~1.7), copying the quants back into block order ~1.1, the
requantization, bit packing and scales ~1.3, the transposition into lanes ~0.9.

Remeasured 2026-11-27 on the same 2-core Xeon (AVX-512), load average 2.0-3.4 (other jobs on both cores),
after Q3_K moved to ``ggufkit.quant.kernels.kquants.q3k_chunk`` (no masked stores in the lane loops, so the group maxima
take ~0.2 ms per 1M weights instead of ~1.5; vectorized compacted passes; no copy of the fitted quants
back into block order; no per-block calls taking arrays; imatrix path: weights in lane order, two trial
scales per pass over the weights, the 16-scale fits of all blocks side by side). An A/B run outside this
script (the old kernel module taken from git, the new one and ggml alternating round by round, same
array and thread count), 4.2M weights, 9 rounds, median of the per-round ratios (in brackets: best time
over best time), bytes equal on all three, load 2.0-2.8:

=======  =======  ===========================  ===========================
type     path     1 thread, before -> after    2 threads, before -> after
=======  =======  ===========================  ===========================
Q3_K     ref      0.50 (0.36) -> 0.32 (0.26)   0.53 (0.52) -> 0.33 (0.33)
Q3_K     imatrix  0.34 (0.34) -> 0.24 (0.22)   0.39 (0.39) -> 0.25 (0.24)
=======  =======  ===========================  ===========================

(An earlier A/B of the reference path at load ~3: 1 thread 0.60 -> 0.29, 2 threads 0.56 -> 0.32.) This
script (16.8M weights, one side after the other, so single runs swing with the load): 2 threads Q3_K ref
0.27-0.28, imatrix 0.22; 1 thread (three runs) ref 0.22-0.40, imatrix 0.17-0.29. Q2_K, not changed: 2
threads 0.28 ref / 0.32 imatrix, 1 thread 0.30 / 0.29. At load ~2 (1 thread, 4.2M weights, best of 7
alternating) the reference path went from 7.6 to 4.8 ms per 1M weights (ggml 14.3).

IQ4_NL/IQ4_XS after their nearest value became a count of midpoints (no table gathers), 2026-11-27, F16
input, paired in one process: 1024 x 4096 without an imatrix, 1 / 2 threads, 0.30-0.36 -> 0.07-0.09 (AVX-512
build) and 0.61-0.79 -> 0.10-0.14 (Numba held to AVX2, ``benchmarks/avx2_only.py``); 512 x 4096 with an
imatrix, 1 thread: 0.06-0.08 (AVX-512), 0.11-0.12 (AVX2). The CUDA kernels run the same code: on an H200
14.9 -> 40.1 GB/s (IQ4_NL) and 13.1 -> 35.9 GB/s (IQ4_XS) of F16-equivalent input, bytes equal to the CPU's.

MXFP4 from F16 with a fused kernel (quant/kernels/lowbit/mxfp4_f16.py: each row widened inside the parallel loop instead of a
separate widening pass), 2048 x 4096, 1 thread, paired in one process with the two-pass path and ggml, 7-9
alternations: AMD EPYC (Zen 5) 0.29 -> 0.20 (AVX-512 build), 0.37 -> 0.30 (Numba held to AVX2).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ggml_oracle import libggml, row_bytes

from ggufkit.quant import KERNELS
from ggufkit.quant.dispatch import start_numba_threads

TYPES = [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0, T.MXFP4, T.Q1_0]
N_PER_ROW = 4096


def cpu_description() -> str:
    """CPU model and its AVX2 / AVX-512 flags, from /proc/cpuinfo where there is one."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    model = model or platform.processor() or "unknown CPU"
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    return (f"{model}; AVX2 {'yes' if 'avx2' in flags else 'no'}; "
            f"AVX-512 {' '.join(avx512) if avx512 else 'no'}")


def _ggml(x: np.ndarray, qtype: T, qw: np.ndarray | None, threads: int) -> np.ndarray:
    out = np.empty((x.shape[0], row_bytes(qtype, x.shape[1])), np.uint8)
    lib = libggml()
    bounds = np.linspace(0, x.shape[0], threads + 1).astype(int)
    qw_ptr = None if qw is None else qw.ctypes.data

    def chunk(i: int) -> None:
        r0, r1 = int(bounds[i]), int(bounds[i + 1])
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, r0 * x.shape[1], r1 - r0, x.shape[1],
                                qw_ptr)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(chunk, range(threads)))
    return out


def _best(fn, rounds: int) -> tuple[float, np.ndarray]:  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--types", default=",".join(t.name for t in TYPES))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, N_PER_ROW), dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)
    imatrix = rng.gamma(0.5, 2.0, N_PER_ROW).astype(np.float32)
    start_numba_threads()  # as ggufkit.quant.quantize starts the pool (OpenMP's passive wait policy)
    numba.set_num_threads(args.threads)
    print(f"{x.size / 1e6:.1f}M weights, {args.threads} threads, best of {args.rounds}; {cpu_description()}")
    print(f"{'type':7s} {'path':8s} {'ggufkit s':>10s} {'ggml s':>10s} {'ratio':>6s}  bytes")
    for name in args.types.split(","):
        qtype = T[name]
        quantize_rows = KERNELS[qtype].cpu()[0]
        for label, qw in (("ref", None), ("imatrix", imatrix)):
            w = np.zeros(0, np.float32) if qw is None else qw
            out = np.empty((x.shape[0], row_bytes(qtype, N_PER_ROW)), np.uint8)
            quantize_rows(x[:2], w, out[:2])  # compile or load from the cache before timing

            t_ours, a = _best(lambda f=quantize_rows, w=w, out=out: (f(x, w, out), out)[1], args.rounds)
            t_ggml, b = _best(lambda t=qtype, qw=qw: _ggml(x, t, qw, args.threads), args.rounds)
            same = "equal" if np.array_equal(a, b) else "DIFFER"
            print(f"{name:7s} {label:8s} {t_ours:10.3f} {t_ggml:10.3f} {t_ours / t_ggml:6.2f}  {same}", flush=True)


if __name__ == "__main__":
    main()
