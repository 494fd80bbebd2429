"""Structural validation of a GGUF file or shard set, with optional tensor hashes.

Everything the reader checks (bounds, counts, type ids, alignment, overlapping or out-of-file tensor
data) plus what only a full pass sees: every string decodes as UTF-8, well-known keys have the type
llama.cpp reads them with, the tokenizer arrays agree in length and the special token ids fall inside
the vocabulary, ``split.tensors.count`` matches, and tensor offsets are packed the way llama.cpp's
``gguf_init_from_file`` demands (it rejects "tensor has offset X, expected Y").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import MODEL_ARCH_NAMES, Keys

from ggufkit.constants import POWERINFER_ARCH_BAMBOO, POWERINFER_ARCH_OPT
from ggufkit.errors import GGUFFormatError
from ggufkit.format.known_keys import expected_types, types_label
from ggufkit.format.reader import GGUFFile, GGUFModel, align_up
from ggufkit.format.shards import SPLIT_COUNT, SPLIT_TENSORS_COUNT, open_gguf
from ggufkit.format.values import VT
from ggufkit.format.writer import NullProgress, Progress
from ggufkit.summary import adapter_summary, projector_summary

#: Bytes hashed between two progress updates.
_HASH_CHUNK = 16 << 20

_TOKEN_ID_KEYS = (Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID,
                  Keys.Tokenizer.UNK_ID, Keys.Tokenizer.SEP_ID, Keys.Tokenizer.PAD_ID, Keys.Tokenizer.MASK_ID)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file.

    Attributes:
        kind: ``format`` (the reader refused the file), ``key_type``, ``tokenizer``, ``split``, ``layout``, ``adapter`` or ``projector``.
        message: what is wrong, naming the key or tensor.
        path: the file (shard) concerned.
        offset: byte offset in that file, when known.
    """

    kind: str
    message: str
    path: str | None = None
    offset: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "path": self.path, "offset": self.offset}


@dataclass
class VerifyReport:
    """The result of :func:`verify`; ``ok`` is True when ``problems`` is empty."""

    path: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    n_tensors: int = 0
    n_kv: int = 0
    tensor_sha256: dict[str, str] | None = None
    digest: str | None = None
    adapter: dict[str, Any] | None = None
    projector: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path, "ok": self.ok, "problems": [p.to_dict() for p in self.problems],
            "warnings": self.warnings, "shards": self.shards, "tensors": self.n_tensors, "kv": self.n_kv,
        }
        if self.adapter is not None:
            out["adapter"] = self.adapter
        if self.projector is not None:
            out["projector"] = self.projector
        if self.tensor_sha256 is not None:
            out["tensor_sha256"] = self.tensor_sha256
            out["digest"] = self.digest
        return out


def verify(path: str | Path, *, hash_tensors: bool = False, progress: Progress | None = None) -> VerifyReport:
    """Validate the GGUF file (or the shard set) at ``path``.

    Args:
        path: a GGUF file or any shard of a gguf-split set.
        hash_tensors: also compute each tensor's sha256 and ``digest``, the sha256 of all tensor data
            concatenated in tensor order (shard order for sets): it is unchanged by metadata edits.
        progress: receives bytes hashed.

    Returns:
        The report; problems are collected, not raised.

    Raises:
        OSError: the file cannot be opened at all.
    """
    report = VerifyReport(path=str(path))
    try:
        model = open_gguf(path)
    except GGUFFormatError as exc:
        report.problems.append(_format_problem(exc))
        return report
    with model:
        report.shards = [str(f.path) for f in model.files]
        report.n_tensors = len(model.tensors)
        report.n_kv = len(model.kv)
        for f in model.files:
            _check_values(f, report)
            _check_layout(f, report)
        first = model.files[0]
        _check_key_types(first, report)
        _check_tokenizer(first, report)
        _check_split(model, report)
        _check_adapter(model, report)
        _check_projector(model, report)
        if hash_tensors and report.ok:
            _hash(model, report, progress or NullProgress())
    return report


def _check_projector(model: GGUFModel, report: VerifyReport) -> None:
    # clip.cpp (clip_model_loader::load_hparams) needs a projector type, image and patch sizes, and an image
    # mean and std of at least 3 items each ("image_mean/image_std arrays must have at least 3 elements") to
    # load a vision encoder.
    report.projector = projector_summary(model)
    p = report.projector
    if p is None or not p["has_vision_encoder"]:
        return
    for key, value in (("clip.projector_type", p["projector_type"]), ("clip.vision.image_size", p["image_size"]),
                       ("clip.vision.patch_size", p["patch_size"])):
        if not value:
            report.problems.append(Problem("projector", f"{key} is missing: libmtmd cannot load the vision "
                                           "encoder", report.path))
    for key in ("clip.vision.image_mean", "clip.vision.image_std"):
        value = p["clip_keys"].get(key)
        if not isinstance(value, list) or len(value) < 3:
            report.problems.append(Problem("projector", f"{key} must list at least 3 values (one per RGB "
                                           "channel): libmtmd cannot load the vision encoder", report.path))
    if p["projector_type"] and p["image_size"] and p["patch_size"] and p["tokens_per_image"] is None:
        report.warnings.append(f"projector type {p['projector_type']!r}: ggufkit does not know how many tokens "
                               "libmtmd makes of an image with it")


