"""Print the environment that holds Numba, ATen and oneDNN to AVX2 on an AVX-512 CPU.

An AVX2-only machine (the 2-core AMD EPYC kind the issues measure on) is approximated on an AVX-512 host by
compiling ggufkit's kernels for AVX2 there. ``NUMBA_CPU_NAME`` alone does not do it: Numba then keeps the host's
feature list, AVX-512 included (numba/core/config.py, ``CPU_FEATURES``), so the list is written out here with
every AVX-512/AMX/AVX-VNNI feature turned off. Use::

    eval "$(python benchmarks/avx2_only.py)"   # then run any benchmark in that shell

The CPU name (``znver3`` by default, ``--cpu NAME`` for another) only tunes instruction scheduling; the
features decide which instructions exist. ggml's quantizer (libggml-base of llama-cpp-python) is compiled
without AVX at all, so on both kinds it runs the same code; llama.cpp's matmuls need a build with
``-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON`` for the same comparison.

Measured 2026-11-27 on a 2-core "Intel(R) Xeon(R) Processor" (Sapphire-Rapids class, AVX2 + AVX-512), 1
thread, F16 input (512 x 4096 for the grid and IQ4 types with a random imatrix, 2048 x 4096 without one
for the others), ggufkit and ggml (``ggml_fp16_to_fp32_row`` + ``ggml_quantize_chunk``) alternating 7-9
times in one process, bytes equal every time; ratio of the fastest times (of the medians in brackets), load
average 1-3. The machine's speed drifts by up to 40 % over minutes, so only ratios from one run compare.

========  ===========================  ===========================
type      native (AVX-512)             AVX2 only (this environment)
========  ===========================  ===========================
IQ1_S     0.32 (0.33)                  0.38 (0.35)
IQ1_M     0.36 (0.38)                  0.44 (0.44)
IQ2_XXS   0.31 (0.43)                  0.45 (0.44)
IQ2_XS    0.20 (0.20)                  0.20 (0.22)
IQ2_S     0.36 (0.41)                  0.34 (0.31)
IQ3_XXS   0.35 (0.39)                  0.42 (0.43)
IQ3_S     0.41 (0.43)                  0.43 (0.47)
IQ4_NL    0.06 (0.10)                  0.12 (0.11)
IQ4_XS    0.08 (0.08)                  0.11 (0.12)
Q8_0      0.21 (0.19)                  0.31 (0.28)
Q4_0      0.30 (0.30)                  0.34 (0.37)
Q4_1      0.30 (0.36)                  0.43 (0.49)
Q5_0      0.26 (0.32)                  0.32 (0.34)
Q5_1      0.31 (0.35)                  0.31 (0.32)
Q2_K      0.28 (0.34)                  0.26 (0.34)
Q3_K      0.44 (0.40)                  0.48 (0.46)
Q4_K      0.25 (0.28)                  0.24 (0.34)
Q5_K      0.23 (0.27)                  0.25 (0.26)
Q6_K      0.22 (0.25)                  0.24 (0.25)
TQ1_0     0.24 (0.27)                  0.40 (0.41)
TQ2_0     0.24 (0.26)                  0.40 (0.44)
MXFP4     0.32 (0.32)                  0.53 (0.41)
Q1_0      0.38 (0.29)                  0.34 (0.33)
========  ===========================  ===========================

The grid and IQ4 rows are after this stop's changes (IQ4's nearest value by midpoints: 0.61-0.79 with AVX2
before, from table gathers; IQ1/IQ2 without 64-bit lane compares and minima); the other rows were taken
earlier the same day on code this stop did not change.

Measured again the next day on a 2-core AMD EPYC (cpu family 26 model 2: Zen 5; AVX2 and AVX-512, LLVM's host
CPU ``znver5``), same script and sizes, 7 alternations, ratio of the fastest times (medians in brackets), load
about 1 (nothing else running; the 2-thread rows used both cores). MXFP4 is with its fused F16 kernel.

========  ============  ============  ============  ============
type      native 1 thr  AVX2 1 thr    native 2 thr  AVX2 2 thr
========  ============  ============  ============  ============
Q8_0      0.14 (0.07)   0.29 (0.25)   0.15 (0.15)   0.20 (0.20)
Q4_0      0.19 (0.19)   0.27 (0.27)   0.12 (0.11)   0.20 (0.17)
Q4_1      0.24 (0.25)   0.33 (0.27)   0.14 (0.32)   0.26 (0.26)
Q5_0      0.16 (0.16)   0.24 (0.21)   0.11 (0.11)   0.17 (0.10)
Q5_1      0.22 (0.22)   0.38 (0.32)   0.16 (0.14)   0.24 (0.21)
Q2_K      0.24 (0.24)   0.25 (0.25)   0.20 (0.20)   0.23 (0.24)
Q3_K      0.27 (0.28)   0.36 (0.35)   0.25 (0.25)   0.32 (0.33)
Q4_K      0.21 (0.21)   0.24 (0.24)   0.25 (0.25)   0.24 (0.25)
Q5_K      0.27 (0.26)   0.24 (0.24)   0.26 (0.27)   0.24 (0.25)
Q6_K      0.19 (0.20)   0.21 (0.20)   0.18 (0.16)   0.19 (0.20)
TQ1_0     0.22 (0.22)   0.33 (0.29)   0.16 (0.17)   0.21 (0.23)
TQ2_0     0.19 (0.19)   0.29 (0.31)   0.16 (0.16)   0.19 (0.20)
MXFP4     0.21 (0.21)   0.31 (0.31)   0.16 (0.16)   0.23 (0.22)
Q1_0      0.17 (0.17)   0.22 (0.26)   0.15 (0.15)   0.17 (0.18)
IQ4_NL    0.07 (0.07)   0.15 (0.15)   0.07 (0.07)   0.10 (0.09)
IQ4_XS    0.07 (0.07)   0.10 (0.10)   0.07 (0.07)   0.10 (0.11)
IQ1_S     0.31 (0.33)   0.37 (0.37)   0.32 (0.33)   0.37 (0.34)
IQ1_M     0.30 (0.30)   0.35 (0.36)   0.30 (0.30)   0.37 (0.36)
IQ2_XXS   0.33 (0.35)   0.37 (0.37)   0.33 (0.34)   0.34 (0.35)
IQ2_XS    0.21 (0.21)   0.24 (0.23)   0.21 (0.22)   0.24 (0.24)
IQ2_S     0.34 (0.37)   0.34 (0.35)   0.35 (0.36)   0.35 (0.36)
IQ3_XXS   0.44 (0.45)   0.38 (0.38)   0.44 (0.44)   0.37 (0.37)
IQ3_S     0.38 (0.38)   0.38 (0.39)   0.37 (0.36)   0.37 (0.38)
========  ============  ============  ============  ============

On this CPU LLVM does not prefer 256-bit vectors (its Intel server targets do). Compiling everything with
``+prefer-256-bit`` added to the host features brought IQ3_XXS to 0.34 and IQ3_S to 0.33 at 1 thread, but
slowed most other rows (Q5_1 0.28, Q3_K 0.32, IQ2_S 0.48, IQ2_XS 0.30, IQ4_NL 0.14), so it is not set; Numba
has one feature set per process.
"""

from __future__ import annotations

import argparse
import shlex

from llvmlite import binding as llvm

# LLVM feature names of instruction sets that an AVX2-only AMD EPYC (Zen 2/3) lacks.
_OFF_PREFIXES = ("avx512", "amx", "avx10", "avxvnni", "avxifma", "avxneconvert", "evex512", "gfni")


def avx2_features() -> str:
    """The host's LLVM feature string with every AVX-512-class feature turned off."""
    out = []
    for feature in llvm.get_host_cpu_features().flatten().split(","):
        name = feature[1:]
        out.append(f"-{name}" if name.startswith(_OFF_PREFIXES) else feature)
    return ",".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", default="znver3", help="LLVM CPU name for Numba's scheduling model")
    args = ap.parse_args()
    env = {"NUMBA_CPU_NAME": args.cpu, "NUMBA_CPU_FEATURES": avx2_features(),
           "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))


if __name__ == "__main__":
    main()
