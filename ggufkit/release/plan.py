"""What a release will do, decided and validated before any work: types, file names, inputs and their hashes.

Everything a user can get wrong (an unknown type, a type that needs an importance matrix without one, an
evaluation text too short for one chunk, an output directory holding another model's release, ``--push``
without a token) is refused here with one line, before the hours of converting and quantizing start.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.errors import UsageError
from ggufkit.release.mix import check_feasible, is_mix, parse_mix, recipe_file

#: A publisher's usual matrix (the quants most GGUF repositories on the hub carry).
DEFAULT_TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
#: Added to the default matrix when an importance matrix is used (llama-quantize refuses most without one).
DEFAULT_IMATRIX_TYPES = ("IQ2_M", "IQ3_M", "IQ4_XS")
#: Shards are cut below the hub's 50 GB per-file limit (decimal units, as llama.cpp's --split-max-size).
DEFAULT_SPLIT_MAX_SIZE = 48 * 10**9
MASTER_TYPES = ("auto", "bf16", "f16", "f32")
#: Types a vision projector is written in (llama.cpp's converter with --mmproj); f16 by default, as publishers
#: ship them.
MMPROJ_TYPES = ("f32", "f16", "bf16", "q8_0")
DEFAULT_MMPROJ_TYPE = "f16"
#: The bundled sample is split: its first characters calibrate the imatrix, the rest is the evaluation text
#: (the same split as ``ggufkit demo``), so a default release never scores on its calibration text.
SAMPLE_SPLIT = 200_000
#: Internal state of a release inside OUTDIR: one record per finished step, and a cache of file hashes.
STATE_DIR = ".ggufkit-release"
MANIFEST = "manifest.json"
CARD = "README.md"
PLOT = "quality.png"
#: The KLD is exact when the master's whole vocabulary is stored for every scored position (``8 * n_vocab +
#: 32`` bytes each, eval/kld_store.py) in at most this many bytes; above it, the master's top 128 tokens are
#: stored and each KLD is an upper bound, labelled as such. A constant rather than this machine's free memory,
#: so that every machine of a fan-out (``--only``) makes the same release.
EXACT_KLD_MAX_BYTES = 4 * 2**30
#: ``--base-model``: a hub model id (``owner/name`` or a bare name).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class TextInput:
    """A text the release reads (calibration or evaluation): its name in the provenance, text and hash."""

    name: str
    text: str
    sha256: str

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TextInput:
        from ggufkit.eval.perplexity import read_text_file

        text = read_text_file(path)
        return cls(Path(path).name, text, hashlib.sha256(text.encode("utf-8")).hexdigest())

    @classmethod
    def bundled(cls, part: str) -> TextInput:
        from ggufkit.eval.perplexity import sample_text

        text = sample_text()
        text = text[:SAMPLE_SPLIT] if part == "calibration" else text[SAMPLE_SPLIT:]
        name = f"ggufkit bundled sample ({part} part: Python help topics, PSF-2.0)"
        return cls(name, text, hashlib.sha256(text.encode("utf-8")).hexdigest())


@dataclass(frozen=True)
class ReleaseOptions:
    """Every option of a release (the CLI's flags, one to one)."""

    model: str
    outdir: Path
    types: tuple[str, ...] | None = None
    master: str = "auto"
    imatrix_text: Path | None = None
    imatrix: Path | None = None
    no_imatrix: bool = False
    eval_text: Path | None = None
    ctx: int = 512
    chunks: int | None = None
    imatrix_chunks: int | None = None
    #: None: exact (the whole vocabulary stored) when that fits :data:`EXACT_KLD_MAX_BYTES`, else
    #: :data:`~ggufkit.eval.kld_store.DEFAULT_TOP_K` with bounds
    kld_top_k: int | None = None
    max_kld: Mapping[str, float] = field(default_factory=dict)
    split_max_size: int | None = DEFAULT_SPLIT_MAX_SIZE
    only: tuple[str, ...] = ()
    card_only: bool = False
    push: str | None = None
    private: bool = False
    revision: str | None = None
    dry_run: bool = False
    device: str = "auto"
    quantized_by: str = "ggufkit"
    mmproj_type: str | None = None
    no_mmproj: bool = False
    base_model: str | None = None
    #: a fan-out over a CI's jobs (ggufkit.release.steps: the exchange): the folder the artifact steps carry, and the
    #: shared job (master and importance matrix)
    exchange: Path | None = None
    shared_only: bool = False


@dataclass
class ReleasePlan:
    """The resolved release: canonical types, file names (relative to OUTDIR), inputs and their hashes."""

    options: ReleaseOptions
    outdir: Path
    model_dir: Path
    repo: str | None
    revision: str | None
    model_name: str
    prefix: str
    master_type: str
    master_bytes: int
    n_params: int
    types: list[str]
    work_types: list[str]
    use_imatrix: bool
    imatrix_file: str | None
    imatrix_text: TextInput | None
    eval_text: TextInput
    source_files: dict[str, dict[str, Any]]
    source_card: str | None
    notes: list[str] = field(default_factory=list)
    #: The vision projector (``mmproj-{basename}-{FTYPE}.gguf``) of a vision-language checkpoint and its outtype;
    #: None for text-only models and with ``--no-mmproj``.
    mmproj_file: str | None = None
    mmproj_outtype: str | None = None
    #: K of the master's stored top-K (:func:`resolve_kld_top_k`); ``>= n_vocab - 1`` scores the whole
    #: vocabulary, so every KLD is exact
    kld_top_k: int = 0
    n_vocab: int = 0
    #: the converter's dry-run plan of the master (for exact dry-run sizes)
    master_plan: Any = field(default=None, repr=False)

    def master_file(self) -> str:
        return f"{self.prefix}-{self.master_type}.gguf"

    def type_file(self, qtype: str) -> str:
        """``{basename}-Q4_K_M.gguf``; a size-budget entry ``MIX@Q3_K_M``: ``{basename}-MIX-Q3_K_M.gguf``."""
        return f"{self.prefix}-{qtype.replace('@', '-')}.gguf"

    @property
    def source_id(self) -> str:
        """One hash of the source checkpoint's files (names, sizes and contents)."""
        return hashlib.sha256(json.dumps(self.source_files, sort_keys=True).encode()).hexdigest()


def canonical_type(name: str) -> str:
    """``q4_k`` -> ``Q4_K_M`` (llama-quantize's names and aliases), ``mix@q3_k_m`` -> ``MIX@Q3_K_M`` (a
    size-budget entry, :mod:`ggufkit.release.mix`); refuses what a release cannot make.

    Raises:
        UsageError: unknown, a float or copy target, a type this build has no kernel for, a bad MIX entry.
    """
    from ggufkit.quant.llama_quantize.presets import get_preset, has_kernel

    if is_mix(name):
        return parse_mix(name).name
    preset = get_preset(name)
    if preset.only_copy or not preset.is_quantized:
        raise UsageError(f"--types {name}: a release's types are quantized types; the float master is --master")
    if not has_kernel(preset.default_type):
        raise UsageError(f"--types {name}: ggufkit has no kernel for {preset.default_type.name} in this build")
    return preset.name.upper()


def needs_imatrix(qtype: str) -> bool:
    """The type (or the preset a ``MIX@PRESET`` entry takes its size from) needs an importance matrix."""
    from ggufkit.quant.llama_quantize.presets import get_preset

    if is_mix(qtype):
        preset = parse_mix(qtype).preset
        return preset is not None and get_preset(preset).needs_imatrix
    return get_preset(qtype).needs_imatrix


def parse_max_kld(items: Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    """``["Q4_K_M=0.05", "all=0.5"]`` -> ``{"Q4_K_M": 0.05, "*": 0.5}``.

    Raises:
        UsageError: not ``TYPE=NUMBER``.
    """
    pairs: list[tuple[str, float]] = []
    if isinstance(items, Mapping):
        pairs = [(str(k), float(v)) for k, v in items.items()]
    else:
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                raise UsageError(f"--max-kld {item!r}: expected TYPE=X, e.g. Q4_K_M=0.05 (or all=0.05)")
            try:
                pairs.append((key, float(value)))
            except ValueError:
                raise UsageError(f"--max-kld {item!r}: {value!r} is not a number") from None
    out: dict[str, float] = {}
    for key, limit in pairs:
        k = "*" if key.strip().lower() in ("all", "*") else canonical_type(key)
        out[k] = limit
    return out


def file_hash(path: Path, cache: dict[str, Any] | None = None, key: str | None = None) -> dict[str, Any]:
    """``{"sha256", "size"}`` of a file; ``cache`` (key -> size, mtime and hash) saves rehashing it."""
    st = path.stat()
    k = key or str(path.resolve())
    if cache is not None:
        hit = cache.get(k)
        if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
            return {"sha256": hit["sha256"], "size": st.st_size}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[k] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return {"sha256": digest, "size": st.st_size}


def source_card_front_matter(card: str | None) -> dict[str, Any]:
    """The YAML front matter of the source checkpoint's README.md (empty when none or not a mapping)."""
    import yaml

    if not card or not card.startswith("---"):
        return {}
    lines = card.splitlines()
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        return {}
    try:
        data = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _check_tokens(vocab_file: Path, text: TextInput, ctx: int, what: str, chunks: int | None = None) -> int:
    """The text gives at least one chunk of ``ctx`` (llama-perplexity needs ``2*ctx`` tokens); returns the
    number of chunks scored."""
    from ggufkit.errors import EvaluationError
    from ggufkit.eval.perplexity import check_chunking, tokenize_text
    from ggufkit.format import open_gguf

    with open_gguf(vocab_file) as f:
        ids, _, _ = tokenize_text(f, text.text)
    assert ids is not None
    try:
        return check_chunking(len(ids), ctx, chunks)
    except EvaluationError as exc:
        raise UsageError(f"{what} {text.name}: {exc}") from None


def build_plan(options: ReleaseOptions, hash_cache: dict[str, Any] | None = None, *,
               hash_source: bool = True) -> ReleasePlan:
    """Resolve and validate a release; nothing is written (a vocabulary-only GGUF goes to a temporary
    directory to tokenize the texts).

    ``hash_source`` False (``--matrix``, which needs the types alone): the checkpoint's files are listed by
    name and size, not read (its tensor bytes are the hour-long part of a 700 GB model's plan); an OUTDIR
    holding another model's release is then known by those names and sizes.

    Raises:
        UsageError: any bad input named in the module docstring.
        CheckpointError, UnsupportedArchitectureError: the model cannot be converted.
    """
    from ggufkit.converters import convert
    from ggufkit.converters.checkpoint import resolve_model

    o = options
    if o.master not in MASTER_TYPES:
        raise UsageError(f"--master {o.master!r}: expected one of {', '.join(MASTER_TYPES)}")
    given = [n for n, v in (("--imatrix-text", o.imatrix_text), ("--imatrix", o.imatrix),
                            ("--no-imatrix", o.no_imatrix or None)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"give at most one of {', '.join(given)}")
    if o.card_only and o.only:
        raise UsageError("--only and --card-only are two halves of a fan-out; give one of them")
    if o.push is not None and o.only:
        raise UsageError("--push uploads a whole release; run it with --card-only after the --only runs")
    if o.shared_only and (o.only or o.card_only or o.push is not None):
        flags: tuple[tuple[str, object], ...] = (("--only", o.only), ("--card-only", o.card_only),
                                                  ("--push", o.push))
        flag = next(n for n, v in flags if v)
        raise UsageError(f"--shared-only is the fan-out's first job; give it without {flag}")
    if o.exchange is not None and not (o.shared_only or o.only or o.card_only):
        raise UsageError("--exchange goes with the jobs of a fan-out: --shared-only, --only TYPE or --card-only")
    if o.exchange is not None and Path(o.exchange).exists() and not Path(o.exchange).is_dir():
        raise UsageError(f"--exchange {o.exchange}: exists and is not a directory")
    if o.ctx < 16:
        raise UsageError(f"--ctx {o.ctx} is too small (at least 16)")
    if o.mmproj_type is not None and o.mmproj_type not in MMPROJ_TYPES:
        raise UsageError(f"--mmproj-type {o.mmproj_type!r}: expected one of {', '.join(MMPROJ_TYPES)}")
    if o.mmproj_type is not None and o.no_mmproj:
        raise UsageError("give one of --mmproj-type and --no-mmproj")
    use_imatrix = not o.no_imatrix
    types = [canonical_type(t) for t in o.types] if o.types else \
        list(DEFAULT_TYPES + (DEFAULT_IMATRIX_TYPES if use_imatrix else ()))
    if len(set(types)) != len(types):
        raise UsageError(f"--types lists a type twice: {', '.join(types)}")
    mixes = _mix_targets(types)
    if not use_imatrix:
        bad = [t for t in types if needs_imatrix(t)]
        if bad:
            raise UsageError(f"{', '.join(bad)} need an importance matrix; drop --no-imatrix or these types")
    only = [canonical_type(t) for t in o.only]
    missing = [t for t in only if t not in types]
    if missing:
        raise UsageError(f"--only {', '.join(missing)}: not among the release's types ({', '.join(types)})")
    for key in o.max_kld:
        if key != "*" and key not in types:
            raise UsageError(f"--max-kld {key}: not among the release's types ({', '.join(types)})")
    if o.imatrix is not None and not Path(o.imatrix).is_file():
        raise UsageError(f"--imatrix {o.imatrix}: no such file")
    if o.push is not None:
        from huggingface_hub import get_token

        if not get_token():
            raise UsageError("--push needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
    outdir = Path(o.outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UsageError(f"{outdir}: OUTDIR exists and is not a directory")

    if o.base_model is not None and not _REPO_ID.fullmatch(o.base_model):
        raise UsageError(f"--base-model {o.base_model!r}: expected a hub model id such as meta-llama/Llama-3.2-1B")

    model_dir, repo, revision = resolve_model(o.model)
    _check_not_in_source(outdir, model_dir)
    source_files = source_file_hashes(model_dir, hash_cache) if hash_source else source_file_sizes(model_dir)
    card_path = model_dir / "README.md"
    source_card = card_path.read_text(encoding="utf-8", errors="replace") if card_path.is_file() else None
    _check_outdir(outdir, source_files)

    dry = convert(o.model, None, outtype=o.master, dry_run=True)
    assert dry.plan.output is not None
    if mixes:
        check_feasible(mixes, dry.plan.entries, use_imatrix)
    file_type = dry.plan.output.name.removesuffix(".gguf").rsplit("-", 1)[1]
    prefix = dry.plan.output.name.removesuffix(f"-{file_type}.gguf")
    # a checkpoint released in MXFP4 (gpt-oss) converts to a float file with MXFP4 experts, which llama.cpp's
    # converter names MXFP4_MOE: the master is named by its float type, so it is never the MXFP4_MOE type's file
    master_type = dry.plan.outtype.upper() if master_holds_mxfp4(dry.plan) else file_type
    model_name = repo or model_dir.resolve().name
    imatrix_text = None
    if use_imatrix and o.imatrix is None:
        imatrix_text = TextInput.from_file(o.imatrix_text) if o.imatrix_text else TextInput.bundled("calibration")
    eval_text = TextInput.from_file(o.eval_text) if o.eval_text else TextInput.bundled("evaluation")
    imatrix_file = None
    if use_imatrix:
        suffix = ".dat" if o.imatrix is not None and Path(o.imatrix).suffix == ".dat" else ".gguf"
        imatrix_file = f"{prefix}.imatrix{suffix}"
    plan = ReleasePlan(o, outdir, model_dir, repo, revision, model_name, prefix, master_type,
                       dry.plan.nbytes, dry.plan.n_params, types, [] if o.shared_only else only or types,
                       use_imatrix, imatrix_file,
                       imatrix_text, eval_text, source_files, source_card, master_plan=dry.plan)
    _plan_projector(plan, model_dir)
    _check_overwrites(plan)
    if use_imatrix and o.imatrix is None and o.imatrix_text is None:
        plan.notes.append("importance matrix from the bundled English sample; a calibration text like the "
                          "model's real use (--imatrix-text) is better")
    positions = _check_texts(plan)
    plan.n_vocab = _n_vocab(dry.plan)
    plan.kld_top_k = resolve_kld_top_k(o.kld_top_k, plan.n_vocab, positions)
    return plan


def master_holds_mxfp4(master_plan: Any) -> bool:
    """The master keeps a checkpoint's MXFP4 experts (converters/mxfp4_source.py): quantizing it to any other
    type dequantizes them first (llama-quantize --allow-requantize)."""
    from gguf import LlamaFileType

    return bool(master_plan is not None and master_plan.file_type == LlamaFileType.MOSTLY_MXFP4_MOE)


def resolve_kld_top_k(option: int | None, n_vocab: int, positions: int) -> int:
    """K of the master's stored top-K: ``option`` when given (at most the vocabulary), else the whole
    vocabulary (every KLD exact) when its store, ``8 * n_vocab + 32`` bytes per scored position, fits
    :data:`EXACT_KLD_MAX_BYTES`, else :data:`~ggufkit.eval.kld_store.DEFAULT_TOP_K` (each KLD then an upper
    bound, eval/kld_store.py)."""
    from ggufkit.eval.kld_store import DEFAULT_TOP_K, record_dtype

    if option is not None:
        return min(option, n_vocab)
    full = positions * record_dtype(n_vocab).itemsize
    return n_vocab if full <= EXACT_KLD_MAX_BYTES else min(DEFAULT_TOP_K, n_vocab)


def _n_vocab(master_plan: Any) -> int:
    """Rows of the master's ``token_embd.weight``: the logits' width (eval/arch.py reads it from there)."""
    entry = next(e for e in master_plan.entries if e.name == "token_embd.weight")
    return int(entry.shape[0])


def source_file_hashes(model_dir: Path, hash_cache: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The checkpoint's files (name -> sha256 and size), without GGUF files (a ``convert`` output left in the
    folder), temporary files, the hub cache and whatever an earlier release made there."""
    return {name: file_hash(model_dir / name, hash_cache) for name in _source_names(model_dir)}


def _source_names(model_dir: Path) -> list[str]:
    own = release_own_files(model_dir)
    out = []
    for p in sorted(model_dir.rglob("*")):
        name = p.relative_to(model_dir).as_posix()
        if not p.is_file() or ".cache" in p.parts or STATE_DIR in p.parts or name in own \
                or p.name.endswith((".gguf", ".ggufkit-part")):
            continue
        out.append(name)
    return out


def source_file_sizes(model_dir: Path) -> dict[str, dict[str, Any]]:
    """:func:`source_file_hashes`' files, name -> size only (nothing read)."""
    return {name: {"size": (model_dir / name).stat().st_size} for name in _source_names(model_dir)}


def release_own_files(folder: Path) -> set[str]:
    """The files an earlier release made in ``folder``: those its ``manifest.json`` lists (and the manifest)
    and those its step records name. Any other file there is the user's."""
    own: set[str] = set()
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("ggufkit-release/") \
            and isinstance(manifest.get("files"), dict):
        own |= {*manifest["files"], MANIFEST}
    for path in sorted((folder / STATE_DIR).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("outputs"), (dict, list)):
            own |= {str(n) for n in rec["outputs"]}
    return own


def planned_outputs(plan: ReleasePlan) -> list[str]:
    """The names of the files the release writes in OUTDIR (a sharded master's shard names aside)."""
    names = [plan.master_file(), *(plan.type_file(t) for t in plan.types),
             *(recipe_file(plan, t) for t in plan.types if is_mix(t)), CARD, PLOT, MANIFEST]
    return names + [n for n in (plan.imatrix_file, plan.mmproj_file) if n is not None]


def _check_not_in_source(outdir: Path, model_dir: Path) -> None:
    """A release never writes into its source checkpoint (its README.md is the source's card)."""
    out, src = Path(os.path.realpath(outdir)), Path(os.path.realpath(model_dir))
    if out == src or src in out.parents:
        where = "is the source checkpoint folder" if out == src else f"is inside the source checkpoint {model_dir}"
        raise UsageError(f"OUTDIR {outdir} {where}; a release never writes into its source: choose another "
                         "folder, e.g. -o " + f"{src.name}-GGUF")


def _check_overwrites(plan: ReleasePlan) -> None:
    """Refuse an OUTDIR holding a file of the release's names that an earlier release there did not make,
    and any output that is one of the release's inputs."""
    from ggufkit.outputs import refuse_overwriting_inputs

    o = plan.options
    names = planned_outputs(plan)
    if plan.outdir.is_dir():
        own = release_own_files(plan.outdir)
        theirs = [n for n in names if (plan.outdir / n).exists() and n not in own]
        if theirs:
            raise UsageError(f"{plan.outdir / theirs[0]}: the release would overwrite this file, which no earlier "
                             "release in OUTDIR made; move it away or choose another OUTDIR")
    refuse_overwriting_inputs([plan.outdir / n for n in names],
                              [o.imatrix_text, o.imatrix, o.eval_text,
                               *(plan.model_dir / n for n in plan.source_files)])


def _mix_targets(types: Sequence[str]) -> list[Any]:
    """The MIX entries of ``types``; two with the same budget (``MIX@2.5G``, ``MIX@2500M``) are refused."""

    mixes = [parse_mix(t) for t in types if is_mix(t)]
    seen: dict[tuple[Any, ...], str] = {}
    for m in mixes:
        key = (m.kind, m.preset, m.size, m.bpw)
        if key in seen:
            raise UsageError(f"--types {seen[key]} and {m.name} are the same budget")
        seen[key] = m.name
    return mixes


def _plan_projector(plan: ReleasePlan, model_dir: Path) -> None:
    """A vision-language checkpoint (a ``vision_config`` in config.json) ships its projector beside every quant,
    unless ``--no-mmproj``; a vision class ggufkit writes no projector for is refused before any work. Only the
    config is read here (planning the projector hashes its weight files: the dry run and the step do that)."""
    from ggufkit.converters.checkpoint import read_config
    from ggufkit.converters.metadata import default_name
    from ggufkit.converters.mmproj import mmproj_output_path, projector_entry
    from ggufkit.errors import UnsupportedArchitectureError

    o = plan.options
    config = read_config(model_dir)
    if not isinstance(config.get("vision_config"), dict):
        if o.mmproj_type is not None:
            plan.notes.append(f"--mmproj-type {o.mmproj_type}: {plan.model_name} is a text-only model; no projector")
        return
    if o.no_mmproj:
        return
    try:
        projector_entry(config, model_dir)
    except UnsupportedArchitectureError as exc:
        raise UsageError(f"{exc.message}; give --no-mmproj to release the text model alone") from None
    outtype = o.mmproj_type or DEFAULT_MMPROJ_TYPE
    # convert --mmproj's own file name (mmproj-{basename}-{FTYPE}.gguf)
    plan.mmproj_file = mmproj_output_path(None, model_dir, plan.repo, default_name(model_dir, plan.repo),
                                          outtype.upper()).name
    plan.mmproj_outtype = outtype


def _check_outdir(outdir: Path, source_files: dict[str, dict[str, Any]]) -> None:
    """Refuse an OUTDIR whose manifest or state names another source checkpoint."""
    recorded = None
    manifest = outdir / MANIFEST
    master = outdir / STATE_DIR / "master.json"
    try:
        if master.is_file():
            recorded = json.loads(master.read_text())["inputs"]["source"]
        elif manifest.is_file():
            recorded = json.loads(manifest.read_text())["source"]["files"]
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{outdir}: holds a manifest ggufkit cannot read; use an empty directory") from None
    if recorded is not None and any("sha256" not in h for h in source_files.values()) and isinstance(recorded, dict):
        recorded = {k: {"size": v.get("size")} if isinstance(v, dict) else v for k, v in recorded.items()}
    if recorded is not None and recorded != source_files:
        changed = sorted(set(recorded) ^ set(source_files)) or \
            sorted(k for k in source_files if recorded.get(k) != source_files[k])
        raise UsageError(f"{outdir}: holds the release of another model (its manifest's source differs in "
                         f"{', '.join(changed[:3])}); use an empty directory")


def _check_texts(plan: ReleasePlan) -> int:
    """Tokenize the texts with the model's own vocabulary (a vocabulary-only GGUF, or the master when it
    exists) and refuse those too short for one chunk (``--card-only``: the evaluation text only).

    Returns:
        The positions the evaluation scores (llama-perplexity's second half of each chunk).
    """
    from ggufkit.converters import convert

    o = plan.options
    master = plan.outdir / plan.master_file()
    with tempfile.TemporaryDirectory(prefix="ggufkit-release-") as tmp:
        if master.is_file():
            vocab = master
        else:
            vocab = Path(tmp) / "vocab.gguf"
            convert(o.model, vocab, outtype="f32", vocab_only=True)
        n_chunk = _check_tokens(vocab, plan.eval_text, o.ctx, "--eval-text", o.chunks)
        if plan.imatrix_text is not None and not o.card_only:
            _check_tokens(vocab, plan.imatrix_text, o.ctx, "--imatrix-text")
    return n_chunk * (o.ctx - o.ctx // 2 - 1)
