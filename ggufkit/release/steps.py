"""The steps of a release, each skipped when its record matches (see :mod:`ggufkit.release.manifest`).

projector (vision-language models: ``mmproj-*.gguf``) -> master (convert) -> imatrix (collect on the master,
or copy the given file) -> one quantization per type (a ``MIX@`` entry: the size-budget search, whose entries
:mod:`ggufkit.release.mix` parses) -> evaluation (the master scored once, each type compared
with it). Every file is written atomically by the
API it comes from (ggufkit.format.atomic), so a SIGKILL leaves no partial file under a final name. The last
section spreads these steps over a CI's jobs (``--matrix``, ``--shared-only``, ``--only``, ``--card-only`` with
``--exchange``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.errors import GGUFKitError, UsageError
from ggufkit.format.writer import NullProgress, Progress
from ggufkit.release.manifest import State, dumps, write_bytes
from ggufkit.release.mix import CACHE_DIR, PROXY, candidates, is_mix, parse_mix, recipe_file
from ggufkit.release.plan import STATE_DIR, ReleasePlan, file_hash, master_holds_mxfp4, needs_imatrix
from ggufkit.release.sizes import converted_size, type_sizes


@dataclass
class StepStatus:
    """One step of the plan: its name, whether it runs or is skipped, and the files it makes."""

    step: str
    action: str  # "run" or "skip"
    files: list[str]
    estimated_bytes: int | None = None
    detail: str = ""


@dataclass
class StepContext:
    plan: ReleasePlan
    state: State
    progress: Progress = field(default_factory=NullProgress)
    stage: Callable[[str], None] = lambda _: None
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: MIX steps that ran: measurements made now and taken from the release's cache
    searches: dict[str, dict[str, int]] = field(default_factory=dict)


def _hashes(rec: dict[str, Any]) -> dict[str, str]:
    return {name: h["sha256"] for name, h in rec["outputs"].items()}


def master_inputs(plan: ReleasePlan) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"source": plan.source_files}, {"outtype": plan.options.master,
                                           "split_max_size": plan.options.split_max_size}


def master_step(ctx: StepContext) -> dict[str, Any]:
    from ggufkit.converters import convert

    plan = ctx.plan
    inputs, params = master_inputs(plan)
    rec = ctx.state.done("master", inputs, params)
    if rec is None:
        ctx.stage(f"converting {plan.model_name} to {plan.master_type}")
        report = convert(plan.options.model, plan.outdir / plan.master_file(), outtype=plan.options.master,
                         split_max_size=plan.options.split_max_size, progress=ctx.progress)
        rec = ctx.state.finish("master", inputs, params, [p.name for p in report.outputs],
                               {"file_type": plan.master_type, "parameters": report.plan.n_params})
        ctx.ran.append("master")
    else:
        ctx.skipped.append("master")
    ctx.records["master"] = rec
    return rec


def mmproj_inputs(plan: ReleasePlan) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"source": plan.source_files}, {"outtype": plan.mmproj_outtype}


def mmproj_step(ctx: StepContext) -> dict[str, Any] | None:
    """The vision projector, written once beside every quant (none for text-only models)."""
    from ggufkit.converters import convert_mmproj
    from ggufkit.format import open_gguf
    from ggufkit.summary import projector_summary

    plan = ctx.plan
    if plan.mmproj_file is None:
        return None
    inputs, params = mmproj_inputs(plan)
    rec = ctx.state.done("mmproj", inputs, params)
    if rec is None:
        ctx.stage(f"writing the vision projector {plan.mmproj_file}")
        out = plan.outdir / plan.mmproj_file
        convert_mmproj(plan.options.model, out, outtype=params["outtype"], progress=ctx.progress)
        with open_gguf(out) as f:
            summary = projector_summary(f)
        assert summary is not None
        results = {k: summary[k] for k in ("projector_type", "image_size", "patch_size", "tokens_per_image")}
        rec = ctx.state.finish("mmproj", inputs, params, [plan.mmproj_file],
                               {"file_type": plan.mmproj_file.removesuffix(".gguf").rsplit("-", 1)[1], **results})
        ctx.ran.append("mmproj")
    else:
        ctx.skipped.append("mmproj")
    ctx.records["mmproj"] = rec
    return rec


def first_output(rec: dict[str, Any], outdir: Path) -> Path:
    """The step's (first) GGUF; a MIX step also records its recipe beside it."""
    names = sorted(rec["outputs"])
    return outdir / next((n for n in names if n.endswith(".gguf")), names[0])


