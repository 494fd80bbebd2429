"""Real-GPU check of the evaluator: dequantization bytes, GPU == CPU perplexity, tokens/s and peak memory.

Not a pytest file (CI has no GPU). Run on a CUDA machine with ggufkit importable (and ``gguf``)::

    python benchmarks/gpu_ppl_check.py [--chunks 40]

1. Every dequantization kernel on the GPU gives the same float32 bits as on the CPU and as gguf-py, on
   random blocks (all bit patterns).
2. Every test architecture (tests/eval_models.py, tiny random transformers models): PPL on CUDA with the
   default dtype vs the CPU, relative difference.
3. A SmolLM2-135M-shaped model (F16, Q8_0, Q4_0; random weights): tokens/s on the GPU for ``--dtype``
   auto/bf16/f16, peak GPU memory, and the PPL difference GPU (default dtype) vs CPU on 2 chunks.

Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _ensure_importable() -> None:
    """Let ``ggufkit.eval`` resolve to ``eval/`` when the package is not installed (a bare GPU machine)."""
    import ggufkit

    try:
        import ggufkit.eval
    except ImportError:
        ggufkit.__path__.append(str(ROOT))


def _quantize(arr: np.ndarray, qtype: object) -> np.ndarray:
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)  # type: ignore[arg-type]


def write_with_gguf_py(model: object, arch: str, path: Path, qtype: object) -> Path:
    """tests/eval_models.write_model_gguf without ggml's library (absent here): gguf-py quantizes."""
    from eval_models import POWERINFER_MAGIC, _metadata, gguf_tensors
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    from ggufkit.constants import GGUF_MAGIC
    from ggufkit.format import TensorSpec, write_gguf

    block, size = GGML_QUANT_SIZES[qtype]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    if qtype != Q.F32:
        sd = {k: (_quantize(v, qtype) if v.ndim == 2 else v) for k, v in sd.items()}
    specs, data = [], []
    for name, arr in gguf_tensors(model, arch, sd):  # type: ignore[arg-type]
        if arr.dtype != np.float32:
            arr = arr.view(np.uint8)
            specs.append(TensorSpec(name, qtype, (arr.shape[0], arr.shape[1] // size * block)))
        else:
            specs.append(TensorSpec(name, Q.F32, tuple(arr.shape)))
        data.append(np.ascontiguousarray(arr))
    magic = POWERINFER_MAGIC if arch in ("opt", "powerinfer_llama") else GGUF_MAGIC
    write_gguf(path, _metadata(model, arch), specs, data, magic=magic)  # type: ignore[arg-type]
    return path


def check_dequant() -> None:
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize

    from ggufkit.eval.dequant import DEQUANTIZERS, dequantize

    for qtype in DEQUANTIZERS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(int(qtype)).integers(0, 256, (4096, 4 * size), dtype=np.uint8)
        # Finite f16 scales: NaN payloads legitimately differ between CPU and GPU conversions.
        if qtype == Q.F16:
            raw[:, 1::2] &= 0x7B
        elif qtype not in (Q.F32, Q.BF16):
            offsets = (208,) if qtype == Q.Q6_K else (0, 2) if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K) else (0,)
            for k in range(4):
                for off in offsets:
                    raw[:, k * size + off + 1] &= 0x3B
        cpu = dequantize(torch.from_numpy(raw), qtype, 4 * block).numpy()
        gpu = dequantize(torch.from_numpy(raw).cuda(), qtype, 4 * block).cpu().numpy()
        rec = {"check": "dequant", "type": qtype.name, "gpu_equals_cpu_bits": _same_bits(cpu, gpu)}
        try:
            with np.errstate(all="ignore"):
                rec["gpu_equals_gguf_py_bits"] = _same_bits(gguf_dequantize(raw, qtype).reshape(cpu.shape), gpu)
        except NotImplementedError:  # a type gguf-py cannot decode (Q1_0)
            rec["gpu_equals_gguf_py_bits"] = None
        print(json.dumps(rec), flush=True)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 bits, NaN equal to NaN: the random scales include f16 NaN/inf, and a NaN's payload
    differs between x86 and CUDA (0xFFC00000 vs 0x7FFFFFFF) without being a different value."""
    same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    return bool(same.all())


def check_archs(tmp: Path) -> None:
    from eval_models import CONFIGS, N_VOCAB, make_hf_model
    from gguf import GGMLQuantizationType as Q

    from ggufkit.eval import perplexity

    tokens = np.random.default_rng(0).integers(3, N_VOCAB, 64 * 6).tolist()
    for arch in CONFIGS:
        try:
            path = write_with_gguf_py(make_hf_model(arch), arch, tmp / f"{arch}.gguf", Q.F32)
            cpu = perplexity(path, tokens=tokens, ctx=64, device="cpu")
            gpu = perplexity(path, tokens=tokens, ctx=64, device="cuda")
            bf16 = perplexity(path, tokens=tokens, ctx=64, device="cuda", dtype="bf16")
            print(json.dumps({"check": "arch", "arch": arch, "ppl_cpu": cpu.ppl, "ppl_gpu": gpu.ppl,
                              "rel_diff": gpu.ppl / cpu.ppl - 1, "rel_diff_bf16": bf16.ppl / cpu.ppl - 1}),
                  flush=True)
        except Exception as exc:  # report and go on: one broken config must not hide the others
            print(json.dumps({"check": "arch", "arch": arch, "error": repr(exc)}), flush=True)


def bench(tmp: Path, chunks: int) -> None:
    import torch
    from eval_models import make_hf_model
    from gguf import GGMLQuantizationType as Q

    from ggufkit.eval import perplexity

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
    model = make_hf_model("llama", **shape)
    tokens = np.random.default_rng(1).integers(3, 49152, 512 * chunks).tolist()
    for qtype in (Q.F16, Q.Q8_0, Q.Q4_0):
        path = write_with_gguf_py(model, "llama", tmp / f"smol-{qtype.name}.gguf", qtype)
        cpu = perplexity(path, tokens=tokens, ctx=512, chunks=2, device="cpu")
        for dtype in ("auto", "bf16", "f16"):
            for batch in (4, 16):
                perplexity(path, tokens=tokens, ctx=512, chunks=2, device="cuda", dtype=dtype, batch=batch)  # warm-up
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                r = perplexity(path, tokens=tokens, ctx=512, device="cuda", dtype=dtype, batch=batch)
                wall = time.perf_counter() - t
                short = perplexity(path, tokens=tokens, ctx=512, chunks=2, device="cuda", dtype=dtype)
                print(json.dumps({"check": "bench", "type": qtype.name, "dtype": dtype, "batch": batch,
                                  "chunks": r.chunks, "tokens_per_second": r.tokens_per_second,
                                  "wall_tokens_per_second": r.chunks * 512 / wall,
                                  "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20,
                                  "file_mib": path.stat().st_size / 2**20, "ppl": r.ppl,
                                  "ppl_2chunks_gpu": short.ppl, "ppl_2chunks_cpu": cpu.ppl,
                                  "rel_diff_vs_cpu": short.ppl / cpu.ppl - 1}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    _ensure_importable()
    with tempfile.TemporaryDirectory() as d:
        if "dequant" not in args.skip:
            check_dequant()
        if "arch" not in args.skip:
            check_archs(Path(d))
        if "bench" not in args.skip:
            bench(Path(d), args.chunks)


if __name__ == "__main__":
    main()
