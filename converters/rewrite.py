"""Tensor rewrites between the registry's one-to-one mapping and the output: merge, split or stack tensors.

A planned tensor is a :data:`Raw` tuple ``(gguf name, source, kind, shape, source dtype, transform)`` with a
loader. The core applies :func:`stack_experts` (rules whose HF name holds ``{xid}``) and then the family's
``rewrite_tensors`` hook, if its hooks module has one (see :mod:`ggufkit.converters.hooks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ggufkit.errors import TensorMappingError

#: (gguf name, source, kind, shape, source dtype, transform)
Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]
Loader = Callable[[], np.ndarray]


def stack_experts(raw: list[Raw], experts: dict[int, tuple[int, int, str]], n_expert: int | None,
                  read: Callable[[str, str | None], np.ndarray]) -> tuple[list[Raw], dict[str, Loader]]:
    """Stack per-expert 2-D tensors into one ``[n_expert, rows, cols]`` tensor per GGUF name (``ffn_*_exps``).

    llama.cpp's converters (conversion/llama.py, conversion/qwen.py ``modify_tensors``) collect a block's
    experts and write its stacked tensors together once the last one arrives, in the order of the HF
    weight names (w1, w2, w3 / down, gate, up); so does this.

    Args:
        raw: planned tensors in source order; expert members share their stacked GGUF name.
        experts: index in ``raw`` -> (block, expert id, HF weight name after the expert id) for members.
        n_expert: the expert count from the config (every stack must have exactly this many), or None.
        read: loads one source tensor with its transform applied.

    Returns:
        (the planned tensors with each stack in place of its members, loaders of the stacks).

    Raises:
        TensorMappingError: a stack misses experts or its members differ in shape or dtype.
    """
    if not experts:
        return raw, {}
    groups: dict[str, list[tuple[int, int]]] = {}  # gguf name -> [(expert id, raw index)]
    block_last: dict[int, int] = {}
    block_groups: dict[int, dict[str, str]] = {}  # block -> {gguf name: HF weight name}
    for index, (block, xid, weight) in experts.items():
        name = raw[index][0]
        groups.setdefault(name, []).append((xid, index))
        block_last[block] = max(block_last.get(block, -1), index)
        block_groups.setdefault(block, {})[name] = weight
    stacked: dict[str, Raw] = {}
    loaders: dict[str, Loader] = {}
    for name, members in groups.items():
        members.sort()
        ids = [xid for xid, _ in members]
        want = n_expert if n_expert is not None else len(ids)
        if ids != list(range(want)):
            missing = sorted(set(range(want)) - set(ids))
            raise TensorMappingError(f"{name}: expert tensors {ids[:8]} found, expected 0..{want - 1}"
                                     + (f" (missing {missing[:8]})" if missing else ""))
        first = raw[members[0][1]]
        parts = [raw[i] for _, i in members]
        if any(p[3] != first[3] or p[4] != first[4] for p in parts):
            raise TensorMappingError(f"{name}: the experts differ in shape or dtype")
        sources = [p[1] for p in parts]
        stacked[name] = (name, f"{sources[0]} .. {sources[-1]} (stacked)", first[2], (want, *first[3]), first[4],
                         first[5])
        loaders[name] = StackLoader(sources, first[5], read)
    out: list[Raw] = []
    emit_at = {last: block for block, last in block_last.items()}
    for index, item in enumerate(raw):
        if index in experts:
            done = emit_at.get(index)
            if done is not None:
                order = sorted(block_groups[done].items(), key=lambda kv: kv[1])
                out.extend(stacked[name] for name, _ in order)
            continue
        out.append(item)
    return out, loaders


class StackLoader:
    """A stacked expert tensor's loader: called, the whole ``[n_expert, rows, cols]`` array (what a family hook
    that rewrites the stack gets); :meth:`pieces` gives it one expert at a time instead.

    Experts are the outermost dimension, so each expert's rows are a contiguous slice of the stack's bytes in
    every GGUF type, and :func:`ggufkit.converters.stream.tensor_stream` converts and writes them one by one:
    the conversion holds one expert (dequantized to float32 for FP8 / INT4 sources), never the stack.
    """

    def __init__(self, sources: list[str], transform: str | None,
                 read: Callable[[str, str | None], np.ndarray]) -> None:
        self.sources, self.transform, self._read = sources, transform, read

    def pieces(self) -> Iterator[np.ndarray]:
        """Each expert's (transformed) tensor, in expert order, read only when asked for."""
        for source in self.sources:
            yield self._read(source, self.transform)

    def __call__(self) -> np.ndarray:
        parts = self.pieces()
        first = next(parts)
        out = np.empty((len(self.sources), *first.shape), dtype=first.dtype)
        out[0] = first
        del first
        for i, part in enumerate(parts, 1):
            out[i] = part
        return out

