"""Grid, map and neighbour tables of ggml's grid quantizers (IQ1_S/IQ1_M, IQ2_XXS/XS/S, IQ3_XXS/S).

The grid points themselves are data: they are taken from ``gguf.quants`` (gguf-py embeds each type's grid
for its dequantizers: ``grid_hex`` packed indices into ``grid_map``), never retyped here. From them this
module derives what ggml derives at ``ggml_quantize_init`` time (ggml-quants.c: ``iq2xs_init_impl`` for the
8-wide grids, ``iq3xs_init_impl`` for the 4-wide ones):

* ``kgrid``: each point as its packed index, ``sum(l_i << bits*i)`` with ``l_i`` the level of element i
  (ggml's ``kgrid_2bit_256``, ``kgrid_1bit_2048``, ``kgrid_256``, ...);
* ``qgrid``: int8[G, E], each element as ``2*l + 1`` (ggml's ``the_grid`` bytes);
* ``kmap``: int32[4^8 or 8^4-ish], packed index -> grid index, or ``-(offset + 1)`` into ``neighbours``
  for points not on the grid;
* ``neighbours``: uint16, per off-grid point a count followed by the grid indices whose squared distance
  is among the ``nwant`` smallest distinct distances, ordered by (distance, index) as ggml's ``qsort``
  with ``iq2_compare_func`` orders them;
* ``dgrid``: the dequantization values (``iq2xxs_grid`` etc. as float32[G, E]).

Everything is built once per process on first use (:func:`iq_tables`), deterministically; building the
IQ1 neighbour lists (41k off-grid points x 2048 grid points) takes well under a second.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numba
import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

T = GGMLQuantizationType


class IQTables(NamedTuple):
    """The tables of one grid (see the module docstring)."""

    kgrid: np.ndarray  # uint16[G]
    qgrid: np.ndarray  # int8[G, E]
    kmap: np.ndarray  # int32[kmap_size]
    neighbours: np.ndarray  # uint16[...]
    dgrid: np.ndarray  # float32[G, E]


class NeighbourLanes(NamedTuple):
    """The neighbour lists of :class:`IQTables` laid out for searches that evaluate a list's candidates
    side by side: list ``p`` (an off-grid packed index) has ``n_cand[p]`` candidates in lanes
    ``start[p] .. start[p] + pad[p]`` (``pad`` rounds the count up to a multiple of 8; the extra lanes
    repeat the last candidate), ``grid_index[lane]`` is the grid index of a lane and element ``i`` of lane
    ``start[p] + j`` is ``qgrid[grid_index, i]`` as float32 at ``values[E*start[p] + i*pad[p] + j]``."""

    start: np.ndarray  # int32[kmap_size] (-1 for points on the grid)
    n_cand: np.ndarray  # int32[kmap_size]
    pad: np.ndarray  # int32[kmap_size]
    grid_index: np.ndarray  # int32[lanes]
    values: np.ndarray  # float32[E * lanes]


# ggml-quants.c: iq2xs_init_impl (nwant per type, kmap_size 43692) and iq3xs_init_impl (kmap_size 4096).
_IQ2_KMAP_SIZE = 43692
_IQ3_KMAP_SIZE = 4096
# grid owner in gguf.quants (IQ1_M shares IQ1_S's grid), bits per element, nwant
_SPEC: dict[GGMLQuantizationType, tuple[type, int, int]] = {
    T.IQ2_XXS: (gguf_quants.IQ2_XXS, 2, 2),
    T.IQ2_XS: (gguf_quants.IQ2_XS, 2, 2),
    T.IQ2_S: (gguf_quants.IQ2_S, 2, 1),
    T.IQ1_S: (gguf_quants.IQ1_S, 2, 3),
    T.IQ1_M: (gguf_quants.IQ1_S, 2, 3),
    T.IQ3_XXS: (gguf_quants.IQ3_XXS, 3, 2),
    T.IQ3_S: (gguf_quants.IQ3_S, 3, 3),
}


def ksigns_iq2xs() -> np.ndarray:
    """ggml's ``ksigns_iq2xs``: uint8[128], the 7 stored sign bits plus the parity bit (from gguf-py)."""
    return np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()


def _levels(owner: type) -> tuple[np.ndarray, np.ndarray]:
    """(levels int[G, E], values float32[G, E]) of a gguf-py grid: the level of each element is its value's
    position in ``grid_map``."""
    owner.init_grid()  # type: ignore[attr-defined]
    grid = np.asarray(owner.grid, dtype=np.float32).reshape(owner.grid_shape)  # type: ignore[attr-defined]
    gmap = np.asarray(owner.grid_map, dtype=np.float32)  # type: ignore[attr-defined]
    levels = np.argmax(grid[..., None] == gmap, axis=-1)
    if not np.array_equal(gmap[levels], grid):
        raise AssertionError(f"{owner.__name__}: grid value outside grid_map")
    return levels.astype(np.int64), grid.copy()


