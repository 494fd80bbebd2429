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
