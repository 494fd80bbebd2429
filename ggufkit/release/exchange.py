"""A release spread over a CI's jobs (GitHub Actions ``strategy.matrix``), exchanging files through one folder.

The jobs, each on its own machine with its own OUTDIR, and the exchange folder ``--exchange XCHG`` that the CI's
artifact steps carry from job to job:

1. ``release --matrix`` prints the matrix: ``{"include": [{"type": "Q4_K_M"}, ...]}``, one job per type.
2. ``release --shared-only --exchange XCHG`` (one job) converts the master, collects the importance matrix (and
   writes a projector), then puts those files and ``XCHG/shared.json`` (their step records) in XCHG.
3. ``release --only TYPE --exchange XCHG`` (one job per type, after 2) takes the master and imatrix from XCHG
   (hard-linked into OUTDIR where the file system allows, else copied), quantizes and evaluates TYPE, and
   writes its manifest part ``XCHG/part-TYPE.json`` (the records of ``quantize-TYPE``, ``eval-TYPE`` and
   ``eval-master``).
4. ``release --card-only --exchange XCHG`` (last) reads ``shared.json`` and every part, checks that each was
   made from this checkpoint with this run's options and that the jobs scored the master alike, and writes
   the card, plot and manifest: the bytes one plain ``release`` writes. The type files themselves need not be
   there (the parts hold their sha256 and size); ``--push`` needs them in OUTDIR.

Every record is the one a single run writes (:mod:`ggufkit.release.manifest`), so the files of the jobs are
those of a single run, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ggufkit.errors import UsageError
from ggufkit.release.manifest import State, dumps, write_bytes
from ggufkit.release.mix import is_mix
from ggufkit.release.plan import ReleasePlan
from ggufkit.release.steps import (
    eval_inputs,
    imatrix_params,
    master_inputs,
    mix_inputs,
    mmproj_inputs,
    quant_inputs,
)

FORMAT = "ggufkit-release-exchange/1"
SHARED = "shared.json"


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
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("records"), dict):
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
    write_bytes(exchange / SHARED, dumps({"format": FORMAT, "source": plan.source_id, "records": recs,
                                          "bpw": bpw}))


def export_parts(plan: ReleasePlan, records: dict[str, dict[str, Any]], exchange: Path) -> None:
    """One manifest part per type this job made (``--only``): its records, for ``--card-only``."""
    exchange.mkdir(parents=True, exist_ok=True)
    for t in plan.work_types:
        write_bytes(exchange / part_name(t), dumps({"format": FORMAT, "source": plan.source_id, "type": t,
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

