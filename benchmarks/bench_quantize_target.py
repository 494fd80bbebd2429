"""``ggufkit quantize --target-size`` mixes vs llama-quantize presets at equal size, KLD by llama-perplexity.

The model: SmolLM2-135M-Instruct (``tests/real_models.py``: ``smollm2-135m-instruct-q4_1``), dequantized to
F16 by ``quantize_file(..., "f16", allow_requantize=True)``. One importance matrix, made by llama-imatrix on
the first half of the bundled sample (``CTX`` x ``IMATRIX_CHUNKS`` tokens), is given to both tools. For each
preset in ``PRESETS``, llama-quantize writes the preset with that imatrix; ggufkit then writes the best mix
of the same file size (``--target-size`` = the preset's bytes). Every file is scored by ``llama-perplexity
--kl-divergence -nr`` against the F16 logits (``--kl-divergence-base``) on ``KLD_CHUNKS`` chunks taken from
the end of the second half of the sample (a text used neither for the imatrix nor for the search; the
search itself reads only weights and the imatrix).

Printed: per size, for preset and mix, file bytes, bpw, mean and p99 KLD, PPL(Q) - PPL(base), same top
token %, the mix/preset KLD ratio and the search time; then the CPU. Targets (issue #16): mix KLD <= 0.30x,
0.35x, 0.75x the preset's at the Q2_K, Q3_K_M, Q4_K_M sizes.

Result (2026-11-26, Intel Xeon Processor with AVX2/AVX-512 F/BF16/VNNI, 2 cores shared with other jobs; ctx 512,
imatrix 16 chunks, KLD 16 chunks; bpw = file bytes x 8 / weights; proxy ``relative``, the default):

    size of  file        bytes    bpw  mean KLD  p99 KLD    dPPL  same top  KLD ratio  target
    q2_k     preset   88206304  5.246   0.25973   1.1021  +1.911   74.95%      1.000
    q2_k     mix      88064032  5.238   0.02297   0.0897  +0.221   91.23%      0.088    0.30
    q3_k_m   preset   93514720  5.562   0.07648   0.3694  +0.837   85.27%      1.000
    q3_k_m   mix      93483040  5.560   0.01458   0.0576  +0.189   92.89%      0.191    0.35
    q4_k_m   preset  105458656  6.272   0.02943   0.1582  +0.350   91.47%      1.000
    q4_k_m   mix     105371648  6.267   0.00243   0.0113  +0.034   97.53%      0.083    0.75

With ``--proxy absolute`` (plain imatrix-weighted squared error): 0.01701 at Q2_K's size (0.066x), 0.03265 at
Q3_K_M's (0.427x: it spends 9 MB on token_embd at Q8_0), 0.00262 at Q4_K_M's (0.089x). The first search
(1807 tensor x type measurements) took 380 s on the busy 2 cores; later targets read the cache and took
23-37 s, against 5-22 s for llama-quantize's preset.

Measured KLD sensitivity (``--sensitivity estimate|search``, :mod:`ggufkit.eval.target_sensitivity`, measured
on calib.txt: one 256-token chunk, 4 layer bands x 5 tensor kinds + token_embd = 21 groups, probe Q4_K where
rows are 256-blocks else Q4_0). Run 2026-11-27, same CPU, 2 cores under load average 9-12 (other helpers'
benchmarks); the presets' and the proxy-only Q2_K mix's KLD equal the run above to every digit, so the
proxy-only rows at Q3_K_M/Q4_K_M are the run above's. ``mix+kld``: the search weighs each tensor's proxy error
by its group's KLD per proxy unit; ``est KLD``: the report's estimated mean KLD (measured on calib.txt) against
llama-perplexity's on the other half:

    size of  file        bytes    bpw  mean KLD  p99 KLD    dPPL  same top  KLD ratio  target   est KLD
    q2_k     preset   88206240  5.246   0.25973   1.1021  +1.911   74.95%      1.000            0.20681
    q2_k     mix      88064000  5.238   0.02297   0.0897  +0.221   91.23%      0.088    0.30   0.02467
    q2_k     mix+kld  88160768  5.243   0.02004   0.0837  +0.197   91.15%      0.077    0.30   0.01571
    q3_k_m   preset   93514656  5.562   0.07648   0.3694  +0.837   85.27%      1.000            0.06641
    q3_k_m   mix+kld  93483008  5.560   0.01445   0.0543  +0.179   92.92%      0.189    0.35   0.01524
    q4_k_m   preset  105458592  6.272   0.02943   0.1582  +0.350   91.47%      1.000            0.02425
    q4_k_m   mix+kld 105371616  6.267   0.00226   0.0107  +0.039   97.40%      0.077    0.75   0.00000

The sensitivity lowers the mix's mean KLD by 13 %, 1 % and 7 % (p99 by 7 %, 6 %, 5 %), so ``quantize`` uses it
in the search by default (``--sensitivity auto`` = ``search`` where PyTorch is installed). The estimate is
within 0.78-1.07x of llama-perplexity's KLD for the presets and the Q2_K/Q3_K_M mixes, but it misses the
Q4_K_M mix (1e-6 vs 0.0023): this F16 was made from a Q4_1 file, so Q4_1 (178 of its tensors) re-creates the
weights almost exactly and no weight error remains to measure; what llama-perplexity sees there is its own
rounding of activations to Q8_1 for Q4_1 dot products, which no weight-error proxy models. The first measurement
(proxy at the probe types for 211 tensors, 22 forward passes of 256 tokens, numba compilation) took 761 s wall,
181 s CPU on the loaded machine; the low-probe calibration pass added later took about 45 s; from the cache, 1-8 s.

After the second probe, ``allocate_best`` and the final check (2026-11-27 04:17-04:44, same CPU, load 2-3 with
CI running beside it; ``--sensitivity search``, the sensitivity re-measured (cache version 2: 116.9 s wall),
proxies from the cache; preset rows as above):

    size of  file        bytes  mean KLD  p99 KLD    dPPL  same top  KLD ratio  target  final check (calibration)
    q2_k     mix+kld  88195328   0.02048   0.0791  +0.216   91.40%      0.079    0.30   mix 0.0192 vs Q2_K 0.2757
    q3_k_m   mix+kld  93483008   0.01451   0.0556  +0.175   92.67%      0.190    0.35   mix 0.0142 vs Q3_K_M 0.0670
    q4_k_m   mix+kld 105371616   0.00236   0.0110  +0.031   97.33%      0.080    0.75   mix 3.4e-6 vs Q4_K_M 0.0242

Within 2 % of the earlier mixes (the plans barely move: Q4_1 re-creates most tensors of this F16); the final
check chose the mix at every size. Search + write: 389 s at Q2_K's size (sensitivity and 1355 new proxy
pairs), 99 s and 44 s for the next two (everything cached; the final check's quantize-and-score of the plans).

Run: ``python tests/llama_cpp_sources.py`` (fetches the model and builds the tools), then
``python benchmarks/bench_quantize_target.py [--work DIR] [--proxy relative|absolute] [--preset q2_k ...]
[--sensitivity off|estimate|search ...]`` (default: proxy ``relative``, all three presets, sensitivity off;
not part of CI).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CTX = 512
IMATRIX_CHUNKS = 16
KLD_CHUNKS = 16
THREADS = 2
PRESETS = ("q2_k", "q3_k_m", "q4_k_m")
TARGET_RATIO = {"q2_k": 0.30, "q3_k_m": 0.35, "q4_k_m": 0.75}


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed:\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def _num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"no {pattern!r} in llama-perplexity's output:\n{text[-3000:]}")
    return float(m.group(1))


def score(path: Path, evalt: Path, base: Path) -> dict[str, float]:
    """llama-perplexity's KLD statistics of ``path`` against the stored base logits."""
    from llama_cpp_sources import tool_path

    out = _run([str(tool_path("llama-perplexity")), "-m", str(path), "-f", str(evalt), "-c", str(CTX), "--chunks",
                str(KLD_CHUNKS), "-t", str(THREADS), "-nr", "--kl-divergence-base", str(base), "--kl-divergence"])
    return {"mean_kld": _num(r"Mean\s+KLD:\s*([-0-9.e+]+)", out), "p99_kld": _num(r"99\.0%\s+KLD:\s*([-0-9.e+]+)", out),
            "ppl_q": _num(r"Mean\s+PPL\(Q\)\s*:\s*([-0-9.e+]+)", out),
            "ppl_base": _num(r"Mean\s+PPL\(base\)\s*:\s*([-0-9.e+]+)", out),
            "same_top": _num(r"Same top p:\s*([-0-9.e+]+)", out)}


