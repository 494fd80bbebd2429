"""Editing GGUF metadata (``ggufkit set-meta``): set any key to any type, delete, rename, in place when safe.

How an edit is written:

- **In place** when the new header fits where the old one was: exactly the old size, or by shrinking or
  growing ggufkit's reserved ``ggufkit.slack`` string, or within the zero padding before the data section.
  Tensor offsets do not move; new keys are inserted just before the slack for this reason. The new
  header is encoded and re-parsed before anything is written, and the changed bytes are written with a
  single ``pwrite`` followed by ``fsync``. In place is used only when
  every changed byte lies inside one 4 KiB page: Linux copies a write into the page cache one page at a
  time and checks for a fatal signal only between pages, so a SIGKILL leaves the file either wholly old or
  wholly new, never torn. (Power loss during that one page write is as safe as the storage's 4 KiB writes.)
- Otherwise a **streaming rewrite**: a temporary file beside the target receives the new header and a
  byte-for-byte copy of every tensor (offsets re-packed as llama.cpp requires), is fsynced and renamed
  over the target (or written to ``output``). A kill leaves the original untouched; the temporary file
  it leaves behind is removed by the next edit (``remove_stale_temporaries``). A rewrite refills the slack,
  so the next edit of ``general.name`` happens in place.

``general.alignment`` may be changed: the rewrite re-lays the tensor data out with the new alignment.
For a gguf-split set, the metadata of shard 1 is edited; ``split.*`` keys are managed and cannot be set.

Typing a value (first rule that applies):

1. ``types[key]`` (``--type KEY=TYPE``): ``u8 i8 u16 i16 u32 i32 u64 i64 f32 f64 bool str`` or ``array[T]``;
2. the existing key's type (arrays keep their item type);
3. the type llama.cpp reads a well-known key with (``ggufkit.format.known_keys``);
4. inference from the text: ``true``/``false`` -> bool; an integer -> u32 (u64 above 2^32-1; i32 if negative,
   i64 below -2^31); a decimal number with ``.`` or an exponent -> f32; a JSON array (``[1, 2]``,
   ``["a", "b"]``) -> array of bool, i32 (i64 when needed), f32 or str; anything else -> str.
   Values from JSON follow the same rules by JSON type; ``{"type": "u64", "value": 5}`` gives the type.

Bools accept ``true``/``false``/``1``/``0`` only (``gguf_set_metadata.py`` turns "false" into True).
Chat templates (``tokenizer.chat_template*``) are parsed, never rendered, with jinja2's
``ImmutableSandboxedEnvironment``; a template that does not parse is refused.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys

from ggufkit.constants import DEFAULT_SLACK_BYTES, KEY_SLACK
from ggufkit.errors import (
    GGUFKitError,
    MetadataKeyNotFoundError,
    MetadataValueError,
    OutputExistsError,
    UsageError,
)
from ggufkit.format.atomic import atomic_write, remove_stale_temporaries
from ggufkit.format.known_keys import expected_types
from ggufkit.format.reader import GGUFFile, KVField, align_up
from ggufkit.format.shards import SPLIT_KEYS, open_gguf
from ggufkit.format.values import (
    FLOAT_TYPES,
    INTEGER_TYPES,
    TYPE_NAMES,
    VT,
    EncodableValue,
    Metadata,
    TypedValue,
    summarize,
    type_label,
)
from ggufkit.format.writer import (
    NullProgress,
    Progress,
    TensorSpec,
    alignment_of,
    encode_header,
    tensor_offsets,
    with_slack,
)

#: In-place patches must lie within one page of this size (see the module docstring).
PATCH_PAGE = 4096
_COPY_CHUNK = 16 << 20
_INT_RE = re.compile(r"[+-]?\d+\Z")
_FLOAT_RE = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?\Z")
_CHAT_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE


@dataclass(frozen=True)
class Change:
    """One key's change: ``op`` is ``add``, ``set``, ``delete`` or ``rename`` (to ``new_key``)."""

    op: str
    key: str
    new_key: str | None = None
    old_type: str | None = None
    new_type: str | None = None
    old: Any = None
    new: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "key": self.key, "new_key": self.new_key, "old_type": self.old_type,
                "new_type": self.new_type, "old": self.old, "new": self.new}


