"""``ggufkit imatrix`` vs ``llama-imatrix`` and ``ggufkit ppl`` vs ``llama-perplexity``: CPU tokens/s, one model.

The model has SmolLM2-135M's shape (30 layers, d=576, 9/3 heads, FFN 1536, vocab 49152, tied head), random
weights (speed does not depend on them), written as F16. The text is words ``t<i>``, each one token of the
synthetic vocabulary in both tokenizers. Each tool runs as a whole process (imports, model load, evaluation)
with the same thread count (all cores, or ``GGUFKIT_BENCH_THREADS``), alternating over ``ROUNDS`` rounds;
llama.cpp's tools are the binaries built from the vendored sources (tests/llama_cpp_sources.py). Printed:
tokens/s by wall clock (best round) and by CPU time of the child (user+sys, best round; steadier than the wall
clock on a shared machine), their ratios ours/llama.cpp (target >= 0.8), the PPLs, and the CPU model and its
SIMD flags.

llama.cpp's tools run with ``-nr`` (no weight repacking: on CPUs that report AMX but cannot run it the
repacked kernels die of SIGILL; F16 weights are not repacked anyway).

Measured (2026-11-27, Intel(R) Xeon(R) Processor, 2 cores, avx2 fma f16c avx512f avx512_bf16 avx512_vnni, 2
threads, 2 rounds, the machine shared with other jobs: 1-min load average 11-14), after the evaluator kept its
dequantized weights between passes (commit "eval: CPU models keep dequantized weights ..."):

* ppl vs llama-perplexity: ggufkit 72.5 tok/s, llama.cpp 42.7 tok/s, ratio 1.70 (CPU time 28.2 s vs 48.3 s);
  PPL 77425.6689 vs 77430.7311.
* imatrix vs llama-imatrix: ggufkit 100.5 tok/s, llama.cpp 38.9 tok/s, ratio 2.58 (CPU time 27.8 s vs 53.3 s).

Under such load llama.cpp's threads lose time waiting at their spinning barriers, which flatters the ratio; the
load-independent comparison on the same machine is one thread each (same model, text and 8 x 512 tokens, whole
process): llama-perplexity ``-t 1 -nr`` 18.3-19.7 s user CPU, ``ggufkit ppl`` with ``OMP_NUM_THREADS=1``
13.7-14.2 s (about 1.35x fewer CPU seconds: oneDNN's float32 GEMM against ggml's F16 dot products).

Run: ``python -m pytest benchmarks/bench_imatrix.py --benchmark-enable -s`` (not part of CI).
``GGUFKIT_BENCH_LLAMA_BIN=DIR`` takes llama.cpp's two tools from another build. An AVX2-only machine (the 2-core AMD
EPYC kind the issue measured) is approximated on an AVX-512 CPU by a llama.cpp build with ``-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON`` (no AVX-512) on one side and ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` on the other (the same instruction sets; not the same micro-architecture). Numba needs
``NUMBA_CPU_NAME`` *and* ``NUMBA_CPU_FEATURES``: with the name alone it keeps the host's feature list, AVX-512
included (numba/core/config.py); ``benchmarks/bench_quantize_kernels.py --avx2-only`` builds that list. The F16
model here runs no Numba kernel (the evaluator's arithmetic is PyTorch's), so the figures measured with the
name alone stand.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CTX = 512
CHUNKS = 8
ROUNDS = int(os.environ.get("GGUFKIT_BENCH_ROUNDS", 2))
THREADS = int(os.environ.get("GGUFKIT_BENCH_THREADS", os.cpu_count() or 1))
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)


def cpu_description() -> str:
    """``model name`` and the SIMD flags of /proc/cpuinfo (AVX2, AVX-512 F/BF16/VNNI, F16C, FMA)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni") if f in flags]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(simd) or 'none of avx2/avx512'}"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from eval_models import make_hf_model, write_model_gguf
    from gguf import GGMLQuantizationType as Q

    d = tmp_path_factory.mktemp("bench_imatrix")
    model = make_hf_model("llama", **SHAPE)
    path = write_model_gguf(model, "llama", d / "smol-f16.gguf", Q.F16)
    words = np.random.default_rng(0).integers(0, 40000, CTX * CHUNKS + 64)
    (d / "text.txt").write_text(" ".join(f"t{i}" for i in words) + "\n")
    return {"model": path, "text": d / "text.txt", "dir": d}


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr[-2000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.stdout + r.stderr


def _final_ppl(log: str) -> float:
    for line in log.splitlines():
        if "Final estimate: PPL = " in line:
            return float(line.split("Final estimate: PPL = ")[1].split()[0])
    return float("nan")


@pytest.mark.parametrize("tool", ["ppl", "imatrix"])
def test_cpu_tokens_per_second_vs_llama_cpp(benchmark, files: dict[str, Path], tool: str) -> None:
    from llama_cpp_sources import tool_path

    if os.environ.get("GGUFKIT_BENCH_LLAMA_BIN"):  # another build of the two tools, e.g. AVX2-only (see above)
        tool_path = lambda name: Path(os.environ["GGUFKIT_BENCH_LLAMA_BIN"]) / name  # noqa: E731
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    model, text, d = str(files["model"]), str(files["text"]), files["dir"]
    common = ["-f", text, "-c", str(CTX), "--chunks", str(CHUNKS)]
    if tool == "ppl":
        theirs = [str(tool_path("llama-perplexity")), "-m", model, *common, "-t", str(THREADS), "-nr"]
        ours = [sys.executable, "-m", "ggufkit", "ppl", model, *common, "--device", "cpu"]
    else:
        theirs = [str(tool_path("llama-imatrix")), "-m", model, *common, "-t", str(THREADS), "-nr", "-o",
                  str(d / "ref.gguf")]
        ours = [sys.executable, "-m", "ggufkit", "imatrix", model, *common, "--device", "cpu", "-o",
                str(d / "ours.gguf")]
    runs: dict[str, list[tuple[float, float, str]]] = {"llama.cpp": [], "ggufkit": []}

    def both() -> None:
        runs["llama.cpp"].append(_timed(theirs, env))
        runs["ggufkit"].append(_timed(ours, env))

    benchmark.pedantic(both, rounds=ROUNDS, iterations=1)
    n = CTX * CHUNKS
    wall = {k: min(r[0] for r in v) for k, v in runs.items()}
    cpu = {k: min(r[1] for r in v) for k, v in runs.items()}
    ppl = {k: _final_ppl(v[0][2]) for k, v in runs.items()}
    info = dict(ggufkit_tok_s=n / wall["ggufkit"], llama_tok_s=n / wall["llama.cpp"],
                ratio_wall=wall["llama.cpp"] / wall["ggufkit"], ratio_cpu=cpu["llama.cpp"] / cpu["ggufkit"],
                ppl_ggufkit=ppl["ggufkit"], ppl_llama=ppl["llama.cpp"], threads=THREADS, cpu=cpu_description(),
                load=os.getloadavg()[0])
    benchmark.extra_info.update(info)
    print(f"\n{tool} vs llama-{'perplexity' if tool == 'ppl' else 'imatrix'} on {info['cpu']} "
          f"({THREADS} threads, whole process, {CHUNKS} x {CTX} tokens, F16, 1-min load average {info['load']:.1f}):"
          f"\n  wall: ggufkit {info['ggufkit_tok_s']:.1f} tok/s, llama.cpp {info['llama_tok_s']:.1f} tok/s, ratio "
          f"{info['ratio_wall']:.2f}\n  CPU time: ggufkit {cpu['ggufkit']:.1f} s, llama.cpp {cpu['llama.cpp']:.1f} s, "
          f"ratio {info['ratio_cpu']:.2f}\n  PPL {ppl['ggufkit']:.4f} vs {ppl['llama.cpp']:.4f}")
    print(json.dumps(info))
