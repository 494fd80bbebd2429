"""Whole-process quantization, start-up included: the ``ggufkit quantize`` command vs the ``llama-quantize`` binary.

The in-process benchmarks (``bench_quantize.py``, ``bench_quant_*.py``) time the work with every kernel
already loaded. A CI job runs the command, so importing Python, NumPy and Numba, loading the cached kernels
and building the grid types' tables count too. This runs both tools as fresh processes, interleaved, on the
same F16 llama GGUF shaped like SmolLM2-135M (576 wide, 30 layers, 9 heads / 3 KV heads, FFN 1536; a
32000-token vocabulary, ~143M weights), at the same thread count, and prints the medians of wall and CPU
(user + system) seconds with their ratios (ggufkit / llama.cpp: below 1 means ggufkit is faster). The grid
types get the same random importance matrix file (llama-imatrix's GGUF layout) on both sides.

``llama-quantize`` is the binary built from the llama.cpp vendored in llama-cpp-python 0.3.36
(``tests/llama_cpp_sources.py``); ``ggufkit`` is the console script next to this Python. Numba's cache is
warmed by one untimed run of each type first (compiling is paid once per install). Run::

    python benchmarks/bench_quantize_process.py [--types q8_0,q4_0,q4_k_m,iq2_xxs] [--runs 5] [--threads 2]

Before every timed run the last output is deleted and ``sync`` writes every dirty page out (untimed), so no run
pays for freeing the previous file or for the disk writing back the other tool's output. ggufkit fsyncs its
output before renaming it into place; llama-quantize does not, so the ``+fsync`` column adds a ``sync -d`` of
its output (the same durable file). The ``floor`` column is a Python process that imports NumPy and Numba,
reads the input once and writes, fsyncs and renames as many bytes as the output, with no quantizing at all:
where ``floor ratio`` (floor / llama-quantize) is above 0.5, no Python + Numba process can reach half of
llama-quantize's time on that model and machine.

``--together`` times the whole list as one ``ggufkit quantize --type a,b,...`` process against one
``llama-quantize`` process per type (a publisher's matrix of files from one F16 model).

Measured: see the notes at the end of this file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _target_common import Timed, load, machine, timed
from fixtures_quantize import imatrix_values, make_llama_gguf, write_imatrix_gguf
from llama_cpp_sources import tool_path

from ggufkit.quant.llama_quantize.presets import ALIASES, PRESETS

# Rows whose default type is a grid type (IQ1/IQ2/IQ3) or that need an imatrix: both tools get the same one.
IMATRIX_TYPES = {n for n, p in PRESETS.items() if p.needs_imatrix or p.default_type.name[:3] in ("IQ1", "IQ2", "IQ3")}
#: ``--types all``: every llama-quantize row except the aliases (q3_k, q4_k, q5_k).
ALL_TYPES = [n for n in PRESETS if n not in ALIASES]


# llama shapes: SmolLM2-135M's (~143M weights) and TinyLlama-1.1B's (~1.1B weights),
# (n_embd, n_ff, n_layer, n_head, n_head_kv); both with a 32000-token vocabulary.
SHAPES = {"135m": (576, 1536, 30, 9, 3), "1b": (2048, 5632, 22, 32, 4)}


def build_model(folder: Path, shape: str = "135m") -> tuple[Path, Path]:
    """An F16 llama model of the given shape and a random imatrix for it."""
    n_embd, n_ff, n_layer, n_head, n_head_kv = SHAPES[shape]
    model = make_llama_gguf(folder / "model-f16.gguf", n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head,
                            n_head_kv=n_head_kv, n_vocab=32000)
    imatrix = write_imatrix_gguf(folder / "imatrix.gguf", imatrix_values(model))
    return model, imatrix


def commands(target: str, model: Path, imatrix: Path, out: Path, threads: int) -> tuple[list[str], list[str]]:
    """(ggufkit, llama-quantize) command lines for one type."""
    ggufkit = str(Path(sys.executable).with_name("ggufkit"))
    ours = [ggufkit, "quantize", str(model), str(out), "--type", target, "--threads", str(threads)]
    theirs = [str(tool_path("llama-quantize"))]
    if target in IMATRIX_TYPES:
        ours += ["--imatrix", str(imatrix)]
        theirs += ["--imatrix", str(imatrix)]
    theirs += [str(model), str(out), target, str(threads)]
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="135m",
                        help="model shape: 135m (~143M weights) or 1b (~1.1B)")
    parser.add_argument("--types", default="q8_0,q4_0,q4_k_m",
                        help="comma-separated llama-quantize type names, or 'all' (every row but the aliases)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each tool per type (interleaved)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the outputs go (default: the temporary folder holding the model); /dev/shm "
                             "takes the disk out of the comparison")
    parser.add_argument("--together", action="store_true",
                        help="the whole list as one `ggufkit quantize --type a,b,...` process against one "
                             "llama-quantize process per type (a publisher's matrix of files)")
    args = parser.parse_args()
    print(machine(), f"load {load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, imatrix = build_model(folder, args.shape)
        print(f"model: {model.stat().st_size >> 20} MiB of F16, threads {args.threads}", flush=True)
        targets = ALL_TYPES if args.types == "all" else args.types.split(",")
        out_dir = args.out_dir or folder
        if args.together:
            together(targets, model, imatrix, out_dir, args.threads, args.runs)
            return
        print(f"{'type':8} {'ggufkit s':>9} {'llama s':>7} {'+fsync s':>8} {'wall ratio':>10} {'vs +fsync':>9} "
              f"{'cpu ratio':>9} {'floor s':>7} {'floor ratio':>11}  load")
        for target in targets:
            out = out_dir / "out.gguf"
            ours, theirs = commands(target, model, imatrix, out, args.threads)
            try:
                timed(ours)  # warm Numba's cache (and the page cache) untimed
            except RuntimeError as error:
                # Q1_0's 128-weight blocks on 576-wide rows: llama-quantize has no fallback type either.
                if subprocess.run(theirs, capture_output=True).returncode == 0:
                    raise
                print(f"{target:8} refused by both tools: {str(error).strip().splitlines()[-1]}", flush=True)
                continue
            floor_cmd = io_floor_command(model, out, out.stat().st_size)
            runs: dict[str, list[Timed]] = {"ggufkit": [], "llama": [], "fsync": [], "floor": []}
            for _ in range(args.runs):
                settle(out)
                runs["floor"].append(timed(floor_cmd, poll_s=0.001))
                settle(out)
                runs["ggufkit"].append(timed(ours, poll_s=0.01))
                settle(out)
                runs["llama"].append(timed(theirs, poll_s=0.01))
                runs["fsync"].append(timed(["sync", "-d", str(out)], poll_s=0.001))
            settle(out)
            wall = {k: statistics.median(t.seconds for t in v) for k, v in runs.items()}
            cpu = {k: statistics.median(t.cpu_seconds for t in v) for k, v in runs.items()}
            durable = statistics.median(a.seconds + b.seconds for a, b in zip(runs["llama"], runs["fsync"]))
            loads = [t.load_before for v in runs.values() for t in v]
            print(f"{target:8} {wall['ggufkit']:9.2f} {wall['llama']:7.2f} {durable:8.2f} "
                  f"{wall['ggufkit'] / wall['llama']:10.2f} {wall['ggufkit'] / durable:9.2f} "
                  f"{cpu['ggufkit'] / cpu['llama']:9.2f} {wall['floor']:7.2f} {wall['floor'] / wall['llama']:11.2f}  "
                  f"{min(loads):.1f}-{max(loads):.1f}", flush=True)


def settle(out: Path) -> None:
    """Untimed, between runs: remove the last output and write every dirty page out, so that no run pays for
    freeing the previous file or for the disk writing it back."""
    out.unlink(missing_ok=True)
    os.sync()


# What any Python + NumPy + Numba quantizer must do at least, without quantizing: start, import both, read
# the input once into one reused buffer, write as many bytes as the real output, fsync, rename into place.
_IO_FLOOR = """
import os, sys, numpy, numba
src, dst, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = bytearray(64 << 20)
with open(src, "rb", buffering=0) as f:
    while f.readinto(buf):
        pass
