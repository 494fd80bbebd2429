"""GGUF metadata values: typed Python values and their little-endian encoding.

A KV record is ``u64 key_len, key bytes, u32 value_type, payload``. A payload is a scalar, a
gguf-string (``u64 len`` + UTF-8 bytes), or an array (``u32 item_type, u64 count``, then the items
packed without per-item type). Arrays of arrays are not allowed (llama.cpp rejects them).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from gguf import GGUFValueType

from ggufkit.errors import MetadataValueError

VT = GGUFValueType

#: numpy little-endian dtype of each fixed-size value type.
SCALAR_DTYPES: dict[GGUFValueType, np.dtype[Any]] = {
    VT.UINT8: np.dtype("<u1"),
    VT.INT8: np.dtype("<i1"),
    VT.UINT16: np.dtype("<u2"),
    VT.INT16: np.dtype("<i2"),
    VT.UINT32: np.dtype("<u4"),
    VT.INT32: np.dtype("<i4"),
    VT.FLOAT32: np.dtype("<f4"),
    VT.BOOL: np.dtype("<u1"),
    VT.UINT64: np.dtype("<u8"),
    VT.INT64: np.dtype("<i8"),
    VT.FLOAT64: np.dtype("<f8"),
}
INTEGER_TYPES = frozenset({VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64})
FLOAT_TYPES = frozenset({VT.FLOAT32, VT.FLOAT64})

#: Short names used on the command line (``--type KEY=u32``) and in JSON output.
TYPE_NAMES: dict[str, GGUFValueType] = {
    "u8": VT.UINT8, "i8": VT.INT8, "u16": VT.UINT16, "i16": VT.INT16, "u32": VT.UINT32, "i32": VT.INT32,
    "u64": VT.UINT64, "i64": VT.INT64, "f32": VT.FLOAT32, "f64": VT.FLOAT64, "bool": VT.BOOL,
    "str": VT.STRING, "string": VT.STRING,
}
SHORT_NAMES: dict[GGUFValueType, str] = {
    VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32", VT.INT32: "i32",
    VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT32: "f32", VT.FLOAT64: "f64", VT.BOOL: "bool",
    VT.STRING: "str", VT.ARRAY: "array",
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def type_label(vtype: GGUFValueType, item_type: GGUFValueType | None = None) -> str:
    """``u32``, ``str``, ``array[str]``: the name a user sees for a value type."""
    if vtype == VT.ARRAY:
        return f"array[{SHORT_NAMES[item_type] if item_type is not None else '?'}]"
    return SHORT_NAMES[vtype]


class EncodableValue(Protocol):
    """Anything the writer can serialise: a :class:`TypedValue` or a reader's ``KVField``."""

    @property
    def type(self) -> GGUFValueType: ...

    @property
    def item_type(self) -> GGUFValueType | None: ...

    def encode_payload(self) -> bytes:
        """The value's bytes after the u32 value type: scalar, gguf-string or array."""
        ...


@dataclass(frozen=True)
class TypedValue:
    """A metadata value with its GGUF type.

    ``value`` is a Python scalar (int, float, bool), a ``str``, or for arrays a sequence (or numpy array)
    of items of ``item_type``. Values are range-checked when encoded.
    """

    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None

    def __post_init__(self) -> None:
        if (self.type == VT.ARRAY) != (self.item_type is not None):
            raise MetadataValueError("an array needs an item type, and only an array may have one")
        if self.item_type == VT.ARRAY:
            raise MetadataValueError("arrays of arrays are not supported by GGUF readers")

    def encode_payload(self) -> bytes:
        if self.type == VT.ARRAY:
            assert self.item_type is not None
            return encode_array(self.item_type, self.value)
        return encode_scalar(self.type, self.value)


class PendingString:
    """A string value still being computed (the weight files' sha256, hashed while the tensors are written).

    Its byte length is known up front (``placeholder``): the writer writes the header with the placeholder
    when the value is not ready yet and rewrites it in place once :attr:`value` is known, so hashing a
    checkpoint overlaps converting it instead of preceding it. Reading :attr:`value` waits for the result.
    """

    type = VT.STRING
    item_type = None

    def __init__(self, placeholder: str, result: Future[str]) -> None:
        self.placeholder = placeholder
        self._result = result

    @property
    def ready(self) -> bool:
        return self._result.done()

    @property
    def value(self) -> str:
        text = self._result.result()
        if len(text.encode("utf-8")) != len(self.placeholder.encode("utf-8")):
            raise MetadataValueError(f"computed value {text[:40]!r}... does not have its placeholder's length")
        return text

    def encode_payload(self) -> bytes:
        return encode_string(self.value if self.ready else self.placeholder)


def encode_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return _U64.pack(len(data)) + data


