"""The two imatrix file formats as stored, read once for both users (common/imatrix-loader.cpp
``common_imatrix_load``, which llama-quantize's ``load_imatrix`` and llama-imatrix's
``IMatrixCollector::load_imatrix`` both call):

- GGUF: tensors ``<name>.in_sum2`` (f32 ``[n_experts, n_per_row]``) and ``<name>.counts`` (f32
  ``[n_experts, 1]``), counts rounded with ``lround``; keys ``imatrix.datasets`` (string array),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32).
- legacy ``.dat`` (``common_imatrix_load_legacy``): ``i32 n_entries``, then per entry ``i32 len, name bytes,
  i32 ncall, i32 nval, f32 values[nval]`` (values hold ``mean * ncall``), then optional trailing data:
  ``i32 chunk_count, i32 len, dataset bytes``.

:mod:`~ggufkit.quant.imatrix.reader` normalises the raw entries as llama-quantize uses them;
:mod:`~ggufkit.quant.imatrix.collector` adds them up as llama-imatrix does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.constants import GGUF_MAGIC
from ggufkit.errors import GGUFFormatError, QuantizationError

KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"

#: Refuse legacy files claiming more entries than this (a corrupt count must not allocate GBs).
_MAX_LEGACY_ENTRIES = 1 << 20


@dataclass(frozen=True)
class RawImatrix:
    """One imatrix file as stored: ``entries`` name -> (float32 sums, int64 counts), both flat.

    Attributes:
        path: the file.
        entries: GGUF: the sums and the ``lround``-ed counts (one per expert); legacy: the stored values
            (``mean * ncall``) and ``[ncall]``.
        datasets: dataset names recorded in the file.
        chunk_count: chunks it was computed on (0 when the file does not say).
        chunk_size: tokens per chunk (0 for legacy files).
        is_legacy: it was a legacy ``.dat`` file.
    """

    path: Path
    entries: dict[str, tuple[np.ndarray, np.ndarray]]
    datasets: tuple[str, ...]
    chunk_count: int
    chunk_size: int
    is_legacy: bool


def read_imatrix_file(path: str | Path, *, require_keys: bool = False) -> RawImatrix:
    """Read an imatrix file in either format without normalising it (a GGUF magic selects GGUF, anything
    else is legacy, as ``common_imatrix_load`` falls back to the legacy reader).

    Args:
        path: the ``.gguf`` or ``.dat`` file.
        require_keys: refuse a GGUF file without llama-imatrix's three metadata keys (llama-quantize's
            ``load_imatrix`` needs them; llama-imatrix does not).

    Raises:
        QuantizationError: malformed file, no entries, unpaired or non-F32 sums/counts, sizes that do not
            split into experts.
        OSError: it cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    return read_gguf(path, require_keys=require_keys) if magic == GGUF_MAGIC else read_legacy(path)