def main(work: Path, proxies: tuple[str, ...] = ("relative",), presets: tuple[str, ...] = PRESETS,
         sensitivities: tuple[str, ...] = ("off",)) -> dict:
    from bench_imatrix import cpu_description
    from llama_cpp_sources import tool_path
    from real_models import real_model_path

    from ggufkit.eval.target_sensitivity import quantize_to_target_kld
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    text = (Path(__file__).resolve().parents[1] / "eval" / "data" / "sample.txt").read_text()
    half = len(text) // 2
    calib, evalt = work / "calib.txt", work / "eval.txt"
    calib.write_text(text[:half])
    evalt.write_text(text[half:])
    # a WORKDIR of an earlier run keeps its F16, imatrix and base logits (same text, same settings)
    f16 = work / "smollm2-f16.gguf"
    if not f16.exists():
        quantize_file(real_model_path("smollm2-135m-instruct-q4_1"), f16, "f16", allow_requantize=True)
    im = work / "imatrix.gguf"
    if not im.exists():
        _run([str(tool_path("llama-imatrix")), "-m", str(f16), "-f", str(calib), "-c", str(CTX), "--chunks",
              str(IMATRIX_CHUNKS), "-t", str(THREADS), "-o", str(im), "--no-ppl", "-nr"])
    base = work / "base.kld"
    if not base.exists():
        _run([str(tool_path("llama-perplexity")), "-m", str(f16), "-f", str(evalt), "-c", str(CTX), "--chunks",
              str(KLD_CHUNKS), "-t", str(THREADS), "-nr", "--kl-divergence-base", str(base)])
    n_weights = None
    rows: dict = {}
    cache = work / "cache"
    for preset in presets:
        ref = work / f"{preset}.gguf"
        t = time.perf_counter()
        _run([str(tool_path("llama-quantize")), "--imatrix", str(im), str(f16), str(ref), preset.upper(), str(THREADS)])
        t_preset = time.perf_counter() - t
        size = ref.stat().st_size
        row: dict = {"size": size, "preset": {"bytes": size, "seconds": t_preset, **score(ref, evalt, base)}}
        for proxy in proxies:
            for sens in sensitivities:
                tag = f"mix-{proxy}" + ("" if sens == "off" else f"-{sens}")
                mix = work / f"{preset}-{tag}.gguf"
                t = time.perf_counter()
                # the measured sensitivity runs on the imatrix's text (calib.txt), not on the scored text
                rep, sres = quantize_to_target_kld(
                    f16, mix, target_like=preset, imatrix=im, cache_dir=cache, proxy=proxy, sensitivity=sens,
                    calibration_text=calib, mix_out=work / f"{preset}-{tag}.txt", device="cpu", threads=THREADS)
                t_mix = time.perf_counter() - t
                n_weights = rep.plan.n_elements
                if rep.reference_estimated_kld is not None:
                    row["preset"]["est_kld"] = rep.reference_estimated_kld
                row[tag] = {"bytes": mix.stat().st_size, "seconds": t_mix, "measured": rep.measured,
                            "cached": rep.cached, "types": rep.plan.type_counts(), "est_kld": rep.estimated_kld,
                            "sens_seconds": sres.seconds if sres is not None else None,
                            "final_check": rep.final_check.to_dict() if rep.final_check is not None else None,
                            **score(mix, evalt, base)}
                print(json.dumps({preset: {tag: row[tag]}}), flush=True)
        rows[preset] = row
        print(json.dumps({preset: row}), flush=True)
    out = {"cpu": cpu_description(), "ctx": CTX, "kld_chunks": KLD_CHUNKS, "imatrix_chunks": IMATRIX_CHUNKS,
           "rows": rows}
    print(f"\n{out['cpu']}")
    print(f"{'size of':8} {'file':6} {'bytes':>10} {'bpw':>6} {'mean KLD':>9} {'p99 KLD':>8} {'dPPL':>7} "
          f"{'same top':>8} {'KLD ratio':>9} {'target':>6} {'est KLD':>8}")
    for preset, row in rows.items():
        for tag, r in row.items():
            if not isinstance(r, dict):
                continue
            if r.get("final_check"):
                tag = f"{tag}:{r['final_check']['chosen']}"
            bpw = r["bytes"] * 8 / n_weights if n_weights else float("nan")
            ratio = r["mean_kld"] / row["preset"]["mean_kld"]
            print(f"{preset:8} {tag:6} {r['bytes']:>10} {bpw:6.3f} {r['mean_kld']:9.5f} {r['p99_kld']:8.4f} "
                  f"{r['ppl_q'] - r['ppl_base']:+7.3f} {r['same_top']:7.2f}% {ratio:9.3f} "
                  f"{'' if tag == 'preset' else TARGET_RATIO[preset]:>6} "
                  f"{'-' if r.get('est_kld') is None else format(r['est_kld'], '.5f'):>8}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="mix vs preset at equal size (see the module docstring)")
    ap.add_argument("--work", type=Path, help="work directory (reused: F16, imatrix, base logits, cache)")
    ap.add_argument("--proxy", action="append", choices=["relative", "absolute"])
    ap.add_argument("--preset", action="append", choices=PRESETS)
    ap.add_argument("--sensitivity", action="append", choices=["off", "estimate", "search"],
                    help="measured KLD sensitivity: off, estimate (proxy search, estimated KLD), search")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_quantize_target_"))
    work.mkdir(parents=True, exist_ok=True)
    main(work, tuple(a.proxy or ("relative",)), tuple(a.preset or PRESETS), tuple(a.sensitivity or ("off",)))
