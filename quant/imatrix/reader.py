"""Importance-matrix files as llama-quantize reads them: llama-imatrix's GGUF format and the legacy ``.dat``.

Both give, per weight tensor name, one f32 per column (and per expert for 3-D tensors): the mean squared
activation that the weighted quantizers (``quantize_*_impl``) use as ``quant_weights``. The files are read by
:mod:`~ggufkit.quant.imatrix.files` (common/imatrix-loader.cpp ``common_imatrix_load``); this module adds
quantize.cpp ``load_imatrix``'s arithmetic (tools/quantize/quantize.cpp):

- GGUF: value = ``in_sum2 / f32(lround(count))`` in f32, and 1.0 where the count is 0.
- legacy: value = ``values / f32(ncall)`` when ncall > 0, else the stored values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggufkit.errors import QuantizationError
from ggufkit.quant.imatrix.files import RawImatrix, read_imatrix_file

#: The keys llama-quantize adds to a file quantized with an imatrix (tools/quantize/quantize.cpp).
KEY_QUANTIZE_IMATRIX_FILE = "quantize.imatrix.file"
KEY_QUANTIZE_IMATRIX_DATASET = "quantize.imatrix.dataset"
KEY_QUANTIZE_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
KEY_QUANTIZE_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"


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
    raw = read_imatrix_file(path, require_keys=True)
    im = _normalise(raw, _sha256(path))
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


def _normalise(raw: RawImatrix, digest: str) -> Imatrix:
    if raw.is_legacy:
        entries = {name: _normalise_legacy(values, int(counts[0])) for name, (values, counts) in raw.entries.items()}
    else:
        entries = {name: _normalise_gguf(sums, counts) for name, (sums, counts) in raw.entries.items()}
    return Imatrix(raw.path, entries, raw.datasets, raw.chunk_count, raw.chunk_size, raw.is_legacy, digest)


def _normalise_legacy(values: np.ndarray, ncall: int) -> np.ndarray:
    # quantize.cpp load_imatrix: the stored values are mean * ncall; divided by (float) ncall when positive.
    return values / np.float32(ncall) if ncall > 0 else values


def _normalise_gguf(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    # common_imatrix_load stores lround(count) as int64 (the reader rounded them); quantize.cpp load_imatrix
    # divides each expert's sums by (float) of that count, and leaves 1s where it is 0.
    count_f32 = counts.astype(np.float32)
    grid = sums.reshape(counts.size, sums.size // counts.size)
    out = np.ones_like(grid)
    positive = count_f32 > 0
    out[positive] = grid[positive] / count_f32[positive, None]
    return out.reshape(-1)
