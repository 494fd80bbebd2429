"""``ggufkit release``: a model's whole GGUF release in one resumable command.

(vision-language models: the projector, ``mmproj-*.gguf``) -> convert once to the master GGUF -> importance
matrix -> quantize every type -> score the master once and each type against it -> model card, plot and
manifest -> quality gates -> optional upload. Each step is
skipped when its record says its inputs are unchanged and its files intact (:mod:`ggufkit.release.manifest`).

Example:
    >>> from ggufkit.release import release                       # doctest: +SKIP
    >>> result = release("./my-model", "./my-model-GGUF", types=["q4_k_m", "q8_0"])
    >>> result.rows[0]["mean_kld"], result.rows[0]["kld_exact"], result.failures
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.format.writer import NullProgress, Progress
from ggufkit.release.plan import (
    CARD,
    MANIFEST,
    PLOT,
    ReleaseOptions,
    ReleasePlan,
    build_plan,
    parse_max_kld,
    planned_outputs,
)

__all__ = ["ReleaseOptions", "ReleaseResult", "release", "release_matrix"]


@dataclass
class ReleaseResult:
    """What :func:`release` did (or, with ``dry_run``, would do)."""

    outdir: str
    dry_run: bool
    steps: list[dict[str, Any]]
    files: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    master: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    push: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    projector: dict[str, Any] | None = None
    #: MIX entries searched in this run: ``{"measured": n, "cached": n}`` (measurements made now and reused
    #: from the release's cache; a second entry on the same master and imatrix measures nothing)
    searches: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def release(model: str | os.PathLike[str], outdir: str | os.PathLike[str], *, types: Sequence[str] | None = None,
            master: str = "auto", imatrix_text: str | os.PathLike[str] | None = None,
            imatrix: str | os.PathLike[str] | None = None, no_imatrix: bool = False,
            eval_text: str | os.PathLike[str] | None = None, ctx: int = 512, chunks: int | None = None,
            imatrix_chunks: int | None = None, kld_top_k: int | None = None,
            max_kld: Sequence[str] | Mapping[str, float] = (), split_max_size: int | None = None,
            only: Sequence[str] = (), card_only: bool = False, push: str | None = None, private: bool = False,
            revision: str | None = None, dry_run: bool = False, device: str = "auto",
            quantized_by: str = "ggufkit", mmproj_type: str | None = None, no_mmproj: bool = False,
            base_model: str | None = None, exchange: str | os.PathLike[str] | None = None,
            shared_only: bool = False, progress: Progress | None = None,
            on_stage: Callable[[str], None] | None = None) -> ReleaseResult:
    """Make (or resume, or plan) a GGUF release of ``model`` in ``outdir``.

    Args:
        model: checkpoint directory or cached hub repo id (as :func:`ggufkit.converters.convert`).
        outdir: the release directory (created; a rerun resumes it).
        types: llama-quantize type names (default: :data:`~ggufkit.release.plan.DEFAULT_TYPES`, plus the
            IQ types with an importance matrix), and size-budget entries ``MIX@Q3_K_M`` (the size of that
            preset's file), ``MIX@2.5G``/``MIX@90MiB`` (a file size), ``MIX@4.5bpw`` (bits per weight): the best
            per-tensor mix at that size (:mod:`ggufkit.release.mix`), with its llama-quantize recipe.
        master: the master's type: ``auto`` (as the checkpoint: bf16 or f16), ``bf16``, ``f16``, ``f32``.
        imatrix_text, imatrix, no_imatrix: calibration text, a ready importance matrix, or none (default:
            collected on the bundled sample's calibration part).
        eval_text: the evaluation text (default: the bundled sample's other part).
        ctx, chunks, imatrix_chunks: chunk length and counts (``None``: every chunk of the text).
        kld_top_k: K of the master's stored top-K tokens per position; None (default): the whole vocabulary,
            so every KLD is exact, when that store fits :data:`~ggufkit.release.plan.EXACT_KLD_MAX_BYTES`, else
            128. Each row's ``mean_kld`` is the one KLD of its file: exact (``kld_exact``) or, when K does not
            cover the vocabulary, its upper bound.
        max_kld: gates ``TYPE=X`` (or ``all=X``) on that ``mean_kld``.
        split_max_size: shard files larger than this (default just under the hub's 50 GB limit).
        only: make only these types (and their evaluation) besides the master and imatrix; no card.
        card_only: assemble the card and manifest from the recorded steps; make nothing.
        push, private, revision: upload to this hub repository after every gate passed.
        dry_run: return the plan; write nothing.
        device: where the imatrix, quantization and evaluation run (``auto``, ``cpu``, ``cuda``).
        quantized_by: the card's ``quantized_by``.
        base_model: the hub id of the model this release quantizes (the card's ``base_model``; default: the
            hub repo the source came from, else the folder's name).
        exchange, shared_only: a release spread over a CI's jobs (:mod:`ggufkit.release.steps`, its last section): the
            folder the CI's artifact steps carry between the jobs, and the shared job (``shared_only``: the
            master and importance matrix only, put in ``exchange``); the ``only`` jobs take them from there and
            leave their manifest parts there, and ``card_only`` assembles the release from those parts.
        mmproj_type, no_mmproj: a vision-language checkpoint's projector (``mmproj-{basename}-{FTYPE}.gguf``,
            shipped beside every quant) is written in this type (``f32``, ``f16``, ``bf16``, ``q8_0``; default
            ``f16``), or not at all with ``no_mmproj``. Text-only models have none.
        progress, on_stage: progress bars and one-line stage messages.

    Returns:
        The :class:`ReleaseResult`; ``failures`` lists the types that failed a gate (nothing is pushed then).

    Raises:
        UsageError: bad input, refused before any work (see :mod:`ggufkit.release.plan`).
    """
    options = _options(model, outdir, types=types, master=master, imatrix_text=imatrix_text, imatrix=imatrix,
                       no_imatrix=no_imatrix, eval_text=eval_text, ctx=ctx, chunks=chunks,
                       imatrix_chunks=imatrix_chunks, kld_top_k=kld_top_k, max_kld=max_kld,
                       split_max_size=split_max_size, only=only, card_only=card_only, push=push, private=private,
                       revision=revision, dry_run=dry_run, device=device, quantized_by=quantized_by,
                       mmproj_type=mmproj_type, no_mmproj=no_mmproj, base_model=base_model, exchange=exchange,
                       shared_only=shared_only)
    from ggufkit.release import steps as fan_out
    from ggufkit.release.manifest import State

    state = State(options.outdir)
    if options.exchange is not None and (options.only or options.card_only):
        # the shared job hashed the checkpoint: its hashes stand for the files it saw (steps.trust_shared_hashes)
        fan_out.trust_shared_hashes(options.model, state.cache, options.exchange)
    plan = build_plan(options, state.cache)
    notes = list(plan.notes)
    if dry_run:
        return _dry_run(plan, state, notes)
    from ggufkit.release.steps import (
        StepContext,
        eval_step,
        imatrix_step,
        master_step,
        mmproj_step,
        quant_step,
    )

    bpw: dict[str, float] = {}
    if options.exchange is not None and options.card_only:  # refused before any work: missing or other parts
        bpw = fan_out.import_all(plan, state, options.exchange)
    elif options.exchange is not None and options.only:
        fan_out.import_shared(plan, state, options.exchange)
    plan.outdir.mkdir(parents=True, exist_ok=True)
    # the files this release writes here are claimed before any is written: a run killed between a file and
    # its step's record leaves a file that the next run knows as its own (plan.release_own_files)
    state.claim(planned_outputs(plan))
    sc = StepContext(plan, state, progress or NullProgress(), on_stage or (lambda _: None))
    if options.card_only:
        _load_records(sc)
    else:
        mmproj_step(sc)  # first: small, and a projector that does not match its config stops the run early
        master_step(sc)
        imatrix_step(sc)
        if not options.shared_only:
            for qtype in plan.work_types:
                quant_step(sc, qtype)
            eval_step(sc, plan.work_types)
    state.save_cache()
    if options.exchange is not None and options.shared_only:
        fan_out.export_shared(plan, sc.records, options.exchange)
    elif options.exchange is not None and options.only:
        fan_out.export_parts(plan, sc.records, options.exchange)
    if options.only or options.shared_only:
        files = sorted({n for r in sc.records.values() for n in r["outputs"]})
        return ReleaseResult(str(plan.outdir), False, [], files, ran=sc.ran, skipped=sc.skipped, notes=notes,
                             searches=sc.searches)
    return _assemble(plan, sc, notes, bpw)


def _options(model: str | os.PathLike[str], outdir: str | os.PathLike[str], **kw: Any) -> ReleaseOptions:
    """:class:`ReleaseOptions` from :func:`release`'s keyword arguments."""
    from ggufkit.release.plan import DEFAULT_SPLIT_MAX_SIZE

    def path(v: Any) -> Path | None:
        return Path(v) if v else None

    return ReleaseOptions(
        model=str(model), outdir=Path(outdir), types=tuple(kw["types"]) if kw["types"] else None,
        master=kw["master"], imatrix_text=path(kw["imatrix_text"]), imatrix=path(kw["imatrix"]),
        no_imatrix=kw["no_imatrix"], eval_text=path(kw["eval_text"]), ctx=kw["ctx"], chunks=kw["chunks"],
        imatrix_chunks=kw["imatrix_chunks"], kld_top_k=kw["kld_top_k"], max_kld=parse_max_kld(kw["max_kld"]),
        split_max_size=kw["split_max_size"] if kw["split_max_size"] is not None else DEFAULT_SPLIT_MAX_SIZE,
        only=tuple(kw["only"]), card_only=kw["card_only"], push=kw["push"], private=kw["private"],
        revision=kw["revision"], dry_run=kw["dry_run"], device=kw["device"], quantized_by=kw["quantized_by"],
        mmproj_type=kw["mmproj_type"], no_mmproj=kw["no_mmproj"], base_model=kw["base_model"],
        exchange=path(kw["exchange"]), shared_only=kw["shared_only"])


def release_matrix(model: str | os.PathLike[str], outdir: str | os.PathLike[str] | None = None, *,
                   types: Sequence[str] | None = None, no_imatrix: bool = False, **kw: Any) -> dict[str, Any]:
    """GitHub Actions' ``strategy.matrix`` of a release spread over a CI's jobs: one job per type
    (``{"include": [{"type": "Q4_K_M"}, ...]}``), each running ``release --only TYPE --exchange DIR`` after
    the ``--shared-only`` job (:mod:`ggufkit.release.steps`, its last section). The release is planned and checked as
    :func:`release` plans it (bad input raises UsageError); nothing is written.

    Args:
        model, types, no_imatrix, kw: as :func:`release` (its other keyword arguments).
        outdir: the release directory the jobs will use, checked as :func:`release` checks it (another model's
            release there is refused, known by its files' names and sizes); None: no directory is checked. The
            matrix names no file, so it is the same either way.

    The checkpoint's files are listed, not read (``build_plan``'s ``hash_source``): the shared job hashes them.
    """
    from ggufkit.release.manifest import State
    from ggufkit.release.steps import matrix

    defaults: dict[str, Any] = dict(master="auto", imatrix_text=None, imatrix=None, eval_text=None, ctx=512,
                                    chunks=None, imatrix_chunks=None, kld_top_k=None, max_kld=(),
                                    split_max_size=None, only=(), card_only=False, push=None, private=False,
                                    revision=None, dry_run=True, device="auto", quantized_by="ggufkit",
                                    mmproj_type=None, no_mmproj=False, base_model=None, exchange=None,
                                    shared_only=False)
    unknown = set(kw) - set(defaults)
    if unknown:
        raise TypeError(f"release_matrix() got unexpected keyword arguments {sorted(unknown)}")
    if outdir is None:
        import tempfile

        # planned against a folder that does not exist (and is never made): no earlier release to check
        with tempfile.TemporaryDirectory(prefix="ggufkit-matrix-") as tmp:
            return release_matrix(model, Path(tmp) / "release", types=types, no_imatrix=no_imatrix, **kw)
    options = _options(model, outdir, types=types, no_imatrix=no_imatrix, **{**defaults, **kw, "dry_run": True})
    return matrix(build_plan(options, State(options.outdir).cache, hash_source=False))


def _load_records(ctx: Any) -> None:
    """``--card-only``: every step's record must be present, and its files intact."""
    from ggufkit.errors import UsageError

    plan = ctx.plan
    steps = ["master", *(["mmproj"] if plan.mmproj_file else []), *(["imatrix"] if plan.use_imatrix else []),
             "eval-master",
             *(f"{s}-{t}" for t in plan.types for s in ("quantize", "eval"))]
    missing = [s for s in steps if ctx.state.record(s) is None]
    if missing:
        raise UsageError(f"{plan.outdir}: no record of {', '.join(missing)}; run those types (--only) first")
    for s in steps:
        rec = ctx.state.record(s)
        if not ctx.state.outputs_match(rec):
            raise UsageError(f"{plan.outdir}: the files of step {s} differ from its record; rerun that step")
        ctx.records[s] = rec


def _rows(plan: ReleasePlan, ctx: Any, bpw: Mapping[str, float]
          ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, list[str]]]:
    from ggufkit.release.evaluate import card_numbers
    from ggufkit.release.mix import is_mix, manifest_entry

    rec = ctx.records
    master_scores = rec["eval-master"]["results"]
    files = {"master": sorted(rec["master"]["outputs"])}
    master = {**master_scores, "size": sum(h["size"] for h in rec["master"]["outputs"].values()),
              "bpw": 16.0 if plan.master_type in ("F16", "BF16") else 32.0}
    master["bpw"] = _bpw(plan.outdir / files["master"][0], bpw)
    rows = []
    for t in plan.types:
        outputs = {n: h for n, h in rec[f"quantize-{t}"]["outputs"].items() if n.endswith(".gguf")}
        files[t] = sorted(outputs)
        size = sum(h["size"] for h in outputs.values())
        rows.append({"type": t, "file": files[t][0], "size": size,
                     "bpw": rec[f"quantize-{t}"]["results"]["bits_per_weight"],
                     **card_numbers(master_scores, rec[f"eval-{t}"]["results"]),
                     **({"mix": manifest_entry(rec[f"quantize-{t}"])} if is_mix(t) else {})})
    return master, rows, files


def _projector(plan: ReleasePlan, ctx: Any, bpw: Mapping[str, float]) -> dict[str, Any] | None:
    """The projector's file, sha256, size, bits per weight and what the mmproj step measured (None: no projector)."""
    rec = ctx.records.get("mmproj")
    if plan.mmproj_file is None or rec is None:
        return None
    return {"file": plan.mmproj_file, **rec["outputs"][plan.mmproj_file],
            "bpw": _bpw(plan.outdir / plan.mmproj_file, bpw), **rec["results"]}


def _bpw(path: Path, known: Mapping[str, float]) -> float:
    """Bits per weight of a GGUF here, or as the fan-out's shared job measured it (``known``: file name ->
    bits per weight) when the file is not here."""
    from ggufkit.release.steps import gguf_bpw

    if not path.is_file() and path.name in known:
        return known[path.name]
    return gguf_bpw(path)


def _gates(plan: ReleasePlan, rows: list[dict[str, Any]]) -> dict[str, str]:
    """type -> why it failed its ``--max-kld`` gate; each row gets ``gate``: ``passed``, ``failed`` or None."""
    failed = {}
    for r in rows:
        limit = plan.options.max_kld.get(r["type"], plan.options.max_kld.get("*"))
        r["gate"] = None if limit is None else "passed" if r["mean_kld"] <= limit else "failed"
        if r["gate"] == "failed":
            what = "mean KLD" if r["kld_exact"] else "mean KLD upper bound"
            failed[r["type"]] = f"{what} {r['mean_kld']:.6f} > --max-kld {limit:g}"
    return failed


def _assemble(plan: ReleasePlan, ctx: Any, notes: list[str], bpw: Mapping[str, float]) -> ReleaseResult:
    from ggufkit import __version__
    from ggufkit.release.card import render_card
    from ggufkit.release.manifest import build_manifest, dumps, write_bytes
    from ggufkit.release.plot import render_plot
    from ggufkit.release.push import push

    ctx.stage("writing the model card, plot and manifest")
    master, rows, files = _rows(plan, ctx, bpw)
    failed = _gates(plan, rows)
    projector = _projector(plan, ctx, bpw)
    write_bytes(plan.outdir / PLOT, render_plot(rows, f"{plan.model_name}: size against quality"))
    card = render_card(plan, master, rows, files, plan.options.push, __version__, projector=projector,
                       failed=failed)
    write_bytes(plan.outdir / CARD, card.encode("utf-8"))
    artifacts = sorted({n for r in ctx.records.values() for n in r["outputs"]} | {CARD, PLOT})
    manifest = build_manifest(plan, ctx.records, artifacts, ctx.state, __version__, rows=rows)
    write_bytes(plan.outdir / MANIFEST, dumps(manifest))
    ctx.state.save_cache()
    files_all = sorted([*artifacts, MANIFEST])
    failures = [f"{t}: {why}" for t, why in failed.items()]
    result = ReleaseResult(str(plan.outdir), False, [], files_all, rows, master, failures, ctx.ran, ctx.skipped,
                           notes=notes, projector=projector, searches=ctx.searches)
    if plan.options.push is not None and not failures:
        ctx.stage(f"uploading {len(files_all)} files to {plan.options.push}")
        result.push = push(plan.outdir, plan.options.push, files_all, private=plan.options.private,
                           revision=plan.options.revision)
    return result


def _dry_run(plan: ReleasePlan, state: Any, notes: list[str]) -> ReleaseResult:
    from ggufkit.release.push import push_plan
    from ggufkit.release.steps import planned_steps

    steps = planned_steps(plan, state)
    files = sorted({f for s in steps for f in s.files} | ({plan.imatrix_file} if plan.imatrix_file else set()))
    result = ReleaseResult(str(plan.outdir), True, [asdict(s) for s in steps], files, notes=notes)
    if plan.options.push is not None:
        result.push = push_plan(plan.options.push, files, private=plan.options.private,
                                revision=plan.options.revision)
    return result
