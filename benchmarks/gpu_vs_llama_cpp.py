"""Real-GPU side by side: ``ggufkit imatrix``/``ppl --device cuda`` vs llama.cpp's CUDA ``llama-imatrix``/``llama-perplexity``.

Not a pytest file (CI has no GPU). Run on a CUDA machine with ggufkit importable and llama.cpp's two tools built
with ``-DGGML_CUDA=ON`` from the sources vendored in llama-cpp-python 0.3.36::

    python benchmarks/gpu_vs_llama_cpp.py --llama-bin DIR [--chunks 256] [--rounds 2]

``benchmarks/build_llama_cuda.sh`` builds the two tools (here, without a GPU) and packs them for the trip.

The model is benchmarks/bench_imatrix.py's: SmolLM2-135M's shape (30 layers, d=576, vocab 49152, tied head) with
random weights written as F16, and a text of words ``t<i>`` (one token each in both tokenizers). Each tool runs
as a whole process with every layer on the GPU (llama.cpp: ``-ngl 99`` and its defaults, flash attention
``auto``; ggufkit: ``--device cuda`` and its defaults), the two alternating over ``--rounds`` rounds after one
warm-up round each. Printed, one JSON object per line: per tool the whole-process tokens/s (best round) and the
tokens/s after start-up (llama.cpp: the wall time less the time stamped on its "computing over" /
"calculating perplexity over" log line; ggufkit: ``tokens_per_second`` of ``--json``), the ratios ggufkit/llama.cpp, both PPLs, and for the importance
matrix the tensor set, the counts and the worst relative L2 difference of ``in_sum2`` between the two files.

Measured (2026-11-27, one NVIDIA H200 and its host's 16-core Intel Xeon (AVX2, AVX-512 F/BF16/VNNI, AMX), llama.cpp
built for sm_90 with CUDA 13.0, flash attention and CUDA graphs on; the template instances for quantized matmul
(mmq), small-batch F16 matmul (mmf) and single-token attention (fattn-vec) were left out of that build to fit the
build in the session, each replaced by a stub that aborts with its name, so a run that needed one would have
failed loudly rather than taken another path):

* imatrix, ``--chunks 32`` (16384 tokens), ``--rounds 1``: whole process llama-imatrix 7.38 s (2221 tok/s),
  ggufkit 5.79 s (2831 tok/s), ratio 1.27; after start-up 3505 vs 21862 tok/s (6.2x: llama-imatrix copies every
  matmul input to the host and sums it there). Same 210 entries, equal counts, worst relative L2 of ``in_sum2``
  3.2e-3 (llama.cpp's CUDA matmuls take F16 activations; ggufkit's take float32). The 131072-token default run
  did not finish inside the device time left for it.
* ppl: llama-perplexity stopped in a left-out small-batch F16 matmul instance (mmf), so no ratio this time (an
  earlier session measured ggufkit 2.0x llama-perplexity's CUDA rate, F16, without flash attention).
* The same script on 2 of the host's cores with AVX2 only on both sides (``CUDA_VISIBLE_DEVICES=`` ``taskset -c
  0,1``; the build's CPU backend is compiled for AVX2/FMA/F16C without AVX-512; ggufkit with
  ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``; the ``NUMBA_CPU_NAME=haswell`` also set did not hold
  Numba to AVX2 without ``NUMBA_CPU_FEATURES``, but this F16 model runs no Numba kernel), 8 x 512 tokens, 1 round:
  imatrix whole process 17.41 s vs 14.32 s (ratio 1.22; after start-up 1.91), ppl 16.53 s vs 16.20 s (ratio 1.02;
  after start-up 1.53); PPL 77431.51 (llama.cpp) vs 77425.66.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

CTX = 512
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
# llama.cpp's log lines start with the time since start-up, minutes.seconds.milliseconds.microseconds
_EVAL_START = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I \w+: (?:computing over|calculating perplexity over)", re.M)
_FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def _emit(**rec: object) -> None:
    print(json.dumps(rec), flush=True)


def _f16_without_llama_cpp() -> None:
    """GPU machines lack llama-cpp-python, whose ggml the test models' writer quantizes with; an F16 tensor is
    each float32 rounded to nearest-even half, which NumPy does the same way (ggml.c: ggml_fp32_to_fp16_row)."""
    import importlib.util
    import types

    if importlib.util.find_spec("llama_cpp") is not None:
        return
    from gguf import GGMLQuantizationType as Q

    def ggml_quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
        assert qtype == Q.F16, qtype
        return np.ascontiguousarray(x, np.float32).astype(np.float16).view(np.uint8).reshape(x.shape[0], -1)

    def ggml_dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
        assert qtype == Q.F16, qtype
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(shape)

    module = types.ModuleType("ggml_oracle")
    module.ggml_quantize = ggml_quantize  # type: ignore[attr-defined]
    module.ggml_dequantize = ggml_dequantize  # type: ignore[attr-defined]
    sys.modules["ggml_oracle"] = module


def make_inputs(d: Path, chunks: int) -> tuple[Path, Path]:
    _f16_without_llama_cpp()
    from eval_models import make_hf_model, write_model_gguf
    from gguf import GGMLQuantizationType as Q

    model = make_hf_model("llama", **SHAPE)
    path = write_model_gguf(model, "llama", d / "smol-f16.gguf", Q.F16)
    words = np.random.default_rng(0).integers(0, 40000, CTX * chunks + 64)
    text = d / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in words) + "\n")
    return path, text


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)  # not the checkout: its ggufkit/ is not the package
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return wall, r.stdout + r.stderr


def _llama_eval_rate(log: str, wall: float, tokens: int) -> float:
    """Tokens/s after start-up: the whole process's wall time less the time stamped on the line that starts the
    evaluation (tokenization and model load before it; the evaluation and writing the output after it)."""
    m = _EVAL_START.search(log)
    if not m:
        return float("nan")
    minutes, seconds, ms, us = (int(g) for g in m.groups())
    return tokens / (wall - (minutes * 60 + seconds + ms / 1e3 + us / 1e6))


def _ggufkit_json(log: str) -> dict[str, object]:
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return {}


def compare(tool: str, model: Path, text: Path, chunks: int, rounds: int, bin_dir: Path, d: Path,
            device: str = "cuda", llama_args: tuple[str, ...] = ("-ngl", "99")) -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": f"{bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    # a build linked against a driver stub may lack libcuda.so.1 among its needed libraries: load the driver first
    llama_env = {**env, "LD_PRELOAD": "libcuda.so.1"} if device == "cuda" else env
    common = ["-f", str(text), "-c", str(CTX), "--chunks", str(chunks)]
    name = "llama-imatrix" if tool == "imatrix" else "llama-perplexity"
    theirs = [str(bin_dir / name), "-m", str(model), *common, *llama_args]
    ours = [sys.executable, "-m", "ggufkit", tool, str(model), *common, "--device", device, "--json"]
    if tool == "imatrix":
        theirs += ["-o", str(d / "llama.imatrix.gguf")]
        ours += ["-o", str(d / "ggufkit.imatrix.gguf")]
    walls: dict[str, list[float]] = {"llama.cpp": [], "ggufkit": []}
    rates: dict[str, list[float]] = {"llama.cpp": [], "ggufkit": []}
    logs: dict[str, str] = {}
    for r in range(rounds + 1):  # round 0 warms caches (numba, CUDA modules, page cache) and is not counted
        for side, cmd in (("llama.cpp", theirs), ("ggufkit", ours)):
            wall, log = _run(cmd, llama_env if side == "llama.cpp" else env, d)
            logs[side] = log
            print(f"# {tool} round {r} {side}: {wall:.2f} s", file=sys.stderr, flush=True)
            rate = _llama_eval_rate(log, wall, CTX * chunks) if side == "llama.cpp" else float(
                _ggufkit_json(log).get("tokens_per_second", float("nan")))  # type: ignore[arg-type]
            if r:
                walls[side].append(wall)
                rates[side].append(rate)
    n = CTX * chunks
    best_wall = {k: min(v) for k, v in walls.items()}
    best_rate = {k: max(v) for k, v in rates.items()}
    m = _FINAL_PPL.search(logs["llama.cpp"])
    rec: dict[str, object] = dict(
        check=f"{tool}-speed", tokens=n, rounds=rounds,
        whole_process_tok_s={k: round(n / v, 1) for k, v in best_wall.items()},
        whole_process_ratio=round(best_wall["llama.cpp"] / best_wall["ggufkit"], 3),
        eval_tok_s={k: round(v, 1) for k, v in best_rate.items()},
        eval_ratio=round(best_rate["ggufkit"] / best_rate["llama.cpp"], 3),
        walls={k: [round(x, 2) for x in v] for k, v in walls.items()},
        ppl_llama=float(m.group(1)) if m else None, ppl_ggufkit=_ggufkit_json(logs["ggufkit"]).get("ppl"))
    _emit(**rec)
    if tool == "imatrix":
        from gpu_imatrix_check import compare_imatrices

        _emit(check="imatrix-vs-llama-imatrix",
              **compare_imatrices(d / "ggufkit.imatrix.gguf", d / "llama.imatrix.gguf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-imatrix, llama-perplexity and their libs")
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tools", default="imatrix,ppl")
    ap.add_argument("--device", default="cuda", help="ggufkit's device (cpu only to try this script without a GPU)")
    ap.add_argument("--llama-args", default="-ngl 99", help="extra arguments of llama.cpp's tools")
    args = ap.parse_args()
    import torch

    _emit(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, cpu_cores=os.cpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model, text = make_inputs(d, args.chunks)
        print(f"# model and text written: {model.stat().st_size} bytes", file=sys.stderr, flush=True)
        for tool in args.tools.split(","):
            try:
                compare(tool, model, text, args.chunks, args.rounds, args.llama_bin.resolve(), d, args.device,
                        tuple(args.llama_args.split()))
            except Exception as exc:  # report and go on to the next tool
                _emit(check=f"{tool}-speed", error=repr(exc)[:1500])


if __name__ == "__main__":
    main()