@dataclass
class EditReport:
    """What :func:`edit_metadata` did (or, with ``dry_run``, would do).

    Attributes:
        mode: ``in_place``, ``rewrite`` or ``unchanged``.
        changes: the diff, old -> new.
        slack: bytes of ``ggufkit.slack`` before and after (0 when absent).
    """

    path: str
    output: str
    mode: str
    dry_run: bool
    changes: list[Change] = field(default_factory=list)
    slack: tuple[int, int] = (0, 0)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "output": self.output, "mode": self.mode, "dry_run": self.dry_run,
                "changes": [c.to_dict() for c in self.changes], "reason": self.reason,
                "slack_bytes": {"old": self.slack[0], "new": self.slack[1]}}


# -- values ----------------------------------------------------------------------------------------
def parse_type(text: str) -> tuple[VT, VT | None]:
    """``u32`` -> (UINT32, None); ``array[str]`` -> (ARRAY, STRING).

    Raises:
        MetadataValueError: unknown type name.
    """
    t = text.strip().lower()
    m = re.fullmatch(r"array\[(\w+)\]", t)
    if m and m[1] in TYPE_NAMES:
        return VT.ARRAY, TYPE_NAMES[m[1]]
    if t in TYPE_NAMES:
        return TYPE_NAMES[t], None
    names = ", ".join(dict.fromkeys(TYPE_NAMES))
    raise MetadataValueError(f"unknown type {text!r}; use one of {names} or array[TYPE]")


def _checked(key: str, value: TypedValue) -> TypedValue:
    try:
        value.encode_payload()
    except MetadataValueError as exc:
        raise MetadataValueError(exc.message, key=key) from None
    return value


def _text_scalar(key: str, text: str, vtype: VT) -> Any:
    if vtype == VT.STRING:
        return text
    if vtype == VT.BOOL:
        low = text.strip().lower()
        if low in ("true", "1"):
            return True
        if low in ("false", "0"):
            return False
        raise MetadataValueError(f"{text!r} is not a bool: use true, false, 1 or 0", key=key)
    if vtype in INTEGER_TYPES:
        if not _INT_RE.match(text.strip()):
            raise MetadataValueError(f"{text!r} is not an integer for {type_label(vtype)}", key=key)
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise MetadataValueError(f"{text!r} is not a number for {type_label(vtype)}", key=key) from None


def _json_scalar(key: str, value: Any, vtype: VT) -> Any:
    if vtype == VT.STRING and isinstance(value, str):
        return value
    if vtype == VT.BOOL:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            return _text_scalar(key, value, vtype)
    if vtype in INTEGER_TYPES and isinstance(value, int) and not isinstance(value, bool):
        return value
    if vtype in FLOAT_TYPES and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise MetadataValueError(f"{value!r} is not a valid {type_label(vtype)}", key=key)


def _typed_from_json(key: str, value: Any, vtype: VT, item_type: VT | None) -> TypedValue:
    if vtype == VT.ARRAY:
        assert item_type is not None
        if not isinstance(value, list):
            raise MetadataValueError(f"expected a JSON array for {type_label(vtype, item_type)}, got {value!r}",
                                     key=key)
        return _checked(key, TypedValue(VT.ARRAY, [_json_scalar(key, v, item_type) for v in value], item_type))
    return _checked(key, TypedValue(vtype, _json_scalar(key, value, vtype)))


def _typed_from_text(key: str, text: str, vtype: VT, item_type: VT | None) -> TypedValue:
    if vtype == VT.ARRAY:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            raise MetadataValueError(f"expected a JSON array such as [1, 2] or [\"a\"] for "
                                     f"{type_label(vtype, item_type)}, got {text!r}", key=key) from None
        return _typed_from_json(key, items, vtype, item_type)
    return _checked(key, TypedValue(vtype, _text_scalar(key, text, vtype)))