tmp = dst + ".floor"
with open(tmp, "wb", buffering=0) as f:
    while size > 0:
        size -= f.write(memoryview(buf)[:min(size, len(buf))])
    os.fsync(f.fileno())
os.replace(tmp, dst)
"""


def io_floor_command(model: Path, out: Path, out_bytes: int) -> list[str]:
    """A Python process that does no quantizing but everything else a whole run must (``_IO_FLOOR``): where its
    time is above half of llama-quantize's, no Python/Numba tool can reach the 0.5 target on this machine."""
    return [sys.executable, "-c", _IO_FLOOR, str(model), str(out), str(out_bytes)]


def together(targets: list[str], model: Path, imatrix: Path, folder: Path, threads: int, runs: int) -> None:
    """One ggufkit process writing every type (start-up paid once) vs llama-quantize once per type."""
    ours = commands(",".join(targets), model, imatrix, folder / "ours-{type}.gguf", threads)[0]
    if any(t in IMATRIX_TYPES for t in targets) and "--imatrix" not in ours:
        ours += ["--imatrix", str(imatrix)]
    theirs = [commands(t, model, imatrix, folder / "out.gguf", threads)[1] for t in targets]
    timed(ours)  # warm Numba's cache (and the page cache) untimed
    mine: list[Timed] = []
    sums: list[tuple[float, float]] = []
    for _ in range(runs):
        for old in folder.glob("ours-*.gguf"):  # named by the QUANT_OPTIONS spelling of each type
            old.unlink()
        settle(folder / "out.gguf")
        mine.append(timed(ours, poll_s=0.01))
        each = []
        for cmd in theirs:
            settle(folder / "out.gguf")
            each.append(timed(cmd, poll_s=0.01))
        sums.append((sum(t.seconds for t in each), sum(t.cpu_seconds for t in each)))
    for old in folder.glob("ours-*.gguf"):
        old.unlink()
    settle(folder / "out.gguf")
    wall = statistics.median(t.seconds for t in mine), statistics.median(w for w, _ in sums)
    cpu = statistics.median(t.cpu_seconds for t in mine), statistics.median(c for _, c in sums)
    print(f"{len(targets)} types in one run ({','.join(targets)}): wall {wall[0]:.2f} vs {wall[1]:.2f} s "
          f"({wall[0] / wall[1]:.2f}), CPU {cpu[0]:.2f} vs {cpu[1]:.2f} s ({cpu[0] / cpu[1]:.2f})", flush=True)


