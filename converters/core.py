"""The conversion pipeline: plan from headers, then stream one tensor at a time into an atomic GGUF write.

1. ``config.json`` -> registry entry (by ``architectures[0]``) -> hyperparameter keys.
2. Safetensors headers / indexes -> a :class:`ConvertPlan`: every source tensor is mapped (name, transform,
   output type) or explicitly ignored, else :class:`~ggufkit.errors.TensorMappingError` names the leftovers.
3. Metadata (general.*, hparams, vocabulary, provenance), then :func:`ggufkit.format.write_gguf` pulls
   tensors from a generator: read (mmap), transform, convert, write, drop.
4. The output is reopened with ggufkit's reader and checked against the plan.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import mmap
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, Keys, LlamaFileType
from gguf.utility import model_weight_count_rounded_notation

from ggufkit.constants import (
    GGUF_MAGIC,
    KEY_POWERINFER_SPARSE_THRESHOLD,
    KEY_SLACK,
    KEY_SOURCE_REPO,
    KEY_SOURCE_REVISION,
    KEY_SOURCE_SHA256,
    KEY_TOOL_VERSION,
    POWERINFER_MAGIC,
)
from ggufkit.converters import OUTTYPES
from ggufkit.converters.checkpoint import Checkpoint, read_config, resolve_model
from ggufkit.converters.hooks import hooks_for
from ggufkit.converters.hparams import hparams_metadata, resolve_hparams
from ggufkit.converters.powerinfer import check_activation, load_predictor, read_predictor
from ggufkit.converters.registry import ArchEntry, TensorRule, load_registry
from ggufkit.converters.transforms import TRANSFORMS, Heads, transformed_shape
from ggufkit.errors import CheckFailedError, CheckpointError, TensorMappingError, UsageError
from ggufkit.format.values import VT, Metadata
from ggufkit.format.writer import NullProgress, Progress, TensorSpec, write_gguf

Q = GGMLQuantizationType
G = Keys.General
FLOAT_OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}
FLOAT_FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
                    "bf16": LlamaFileType.MOSTLY_BF16}
#: GGUF tensors llama.cpp's converter always keeps in F32 whatever the outtype (convert.md §2.5).
_F32_KINDS = frozenset({"POS_EMBD", "TOKEN_TYPES"})


@dataclass(frozen=True)
class PlanEntry:
    """One output tensor: where it comes from and what it becomes.

    Attributes:
        name: GGUF name.
        source: HF tensor name (or ``model_N.pt:fc1.weight`` for predictors, ``generated`` for computed ones).
        shape: output shape, numpy order.
        src_dtype: source dtype (``F32``, ``F16``, ``BF16``, ...).
        ggml_type: output type.
        transform: transform name, or None.
        reason: why this output type.
        kind: MODEL_TENSOR name (``ATTN_Q``) or ``""``.
    """

    name: str
    source: str
    shape: tuple[int, ...]
    src_dtype: str
    ggml_type: GGMLQuantizationType
    transform: str | None
    reason: str
    kind: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "shape": list(self.shape), "src_dtype": self.src_dtype,
                "type": self.ggml_type.name, "transform": self.transform, "reason": self.reason}


@dataclass
class ConvertPlan:
    """Everything that will be written, known before any tensor data is read."""

    hf_class: str
    arch: str
    outtype: str
    file_type: int
    magic: bytes
    metadata: Metadata
    entries: list[PlanEntry]
    ignored: list[str]
    output: Path | None
    loaders: dict[str, Callable[[], np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(e.shape, dtype=np.int64)) for e in self.entries)

    @property
    def nbytes(self) -> int:
        return sum(TensorSpec(e.name, e.ggml_type, e.shape).nbytes for e in self.entries)

    def as_dict(self) -> dict[str, Any]:
        meta = {}
        for k, v in self.metadata.items():
            if k == KEY_SLACK:
                continue
            value = getattr(v, "value", None)
            if v.type == VT.ARRAY:
                value = {"array_length": len(value) if value is not None else None}
            meta[k] = value
        return {"hf_class": self.hf_class, "architecture": self.arch, "outtype": self.outtype,
                "file_type": self.file_type, "powerinfer": self.magic == POWERINFER_MAGIC,
                "output": str(self.output) if self.output else None, "n_tensors": len(self.entries),
                "n_params": self.n_params, "nbytes": self.nbytes, "metadata": meta,
                "tensors": [e.as_dict() for e in self.entries], "ignored": self.ignored}


@dataclass
class ConvertReport:
    """What :func:`convert` did."""

    plan: ConvertPlan
    outputs: list[Path]
    seconds: float
    dry_run: bool = False
    check: dict[str, Any] | None = None
    model_dir: Path | None = None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": True, "dry_run": self.dry_run, "outputs": [str(p) for p in self.outputs],
                "seconds": round(self.seconds, 3), "check": self.check, "warnings": self.warnings,
                **self.plan.as_dict()}


# -- mapping -------------------------------------------------------------------------------------------
def _compile(rule: TensorRule) -> re.Pattern[str]:
    body = re.escape(rule.hf_template).replace(re.escape("{bid}"), r"(?P<bid>\d+)")
    return re.compile(rf"^{body}(?P<suffix>\.weight|\.bias)?$")


def map_tensors(entry: ArchEntry, names: list[str], n_layer: int) -> tuple[list[tuple[str, str, TensorRule]],
                                                                            list[str]]:
    """Map HF names to GGUF names.

    Returns:
        ([(hf name, gguf name, rule)], [ignored hf names]), in source order.

    Raises:
        TensorMappingError: names no rule consumes and no ignore pattern matches, or a block index out of range.
    """
    rules = [(_compile(r), r) for r in entry.tensors]
    mapped, ignored, leftovers = [], [], []
    for name in names:
        local = name.removeprefix(entry.strip_prefix) if entry.strip_prefix else name
        stem = re.sub(r"\.(weight|bias)$", "", local)
        if any(fnmatch.fnmatchcase(local, p) or fnmatch.fnmatchcase(stem, p) for p in entry.ignore):
            ignored.append(name)
            continue
        for pattern, rule in rules:
            m = pattern.match(local)
            if m is None:
                continue
            bid = m.group("bid") if "{bid}" in rule.hf_template else None
            if bid is not None and int(bid) >= n_layer:
                leftovers.append(f"{name} (block {bid} >= block_count {n_layer})")
                break
            gguf = rule.gguf_template.format(bid=bid) + (m.group("suffix") or "")
            mapped.append((name, gguf, rule))
            break
        else:
            leftovers.append(name)
    if leftovers:
        more = f" and {len(leftovers) - 10} more" if len(leftovers) > 10 else ""
        raise TensorMappingError(f"{entry.hf_class}: no rule for source tensors {', '.join(leftovers[:10])}{more}; "
                                 "add them to registry.yaml 'tensors' or 'ignore'")
    _check_complete(entry, mapped, n_layer)
    return mapped, ignored


def _check_complete(entry: ArchEntry, mapped: list[tuple[str, str, TensorRule]], n_layer: int) -> None:
    produced = {g for _, g, _ in mapped}
    kinds = {r.tensor for _, _, r in mapped}
    if "TOKEN_EMBD" not in kinds:
        raise TensorMappingError(f"{entry.hf_class}: the checkpoint has no token embedding")
    # A per-block tensor present in one block must be present in all of them (a truncated shard set).
    per_block: dict[str, set[str]] = {}
    for _, gguf, rule in mapped:
        if "{bid}" in rule.gguf_template:
            suffix = gguf.split(".")[-1]
            per_block.setdefault(f"{rule.gguf_template}.{suffix}", set()).add(gguf)
    missing = []
    for template in per_block:
        for bid in range(n_layer):
            name = template.format(bid=bid)
            if name not in produced:
                missing.append(name)
    if missing:
        raise TensorMappingError(f"{entry.hf_class}: missing source tensors for {', '.join(missing[:10])}")


# -- types -------------------------------------------------------------------------------------------
def resolve_outtype(outtype: str, first_2d_dtypes: list[str]) -> str:
    """``auto``: the first 2-D bf16 or f16 tensor decides, f16 otherwise (llama.cpp's GUESSED rule)."""
    if outtype != "auto":
        return outtype
    for dtype in first_2d_dtypes:
        if dtype == "BF16":
            return "bf16"
        if dtype == "F16":
            return "f16"
    return "f16"


def float_type(name: str, kind: str, shape: tuple[int, ...], target: GGMLQuantizationType,
               powerinfer: bool) -> tuple[GGMLQuantizationType, str]:
    """Output type of one tensor for a float outtype, with the reason (convert.md §2.5)."""
    if len(shape) <= 1:
        return Q.F32, "1-D: F32"
    if name.endswith("_norm.weight"):
        return Q.F32, "norm: F32"
    if not name.endswith(".weight"):
        return Q.F32, "bias: F32"
    if kind in _F32_KINDS:
        return Q.F32, f"{kind.lower()}: F32"
    if powerinfer and kind == "FFN_DOWN_T":
        return Q.F16, "PowerInfer's CPU axpy kernel reads ffn_down_t as F16"
    return target, "outtype"


def to_float32(arr: np.ndarray, src_dtype: str) -> np.ndarray:
    """Source data as float32 (bf16 bits widened exactly)."""
    if src_dtype == "BF16":
        wide = np.asarray(arr).astype(np.uint32)
        wide <<= 16  # in place: one float32-sized buffer, not two
        return wide.view(np.float32)
    return np.asarray(arr).astype(np.float32, copy=False)


def bf16_from_float32(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16 bits, NaN kept quiet: ggml_compute_fp32_to_bf16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 64).astype(np.uint16)
    return rounded


def bf16_to_f16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float16, bit-identical to widening to float32 and ``astype(np.float16)``.

    bf16 values whose exponent lies in f16's normal range convert exactly by moving bit fields
    (``((bits & 0x7FFF) - (112 << 7)) << 3``, sign kept); the few others (zero, f16 subnormals, overflow,
    inf/NaN) take the float path. About three times faster than the float path for weights; an exhaustive
    test over all 65536 patterns keeps them equal.
    """
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    magnitude = bits & np.uint16(0x7FFF)
    out = magnitude - np.uint16(0x3800)  # exponent bias 127 -> 15
    out <<= np.uint16(3)  # 7 -> 10 mantissa bits
    out |= bits & np.uint16(0x8000)
    # Exponents 113..142 are f16 normals: magnitude bits 0x3880..0x477F.
    odd = np.flatnonzero((magnitude < 0x3880) | (magnitude >= 0x4780))
    if odd.size:
        with np.errstate(over="ignore"):
            out.reshape(-1)[odd] = to_float32(bits.reshape(-1)[odd], "BF16").astype(np.float16).view(np.uint16)
    return out.view(np.float16)


#: Rows are converted in chunks of about this many elements (4 MiB as float32), so temporaries stay small
#: whatever the tensor. Quantized types too: the quantizer's per-call cost is well under a millisecond now,
#: and a chunk that fits in cache quantizes faster per weight than a whole 16M-element tensor.
CHUNK_ELEMENTS = 1 << 20


def _encode_rows(rows: np.ndarray, src_dtype: str, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type == Q.BF16:
        return bf16_from_float32(to_float32(rows, src_dtype))
    if ggml_type == Q.F16:
        if src_dtype == "BF16":
            return bf16_to_f16(rows)
        with np.errstate(over="ignore"):  # reported by the caller, which knows the tensor's name
            return to_float32(rows, src_dtype).astype(np.float16)
    f32 = np.ascontiguousarray(to_float32(rows, src_dtype))
    if ggml_type == Q.F32:
        return f32
    from ggufkit.quant import quantize

    return quantize(f32, ggml_type)


def page_releaser(arr: np.ndarray) -> Callable[[np.ndarray], None] | None:
    """For an array backed by a read-only ``np.memmap``: a function that drops the pages under a
    C-contiguous slice of it from this process (``madvise(MADV_DONTNEED)``); None for other arrays.

    Pages of a file mapping count in the process's RSS once read, until the mapping is closed; a 16M-element
    bf16 tensor would keep 32 MB resident while it is converted. Dropped pages of a read-only file mapping
    come back from the page cache if read again, so releasing is always safe.
    """
    mm = getattr(arr, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or len(mm) == 0:
        return None
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    size = len(mm)

    def release(part: np.ndarray) -> None:
        start = part.ctypes.data - base
        if part.nbytes == 0 or not 0 <= start < size:
            return
        lo = start - start % mmap.PAGESIZE  # the mapping starts on a page; madvise wants a page-aligned start
        # Only a memory optimisation: never fail a conversion for it.
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, lo, min(size, start + part.nbytes) - lo)

    return release


def encode(arr: np.ndarray, src_dtype: str, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Convert one (transformed) tensor to its output type: numpy order, rows of ``ggml_type``'s bytes.

    Same-type data is passed through (a memmap view, no copy); otherwise rows are converted in chunks of
    :data:`CHUNK_ELEMENTS` into one preallocated output buffer (quantized types give
    ``uint8[n_rows, row_bytes]``), and the source pages of each chunk of a memory-mapped tensor are released
    once converted, so peak memory is the output plus one chunk's temporaries.
    """
    same = (ggml_type == Q.BF16 and src_dtype == "BF16") or (ggml_type == Q.F16 and src_dtype == "F16") or \
        (ggml_type == Q.F32 and src_dtype == "F32")
    if same:
        return np.ascontiguousarray(arr)
    row_len = arr.shape[-1] if arr.ndim else 1
    release = page_releaser(arr) if arr.flags.c_contiguous else None
    rows = np.asarray(arr).reshape(-1, row_len)
    step = max(1, CHUNK_ELEMENTS // max(row_len, 1))
    if rows.shape[0] <= step:
        out = _encode_rows(rows, src_dtype, ggml_type)
        if release is not None:
            release(rows)
        return out.reshape(*arr.shape[:-1], -1)
    out = None
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        encoded = _encode_rows(part, src_dtype, ggml_type)
        if out is None:
            out = np.empty((rows.shape[0], encoded.shape[1]), dtype=encoded.dtype)
        out[start:start + step] = encoded
        del encoded
        if release is not None:
            release(part)
    assert out is not None
    return out.reshape(*arr.shape[:-1], -1)


# -- naming and metadata -------------------------------------------------------------------------------
def size_label(n_params: int) -> str:
    """``494M``, ``7.6B``: the hub's size label (gguf's own rounding)."""
    return model_weight_count_rounded_notation(n_params, min_digits=2)


def default_name(model_dir: Path, repo: str | None) -> str:
    return (repo.split("/")[-1] if repo else model_dir.resolve().name) or "model"


def output_path(output: str | Path | None, model_dir: Path, repo: str | None, basename: str, label: str | None,
                ftype_name: str, vocab_only: bool) -> Path:
    """``-o`` file, directory or template (``{ftype}``, ``{FTYPE}``, ``{outtype}``), or the hub convention
    ``{basename}-{size_label}-{FTYPE}.gguf`` in the model directory (the current one for hub ids)."""
    parts = [basename.replace(" ", "-").replace("/", "-")] + ([label] if label else []) + [ftype_name.upper()]
    name = "-".join(parts) + ("-vocab" if vocab_only else "") + ".gguf"
    if output is None:
        return (Path.cwd() if repo else model_dir) / name
    out = Path(output)
    if out.is_dir():
        return out / name
    if "{" in str(out):
        try:
            return Path(str(out).format(ftype_name.lower(), ftype=ftype_name.lower(), outtype=ftype_name.lower(),
                                        FTYPE=ftype_name.upper(), OUTTYPE=ftype_name.upper()))
        except (KeyError, IndexError, ValueError) as exc:
            raise UsageError(f"output template {str(out)!r}: {exc}") from None
    return out


def read_metadata_file(path: Path | None) -> dict[str, Any]:
    """``--metadata FILE``: a JSON object of ``general.*`` keys (strings, numbers, booleans, string lists)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metadata {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--metadata {path}: expected a JSON object")
    for key, value in data.items():
        ok = isinstance(value, (str, int, float, bool)) or (isinstance(value, list)
                                                             and all(isinstance(v, str) for v in value))
        if not key.startswith("general.") or not ok or key in (G.ARCHITECTURE, G.FILE_TYPE):
            raise UsageError(f"--metadata {path}: key {key!r} must be a general.* key other than architecture "
                             "and file_type, with a string, number, boolean or string-list value")
    return data


def _set_general(meta: Metadata, key: str, value: Any) -> None:
    if isinstance(value, bool):
        meta.set(key, VT.BOOL, value)
    elif isinstance(value, int):
        meta.set(key, VT.UINT32 if value >= 0 else VT.INT32, value)
    elif isinstance(value, float):
        meta.set(key, VT.FLOAT32, value)
    elif isinstance(value, list):
        meta.set(key, VT.ARRAY, value, VT.STRING)
    else:
        meta.set(key, VT.STRING, value)


# -- planning ------------------------------------------------------------------------------------------
@dataclass
class _Source:
    model_dir: Path
    repo: str | None
    revision: str | None
    config: dict[str, Any]
    entry: ArchEntry
    checkpoint: Checkpoint | None


def _open_source(model: str | Path, vocab_only: bool) -> _Source:
    model_dir, repo, revision = resolve_model(model)
    config = read_config(model_dir)
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise CheckpointError("config.json has no 'architectures' list naming the model class", path=model_dir)
    entry = load_registry().get(archs[0])
    check = hooks_for(entry.hf_class).get("check_config")
    if check is not None:
        check(config)
    return _Source(model_dir, repo, revision, config, entry, None if vocab_only else Checkpoint(model_dir))


def _heads(hp: Mapping[str, tuple[VT, Any]], arch: str) -> Heads:
    n_head = int(hp.get(f"{arch}.attention.head_count", (VT.UINT32, 0))[1])
    n_kv = int(hp.get(f"{arch}.attention.head_count_kv", (VT.UINT32, n_head))[1])
    return Heads(n_head, n_kv)


def build_plan(src: _Source, *, outtype: str, predictor: Path | None, vocab_only: bool,
               output: str | Path | None, metadata_file: Path | None, pre_tokenizer: str | None) -> ConvertPlan:
    """Plan a conversion from headers only (no tensor data is read, except predictor shapes)."""
    entry, config = src.entry, src.config
    if outtype not in OUTTYPES:
        raise UsageError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    hp = resolve_hparams(entry, config)
    arch = entry.arch
    n_layer = int(hp[f"{arch}.block_count"][1])
    heads = _heads(hp, arch)
    powerinfer = predictor is not None
    if powerinfer and not entry.powerinfer:
        raise UsageError(f"--predictor: PowerInfer has no sparse loader for {entry.hf_class} ({arch})")
    if powerinfer:
        check_activation(config)

    entries: list[PlanEntry] = []
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    ignored: list[str] = []
    raw: list[tuple[str, str, str, tuple[int, ...], str, str | None]] = []  # gguf, source, kind, shape, dtype, tf
    extra = hooks_for(entry.hf_class).get("extra_tensors")
    if not vocab_only:
        assert src.checkpoint is not None
        ckpt = src.checkpoint
        for gguf_name, arr in (extra(config) if extra is not None else []):
            if powerinfer:
                raise UsageError(f"--predictor: PowerInfer's loader does not accept {gguf_name}")
            raw.append((gguf_name, "generated", "", arr.shape, "F32", None))
            loaders[gguf_name] = _constant(arr)
        mapped, ignored = map_tensors(entry, list(ckpt.tensors), n_layer)
        for hf, gguf_name, rule in mapped:
            st = ckpt.tensors[hf]
            kind, transform = rule.tensor, rule.transform
            if powerinfer and kind == "FFN_DOWN":
                # PowerInfer stores the down projection transposed, one neuron per row (powerinfer.md §2.3).
                kind, transform = "FFN_DOWN_T", "transpose"
                gguf_name = gguf_name.replace(".ffn_down.", ".ffn_down_t.")
            raw.append((gguf_name, hf, kind, transformed_shape(transform, st.shape), st.dtype, transform))
        kinds = {r[2] for r in raw}
        # A tied head where the loader needs output.weight (PowerInfer's llama loader too): write the embedding
        # again under that name.
        if "OUTPUT" not in kinds and (entry.output == "required" or (powerinfer and entry.output == "optional")):
            emb = next(r for r in raw if r[0] == "token_embd.weight")
            raw.append(("output.weight", emb[1], "OUTPUT", emb[3], emb[4], emb[5]))
        if powerinfer:
            pred = load_predictor(predictor, n_layer=n_layer, n_embd=int(hp[f"{arch}.embedding_length"][1]),
                                  n_ff=int(hp[f"{arch}.feed_forward_length"][1]))
            for gguf_name, shape, dtype, file, key in pred.tensors():
                raw.append((gguf_name, f"{file.name}:{key}", "FC1" if ".fc1." in gguf_name else "FC2", shape,
                            dtype, None))
                loaders[gguf_name] = _predictor_loader(pred.directory, key, file)
        for gguf_name, source, _, _, _, transform in raw:
            if gguf_name not in loaders:
                loaders[gguf_name] = _loader(ckpt, source, transform, heads)

    resolved = resolve_outtype(outtype, [r[4] for r in raw if len(r[3]) >= 2 and r[1] != "generated"])
    if resolved in FLOAT_OUTTYPES:
        target = FLOAT_OUTTYPES[resolved]
        for gguf_name, source, kind, shape, dtype, transform in raw:
            ggml_type, reason = float_type(gguf_name, kind, shape, target, powerinfer)
            entries.append(PlanEntry(gguf_name, source, shape, dtype, ggml_type, transform, reason, kind))
        file_type = int(FLOAT_FILE_TYPES[resolved])
    else:
        entries, file_type, resolved = _quant_entries(raw, resolved, arch, powerinfer, hp)

    meta = _metadata(src, hp, entries, file_type, vocab_only, metadata_file, powerinfer, predictor, pre_tokenizer)
    label = None if vocab_only else size_label(sum(int(np.prod(e.shape, dtype=np.int64)) for e in entries))
    name_value = meta.get(G.BASENAME) or meta.get(G.NAME)
    basename = str(getattr(name_value, "value", default_name(src.model_dir, src.repo)))
    out = output_path(output, src.model_dir, src.repo, basename, label,
                      LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_"), vocab_only)
    return ConvertPlan(entry.hf_class, arch, resolved, file_type, POWERINFER_MAGIC if powerinfer else GGUF_MAGIC,
                       meta, entries, ignored, out, loaders)


def _constant(arr: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: arr


def _predictor_loader(directory: Path, key: str, file: Path) -> Callable[[], np.ndarray]:
    return lambda: read_predictor(directory, key, file)


def _loader(ckpt: Checkpoint, source: str, transform: str | None, heads: Heads) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        arr = ckpt.read(source)
        return TRANSFORMS[transform](arr, heads) if transform else arr

    return load


def _quant_entries(raw: list[tuple[str, str, str, tuple[int, ...], str, str | None]], target: str, arch: str,
                   powerinfer: bool, hp: Mapping[str, tuple[VT, Any]]) -> tuple[list[PlanEntry], int, str]:
    """Per-tensor types for a quantized outtype, chosen by llama-quantize's rules (ggufkit.quant.plan).

    Returns:
        (entries in llama-quantize's order, general.file_type, canonical target name such as ``q4_k_m``).
    """
    from ggufkit.quant.plan import QuantOptions, plan_quantization

    # The planner sees what `ggufkit quantize` would see in the f32 conversion, so types (and tensor order)
    # match quantizing that file.
    sources = [TensorSpec(g, Q.F32, shape) for g, _, _, shape, _, _ in raw]
    meta = {k: v for k, (_, v) in hp.items()}
    meta[G.ARCHITECTURE] = arch
    qplan = plan_quantization(sources, target, arch=arch, metadata=meta, options=QuantOptions())
    by_name = {r[0]: r for r in raw}
    entries = []
    for qe in qplan.entries:
        gguf_name, source, kind, shape, dtype, transform = by_name[qe.name]
        ggml_type, reason = qe.dst_type, qe.reason
        if powerinfer and kind == "FFN_DOWN_T" and ggml_type != Q.Q4_0:
            ggml_type, reason = Q.F16, "PowerInfer's CPU axpy kernel reads ffn_down_t as F16 (or Q4_0)"
        entries.append(PlanEntry(gguf_name, source, shape, dtype, ggml_type, transform, reason, kind))
    return entries, int(qplan.file_type), qplan.target


def _metadata(src: _Source, hp: Mapping[str, tuple[VT, Any]], entries: list[PlanEntry], file_type: int,
              vocab_only: bool, metadata_file: Path | None, powerinfer: bool, predictor: Path | None,
              pre_tokenizer: str | None) -> Metadata:
    from ggufkit import __version__

    entry = src.entry
    meta = Metadata()
    meta.set(G.ARCHITECTURE, VT.STRING, entry.arch)
    meta.set(G.TYPE, VT.STRING, "model")
    overrides = read_metadata_file(metadata_file)
    name = overrides.get(G.NAME, default_name(src.model_dir, src.repo))
    meta.set(G.NAME, VT.STRING, str(name))
    meta.set(G.BASENAME, VT.STRING, str(overrides.get(G.BASENAME, name)).replace(" ", "-"))
    if not vocab_only:
        n_params = sum(int(np.prod(e.shape, dtype=np.int64)) for e in entries)
        meta.set(G.SIZE_LABEL, VT.STRING, str(overrides.get(G.SIZE_LABEL, size_label(n_params))))
    if src.repo:
        meta.set(G.SOURCE_REPO_URL, VT.STRING, f"https://huggingface.co/{src.repo}")
    for key, value in overrides.items():
        if key not in meta:
            _set_general(meta, key, value)
    for key, value in hparams_metadata(hp).items():
        meta.put(key, value)
    meta.set(G.FILE_TYPE, VT.UINT32, file_type)
    if powerinfer and predictor is not None:
        threshold = _predictor_threshold(predictor)
        if threshold is not None:
            meta.set(KEY_POWERINFER_SPARSE_THRESHOLD, VT.FLOAT32, threshold)
    meta.set(G.QUANTIZATION_VERSION, VT.UINT32, GGML_QUANT_VERSION)
    for key, value in _vocab(src, pre_tokenizer, entries).items():
        meta.put(key, value)
    meta.set(KEY_TOOL_VERSION, VT.STRING, __version__)
    if src.checkpoint is not None:
        meta.set(KEY_SOURCE_SHA256, VT.STRING, "\n".join(f"{h}  {n}" for n, h in src.checkpoint.sha256()))
    if src.repo:
        meta.set(KEY_SOURCE_REPO, VT.STRING, src.repo)
    if src.revision:
        meta.set(KEY_SOURCE_REVISION, VT.STRING, src.revision)
    return meta


def _predictor_threshold(predictor: Path) -> float | None:
    path = Path(predictor) / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("sparse_threshold")
    return None if value is None else float(value)


def _vocab(src: _Source, pre_tokenizer: str | None, entries: list[PlanEntry]) -> Metadata:
    from ggufkit.converters.vocab import build_vocab

    entry, d = src.entry, src.model_dir
    kind = entry.vocab[-1]
    for candidate in entry.vocab:
        if (candidate == "spm" and (d / "tokenizer.model").is_file()) or \
           (candidate == "bpe" and (d / "tokenizer.json").is_file()) or \
           (candidate == "tiktoken" and any(d.glob("*.tiktoken"))):
            kind = candidate
            break
    vocab_size = src.config.get("vocab_size")
    emb = next((e for e in entries if e.name == "token_embd.weight"), None)
    if emb is not None:
        vocab_size = emb.shape[0]
    if not isinstance(vocab_size, int):
        raise CheckpointError("config.json has no vocab_size", path=d)
    return build_vocab(d, kind, vocab_size=vocab_size, pre_tokenizer=pre_tokenizer)


# -- writing -------------------------------------------------------------------------------------------
def _tensor_stream(plan: ConvertPlan, warnings: list[str]) -> Iterator[np.ndarray]:
    for e in plan.entries:
        arr = plan.loaders[e.name]()
        src_dtype = "F32" if e.source == "generated" or e.kind in ("FC1", "FC2") else e.src_dtype
        out = encode(arr, src_dtype, e.ggml_type)
        if e.ggml_type == Q.F16 and src_dtype != "F16":
            # llama.cpp's converter overflows silently; values beyond +-65504 become inf.
            # Cheap test on the f16 bits first (exponent all ones means inf or NaN); count only when needed.
            n_inf = 0
            if out.size and int((out.view(np.uint16) & np.uint16(0x7FFF)).max()) >= 0x7C00:
                n_inf = int(np.isinf(out).sum()) - int(np.isinf(to_float32(arr, src_dtype)).sum())
            if n_inf > 0:
                warnings.append(f"{e.name}: {n_inf} values exceed f16's range and became inf; use --outtype "
                                "bf16 or f32")
        # A passed-through memmap view is written after this yield: release its pages only then.
        release = page_releaser(arr) if arr.flags.c_contiguous else None
        del arr
        yield out
        if release is not None:
            release(out)
        del out


def verify_output(plan: ConvertPlan, paths: list[Path]) -> None:
    """Reopen the written file(s) with ggufkit's reader and compare with the plan.

    Raises:
        CheckFailedError: a tensor or key differs from the plan.
    """
    from ggufkit.format import open_gguf

    with open_gguf(paths[0]) as model:
        if model.magic != plan.magic:
            raise CheckFailedError(f"written magic {model.magic!r}, planned {plan.magic!r}", path=paths[0])
        got = [(t.name, t.ggml_type, t.shape) for t in model.tensors]
        want = [(e.name, e.ggml_type, e.shape) for e in plan.entries]
        if got != want:
            diff = next((w, g) for w, g in zip(want + [None] * len(got), got + [None] * len(want)) if w != g)
            raise CheckFailedError(f"written tensors differ from the plan: planned {diff[0]}, found {diff[1]}",
                                   path=paths[0])
        missing = [k for k in plan.metadata if k not in model.kv]
        if missing:
            raise CheckFailedError(f"metadata keys missing from the output: {missing[:5]}", path=paths[0])


def convert(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
            predictor: Path | None = None, vocab_only: bool = False, split_max_size: int | None = None,
            metadata_file: Path | None = None, pre_tokenizer: str | None = None, dry_run: bool = False,
            progress: Progress | None = None) -> ConvertReport:
    """Convert a Hugging Face checkpoint to GGUF (or a PowerInfer GGUF with ``predictor``).

    Args:
        model: checkpoint directory or hub repo id (resolved through the local cache; ``HF_HUB_OFFLINE``).
        output: output file, directory, or template with ``{ftype}``; None: the hub naming convention
            ``{basename}-{size_label}-{FTYPE}.gguf`` in the model directory.
        outtype: one of :data:`OUTTYPES`; ``auto`` follows the checkpoint (bf16 -> bf16, else f16).
        predictor: PowerInfer predictor directory (``model_N.pt``), for ReLU LLaMA-family and OPT models.
        vocab_only: write metadata and vocabulary only.
        split_max_size: gguf-split shards of at most this many bytes.
        metadata_file: JSON of ``general.*`` keys overriding the derived ones.
        pre_tokenizer: force ``tokenizer.ggml.pre`` (BPE vocabularies).
        dry_run: plan only; nothing is written.
        progress: receives bytes written.

    Returns:
        A :class:`ConvertReport` with the plan and the written paths.

    Raises:
        UnsupportedArchitectureError: the HF class is not in registry.yaml.
        CheckpointError: config or weights missing, malformed or unsafe.
        TensorMappingError: source tensors no rule consumes, or required ones missing.
        TokenizerError: the vocabulary cannot be converted.
        CheckFailedError: the written file does not match the plan.
    """
    start = time.perf_counter()
    src = _open_source(model, vocab_only)
    try:
        plan = build_plan(src, outtype=outtype, predictor=predictor, vocab_only=vocab_only, output=output,
                          metadata_file=metadata_file, pre_tokenizer=pre_tokenizer)
        if dry_run:
            return ConvertReport(plan, [], time.perf_counter() - start, dry_run=True, model_dir=src.model_dir)
        assert plan.output is not None
        if not plan.output.parent.is_dir():
            raise UsageError(f"output directory {plan.output.parent} does not exist")
        specs = [TensorSpec(e.name, e.ggml_type, e.shape) for e in plan.entries]
        warnings: list[str] = []
        paths = write_gguf(plan.output, plan.metadata, specs, _tensor_stream(plan, warnings), magic=plan.magic,
                           split_max_size=split_max_size, progress=progress or NullProgress())
        verify_output(plan, paths)
        return ConvertReport(plan, paths, time.perf_counter() - start, model_dir=src.model_dir, warnings=warnings)
    finally:
        if src.checkpoint is not None:
            src.checkpoint.close()
