"""A release's state and its manifest.

Each finished step leaves one record, ``OUTDIR/.ggufkit-release/<step>.json``: the hashes of its inputs,
its parameters, the sha256 and size of each file it wrote, and what it measured. A step is skipped when
its record exists, its inputs and parameters are those of this run, and its files are present with the
recorded hashes. Files are written atomically first and the record after, so a run killed at any moment
leaves either a finished step (file and record) or one that the next run redoes.

``manifest.json`` is assembled from the records: deterministic JSON (sorted keys, no times, no absolute
paths), so the same inputs give the same bytes on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ggufkit.format.atomic import atomic_write
from ggufkit.release.mix import manifest_entry
from ggufkit.release.plan import MANIFEST, STATE_DIR, file_hash

FORMAT = "ggufkit-release/1"
_HASH_CACHE = "hashes.json"
#: The names of the files a release in OUTDIR writes, recorded before it writes any (see State.claim).
CLAIMS = "claims.json"


def dumps(data: Any) -> bytes:
    """The one JSON encoding of the release's files: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (a temporary file renamed over it), unless it already holds ``data``."""
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as (f,):
        f.write(data)


class State:
    """The records of a release directory and its cache of file hashes (keyed by size and mtime)."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.dir = outdir / STATE_DIR
        self.cache: dict[str, Any] = {}
        #: sha256 and size of files made on another machine and absent here (``--card-only --exchange``: the
        #: jobs' manifest parts hold them), name -> hash
        self.known: dict[str, dict[str, Any]] = {}
        try:
            self.cache = json.loads((self.dir / _HASH_CACHE).read_text())
        except (OSError, ValueError):
            self.cache = {}

    def save_cache(self) -> None:
        if self.dir.is_dir():
            write_bytes(self.dir / _HASH_CACHE, dumps(self.cache))

    def record(self, step: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.dir / f"{step}.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def hash(self, name: str) -> dict[str, Any]:
        """sha256 and size of ``OUTDIR/name`` (from the cache when its size and mtime are unchanged; a file
        absent here and made by another job: its recorded hash)."""
        if name in self.known and not (self.outdir / name).is_file():
            return self.known[name]
        return file_hash(self.outdir / name, self.cache, key=f"out:{name}")

    def outputs_match(self, rec: dict[str, Any]) -> bool:
        for name, want in rec.get("outputs", {}).items():
            if not (self.outdir / name).is_file() and self.known.get(name) == want:
                continue
            if not (self.outdir / name).is_file() or self.hash(name) != want:
                return False
        return True

    def done(self, step: str, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
        """The step's record if it can be skipped (same inputs and parameters, outputs intact), else None."""
        rec = self.record(step)
        if rec is None or rec.get("inputs") != inputs or rec.get("params") != params:
            return None
        return rec if self.outputs_match(rec) else None

    def claim(self, names: list[str]) -> None:
        """Record (``claims.json``, with the names claimed before) the files the release is about to write."""
        path = self.dir / CLAIMS
        try:
            before = json.loads(path.read_text())["outputs"]
        except (OSError, ValueError, KeyError, TypeError):
            before = []
        write_bytes(path, dumps({"step": "claims", "outputs": sorted({*before, *names})}))

    def finish(self, step: str, inputs: dict[str, Any], params: dict[str, Any], outputs: list[str],
               results: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hash the step's files and write its record (after the files: see the module docstring)."""
        rec = {"step": step, "inputs": inputs, "params": params,
               "outputs": {name: self.hash(name) for name in outputs}, "results": results or {}}
        write_bytes(self.dir / f"{step}.json", dumps(rec))
        self.save_cache()
        return rec


#: The numbers of a row (ggufkit.release.evaluate.card_numbers) the manifest's ``quality`` keeps per type.
QUALITY_KEYS = ("ppl", "ppl_error", "delta_ppl", "mean_kld", "kld_exact", "p99_kld", "same_top_p", "gate")


def _step_results(name: str, rec: dict[str, Any]) -> dict[str, Any]:
    """A step's record for the manifest; an evaluation whose KLD is not exact names its stored lower bound
    ``mean_kld_lower`` (the file's KLD is the upper bound, in ``quality``)."""
    out = {k: rec[k] for k in ("inputs", "params", "outputs", "results")}
    kld = rec["results"].get("kld") if name.startswith("eval-") else None
    if isinstance(kld, dict) and kld.get("mean_kld_upper") is not None and not rec["results"].get("kld_exact"):
        kld = dict(kld)
        kld["mean_kld_lower"] = kld.pop("mean_kld")
        out["results"] = {**rec["results"], "kld": kld}
    return out


def build_manifest(plan: Any, records: dict[str, dict[str, Any]], files: list[str], state: State,
                   version: str, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The manifest: every file's sha256 and size, the source, the tool, every step and every number
    (``quality``: each type's row of the card, its one KLD and gate)."""
    o = plan.options
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "tool": {"name": "ggufkit", "version": version},
        "model": plan.model_name,
        "source": {"repo": plan.repo, "revision": plan.revision, "files": plan.source_files,
                   "sha256": plan.source_id},
        "parameters": {"master": plan.master_type, "types": plan.types, "ctx": o.ctx, "chunks": o.chunks,
                       "imatrix_chunks": o.imatrix_chunks, "kld_top_k": plan.kld_top_k,
                       "imatrix": plan.imatrix_file,
                       "imatrix_text": {"name": plan.imatrix_text.name, "sha256": plan.imatrix_text.sha256}
                       if plan.imatrix_text else None,
                       "eval_text": {"name": plan.eval_text.name, "sha256": plan.eval_text.sha256},
                       "max_kld": dict(sorted(o.max_kld.items())), "split_max_size": o.split_max_size},
        "steps": {name: _step_results(name, rec) for name, rec in sorted(records.items())},
        "files": {name: state.hash(name) for name in sorted(files) if name != MANIFEST},
    }
    if rows is not None:
        manifest["quality"] = {r["type"]: {k: r.get(k) for k in QUALITY_KEYS} for r in rows}
    if o.base_model is not None:
        manifest["source"]["base_model"] = o.base_model
    mixes = {name.removeprefix("quantize-"): rec for name, rec in records.items()
             if name.startswith("quantize-") and "recipe" in rec.get("results", {})}
    if mixes:
        # size-budget entries: target, budget, base preset, candidates and the search's estimate (the recipe's
        # sha256 is in "files")
        manifest["mixes"] = {name: manifest_entry(rec) for name, rec in sorted(mixes.items())}
    if plan.mmproj_file is not None and "mmproj" in records:
        # a vision-language model's projector, loaded beside every quant (text-only manifests are unchanged)
        manifest["parameters"]["mmproj_type"] = plan.mmproj_outtype
        manifest["projector"] = {"file": plan.mmproj_file, **state.hash(plan.mmproj_file),
                                 **records["mmproj"]["results"]}
    return manifest