if __name__ == "__main__":
    main()

# Notes (ratio ggufkit / llama-quantize), 2026-11-27, Intel Xeon (Sapphire-Rapids class, AVX2 + AVX-512), 2 cores,
# 2 threads, with .pyc files written (PYTHONDONTWRITEBYTECODE unset, as a pip install leaves them):
#   quiet machine (load 1.0-1.5), 5 interleaved runs, medians:
#     q8_0    wall 1.20 vs 1.20 s (1.00), CPU 1.38 vs 1.61 s (0.85)
#     q4_0    wall 0.98 vs 0.71 s (1.38), CPU 1.15 vs 0.97 s (1.19)
#     q4_k_m  wall 1.46 vs 1.96 s (0.74), CPU 1.93 vs 3.21 s (0.60)
#   For the fast types a 135M model is start-up-bound: in a profile of the q4_0 run (1.08 s) the kernels were
#   0.17 s; importing NumPy, Numba and the CLI, reading .pyc files and loading two cached kernels the most of
#   the rest. Loading the kernels no longer sets up Numba's whole compiler (quant/kernels/numba_loading.py), which
#   took ~0.35 s of CPU per command before. What is left is Python's and Numba's own import cost.
#   loaded machine (load 4-5.7, one run each): iq2_xxs wall 19.5 vs 77.8 s (0.25), CPU 13.7 vs 39.4 s (0.35);
#   iq1_m wall 31.8 vs 89.3 s (0.36), CPU 15.1 vs 43.6 s (0.35). ggml's grid-table set-up
#   (ggml_quantize_init) alone took 2.7 s for IQ2_XXS and 12-24 s for IQ1_S/IQ1_M in a fresh process here;
#   ggufkit builds its tables in 1-4.4 s.
#
# 2026-11-27, later (same machine; after the IQ1_S and Q6_K kernel rounds and the float-target changes).
#   Every row, 135M shape, 1 run each, load 1.8-4.5 (two engineers' jobs running; CPU ratios are the steadier):
#     type        wall s ours/llama   wall  CPU    | type        wall s ours/llama   wall  CPU
#     q4_0        2.09 / 1.73         1.21  1.29   | iq3_xxs     14.18 / 35.20       0.40  0.38
#     q4_1        2.37 / 1.95         1.21  1.23   | iq3_s        9.83 / 27.66       0.36  0.33
#     mxfp4_moe   2.39 / 3.07         0.78  0.90   | iq3_xs      16.80 / 42.81       0.39  0.38
#     q5_0        1.73 / 2.13         0.81  0.98   | q3_k_s       1.60 / 1.39        1.15  1.19
#     q5_1        1.89 / 1.72         1.10  1.06   | q3_k_m       2.15 / 3.74        0.57  0.51
#     iq2_xxs    18.99 / 62.56        0.30  0.32   | q3_k_l       2.67 / 4.03        0.66  0.62
#     iq2_xs     23.46 / 48.30        0.49  0.30   | iq4_nl      14.12 / 36.36       0.39  0.34
#     iq2_s      16.31 / 33.83        0.48  0.26   | iq4_xs      12.76 / 30.31       0.42  0.36
#     iq2_m      10.33 / 31.96        0.32  0.30   | q4_k_s       1.91 / 4.57        0.42  0.50
#     iq1_m      12.55 / 29.81        0.42  0.32   | q4_k_m       2.07 / 2.73        0.76  0.58
#     tq1_0       1.74 / 1.51         1.16  1.04   | q5_k_s       1.71 / 2.68        0.64  0.52
#     tq2_0       1.72 / 1.18         1.46  1.20   | q5_k_m       1.67 / 2.64        0.63  0.66
#     q2_k        2.18 / 1.47         1.48  1.05   | q8_0         1.16 / 1.69        0.69  0.69
#     q2_k_s      4.32 / 7.50         0.58  0.48   | f32          1.18 / 1.05        1.13  1.34
#   (q1_0: both tools refuse this model -- 576-wide rows, no fallback type for Q1_0's 128-weight blocks.)
#   Quieter (load 1.1-1.6), after the changes: iq1_s 9.12 vs 26.28 s (0.35) CPU 0.29; iq3_m 9.51 vs 23.01 s (0.41)
#   CPU 0.39; 3 runs: q8_0 1.10 / CPU 0.85, q4_0 1.40 / 1.17, q6_k 0.85 / 0.67, f16 1.49 / 2.27, bf16 1.62 / 1.68
#   (2.78 s -> 1.46 s with the Numba BF16 pass), copy 1.30 / 1.60.
#   At 135M every row whose tool takes ~1-4 s in llama-quantize is bound by ggufkit's start-up (~0.45 CPU-s of
#   imports: NumPy 0.1, gguf 0.05, Numba 0.2; ~0.1 per cached kernel loaded). The same rows on the 1.1B shape
#   (--shape 1b), 1 run each, load 1.3-4.7:
#     q8_0 3.45 vs 7.43 s (0.46) CPU 0.43      q4_0 2.95 vs 7.03 (0.42) CPU 0.49    q4_1 6.83 vs 11.40 (0.60) CPU 0.44
#     q5_0 5.28 vs 11.69 (0.45) CPU 0.41       q5_1 5.80 vs 11.21 (0.52) CPU 0.44  mxfp4_moe 4.59 vs 10.46 (0.44) 0.33
#     tq2_0 5.27 vs 13.59 (0.39) CPU 0.34      q2_k 19.26 vs 44.97 (0.43) 0.40     q2_k_s 52.93 vs 137.38 (0.39) 0.32
#     q3_k_s 6.40 vs 13.83 (0.46) CPU 0.40     q3_k_m 11.27 vs 27.61 (0.41) 0.36   q3_k_l 11.15 vs 26.72 (0.42) 0.38
#     q4_k_m 26.85 vs 112.36 (0.24) CPU 0.30   q5_k_s 17.27 vs 51.71 (0.33) 0.30   q5_k_m 16.39 vs 52.36 (0.31) 0.28
#     q6_k 11.56 vs 31.18 (0.37) CPU 0.33      (q6_k before the Q6_K round: 30.62 vs 84.06 s, 0.36 / CPU 0.44)
#   Float rows at 1.1B, load 1.2-1.4: f16 5.15 vs 3.91 s (1.32) CPU 1.87; bf16 6.78 vs 6.35 (1.07) CPU 1.14;
#   f32 10.30 vs 10.87 (0.95) CPU 0.94; copy 3.55 vs 5.41 (0.66) CPU 0.80. These are copies and element
#   conversions bound by reading and writing the file: ggufkit reads each tensor into a buffer (pread) and
#   writes it, one copy more than a writer from a mapping; f16 and copy run the same plan (every tensor copied),
#   so their difference is run-to-run I/O noise.
#   AVX2 only (eval "$(python benchmarks/avx2_only.py)": ggufkit's Numba compiled without AVX-512; llama-quantize's
#   quantizer is SSE2 code either way), 1.1B shape, 3 interleaved runs, loaded (load 3.0-4.9: two other jobs on
#   the 2 cores, so both sides slow down), medians, wall / CPU ratio:
#     q8_0 8.36 vs 19.19 s (0.44) CPU 0.49     q4_0 10.16 vs 18.67 (0.54) CPU 0.54  q4_1 8.88 vs 18.62 (0.48) 0.52
#     q5_1 18.37 vs 25.53 (0.72) CPU 0.57      q4_k_m 53.25 vs 184.65 (0.29) 0.27   q6_k 28.94 vs 92.48 (0.31) 0.30
#   The fast rows' extra CPU time on a loaded box is reading (pread, ~2 s of 2.1 GB) and writing, not the kernels
#   (~1.7 CPU-s for q4_0's 1.1B weights at AVX2); the output's f16 scale check now costs ~0.15 s instead of ~0.65.
#
# AMD EPYC (cpu family 26 model 2: Zen 5; AVX2 + AVX-512), 2 cores, 2 threads, 2026-11-27 (ratio ggufkit /
# llama-quantize, wall / CPU, medians; load 1-2):
#   1.1B shape, 2-3 runs: q8_0 0.68-0.72 / 0.54-0.57, q4_0 0.57-0.69 / 0.45-0.55, q4_1 0.73-0.83 / 0.58-0.67,
#   q5_0 0.59 / 0.46, q5_1 0.68-0.72 / 0.54-0.56, mxfp4_moe 0.58 / 0.45, tq2_0 0.47 / 0.36 (llama-quantize does
#   1.1B q4_0 in 2.96-3.18 s here); 1 run: q4_k_m 8.94 vs 27.25 s (0.33 / 0.27), q6_k 0.24 / 0.21, q3_k_m 0.31 / 0.29.
#   135M shape, 3 runs: q8_0 1.25 / 1.04, q4_0 1.21 / 1.25, q4_1 1.48, q5_1 1.31, tq2_0 1.56, q4_k_m 0.66 / 0.68,
#   q6_k 0.79, mxfp4_moe 0.91; 1 run: iq2_xxs 0.23 / 0.20, iq3_xxs 0.25 / 0.22, iq1_s 0.15 / 0.12, iq2_m 0.16 / 0.13,
#   iq4_xs 0.13 / 0.11. A fresh process spends ~0.07 s importing ggufkit.quant and ~0.2 s on its first kernel
#   (Numba's import and runtime set-up included); each further cached kernel loads in 0.01-0.02 s.
#   --together (one ggufkit process for every type vs one llama-quantize process per type), .pyc files present:
#     135M, q2_k,q3_k_s,q3_k_m,q3_k_l,q4_0,q4_k_s,q4_k_m,q5_k_s,q5_k_m,q6_k,q8_0, 2 runs: 3.87 vs 9.05 s (0.43), CPU 0.35
#     135M, q8_0,q4_0,q4_1,q5_1,q4_k_m,q6_k, 3 runs: 1.93 vs 3.64 s (0.53), CPU 0.42
#     1.1B, the same 11 types, 1 run: 57.54 vs 185.45 s (0.31), CPU 91.97 vs 337.34 s (0.27)
#
# AMD EPYC (Zen 5, AVX2 + AVX-512), 2 cores, 2 threads, after settle() (untimed unlink + sync before every run)
# and with the floor column; medians; wall ratio / vs llama-quantize + fsync / CPU ratio; floor ratio:
#   135M shape, 5 runs, load 0.1-1.5:
#     q8_0 1.17 / 1.05 / 0.95, floor 1.16      q4_0 1.51 / 1.41 / 1.34, floor 0.94   q4_1 1.67 / 1.51, floor 1.03
#     q5_0 1.31 / 1.18, floor 1.05             q5_1 1.48 / 1.36, floor 1.14          tq1_0 1.33 / 1.25, floor 0.89
#     tq2_0 1.56 / 1.47, floor 0.94            mxfp4_moe 1.17 / 1.04, floor 1.00     q2_k 1.23 / 1.16, floor 0.70
#     q3_k_s 1.29 / 1.21, floor 0.82           q3_k_m 0.79 / 0.77, floor 0.41        q4_k_s 0.97 / 0.93, floor 0.46
#     q4_k_m 0.96 / 0.93, floor 0.59           q5_k_m 0.87 / 0.83, floor 0.51        q6_k 0.97 / 0.93, floor 0.60
#   llama-quantize does these in 0.36-1.15 s; the floor process (start, import NumPy and Numba, read 273 MiB,
#   write + fsync the output's size) takes 0.35-0.60 s, as long as llama-quantize's whole run for the fast rows.
#   At this size half of llama-quantize's time is below what any Python + Numba process needs before it
#   quantizes a weight; ggufkit is 0.15-0.25 s above the floor (its own imports, two to five cached kernels,
#   the quantizing).
#   1.1B shape, 3 runs, load 0.6-1.9:
#     q8_0 0.42 / 0.39 / 0.34, floor 0.44      q4_0 0.44 / 0.42 / 0.37, floor 0.46   q4_1 0.47 / 0.44 / 0.41
#     q5_0 0.44 / 0.41 / 0.36                  q5_1 0.39 / 0.37 / 0.33               tq1_0 0.45 / 0.44 / 0.37
#     tq2_0 0.44 / 0.43 / 0.36                 mxfp4_moe 0.42 / 0.39 / 0.34          q3_k_s 0.36 / 0.35 / 0.32
#   (llama-quantize 3.1-7.7 s). ggufkit's fast rows take about as long as the floor process (1.4-1.8 s): they
#   are bound by reading 2.1 GB and writing + fsyncing the output, with the quantizing overlapped. The earlier
#   0.57-0.86 wall ratios on this machine (0.86 / 0.52 / 0.65 / 0.76 / 0.48 for q8_0 / q4_0 / q4_1 / q5_1 / tq2_0
#   in this session, before settle()) came from the order of the runs, not from the quantizer: each ggufkit run
#   followed a llama-quantize run that left its 0.6-1.1 GB output unsynced, so ggufkit's fsync queued behind the
#   disk writing that back, and its rename freed the previous output's blocks (this ext4 discards online).
#   AVX2 only (eval "$(python benchmarks/avx2_only.py)"), 1.1B shape, 3 runs, load 0.7-1.8, same columns:
#     before the reused widening buffer (quant/dispatch.py _widening_buffer):
#       q8_0 0.49 / 0.45, floor 0.50     q4_0 0.44 / 0.42, floor 0.46    q4_1 0.54 / 0.50, floor 0.43
#       q5_0 0.43 / 0.41                 q5_1 0.46 / 0.43                tq1_0 0.52 / 0.51, floor 0.22
#       tq2_0 0.54 / 0.53, floor 0.23    mxfp4_moe 0.55 / 0.50, floor 0.47
#     after: tq1_0 0.46 / 0.45, tq2_0 0.48 / 0.47 (the F16 -> F32 widening of their two-pass path 0.59 -> 0.31 s);
#       q4_1 0.56 / 0.53, floor 0.46; q8_0 0.57 / 0.53 and mxfp4_moe 0.58 / 0.54 with floors of 0.50-0.53: a
#       1.1 GB output's write + fsync on this VM's disk (386-1200 MB/s, run to run) is half of llama-quantize's
#       time by itself, so those two rows cannot reach 0.5 here without giving up the fsync.
