"""Per-tensor error of each candidate type, measured with ggufkit's byte-exact quantizers, and its cache.

For one tensor ``W`` (rows ``w_r``), one candidate type ``t`` and the importance matrix ``a`` of that tensor
(llama-imatrix's mean squared activation of each input column; all ones without one), the measurement is

    sse(t)    = sum_r sum_j a_j * (w_rj - deq(quant_t(w_r))_j)^2      (imatrix-weighted squared error)
    energy    = sum_r sum_j a_j * w_rj^2

over a sample of evenly spaced rows (all rows of small tensors), scaled to the whole tensor. ``quant_t`` is
exactly what llama-quantize would write for those rows (same kernels, same imatrix slice), so the proxy
sees the real effect of the type, not a model of it. With the diagonal approximation of ``E[a a^T]``,
``sse`` is the expected squared error the tensor adds to its matmul's output and ``sse / energy`` that
output's noise-to-signal ratio (PR 15550 of llama.cpp, ``--target-bpw``, uses the same imatrix-weighted
row-sample error).

Measurements are cached in one JSON file per (model hash, imatrix hash, sample size) under
``~/.cache/ggufkit/target`` (or ``cache_dir``), rewritten at most every :data:`SAVE_EVERY_S` seconds and when
the search ends or is interrupted, so a second target on the same inputs measures nothing twice and a
killed search started again loses at most those seconds.

Cost: the grid types (IQ1/IQ2/IQ3) cost several times the others per row; they are measured on a quarter of
the sampled rows (:data:`GRID_SAMPLE_DIVISOR`), which cut the cold search's CPU time ~2.5x on a 1.1B LLaMA
(``benchmarks/bench_quantize_target_scale.py``). The kernels do not release the GIL (``numba.njit`` without
``nogil``) and already split each call's rows over ``threads``, so tensors are measured one after another.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.format.reader import GGUFModel, TensorInfo
from ggufkit.quant.imatrix.reader import Imatrix
from ggufkit.quant.registry import FLOAT_TYPES, GRID_TYPES

QT = GGMLQuantizationType

#: Bump when the measurement changes meaning: old cache files are then ignored. 2: the grid types on a
#: quarter of the sampled rows (:data:`GRID_SAMPLE_DIVISOR`), sums in another order.
MEASURE_VERSION = 2
#: Rows sampled per tensor (per expert for 3-D tensors) by default.
DEFAULT_SAMPLE_ROWS = 256
#: The grid types (:data:`ggufkit.quant.registry.GRID_TYPES`, ~80 % of a search's measurement when all five
#: IQ2/IQ3 candidates are offered) are measured on every this-many-th sampled row (64 of 256 by default).
GRID_SAMPLE_DIVISOR = 4
#: The cache file is rewritten at most this often (and when the search ends or is interrupted).
SAVE_EVERY_S = 10.0


def default_cache_dir() -> Path:
    """``$GGUFKIT_CACHE/target`` or ``~/.cache/ggufkit/target``."""
    root = os.environ.get("GGUFKIT_CACHE")
    return Path(root) / "target" if root else Path.home() / ".cache" / "ggufkit" / "target"


def file_sha256(paths: Sequence[Path]) -> str:
    """SHA-256 over the bytes of ``paths`` in order (the model's shards)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Measurement:
    """Weighted squared error ``sse`` of one tensor in one type, and the tensor's weighted ``energy``."""

    sse: float
    energy: float

    @property
    def relative(self) -> float:
        """``sse / energy``: the noise-to-signal ratio of the tensor's output."""
        return self.sse / self.energy if self.energy > 0 else 0.0


class MeasureCache:
    """The measurements of one (model, imatrix, sample size): ``tensor -> type name -> [sse, energy]``.

    Args:
        directory: where cache files live.
        key: the identity of the inputs (see :func:`cache_key`).
    """

    def __init__(self, directory: Path, key: str) -> None:
        self.path = directory / f"{key}.json"
        self.data: dict[str, dict[str, list[float]]] = {}
        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict) and loaded.get("version") == MEASURE_VERSION:
                self.data = loaded.get("tensors", {})
        except (OSError, ValueError):
            pass  # no cache yet, or a damaged one: measure again

    def get(self, tensor: str, t: GGMLQuantizationType) -> Measurement | None:
        v = self.data.get(tensor, {}).get(t.name)
        return Measurement(v[0], v[1]) if v else None

    def put(self, tensor: str, t: GGMLQuantizationType, m: Measurement) -> None:
        self.data.setdefault(tensor, {})[t.name] = [m.sse, m.energy]

    def save(self) -> None:
        save_json_cache(self.path, {"version": MEASURE_VERSION, "tensors": self.data})


