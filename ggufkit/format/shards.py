"""gguf-split shard sets: names and keys, and opening a model (one file, or a whole set) as one object
above the single-file reader.

llama.cpp's layout (src/llama.cpp: llama_split_path, tools/gguf-split): ``NAME-00001-of-0000N.gguf`` ... ; shard 1 holds all
metadata plus ``split.no`` (u16, 0-based), ``split.count`` (u16) and ``split.tensors.count`` (i32, the
total); the other shards hold only those three keys and their tensors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gguf import Keys

from ggufkit.errors import GGUFFormatError
from ggufkit.format.reader import GGUFFile, GGUFModel
from ggufkit.format.values import VT

SPLIT_NO = Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS_COUNT = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)
#: Expected value types of the split keys (the loader checks them).
SPLIT_KEY_TYPES = {SPLIT_NO: VT.UINT16, SPLIT_COUNT: VT.UINT16, SPLIT_TENSORS_COUNT: VT.INT32}

_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_path(base: Path, index: int, count: int) -> Path:
    """Path of shard ``index`` (0-based) of ``count`` for an output named ``base`` (suffix replaced)."""
    stem = base.name[:-5] if base.name.endswith(".gguf") else base.name
    return base.with_name(f"{stem}-{index + 1:05d}-of-{count:05d}.gguf")


def shard_prefix(path: Path) -> tuple[Path, int, int] | None:
    """(``path`` of the set's name without the shard suffix, 0-based index, count), or None."""
    m = _SHARD_RE.match(path.name)
    if m is None:
        return None
    return path.with_name(m["prefix"]), int(m["no"]) - 1, int(m["count"])


def _split_value(f: GGUFFile, key: str) -> int:
    field = f.kv[key]
    if field.type != SPLIT_KEY_TYPES[key]:
        raise GGUFFormatError(f"{key} has type {field.type_label}, expected "
                              f"{'u16' if SPLIT_KEY_TYPES[key] == VT.UINT16 else 'i32'}",
                              path=f.path, offset=field.offset)
    return int(field.value)


def open_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open a GGUF model: one file, or a whole gguf-split set when ``path`` is one of its shards (every shard
    opened, its split keys checked against the set).

    Raises:
        GGUFFormatError: a file is malformed, or the shard set is incomplete or inconsistent.
    """
    return _open_set(Path(path))


def _open_set(path: Path) -> GGUFModel:
    first = GGUFFile(path)
    if SPLIT_COUNT not in first.kv:
        return GGUFModel([first])
    count = _split_value(first, SPLIT_COUNT)
    if count <= 1:
        return GGUFModel([first])
    parsed = shard_prefix(path)
    if parsed is None:
        first.close()
        raise GGUFFormatError(f"file declares {SPLIT_COUNT}={count} but its name does not follow "
                              "NAME-00001-of-0000N.gguf", path=path)
    prefix, index, name_count = parsed
    if name_count != count:
        first.close()
        raise GGUFFormatError(f"file name says {name_count} shards, {SPLIT_COUNT} says {count}", path=path)
    files: list[GGUFFile] = []
    try:
        for i in range(count):
            p = path if i == index else shard_path(prefix.with_name(prefix.name + ".gguf"), i, count)
            if not p.exists():
                raise GGUFFormatError(f"shard {i + 1} of {count} is missing: {p.name}", path=path)
            f = first if i == index else GGUFFile(p)
            files.append(f)
            for key in SPLIT_KEYS:
                if key not in f.kv:
                    raise GGUFFormatError(f"shard lacks {key}", path=p)
            if _split_value(f, SPLIT_NO) != i:
                raise GGUFFormatError(f"{SPLIT_NO} is {_split_value(f, SPLIT_NO)}, expected {i}", path=p)
            if _split_value(f, SPLIT_COUNT) != count:
                raise GGUFFormatError(f"{SPLIT_COUNT} is {_split_value(f, SPLIT_COUNT)}, expected {count}", path=p)
        model = GGUFModel(files)
    except BaseException:
        for f in files:
            f.close()
        if first not in files:
            first.close()
        raise
    declared = _split_value(files[0], SPLIT_TENSORS_COUNT)
    total = sum(len(f.tensors) for f in files)
    names = sum(len(set(t.name for t in f.tensors)) for f in files)
    if len(model) != names:
        model.close()
        raise GGUFFormatError("a tensor name appears in more than one shard", path=files[0].path)
    if declared != total:
        model.close()
        raise GGUFFormatError(f"{SPLIT_TENSORS_COUNT} is {declared} but the shards hold {total} tensors",
                              path=files[0].path)
    return model