def _check_adapter(model: GGUFModel, report: VerifyReport) -> None:
    # llama.cpp refuses an adapter whose lora_a/lora_b do not pair up (llama-adapter.cpp:
    # llama_adapter_lora_init_impl: "LoRA tensor pair ... is missing one component").
    report.adapter = adapter_summary(model)
    if report.adapter is not None:
        for name in report.adapter["unpaired"]:
            report.problems.append(Problem("adapter", f"{name}: lora_a and lora_b must both be present", report.path))


def _format_problem(exc: GGUFFormatError) -> Problem:
    message = exc.message.removeprefix(f"at byte {exc.offset}: ") if exc.offset is not None else exc.message
    return Problem("format", message, exc.path, exc.offset)


def _check_values(f: GGUFFile, report: VerifyReport) -> None:
    for kv in f.iter_kv():
        try:
            kv.value  # noqa: B018 - decoding is the check (UTF-8 of every string array item)
        except GGUFFormatError as exc:
            report.problems.append(_format_problem(exc))


def _check_layout(f: GGUFFile, report: VerifyReport) -> None:
    expected = 0
    for t in f.tensors:
        if t.offset != expected:
            report.problems.append(Problem(
                "layout", f"tensor {t.name!r} has offset {t.offset}, llama.cpp expects {expected} (tensors must be "
                "packed in info order, each padded to the alignment)", str(f.path), t.info_offset))
            return
        expected += align_up(t.nbytes, f.alignment)


def _check_key_types(f: GGUFFile, report: VerifyReport) -> None:
    arch = f.architecture
    if arch is None:
        if Keys.General.ARCHITECTURE not in f.kv:
            report.warnings.append(f"{Keys.General.ARCHITECTURE} is missing: llama.cpp cannot load this file")
    elif arch not in MODEL_ARCH_NAMES.values() and arch not in (POWERINFER_ARCH_OPT, POWERINFER_ARCH_BAMBOO):
        report.warnings.append(f"architecture {arch!r} is unknown to gguf and PowerInfer")
    for kv in f.iter_kv():
        types = expected_types(kv.key, arch)
        if types is not None and (kv.type, kv.item_type) not in types:
            report.problems.append(Problem("key_type", f"{kv.key} has type {kv.type_label}, llama.cpp reads "
                                           f"{types_label(types)}", str(f.path), kv.offset))


def _check_tokenizer(f: GGUFFile, report: VerifyReport) -> None:
    tokens = f.kv.get(Keys.Tokenizer.LIST)
    if tokens is None or tokens.type != VT.ARRAY:
        return
    n_vocab = tokens.count or 0
    for key in (Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE):
        kv = f.kv.get(key)
        if kv is not None and kv.type == VT.ARRAY and kv.count != n_vocab:
            report.problems.append(Problem("tokenizer", f"{key} has {kv.count} items, {Keys.Tokenizer.LIST} has "
                                           f"{n_vocab}", str(f.path), kv.offset))
    for key in _TOKEN_ID_KEYS:
        kv = f.kv.get(key)
        if kv is not None and kv.type == VT.UINT32 and int(kv.value) >= n_vocab:
            # llama.cpp only warns and falls back to its default id, which is rarely what was meant.
            report.problems.append(Problem("tokenizer", f"{key} = {kv.value} is outside the {n_vocab}-token "
                                           "vocabulary", str(f.path), kv.offset))


def _check_split(model: GGUFModel, report: VerifyReport) -> None:
    # A complete set was checked when it was opened (shards.open_gguf); this covers one-file "sets".
    first = model.files[0]
    declared = first.kv.get(SPLIT_TENSORS_COUNT)
    if declared is None or len(model.files) > 1 or declared.type != VT.INT32:
        return
    count = first.kv.get(SPLIT_COUNT)
    if count is not None and count.type == VT.UINT16 and int(count.value) > 1:
        return
    if int(declared.value) != len(first.tensors):
        report.problems.append(Problem("split", f"{SPLIT_TENSORS_COUNT} is {declared.value} but the file holds "
                                       f"{len(first.tensors)} tensors", str(first.path), declared.offset))


def _hash(model: GGUFModel, report: VerifyReport, progress: Progress) -> None:
    total = hashlib.sha256()
    hashes: dict[str, str] = {}
    progress.begin(sum(t.nbytes for t in model.tensors), "B", "hashing tensors")
    for t in model.tensors:
        view = model.raw(t)
        h = hashlib.sha256()
        for start in range(0, t.nbytes, _HASH_CHUNK):
            chunk = view[start:start + _HASH_CHUNK]
            h.update(chunk)
            total.update(chunk)
            progress.advance(len(chunk))
        hashes[t.name] = h.hexdigest()
        del view
    progress.end()
    report.tensor_sha256 = hashes
    report.digest = total.hexdigest()
