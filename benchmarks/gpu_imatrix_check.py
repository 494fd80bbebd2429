"""Real-GPU check of ``ggufkit imatrix`` and of whole-file ``ggufkit quantize --device cuda``.

Not a pytest file (CI has no GPU). Run on a CUDA machine with ggufkit importable::

    python benchmarks/gpu_imatrix_check.py [--models DIR] [--skip-speed]

1. Every GGUF in ``--models`` (e.g. tiny dense and MoE models converted here, F32 and Q4_K_M): the
   importance matrix collected on CUDA vs on the CPU — the same entries and counts, and the relative L2
   difference of every ``in_sum2``.
2. A SmolLM2-135M-shaped LLaMA (random weights, F16): imatrix tokens/s on the GPU and on the CPU, and the
   relative difference of the two matrices.
3. The same F16 file quantized to several types (K-quants with that imatrix too) with ``--device cuda``
   and ``--device cpu``: the files' sha256 must be equal; the wall time of each.

Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine on quiet hills"


def _emit(**rec: object) -> None:
    print(json.dumps(rec), flush=True)


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(b.astype(np.float64)))
    return float(np.linalg.norm(a.astype(np.float64) - b)) / den if den else float(np.abs(a).max())


def compare_imatrices(a: Path, b: Path) -> dict[str, object]:
    from ggufkit.quant.imatrix.collector import read_raw_imatrix

    x, y = read_raw_imatrix(a), read_raw_imatrix(b)
    if sorted(x.entries) != sorted(y.entries):
        return {"same_entries": False}
    worst, counts_equal = 0.0, True
    for name, (sums, counts) in y.entries.items():
        s2, c2 = x.entries[name]
        counts_equal &= bool(np.array_equal(np.asarray(counts), np.asarray(c2)))
        worst = max(worst, _rel_l2(np.asarray(s2), np.asarray(sums)))
    return {"same_entries": True, "entries": len(y.entries), "counts_equal": counts_equal,
            "worst_rel_l2": worst}


def check_models(models: Path, tmp: Path) -> None:
    from ggufkit.eval import collect_imatrix

    text_file = models / "text.txt"
    text = text_file.read_text() if text_file.exists() else " ".join(
        np.random.default_rng(0).choice(WORDS.split(), 1200))
    for path in sorted(models.glob("*.gguf")):
        try:
            out = {}
            for device in ("cpu", "cuda"):
                out[device] = tmp / f"{path.stem}-{device}.gguf"
                collect_imatrix(path, text=text, output=out[device], ctx=64, chunks=4, device=device,
                                process_output=True)
            _emit(check="imatrix-model", model=path.name, **compare_imatrices(out["cuda"], out["cpu"]))
        except Exception as exc:  # report and go on
            _emit(check="imatrix-model", model=path.name, error=repr(exc)[:600])


def smollm_f16(tmp: Path) -> Path:
    import torch
    from gguf import GGMLQuantizationType as Q
    from gpu_ppl_check import write_with_gguf_py
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=False, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    return write_with_gguf_py(model, "llama", tmp / "smollm-shaped-f16.gguf", Q.F16)


def check_speed(tmp: Path) -> Path:
    from ggufkit.eval import collect_imatrix

    f16 = smollm_f16(tmp)
    tokens = np.random.default_rng(0).integers(3, 320, 8 * 512 + 1).tolist()
    out = {}
    for device in ("cuda", "cpu"):
        out[device] = tmp / f"smollm-{device}.imatrix.gguf"
        r = collect_imatrix(f16, tokens=tokens, output=out[device], ctx=512, chunks=8, device=device)
        _emit(check="imatrix-speed", device=r.device, tokens_per_second=round(r.tokens_per_second, 1),
              seconds=round(r.seconds, 2), ppl=r.ppl)
    _emit(check="imatrix-speed-diff", **compare_imatrices(out["cuda"], out["cpu"]))
    return out["cpu"]


def check_quantize(tmp: Path, f16: Path, imatrix: Path, types: list[str]) -> None:
    from ggufkit.quant import quantize_file

    for target in types:
        rec: dict[str, object] = {"check": "quantize-file", "type": target}
        try:
            digests = {}
            for device in ("cuda", "cpu"):
                out = tmp / f"q-{target}-{device}.gguf"
                t0 = time.perf_counter()
                quantize_file(f16, out, target, imatrix=imatrix, device=device)
                rec[f"{device}_s"] = round(time.perf_counter() - t0, 2)
                digests[device] = hashlib.sha256(out.read_bytes()).hexdigest()
                out.unlink()
            rec["bytes_equal"] = digests["cuda"] == digests["cpu"]
        except Exception as exc:
            rec["error"] = repr(exc)[:600]
        _emit(**rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=None, help="folder of small GGUF models to compare")
    ap.add_argument("--types", default="q4_0,q8_0,q2_k,q3_k_m,q4_k_m,q5_k_m,q6_k,iq4_nl,iq4_xs,tq2_0,mxfp4_moe")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    if not hasattr(np, "row_stack"):  # numba 0.68.0's parallel backend still names np.row_stack (NumPy 2.5)
        np.row_stack = np.vstack
    import torch

    _emit(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.models is not None:
            check_models(args.models, tmp)
        if not args.skip_speed:
            imatrix = check_speed(tmp)
            check_quantize(tmp, tmp / "smollm-shaped-f16.gguf", imatrix, args.types.split(","))


if __name__ == "__main__":
    main()
