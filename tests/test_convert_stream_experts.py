"""A stacked expert tensor is converted and written one expert at a time (issue 32, "Scale").

An FP8 MoE release dequantizes to float32 before any outtype; stacking a layer's experts first (DeepSeek-V3:
256 x 2048 x 7168) made the conversion's memory the whole stack in float32 and its encoded copy. The stream now
hands the writer each expert's rows (a contiguous slice of the stacked tensor's bytes in every GGUF type) and
big tensors in row blocks, so the numpy memory of a conversion stays below one stacked tensor. The bytes are
still llama.cpp's converter's.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from fixtures_models import make_checkpoint
from gguf import GGMLQuantizationType
from test_convert_archs import llama_cpp_convert
from test_convert_fp8 import assert_same_file, store_fp8

from ggufkit.converters import stream
from ggufkit.converters.plan import build_plan, open_source
from ggufkit.converters.write import write_plan
from ggufkit.errors import GGUFKitError
from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.format.values import VT

N_EXPERT, HIDDEN, EXPERT_FF = 32, 256, 512
#: one layer's stacked gate (or up, or down) tensor as float32, as the old stream built it
STACK_F32 = N_EXPERT * EXPERT_FF * HIDDEN * 4


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE release stored as the FP8 releases store it (bf16, 128x128 block scales), 32 experts."""
    root = tmp_path_factory.mktemp("stream-experts")
    d = make_checkpoint(root / "m", "Qwen3MoeForCausalLM", dtype="bfloat16", vocab="real:gpt-2",
                        hidden_size=HIDDEN, moe_intermediate_size=EXPERT_FF, num_experts=N_EXPERT,
                        num_experts_per_tok=2, head_dim=64)
    return store_fp8(d)


def convert_traced(d: Path, out: Path, outtype: str) -> int:
    """Convert ``d`` as ``ggufkit convert`` does; the peak of the memory traced while the tensors are written."""
    src = open_source(d, False)
    try:
        plan = build_plan(src, outtype=outtype, predictor=None, vocab_only=False, output=out, metadata_file=None,
                          pre_tokenizer=None, mtp=None)
        tracemalloc.start()
        try:
            write_plan(plan, src.model_dir, 0.0)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        assert src.checkpoint is not None
        src.checkpoint.close()


@pytest.fixture(scope="module")
def theirs_bf16(fp8_moe: Path) -> Path:
    return llama_cpp_convert(fp8_moe, fp8_moe.parent / "theirs-bf16.gguf", "bf16")


def test_fp8_experts_stream_one_at_a_time(fp8_moe: Path, theirs_bf16: Path, tmp_path: Path) -> None:
    """FP8 -> BF16: the numpy memory of the write stays below one stacked float32 tensor (the old stream held
    that and its bf16 copy: 43.8 MB traced against 10.9 MB now), and the file is llama.cpp's converter's."""
    ours = tmp_path / "ours-bf16.gguf"
    peak = convert_traced(fp8_moe, ours, "bf16")
    with open_gguf(ours) as f:
        assert f["blk.0.ffn_gate_exps.weight"].shape == (N_EXPERT, EXPERT_FF, HIDDEN)
    assert peak < STACK_F32, (peak, STACK_F32)
    assert_same_file(theirs_bf16, ours)


def test_blocks_of_every_tensor_give_the_same_bytes(fp8_moe: Path, theirs_bf16: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4096 elements: every tensor (the bf16 embeddings passed through, the dequantized attention,
    each expert) reaches the writer in several pieces. BF16 is llama.cpp's converter's file; Q8_0 is the file
    of whole tensors (the experts' one at a time)."""
    whole = tmp_path / "whole-q8_0.gguf"  # every tensor of this model is below PIECE_ELEMENTS: one buffer each
    convert_traced(fp8_moe, whole, "q8_0")
    monkeypatch.setattr(stream, "PIECE_ELEMENTS", 4096)
    convert_traced(fp8_moe, tmp_path / "ours-bf16.gguf", "bf16")
    assert_same_file(theirs_bf16, tmp_path / "ours-bf16.gguf")
    convert_traced(fp8_moe, tmp_path / "ours-q8_0.gguf", "q8_0")
    assert (tmp_path / "ours-q8_0.gguf").read_bytes() == whole.read_bytes()


def test_writer_takes_a_tensor_in_pieces(tmp_path: Path) -> None:
    """``write_gguf`` data item given as an iterator of pieces: the same file as the whole buffer; pieces that
    do not add up to the tensor are refused and nothing is written."""
    a = np.arange(3 * 40, dtype=np.float32).reshape(3, 40)  # 480 bytes: padding to 32 follows each tensor
    b = np.arange(5, dtype=np.float32)
    specs = [TensorSpec("a", GGMLQuantizationType.F32, (3, 40)), TensorSpec("b", GGMLQuantizationType.F32, (5,))]
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    whole = write_gguf(tmp_path / "whole.gguf", meta, specs, [a, b])[0]
    pieces = write_gguf(tmp_path / "pieces.gguf", meta, specs, [iter([a[0], a[1:]]), iter([b[:2], b[2:].tobytes()])])[0]
    assert whole.read_bytes() == pieces.read_bytes()
    for parts in ([a[0], a[1]], [a, b]):
        with pytest.raises(GGUFKitError, match="tensor 'a'"):
            write_gguf(tmp_path / "bad.gguf", meta, specs, [iter(parts), b])
        assert not (tmp_path / "bad.gguf").exists()


def test_fp8_weight_dequantizes_in_block_rows(fp8_moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 weight's loader gives its float32 values block row by block row (one 128-row block at a time
    here), the same bits as the whole tensor, so a stream need not hold a 470 MB float32 ``o_proj``."""
    from ggufkit.converters import source_fp8

    monkeypatch.setattr(source_fp8, "PIECE_WEIGHTS", 1)
    src = open_source(fp8_moe, False)
    assert src.checkpoint is not None
    load = src.checkpoint.derived["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(load, source_fp8.Dequantized)
    parts = list(load.pieces())
    assert [p.shape[0] for p in parts] == [128, 128]
    assert np.concatenate(parts).tobytes() == load().tobytes()