def save_json_cache(path: Path, obj: Any) -> None:
    """Write a measurement cache atomically (a temporary file in the same directory, then renamed), so a
    killed search leaves the previous cache or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_key(model_sha256: str, imatrix_sha256: str | None, sample_rows: int, text_sha256: str = "") -> str:
    """The cache file's name: (model hash, imatrix hash, calibration-text hash, sample size, version)."""
    ident = f"{model_sha256}|{imatrix_sha256 or '-'}|{text_sha256 or '-'}|{sample_rows}|v{MEASURE_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _rows_as_f32(model: GGUFModel, info: TensorInfo, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (flat row indices) of ``info`` as float32 ``[len(rows), ne0]``."""
    from ggufkit.quant import dequantize

    data = model.files[info.shard].data(info)
    n_per_row = info.ne[0]
    flat = data.reshape(-1, data.shape[-1])[rows]
    if info.ggml_type == QT.F32:
        return np.asarray(flat, dtype=np.float32)
    if info.ggml_type == QT.F16:
        return np.asarray(flat).astype(np.float32)
    if info.ggml_type == QT.BF16:
        return (np.asarray(flat).astype(np.uint32) << 16).view(np.float32)
    return dequantize(np.ascontiguousarray(flat), info.ggml_type, (len(rows), n_per_row))


def sample_rows(n_rows: int, rows_per_expert: int, per_expert: int) -> np.ndarray:
    """Evenly spaced row indices: ``per_expert`` from each expert's block of ``rows_per_expert`` rows."""
    out = []
    for start in range(0, n_rows, rows_per_expert):
        n = min(rows_per_expert, n_rows - start)
        k = min(n, per_expert)
        out.append(start + np.unique(np.linspace(0, n - 1, k).round().astype(np.int64)))
    return np.concatenate(out)


def _weighted_sse(x64: np.ndarray, y: np.ndarray, a: np.ndarray) -> float:
    """``sum_r sum_j a_j (x_rj - y_rj)^2`` in float64 (columns summed first: one temporary, not three)."""
    d = x64 - y
    d *= d
    return float(d.sum(axis=0) @ a)


