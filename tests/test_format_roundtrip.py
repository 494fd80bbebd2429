"""Round trips: every value type and every tensor type, ggufkit <-> gguf-py, in both directions."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf_builders import random_tensor_bytes

from ggufkit.format import GGUFFile, Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.format.values import VT

# One value per scalar type at the edges of its range, and an array of each item type.
SCALARS: list[tuple[str, GGUFValueType, object]] = [
    ("t.u8", VT.UINT8, 255), ("t.i8", VT.INT8, -128), ("t.u16", VT.UINT16, 65535), ("t.i16", VT.INT16, -32768),
    ("t.u32", VT.UINT32, 2**32 - 1), ("t.i32", VT.INT32, -(2**31)), ("t.u64", VT.UINT64, 2**64 - 1),
    ("t.i64", VT.INT64, -(2**63)), ("t.f32", VT.FLOAT32, 0.1), ("t.f64", VT.FLOAT64, 1e300),
    ("t.bool_t", VT.BOOL, True), ("t.bool_f", VT.BOOL, False), ("t.str", VT.STRING, "héllo\n✓"),
    ("t.empty_str", VT.STRING, ""),
]
ARRAYS: list[tuple[str, GGUFValueType, list[object]]] = [
    ("a.u8", VT.UINT8, [0, 255]), ("a.i8", VT.INT8, [-128, 127]), ("a.u16", VT.UINT16, [1, 65535]),
    ("a.i16", VT.INT16, [-5, 5]), ("a.u32", VT.UINT32, [7, 2**32 - 1]), ("a.i32", VT.INT32, [-1, 2**31 - 1]),
    ("a.u64", VT.UINT64, [0, 2**64 - 1]), ("a.i64", VT.INT64, [-(2**63), 3]), ("a.f32", VT.FLOAT32, [0.5, -2.25]),
    ("a.f64", VT.FLOAT64, [1e-300, 2.5]), ("a.bool", VT.BOOL, [True, False, True]),
    ("a.str", VT.STRING, ["<s>", "", "▁the", "日本"]),
]
TENSOR_TYPES = sorted(GGML_QUANT_SIZES, key=int)


def _expected(vtype: GGUFValueType, value: object) -> object:
    return float(np.float32(value)) if vtype == VT.FLOAT32 else value


def _metadata() -> Metadata:
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    for key, vtype, value in SCALARS:
        meta.set(key, vtype, value)
    for key, item, items in ARRAYS:
        meta.set(key, VT.ARRAY, items, item)
    return meta


def _tensors() -> tuple[list[TensorSpec], list[bytes]]:
    specs, data = [], []
    for i, t in enumerate(TENSOR_TYPES):
        block = GGML_QUANT_SIZES[t][0]
        shape = (3, 2 * block)
        specs.append(TensorSpec(f"t{int(t)}.{t.name.lower()}", t, shape))
        data.append(random_tensor_bytes(t, shape, seed=i))
    return specs, data


def _check_our_values(f: GGUFFile) -> None:
    for key, vtype, value in SCALARS:
        kv = f.kv[key]
        assert kv.type == vtype and kv.value == _expected(vtype, value), key
    for key, item, items in ARRAYS:
        kv = f.kv[key]
        assert (kv.type, kv.item_type, kv.count) == (VT.ARRAY, item, len(items)), key
        got = kv.value if item == VT.STRING else kv.value.tolist()
        want = [_expected(item, v) for v in items]
        assert got == want, key
        assert kv.head(2) == want[:2], key


def test_our_writer_round_trips_every_value_and_tensor_type_through_our_reader(tmp_path: Path) -> None:
    specs, data = _tensors()
    path = tmp_path / "all.gguf"
    write_gguf(path, _metadata(), specs, data)
    with open_gguf(path) as model:
        f = model.files[0]
        _check_our_values(f)
        assert [t.name for t in model.tensors] == [s.name for s in specs]
        for spec, raw, info in zip(specs, data, model.tensors):
            assert info.ggml_type == spec.ggml_type
            assert info.shape == spec.shape and info.ne == tuple(reversed(spec.shape))
            assert bytes(model.raw(info)) == raw
            assert model.data(info).tobytes() == raw
            assert info.offset % f.alignment == 0


def test_gguf_py_reader_reads_our_file_identically(tmp_path: Path) -> None:
    specs, data = _tensors()
    path = tmp_path / "all.gguf"
    write_gguf(path, _metadata(), specs, data)
    reader = gguf.GGUFReader(path)
    for key, vtype, value in SCALARS:
        field = reader.fields[key]
        assert field.types == [vtype]
        assert field.contents() == _expected(vtype, value), key
    for key, item, items in ARRAYS:
        field = reader.fields[key]
        assert field.types == [VT.ARRAY, item]
        assert field.contents() == [_expected(item, v) for v in items], key
    assert [t.name for t in reader.tensors] == [s.name for s in specs]
    for spec, raw, t in zip(specs, data, reader.tensors):
        assert t.tensor_type == spec.ggml_type
        assert tuple(int(d) for d in t.shape) == tuple(reversed(spec.shape))
        assert t.data.tobytes() == raw


def test_files_written_by_gguf_py_read_identically_with_ours(tmp_path: Path) -> None:
    path = tmp_path / "gguf_py.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for key, vtype, value in SCALARS:
        if vtype == VT.STRING and not value:
            continue  # gguf-py's writer drops empty strings (reference/convert.md §4)
        w.add_key_value(key, value, vtype)
    for key, item, items in ARRAYS:
        w.add_key_value(key, items, VT.ARRAY, sub_type=item)
    specs, data = _tensors()
    for spec, raw in zip(specs, data):
        # gguf-py takes quantized data as uint8 rows and derives the element shape from the byte shape.
        w.add_tensor(spec.name, np.frombuffer(raw, dtype=np.uint8).reshape(spec.shape[0], -1).copy(),
                     raw_dtype=spec.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    with open_gguf(path) as model:
        f = model.files[0]
        assert list(f.kv) == [k for k in reader.fields if not k.startswith("GGUF.")]
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            ours = f.kv[key].value
            ours = ours.tolist() if isinstance(ours, np.ndarray) else ours
            assert ours == field.contents(), key
        for spec, raw, info, theirs in zip(specs, data, model.tensors, reader.tensors):
            assert (info.name, info.ggml_type, info.shape) == (spec.name, spec.ggml_type, spec.shape)
            assert info.offset == theirs.data_offset - f.data_offset
            assert bytes(model.raw(info)) == raw


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                       GGMLQuantizationType.I32, GGMLQuantizationType.F64])
def test_plain_tensors_are_numpy_views_in_numpy_shape(tmp_path: Path, ggml_type: GGMLQuantizationType) -> None:
    dtype = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.I32: "<i4",
             GGMLQuantizationType.F64: "<f8"}[ggml_type]
    arr = np.arange(2 * 3 * 8).reshape(2, 3, 8).astype(dtype)
    path = tmp_path / "v.gguf"
    write_gguf(path, Metadata(), [TensorSpec("x", ggml_type, arr.shape)], [arr])
    with open_gguf(path) as model:
        view = model.data(model["x"])
        assert view.dtype == np.dtype(dtype) and view.shape == (2, 3, 8)
        np.testing.assert_array_equal(view, arr)
        assert not view.flags.owndata and not view.flags.writeable


def test_quantized_tensor_view_has_row_bytes_as_last_axis(tmp_path: Path) -> None:
    t = GGMLQuantizationType.Q4_K
    shape = (2, 3, 512)
    raw = random_tensor_bytes(t, shape, seed=1)
    path = tmp_path / "q.gguf"
    write_gguf(path, Metadata(), [TensorSpec("q", t, shape)], [raw])
    with open_gguf(path) as model:
        view = model.data(model["q"])
        assert view.shape == (2, 3, 2 * GGML_QUANT_SIZES[t][1]) and view.dtype == np.uint8
        assert view.tobytes() == raw


def test_string_array_is_not_decoded_when_the_file_is_opened(tmp_path: Path) -> None:
    meta = Metadata()
    meta.set("tokenizer.ggml.tokens", VT.ARRAY, [f"tok{i}" for i in range(5000)], VT.STRING)
    path = tmp_path / "vocab.gguf"
    write_gguf(path, meta, [], [])
    with GGUFFile(path) as f:
        kv = f.kv["tokenizer.ggml.tokens"]
        assert kv.count == 5000 and kv.head(3) == ["tok0", "tok1", "tok2"]
        assert kv._value is not None and kv._value.__class__.__name__ == "_Unset"  # still lazy after head()
        assert kv.value[4999] == "tok4999"


def test_membership_of_a_missing_tensor_is_false_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, Metadata(), [TensorSpec("a", GGMLQuantizationType.F32, (4,))], [np.zeros(4, np.float32)])
    with open_gguf(path) as model:
        assert "a" in model and "missing" not in model
