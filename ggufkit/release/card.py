"""The model card (README.md): Hugging Face front matter, the quality table, the plot, how to run, provenance.

Deterministic: built only from the manifest's numbers and the options (no dates, no absolute paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ggufkit.release.mix import card_lines
from ggufkit.release.plan import PLOT, source_card_front_matter

#: Mean-KLD bands of the recommendation column (nats per token against the master).
BANDS = ((0.005, "near-lossless"), (0.02, "very good"), (0.06, "good"), (0.2, "noticeable loss"))
REPO_PLACEHOLDER = "<user>/<repo>"


def recommendation(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """A short note from the numbers: the KLD band, plus the smallest file of the best bands."""
    kld = row["mean_kld"]
    note = next((label for limit, label in BANDS if kld <= limit), "heavy loss, last resort")
    smallest_good = min((r for r in rows if r["mean_kld"] <= BANDS[2][0]), key=lambda r: r["size"], default=None)
    smallest_lossless = min((r for r in rows if r["mean_kld"] <= BANDS[0][0]), key=lambda r: r["size"],
                            default=None)
    if smallest_good is not None and row["type"] == smallest_good["type"]:
        note = f"**recommended**: smallest file with mean KLD ≤ {BANDS[2][0]}"
    elif smallest_lossless is not None and row["type"] == smallest_lossless["type"]:
        note += "; smallest near-lossless"
    return note


def _human(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def front_matter(plan: Any, repo_id: str | None, vision: bool = False) -> dict[str, Any]:
    """The card's YAML metadata; license and language come from the source card when it has them."""
    src = source_card_front_matter(plan.source_card)
    meta: dict[str, Any] = {"base_model": plan.repo or plan.model_name, "base_model_relation": "quantized",
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
                repo_id: str | None, version: str, *, projector: dict[str, Any] | None = None) -> str:
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
    """
    import yaml

    o = plan.options
    repo = repo_id or REPO_PLACEHOLDER
    exact = all(r.get("mean_kld_upper") is None or r["mean_kld_upper"] == r["mean_kld"] for r in rows)
    pj = projector
    meta = front_matter(plan, repo_id, pj is not None)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(),
             "---", "", f"# {plan.model_name} GGUF", "",
             "GGUF quantizations of "
             + (f"[{plan.repo}](https://huggingface.co/{plan.repo})" if plan.repo else plan.model_name)
             + f", made with ggufkit {version} (`ggufkit release`): quantized byte-identically to llama.cpp's "
               f"`llama-quantize` from the {plan.master_type} master"
             + (", with an importance matrix" if plan.use_imatrix else "") + "."
             + (f" The vision projector `{pj['file']}` goes beside any of them: images are read by llama.cpp's "
                "libmtmd (llama-mtmd-cli, llama-server)." if pj else ""), "",
             "## Files", "",
             "| file | type | size | bits/weight | PPL | ΔPPL | mean KLD | p99 KLD | same top | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
             f"| `{files['master'][0]}` | {plan.master_type} (master) | {_human(master['size'])} | "
             f"{master['bpw']:.2f} | {master['ppl']:.4f} ± {master['ppl_error']:.4f} | – | – | – | – | reference |"]
    if pj:
        lines.append(f"| `{pj['file']}` | {pj['file_type']} (vision projector) | {_human(pj['size'])} | "
                     f"{pj['bpw']:.2f} | – | – | – | – | – | {pj['projector_type']}, {pj['tokens_per_image']} tokens "
                     f"per {pj['image_size']} px image; load with `--mmproj` beside any file |")
    for r in rows:
        name = files[r["type"]][0] + (f" (+{len(files[r['type']]) - 1} shards)" if len(files[r["type"]]) > 1 else "")
        lines.append(f"| `{name}` | {r['type']} | {_human(r['size'])} | {r['bpw']:.2f} | "
                     f"{r['ppl']:.4f} ± {r['ppl_error']:.4f} | {100 * r['delta_ppl']:+.2f}% | {r['mean_kld']:.5f} | "
                     f"{r['p99_kld']:.5f} | {100 * r['same_top_p']:.1f}% | {recommendation(r, rows)} |")
    kld_note = ("exact (the stored top-K covers the vocabulary)" if exact else
                f"lower bounds from the master's stored top-{o.kld_top_k} tokens; the manifest has each upper bound")
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
    first_type = presets[0]["type"] if presets else plan.master_type
    first_file = files[presets[0]["type"]][0] if presets else files["master"][0]
    # a glob *Q3_K_M.gguf would also match a mix's *-MIX-Q3_K_M.gguf: with mixes, the exact file name
    pattern = first_file if len(presets) < len(rows) else f"*{first_type}.gguf"
    if pj:
        lines += ["llama.cpp, text and images (`-hf` fetches the projector with the model):", "", "```sh",
                  f"llama-mtmd-cli -hf {repo}:{first_type} --image image.jpg -p \"Describe this image.\"",
                  f"llama-mtmd-cli -m {first_file} --mmproj {pj['file']} --image image.jpg -p \"Describe this image.\"",
                  f"llama-server -m {first_file} --mmproj {pj['file']}",
                  "```", ""]
    lines += ["llama.cpp" + (", text only" if pj else "") + ":", "", "```sh",
              f"llama-cli -hf {repo}:{first_type} -p \"Hello\"",
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
              + f" (files sha256 `{plan.source_id}`, listed in `manifest.json`)",
              f"- master: `{files['master'][0]}` ({plan.master_type}, converted by ggufkit {version})",
              *([f"- vision projector: `{pj['file']}` ({pj['file_type']}, projector type {pj['projector_type']}, "
                 f"converted by ggufkit {version} from the same checkpoint)"] if pj else []),
              f"- importance matrix: {im}",
              f"- evaluation text: {plan.eval_text.name} (sha256 `{plan.eval_text.sha256}`), ctx {o.ctx}, "
              f"{master['chunks']} chunks",
              "- every file's sha256 and size, every step's parameters and every number: `manifest.json`", ""]
    return "\n".join(lines)
