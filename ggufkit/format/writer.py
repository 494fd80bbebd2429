"""Streaming, atomic, deterministic GGUF writer.

The header, KV records and tensor infos are written first, from shapes and types known up front; the
data then arrives one tensor at a time from an iterable, so peak memory is one tensor, not the model.
Files go through :func:`ggufkit.format.atomic.atomic_write`. The same inputs give the same bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys

from ggufkit.constants import (
    DEFAULT_ALIGNMENT,
    DEFAULT_SLACK_BYTES,
    GGUF_MAGIC,
    KEY_SLACK,
    MAX_DIMS,
    MAX_TENSOR_NAME_BYTES,
)
from ggufkit.errors import GGUFKitError, UsageError
from ggufkit.format.atomic import EarlyWriteback, atomic_write
from ggufkit.format.reader import MAX_ALIGNMENT, align_up, tensor_nbytes
from ggufkit.format.shards import SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT, shard_path
from ggufkit.format.tensor_shape import n_elements
from ggufkit.format.values import (
    VT,
    EncodableValue,
    Metadata,
    PendingString,
    TypedValue,
    encode_kv,
    encode_string,
    python_value,
)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_GENERAL_PREFIX = Keys.General.ARCHITECTURE.split(".")[0] + "."


class Progress(Protocol):
    """What long-running library functions report to; the CLI passes a progress bar."""

    def begin(self, total: int, unit: str, desc: str) -> None: ...

    def advance(self, n: int) -> None: ...

    def end(self) -> None: ...


class NullProgress:
    def begin(self, total: int, unit: str, desc: str) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, type and numpy-order shape (in elements)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.name.encode("utf-8")) >= MAX_TENSOR_NAME_BYTES:
            raise UsageError(f"tensor name {self.name!r} is {len(self.name.encode('utf-8'))} bytes; ggml allows "
                             f"at most {MAX_TENSOR_NAME_BYTES - 1}")
        if any(int(d) < 0 for d in self.shape):
            raise UsageError(f"tensor {self.name!r}: negative dimension in {list(self.shape)}")
        if not 1 <= len(self.shape) <= MAX_DIMS:
            raise UsageError(f"tensor {self.name!r}: {len(self.shape)} dimensions (allowed 1..{MAX_DIMS})")
        block = GGML_QUANT_SIZES[self.ggml_type][0]
        if self.shape[-1] % block:
            raise UsageError(f"tensor {self.name!r}: row length {self.shape[-1]} is not a multiple of the "
                             f"{self.ggml_type.name} block size {block}")

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.ne)

    @property
    def n_elements(self) -> int:
        return n_elements(self.shape)


def alignment_of(metadata: Mapping[str, EncodableValue]) -> int:
    """The data alignment ``metadata`` asks for (``general.alignment``, default 32).

    Raises:
        UsageError: the key is not a u32 power of two up to the reader's limit.
    """
    value = metadata.get(Keys.General.ALIGNMENT)
    if value is None:
        return DEFAULT_ALIGNMENT
    if value.type != VT.UINT32:
        raise UsageError(f"{Keys.General.ALIGNMENT} must be u32")
    align = int(python_value(value))
    if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
        raise UsageError(f"{Keys.General.ALIGNMENT} {align} is not a power of two up to {MAX_ALIGNMENT}")
    return align


def encode_header(magic: bytes, metadata: Mapping[str, EncodableValue], tensors: Sequence[TensorSpec],
                  offsets: Sequence[int], version: int = 3) -> bytes:
    """Header, KV records and tensor infos, without the padding that follows them."""
    parts = [magic, _U32.pack(version), _U64.pack(len(tensors)), _U64.pack(len(metadata))]
    parts.extend(encode_kv(k, v) for k, v in metadata.items())
    for spec, off in zip(tensors, offsets):
        parts.append(encode_string(spec.name))
        parts.append(_U32.pack(len(spec.shape)))
        parts.extend(_U64.pack(d) for d in spec.ne)
        parts.append(_U32.pack(int(spec.ggml_type)))
        parts.append(_U64.pack(off))
    return b"".join(parts)


def tensor_offsets(tensors: Sequence[TensorSpec], alignment: int) -> list[int]:
    """Offsets in the data section: packed in order, each tensor padded to the alignment (as llama.cpp requires)."""
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += align_up(t.nbytes, alignment)
    return offsets


def with_slack(metadata: Mapping[str, EncodableValue], slack_bytes: int) -> Metadata:
    """A copy of ``metadata`` with ``ggufkit.slack`` (``slack_bytes`` spaces) after the last general.* key.

    The slack lets later edits of nearby strings (``general.name``, ...) happen in place: set-meta shrinks or
    grows it so the header keeps its size. An existing slack key is kept where it is.
    """
    out = Metadata(metadata.items())
    if slack_bytes <= 0 or KEY_SLACK in out:
        return out
    general = [k for k in out if k.startswith(_GENERAL_PREFIX)]
    out.insert_after(general[-1] if general else None, KEY_SLACK, TypedValue(VT.STRING, " " * slack_bytes))
    return out


def plan_shards(tensors: Sequence[TensorSpec], alignment: int, max_size: int | None,
                max_tensors: int | None) -> list[list[int]]:
    """Group tensor indices into shards; a shard closes when the next tensor would pass either limit."""
    if max_size is None and max_tensors is None:
        return [list(range(len(tensors)))]
    if (max_size is not None and max_size <= 0) or (max_tensors is not None and max_tensors <= 0):
        raise UsageError("split limits must be positive")
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        padded = align_up(t.nbytes, alignment)
        current = groups[-1]
        over_size = max_size is not None and current and size + padded > max_size
        over_count = max_tensors is not None and len(current) >= max_tensors
        if over_size or over_count:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += padded
    return groups


def _as_bytes(chunk: Any, spec: TensorSpec) -> memoryview:
    if isinstance(chunk, np.ndarray):
        view = np.ascontiguousarray(chunk).data.cast("B")
    else:
        view = memoryview(chunk).cast("B")
    if view.nbytes != spec.nbytes:
        raise GGUFKitError(f"tensor {spec.name!r}: got {view.nbytes} bytes of data, expected {spec.nbytes} "
                           f"for {spec.ggml_type.name} {list(spec.shape)}")
    return view


def _views(chunk: Any, spec: TensorSpec) -> Iterator[memoryview]:
    """A tensor's bytes as they arrive: one buffer, or an iterator of buffers whose bytes, in order, make it
    (a stacked expert tensor converted one expert at a time, ``ggufkit.converters.stream``)."""
    if isinstance(chunk, (np.ndarray, bytes, bytearray, memoryview)):
        yield _as_bytes(chunk, spec)
        return
    total = 0
    for piece in chunk:
        view = (np.ascontiguousarray(piece).data if isinstance(piece, np.ndarray) else memoryview(piece)).cast("B")
        total += view.nbytes
        if total > spec.nbytes:
            break
        yield view
    if total != spec.nbytes:
        raise GGUFKitError(f"tensor {spec.name!r}: got {'more than ' if total > spec.nbytes else ''}{total} bytes "
                           f"of data, expected {spec.nbytes} for {spec.ggml_type.name} {list(spec.shape)}")


def _complete_headers(files: Sequence[Any], headers: Sequence[tuple[Metadata, list[TensorSpec]]],
                      written: Sequence[bytes], magic: bytes, alignment: int) -> None:
    """Rewrite in place the headers written with a :class:`PendingString`'s placeholder, now that it is known."""
    for f, (shard_meta, shard_tensors), old in zip(files, headers, written):
        pending = [v for v in shard_meta.values() if isinstance(v, PendingString)]
        if not pending:
            continue
        for value in pending:
            value.value  # noqa: B018 - waits for the result, so the header below never keeps the placeholder
        header = encode_header(magic, shard_meta, shard_tensors, tensor_offsets(shard_tensors, alignment))
        if header == old:
            continue
        if len(header) != len(old):  # PendingString.value checks the length; this cannot happen
            raise GGUFKitError("a computed metadata value changed the header's length")
        f.seek(0)
        f.write(header)
        f.seek(0, 2)


