"""``ggufkit release``: a thin shell over :func:`ggufkit.release.release`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from ggufkit.cli._options import SizeParam, common_options, device_option, dry_run_option, imatrix_option
from ggufkit.cli._output import Output, human_bytes, table


def _render(d: Mapping[str, Any]) -> str:
    from ggufkit.release.card import kld_cell, percent

    if d["dry_run"]:
        steps: list[tuple[str, ...]] = [(s["step"], s["action"], ", ".join(s["files"]) or "-",
                 human_bytes(s["estimated_bytes"]) if s["estimated_bytes"] else "-", s["detail"]) for s in d["steps"]]
        lines = [table(steps, ["step", "action", "files", "estimated size", "detail"]), "",
                 f"files in {d['outdir']}: {', '.join(d['files'])}"]
        if d["push"]:
            p = d["push"]
            lines.append(f"would upload {len(p['files'])} files to {p['repo_id']}@{p['revision']} "
                         f"({'private' if p['private'] else 'public'}; {p['method']}, commit {p['commit_message']!r})")
        return "\n".join([*lines, "dry run: nothing written"])
    lines = [f"{d['outdir']}: ran {len(d['ran'])} steps, skipped {len(d['skipped'])}"]
    if d["rows"]:
        m = d["master"]
        rows: list[tuple[str, ...]] = [("master", human_bytes(m["size"]), f"{m['bpw']:.2f}", f"{m['ppl']:.4f}", "-", "-", "-", "-")]
        rows += [(r["type"], human_bytes(r["size"]), f"{r['bpw']:.2f}", f"{r['ppl']:.4f}",
                  percent(r["delta_ppl"]), kld_cell(r), kld_cell(r, "p99_kld"),
                  f"{100 * r['same_top_p']:.1f}%", {"failed": "FAILED", "passed": "passed"}.get(r.get("gate"), "-"))
                 for r in d["rows"]]
        lines += ["", table(rows, ["type", "size", "bpw", "PPL", "ΔPPL", "mean KLD", "p99 KLD", "same top", "gate"],
                            align="lrrrrrrrl")]
        if not all(r["kld_exact"] for r in d["rows"]):
            lines.append("KLD not exact (the master's stored top-K does not cover the vocabulary): ≤ marks an "
                         "upper bound, ≥ a lower bound")
    if d.get("projector"):
        pj = d["projector"]
        lines.append(f"vision projector: {pj['file']} ({pj['file_type']}, {pj['projector_type']}, "
                     f"{pj['tokens_per_image']} tokens per image), {human_bytes(pj['size'])}")
    if d["push"]:
        lines.append(f"uploaded to {d['push']['url']}")
    if d["failures"]:
        lines.append("quality gates FAILED: " + "; ".join(d["failures"]))
    return "\n".join(lines)


@click.command("release")
@click.argument("model", type=str)
@click.option("-o", "--outdir", default=None, type=click.Path(file_okay=False, path_type=str),
              help="The release directory (created; a rerun resumes it). Required, except with --matrix, which "
                   "writes nothing.")
@click.option("--types", default=None, metavar="LIST",
              help="Comma-separated llama-quantize types (default: Q2_K,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K,Q8_0 and, with "
                   "an importance matrix, IQ2_M,IQ3_M,IQ4_XS), and size-budget entries, case-insensitive: "
                   "MIX@PRESET (the size llama-quantize's PRESET file has for this model and imatrix, e.g. "
                   "MIX@Q3_K_M), MIX@SIZE (a whole-file size with a unit: K/M/G/T decimal, KiB/MiB/GiB/TiB, B; "
                   "e.g. MIX@2.5G, MIX@90MiB) or MIX@Xbpw (bits per weight, e.g. MIX@4.5bpw). Each is the best "
                   "per-tensor mix at that size (types chosen by measured error), written as "
                   "BASENAME-MIX-Q3_K_M.gguf with its llama-quantize --tensor-type-file recipe "
                   "BASENAME-MIX-Q3_K_M.tensor-types.txt.")
@click.option("--master", type=click.Choice(["auto", "bf16", "f16", "f32"]), default="auto", show_default=True,
              help="Type of the converted master every type is quantized from (auto: as the checkpoint).")
@click.option("--imatrix-text", type=click.Path(dir_okay=False, exists=True, path_type=str), default=None,
              help="Calibration text for the importance matrix (default: the bundled English sample).")
@imatrix_option(use=", used instead of collecting one")
@click.option("--no-imatrix", is_flag=True, help="No importance matrix (types that need one are refused).")
@click.option("--eval-text", type=click.Path(dir_okay=False, exists=True, path_type=str), default=None,
              help="Evaluation text (default: the bundled sample's part not used for calibration).")
@click.option("--ctx", "-c", type=click.IntRange(min=16), default=512, show_default=True,
              help="Tokens per chunk (imatrix and evaluation).")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Evaluate at most N chunks.")
@click.option("--imatrix-chunks", type=click.IntRange(min=1), default=None,
              help="Calibrate on at most N chunks (default: --chunks).")
@click.option("--kld-top-k", type=click.IntRange(min=1), default=None,
              help="Master tokens kept per scored position. Default: the whole vocabulary (every KLD exact) "
                   "when that takes at most 4 GiB (8 bytes per token per position), else 128 (each KLD is then "
                   "an upper bound, marked ≤).")
@click.option("--max-kld", multiple=True, metavar="TYPE=X",
              help="Gate: exit 1 if TYPE's mean KLD (the table's, exact or its upper bound) exceeds X (all=X "
                   "for every type); repeatable. A file that fails is never the card's recommendation.")
@click.option("--split-max-size", type=SizeParam(), default=None,
              help="Shard files larger than this (default 48G, under the hub's 50 GB file limit).")
@click.option("--only", multiple=True, metavar="TYPE",
              help="Make only this type and its evaluation (plus the master and imatrix if missing); repeatable.")
@click.option("--card-only", is_flag=True, help="Assemble the card and manifest from the --only runs' results.")
@click.option("--matrix", is_flag=True,
              help="Print the GitHub Actions strategy.matrix JSON of a release spread over CI jobs (one job per "
                   "type: --only TYPE --exchange DIR) and exit; nothing is written.")
@click.option("--shared-only", is_flag=True,
              help="The CI fan-out's first job: make only the master and the importance matrix (and a projector) "
                   "and put them in --exchange.")
@click.option("--exchange", type=click.Path(file_okay=False, path_type=str), default=None, metavar="DIR",
              help="The folder the CI's artifact steps carry between the jobs of a fan-out (--shared-only, "
                   "--only, --card-only): the master, the imatrix and each job's manifest part.")
@click.option("--push", metavar="REPO_ID", default=None, help="Upload OUTDIR to this hub repo after the gates pass.")
@click.option("--private", is_flag=True, help="Create the hub repo private (with --push).")
@click.option("--revision", default=None, metavar="BRANCH", help="Upload to this branch (with --push).")
@click.option("--quantized-by", default="ggufkit", show_default=True, help="The card's quantized_by.")
@click.option("--base-model", default=None, metavar="ID",
              help="The hub id of the model this release quantizes, for the card's base_model (default: the "
                   "hub repo MODEL came from, else the folder's name).")
@click.option("--mmproj-type", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default=None,
              help="Type of a vision-language model's projector (mmproj-*.gguf, shipped beside every quant; "
                   "default f16).")
@click.option("--no-mmproj", is_flag=True, help="Release a vision-language model's text model without its projector.")
@dry_run_option
@device_option
@common_options
def release(model: str, outdir: str | None, types: str | None, master: str, imatrix_text: str | None,
            imatrix: str | None, no_imatrix: bool, eval_text: str | None, ctx: int, chunks: int | None,
            imatrix_chunks: int | None, kld_top_k: int | None, max_kld: tuple[str, ...], split_max_size: int | None,
            only: tuple[str, ...], card_only: bool, matrix: bool, shared_only: bool, exchange: str | None,
            push: str | None, private: bool, revision: str | None,
            quantized_by: str, base_model: str | None, mmproj_type: str | None, no_mmproj: bool, dry_run: bool, device: str,
            out: Output) -> None:
    """Make MODEL's whole GGUF release in OUTDIR: convert once to the master, collect an importance matrix,
    quantize every type, score the master once and each type against it (PPL, ΔPPL, mean and p99 KLD, same
    top token), write the model card (README.md), a plot and manifest.json, check the gates, and upload with
    --push. A vision-language model's projector (mmproj-*.gguf) is written once and shipped beside every
    quant. A rerun skips every step whose inputs and files are unchanged; a killed run is resumed by
    running it again. Bad input exits 2 before any work; a failed gate exits 1 naming the types.

    \b
    Example:
      ggufkit release ./my-model -o my-model-GGUF --types q4_k_m,q8_0 --max-kld all=0.1
      ggufkit release ./my-model -o my-model-GGUF --types q3_k_m,mix@q3_k_m,mix@2.5G,mix@4.5bpw
      ggufkit release ./my-model -o my-model-GGUF --dry-run
      ggufkit release ./my-model -o my-model-GGUF --base-model meta-llama/Llama-3.2-1B
      ggufkit release ./my-model -o out --only q4_k_m      # one type per machine, then --card-only
      ggufkit release ./my-model -o my-model-GGUF --push me/my-model-GGUF
      ggufkit release ./my-model --matrix                          # CI: the per-type jobs' matrix
      ggufkit release ./my-model -o out --shared-only --exchange x  # first job: master + imatrix
      ggufkit release ./my-model -o out --only q4_k_m --exchange x  # one job per type
      ggufkit release ./my-model -o out --card-only --exchange x    # last: card and manifest
    """
    from ggufkit.cli._malloc import keep_freed_memory
    from ggufkit.errors import CheckFailedError, UsageError
    from ggufkit.release import release as run_release

    keep_freed_memory()
    type_list = [t.strip() for t in types.split(",") if t.strip()] if types else None
    if matrix:
        import json

        from ggufkit.release import release_matrix

        given = [n for n, v in (("--only", only), ("--card-only", card_only), ("--shared-only", shared_only),
                                ("--push", push), ("--exchange", exchange)) if v]
        if given:
            raise UsageError(f"--matrix prints the jobs' matrix; give it without {given[0]}")
        jobs = release_matrix(model, outdir, types=type_list, master=master, imatrix_text=imatrix_text,
                              imatrix=imatrix, no_imatrix=no_imatrix, eval_text=eval_text, ctx=ctx, chunks=chunks,
                              imatrix_chunks=imatrix_chunks, kld_top_k=kld_top_k, max_kld=max_kld,
                              split_max_size=split_max_size, device=device, quantized_by=quantized_by,
                              mmproj_type=mmproj_type, no_mmproj=no_mmproj, base_model=base_model)
        click.echo(json.dumps(jobs, separators=(",", ":")))
        return
    if outdir is None:
        raise UsageError("release needs -o/--outdir, the release directory (only --matrix, which writes nothing, "
                         "goes without it)")
    result = run_release(model, outdir, types=type_list, master=master, imatrix_text=imatrix_text,
                         imatrix=imatrix, no_imatrix=no_imatrix, eval_text=eval_text, ctx=ctx, chunks=chunks,
                         imatrix_chunks=imatrix_chunks, kld_top_k=kld_top_k, max_kld=max_kld,
                         split_max_size=split_max_size, only=only, card_only=card_only, push=push,
                         private=private, revision=revision, dry_run=dry_run, device=device,
                         quantized_by=quantized_by, mmproj_type=mmproj_type, no_mmproj=no_mmproj,
                         base_model=base_model, exchange=exchange, shared_only=shared_only,
                         progress=out.progress(), on_stage=out.info)
    for note in result.notes:
        out.info(f"note: {note}")
    out.result(result.to_dict(), _render)
    if result.failures:
        message = "quality gate failed: " + "; ".join(result.failures)
        if out.json_mode:
            click.echo(f"ggufkit: error: {message}", err=True)
            raise click.exceptions.Exit(CheckFailedError.exit_code)
        raise CheckFailedError(message)
