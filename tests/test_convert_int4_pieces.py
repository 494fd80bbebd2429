"""compressed-tensors weights dequantize in row pieces (issue 32, "Scale").

An INT4 release (``pack-quantized``, Kimi K2's layout) or an FP8/INT8 per-channel one (``float-quantized`` /
``int-quantized``) used to dequantize each weight whole before the stream cut it into blocks: the conversion held
one float32 tensor per weight (7168 x 18432 is 528 MB). Their loaders now give the float32 values in groups of
rows whose scales and zero points are whole, as FP8's block rows do (tests/test_convert_stream_experts.py), and the
file is still llama.cpp's converter's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fixtures_models import make_checkpoint
from test_convert_archs import llama_cpp_convert
from test_convert_compressed_tensors import store_compressed
from test_convert_fp8 import assert_same_file
from test_convert_stream_experts import convert_traced

from ggufkit.converters import source_fp8
from ggufkit.converters.plan import open_source

HIDDEN, FF = 512, 8192
#: one MLP weight (8192 x 512) as float32: what the old loader held while the stream wrote it
WHOLE_F32 = HIDDEN * FF * 4


def test_int4_weights_are_written_in_row_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kimi K2's INT4 layout (symmetric, groups of 32, bf16 scales) -> BF16 in pieces of 64 K weights: the numpy
    memory of the write stays below one whole float32 MLP weight of 16.8 MB (the old loader held it and its bf16
    copy: 42.0 MB traced, against 8.5 MB now), and the file is llama.cpp's converter's."""
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", dtype="bfloat16", hidden_size=HIDDEN,
                        intermediate_size=FF, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    store_compressed(d, "pack-quantized")
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", "bf16")
    monkeypatch.setattr(source_fp8, "PIECE_WEIGHTS", 1 << 16)
    ours = tmp_path / "ours.gguf"
    peak = convert_traced(d, ours, "bf16")
    assert peak < WHOLE_F32, (peak, WHOLE_F32)
    assert_same_file(theirs, ours)


def _wholes_and_pieces(d: Path) -> Iterator[tuple[str, np.ndarray, list[np.ndarray]]]:
    """(name, whole tensor, its pieces) of each dequantized projection weight of checkpoint ``d`` (7 of them)."""
    src = open_source(d, False)
    assert src.checkpoint is not None
    try:
        derived = {n: load for n, load in src.checkpoint.derived.items() if n.endswith("proj.weight")}
        assert len(derived) == 7
        for name, load in derived.items():
            yield name, load(), list(load.pieces())  # type: ignore[attr-defined]
    finally:
        src.checkpoint.close()


@pytest.mark.parametrize("fmt,zero_point", [("pack-quantized", True), ("pack-quantized", False),
                                            ("float-quantized", False), ("int-quantized", False)])
def test_pieces_are_the_whole_tensors_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str,
                                           zero_point: bool) -> None:
    """Each dequantizing loader's pieces, concatenated, are the bits of the whole tensor. With pieces of one
    weight: an INT4 piece is the 8 rows one int32 of the zero point packs (a k_proj of 12 rows: 8 then 4, the
    padding fields trimmed), a per-channel piece one row."""
    monkeypatch.setattr(source_fp8, "PIECE_WEIGHTS", 1)
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=1, num_key_value_heads=1, head_dim=12)
    store_compressed(d, fmt, group=16, zero_point=zero_point)
    for name, whole, parts in _wholes_and_pieces(d):
        sizes = [p.shape[0] for p in parts]
        if fmt == "pack-quantized":
            assert sizes == [8] * (whole.shape[0] // 8) + ([whole.shape[0] % 8] if whole.shape[0] % 8 else [])
        else:
            assert sizes == [1] * whole.shape[0], name
        assert np.concatenate(parts).tobytes() == whole.tobytes(), name
        if name == "model.layers.0.self_attn.k_proj.weight":
            assert whole.shape == (12, 64)


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_fp8_channel_and_tensor_scales_give_row_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        scheme: str) -> None:
    """An FP8 release with one scale per row or one per tensor (no ``weight_block_size``) also dequantizes row by
    row (it used to load each weight whole): with pieces of one weight, one row a piece, the same bits as the
    whole tensor."""
    from test_convert_fp8 import store_fp8

    monkeypatch.setattr(source_fp8, "PIECE_WEIGHTS", 1)
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=1)
    store_fp8(d, scheme=scheme)
    for name, whole, parts in _wholes_and_pieces(d):
        assert [p.shape[0] for p in parts] == [1] * whole.shape[0], name
        assert np.concatenate(parts).tobytes() == whole.tobytes(), name