def _write_tensor(f: BinaryIO, padding: int, view: memoryview, writeback: EarlyWriteback) -> None:
    f.write(b"\0" * padding)
    f.write(view)
    writeback.wrote(view.nbytes)


def write_gguf(path: str | Path, metadata: Mapping[str, EncodableValue], tensors: Sequence[TensorSpec],
               data: Iterable[Any], *, magic: bytes = GGUF_MAGIC, split_max_size: int | None = None,
               split_max_tensors: int | None = None, slack_bytes: int = DEFAULT_SLACK_BYTES,
               progress: Progress | None = None, shard_of: Sequence[int] | None = None) -> list[Path]:
    """Write a GGUF file (or a gguf-split shard set) atomically, streaming tensor data.

    Args:
        path: output path. With splitting, shards are named ``STEM-00001-of-0000N.gguf`` beside it.
        metadata: KV pairs in the order to write them (``general.architecture`` first, by convention).
        tensors: what will be written, in order.
        data: one buffer per tensor, in the same order (numpy array, bytes or memoryview of exactly
            ``spec.nbytes`` bytes), or for a tensor an iterator of such buffers whose bytes, in order, make
            its ``spec.nbytes``. Consumed lazily: produce each tensor (each piece) only when asked.
        magic: ``b"GGUF"``, or ``b"PWRI"`` for PowerInfer files.
        split_max_size: start a new shard before a tensor that would take a shard past this many bytes.
        split_max_tensors: at most this many tensors per shard.
        slack_bytes: size of the reserved ``ggufkit.slack`` string (0: none).
        progress: receives the number of data bytes written.
        shard_of: an explicit shard index per tensor (non-decreasing, from 0), instead of the split limits
            (llama-quantize ``--keep-split``); one shard means one file at ``path``.

    Returns:
        The paths written (one, or the shards in order).

    Raises:
        GGUFKitError: a data buffer has the wrong size; nothing is written then.
    """
    path = Path(path)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"tensor {dup!r} is listed twice")
    if any(k in metadata for k in SPLIT_KEYS):
        raise UsageError("split.* keys are managed by the writer; remove them from the metadata")
    alignment = alignment_of(metadata)
    meta = with_slack(metadata, slack_bytes)
    if shard_of is not None:
        if list(shard_of) != sorted(shard_of) or len(shard_of) != len(tensors):
            raise UsageError("shard_of must give one non-decreasing shard index per tensor")
        groups = [[i for i, s in enumerate(shard_of) if s == g] for g in range(max(shard_of, default=0) + 1)]
    else:
        groups = plan_shards(tensors, alignment, split_max_size, split_max_tensors)
    if len(groups) == 1:
        outputs = [path]
        headers = [(meta, list(tensors))]
    else:
        outputs = [shard_path(path, i, len(groups)) for i in range(len(groups))]
        headers = []
        for i, group in enumerate(groups):
            shard_meta = Metadata(meta.items()) if i == 0 else Metadata()
            shard_meta.set(SPLIT_NO, VT.UINT16, i)
            shard_meta.set(SPLIT_COUNT, VT.UINT16, len(groups))
            shard_meta.set(SPLIT_TENSORS_COUNT, VT.INT32, len(tensors))
            headers.append((shard_meta, [tensors[j] for j in group]))
    progress = progress or NullProgress()
    progress.begin(sum(t.nbytes for t in tensors), "B", f"writing {path.name}")
    data_iter = iter(data)
    with atomic_write(*outputs) as files:
        written: list[bytes] = []
        for f, (shard_meta, shard_tensors) in zip(files, headers):
            offsets = tensor_offsets(shard_tensors, alignment)
            header = encode_header(magic, shard_meta, shard_tensors, offsets)
            written.append(header)
            f.write(header)
            f.write(b"\0" * (align_up(len(header), alignment) - len(header)))
            # Tensor i is written by a helper thread while the caller's iterator reads and quantizes tensor
            # i + 1 (a write syscall runs without the GIL); at most two tensors' bytes are held at a time, or
            # two pieces of a tensor given in pieces. A tensor's alignment padding goes before the next write.
            with EarlyWriteback(f) as writeback, ThreadPoolExecutor(1) as writer:
                pending: Future[None] | None = None
                pending_bytes = 0
                padding = 0
                for spec in shard_tensors:
                    try:
                        chunk = next(data_iter)
                    except StopIteration:
                        raise GGUFKitError(f"data ended before tensor {spec.name!r}") from None
                    views = _views(chunk, spec)
                    del chunk
                    for view in views:
                        if pending is not None:
                            pending.result()  # re-raises the write's error here
                            progress.advance(pending_bytes)
                        pending = writer.submit(_write_tensor, f, padding, view, writeback)
                        pending_bytes, padding = view.nbytes, 0
                        del view
                    padding += align_up(spec.nbytes, alignment) - spec.nbytes
                if pending is not None:
                    pending.result()
                    progress.advance(pending_bytes)
                f.write(b"\0" * padding)
        if next(data_iter, None) is not None:
            raise GGUFKitError("more tensor data than tensors")
        _complete_headers(files, headers, written, magic, alignment)
    progress.end()
    return outputs
