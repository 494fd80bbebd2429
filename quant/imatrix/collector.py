"""Importance-matrix accumulators as llama-imatrix keeps, combines and writes them (tools/imatrix/imatrix.cpp).

:mod:`ggufkit.quant.imatrix.reader` reads a file the way llama-quantize uses it (normalised means). This module keeps
the *raw* form llama-imatrix's ``IMatrixCollector`` holds: per weight name the float32 sums of squared input
activations (``[n_mat, n_per_row]``, one row per expert) and the int64 token counts (one per expert; one for
a dense weight), with the same loading, combining and saving rules:

- ``IMatrixCollector::load_imatrix``: GGUF sums and counts (counts rounded with ``lround``) are added as they
  are; a legacy ``.dat`` entry holds ``mean * ncall``, so its values and its count ``ncall`` are both
  multiplied by the chunk size before they are added. A dense entry combined with a per-expert one is
  broadcast; any other size difference is an error.
- ``save_imatrix`` (GGUF): keys ``general.type = "imatrix"``, ``imatrix.datasets``, ``imatrix.chunk_count``
  and ``imatrix.chunk_size``; per name in sorted order ``<name>.in_sum2`` (f32 ``ne = [n_per_row, n_mat]``)
  and ``<name>.counts`` (f32 ``ne = [1, n_mat]``); entries without data are written too.
- ``save_imatrix_legacy`` (``.dat``): entries whose counts are all zero are skipped; per entry
  ``ncall = ceil(max(counts) / chunk_size)`` and the values ``(sum / count) * ncall`` (1 where the count is 0),
  then the chunk count and one dataset name.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.errors import QuantizationError
from ggufkit.quant.imatrix.files import (
    KEY_CHUNK_COUNT,
    KEY_CHUNK_SIZE,
    KEY_DATASETS,
    SUFFIX_COUNTS,
    SUFFIX_SUMS,
    RawImatrix,
    read_imatrix_file,
)

#: ``general.type`` of an imatrix GGUF (imatrix.cpp: ``gguf_set_val_str(ctx_gguf, "general.type", "imatrix")``).
GENERAL_TYPE_IMATRIX = "imatrix"
_KEY_GENERAL_TYPE = "general.type"


def read_raw_imatrix(path: str | Path) -> RawImatrix:
    """Read an imatrix file in either format without normalising it (``common_imatrix_load``, through
    :func:`~ggufkit.quant.imatrix.files.read_imatrix_file`), refusing non-finite sums and negative counts.

    Raises:
        QuantizationError: malformed file, no entries, unpaired or non-F32 sums/counts, sizes that do not
            split into experts, or a non-finite value.
        OSError: it cannot be read.
    """
    path = Path(path)
    raw = read_imatrix_file(path)
    for name, (sums, counts) in raw.entries.items():
        if not np.isfinite(sums).all():
            raise QuantizationError(f"imatrix entry {name!r} contains a non-finite value", path=path)
        if (counts < 0).any():
            raise QuantizationError(f"imatrix entry {name!r} has a negative count", path=path)
    return raw


@dataclass
class ImatrixAccumulator:
    """llama-imatrix's collector state: raw sums and counts per weight name, the datasets seen.

    Attributes:
        chunk_size: tokens per chunk (``--ctx``); counts / chunk_size is the number of chunks.
        sums: name -> float32 ``[n_mat, n_per_row]`` sums of squared activations.
        counts: name -> int64 ``[n_mat]`` tokens (per expert: routed tokens) summed.
        datasets: dataset names of the loaded files, in load order.
    """

    chunk_size: int
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)

    @property
    def chunk_count(self) -> int:
        """llama-imatrix's ``m_last_chunk``: the largest count divided by the chunk size."""
        top = max((int(c.max()) for c in self.counts.values() if c.size), default=0)
        return top // self.chunk_size

    def load(self, path: str | Path) -> None:
        """Add a file's entries as ``IMatrixCollector::load_imatrix`` does.

        Raises:
            QuantizationError: the file is malformed, or an entry's size differs from what is held.
        """
        raw = read_raw_imatrix(path)
        for name, (values, counts) in raw.entries.items():
            if raw.is_legacy:
                # values hold mean * ncall and counts {ncall}: back to raw sums by the chunk size.
                if name not in self.sums:
                    self.sums[name] = np.zeros((1, values.size), np.float32)
                    self.counts[name] = np.zeros(1, np.int64)
                held = self.sums[name]
                if held.size != values.size:
                    raise QuantizationError(f"mismatched sums size for {name!r}: {values.size} != {held.size}",
                                            path=path)
                flat = held.reshape(-1)
                flat += values * np.float32(self.chunk_size)
                self.counts[name] += counts[0] * self.chunk_size
                continue
            n_mat = counts.size
            if name not in self.sums:
                self.sums[name] = np.zeros((n_mat, values.size // n_mat), np.float32)
                self.counts[name] = np.zeros(n_mat, np.int64)
            held = self.sums[name]
            if held.size != values.size:
                raise QuantizationError(f"mismatched sums size for {name!r}: {values.size} != {held.size}",
                                        path=path)
            if self.counts[name].size == 1 and n_mat > 1:
                self.counts[name] = np.full(n_mat, self.counts[name][0], np.int64)
            elif self.counts[name].size != n_mat:
                raise QuantizationError(f"mismatched counts size for {name!r}: {n_mat} != "
                                        f"{self.counts[name].size}", path=path)
            self.sums[name] = (held.reshape(-1) + values).reshape(n_mat, -1)
            self.counts[name] = self.counts[name] + counts
        self.datasets.extend(raw.datasets)

    def entry(self, name: str, n_mat: int, n_per_row: int) -> tuple[np.ndarray, np.ndarray]:
        """The (sums, counts) of ``name``, created empty, or QuantizationError if the held size differs."""
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, n_per_row), np.float32)
            self.counts[name] = np.zeros(1 if n_mat == 1 else n_mat, np.int64)
        sums = self.sums[name]
        if sums.size != n_mat * n_per_row:
            raise QuantizationError(f"imatrix entry {name!r} holds {sums.size} values, the model's tensor has "
                                    f"{n_mat * n_per_row} ({n_mat} x {n_per_row})")
        if sums.shape != (n_mat, n_per_row):
            self.sums[name] = sums.reshape(n_mat, n_per_row)
        counts = self.counts[name]
        if counts.size == 1 and n_mat > 1:  # a dense count loaded for a per-expert weight: broadcast
            self.counts[name] = np.full(n_mat, counts[0], np.int64)
        elif n_mat == 1 and counts.size > 1 and (counts == counts[0]).all():
            self.counts[name] = counts[:1].copy()  # one count per dense tensor (collect_imatrix)
        return self.sums[name], self.counts[name]

    # -- writing -----------------------------------------------------------------------------------
    def dataset_list(self, prompt_file: str | None) -> list[str]:
        return self.datasets + ([prompt_file] if prompt_file else [])

    def write_gguf(self, path: str | Path, prompt_file: str | None = None) -> Path:
        """Write llama-imatrix's GGUF format atomically (the bytes ``save_imatrix`` writes for the same data).

        Raises:
            QuantizationError: nothing to write.
        """
        from ggufkit.format import Metadata, TensorSpec, write_gguf
        from ggufkit.format.values import VT

        names = self._names(skip_empty=False)
        meta = Metadata()
        meta.set(_KEY_GENERAL_TYPE, VT.STRING, GENERAL_TYPE_IMATRIX)
        meta.set(KEY_DATASETS, VT.ARRAY, self.dataset_list(prompt_file), item_type=VT.STRING)
        meta.set(KEY_CHUNK_COUNT, VT.UINT32, self.chunk_count)
        meta.set(KEY_CHUNK_SIZE, VT.UINT32, self.chunk_size)
        specs, data = [], []
        f32 = GGMLQuantizationType.F32
        for name in names:
            sums, counts = self.sums[name], self.counts[name]
            n_mat = counts.size
            # ggml_new_tensor_2d(ne = [n_per_row, n_mat]) and [1, n_mat]; gguf stores ggml_n_dims dimensions,
            # so a dense entry (n_mat = 1) is written 1-D.
            specs.append(TensorSpec(name + SUFFIX_SUMS, f32, (n_mat, sums.size // n_mat) if n_mat > 1
                                    else (sums.size,)))
            specs.append(TensorSpec(name + SUFFIX_COUNTS, f32, (n_mat, 1) if n_mat > 1 else (1,)))
            data += [np.ascontiguousarray(sums, np.float32), counts.astype(np.float32)]
        return write_gguf(path, meta, specs, data, slack_bytes=0)[0]

    def write_dat(self, path: str | Path, prompt_file: str | None = None) -> Path:
        """Write the legacy ``.dat`` format atomically (``save_imatrix_legacy``).

        Raises:
            QuantizationError: every entry is empty.
        """
        from ggufkit.format.atomic import atomic_write

        names = self._names(skip_empty=True)
        parts = [struct.pack("<i", len(names))]
        for name in names:
            sums, counts = self.sums[name], self.counts[name]
            encoded = name.encode("utf-8")
            ncall = (int(counts.max()) + self.chunk_size - 1) // self.chunk_size
            per = sums.size // counts.size
            count_f = np.repeat(counts.astype(np.float32), per)
            value = sums.reshape(-1).copy()
            empty = count_f == 0
            value[empty], count_f[empty] = np.float32(1), np.float32(1)  # "store 1 for partial data"
            out = (value / count_f).astype(np.float32) * np.float32(ncall)
            parts += [struct.pack("<i", len(encoded)), encoded, struct.pack("<ii", ncall, sums.size),
                      out.astype("<f4").tobytes()]
        datasets = self.dataset_list(prompt_file)
        dataset = (prompt_file or (datasets[-1] if datasets else "")).encode("utf-8")
        parts += [struct.pack("<ii", self.chunk_count, len(dataset)), dataset]
        path = Path(path)
        with atomic_write(path) as (f,):
            f.write(b"".join(parts))
        return path

    def write(self, path: str | Path, fmt: str, prompt_file: str | None = None) -> Path:
        """:meth:`write_gguf` for ``fmt == "gguf"``, :meth:`write_dat` for ``"dat"``."""
        return self.write_gguf(path, prompt_file) if fmt == "gguf" else self.write_dat(path, prompt_file)

    def _names(self, skip_empty: bool) -> list[str]:
        names = sorted(n for n in self.sums if self.sums[n].size and self.counts[n].size
                       and not (skip_empty and not self.counts[n].any()))
        if not names:
            raise QuantizationError("the importance matrix has no entries with data")
        return names


def combine_files(paths: Iterable[str | Path], chunk_size: int) -> ImatrixAccumulator:
    """Load and add imatrix files as ``llama-imatrix --in-file a --in-file b`` does."""
    acc = ImatrixAccumulator(chunk_size)
    for p in paths:
        acc.load(p)
    return acc


# -- --show-statistics ------------------------------------------------------------------------------
_BLK = re.compile(r"blk\.(\d+)\.")


def _f32_sum(v: np.ndarray) -> np.float32:
    """``std::accumulate(..., 0.0f)``: a sequential float32 sum."""
    return np.float32(np.cumsum(v, dtype=np.float32)[-1]) if v.size else np.float32(0)


def _split_name(name: str) -> tuple[str, str]:
    """imatrix.cpp ``process_tensor_name``: (layer, tensor) from ``blk.N.<tensor>.weight``."""
    parts = name.split(".")
    layer = next((parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "blk"), "-")
    tensor = next((parts[i - 1] for i in range(1, len(parts)) if parts[i] == "weight"), name)
    return layer, tensor


def tensor_statistics(acc: ImatrixAccumulator) -> dict[str, Any]:
    """llama-imatrix ``--show-statistics``: per tensor and per layer (``compute_statistics``, ``compute_cossim``).

    Returns:
        ``{"tensors": [...], "layers": [...]}`` in llama-imatrix's print order.
    """
    rows = []
    for name in acc.sums:
        sums, counts = acc.sums[name].reshape(counts_len := acc.counts[name].size, -1), acc.counts[name]
        keep = counts != 0
        if not keep.any():
            continue
        act = (sums[keep] / counts[keep].astype(np.float32)[:, None]).astype(np.float32).reshape(-1)
        total = _f32_sum(act)
        n = act.size
        mean = np.float32(total / np.float32(n))
        var = np.float32(_f32_sum(act * act) / np.float32(n)) - mean * mean
        dev = np.float32(math.sqrt(max(0.0, float(var))))
        active = 1 - np.float32(int((np.abs(act) <= np.float32(1e-5)).sum())) / np.float32(n)
        entropy = np.float32(0)
        if total > 0:
            p = act / total
            p = p[p > 0]
            entropy = -_f32_sum((p * np.log2(p)).astype(np.float32))
        zd = np.float32(int(((act - mean) / dev > 1).sum())) / np.float32(n) if dev > 0 else np.float32(0)
        layer, tensor = _split_name(name)
        rows.append(dict(name=name, layer=layer, tensor=tensor, sum=float(total), min=float(act.min()),
                         max=float(act.max()), mean=float(mean), stddev=float(dev), active=float(active),
                         elements=n, entropy=float(entropy),
                         entropy_norm=float(100 * entropy / np.float32(math.log2(n))) if n > 1 else 0.0,
                         zd=float(zd), cossim=0.0, _values=sums.reshape(-1), _n_mat=counts_len))
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        m = _BLK.search(r["name"])
        if m is None:
            continue
        prev = by_name.get(r["name"][: m.start(1)] + str(int(m.group(1)) - 1) + r["name"][m.end(1):])
        if prev is not None:
            a, b = r["_values"], prev["_values"]
            dp = _f32_sum(a * b[: a.size]) if a.size == b.size else np.float32(0)
            r["cossim"] = float(dp / (np.float32(math.sqrt(_f32_sum(a * a))) * np.float32(math.sqrt(_f32_sum(b * b)))))
    rows.sort(key=lambda r: (r["tensor"], -r["sum"]))
    layers: dict[int, list[float]] = {}
    for r in rows:
        blk = int(r["layer"]) if r["layer"].isdigit() else -1
        w = layers.setdefault(blk, [0.0, 0.0, 0.0, 0])
        w[0] += r["elements"] * r["sum"]
        w[1] += r["elements"] * r["zd"]
        w[2] += r["elements"] * r["cossim"]
        w[3] += r["elements"]
    for r in rows:
        del r["_values"], r["_n_mat"]
    per_layer = [dict(layer=k, sum=v[0] / v[3], zd=v[1] / v[3], cossim=v[2] / v[3])
                 for k, v in sorted(layers.items()) if k >= 0 and v[3]]
    return {"tensors": rows, "layers": per_layer}