def _int_type(key: str, v: int) -> VT:
    for vtype, lo, hi in ((VT.UINT32, 0, 2**32 - 1), (VT.UINT64, 0, 2**64 - 1), (VT.INT32, -(2**31), -1),
                          (VT.INT64, -(2**63), -1)):
        if lo <= v <= hi:
            return vtype
    raise MetadataValueError(f"{v} does not fit in any GGUF integer type", key=key)


def _is_typed(value: Any) -> bool:
    """``{"type": "u64", "value": 5}``: a JSON value that states its type."""
    return isinstance(value, dict) and set(value) == {"type", "value"} and isinstance(value["type"], str)


def _infer_json(key: str, value: Any) -> TypedValue:
    if isinstance(value, bool):
        return TypedValue(VT.BOOL, value)
    if isinstance(value, int):
        return _checked(key, TypedValue(_int_type(key, value), value))
    if isinstance(value, float):
        return _checked(key, TypedValue(VT.FLOAT32, value))
    if isinstance(value, str):
        return TypedValue(VT.STRING, value)
    if isinstance(value, list) and value:
        if all(isinstance(v, bool) for v in value):
            item = VT.BOOL
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            item = VT.INT32 if all(-(2**31) <= v < 2**31 for v in value) else VT.INT64
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            item = VT.FLOAT32
        elif all(isinstance(v, str) for v in value):
            item = VT.STRING
        else:
            raise MetadataValueError("mixed array items: give the type with --type KEY=array[TYPE]", key=key)
        return _typed_from_json(key, value, VT.ARRAY, item)
    raise MetadataValueError(f"cannot infer a GGUF type for {value!r}: give it with --type KEY=TYPE", key=key)


def _infer_text(key: str, text: str) -> TypedValue:
    s = text.strip()
    if s.lower() in ("true", "false"):
        return TypedValue(VT.BOOL, s.lower() == "true")
    if _INT_RE.match(s):
        return _infer_json(key, int(s))
    if _FLOAT_RE.match(s) and any(c in s for c in ".eE"):
        return _checked(key, TypedValue(VT.FLOAT32, float(s)))
    if s.startswith("["):
        try:
            items = json.loads(s)
        except json.JSONDecodeError:
            items = None
        if isinstance(items, list):
            return _infer_json(key, items)
    return TypedValue(VT.STRING, text)


def lint_chat_template(text: str, *, key: str = _CHAT_TEMPLATE) -> None:
    """Parse a chat template with jinja2's sandboxed environment (it is never rendered).

    Raises:
        MetadataValueError: the template does not parse, with jinja2's message and line.
    """
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # loopcontrols: Hugging Face's apply_chat_template enables it, so templates use {% break %}.
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except TemplateSyntaxError as exc:
        raise MetadataValueError(f"chat template does not parse (line {exc.lineno}): {exc.message}",
                                 key=key) from None