@numba.njit(cache=True, fastmath=False)
def _neighbour_counts(qgrid: np.ndarray, kmap: np.ndarray, bits: int, nwant: int, counts: np.ndarray) -> None:
    """Pass 1 of ggml's neighbour search: how many neighbours each off-grid point gets."""
    n_grid, n_el = qgrid.shape
    d2 = np.empty(n_grid, np.int64)
    pos = np.empty(n_el, np.int64)
    mask = (1 << bits) - 1
    for i in range(kmap.size):
        counts[i] = 0
        if kmap[i] >= 0:
            continue
        for k in range(n_el):
            pos[k] = 2 * ((i >> (bits * k)) & mask) + 1
        for j in range(n_grid):
            s = 0
            for k in range(n_el):
                t = np.int64(qgrid[j, k]) - pos[k]
                s += t * t
            d2[j] = s
        # the nwant smallest distinct distances; every point at one of them is a neighbour
        last = -1
        n = 0
        for _ in range(nwant):
            best = -1
            for j in range(n_grid):
                if d2[j] > last and (best < 0 or d2[j] < best):
                    best = d2[j]
            if best < 0:
                break
            for j in range(n_grid):
                if d2[j] == best:
                    n += 1
            last = best
        counts[i] = n


@numba.njit(cache=True, fastmath=False)
def _neighbour_fill(qgrid: np.ndarray, kmap: np.ndarray, bits: int, nwant: int, offsets: np.ndarray,
                    neighbours: np.ndarray) -> None:
    """Pass 2: write each off-grid point's list (count, then indices by (distance, index))."""
    n_grid, n_el = qgrid.shape
    d2 = np.empty(n_grid, np.int64)
    pos = np.empty(n_el, np.int64)
    mask = (1 << bits) - 1
    for i in range(kmap.size):
        if kmap[i] >= 0:
            continue
        for k in range(n_el):
            pos[k] = 2 * ((i >> (bits * k)) & mask) + 1
        for j in range(n_grid):
            s = 0
            for k in range(n_el):
                t = np.int64(qgrid[j, k]) - pos[k]
                s += t * t
            d2[j] = s
        o = offsets[i]
        kmap[i] = -(o + 1)
        c = o + 1
        last = -1
        for _ in range(nwant):
            best = -1
            for j in range(n_grid):
                if d2[j] > last and (best < 0 or d2[j] < best):
                    best = d2[j]
            if best < 0:
                break
            for j in range(n_grid):
                if d2[j] == best:
                    neighbours[c] = j
                    c += 1
            last = best
        neighbours[o] = c - o - 1


@cache
def iq_tables(qtype: GGMLQuantizationType) -> IQTables:
    """The grid tables of ``qtype`` (built on first use, then cached for the process).

    Args:
        qtype: one of IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, IQ3_XXS, IQ3_S.

    Returns:
        An :class:`IQTables`; the arrays must not be modified.
    """
    owner, bits, nwant = _SPEC[qtype]
    levels, values = _levels(owner)
    n_grid, n_el = levels.shape
    kgrid = (levels << (bits * np.arange(n_el))).sum(axis=1).astype(np.uint16)
    qgrid = (2 * levels + 1).astype(np.int8)
    kmap = np.full(_IQ3_KMAP_SIZE if bits == 3 else _IQ2_KMAP_SIZE, -1, np.int32)
    kmap[kgrid.astype(np.int64)] = np.arange(n_grid, dtype=np.int32)
    counts = np.zeros(kmap.size, np.int64)
    _neighbour_counts(qgrid, kmap, bits, nwant, counts)
    off_grid = kmap < 0
    offsets = np.full(kmap.size, -1, np.int64)
    sizes = np.where(off_grid, counts + 1, 0)
    offsets[off_grid] = (np.cumsum(sizes) - sizes)[off_grid]
    neighbours = np.zeros(int(sizes.sum()), np.uint16)
    _neighbour_fill(qgrid, kmap, bits, nwant, offsets, neighbours)
    return IQTables(kgrid, qgrid, kmap, neighbours, values.astype(np.float32))


@cache
def neighbour_lanes(qtype: GGMLQuantizationType) -> NeighbourLanes:
    """:class:`NeighbourLanes` of ``qtype``'s neighbour lists (built on first use, then cached)."""
    t = iq_tables(qtype)
    return lay_out_lists(t, np.flatnonzero(t.kmap < 0))


def lay_out_lists(t: IQTables, off_grid: np.ndarray) -> NeighbourLanes:
    """:class:`NeighbourLanes` of the neighbour lists of the off-grid packed indices ``off_grid`` (the others
    get start -1), the values being the grid's levels as float32."""
    n_el = t.qgrid.shape[1]
    first = (-t.kmap[off_grid] - 1).astype(np.int64)  # offset of each list's count in t.neighbours
    counts = t.neighbours[first].astype(np.int64)
    pads = (counts + 7) // 8 * 8
    starts = np.cumsum(pads) - pads
    lanes = int(pads.sum())
    # lane -> (list, position in the list, clipped to the last candidate for the padding lanes)
    owner = np.repeat(np.arange(off_grid.size), pads)
    pos = np.arange(lanes) - starts[owner]
    index = t.neighbours[first[owner] + 1 + np.minimum(pos, counts[owner] - 1)].astype(np.int32)
    values = np.empty(n_el * lanes, np.float32)
    q = t.qgrid[index].astype(np.float32)  # [lanes, E]
    for i in range(n_el):
        values[n_el * starts[owner] + i * pads[owner] + pos] = q[:, i]
    start = np.full(t.kmap.size, -1, np.int32)
    count = np.zeros(t.kmap.size, np.int32)
    pad = np.zeros(t.kmap.size, np.int32)
    start[off_grid] = starts
    count[off_grid] = counts
    pad[off_grid] = pads
    return NeighbourLanes(start, count, pad, index, values)
