"""Importance-matrix files as llama-quantize reads them: llama-imatrix's GGUF format and the legacy ``.dat``.

Both give, per weight tensor name, one f32 per column (and per expert for 3-D tensors): the mean squared
activation that the weighted quantizers (``quantize_*_impl``) use as ``quant_weights``. The arithmetic is
``common_imatrix_load`` + quantize.cpp ``load_imatrix`` (common/common.cpp, tools/quantize/quantize.cpp):

- GGUF: tensors ``<name>.in_sum2`` (f32 ``[n_experts, n_per_row]``) and ``<name>.counts`` (f32
  ``[n_experts, 1]``); value = ``in_sum2 / f32(lround(count))`` in f32, and 1.0 where the count is 0.
  Keys ``imatrix.datasets`` (string array), ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32).
- legacy: ``i32 n_entries``, then per entry ``i32 len, name bytes, i32 ncall, i32 nval, f32 values[nval]``,
  optionally ``i32 chunk_count, i32 len, dataset bytes``; value = ``values / f32(ncall)`` when ncall > 0.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggufkit.constants import GGUF_MAGIC
from ggufkit.errors import QuantizationError

KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"
#: The keys llama-quantize adds to a file quantized with an imatrix (tools/quantize/quantize.cpp).
KEY_QUANTIZE_IMATRIX_FILE = "quantize.imatrix.file"
KEY_QUANTIZE_IMATRIX_DATASET = "quantize.imatrix.dataset"
KEY_QUANTIZE_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
KEY_QUANTIZE_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"

#: Refuse legacy files claiming more entries or values than this (a corrupt count must not allocate GBs).
_MAX_LEGACY_ENTRIES = 1 << 20


@dataclass(frozen=True)
class Imatrix:
    """A loaded importance matrix.

    Attributes:
        path: the file it came from.
        entries: tensor name -> float32 values (``n_per_row`` per expert, experts back to back).
        datasets: dataset names recorded in the file.
        chunk_count: number of chunks it was computed on (0 when unknown).
        chunk_size: tokens per chunk (0 for legacy files).
        is_legacy: it was a legacy ``.dat`` file.
        sha256: hex digest of the file.
    """

    path: Path
    entries: dict[str, np.ndarray]
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0
    is_legacy: bool = False
    sha256: str = ""

    def sizes(self) -> dict[str, int]:
        """Name -> number of values, what :class:`ggufkit.quant.llama_quantize.plan.QuantOptions` needs."""
        return {k: int(v.size) for k, v in self.entries.items()}

    def for_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The values to use for tensor ``name`` of numpy-order ``shape``: ``[n_experts, n_per_row]``.

        None when there is no entry or (token_embd only) the size does not match, as in llama-quantize;
        the plan has already rejected a size mismatch on any other tensor.
        """
        values = self.entries.get(name)
        n_experts = shape[-3] if len(shape) >= 3 else 1
        if values is None or values.size != shape[-1] * n_experts:
            return None
        return values.reshape(n_experts, shape[-1])


def load_imatrix(path: str | Path) -> Imatrix:
    """Read an imatrix file in either format (a GGUF magic selects GGUF, anything else is legacy).

    Args:
        path: the ``.gguf`` or ``.dat`` file written by llama-imatrix.

    Returns:
        The entries with llama-quantize's normalisation applied.

    Raises:
        QuantizationError: the file is malformed, has no entries, lacks the GGUF imatrix keys, pairs a sums
            tensor with no counts (or the reverse), or holds a non-finite value.
        OSError: it cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    digest = _sha256(path)
    if magic == GGUF_MAGIC:
        im = _load_gguf(path, digest)
    else:
        im = _load_legacy(path, digest)
    for name, values in im.entries.items():
        if not np.isfinite(values).all():
            raise QuantizationError(f"imatrix entry {name!r} contains a non-finite value", path=path)
    return im


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_gguf(path: Path, digest: str) -> Imatrix:
    # One GGUF imatrix parser (ggufkit.quant.imatrix.collector); here only llama-quantize's normalisation is added.
    from ggufkit.quant.imatrix.collector import _read_gguf

    raw = _read_gguf(path, require_keys=True)
    entries = {name: _normalise_gguf(sums, counts) for name, (sums, counts) in raw.entries.items()}
    return Imatrix(path, entries, raw.datasets, raw.chunk_count, raw.chunk_size, False, digest)


def _normalise_gguf(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    # common_imatrix_load stores lround(count) as int64 (the reader rounded them); quantize.cpp load_imatrix
    # divides each expert's sums by (float) of that count, and leaves 1s where it is 0.
    count_f32 = counts.astype(np.float32)
    grid = sums.reshape(counts.size, sums.size // counts.size)
    out = np.ones_like(grid)
    positive = count_f32 > 0
    out[positive] = grid[positive] / count_f32[positive, None]
    return out.reshape(-1)


def _load_legacy(path: Path, digest: str) -> Imatrix:
    data = path.read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise QuantizationError(f"legacy imatrix truncated at byte {pos} while reading {what}", path=path)
        chunk = data[pos:pos + n]
        pos += n
        return chunk

    def i32(what: str) -> int:
        return int(struct.unpack("<i", take(4, what))[0])

    n_entries = i32("the entry count")
    if n_entries < 1 or n_entries > _MAX_LEGACY_ENTRIES:
        raise QuantizationError(f"legacy imatrix has {n_entries} entries: not an imatrix file?", path=path)
    entries: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        length = i32(f"the name length of entry {i + 1}")
        raw_name = take(length, f"the name of entry {i + 1}")
        # The C reader builds std::string from a NUL-terminated buffer: the name stops at the first NUL.
        name = raw_name.split(b"\0", 1)[0].decode("utf-8", errors="replace")
        ncall = i32(f"the call count of entry {i + 1}")
        nval = i32(f"the value count of entry {i + 1}")
        if nval < 1:
            raise QuantizationError(f"legacy imatrix entry {i + 1} ({name!r}) has {nval} values", path=path)
        values = np.frombuffer(take(4 * nval, f"the values of {name!r}"), dtype="<f4").astype(np.float32)
        if ncall > 0:
            values = values / np.float32(ncall)
        entries[name] = values
    chunk_count = 0
    datasets: tuple[str, ...] = ()
    if pos + 4 <= len(data):
        chunk_count = i32("the chunk count")
        if pos + 4 <= len(data):
            length = i32("the dataset name length")
            if 0 < length <= len(data) - pos:
                datasets = (take(length, "the dataset name").split(b"\0", 1)[0].decode("utf-8", "replace"),)
    return Imatrix(path, entries, datasets, chunk_count, 0, True, digest)
