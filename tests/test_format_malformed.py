"""The reader distrusts its input: a corpus of crafted files and a fuzzer, all ending in GGUFFormatError.

Every case also runs under tracemalloc: a file of a few hundred bytes that declares 2^63 items must be
refused before anything of that size is allocated (gguf 0.19's reader hangs on such a file).
"""

from __future__ import annotations

import contextlib
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_builders import RawGGUF, gstr, kv_str, kv_u32, tensor_info, u32, u64, valid_raw
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufkit.errors import GGUFFormatError
from ggufkit.format import GGUFFile, open_gguf
from ggufkit.format.values import VT
from ggufkit.verify import verify

F32 = int(gguf.GGMLQuantizationType.F32)
Q4_0 = int(gguf.GGMLQuantizationType.Q4_0)
BIG = 2**63
#: No case may allocate more than this while failing.
MAX_ALLOC = 8 << 20


def _open_fully(path: Path) -> None:
    """Open and decode everything, as `ggufkit verify` does."""
    with open_gguf(path) as model:
        for f in model.files:
            for kv in f.iter_kv():
                _ = kv.value
        for t in model.tensors:
            model.data(t)


def _expect_format_error(tmp_path: Path, data: bytes, match: str) -> GGUFFormatError:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFFormatError, match=match) as info:
            _open_fully(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_ALLOC
    return info.value


def _with(**changes: object) -> bytes:
    raw = valid_raw()
    for k, v in changes.items():
        setattr(raw, k, v)
    return raw.build()


def test_the_valid_base_file_opens(tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(valid_raw().build())
    with open_gguf(path) as model:
        assert [t.name for t in model.tensors] == ["a", "b"]
        np.testing.assert_array_equal(model.data(model["a"]).reshape(-1), np.arange(16, dtype=np.float32))
    assert verify(path).ok


def test_every_truncation_of_a_valid_file_is_a_format_error(tmp_path: Path) -> None:
    full = valid_raw().build()
    data_end = len(full) - 16  # the last 16 bytes are padding after tensor b: truncating there is harmless
    for n in range(data_end):
        err = _expect_format_error(tmp_path, full[:n], "truncated|too short|outside|past the end|exceeds|"
                                                       "cannot fit|needs")
        assert err.offset is not None or n < 4


# (name, bytes, message): each builds a file with exactly one thing wrong.
def _cases() -> list[tuple[str, Callable[[], bytes], str]]:
    ok_kvs = valid_raw().kvs
    ok_infos = valid_raw().infos
    return [
        ("bad magic", lambda: _with(magic=b"GGML"), "invalid magic"),
        ("version 1", lambda: _with(version=1), "unsupported GGUF version 1"),
        ("big-endian", lambda: _with(version=0x03000000), "big-endian"),
        ("n_kv near 2^63", lambda: _with(n_kv=BIG), "KV count 9223372036854775808 cannot fit"),
        ("n_tensors near 2^63", lambda: _with(n_tensors=BIG - 1), "tensor count .* cannot fit"),
        ("key length 2^63", lambda: _with(kvs=[u64(BIG) + b"x"]), "key length .* exceeds"),
        ("string length 2^63", lambda: _with(kvs=[gstr("k") + u32(int(VT.STRING)) + u64(BIG)]),
         "value of 'k' length .* exceeds"),
        ("u8 array of 2^63 (the 43-byte hang)",
         lambda: _with(kvs=[gstr("k") + u32(int(VT.ARRAY)) + u32(int(VT.UINT8)) + u64(BIG)], infos=[], data=b""),
         "array of 9223372036854775808 u8 needs"),
        ("string array of 2^63",
         lambda: _with(kvs=[gstr("k") + u32(int(VT.ARRAY)) + u32(int(VT.STRING)) + u64(BIG)]),
         "array of .* strings cannot fit"),
        ("string item length 2^63",
         lambda: _with(kvs=[gstr("k") + u32(int(VT.ARRAY)) + u32(int(VT.STRING)) + u64(1) + u64(BIG)]),
         "item 0 of 'k': length .* exceeds"),
        ("unknown value type", lambda: _with(kvs=[gstr("k") + u32(13) + u32(0)]), "unknown value type 13"),
        ("unknown array item type", lambda: _with(kvs=[gstr("k") + u32(int(VT.ARRAY)) + u32(99) + u64(0)]),
         "unknown array item type 99"),
        ("array nested in an array",
         lambda: _with(kvs=[gstr("k") + u32(int(VT.ARRAY)) + u32(int(VT.ARRAY)) + u64(1)
                            + u32(int(VT.STRING)) + u64(1) + gstr("x")]), "nested arrays"),
        ("bad UTF-8 in a key", lambda: _with(kvs=[kv_str(b"k\xff", "v")]), "key is not valid UTF-8"),
        ("bad UTF-8 in a string", lambda: _with(kvs=[kv_str("k", b"\xc3\x28")]), "value of 'k' is not valid UTF-8"),
        ("bad UTF-8 in a string array",
         lambda: _with(kvs=[gstr("k") + u32(int(VT.ARRAY)) + u32(int(VT.STRING)) + u64(2) + gstr("ok")
                            + gstr(b"\xed\xa0\x80")]), "item 1 of 'k' is not valid UTF-8"),
        ("duplicate key", lambda: _with(kvs=[kv_u32("k", 1), kv_u32("k", 2)]), "duplicate key 'k'"),
        ("alignment 0", lambda: _with(kvs=[*ok_kvs, kv_u32("general.alignment", 0)]), "not a power of two"),
        ("alignment 48", lambda: _with(kvs=[*ok_kvs, kv_u32("general.alignment", 48)]), "48 is not a power of two"),
        ("alignment 2^31", lambda: _with(kvs=[*ok_kvs, kv_u32("general.alignment", 2**31)]), "not a power of two up"),
        ("alignment of type str", lambda: _with(kvs=[*ok_kvs, kv_str("general.alignment", "32")]),
         "general.alignment has type str, expected u32"),
        ("5 dimensions", lambda: _with(infos=[tensor_info("a", [1, 1, 1, 1, 16], F32, 0)]),
         "has 5 dimensions"),
        ("0 dimensions", lambda: _with(infos=[tensor_info("a", [], F32, 0)]), "has 0 dimensions"),
        ("dimension of 2^63", lambda: _with(infos=[tensor_info("a", [BIG, 1], F32, 0)]), "does not fit in int64"),
        ("dimension product overflows", lambda: _with(infos=[tensor_info("a", [2**32, 2**32], F32, 0)]),
         "element count overflows"),
        ("unknown tensor type", lambda: _with(infos=[tensor_info("a", [16], 4, 0)]), "unknown type id 4"),
        ("tensor type id 99", lambda: _with(infos=[tensor_info("a", [16], 99, 0)]), "unknown type id 99"),
        ("row not a whole block", lambda: _with(infos=[tensor_info("a", [33], Q4_0, 0)]), "not a multiple of"),
        ("tensor name of 64 bytes", lambda: _with(infos=[tensor_info("n" * 64, [16], F32, 0)]), "ggml allows"),
        ("bad UTF-8 in a tensor name", lambda: _with(infos=[gstr(b"\xff") + u32(1) + u64(4) + u32(F32) + u64(0)]),
         "tensor name is not valid UTF-8"),
        ("duplicate tensor name", lambda: _with(infos=[ok_infos[0], tensor_info("a", [4], F32, 64)]),
         "duplicate tensor name 'a'"),
        ("tensor past the end", lambda: _with(infos=[ok_infos[0], tensor_info("b", [4], F32, 96)]),
         "lies outside the 96-byte data section"),
        ("tensor offset near 2^64", lambda: _with(infos=[ok_infos[0], tensor_info("b", [4], F32, 2**64 - 32)]),
         "lies outside"),
        ("overlapping tensors", lambda: _with(infos=[ok_infos[0], tensor_info("b", [4], F32, 32)]),
         "tensors 'a' and 'b' overlap"),
        ("misaligned tensor", lambda: _with(infos=[ok_infos[0], tensor_info("b", [4], F32, 72)]),
         "data offset 72 is not a multiple of the alignment 32"),
    ]


@pytest.mark.parametrize("name, build, match", _cases(), ids=[c[0] for c in _cases()])
def test_malformed_file_raises_format_error_naming_the_problem(tmp_path: Path, name: str,
                                                               build: Callable[[], bytes], match: str) -> None:
    _expect_format_error(tmp_path, build(), match)


def test_format_error_names_the_byte_offset(tmp_path: Path) -> None:
    err = _expect_format_error(tmp_path, _with(version=7), "unsupported")
    assert err.offset == 4 and "at byte 4" in str(err) and str(tmp_path / "bad.gguf") in str(err)


def test_big_endian_file_from_gguf_py_gets_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("x", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFormatError, match="big-endian GGUF files are not supported"):
        GGUFFile(path)


def test_version_2_files_are_read(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    path.write_bytes(_with(version=2))
    with open_gguf(path) as model:
        assert model.files[0].version == 2 and model.get("llama.context_length") == 64


def test_powerinfer_magic_is_read_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "pwri.gguf"
    path.write_bytes(_with(magic=b"PWRI"))
    with open_gguf(path) as model:
        assert model.is_powerinfer and model.magic == b"PWRI" and len(model) == 2


def test_directories_and_fifos_are_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo):
        with pytest.raises(GGUFFormatError, match="not a regular file"):
            open_gguf(path)


def test_empty_and_tiny_files_are_format_errors(tmp_path: Path) -> None:
    for data in (b"", b"GG", b"GGUF"):
        _expect_format_error(tmp_path, data, "too short|truncated")


def _fuzz_base() -> bytes:
    # the valid file plus a string array and a numeric array, so mutations reach the array paths too
    raw = valid_raw()
    raw.kvs.append(gstr("tokenizer.ggml.tokens") + u32(int(VT.ARRAY)) + u32(int(VT.STRING)) + u64(3)
                   + gstr("<s>") + gstr("é") + gstr(""))
    raw.kvs.append(gstr("tokenizer.ggml.token_type") + u32(int(VT.ARRAY)) + u32(int(VT.INT32)) + u64(3)
                   + u32(1) + u32(1) + u32(3))
    return raw.build()


_BASE = _fuzz_base()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(_BASE) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.integers(0, len(_BASE)))
def test_fuzzed_files_open_or_raise_format_error(tmp_path: Path, edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(_BASE)
    for pos, byte in edits:
        data[pos] = byte
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(data[:cut]) if cut > 0 else bytes(data))
    tracemalloc.start()
    try:
        with contextlib.suppress(GGUFFormatError):
            _open_fully(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_ALLOC


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=200), version=st.sampled_from([2, 3]))
def test_random_bodies_after_a_valid_magic_raise_format_error_or_open(tmp_path: Path, body: bytes,
                                                                     version: int) -> None:
    path = tmp_path / "rand.gguf"
    path.write_bytes(RawGGUF(version=version).magic + u32(version) + body)
    with contextlib.suppress(GGUFFormatError):
        _open_fully(path)