def read_gguf(path: Path, *, require_keys: bool = False) -> RawImatrix:
    """Entries of a GGUF imatrix (counts rounded as ``common_imatrix_load`` does); see
    :func:`read_imatrix_file`."""
    from ggufkit.format import open_gguf
    from ggufkit.format.values import VT

    try:
        model = open_gguf(path)
    except GGUFFormatError as exc:
        raise QuantizationError(f"not a valid GGUF imatrix: {exc.message}", path=path) from None
    with model:
        if not model.tensors:
            raise QuantizationError("the imatrix has no entries", path=path)
        missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in model.kv]
        if require_keys and missing:
            raise QuantizationError(f"missing imatrix metadata {', '.join(missing)}: not written by llama-imatrix?",
                                    path=path)
        datasets: tuple[str, ...] = ()
        ds = model.kv.get(KEY_DATASETS)
        if ds is not None and ds.type == VT.ARRAY and ds.item_type == VT.STRING:
            datasets = tuple(ds.value)
        chunk_count, chunk_size = (_u32(model.kv.get(k), k, path) for k in (KEY_CHUNK_COUNT, KEY_CHUNK_SIZE))
        pairs: dict[str, list[Any]] = {}
        for t in model.tensors:
            for slot, suffix in enumerate((SUFFIX_SUMS, SUFFIX_COUNTS)):
                if t.name.endswith(suffix) and len(t.name) > len(suffix):
                    pairs.setdefault(t.name[: -len(suffix)], [None, None])[slot] = t
        entries: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in sorted(pairs):
            s_info, c_info = pairs[name]
            if s_info is None or c_info is None:
                raise QuantizationError(f"mismatched sums and counts for {name!r}", path=path)
            if s_info.ggml_type != GGMLQuantizationType.F32 or c_info.ggml_type != GGMLQuantizationType.F32:
                raise QuantizationError(f"sums and counts for {name!r} must be F32", path=path)
            sums = np.array(model.data(s_info), dtype=np.float32).reshape(-1)
            counts_f = np.array(model.data(c_info), dtype=np.float32).reshape(-1)
            if counts_f.size == 0 or sums.size % counts_f.size:
                raise QuantizationError(f"{name!r}: {sums.size} sums do not split into {counts_f.size} experts",
                                        path=path)
            if not np.isfinite(counts_f).all() or (np.abs(counts_f) > 2.0**62).any():
                raise QuantizationError(f"imatrix entry {name!r} has an invalid count", path=path)
            c64 = counts_f.astype(np.float64)  # std::lround: half away from zero
            counts = np.where(c64 >= 0, np.floor(c64 + 0.5), np.ceil(c64 - 0.5)).astype(np.int64)
            entries[name] = (sums, counts)
    return RawImatrix(path, entries, datasets, chunk_count, chunk_size, False)


def _u32(field_: Any, key: str, path: Path) -> int:
    if field_ is None:
        return 0
    value = getattr(field_, "value", None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantizationError(f"imatrix key {key} must be an integer", path=path)
    return value


def read_legacy(path: Path) -> RawImatrix:
    """Entries of a legacy ``.dat`` imatrix, read as ``common_imatrix_load_legacy`` reads them; see
    :func:`read_imatrix_file`.

    The trailing data is optional and read as the C++ ``std::ifstream`` does: any byte after the last entry
    starts the chunk count; an ``in.read`` that hits the end of the file keeps the bytes it got (1 to 3 bytes
    give a chunk count of those bytes, little-endian) and fails, and a failed read ends the trailing data.
    The dataset name is kept only when its length is positive and all its bytes are there; it ends at its
    first NUL (the C reader builds a ``std::string`` from the buffer). Bytes after it are ignored.
    """
    data = path.read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise QuantizationError(f"legacy imatrix truncated at byte {pos} while reading {what}", path=path)
        pos += n
        return data[pos - n:pos]

    def i32(what: str) -> int:
        return int(struct.unpack("<i", take(4, what))[0])

    n_entries = i32("the entry count")
    if n_entries < 1 or n_entries > _MAX_LEGACY_ENTRIES:
        raise QuantizationError(f"legacy imatrix has {n_entries} entries: not an imatrix file?", path=path)
    entries: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(n_entries):
        raw_name = take(i32(f"the name length of entry {i + 1}"), f"the name of entry {i + 1}")
        # The C reader builds std::string from a NUL-terminated buffer: the name stops at the first NUL.
        name = raw_name.split(b"\0", 1)[0].decode("utf-8", errors="replace")
        ncall = i32(f"the call count of entry {i + 1}")
        nval = i32(f"the value count of entry {i + 1}")
        if nval < 1:
            raise QuantizationError(f"legacy imatrix entry {i + 1} ({name!r}) has {nval} values", path=path)
        values = np.frombuffer(take(4 * nval, f"the values of {name!r}"), dtype="<f4").astype(np.float32)
        entries[name] = (values, np.array([ncall], dtype=np.int64))
    chunk_count = 0
    datasets: tuple[str, ...] = ()
    if pos < len(data):  # in.peek() != EOF
        got = data[pos:pos + 4]
        pos += len(got)
        chunk_count = int.from_bytes(got.ljust(4, b"\0"), "little", signed=True)  # n_calls starts at 0
        if len(got) == 4 and pos + 4 <= len(data):
            length = i32("the dataset name length")
            if 0 < length <= len(data) - pos:
                datasets = (take(length, "the dataset name").split(b"\0", 1)[0].decode("utf-8", "replace"),)
    return RawImatrix(path, entries, datasets, chunk_count, 0, True)
