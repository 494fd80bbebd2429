"""Every ``--type`` preset measured on a real small model: file size relative to F16, KLD and PPL change.

This is the data ``ggufkit quantize --help`` shows beside each preset (``quant/llama_quantize/preset_quality.py``), in the
spirit of llama-quantize's QUANT_OPTIONS descriptions ("4.58G, +0.1754 ppl @ Llama-3-8B",
tools/quantize/quantize.cpp), measured here with ggufkit's own quantizer and evaluator:

1. the reference: a published GGUF (default SmolLM2-135M-Instruct Q4_1 from tests/real_models.py)
   dequantized to F16 by ``quantize --type f16 --allow-requantize`` (it holds exactly the Q4_1 values, so
   types at 4.5 bpw and above measure close to lossless: the ranking holds, the absolute figures flatter);
2. an importance matrix of the reference on the first ``IMATRIX_CHARS`` characters of ggufkit's bundled
   sample text (eval/data/sample.txt), ``CTX`` tokens per chunk, given to every preset (several need one);
3. every preset quantized from the reference (``quantize_file``, the same code as the CLI), its file size
   divided by the F16 file's, then its KL divergence from the F16 model (exact, whole vocabulary, as
   ``ggufkit ppl --baseline`` computes it side by side) and its perplexity, on ``CHUNKS`` chunks of ``CTX``
   tokens of the text after the imatrix part; the F16 logits are computed once. F16, F32 and COPY hold the
   reference's values exactly (KLD 0 without a run), an alias (Q4_K) is the file of its preset (Q4_K_M), a
   preset without a kernel in this build gets its exact predicted size and no quality figure, and one the
   model's shapes refuse (Q1_0: rows of 576 are no whole blocks of 128) gets its error.

Run (not part of CI; about 40 minutes on 2 shared cores):
``python benchmarks/bench_preset_quality.py [--model NAME_OR_PATH] [--presets q4_k_m,...] [--write]``;
``--write`` regenerates ``quant/llama_quantize/preset_quality.py`` (only with every preset measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CTX = 256
CHUNKS = 4
IMATRIX_CHARS = 40_000
IMATRIX_CHUNKS = 16
DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"
OUT_MODULE = ROOT / "quant" / "llama_quantize" / "preset_quality.py"
#: Default types whose file holds the F16 reference's values exactly (F16 copied, or widened to F32).
LOSSLESS = ("F16", "F32")


def _model_path(name: str) -> tuple[Path, str]:
    if Path(name).is_file():
        return Path(name), Path(name).name
    from real_models import REAL_MODELS, real_model_path

    return real_model_path(name), REAL_MODELS[name].filename


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(model: str, presets: list[str], workdir: Path, threads: int | None) -> dict[str, Any]:
    import torch

    from ggufkit.errors import GGUFKitError
    from ggufkit.eval import collect_imatrix
    from ggufkit.eval.kld import KLDAccumulator
    from ggufkit.eval.model import load_model
    from ggufkit.eval.perplexity import _tokens, chunk_windows, sample_text
    from ggufkit.format import open_gguf
    from ggufkit.quant.imatrix.reader import load_imatrix
    from ggufkit.quant.llama_quantize.pipeline import predict_file_size, quantize_file
    from ggufkit.quant.llama_quantize.presets import ALIASES, PRESETS

    src, src_name = _model_path(model)
    ref = workdir / "ref-f16.gguf"
    if not ref.exists():
        _log(f"reference: {src_name} -> F16")
        quantize_file(src, ref, "f16", allow_requantize=True, threads=threads)
    text = sample_text()
    imatrix_text, eval_text = text[:IMATRIX_CHARS], text[IMATRIX_CHARS:]
    im_path = workdir / "imatrix.gguf"
    if not im_path.exists():
        _log("imatrix")
        collect_imatrix(ref, text=imatrix_text, output=im_path, ctx=CTX, chunks=IMATRIX_CHUNKS, device="cpu")
    im = load_imatrix(im_path)

    base = load_model(ref, device="cpu")
    ids, add_bos, bos_id, _ = _tokens(base.file, eval_text, None)
    stream = torch.tensor(ids[: CHUNKS * CTX], dtype=torch.int64).reshape(CHUNKS, CTX)
    windows = list(chunk_windows(stream, CHUNKS, add_bos, bos_id))
    base_logits = [base.logits(w, start=CTX // 2)[:, :-1].clone() for _, w, _ in windows]
    base.close()
    ref_size = ref.stat().st_size
    with open_gguf(ref) as f:
        n_params = sum(t.n_elements for t in f.tensors)

    rows: dict[str, dict[str, Any]] = {}
    ppl_f16 = None
    for name in presets:
        p = PRESETS[name]
        out = workdir / f"{name}.gguf"
        t0 = time.perf_counter()
        try:
            report = quantize_file(ref, None, name, imatrix=im, dry_run=True)
        except GGUFKitError as exc:  # e.g. Q1_0: rows of 576 are no whole blocks of 128, and no fallback
            rows[name] = {"size": None, "kld": None, "ppl_change": None, "error": exc.message}
            _log(f"{name}: {exc}")
            continue
        row: dict[str, Any] = {}
        if name in ALIASES:  # the same file as the preset it stands for: filled in below
            continue
        if report.plan.missing_kernels():
            with open_gguf(ref) as f:
                size = predict_file_size(f, report.plan, im)
            row.update(size=round(size / ref_size, 4), kld=None, ppl_change=None)
        else:
            quantize_file(ref, out, name, imatrix=im, threads=threads)
            size = out.stat().st_size
        if not report.plan.missing_kernels() and p.default_type.name in LOSSLESS:  # F16 widened or copied: exact
            row.update(size=round(size / ref_size, 4), kld=0.0, ppl_change=0.0, same_top=1.0)
            out.unlink()
        elif not report.plan.missing_kernels():
            m = load_model(out, device="cpu")
            acc = KLDAccumulator()
            for (_, w, targets), bl in zip(windows, base_logits):
                logits = m.logits(w, start=CTX // 2)[:, :-1]
                for i in range(logits.shape[0]):
                    acc.add(logits[i], bl[i], targets[i])
            m.close()
            s = acc.summary()
            ppl_f16 = s["ppl_base"]
            row.update(size=round(size / ref_size, 4), kld=round(float(s["mean_kld"]), 6),
                       ppl_change=round(float(s["ppl_ratio"]) - 1.0, 5),
                       same_top=round(float(s["same_top_p"]), 4))
            out.unlink()
        row["bpw"] = round(size * 8 / n_params, 3)
        row["fallback"] = round(report.plan.fallback_share, 3)
        rows[name] = row
        _log(f"{name}: {row} ({time.perf_counter() - t0:.0f} s)")
    for name in presets:
        if name in ALIASES and ALIASES[name] in rows:
            rows[name] = dict(rows[ALIASES[name]])
    rows = {name: rows[name] for name in presets if name in rows}
    kind = src_name.rsplit(".", 2)[-2] if src_name.count(".") >= 2 else "quantized"
    return {"model": src_name, "model_type": kind,
            "reference": f"its F16 dequantization: types that hold {kind} values exactly measure ~0",
            "text": f"eval/data/sample.txt, {CHUNKS} chunks of {CTX} tokens after the first {IMATRIX_CHARS} "
                    f"characters",
            "imatrix": f"the F16's, on the first {IMATRIX_CHARS} characters ({IMATRIX_CHUNKS} x {CTX} tokens)",
            "ppl_f16": round(ppl_f16, 4) if ppl_f16 is not None else None, "n_params": n_params, "f16_bytes": ref_size,
            "date": datetime.date.today().isoformat(), "presets": rows}


def annotate(data: dict[str, Any], exact_below: float = 2e-5) -> dict[str, Any]:
    """Mark the presets whose grid holds the reference's own values (KLD about 0 though lossy in general:
    Q4_1 and Q5_1 on a Q4_1 model), so that ``--help`` does not present them as lossless."""
    from ggufkit.quant.llama_quantize.presets import PRESETS

    for name, row in data["presets"].items():
        lossless = PRESETS[name].default_type.name in LOSSLESS
        notes = []
        if row.get("kld") is not None and row["kld"] < exact_below and not lossless:
            notes.append(f"exact on {data['model_type']} values")
        if row.get("fallback"):  # rows that are no whole blocks (576 wide): llama-quantize's fallback types
            notes.append(f"{row['fallback']:.0%} fallback")
        if notes:
            row["note"] = ", ".join(notes)
    return data


def write_module(data: dict[str, Any], path: Path = OUT_MODULE) -> None:
    def lit(value: Any) -> str:
        return json.dumps(value).replace("null", "None").replace("true", "True").replace("false", "False")

    lines = [f"    {lit(k)}: {lit(v)}," for k, v in data.items() if k != "presets"]
    lines.append('    "presets": {')
    lines += [f"        {lit(name)}: {lit(row)}," for name, row in data["presets"].items()]
    body = "{\n" + "\n".join(lines) + "\n    },\n}"
    path.write_text(
        '"""Each ``--type`` preset measured on a real small model (``quantize --help`` shows it).\n\n'
        "Generated by benchmarks/bench_preset_quality.py (its docstring says how); do not edit by hand.\n"
        "``presets``: name -> ``size`` (file bytes / the F16 file's), ``bpw`` (file bits per weight), ``kld``\n"
        "(mean KL divergence from the F16 model, exact) and ``ppl_change`` (PPL / F16's PPL - 1); ``kld`` and\n"
        '``ppl_change`` are None where this build has no kernel for the preset.\n"""\n\n'
        "from __future__ import annotations\n\nfrom typing import Any\n\n"
        f"MEASURED: dict[str, Any] = {body}\n")


def main() -> None:
    from ggufkit.quant.llama_quantize.presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    presets = [p.strip().lower() for p in args.presets.split(",") if p.strip()]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_preset_quality_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        import numba
        import torch

        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    data = measure(args.model, presets, workdir, args.threads)
    print(json.dumps(data, indent=1))
    if args.write:
        if set(presets) != set(PRESETS):
            raise SystemExit("--write needs every preset measured")
        write_module(annotate(data))
        _log(f"wrote {OUT_MODULE}")
    os.sync()


if __name__ == "__main__":
    main()
