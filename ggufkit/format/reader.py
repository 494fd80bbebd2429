"""A lazy, mmap-based GGUF reader that distrusts its input.

Opening a file parses the header, the KV records and the tensor infos; array values (a 150k-token
vocabulary) are located but decoded only when asked for. Every count, length, dimension, type id,
alignment and offset is checked against the file size and ggml's limits *before* anything is allocated,
and every violation raises :class:`~ggufkit.errors.GGUFFormatError` naming what is wrong and the byte
offset. Tensor data is exposed as numpy views of the mmap, never copied.

Layout (little-endian; ggml/src/gguf.cpp: gguf_init_from_reader, gguf-py/gguf/gguf_reader.py)::

    magic[4] ("GGUF" or PowerInfer's "PWRI"), u32 version (2 or 3), u64 n_tensors, u64 n_kv,
    n_kv x KV record, n_tensors x (gguf-string name, u32 n_dims, n_dims x u64 ne, u32 type, u64 offset),
    zero padding to the alignment, data section (offsets relative to its start).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from ggufkit.constants import (
    DEFAULT_ALIGNMENT,
    KNOWN_MAGICS,
    MAX_DIMS,
    MAX_TENSOR_NAME_BYTES,
    POWERINFER_MAGIC,
    SUPPORTED_VERSIONS,
)
from ggufkit.errors import GGUFFormatError, TensorNotFoundError
from ggufkit.format.tensor_shape import n_elements
from ggufkit.format.values import SCALAR_DTYPES, VT, type_label

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_INT64_MAX = (1 << 63) - 1

#: Smallest encoded size of one KV record: empty key (8) + type (4) + 1-byte value.
_MIN_KV_BYTES = 13
#: Smallest tensor info: empty name (8) + n_dims (4) + type (4) + offset (8).
_MIN_TENSOR_INFO_BYTES = 24
#: Keys longer than this are refused (llama.cpp has no limit; nothing sane comes close).
MAX_KEY_BYTES = 65535
#: Largest alignment accepted: ggml pads with it, so a huge value would make a writer allocate it.
MAX_ALIGNMENT = 1 << 20

#: numpy dtype of the tensor types that have one; the rest are exposed as raw uint8 rows.
TENSOR_DTYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype("<u2"),  # numpy has no bfloat16: raw 16-bit patterns
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


def tensor_nbytes(ggml_type: GGMLQuantizationType, ne: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``ne`` (GGUF order, innermost first); ne[0] must be a whole number of blocks."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in ne[1:]:
        n *= d
    return n * (ne[0] // block) * type_size if ne else type_size


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's record: name, type, dimensions and where its data lies.

    Attributes:
        name: tensor name, e.g. ``blk.0.attn_q.weight``.
        ggml_type: the element/block type.
        ne: dimensions in GGUF order (ne[0] is the row length, innermost).
        offset: data offset relative to the start of the data section.
        nbytes: size of the data in bytes.
        info_offset: byte offset of this record in its file (for error messages).
        shard: index of the file holding it in a shard set (0 for a single file).
    """

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    offset: int
    nbytes: int
    info_offset: int = 0
    shard: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions in numpy order (rows first), counted in elements."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return n_elements(self.ne)

    @property
    def n_dims(self) -> int:
        return len(self.ne)

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class KVField:
    """One metadata record; its value is decoded on first access.

    Attributes:
        key: the key.
        type: the value type; ``item_type`` and ``count`` for arrays.
        offset: byte offset of the record (its key length) in the file.
        value_offset: byte offset of the payload (after the u32 value type).
        end: byte offset just past the record.
    """

    __slots__ = ("_file", "_value", "count", "end", "item_type", "key", "offset", "type", "value_offset")

    def __init__(self, file: GGUFFile, key: str, vtype: GGUFValueType, item_type: GGUFValueType | None,
                 count: int | None, offset: int, value_offset: int, end: int) -> None:
        self._file = file
        self.key = key
        self.type = vtype
        self.item_type = item_type
        self.count = count
        self.offset = offset
        self.value_offset = value_offset
        self.end = end
        self._value: Any = _UNSET

    @property
    def nbytes(self) -> int:
        """Size of the whole record in bytes."""
        return self.end - self.offset

    @property
    def type_label(self) -> str:
        return type_label(self.type, self.item_type)

    @property
    def value(self) -> Any:
        """Scalars as Python values, strings as ``str``, numeric arrays as read-only numpy views,
        string arrays as ``list[str]``, bool arrays as numpy bool arrays."""
        if self._value is _UNSET:
            self._value = self._file._decode_value(self)
        return self._value

    def head(self, n: int) -> list[Any]:
        """The first ``n`` items of an array, decoding nothing else (a 150k-token list stays undecoded)."""
        if self._value is not _UNSET:
            return [x.item() if isinstance(x, np.generic) else x for x in self._value[:n]]
        return self._file._decode_head(self, n)

    def encode_payload(self) -> bytes:
        """The raw payload bytes, copied verbatim (lets writers copy a vocabulary without decoding)."""
        return bytes(self._file._mm[self.value_offset:self.end])

    def __repr__(self) -> str:
        return f"KVField({self.key!r}, {self.type_label})"