def _check_int(vtype: GGUFValueType, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise MetadataValueError(f"expected an integer for {type_label(vtype)}, got {value!r}")
    info = np.iinfo(SCALAR_DTYPES[vtype])
    if not info.min <= int(value) <= info.max:
        raise MetadataValueError(f"{value} is out of range for {type_label(vtype)} ({info.min}..{info.max})")
    return int(value)


def encode_scalar(vtype: GGUFValueType, value: Any) -> bytes:
    """Encode one scalar or string payload."""
    if vtype == VT.STRING:
        if not isinstance(value, str):
            raise MetadataValueError(f"expected a string, got {value!r}")
        return encode_string(value)
    if vtype == VT.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise MetadataValueError(f"expected a bool, got {value!r}")
        return b"\x01" if value else b"\x00"
    if vtype in INTEGER_TYPES:
        return SCALAR_DTYPES[vtype].type(_check_int(vtype, value)).tobytes()
    if vtype in FLOAT_TYPES:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise MetadataValueError(f"expected a number for {type_label(vtype)}, got {value!r}")
        if vtype == VT.FLOAT32 and math.isfinite(value) and abs(value) > float(np.finfo(np.float32).max):
            raise MetadataValueError(f"{value} does not fit in f32")
        return SCALAR_DTYPES[vtype].type(value).tobytes()
    raise MetadataValueError(f"value type {vtype!r} is not a scalar type")


def encode_array(item_type: GGUFValueType, items: Any) -> bytes:
    """Encode an array payload: item type, count, items."""
    if item_type == VT.STRING:
        strings = list(items)
        parts = [_U32.pack(int(VT.STRING)), _U64.pack(len(strings))]
        for s in strings:
            if not isinstance(s, str):
                raise MetadataValueError(f"expected strings in a string array, got {s!r}")
            parts.append(encode_string(s))
        return b"".join(parts)
    dtype = SCALAR_DTYPES.get(item_type)
    if dtype is None:
        raise MetadataValueError(f"unsupported array item type {item_type!r}")
    if isinstance(items, np.ndarray) and items.dtype != object:
        arr = items.reshape(-1)
        if item_type == VT.BOOL:
            arr = arr.astype(bool)
        elif item_type in INTEGER_TYPES and arr.dtype.kind not in "iub":
            raise MetadataValueError(f"expected integers for array[{SHORT_NAMES[item_type]}], got {arr.dtype}")
        elif arr.dtype.kind in "iu" and item_type in INTEGER_TYPES:
            info = np.iinfo(dtype)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise MetadataValueError(f"array values out of range for {type_label(item_type)}")
        data = arr.astype(dtype, copy=False).tobytes()
    else:
        data = b"".join(encode_scalar(item_type, v) for v in items)
        arr = None
    count = len(data) // dtype.itemsize
    return _U32.pack(int(item_type)) + _U64.pack(count) + data


def encode_kv(key: str, value: EncodableValue) -> bytes:
    """One whole KV record."""
    return encode_string(key) + _U32.pack(int(value.type)) + value.encode_payload()


class Metadata(Mapping[str, EncodableValue]):
    """An ordered set of typed KV pairs, as written to a GGUF header.

    Setting an existing key keeps its position (as ``gguf_new_metadata`` does); new keys are appended.
    """

    def __init__(self, items: Iterable[tuple[str, EncodableValue]] = ()) -> None:
        self._items: dict[str, EncodableValue] = {}
        for key, value in items:
            self._items[key] = value

    def set(self, key: str, vtype: GGUFValueType, value: Any, item_type: GGUFValueType | None = None) -> None:
        """Set ``key`` to ``value`` of type ``vtype`` (``item_type`` for arrays)."""
        self._items[key] = TypedValue(vtype, value, item_type)

    def put(self, key: str, value: EncodableValue) -> None:
        """Set ``key`` to an already typed value (for example a field copied from a reader)."""
        self._items[key] = value

    def append(self, key: str, vtype: GGUFValueType, value: Any, item_type: GGUFValueType | None = None) -> None:
        """Remove ``key`` if present and add it at the end (llama-quantize's behaviour for its keys)."""
        self._items.pop(key, None)
        self.set(key, vtype, value, item_type)

    def remove(self, key: str) -> None:
        self._items.pop(key, None)

    def insert_after(self, anchor: str | None, key: str, value: EncodableValue) -> None:
        """Insert ``key`` right after ``anchor`` (at the front when ``anchor`` is None)."""
        self._items.pop(key, None)
        items = list(self._items.items())
        pos = 0 if anchor is None else [k for k, _ in items].index(anchor) + 1
        items.insert(pos, (key, value))
        self._items = dict(items)

    def __getitem__(self, key: str) -> EncodableValue:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def python_value(value: EncodableValue) -> Any:
    """The plain Python value of a typed value (reader fields decode lazily)."""
    if isinstance(value, TypedValue):
        return value.value
    return value.value  # type: ignore[attr-defined]


def summarize(value: Any, vtype: GGUFValueType, item_type: GGUFValueType | None, count: int | None,
              first: int = 8) -> Any:
    """A JSON-friendly summary: scalars as-is, arrays as {type, length, first items}."""
    if vtype != VT.ARRAY:
        if isinstance(value, float) and not math.isfinite(value):
            return repr(value)
        return value
    head: Sequence[Any] = value[:first]
    head = [x.item() if hasattr(x, "item") else x for x in head]
    return {"type": type_label(vtype, item_type), "length": count, "first": head}