def imatrix_params(plan: ReleasePlan, records: dict[str, dict[str, Any]]
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    o = plan.options
    if o.imatrix is not None:
        return {"imatrix": file_hash(Path(o.imatrix))["sha256"]}, {"source": "given"}
    assert plan.imatrix_text is not None
    return ({"master": _hashes(records["master"]), "text": plan.imatrix_text.sha256},
            {"ctx": o.ctx, "chunks": o.imatrix_chunks if o.imatrix_chunks is not None else o.chunks,
             "text_name": plan.imatrix_text.name})


def imatrix_step(ctx: StepContext) -> dict[str, Any] | None:
    plan = ctx.plan
    if not plan.use_imatrix:
        return None
    assert plan.imatrix_file is not None
    o = plan.options
    inputs, params = imatrix_params(plan, ctx.records)
    rec = ctx.state.done("imatrix", inputs, params)
    if rec is None:
        out = plan.outdir / plan.imatrix_file
        if o.imatrix is not None:
            ctx.stage(f"copying the importance matrix {Path(o.imatrix).name}")
            write_bytes(out, Path(o.imatrix).read_bytes())
        else:
            from ggufkit.eval import collect_imatrix

            assert plan.imatrix_text is not None
            ctx.stage(f"collecting an importance matrix on {plan.imatrix_text.name}")
            collect_imatrix(first_output(ctx.records["master"], plan.outdir), text=plan.imatrix_text.text,
                            output=out, dataset=plan.imatrix_text.name, ctx=params["ctx"],
                            chunks=params["chunks"], compute_ppl=False, output_frequency=0,
                            device=o.device, progress=ctx.progress)
        rec = ctx.state.finish("imatrix", inputs, params, [plan.imatrix_file])
        ctx.ran.append("imatrix")
    else:
        ctx.skipped.append("imatrix")
    ctx.records["imatrix"] = rec
    return rec


def quant_inputs(plan: ReleasePlan, records: dict[str, dict[str, Any]], qtype: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    inputs: dict[str, Any] = {"master": _hashes(records["master"])}
    if "imatrix" in records:
        inputs["imatrix"] = _hashes(records["imatrix"])
    return inputs, {"type": qtype, "keep_split": len(records["master"]["outputs"]) > 1}


def release_imatrix(ctx: StepContext) -> Any:
    """The release's importance matrix (None without one), loaded for quantizing."""
    plan = ctx.plan
    if "imatrix" not in ctx.records or not plan.imatrix_file:
        return None
    import dataclasses

    from ggufkit.quant.imatrix.reader import load_imatrix

    # quantize.imatrix.file names the file as it sits in the release, not this machine's path,
    # so that every machine of a fan-out writes the same bytes.
    return dataclasses.replace(load_imatrix(plan.outdir / plan.imatrix_file), path=Path(plan.imatrix_file))


def mix_inputs(plan: ReleasePlan, records: dict[str, dict[str, Any]], qtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A MIX entry's inputs (the master's and imatrix's hashes) and parameters (target, candidates, method)."""
    from ggufkit.quant.target.measure import DEFAULT_SAMPLE_ROWS

    inputs, _ = quant_inputs(plan, records, qtype)
    mix = parse_mix(qtype)
    return inputs, {"type": mix.name, "target": mix.to_dict(), "candidates": candidates(plan.use_imatrix),
                    "proxy": PROXY, "sample_rows": DEFAULT_SAMPLE_ROWS}


def mix_step(ctx: StepContext, qtype: str) -> dict[str, Any]:
    """Search and write one MIX entry (skipped when its record matches): the model, its recipe, its record."""
    from ggufkit.quant.target.search import quantize_to_target

    plan = ctx.plan
    mix = parse_mix(qtype)
    inputs, params = mix_inputs(plan, ctx.records, qtype)
    step = f"quantize-{qtype}"
    rec = ctx.state.done(step, inputs, params)
    if rec is None:
        ctx.stage(f"searching the best mix at {mix.describe()}")
        model_file, recipe = plan.type_file(qtype), recipe_file(plan, qtype)
        report = quantize_to_target(
            first_output(ctx.records["master"], plan.outdir), plan.outdir / model_file, target_size=mix.size,
            target_bpw=mix.bpw, target_like=mix.preset, imatrix=release_imatrix(ctx), types=params["candidates"],
            mix_out=plan.outdir / recipe, cache_dir=plan.outdir / STATE_DIR / CACHE_DIR,
            sample_rows=params["sample_rows"], proxy=params["proxy"], device=plan.options.device,
            progress=ctx.progress)
        d = report.to_dict()
        ref = d["reference"]
        # run-specific numbers (seconds, measured/cached counts) stay out of the record: the manifest is the
        # same whichever machine or run made the step
        results = {"bits_per_weight": d["bits_per_weight"], "budget": d["budget"], "budget_kind": d["budget_kind"],
                   "feasible": d["feasible"], "predicted_size": d["predicted_size"],
                   "base_preset": d["base_preset"].upper(), "proxy": d["proxy"], "estimated_error": d["estimated_error"],
                   "reference": {**ref, "preset": ref["preset"].upper()}, "types": d["types"], "recipe": recipe,
                   "target": mix.describe()}
        rec = ctx.state.finish(step, inputs, params, [model_file, recipe], results)
        ctx.ran.append(step)
        ctx.searches[qtype] = {"measured": report.measured, "cached": report.cached}
    else:
        ctx.skipped.append(step)
    ctx.records[step] = rec
    return rec


def _requantize(plan: ReleasePlan) -> dict[str, bool]:
    """A master with MXFP4 experts (an MXFP4 checkpoint's) is quantized as llama-quantize --allow-requantize
    does; MXFP4_MOE copies them as they are. Nothing is passed otherwise (the call is as it always was)."""
    return {"allow_requantize": True} if master_holds_mxfp4(plan.master_plan) else {}


def quant_step(ctx: StepContext, qtype: str) -> dict[str, Any]:
    from ggufkit.quant import quantize_file

    if is_mix(qtype):
        return mix_step(ctx, qtype)
    plan = ctx.plan
    inputs, params = quant_inputs(plan, ctx.records, qtype)
    step = f"quantize-{qtype}"
    rec = ctx.state.done(step, inputs, params)
    if rec is None:
        ctx.stage(f"quantizing to {qtype}")
        imatrix = release_imatrix(ctx)
        if imatrix is None and needs_imatrix(qtype):
            raise UsageError(f"{qtype} needs an importance matrix")
        report = quantize_file(first_output(ctx.records["master"], plan.outdir), plan.outdir / plan.type_file(qtype),
                               qtype, imatrix=imatrix, keep_split=params["keep_split"], device=plan.options.device,
                               progress=ctx.progress, **_requantize(plan))
        rec = ctx.state.finish(step, inputs, params, [p.name for p in report.outputs] or [plan.type_file(qtype)],
                               {"bits_per_weight": report.plan.to_dict()["totals"]["bits_per_weight"]})
        ctx.ran.append(step)
    else:
        ctx.skipped.append(step)
    ctx.records[step] = rec
    return rec


def eval_inputs(plan: ReleasePlan, records: dict[str, dict[str, Any]], qtype: str | None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    o = plan.options
    inputs: dict[str, Any] = {"master": _hashes(records["master"]), "text": plan.eval_text.sha256}
    if qtype is not None:
        inputs["model"] = _hashes(records[f"quantize-{qtype}"])
    params = {"ctx": o.ctx, "chunks": o.chunks, "text_name": plan.eval_text.name}
    if qtype is not None:
        params["kld_top_k"] = plan.kld_top_k
    return inputs, params


def eval_step(ctx: StepContext, types: list[str]) -> None:
    """Score the master and every type of ``types`` whose evaluation is not recorded yet, in one pass."""
    from ggufkit.eval.shared_baseline import evaluate

    plan = ctx.plan
    todo: dict[str, Path] = {}
    wanted: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for name in [None, *types]:
        step = "eval-master" if name is None else f"eval-{name}"
        inputs, params = eval_inputs(plan, ctx.records, name)
        rec = ctx.state.done(step, inputs, params)
        if rec is not None:
            ctx.records[step] = rec
            ctx.skipped.append(step)
        elif name is not None:
            todo[name] = first_output(ctx.records[f"quantize-{name}"], plan.outdir)
            wanted[step] = (inputs, params)
        else:
            wanted[step] = (inputs, params)
    if not wanted:
        return
    master_scores, scores = evaluate(first_output(ctx.records["master"], plan.outdir), todo,
                                     text=plan.eval_text.text, ctx=plan.options.ctx, chunks=plan.options.chunks,
                                     kld_top_k=plan.kld_top_k, device=plan.options.device,
                                     progress=ctx.progress, on_stage=ctx.stage)
    if "eval-master" in wanted:
        ctx.records["eval-master"] = ctx.state.finish("eval-master", *wanted["eval-master"], [], master_scores)
        ctx.ran.append("eval-master")
    for name, result in scores.items():
        step = f"eval-{name}"
        ctx.records[step] = ctx.state.finish(step, *wanted[step], [], result)
        ctx.ran.append(step)


def planned_steps(plan: ReleasePlan, state: State) -> list[StepStatus]:
    """What a run would do (``--dry-run``): each step, run or skip, its files and estimated sizes."""
    from ggufkit.quant.llama_quantize.presets import get_preset
    from ggufkit.quant.registry import bits_per_weight

    o = plan.options
    out: list[StepStatus] = []
    records: dict[str, dict[str, Any]] = {}

    def check(step: str, inputs: dict[str, Any] | None, params: dict[str, Any] | None) -> str:
        rec = state.done(step, inputs, params) if inputs is not None and params is not None else None
        if rec is not None:
            records[step] = rec
        return "skip" if rec is not None else "run"

    if o.card_only:
        return [StepStatus("card", "run", ["README.md", "quality.png", "manifest.json"])]
    if plan.mmproj_file is not None:
        from ggufkit.converters import convert_mmproj

        # planning the projector checks its tensors against the config (and hashes its weight files)
        dry = convert_mmproj(o.model, plan.outdir / plan.mmproj_file, outtype=plan.mmproj_outtype, dry_run=True)
        out.append(StepStatus("mmproj", check("mmproj", *mmproj_inputs(plan)), [plan.mmproj_file],
                              converted_size(dry.plan), f"vision projector in {plan.mmproj_outtype}"))
    # exact sizes: the files' headers and llama-quantize's plan on the master (ggufkit.release.sizes)
    master_size, sizes = type_sizes(plan, [t for t in plan.work_types if not is_mix(t)])
    m_in, m_par = master_inputs(plan)
    out.append(StepStatus("master", check("master", m_in, m_par), [plan.master_file()],
                          master_size if master_size is not None else plan.master_bytes,
                          f"convert to {plan.master_type}"))
    known = "master" in records
    if plan.use_imatrix:
        assert plan.imatrix_file is not None
        action = check("imatrix", *imatrix_params(plan, records)) if known or o.imatrix is not None else "run"
        out.append(StepStatus("imatrix", action, [plan.imatrix_file], None,
                              "given file" if o.imatrix else f"collect on {plan.imatrix_text.name if plan.imatrix_text else ''}"))
    for qtype in plan.work_types:
        mix = parse_mix(qtype) if is_mix(qtype) else None
        action = "run"
        if known and (not plan.use_imatrix or "imatrix" in records):
            q_in, q_par = mix_inputs(plan, records, qtype) if mix else quant_inputs(plan, records, qtype)
            action = check(f"quantize-{qtype}", q_in, q_par)
        if mix is not None:
            bpw = mix.bpw or bits_per_weight(get_preset(mix.preset or "q8_0").default_type)
            est = mix.size or int(plan.n_params * bpw / 8)
            out.append(StepStatus(f"quantize-{qtype}", action, [plan.type_file(qtype), recipe_file(plan, qtype)],
                                  est, f"best mix at {mix.describe()} (per-tensor types by measured error)"))
            continue
        if qtype in sizes:
            out.append(StepStatus(f"quantize-{qtype}", action, [plan.type_file(qtype)], sizes[qtype],
                                  "exact size (llama-quantize's plan on the master)"))
            continue
        bpw = bits_per_weight(get_preset(qtype).default_type)
        est = int(plan.n_params * bpw / 8)
        out.append(StepStatus(f"quantize-{qtype}", action, [plan.type_file(qtype)], est,
                              f"~{bpw:.2f} bits per weight (default tensor type; mixtures differ)"))
    for name in [] if o.shared_only else [None, *plan.work_types]:
        step = "eval-master" if name is None else f"eval-{name}"
        action = "run"
        if known and (name is None or f"quantize-{name}" in records):
            e_in, e_par = eval_inputs(plan, records, name)
            action = check(step, e_in, e_par)
        out.append(StepStatus(step, action, [], None, "perplexity" if name is None else "perplexity and KLD"))
    if not o.only and not o.shared_only:
        out.append(StepStatus("card", "run", ["README.md", "quality.png", "manifest.json"]))
    return out


# --- a release spread over a CI's jobs (--matrix, --shared-only, --only, --card-only with --exchange) ------
# A release spread over a CI's jobs (GitHub Actions ``strategy.matrix``), exchanging files through one folder.
#
# The jobs, each on its own machine with its own OUTDIR, and the exchange folder ``--exchange XCHG`` that the CI's
# artifact steps carry from job to job:
#
# 1. ``release --matrix`` prints the matrix: ``{"include": [{"type": "Q4_K_M"}, ...]}``, one job per type.
# 2. ``release --shared-only --exchange XCHG`` (one job) converts the master, collects the importance matrix (and
#    writes a projector), then puts those files and ``XCHG/shared.json`` (their step records, and the checkpoint's
#    files as it hashed them: sha256, size, mtime) in XCHG.
# 3. ``release --only TYPE --exchange XCHG`` (one job per type, after 2) takes the master and imatrix from XCHG
#    (hard-linked into OUTDIR where the file system allows, else copied), takes the checkpoint's hashes from
#    ``shared.json`` where its files are those the shared job saw (:func:`trust_shared_hashes`), quantizes and
#    evaluates TYPE, and writes its manifest part ``XCHG/part-TYPE.json`` (the records of ``quantize-TYPE``,
#    ``eval-TYPE`` and ``eval-master``).
# 4. ``release --card-only --exchange XCHG`` (last) reads ``shared.json`` and every part, checks that each was
#    made from this checkpoint with this run's options and that the jobs scored the master alike, and writes
#    the card, plot and manifest: the bytes one plain ``release`` writes. The type files themselves need not be
#    there (the parts hold their sha256 and size); ``--push`` needs them in OUTDIR.
#
# Every record is the one a single run writes (:mod:`ggufkit.release.manifest`), so the files of the jobs are
# those of a single run, byte for byte.

EXCHANGE_FORMAT = "ggufkit-release-exchange/1"
SHARED = "shared.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def part_name(qtype: str) -> str:
    """The manifest part of one type's job: ``part-Q4_K_M.json`` (``part-MIX@2.5G.json``)."""
    return f"part-{qtype}.json"


def matrix(plan: ReleasePlan) -> dict[str, Any]:
    """GitHub Actions' ``strategy.matrix`` for the per-type jobs, in the release's type order."""
    return {"include": [{"type": t} for t in plan.types]}


def _shared_steps(plan: ReleasePlan) -> list[str]:
    return ["master", *(["mmproj"] if plan.mmproj_file else []), *(["imatrix"] if plan.use_imatrix else [])]


def _type_steps(qtype: str) -> list[str]:
    return [f"quantize-{qtype}", f"eval-{qtype}", "eval-master"]


def gguf_bpw(path: Path) -> float:
    """Bits per weight of a GGUF's tensors (its header only): the card's master and projector column."""
    from ggufkit.format import open_gguf

    with open_gguf(path) as m:
        return 8 * sum(t.nbytes for t in m.tensors) / sum(t.n_elements for t in m.tensors)


def _place(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s bytes: a hard link where the file system allows (a master of hundreds of GB
    is not copied), else a copy; through a temporary name, so that a killed job leaves no partial file."""
    from ggufkit.outputs import same_file

    if dst.is_file() and same_file(src, dst):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.ggufkit-part")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--exchange {path.parent}: no {path.name} ({what})") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--exchange {path}: unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != EXCHANGE_FORMAT or not isinstance(data.get("records"), dict):
        raise UsageError(f"--exchange {path}: not a ggufkit release exchange file")
    return data


def _check_source(plan: ReleasePlan, data: dict[str, Any], path: Path) -> None:
    if data.get("source") != plan.source_id:
        raise UsageError(f"--exchange {path}: made from another checkpoint (its source hashes differ)")


def export_shared(plan: ReleasePlan, records: dict[str, dict[str, Any]], exchange: Path) -> None:
    """The shared job's files (master, imatrix, projector) and ``shared.json`` into the exchange folder."""
    exchange.mkdir(parents=True, exist_ok=True)
    recs = {s: records[s] for s in _shared_steps(plan)}
    bpw = {}
    for step, rec in recs.items():
        for name in sorted(rec["outputs"]):
            _place(plan.outdir / name, exchange / name)
            if name.endswith(".gguf") and step in ("master", "mmproj"):
                bpw[name] = gguf_bpw(plan.outdir / name)
    write_bytes(exchange / SHARED, dumps({"format": EXCHANGE_FORMAT, "source": plan.source_id, "records": recs,
                                          "bpw": bpw, "checkpoint": _checkpoint_stats(plan)}))


def _checkpoint_stats(plan: ReleasePlan) -> dict[str, dict[str, Any]]:
    """The checkpoint's files as the shared job hashed them: name -> sha256, size and mtime (ns), for
    :func:`trust_shared_hashes`."""
    out = {}
    for name, h in plan.source_files.items():
        st = (plan.model_dir / name).stat()
        out[name] = {"sha256": h["sha256"], "size": h["size"], "mtime_ns": st.st_mtime_ns}
    return out


def _hub_sha256(model_dir: Path, name: str) -> str | None:
    """The sha256 the Hugging Face hub addressed this file by, when it came from the hub and is unchanged since
    (None otherwise): a hub cache snapshot links each LFS file to ``blobs/<sha256>``, and a ``hf download
    --local-dir`` keeps ``.cache/huggingface/download/<name>.metadata`` (commit, etag = the LFS sha256, time),
    valid while the file is not newer than that time (huggingface_hub ``_local_folder.read_download_metadata``'s
    own rule). Small files stored in git have a 40-digit git etag and are not taken."""
    path = model_dir / name
    target = path.resolve()
    if path.is_symlink() and target.parent.name == "blobs" and _SHA256.fullmatch(target.name):
        return target.name
    meta = model_dir / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    try:
        _commit, etag, stamp = meta.read_text(encoding="utf-8").splitlines()[:3]
        fresh = path.stat().st_mtime - 1 <= float(stamp)
    except (OSError, ValueError):
        return None
    etag = etag.strip().strip('"')
    return etag if fresh and _SHA256.fullmatch(etag) else None


def trust_shared_hashes(model: str, hash_cache: dict[str, Any], exchange: Path) -> int:
    """A fan-out job after the shared one (``--only``, ``--card-only``) takes the checkpoint's hashes from
    ``shared.json`` rather than reading the whole checkpoint again (an hour per job for a model of 700 GB):
    each file of the same name and size whose mtime is the one the shared job saw (the same disk, or a cache
    restored with its times), or that the hub addresses by the recorded sha256 (:func:`_hub_sha256`: a
    download of the same file on another machine), gets the recorded sha256 in ``hash_cache``; any other file
    is hashed as before. The file list itself is still this machine's, so a file added or removed here
    changes the checkpoint's identity and the job is refused as made from another checkpoint.

    Returns:
        How many files were trusted (0 when there is no readable ``shared.json``: the job then refuses later).
    """
    from ggufkit.converters.checkpoint import resolve_model

    try:
        data = json.loads((exchange / SHARED).read_text(encoding="utf-8"))
        recorded = data["checkpoint"]
        model_dir = resolve_model(model)[0]
    except (OSError, ValueError, KeyError, TypeError, GGUFKitError):
        return 0
    trusted = 0
    for name, rec in sorted(recorded.items()) if isinstance(recorded, dict) else []:
        path = model_dir / name
        try:
            st = path.stat()
            size, sha, mtime = int(rec["size"]), str(rec["sha256"]), int(rec["mtime_ns"])
        except (OSError, KeyError, TypeError, ValueError):
            continue
        if not path.is_file() or st.st_size != size:
            continue
        if st.st_mtime_ns == mtime or _hub_sha256(model_dir, name) == sha:
            # the entry file_hash (release/plan.py) looks up: keyed by the resolved path, its size and mtime
            hash_cache[str(path.resolve())] = {"size": size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
            trusted += 1
    return trusted


def export_parts(plan: ReleasePlan, records: dict[str, dict[str, Any]], exchange: Path) -> None:
    """One manifest part per type this job made (``--only``): its records, for ``--card-only``."""
    exchange.mkdir(parents=True, exist_ok=True)
    for t in plan.work_types:
        write_bytes(exchange / part_name(t), dumps({"format": EXCHANGE_FORMAT, "source": plan.source_id, "type": t,
                                                    "records": {s: records[s] for s in _type_steps(t)}}))


def _expected(plan: ReleasePlan, records: dict[str, dict[str, Any]], step: str) -> tuple[Any, Any]:
    """The inputs and parameters this run gives ``step`` (as the step itself computes them)."""
    if step == "master":
        return master_inputs(plan)
    if step == "mmproj":
        return mmproj_inputs(plan)
    if step == "imatrix":
        return imatrix_params(plan, records)
    if step == "eval-master":
        return eval_inputs(plan, records, None)
    kind, _, qtype = step.partition("-")
    if kind == "quantize":
        return mix_inputs(plan, records, qtype) if is_mix(qtype) else quant_inputs(plan, records, qtype)
    return eval_inputs(plan, records, qtype)


def _check_record(plan: ReleasePlan, records: dict[str, dict[str, Any]], step: str, rec: Any, path: Path) -> None:
    if not isinstance(rec, dict) or not isinstance(rec.get("outputs"), dict):
        raise UsageError(f"--exchange {path}: no record of step {step}")
    inputs, params = _expected(plan, records, step)
    if rec.get("inputs") != inputs or rec.get("params") != params:
        raise UsageError(f"--exchange {path}: step {step} was made with other inputs or options than this run; "
                         "run every job of the matrix with the same arguments")


def _load_shared(plan: ReleasePlan, exchange: Path) -> dict[str, Any]:
    path = exchange / SHARED
    data = _read(path, "run the --shared-only job first and carry its files here")
    _check_source(plan, data, path)
    records: dict[str, dict[str, Any]] = {}
    for step in _shared_steps(plan):
        rec = data["records"].get(step)
        _check_record(plan, records, step, rec, path)
        records[step] = rec
    data["records"] = records
    return data


def _save_records(state: State, records: dict[str, dict[str, Any]]) -> None:
    """The records into OUTDIR's state folder, where the steps and ``--card-only`` look for them."""
    for step, rec in records.items():
        write_bytes(state.dir / f"{step}.json", dumps(rec))


def import_shared(plan: ReleasePlan, state: State, exchange: Path) -> None:
    """``--only`` with an exchange: the shared job's files into OUTDIR (linked or copied) and its records
    into OUTDIR's state, so that the master and imatrix steps are skipped.

    Raises:
        UsageError: no shared part, or one made from another checkpoint or with other options.
    """
    data = _load_shared(plan, exchange)
    for rec in data["records"].values():
        for name, want in sorted(rec["outputs"].items()):
            src = exchange / name
            if not src.is_file() or src.stat().st_size != want["size"]:
                raise UsageError(f"--exchange {exchange}: {name} is missing or incomplete; carry the shared "
                                 "job's files here")
            _place(src, plan.outdir / name)
            st = (plan.outdir / name).stat()
            # the shared job hashed it; the hash cache (keyed by size and mtime) saves rehashing a huge master
            state.cache[f"out:{name}"] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": want["sha256"]}
    state.dir.mkdir(parents=True, exist_ok=True)
    _save_records(state, data["records"])
    state.save_cache()


def import_all(plan: ReleasePlan, state: State, exchange: Path) -> dict[str, float]:
    """``--card-only`` with an exchange: every record (shared and one part per type) into OUTDIR's state.
    Files not in OUTDIR are known by their recorded sha256 and size (``State.known``).

    Returns:
        Bits per weight of the master and projector, recorded by the shared job.

    Raises:
        UsageError: a missing part, one made from another checkpoint or with other options, or jobs whose
            scores of the master differ.
    """
    data = _load_shared(plan, exchange)
    records = dict(data["records"])
    master_scores: dict[str, tuple[str, Any]] = {}
    for t in plan.types:
        path = exchange / part_name(t)
        part = _read(path, f"the manifest part of the {t} job; carry every job's part here")
        _check_source(plan, part, path)
        for step in _type_steps(t):
            rec = part["records"].get(step)
            _check_record(plan, records, step, rec, path)
            if step == "eval-master":
                master_scores[t] = (dumps(rec).decode(), rec)
            else:
                records[step] = rec
    if master_scores:
        distinct = {text for text, _ in master_scores.values()}
        if len(distinct) > 1:
            raise UsageError("the jobs scored the master differently (" + ", ".join(sorted(master_scores)) +
                             "); run every job on the same kind of machine with the same --device")
        records["eval-master"] = next(iter(master_scores.values()))[1]
    known = {name: h for rec in records.values() for name, h in rec["outputs"].items()}
    if plan.options.push is not None:
        absent = sorted(n for n in known if not (plan.outdir / n).is_file())
        if absent:
            raise UsageError(f"--push uploads every file, and OUTDIR lacks {absent[0]}"
                             f"{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}; put the jobs' "
                             "files in OUTDIR first")
    state.dir.mkdir(parents=True, exist_ok=True)
    _save_records(state, records)
    state.known.update(known)
    return {str(k): float(v) for k, v in data.get("bpw", {}).items()}