class _Unset:
    pass


_UNSET = _Unset()


class _Cursor:
    """Bounds-checked sequential reads over the mmap; every failure names the offset."""

    def __init__(self, file: GGUFFile, pos: int) -> None:
        self.f = file
        self.pos = pos

    def fail(self, message: str, at: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(message, path=self.f.path, offset=self.pos if at is None else at)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.f.file_size:
            raise self.fail(f"file truncated: {what} needs {n} bytes, {self.f.file_size - self.pos} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.f._mm, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.f._mm, self.pos)
        self.pos += 8
        return int(v)

    def string_span(self, what: str, limit: int | None = None) -> tuple[int, int]:
        start = self.pos
        n = self.u64(f"{what} length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} length {n} exceeds the limit of {limit} bytes", at=start)
        if n > self.f.file_size - self.pos:
            raise self.fail(f"{what} length {n} exceeds the {self.f.file_size - self.pos} bytes left in the file",
                            at=start)
        span = (self.pos, self.pos + n)
        self.pos += n
        return span

    def text(self, what: str, limit: int | None = None) -> str:
        a, b = self.string_span(what, limit)
        try:
            return bytes(self.f._mm[a:b]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason})", at=a + exc.start) from None


class GGUFFile:
    """One GGUF (or PowerInfer PWRI) file, opened read-only.

    Args:
        path: the file.

    Raises:
        GGUFFormatError: the file is not a well-formed GGUF file.
        OSError: it cannot be opened.

    Example:
        >>> with GGUFFile("model.gguf") as f:            # doctest: +SKIP
        ...     print(f.architecture, len(f.tensors))
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._header_only = False
        self._fd = -1
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise GGUFFormatError("not a regular file (a directory, FIFO or device)", path=self.path)
            self.file_size = st.st_size
            if self.file_size < 4:
                raise GGUFFormatError(f"file is {self.file_size} bytes, too short for a GGUF header",
                                      path=self.path, offset=0)
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            self._parse()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_header_bytes(cls, header: bytes, path: str | os.PathLike[str]) -> GGUFFile:
        """Parse a header held in memory (magic up to the end of the tensor infos, padding optional).

        Everything the file reader checks is checked except that tensor data lies inside the file:
        set-meta validates a new header with this before writing it.

        Raises:
            GGUFFormatError: the header is malformed.
        """
        self = cls.__new__(cls)
        self.path = Path(path)
        self._header_only = True
        self._fd = -1
        self._mm = header  # type: ignore[assignment]
        self.file_size = len(header)
        if self.file_size < 4:
            raise GGUFFormatError("header is too short", path=self.path, offset=0)
        self._parse()
        return self

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        cur = _Cursor(self, 0)
        magic = bytes(self._mm[0:4])
        if magic not in KNOWN_MAGICS:
            raise cur.fail(f"invalid magic {magic!r}: not a GGUF file (expected b'GGUF' or b'PWRI')")
        self.magic = magic
        cur.pos = 4
        version = cur.u32("version")
        if version & 0xFFFF == 0 and version >> 16:
            raise cur.fail("big-endian GGUF files are not supported; convert with gguf_convert_endian.py", at=4)
        if version not in SUPPORTED_VERSIONS:
            raise cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)", at=4)
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("KV count")
        remaining = self.file_size - cur.pos
        if n_kv > remaining // _MIN_KV_BYTES:
            raise cur.fail(f"KV count {n_kv} cannot fit in the {remaining} bytes left in the file", at=16)
        if n_tensors > remaining // _MIN_TENSOR_INFO_BYTES:
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the {remaining} bytes left in the file", at=8)

        self.kv: dict[str, KVField] = {}
        for _ in range(n_kv):
            field = self._parse_kv(cur)
            if field.key in self.kv:
                raise cur.fail(f"duplicate key {field.key!r}", at=field.offset)
            self.kv[field.key] = field
        self.alignment = self._parse_alignment()

        remaining = self.file_size - cur.pos
        if n_tensors > remaining // _MIN_TENSOR_INFO_BYTES:
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the {remaining} bytes left in the file", at=8)
        infos: list[TensorInfo] = []
        names: set[str] = set()
        for _ in range(n_tensors):
            info = self._parse_tensor_info(cur)
            if info.name in names:
                raise cur.fail(f"duplicate tensor name {info.name!r}", at=info.info_offset)
            names.add(info.name)
            infos.append(info)
        self.header_end = cur.pos
        self.data_offset = align_up(cur.pos, self.alignment)
        if n_tensors and self.data_offset > self.file_size and not self._header_only:
            raise cur.fail(f"data section starts at {self.data_offset}, past the end of the file "
                           f"({self.file_size} bytes)")
        self._check_tensor_ranges(infos)
        self.tensors: list[TensorInfo] = infos
        self._by_name = {t.name: t for t in infos}

    def _parse_kv(self, cur: _Cursor) -> KVField:
        start = cur.pos
        key = cur.text("key", limit=MAX_KEY_BYTES)
        type_pos = cur.pos
        raw_type = cur.u32(f"value type of {key!r}")
        try:
            vtype = GGUFValueType(raw_type)
        except ValueError:
            raise cur.fail(f"unknown value type {raw_type} for key {key!r}", at=type_pos) from None
        value_offset = cur.pos
        item_type: GGUFValueType | None = None
        count: int | None = None
        if vtype == VT.ARRAY:
            item_pos = cur.pos
            raw_item = cur.u32(f"array item type of {key!r}")
            try:
                item_type = GGUFValueType(raw_item)
            except ValueError:
                raise cur.fail(f"unknown array item type {raw_item} for key {key!r}", at=item_pos) from None
            if item_type == VT.ARRAY:
                raise cur.fail(f"key {key!r}: nested arrays are not supported", at=item_pos)
            count_pos = cur.pos
            count = cur.u64(f"array length of {key!r}")
            left = self.file_size - cur.pos
            if item_type == VT.STRING:
                if count > left // 8:
                    raise cur.fail(f"key {key!r}: array of {count} strings cannot fit in the {left} bytes left",
                                   at=count_pos)
                cur.pos = self._skip_strings(cur.pos, count, key)
            else:
                size = SCALAR_DTYPES[item_type].itemsize
                if count > left // size:
                    raise cur.fail(f"key {key!r}: array of {count} {type_label(item_type)} needs {count * size} "
                                   f"bytes, {left} are left", at=count_pos)
                cur.pos += count * size
        elif vtype == VT.STRING:
            a, b = cur.string_span(f"value of {key!r}")
            try:
                bytes(self._mm[a:b]).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise cur.fail(f"value of {key!r} is not valid UTF-8", at=a + exc.start) from None
        else:
            size = SCALAR_DTYPES[vtype].itemsize
            cur.need(size, f"value of {key!r}")
            cur.pos += size
        return KVField(self, key, vtype, item_type, count, start, value_offset, cur.pos)

    def _skip_strings(self, pos: int, count: int, key: str) -> int:
        """Walk ``count`` gguf-strings from ``pos`` and return the offset after them.

        This loop is the cost of opening a file with a 150k-token vocabulary, so it is kept tight
        (no per-item method calls); UTF-8 is checked when the array is decoded, not here.
        """
        mm, end, unpack = self._mm, self.file_size, _U64.unpack_from
        for i in range(count):
            if pos + 8 > end:
                raise GGUFFormatError(f"file truncated: length of item {i} of {key!r} needs 8 bytes, "
                                      f"{end - pos} remain", path=self.path, offset=pos)
            (n,) = unpack(mm, pos)
            if n > end - pos - 8:
                raise GGUFFormatError(f"item {i} of {key!r}: length {n} exceeds the {end - pos - 8} bytes left "
                                      "in the file", path=self.path, offset=pos)
            pos += 8 + n
        return pos

    def _parse_alignment(self) -> int:
        field = self.kv.get(Keys.General.ALIGNMENT)
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != VT.UINT32:
            raise GGUFFormatError(f"{Keys.General.ALIGNMENT} has type {field.type_label}, expected u32",
                                  path=self.path, offset=field.offset)
        value = int(field.value)
        if value == 0 or value & (value - 1) or value > MAX_ALIGNMENT:
            raise GGUFFormatError(f"{Keys.General.ALIGNMENT} {value} is not a power of two up to {MAX_ALIGNMENT}",
                                  path=self.path, offset=field.value_offset)
        return value

    def _parse_tensor_info(self, cur: _Cursor) -> TensorInfo:
        start = cur.pos
        name = cur.text("tensor name", limit=MAX_KEY_BYTES)
        if len(name.encode("utf-8")) >= MAX_TENSOR_NAME_BYTES:
            raise cur.fail(f"tensor name {name[:80]!r} is {len(name.encode())} bytes; ggml allows at most "
                           f"{MAX_TENSOR_NAME_BYTES - 1}", at=start)
        dims_pos = cur.pos
        n_dims = cur.u32(f"n_dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (allowed 1..{MAX_DIMS})", at=dims_pos)
        ne: list[int] = []
        for i in range(n_dims):
            d_pos = cur.pos
            d = cur.u64(f"ne[{i}] of {name!r}")
            if d > _INT64_MAX:
                raise cur.fail(f"tensor {name!r}: ne[{i}] = {d} does not fit in int64", at=d_pos)
            ne.append(d)
            if n_elements(ne) > _INT64_MAX:
                raise cur.fail(f"tensor {name!r}: element count overflows int64", at=d_pos)
        type_pos = cur.pos
        raw_type = cur.u32(f"type of {name!r}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown type id {raw_type}", at=type_pos) from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has type {ggml_type.name}, which has no size", at=type_pos)
        block, _ = GGML_QUANT_SIZES[ggml_type]
        if ne[0] % block:
            raise cur.fail(f"tensor {name!r}: row length {ne[0]} is not a multiple of the {ggml_type.name} "
                           f"block size {block}", at=dims_pos)
        offset_pos = cur.pos
        offset = cur.u64(f"data offset of {name!r}")
        if offset % self.alignment:
            raise cur.fail(f"tensor {name!r}: data offset {offset} is not a multiple of the alignment "
                           f"{self.alignment}", at=offset_pos)
        nbytes = tensor_nbytes(ggml_type, tuple(ne))
        return TensorInfo(name, ggml_type, tuple(ne), offset, nbytes, info_offset=start)

    def _check_tensor_ranges(self, infos: list[TensorInfo]) -> None:
        data_size = self.file_size - self.data_offset
        for info in [] if self._header_only else infos:
            if info.offset > data_size or info.nbytes > data_size - info.offset:
                raise GGUFFormatError(
                    f"tensor {info.name!r}: data [{info.offset}, {info.offset + info.nbytes}) lies outside the "
                    f"{max(data_size, 0)}-byte data section (file truncated?)", path=self.path,
                    offset=info.info_offset)
        ordered = sorted(infos, key=lambda t: t.offset)
        for prev, nxt in itertools.pairwise(ordered):
            if prev.offset + prev.nbytes > nxt.offset:
                raise GGUFFormatError(f"tensors {prev.name!r} and {nxt.name!r} overlap", path=self.path,
                                      offset=nxt.info_offset)

    # -- values ----------------------------------------------------------------------------------
    def _decode_value(self, field: KVField) -> Any:
        mm = self._mm
        if field.type == VT.STRING:
            (n,) = _U64.unpack_from(mm, field.value_offset)
            return bytes(mm[field.value_offset + 8:field.value_offset + 8 + n]).decode("utf-8")
        if field.type == VT.ARRAY:
            assert field.item_type is not None and field.count is not None
            start = field.value_offset + 12
            if field.item_type == VT.STRING:
                out: list[str] = []
                pos = start
                for i in range(field.count):
                    (n,) = _U64.unpack_from(mm, pos)
                    try:
                        out.append(bytes(mm[pos + 8:pos + 8 + n]).decode("utf-8"))
                    except UnicodeDecodeError as exc:
                        raise GGUFFormatError(f"item {i} of {field.key!r} is not valid UTF-8",
                                              path=self.path, offset=pos + 8 + exc.start) from None
                    pos += 8 + n
                return out
            arr = np.frombuffer(mm, dtype=SCALAR_DTYPES[field.item_type], count=field.count, offset=start)
            return arr.astype(bool) if field.item_type == VT.BOOL else arr
        arr = np.frombuffer(mm, dtype=SCALAR_DTYPES[field.type], count=1, offset=field.value_offset)
        if field.type == VT.BOOL:
            return bool(arr[0])
        return arr[0].item()

    def _decode_head(self, field: KVField, n: int) -> list[Any]:
        if field.type != VT.ARRAY or field.item_type is None or field.count is None:
            return [field.value]
        n = min(n, field.count)
        start = field.value_offset + 12
        if field.item_type != VT.STRING:
            arr = np.frombuffer(self._mm, dtype=SCALAR_DTYPES[field.item_type], count=n, offset=start)
            return [bool(x) for x in arr] if field.item_type == VT.BOOL else arr.tolist()
        out: list[str] = []
        pos = start
        for i in range(n):
            (length,) = _U64.unpack_from(self._mm, pos)
            try:
                out.append(bytes(self._mm[pos + 8:pos + 8 + length]).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise GGUFFormatError(f"item {i} of {field.key!r} is not valid UTF-8", path=self.path,
                                      offset=pos + 8 + exc.start) from None
            pos += 8 + length
        return out

    # -- public API ------------------------------------------------------------------------------
    @property
    def is_powerinfer(self) -> bool:
        """True for PowerInfer files (magic ``PWRI``)."""
        return self.magic == POWERINFER_MAGIC

    @property
    def architecture(self) -> str | None:
        field = self.kv.get(Keys.General.ARCHITECTURE)
        return field.value if field is not None and field.type == VT.STRING else None

    def get(self, key: str, default: Any = None) -> Any:
        """The decoded value of ``key``, or ``default``."""
        field = self.kv.get(key)
        return default if field is None else field.value

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise TensorNotFoundError(name, path=self.path) from None

    def read_bytes(self, start: int, stop: int) -> bytes:
        """A copy of bytes ``[start, stop)`` of the file (clipped to its end)."""
        return bytes(self._mm[start:stop])

    def raw(self, info: TensorInfo) -> memoryview:
        """The tensor's bytes as a read-only memoryview of the mmap."""
        start = self.data_offset + info.offset
        return memoryview(self._mm)[start:start + info.nbytes]

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor as a read-only numpy view of the mmap.

        F32/F16/F64/I* tensors have their numpy dtype and shape ``info.shape``; BF16 is ``uint16`` bit
        patterns of that shape; block-quantized types are ``uint8[*shape[:-1], row_bytes]``.
        """
        start = self.data_offset + info.offset
        dtype = TENSOR_DTYPES.get(info.ggml_type)
        if dtype is not None:
            return np.frombuffer(self._mm, dtype=dtype, count=info.n_elements, offset=start).reshape(info.shape)
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=start)
        if info.n_elements == 0:
            return arr
        rows = info.n_elements // info.ne[0]
        return arr.reshape(*info.shape[:-1], info.nbytes // rows)

    def iter_kv(self) -> Iterator[KVField]:
        return iter(self.kv.values())

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if isinstance(mm, mmap.mmap):
            # BufferError: numpy views are still alive; the mapping is released with them.
            with contextlib.suppress(BufferError):
                mm.close()
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)
            self._fd = -1

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class GGUFModel(Mapping[str, TensorInfo]):
    """A model as one object: a single GGUF file, or a gguf-split shard set opened from any shard name.

    Metadata comes from the first shard; tensors are the union of all shards (each ``TensorInfo`` carries
    its ``shard`` index). It is a mapping from tensor name to :class:`TensorInfo` in file order.
    """

    def __init__(self, files: list[GGUFFile]) -> None:
        self.files = files
        self.tensors: list[TensorInfo] = []
        for i, f in enumerate(files):
            for t in f.tensors:
                self.tensors.append(t if i == 0 else _with_shard(t, i))
        self._by_name = {t.name: t for t in self.tensors}

    @property
    def path(self) -> Path:
        return self.files[0].path

    @property
    def kv(self) -> dict[str, KVField]:
        return self.files[0].kv

    @property
    def magic(self) -> bytes:
        return self.files[0].magic

    @property
    def is_powerinfer(self) -> bool:
        return self.files[0].is_powerinfer

    @property
    def architecture(self) -> str | None:
        return self.files[0].architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.files[0].get(key, default)

    def data(self, info: TensorInfo) -> np.ndarray:
        return self.files[info.shard].data(info)

    def raw(self, info: TensorInfo) -> memoryview:
        return self.files[info.shard].raw(info)

    @cached_property
    def file_size(self) -> int:
        return sum(f.file_size for f in self.files)

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise TensorNotFoundError(name, path=self.path) from None

    def __contains__(self, name: object) -> bool:
        # Mapping's default relies on KeyError; TensorNotFoundError is a LookupError but not a KeyError.
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_shard(t: TensorInfo, shard: int) -> TensorInfo:
    return TensorInfo(t.name, t.ggml_type, t.ne, t.offset, t.nbytes, t.info_offset, shard)
