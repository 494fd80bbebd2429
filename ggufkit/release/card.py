"""The model card (README.md): Hugging Face front matter, the quality table, the plot, how to run, provenance.

Deterministic: built only from the manifest's numbers and the options (no dates, no absolute paths).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ggufkit.release.mix import card_lines
from ggufkit.release.plan import PLOT, source_card_front_matter
from ggufkit.units import human_bytes

#: Mean-KLD bands of the recommendation column (nats per token against the master).
BANDS = ((0.005, "near-lossless"), (0.02, "very good"), (0.06, "good"), (0.2, "noticeable loss"))
REPO_PLACEHOLDER = "<user>/<repo>"


def recommendation(row: dict[str, Any], rows: Sequence[dict[str, Any]],
                   failed: Mapping[str, str] | None = None) -> str:
    """A short note from the numbers: the KLD band, plus the smallest file of the best bands. A file that
    failed its gate (``failed``: type -> why) is never recommended; its note says it failed."""
    failed = failed or {}
    if row["type"] in failed:
        return f"**failed the quality gate**: {failed[row['type']]}"
    kld = row["mean_kld"]
    note = next((label for limit, label in BANDS if kld <= limit), "heavy loss, last resort")
    passed = [r for r in rows if r["type"] not in failed]
    smallest_good = min((r for r in passed if r["mean_kld"] <= BANDS[2][0]), key=lambda r: r["size"], default=None)
    smallest_lossless = min((r for r in passed if r["mean_kld"] <= BANDS[0][0]), key=lambda r: r["size"],
                            default=None)
    if smallest_good is not None and row["type"] == smallest_good["type"]:
        note = f"**recommended**: smallest file with mean KLD ≤ {BANDS[2][0]}"
    elif smallest_lossless is not None and row["type"] == smallest_lossless["type"]:
        note += "; smallest near-lossless"
    return note


def recommended(rows: Sequence[dict[str, Any]], failed: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The row the card recommends (None when no file passed with mean KLD ≤ the "good" band)."""
    failed = failed or {}
    return min((r for r in rows if r["type"] not in failed and r["mean_kld"] <= BANDS[2][0]),
               key=lambda r: r["size"], default=None)