def load_json_edits(path: str | Path) -> dict[str, Any]:
    """Read ``--from-json FILE``: one JSON object mapping keys to values (or ``{"type", "value"}``).

    Raises:
        UsageError: the file is not a JSON object.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object mapping keys to values")
    return data


# -- planning ----------------------------------------------------------------------------------------
def _summary(value: EncodableValue) -> Any:
    if isinstance(value, KVField):
        v = value.head(8) if value.type == VT.ARRAY else value.value
        return summarize(v, value.type, value.item_type, value.count)
    assert isinstance(value, TypedValue)
    if value.type == VT.ARRAY:
        items = list(value.value)
        return summarize(items, value.type, value.item_type, len(items))
    return summarize(value.value, value.type, None, None)


def _label(value: EncodableValue) -> str:
    return type_label(value.type, value.item_type)


def _apply(f: GGUFFile, *, set_text: Mapping[str, str], set_values: Mapping[str, Any],
           types: Mapping[str, str], delete: Sequence[str], rename: Mapping[str, str]) -> tuple[Metadata, list[Change]]:
    touched = [*delete, *rename, *rename.values(), *set_text, *set_values]
    for key in touched:
        if key in SPLIT_KEYS:
            raise UsageError(f"{key} is managed by the shard layout and cannot be edited")
        if key == KEY_SLACK:
            raise UsageError(f"{KEY_SLACK} is reserved by ggufkit for in-place edits and cannot be edited")
    seen: set[str] = set()
    for key in touched:
        if key in seen:
            raise UsageError(f"key {key!r} is given more than once (set, delete and rename must not overlap)")
        seen.add(key)
    unused = [k for k in types if k not in set_text and k not in set_values]
    if unused:
        raise UsageError(f"--type given for {unused[0]!r}, which is not being set")

    meta = Metadata((kv.key, kv) for kv in f.iter_kv())
    changes: list[Change] = []
    for key in delete:
        if key not in meta:
            raise MetadataKeyNotFoundError(key, path=f.path, hint="nothing to delete")
        gone = meta[key]
        changes.append(Change("delete", key, old_type=_label(gone), old=_summary(gone)))
        meta.remove(key)
    for old_key, new_key in rename.items():
        if old_key not in meta:
            raise MetadataKeyNotFoundError(old_key, path=f.path, hint="nothing to rename")
        if new_key in meta:
            raise MetadataValueError(f"cannot rename {old_key!r}: the key already exists", key=new_key)
        value = meta[old_key]
        meta = Metadata((new_key if k == old_key else k, v) for k, v in meta.items())
        changes.append(Change("rename", old_key, new_key=new_key, old_type=_label(value), new_type=_label(value)))

    arch = f.architecture
    requests = [(k, v, True) for k, v in set_text.items()] + [(k, v, False) for k, v in set_values.items()]
    for key, raw, is_text in requests:
        old = meta.get(key)
        explicit = types.get(key)
        if not is_text and _is_typed(raw):
            explicit, raw = raw["type"], raw["value"]
        if explicit is not None:
            vtype, item_type = parse_type(explicit)
        elif old is not None:
            vtype, item_type = old.type, old.item_type
        elif (known := expected_types(key, arch)) is not None:
            vtype, item_type = known[0]
        else:
            new = _infer_text(key, raw) if is_text else _infer_json(key, raw)
            vtype, item_type = new.type, new.item_type
        if is_text:
            new = _typed_from_text(key, raw, vtype, item_type)
        else:
            new = _typed_from_json(key, raw, vtype, item_type)
        if key == _CHAT_TEMPLATE or key.startswith(_CHAT_TEMPLATE + "."):
            if new.type != VT.STRING:
                raise MetadataValueError("a chat template must be a string", key=key)
            lint_chat_template(new.value, key=key)
        if key == Keys.General.ALIGNMENT:
            alignment_of({key: new})  # refuses a non-power of two before anything is written
        if old is not None and old.type == new.type and old.item_type == new.item_type \
                and old.encode_payload() == new.encode_payload():
            continue
        if old is None and KEY_SLACK in meta:
            # New keys go just before the slack, so adding one shifts only the bytes up to the slack and
            # can happen in place; KV order carries no meaning in GGUF.
            keys = list(meta)
            at = keys.index(KEY_SLACK)
            meta.insert_after(keys[at - 1] if at else None, key, new)
        else:
            meta.put(key, new)
        changes.append(Change("add" if old is None else "set", key, old_type=None if old is None else _label(old),
                              new_type=_label(new), old=None if old is None else _summary(old), new=_summary(new)))
    return meta, changes


def _slack_len(meta: Mapping[str, EncodableValue]) -> int:
    value = meta.get(KEY_SLACK)
    if value is None or value.type != VT.STRING:
        return 0
    return len(value.encode_payload()) - 8


def _specs(f: GGUFFile) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.ggml_type, t.shape) for t in f.tensors]


def _plan_in_place(f: GGUFFile, meta: Metadata) -> tuple[int, bytes, Metadata] | str:
    """(offset, bytes to write, final metadata), or why the edit cannot be done in place."""
    if alignment_of(meta) != f.alignment:
        return f"{Keys.General.ALIGNMENT} changes: the tensor data must be laid out again"
    specs = _specs(f)
    offsets = [t.offset for t in f.tensors]
    header = encode_header(f.magic, meta, specs, offsets, version=f.version)
    if KEY_SLACK in meta and meta[KEY_SLACK].type == VT.STRING:
        new_slack = max(0, _slack_len(meta) - (len(header) - f.header_end))
        meta = Metadata(meta.items())
        meta.put(KEY_SLACK, TypedValue(VT.STRING, " " * new_slack))
        header = encode_header(f.magic, meta, specs, offsets, version=f.version)
    limit = f.data_offset if f.tensors else max(f.file_size, f.header_end)
    if len(header) > limit:
        return f"the new header needs {len(header)} bytes, {limit} are available before the tensor data"
    block = header + b"\0" * (limit - len(header))
    differs = np.flatnonzero(np.frombuffer(block, np.uint8) != np.frombuffer(f.read_bytes(0, limit), np.uint8))
    if differs.size == 0:
        return "no byte changes"
    first, last = int(differs[0]), int(differs[-1])
    if first // PATCH_PAGE != last // PATCH_PAGE:
        return (f"the changed bytes span {first}..{last}, more than one {PATCH_PAGE}-byte page, so a single "
                "kill-safe write cannot hold them")
    parsed = GGUFFile.from_header_bytes(block, f.path)
    same_tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in parsed.tensors] == \
        [(t.name, t.ggml_type, t.ne, t.offset) for t in f.tensors]
    if list(parsed.kv) != list(meta) or not same_tensors or (f.tensors and parsed.data_offset != f.data_offset):
        raise GGUFKitError(f"internal error: the in-place header does not describe the same data ({f.path})")
    return first, block[first:last + 1], meta


def _patch(path: Path, offset: int, old: bytes, new: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.pread(fd, len(old), offset) != old:
            raise GGUFKitError("the file changed while it was being edited; nothing was written", path=path)
        # One pwrite inside one page: a kill cannot leave it half done (module docstring).
        if os.pwrite(fd, new, offset) != len(new):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite(f: GGUFFile, meta: Metadata, dest: Path, slack_bytes: int, progress: Progress) -> Metadata:
    meta = Metadata(meta.items())
    if slack_bytes > 0:
        if KEY_SLACK in meta:
            meta.put(KEY_SLACK, TypedValue(VT.STRING, " " * slack_bytes))
        else:
            meta = with_slack(meta, slack_bytes)
    alignment = alignment_of(meta)
    specs = _specs(f)
    offsets = tensor_offsets(specs, alignment)
    header = encode_header(f.magic, meta, specs, offsets, version=f.version)
    GGUFFile.from_header_bytes(header, f.path)  # our own encoding must parse before we write it
    mode = stat.S_IMODE(os.stat(f.path).st_mode)
    progress.begin(sum(t.nbytes for t in f.tensors), "B", f"rewriting {dest.name}")
    with atomic_write(dest) as (out,):
        os.fchmod(out.fileno(), mode)
        out.write(header)
        out.write(b"\0" * (align_up(len(header), alignment) - len(header)))
        for t in f.tensors:
            view = f.raw(t)
            for start in range(0, t.nbytes, _COPY_CHUNK):
                chunk = view[start:start + _COPY_CHUNK]
                out.write(chunk)
                progress.advance(len(chunk))
                chunk.release()
            view.release()
            out.write(b"\0" * (align_up(t.nbytes, alignment) - t.nbytes))
    progress.end()
    return meta


def edit_metadata(path: str | Path, *, set_text: Mapping[str, str] | None = None,
                  set_values: Mapping[str, Any] | None = None, types: Mapping[str, str] | None = None,
                  delete: Sequence[str] = (), rename: Mapping[str, str] | None = None,
                  output: str | Path | None = None, dry_run: bool = False,
                  slack_bytes: int = DEFAULT_SLACK_BYTES, progress: Progress | None = None) -> EditReport:
    """Edit the metadata of a GGUF file (shard 1 of a set), in place when safe, otherwise by rewriting.

    Args:
        path: the GGUF file, or any shard of a gguf-split set.
        set_text: key -> value as typed on a command line (``KEY=VALUE``), typed by the module rules.
        set_values: key -> JSON value (``--from-json``), typed by the same rules by JSON type.
        types: key -> type name (``u32``, ``array[str]``) for keys in ``set_text``/``set_values``.
        delete: keys to remove.
        rename: old key -> new key (position, type and value kept).
        output: write the result here instead of editing ``path`` (always a rewrite; ``path`` is untouched).
            The same file as ``path`` means editing in place.
        dry_run: compute the diff and the mode, write nothing.
        slack_bytes: size of the slack a rewrite leaves for the next in-place edit.
        progress: receives bytes copied during a rewrite.

    Returns:
        The report: mode, diff, slack before and after.

    Raises:
        GGUFFormatError: the file is malformed.
        MetadataKeyNotFoundError: a key to delete or rename does not exist.
        MetadataValueError: a value does not parse as its type, or a chat template does not parse.
        UsageError: conflicting requests, a managed key (``split.*``, ``ggufkit.slack``), or an ``output``
            in a folder that does not exist.
        OutputExistsError: ``output`` is a directory, or ``-o`` is used on a shard set.
    """
    src = Path(path)
    out_path = Path(output) if output is not None else None
    if out_path is not None and out_path.is_dir():
        raise OutputExistsError(f"output {out_path} is a directory")
    if out_path is not None and not out_path.parent.is_dir():
        raise UsageError(f"cannot write {out_path}: the folder {out_path.parent} does not exist (create it first)")
    if out_path is not None and out_path.exists() and os.path.samefile(out_path, src):
        out_path = None  # same file: an in-place edit, never a copy onto itself
    model = open_gguf(src)
    with model:
        f = model.files[0]
        if out_path is not None and len(model.files) > 1:
            raise OutputExistsError("-o/--output cannot write a shard set; edit the set in place (shard 1 holds "
                                    "the metadata) or copy it first")
        meta, changes = _apply(f, set_text=set_text or {}, set_values=set_values or {}, types=types or {},
                               delete=delete, rename=rename or {})
        target = out_path or f.path
        report = EditReport(str(f.path), str(target), "unchanged", dry_run, changes,
                            slack=(_slack_len(f.kv), _slack_len(f.kv)))
        if not changes and out_path is None:
            report.reason = "nothing to change"
            return report
        plan: tuple[int, bytes, Metadata] | str = "output is another file"
        if out_path is None:
            plan = _plan_in_place(f, meta)
        if isinstance(plan, tuple):
            offset, patch, final = plan
            report.mode, report.reason = "in_place", "the new header fits in place"
            report.slack = (report.slack[0], _slack_len(final))
            if not dry_run:
                remove_stale_temporaries(f.path)
                old = f.read_bytes(offset, offset + len(patch))
                model.close()
                _patch(f.path, offset, old, patch)
            return report
        report.mode, report.reason = "rewrite", plan
        if dry_run:
            report.slack = (report.slack[0], slack_bytes if slack_bytes > 0 else report.slack[0])
            return report
        remove_stale_temporaries(target)
        final = _rewrite(f, meta, target, slack_bytes, progress or NullProgress())
        report.slack = (report.slack[0], _slack_len(final))
    return report


__all__ = ["Change", "EditReport", "edit_metadata", "lint_chat_template", "load_json_edits", "parse_type"]