def measure_tensor(model: GGUFModel, info: TensorInfo, types: Sequence[GGMLQuantizationType],
                   weights: np.ndarray | None, n_sample: int, threads: int | None = None) -> dict[
                       GGMLQuantizationType, Measurement]:
    """Measure ``types`` on one tensor, all from one read of its sampled rows.

    Every type but the grid types is measured on the same ``n_sample`` rows per expert (so the differences
    between types, which decide the tensor's hull, see the same weights); the grid types
    (:data:`~ggufkit.quant.registry.GRID_TYPES`) on every :data:`GRID_SAMPLE_DIVISOR`-th of those rows,
    their ``sse`` being the subsample's ``sse / energy`` times the full sample's energy. The result of one type
    does not depend on which other types are measured with it, nor on ``threads`` (the kernels' bytes do not;
    the sums run in a fixed order).

    Args:
        model: the open input model.
        info: the tensor.
        types: candidate types (rows must be whole blocks of each).
        weights: ``[n_experts, ne0]`` imatrix values used both to quantize (as llama-quantize does) and to
            weight the error; None: unweighted quantization and error.
        n_sample: rows sampled per expert.
        threads: kernel threads.
    """
    from ggufkit.quant import dequantize, quantize

    ne0 = info.ne[0]
    n_rows = info.n_elements // ne0
    rows_per_expert = info.ne[1] if len(info.ne) >= 3 else n_rows
    rows = sample_rows(n_rows, rows_per_expert, n_sample)
    x = _rows_as_f32(model, info, rows)
    expert = rows // rows_per_expert
    scale = n_rows / len(rows)
    a = np.ones((1, ne0), dtype=np.float64) if weights is None else weights.astype(np.float64)
    # per expert: its rows (float32 for the kernels, float64 for the error), the subsample of the grid
    # types (every GRID_SAMPLE_DIVISOR-th row of the expert's sample), the weights, the energies
    groups = []
    energy = energy_sub = 0.0
    for e in np.unique(expert):
        xe = np.ascontiguousarray(x[expert == e])
        ae = a[min(int(e), a.shape[0] - 1)]
        qw = None if weights is None else np.ascontiguousarray(weights[int(e)], dtype=np.float32)
        sub = np.ascontiguousarray(xe[::GRID_SAMPLE_DIVISOR])
        x64, s64 = xe.astype(np.float64), sub.astype(np.float64)
        energy += float((x64 * x64).sum(axis=0) @ ae)
        energy_sub += float((s64 * s64).sum(axis=0) @ ae)
        groups.append((xe, x64, sub, s64, ae, qw))
    out: dict[GGMLQuantizationType, Measurement] = {}
    for t in types:
        grid = t in GRID_TYPES and GRID_SAMPLE_DIVISOR > 1
        sse = 0.0
        for xe, x64, sub, s64, ae, qw in groups:
            xs, xs64 = (sub, s64) if grid else (xe, x64)
            q = quantize(xs, t, imatrix=None if t in FLOAT_TYPES else qw, device="cpu", threads=threads,
                         name=info.name)
            y = dequantize(np.ascontiguousarray(q).view(np.uint8), t, xs.shape)
            sse += _weighted_sse(xs64, y, ae)
        if grid:
            sse = sse / energy_sub * energy if energy_sub > 0 else 0.0
        out[t] = Measurement(sse * scale, energy * scale)
    return out


def measure_all(model: GGUFModel, wanted: Mapping[str, Sequence[GGMLQuantizationType]], im: Imatrix | None,
                used_imatrix: Mapping[str, bool], cache: MeasureCache, n_sample: int, threads: int | None = None,
                on_tensor: Callable[[str], Any] | None = None) -> tuple[dict[str, dict[GGMLQuantizationType,
                                                                                  Measurement]], int, int]:
    """Measurements for every (tensor, type) in ``wanted``, from the cache where present.

    Returns:
        ``(measurements, n_measured, n_cached)``: tensor -> type -> :class:`Measurement`, and how many
        (tensor, type) pairs were measured now and how many came from the cache.
    """
    result: dict[str, dict[GGMLQuantizationType, Measurement]] = {}
    n_measured = n_cached = 0
    unsaved = False
    last_save = time.monotonic()
    try:
        for name, types in wanted.items():
            have = {t: m for t in types if (m := cache.get(name, t)) is not None}
            todo = [t for t in types if t not in have]
            n_cached += len(have)
            if todo:
                info = model[name]
                w = im.for_tensor(name, info.shape) if (im is not None and used_imatrix.get(name)) else None
                have.update(measure_tensor(model, info, todo, w, n_sample, threads))
                for t in todo:
                    cache.put(name, t, have[t])
                unsaved = True
                n_measured += len(todo)
                # the whole file is rewritten: once per tensor would be O(tensors^2) bytes on a large model
                if time.monotonic() - last_save >= SAVE_EVERY_S:
                    cache.save()
                    unsaved, last_save = False, time.monotonic()
            result[name] = have
            if on_tensor is not None:
                on_tensor(name)
    finally:
        if unsaved:  # also when interrupted: a search started again resumes from here
            cache.save()
    return result, n_measured, n_cached
