"""PowerInfer outputs (reference/powerinfer.md §2-§4): OPT in PowerInfer's layout, and predictor merges for
ReLU LLaMA and OPT, checked against what PowerInfer's loader requires: the PWRI magic, the exact tensor set
(nothing missing, nothing extra), shapes, dtypes and keys. OPT logits go through ggufkit's evaluator (there
is no OPT in llama.cpp) and are compared with transformers'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures_models import TOKENS, make_checkpoint, make_predictor, transformers_logits

from ggufkit.converters import convert
from ggufkit.errors import CheckpointError, UsageError
from ggufkit.format import open_gguf
from ggufkit.format.values import VT

N_LAYER, N_EMBD, N_FF = 2, 64, 128


@pytest.fixture(scope="module")
def relu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ReluLLaMA-shaped checkpoint: LLaMA with a ReLU FFN and an untied head."""
    return make_checkpoint(tmp_path_factory.mktemp("relu_llama"), "LlamaForCausalLM", hidden_act="relu")


@pytest.fixture(scope="module")
def opt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("opt"), "OPTForCausalLM")


def _types(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open_gguf(path) as m:
        return {t.name: (t.type_name, t.ne) for t in m.tensors}


def _expected_llama(r: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """powerinfer.md §2.3, LLaMA: 3 + 11 L tensors, f16 outtype."""
    out = {"token_embd.weight": ("F16", (N_EMBD, 320)), "output_norm.weight": ("F32", (N_EMBD,)),
           "output.weight": ("F16", (N_EMBD, 320))}
    for b in range(N_LAYER):
        out.update({
            f"blk.{b}.attn_norm.weight": ("F32", (N_EMBD,)), f"blk.{b}.attn_q.weight": ("F16", (N_EMBD, N_EMBD)),
            f"blk.{b}.attn_k.weight": ("F16", (N_EMBD, 32)), f"blk.{b}.attn_v.weight": ("F16", (N_EMBD, 32)),
            f"blk.{b}.attn_output.weight": ("F16", (N_EMBD, N_EMBD)), f"blk.{b}.ffn_norm.weight": ("F32", (N_EMBD,)),
            f"blk.{b}.ffn_gate.weight": ("F16", (N_EMBD, N_FF)), f"blk.{b}.ffn_up.weight": ("F16", (N_EMBD, N_FF)),
            f"blk.{b}.ffn_down_t.weight": ("F16", (N_EMBD, N_FF)), f"blk.{b}.fc1.weight": ("F16", (N_EMBD, r)),
            f"blk.{b}.fc2.weight": ("F16", (r, N_FF)),
        })
    return out


def test_relu_llama_with_predictor_is_a_powerinfer_file_with_exactly_the_loader_tensors(
        relu_llama: Path, tmp_path: Path) -> None:
    pred = make_predictor(tmp_path / "pred", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, rank=32, threshold=0.25)
    out = convert(relu_llama, tmp_path / "m.powerinfer.gguf", outtype="f16", predictor=pred).outputs[0]
    assert out.read_bytes()[:4] == b"PWRI"
    assert _types(out) == _expected_llama(32)
    with open_gguf(out) as m:
        for key in ("llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
                    "llama.attention.head_count", "llama.block_count"):
            assert m.kv[key].type == VT.UINT32, key
        assert m.kv["llama.attention.layer_norm_rms_epsilon"].type == VT.FLOAT32
        assert m.kv["powerinfer.sparse_threshold"].type == VT.FLOAT32 and m.get("powerinfer.sparse_threshold") == 0.25
        assert m.get("llama.rope.dimension_count") == N_EMBD // 4
        assert m.get("tokenizer.ggml.model") == "llama" and "<0x0A>" in m.get("tokenizer.ggml.tokens")
        # ffn_down_t is HF's down_proj transposed: one FFN neuron per row.
        from safetensors.numpy import load_file

        down = load_file(str(relu_llama / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
        np.testing.assert_array_equal(m.data(m["blk.1.ffn_down_t.weight"]), down.T.astype(np.float16))


def test_f32_powerinfer_file_keeps_ffn_down_t_f16_and_gives_transformers_logits(relu_llama: Path,
                                                                                 tmp_path: Path) -> None:
    import torch

    from ggufkit.eval import load_model

    # PowerInfer's CPU axpy kernel reads ffn_down_t rows as fp16 whatever their type.
    pred = make_predictor(tmp_path / "pred", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF)
    out = convert(relu_llama, tmp_path / "m.gguf", outtype="f32", predictor=pred).outputs[0]
    types = _types(out)
    assert types["blk.0.ffn_down_t.weight"][0] == "F16" and types["blk.0.ffn_up.weight"][0] == "F32"
    # The dense forward pass of the PowerInfer file (ReLU FFN through ffn_down_t) is transformers' model;
    # the F16 down projection bounds the difference.
    want = transformers_logits(relu_llama)
    got = load_model(out, device="cpu").logits(torch.tensor([TOKENS]))[0].numpy()
    assert np.abs(got - want).max() < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize(("kwargs", "mutate", "message"), [
    ({}, lambda d: (d / "model_1.pt").unlink(), r"predictor layers missing for blocks \[1\]"),
    ({}, lambda d: (d / "model_2.pt").write_bytes((d / "model_0.pt").read_bytes()),
     r"predictor has files for blocks \[2\]"),
    ({"extra_keys": True}, None, r"expected exactly fc1.weight and fc2.weight"),
    ({"n_ff": N_FF * 2}, None, r"fc2.weight has shape \[256, 32\], expected \[n_ff=128, rank\]"),
    ({"n_embd": 32}, None, r"fc1.weight has shape \[32, 32\], expected \[rank, n_embd=64\]"),
    ({}, lambda d: (d / "notes.pt").write_bytes(b""), r"unexpected predictor file notes.pt"),
])
def test_bad_predictor_is_refused_before_anything_is_written(relu_llama: Path, tmp_path: Path, kwargs: dict,
                                                             mutate, message: str) -> None:
    args = {"n_layer": N_LAYER, "n_embd": N_EMBD, "n_ff": N_FF, **kwargs}
    pred = make_predictor(tmp_path / "pred", **args)
    if mutate is not None:
        mutate(pred)
    with pytest.raises(CheckpointError, match=message):
        convert(relu_llama, tmp_path / "out.gguf", outtype="f16", predictor=pred)
    assert not (tmp_path / "out.gguf").exists()


def test_predictor_for_a_silu_model_is_refused(tmp_path: Path) -> None:
    silu = make_checkpoint(tmp_path / "silu", "LlamaForCausalLM")
    pred = make_predictor(tmp_path / "pred", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF)
    with pytest.raises(CheckpointError, match=r"needs a ReLU-family model .* activation 'silu'"):
        convert(silu, tmp_path / "out.gguf", predictor=pred)


def test_predictor_for_an_architecture_powerinfer_cannot_load_is_refused(tmp_path: Path) -> None:
    qwen = make_checkpoint(tmp_path / "q", "Qwen2ForCausalLM", hidden_act="relu")
    pred = make_predictor(tmp_path / "pred", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF)
    with pytest.raises(UsageError, match="PowerInfer has no sparse loader for Qwen2ForCausalLM"):
        convert(qwen, tmp_path / "out.gguf", predictor=pred)


def _expected_opt(n_vocab: int, rank: int | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """powerinfer.md §3: OPT's tensors (no output.weight; the full 2050-row position table)."""
    ff = 256
    out = {"token_embd.weight": ("F16", (N_EMBD, n_vocab)), "position_embd.weight": ("F32", (N_EMBD, 2050)),
           "output_norm.weight": ("F32", (N_EMBD,)), "output_norm.bias": ("F32", (N_EMBD,))}
    for b in range(N_LAYER):
        for t in ("attn_norm", "ffn_norm"):
            out[f"blk.{b}.{t}.weight"] = ("F32", (N_EMBD,))
            out[f"blk.{b}.{t}.bias"] = ("F32", (N_EMBD,))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out[f"blk.{b}.{t}.weight"] = ("F16", (N_EMBD, N_EMBD))
            out[f"blk.{b}.{t}.bias"] = ("F32", (N_EMBD,))
        out[f"blk.{b}.ffn_up.weight"] = ("F16", (N_EMBD, ff))
        out[f"blk.{b}.ffn_up.bias"] = ("F32", (ff,))
        out[f"blk.{b}.ffn_down_t.weight"] = ("F16", (N_EMBD, ff))
        out[f"blk.{b}.ffn_down_t.bias"] = ("F32", (N_EMBD,))
        if rank is not None:
            out[f"blk.{b}.fc1.weight"] = ("F16", (N_EMBD, rank))
            out[f"blk.{b}.fc2.weight"] = ("F16", (rank, ff))
    return out


def test_opt_is_written_in_powerinfer_layout_and_gives_transformers_logits(opt: Path, tmp_path: Path) -> None:
    import torch

    from ggufkit.eval import load_model

    f16 = convert(opt, tmp_path / "opt-f16.gguf", outtype="f16").outputs[0]
    assert f16.read_bytes()[:4] == b"GGUF"
    assert _types(f16) == _expected_opt(400, None)
    with open_gguf(f16) as m:
        assert m.get("general.architecture") == "opt" and m.get("opt.feed_forward_length") == 256
        assert m.kv["opt.attention.layer_norm_epsilon"].type == VT.FLOAT32
        assert m.get("tokenizer.ggml.model") == "gpt2" and m.get("tokenizer.ggml.merges")
    f32 = convert(opt, tmp_path / "opt-f32.gguf", outtype="f32").outputs[0]
    want = transformers_logits(opt)
    got = load_model(f32, device="cpu").logits(torch.tensor([TOKENS]))[0].numpy()
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_opt_with_predictor_has_exactly_the_sparse_loader_tensors(opt: Path, tmp_path: Path) -> None:
    pred = make_predictor(tmp_path / "pred", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=256, rank=48, threshold=None)
    out = convert(opt, tmp_path / "opt.powerinfer.gguf", outtype="f16", predictor=pred).outputs[0]
    assert out.read_bytes()[:4] == b"PWRI"
    assert _types(out) == _expected_opt(400, 48)
    with open_gguf(out) as m:
        assert "powerinfer.sparse_threshold" not in m.kv  # only written when the predictor config has one
