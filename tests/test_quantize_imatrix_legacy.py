"""The legacy ``.dat`` imatrix is read once (ggufkit.quant.imatrix.files), as llama.cpp's
``common_imatrix_load_legacy`` reads it, for both of its users: llama-quantize's ``load_imatrix`` (quantize
--imatrix) and llama-imatrix's ``IMatrixCollector::load_imatrix`` (imatrix --in-file).

Its trailing data (chunk count, dataset name) is optional, and a C++ ``in.read`` that hits the end of the file
keeps the bytes it got: 1 to 3 trailing bytes are a chunk count of those bytes, a cut dataset name is dropped,
and bytes after the dataset name are ignored. Oracles: llama-quantize and llama-imatrix built from the
llama.cpp vendored in llama-cpp-python 0.3.36, given the same files.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_quantize import make_llama_gguf
from llama_cpp_sources import tool_path
from test_quantize_options_oracle import assert_same_file, llama_quantize_bin

from ggufkit.format import open_gguf
from ggufkit.quant.imatrix.collector import read_raw_imatrix
from ggufkit.quant.imatrix.reader import load_imatrix
from ggufkit.quant.llama_quantize.pipeline import quantize_file

CTX = 64


def _i32(v: int) -> bytes:
    return struct.pack("<i", v)


#: trailing bytes after the last entry -> (chunk count, datasets) as common_imatrix_load_legacy reads them
TRAILERS: dict[str, tuple[bytes, int, tuple[str, ...]]] = {
    "none": (b"", 0, ()),
    "one-byte": (b"\x07", 7, ()),
    "three-bytes": (b"\x07\x01\x00", 263, ()),
    "count-only": (_i32(5), 5, ()),
    "cut-length": (_i32(5) + b"\x04\x00", 5, ()),
    "zero-length": (_i32(5) + _i32(0) + b"wiki", 5, ()),
    "cut-name": (_i32(5) + _i32(8) + b"wiki", 5, ()),
    "name": (_i32(5) + _i32(4) + b"wiki", 5, ("wiki",)),
    "name-with-nul-and-more": (_i32(5) + _i32(6) + b"wi\0ki!" + b"junk", 5, ("wi",)),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("legacy")
    model = make_llama_gguf(d / "m.gguf", n_layer=1, n_vocab=256)
    rng = np.random.default_rng(4)
    parts = []
    with open_gguf(model) as m:
        weights = [t for t in m.tensors if len(t.ne) == 2]
    for t in weights:  # save_imatrix_legacy: mean * ncall per value
        raw = t.name.encode()
        values = (rng.gamma(0.5, 2.0, t.ne[0]) * 3).astype("<f4")
        parts += [_i32(len(raw)), raw, _i32(3), _i32(values.size), values.tobytes()]
    body = _i32(len(weights)) + b"".join(parts)
    out = {"model": model, "dir": d}
    for case, (trailer, _, _) in TRAILERS.items():
        out[case] = d / f"{case}.dat"
        out[case].write_bytes(body + trailer)
    return out


@pytest.mark.parametrize("case", list(TRAILERS))
def test_both_readers_read_the_trailing_data_as_llama_cpp(files, case):
    _, chunk_count, datasets = TRAILERS[case]
    raw, im = read_raw_imatrix(files[case]), load_imatrix(files[case])
    assert (raw.chunk_count, raw.datasets) == (chunk_count, datasets)
    assert (im.chunk_count, im.datasets) == (chunk_count, datasets)
    assert raw.entries.keys() == im.entries.keys() == read_raw_imatrix(files["none"]).entries.keys()


@pytest.mark.parametrize("case", ["one-byte", "three-bytes", "cut-length", "cut-name", "name-with-nul-and-more"])
def test_quantize_with_a_legacy_imatrix_equals_llama_quantize(files, tmp_path, case):
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    res = llama_quantize_bin(files["model"], ref, "q4_0", "--imatrix", str(files[case]))
    assert res.returncode == 0, res.stderr[-1500:]
    quantize_file(files["model"], ours, "q4_0", imatrix=files[case])
    assert_same_file(ref, ours)
    with open_gguf(ours) as m:  # the chunk count is written when positive, the dataset when there is one
        assert m.get("quantize.imatrix.chunks_count") == TRAILERS[case][1]


@pytest.mark.parametrize("case", ["one-byte", "three-bytes", "cut-name", "name-with-nul-and-more"])
def test_imatrix_in_file_with_a_legacy_imatrix_equals_llama_imatrix(files, tmp_path, case):
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    r = subprocess.run([str(tool_path("llama-imatrix")), "-m", str(files["model"]), "--in-file", str(files[case]),
                        "-c", str(CTX), "-o", str(ref), "--no-repack"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    result = invoke("imatrix", "--in-file", str(files[case]), "-c", str(CTX), "-o", str(ours))
    assert result.exit_code == 0, result.stderr
    assert ours.read_bytes() == ref.read_bytes()