def fixed(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals; a value that rounds to zero prints without a sign (never ``-0.00``)."""
    text = f"{x:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def percent(x: float) -> str:
    """A signed percentage of the fraction ``x`` (``+1.25%``, ``-0.40%``); one that rounds to zero prints
    ``0.00%``, without a sign."""
    text = f"{100 * x:+.2f}"
    return f"{text[1:] if float(text) == 0 else text}%"


def kld_cell(row: dict[str, Any], key: str = "mean_kld") -> str:
    """A row's mean KLD as the card and the CLI print it: exact, or ``≤ x`` (an upper bound); its p99
    (``key="p99_kld"``): exact, or ``≥ x`` (a lower bound)."""
    mark = "" if row.get("kld_exact", True) else ("≤ " if key == "mean_kld" else "≥ ")
    return mark + fixed(row[key], 5)


def base_model(plan: Any) -> str:
    """The model this release quantizes: ``--base-model``, else the hub repo the source came from, else the
    source folder's name."""
    return str(plan.options.base_model or plan.repo or plan.model_name)


def front_matter(plan: Any, repo_id: str | None, vision: bool = False) -> dict[str, Any]:
    """The card's YAML metadata; license and language come from the source card when it has them."""
    src = source_card_front_matter(plan.source_card)
    meta: dict[str, Any] = {"base_model": base_model(plan), "base_model_relation": "quantized",
                            "quantized_by": plan.options.quantized_by}
    for key in ("license", "license_name", "license_link", "language"):
        if key in src:
            meta[key] = src[key]
    tags = ["gguf", "ggufkit", "llama.cpp", "quantized"] + (["imatrix"] if plan.use_imatrix else []) \
        + (["vision", "mmproj"] if vision else [])
    meta["tags"] = tags
    meta["pipeline_tag"] = src.get("pipeline_tag", "image-text-to-text" if vision else "text-generation")
    meta["library_name"] = "gguf"
    return meta


def render_card(plan: Any, master: dict[str, Any], rows: Sequence[dict[str, Any]], files: dict[str, list[str]],
                repo_id: str | None, version: str, *, projector: dict[str, Any] | None = None,
                failed: Mapping[str, str] | None = None) -> str:
    """The README.md text.

    Args:
        plan: the :class:`~ggufkit.release.plan.ReleasePlan`.
        master: the master's scores (``ppl``, ``ppl_error``, ``chunks``, ``tokens_scored``) plus ``size``, ``bpw``.
        rows: one per type, in release order: ``type``, ``ppl``, ``ppl_error``, ``delta_ppl``, ``mean_kld``,
            ``mean_kld_upper``, ``p99_kld``, ``same_top_p``, ``size``, ``bpw``.
        files: type (and ``master``) -> its file names.
        repo_id: the hub repository the card will live in (placeholder when unknown).
        version: ggufkit's version.
        projector: a vision-language model's projector (``file``, ``file_type``, ``size``, ``bpw``,
            ``projector_type``, ``image_size``, ``tokens_per_image``): listed with the files, run with
            llama-mtmd-cli; None (text-only models) leaves the card as it was.
        failed: type -> why it failed its quality gate (never recommended; its note says so).
    """
    import yaml

    o = plan.options
    repo = repo_id or REPO_PLACEHOLDER
    exact = all(r.get("kld_exact", True) for r in rows)
    base = base_model(plan)
    linked = plan.options.base_model is not None or plan.repo is not None
    pj = projector
    meta = front_matter(plan, repo_id, pj is not None)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(),
             "---", "", f"# {plan.model_name} GGUF", "",
             "GGUF quantizations of "
             + (f"[{base}](https://huggingface.co/{base})" if linked else base)
             + f", made with ggufkit {version} (`ggufkit release`): quantized byte-identically to llama.cpp's "
               f"`llama-quantize` from the {plan.master_type} master"
             + (", with an importance matrix" if plan.use_imatrix else "") + "."
             + (f" The vision projector `{pj['file']}` goes beside any of them: images are read by llama.cpp's "
                "libmtmd (llama-mtmd-cli, llama-server)." if pj else ""), "",
             "## Files", "",
             "| file | type | size | bits/weight | PPL | ΔPPL | mean KLD | p99 KLD | same top | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
             f"| `{files['master'][0]}` | {plan.master_type} (master) | {human_bytes(master['size'])} | "
             f"{master['bpw']:.2f} | {master['ppl']:.4f} ± {master['ppl_error']:.4f} | – | – | – | – | reference |"]
    if pj:
        lines.append(f"| `{pj['file']}` | {pj['file_type']} (vision projector) | {human_bytes(pj['size'])} | "
                     f"{pj['bpw']:.2f} | – | – | – | – | – | {pj['projector_type']}, {pj['tokens_per_image']} tokens "
                     f"per {pj['image_size']} px image; load with `--mmproj` beside any file |")
    for r in rows:
        name = files[r["type"]][0] + (f" (+{len(files[r['type']]) - 1} shards)" if len(files[r["type"]]) > 1 else "")
        lines.append(f"| `{name}` | {r['type']} | {human_bytes(r['size'])} | {r['bpw']:.2f} | "
                     f"{r['ppl']:.4f} ± {r['ppl_error']:.4f} | {percent(r['delta_ppl'])} | {kld_cell(r)} | "
                     f"{kld_cell(r, 'p99_kld')} | {100 * r['same_top_p']:.1f}% | {recommendation(r, rows, failed)} |")
    kld_note = ("exact: the master's whole vocabulary is scored at every position" if exact else
                f"from the master's stored top-{plan.kld_top_k} tokens of its {plan.n_vocab}, so not exact: "
                "a mean marked ≤ is an upper bound of the true mean KLD, and a p99 marked ≥ a lower bound")
    lines += ["",
              f"PPL: perplexity on the evaluation text ({master['chunks']} chunks of {o.ctx} tokens, "
              f"{master['tokens_scored']} scored tokens, llama-perplexity's method). ΔPPL: PPL(type)/PPL(master) − 1. "
              f"KLD: KL divergence of each type's next-token distribution from the master's (mean and 99th "
              f"percentile; {kld_note}). Same top: share of positions whose most likely token is the master's. "
              "Note: the master's logits are scored once and every type is compared with them.", "",
              f"![size against quality]({PLOT})", "", *card_lines(plan, list(rows), files),
              "## How to run", ""]
    # the hub names a file by its llama-quantize type (`-hf REPO:Q4_K_M`): the mixes are run by file name
    presets = [r for r in rows if not r.get("mix")]
    # the examples run the recommended file (else the first that passed its gate, else the first)
    run = recommended(rows, failed) or next((r for r in presets if r["type"] not in (failed or {})),
                                            presets[0] if presets else None)
    first_type = run["type"] if run is not None else plan.master_type
    first_file = files[run["type"]][0] if run is not None else files["master"][0]
    # llama.cpp's common arguments: -hf REPO:QUANT picks a file by its type, --hf-file names one (a mix)
    hf = f"{repo} --hf-file {first_file}" if run is not None and run.get("mix") else f"{repo}:{first_type}"
    # a glob *Q3_K_M.gguf would also match a mix's *-MIX-Q3_K_M.gguf: with mixes, the exact file name
    pattern = first_file if len(presets) < len(rows) else f"*{first_type}.gguf"
    if pj:
        lines += ["llama.cpp, text and images (`-hf` fetches the projector with the model):", "", "```sh",
                  f"llama-mtmd-cli -hf {hf} --image image.jpg -p \"Describe this image.\"",
                  f"llama-mtmd-cli -m {first_file} --mmproj {pj['file']} --image image.jpg -p \"Describe this image.\"",
                  f"llama-server -m {first_file} --mmproj {pj['file']}",
                  "```", ""]
    lines += ["llama.cpp" + (", text only" if pj else "") + ":", "", "```sh",
              f"llama-cli -hf {hf} -p \"Hello\"",
              f"llama-cli -m {first_file} -p \"Hello\"",
              "```", "", "llama-cpp-python:", "", "```python", "from llama_cpp import Llama", "",
              f"llm = Llama.from_pretrained(repo_id=\"{repo}\", filename=\"{pattern}\")",
              "print(llm(\"Hello\", max_tokens=32)[\"choices\"][0][\"text\"])", "```", "",
              "ollama" + (" (the projector is fetched with the model)" if pj else "") + ":", "", "```sh"]
    lines += [f"ollama run hf.co/{repo}:{r['type']}" for r in presets] + ["```", ""]
    it = plan.imatrix_text
    im = ("none" if not plan.use_imatrix else
          f"`{plan.imatrix_file}`, given" if o.imatrix is not None else
          f"`{plan.imatrix_file}`, collected on the master over {it.name if it else ''} "
          f"(sha256 `{it.sha256 if it else ''}`), ctx {o.ctx}, "
          f"{o.imatrix_chunks if o.imatrix_chunks is not None else (o.chunks or 'all')} chunks")
    lines += ["## Provenance", "",
              f"- source: {plan.repo or plan.model_name}" + (f" at revision `{plan.revision}`" if plan.revision else "")
              + (f" (base model `{plan.options.base_model}`)" if plan.options.base_model else "")
              + f" (files sha256 `{plan.source_id}`, listed in `manifest.json`)",
              f"- master: `{files['master'][0]}` ({plan.master_type}, converted by ggufkit {version})",
              *([f"- vision projector: `{pj['file']}` ({pj['file_type']}, projector type {pj['projector_type']}, "
                 f"converted by ggufkit {version} from the same checkpoint)"] if pj else []),
              f"- importance matrix: {im}",
              f"- evaluation text: {plan.eval_text.name} (sha256 `{plan.eval_text.sha256}`), ctx {o.ctx}, "
              f"{master['chunks']} chunks",
              "- every file's sha256 and size, every step's parameters and every number: `manifest.json`", ""]
    return "\n".join(lines)
