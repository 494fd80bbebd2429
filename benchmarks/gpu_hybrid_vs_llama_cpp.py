"""Real-GPU side by side for the hybrid families (issue 33): ``ggufkit ppl``/``imatrix --device cuda`` vs llama.cpp's
CUDA ``llama-perplexity``/``llama-imatrix`` on the Qwen3.5-shaped and the Granite-4-shaped F16 models of
benchmarks/bench_ppl_qwen35.py and bench_ppl_granite4.py (gated delta-net and Mamba2 layers on the GPU).

Not a pytest file (CI has no GPU). Run on a CUDA machine with ggufkit and transformers importable, llama.cpp's two
tools built with ``-DGGML_CUDA=ON`` (``benchmarks/build_llama_cuda.sh``) and the two vocab files the test
tokenizers are rebuilt from (``ggml-vocab-gpt-2.gguf``, ``ggml-vocab-qwen2.gguf``) under
``$GGUFKIT_LLAMA_CPP_SRC/vendor/llama.cpp/models``::

    python benchmarks/gpu_hybrid_vs_llama_cpp.py --llama-bin DIR [--chunks 32] [--rounds 1] [--models qwen35,granite4]

Each tool runs as a whole process with every layer on the GPU (llama.cpp ``-ngl 99`` and its defaults; ggufkit
``--device cuda``), alternating, after one warm-up round each (benchmarks/gpu_vs_llama_cpp.py ``compare``). One JSON
object a line: whole-process and after-start-up tokens/s of both, the ratios, both PPLs, and for the importance
matrix the entries, counts and the worst relative L2 of ``in_sum2``.

Not measured on a GPU yet: the session that wrote it (2026-11-28) lost its GPU loan before llama.cpp's CUDA
build (2 shared cores) finished. It ran end to end on the CPU (``--device cpu``, the CPU tools, one chunk): Granite-4
shape, PPL 52012.70 (ggufkit) vs 52013.06 (llama-perplexity).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


def build_granite4(d: Path) -> Path:
    from bench_ppl_granite4 import build

    return build(d)


def build_qwen35(d: Path) -> Path:
    from bench_ppl_qwen35 import build

    return build(d)


def word_text(d: Path, chunks: int, ctx: int) -> Path:
    """Words ``t<i>`` (at most a few tokens each): more than enough tokens for ``chunks`` windows of ``ctx``."""
    words = np.random.default_rng(0).integers(0, 40000, ctx * chunks + 64)
    text = d / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in words) + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-imatrix, llama-perplexity and their libs")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tools", default="ppl,imatrix")
    ap.add_argument("--models", default="qwen35,granite4")
    ap.add_argument("--device", default="cuda", help="ggufkit's device (cpu only to try this script without a GPU)")
    ap.add_argument("--llama-args", default="-ngl 99", help="extra arguments of llama.cpp's tools")
    args = ap.parse_args()
    import torch
    from gpu_vs_llama_cpp import CTX, _f16_without_llama_cpp, compare

    _f16_without_llama_cpp()
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                          cpu_cores=os.cpu_count())), flush=True)
    builders = {"qwen35": build_qwen35, "granite4": build_granite4}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        text = word_text(d, args.chunks, CTX)
        for name in args.models.split(","):
            sub = d / name
            sub.mkdir()
            model = builders[name](sub)
            print(f"# {name}: {model.stat().st_size} bytes", file=sys.stderr, flush=True)
            for tool in args.tools.split(","):
                print(json.dumps(dict(model=name, tool=tool)), flush=True)
                try:
                    compare(tool, model, text, args.chunks, args.rounds, args.llama_bin.resolve(), sub, args.device,
                            tuple(args.llama_args.split()))
                except Exception as exc:  # report and go on
                    print(json.dumps(dict(model=name, check=f"{tool}-speed", error=repr(exc)[:1500])), flush=True)


if __name__ == "__main__":
    main()
