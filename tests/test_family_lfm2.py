"""Liquid LFM2 (``Lfm2ForCausalLM``, GGUF arch ``lfm2``) end to end against llama.cpp (issue 33).

LFM2 mixes short-convolution layers (``in_proj`` -> B, C, x; ``B*x``; a causal depthwise convolution of
``conv_L_cache`` taps; ``C*conv``; ``out_proj``) with GQA layers (per-head q/k RMS norms, NEOX RoPE), by the
config's schedule. Tiny random checkpoints of transformers' own class, every parameter random (the norms
1 + N(0, 0.1), tests/fixtures_models.py randomize), in two layouts:

* ``release``: config.json as Liquid's released checkpoints spell it (LiquidAI/LFM2-1.2B: ``block_*`` keys with
  ``block_ff_dim`` for the FFN width before LFM2's 2/3 adjustment, ``full_attn_idxs`` beside ``layer_types``,
  ``tie_embedding``, ``rope_theta`` at the root, ``torch_dtype``);
* ``tf5``: what transformers 5's ``save_pretrained`` writes (``intermediate_size``, ``layer_types`` only,
  ``rope_parameters``, ``dtype``).

The tokenizer is a byte-level BPE that llama.cpp's converter knows by its check hash (GPT-2's, rebuilt from
llama.cpp's vocab file): LFM2's own BPE (llama.cpp's "lfm2" hash) cannot be built without its 65k-token
vocabulary, which the tests do not download and llama.cpp does not vendor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, transformers_logits

from ggufkit.converters import convert
from ggufkit.format import open_gguf

HF_CLASSES = {"lfm2": ("Lfm2Config", "Lfm2ForCausalLM"), "lfm2moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM")}
LAYOUTS = ("release", "tf5")
#: Both layer kinds, a convolution first (its state starts empty) and attention last.
SCHEDULE = ["conv", "full_attention", "conv", "conv", "full_attention"]
_BASE: dict[str, dict[str, Any]] = {
    # intermediate_size 192 -> int(2 * 192 / 3) = 128, a multiple of block_multiple_of 32 (LFM2's adjustment)
    "lfm2": dict(hidden_size=64, intermediate_size=192, block_multiple_of=32, num_hidden_layers=len(SCHEDULE),
                 num_attention_heads=4, num_key_value_heads=2, layer_types=SCHEDULE, max_position_embeddings=128,
                 conv_L_cache=3, norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                 bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # 4 experts, top-2, one dense lead layer
    "lfm2moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=len(SCHEDULE),
                    num_dense_layers=1, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                    num_key_value_heads=2, layer_types=SCHEDULE, max_position_embeddings=128, conv_L_cache=3,
                    norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def build_model(arch: str, vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    """A randomized transformers model of ``arch`` (float32): every parameter, and LFM2-MoE's ``expert_bias``
    buffer (zeros at init) N(0, 0.1), so that the selection bias changes which experts run."""
    import torch
    import transformers
    from fixtures_models import randomize

    config_name, model_name = HF_CLASSES[arch]
    config = getattr(transformers, config_name)(**{**_BASE[arch], "vocab_size": vocab_size, **overrides})
    config.architectures = [model_name]
    model = getattr(transformers, model_name)(config)
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return model.eval()


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 config.json in the released spelling (LiquidAI/LFM2-1.2B, LFM2-8B-A1B keys)."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters", None) or {}
    dtype = config.pop("dtype", "bfloat16")
    config.update(rope_theta=rope.get("rope_theta", 1000000.0), torch_dtype=dtype, transformers_version="4.54.0")
    config["tie_embedding"] = config.pop("tie_word_embeddings", True)
    if config["model_type"] == "lfm2":
        n = config["hidden_size"]
        config["block_ff_dim"] = config.pop("intermediate_size")
        config["full_attn_idxs"] = [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"]
        config.update(block_dim=n, conv_dim=n, conv_dim_out=n, block_norm_eps=config["norm_eps"],
                      block_use_swiglu=True, block_use_xavier_init=True, block_mlp_init_scale=1.0,
                      block_out_init_scale=1.0, conv_use_xavier_init=True, num_heads=config["num_attention_heads"],
                      theta=config["rope_theta"], use_pos_enc=True)
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def make_lfm2(dir: Path, arch: str = "lfm2", layout: str = "tf5", *, config_edit: Any = None,
              **overrides: Any) -> Path:
    """A tiny checkpoint of ``arch`` in ``layout``; ``config_edit(config)`` edits its config.json last."""
    from fixtures_models import _write_tokenizer

    dir.mkdir(parents=True, exist_ok=True)
    n_tokens = _write_tokenizer(dir, "real:gpt-2")
    build_model(arch, n_tokens, **overrides).save_pretrained(dir)
    if layout == "release":
        to_release_config(dir / "config.json")
    if config_edit is not None:
        config = json.loads((dir / "config.json").read_text())
        config_edit(config)
        (dir / "config.json").write_text(json.dumps(config, indent=2))
    return dir


def llama_cpp_f32(dir: Path, arch: str = "lfm2", **overrides: Any) -> Path:
    """A tiny checkpoint converted to F32 by llama.cpp's own converter."""
    from test_convert_archs import llama_cpp_convert

    ckpt = make_lfm2(dir / "ckpt", arch, **overrides)
    return llama_cpp_convert(ckpt, dir / "f32.gguf")


# -- quantization --------------------------------------------------------------------------------------
def quant_gguf(path: Path, arch: str, *, n_layer: int = 8, d: int = 256, ff: int = 512, n_exp: int = 4,
               seed: int = 4) -> Path:
    """A GGUF as llama.cpp's converter lays out ``arch`` (its keys, per-layer KV heads, its tensors in checkpoint
    order; F16 matrices, F32 vectors and conv kernels): layers 2 and 5 attention, the others short convolutions;
    LFM2-MoE's first layer dense. Enough for llama_model_quantize, which reads only the hparams."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT

    from ggufkit.format import Metadata, TensorSpec, write_gguf

    attn = {2, 5}
    kv = d // 2
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, arch)
    u32 = {"block_count": n_layer, "context_length": 256, "embedding_length": d, "feed_forward_length": ff,
           "attention.head_count": 4, "vocab_size": 256, "shortconv.l_cache": 3}
    if arch == "lfm2moe":
        u32.update(expert_count=n_exp, expert_used_count=2, expert_feed_forward_length=ff // 2,
                   leading_dense_block_count=1, expert_gating_func=2)
    for key, value in u32.items():
        meta.set(f"{arch}.{key}", VT.UINT32, value)
    meta.set(f"{arch}.attention.head_count_kv", VT.ARRAY, [2 if il in attn else 0 for il in range(n_layer)],
             VT.INT32)
    meta.set(f"{arch}.rope.freq_base", VT.FLOAT32, 1e6)
    meta.set(f"{arch}.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-5)
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (256, d)), ("token_embd_norm.weight", (d,))]
    for il in range(n_layer):
        b = f"blk.{il}."
        if il not in attn:
            tensors += [(b + "shortconv.conv.weight", (d, 3)), (b + "shortconv.in_proj.weight", (3 * d, d)),
                        (b + "shortconv.out_proj.weight", (d, d))]
        if arch == "lfm2moe" and il >= 1:
            e = ff // 2
            tensors += [(b + "exp_probs_b.bias", (n_exp,)), (b + "ffn_gate_exps.weight", (n_exp, e, d)),
                        (b + "ffn_down_exps.weight", (n_exp, d, e)), (b + "ffn_up_exps.weight", (n_exp, e, d)),
                        (b + "ffn_gate_inp.weight", (n_exp, d))]
        else:
            tensors += [(b + "ffn_gate.weight", (ff, d)), (b + "ffn_down.weight", (d, ff)), (b + "ffn_up.weight", (ff, d))]
        tensors += [(b + "ffn_norm.weight", (d,)), (b + "attn_norm.weight", (d,))]
        if il in attn:
            tensors += [(b + "attn_k_norm.weight", (d // 4,)), (b + "attn_k.weight", (kv, d)),
                        (b + "attn_output.weight", (d, d)), (b + "attn_q_norm.weight", (d // 4,)),
                        (b + "attn_q.weight", (d, d)), (b + "attn_v.weight", (kv, d))]
    rng = np.random.default_rng(seed)
    specs, arrays = [], []
    for name, shape in tensors:
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        f32 = len(shape) == 1 or "shortconv.conv" in name
        specs.append(TensorSpec(name, QT.F32 if f32 else QT.F16, shape))
        arrays.append(arr if f32 else arr.astype(np.float16))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


# -- conversion, logits, --check -----------------------------------------------------------------------
CTX = 64
CHUNKS = 4


@pytest.fixture(scope="module", params=[(a, lay) for a in HF_CLASSES for lay in LAYOUTS], ids=lambda p: "-".join(p))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, layout = request.param
    d = make_lfm2(tmp_path_factory.mktemp(f"{arch}-{layout}") / "m", arch, layout)
    report = convert(d, d.parent / "ours.gguf", outtype="f32")
    return {"arch": arch, "layout": layout, "dir": d, "ours": report.outputs[0], "plan": report.plan}


def assert_same_file(theirs: Path, ours: Path, *, ordered: bool = True) -> None:
    from test_family_olmo2 import assert_same_file as same

    same(theirs, ours, ordered=ordered)


def test_file_equals_llama_cpps_converter(case: dict[str, Any]) -> None:
    """Every tensor byte-identical (the conv kernels squeezed to [n_embd, 3], exp_probs_b.bias), every key equal:
    head_count_kv per layer (0 on the convolution layers), the FFN width after LFM2's 2/3 adjustment."""
    from test_convert_archs import llama_cpp_convert

    theirs = llama_cpp_convert(case["dir"], case["dir"].parent / "theirs.gguf")
    assert_same_file(theirs, case["ours"])
    a = case["arch"]
    with open_gguf(case["ours"]) as f:
        assert f.architecture == a
        assert list(f.get(f"{a}.attention.head_count_kv")) == [0, 2, 0, 0, 2]
        assert f["blk.0.shortconv.conv.weight"].ne == (3, 64) and "blk.1.shortconv.in_proj.weight" not in f
        assert f.get(f"{a}.feed_forward_length") == (128 if a == "lfm2" else 96)
        assert ("blk.1.exp_probs_b.bias" in f) == (a == "lfm2moe") and "blk.0.ffn_gate_inp.weight" not in f


@pytest.mark.parametrize("arch", list(HF_CLASSES))
@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_other_outtypes_equal_llama_cpps_converter(arch: str, outtype: str, tmp_path: Path) -> None:
    """Matrices in the outtype, norms, the router bias and the conv kernels F32, byte for byte; a quantized
    outtype in llama-quantize's tensor order."""
    from test_convert_archs import llama_cpp_convert

    d = make_lfm2(tmp_path / "m", arch)
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", outtype)
    ours = convert(d, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert_same_file(theirs, ours, ordered=outtype != "q8_0")


def test_llama_cpp_logits_match_transformers(case: dict[str, Any]) -> None:
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_check_passes_and_fails_on_other_weights(case: dict[str, Any], tmp_path: Path) -> None:
    """``convert --check``: transformers' model against the evaluator's forward of the file."""
    from ggufkit.eval.convert_check import check_conversion

    ok = check_conversion(case["dir"], case["ours"], case["plan"], device="cpu")
    assert ok.status == "passed", ok.failures
    other = make_lfm2(tmp_path / "other", case["arch"], case["layout"], seed=7)
    bad = check_conversion(case["dir"], convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0],
                           case["plan"], device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


def _drop_layer_types(config: dict[str, Any]) -> None:
    config.pop("layer_types")


def _only_idxs(config: dict[str, Any]) -> None:
    config.pop("layer_types")
    config["full_attn_idxs"] = [0, 4]


def _all_conv(config: dict[str, Any]) -> None:
    config["layer_types"] = ["conv"] * len(SCHEDULE)


def test_full_attn_idxs_alone(tmp_path: Path) -> None:
    """LFM2's schedule as ``full_attn_idxs`` without ``layer_types`` (older LFM2 configs): transformers builds
    layer_types from it, and so does llama.cpp's converter, which loads the config through AutoConfig. The
    file and its logits as llama.cpp's converter and transformers have them. (The release layout writes both
    spellings, the tf5 one layer_types alone: the ``case`` fixture.)"""
    from test_convert_archs import llama_cpp_convert

    types = ["full_attention", "conv", "conv", "conv", "full_attention"]
    d = make_lfm2(tmp_path / "m", "lfm2", "release", layer_types=types, config_edit=_only_idxs)
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(llama_cpp_convert(d, tmp_path / "theirs.gguf"), ours)
    with open_gguf(ours) as f:
        assert list(f.get("lfm2.attention.head_count_kv")) == [2, 0, 0, 0, 2]
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def _no_multiplier(config: dict[str, Any]) -> None:
    config["block_ffn_dim_multiplier"] = None
    config["block_multiple_of"] = 48  # llama.cpp rounds 128 up to 144, transformers keeps 128


def _sliding(config: dict[str, Any]) -> None:
    config["layer_types"] = ["conv", "sliding_attention", "conv", "conv", "full_attention"]


def _conv_bias(config: dict[str, Any]) -> None:
    config["conv_bias"] = True


@pytest.mark.parametrize(("edit", "message"), [
    (_no_multiplier, "block_ffn_dim_multiplier null: llama.cpp's converter writes feed_forward_length 144"),
    (_sliding, "layer_types ['conv', 'sliding_attention'"),
    (_conv_bias, "conv_bias (llama.cpp's short convolution has no biases)"),
    (_drop_layer_types, "only full_attention layers"),
    (_all_conv, "only conv layers"),
], ids=["ffn-width", "layer-kind", "conv-bias", "all-attention", "all-conv"])
def test_convert_refuses_them_in_one_line_and_writes_nothing(edit: Any, message: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_lfm2(tmp_path / "m", "lfm2", config_edit=edit)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "lfm2: llama.cpp would compute another model" in err and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


# -- evaluator -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("lfm2-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def test_ppl_equals_llama_perplexity(case: dict[str, Any], text_file: tuple[str, Path], tmp_path: Path) -> None:
    """F32, and F16 with llama.cpp's F16 rounding of each matmul's input (--ggml-rounding); every chunk starts
    from an empty conv state, as llama-perplexity clears the memory."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity

    text, path = text_file
    f16 = convert(case["dir"], tmp_path / "f16.gguf", outtype="f16").outputs[0]
    for model, rounding in ((case["ours"], False), (f16, True)):
        ours = perplexity(model, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=rounding,
                          kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, CTX, CHUNKS, *F32_PATH)
        assert ours.chunks == n_chunks == CHUNKS
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(case: dict[str, Any], text_file: tuple[str, Path], tmp_path: Path) -> None:
    """The same entries as llama-imatrix (shortconv in_proj/out_proj, attention, FFN or router and experts, not
    the convolution kernel, which is no matmul), in_sum2 within float32 noise."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import F32_TOLERANCE

    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", text_file[1], "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", case["ours"], "-o", ref, *common, *F32_ATTENTION)
    ours(case["ours"], "-o", mine, *common)
    rel = relative_l2(mine, ref)
    ffn = ({"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
           if case["arch"] == "lfm2moe" else {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"})
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.3.")} == {
        "shortconv.in_proj.weight", "shortconv.out_proj.weight", *ffn}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.4.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", *ffn}
    assert not any("shortconv.conv" in n for n in rel)
    assert max(rel.values()) <= F32_TOLERANCE, rel


def test_kld_equals_llama_perplexitys(case: dict[str, Any], text_file: tuple[str, Path], tmp_path: Path) -> None:
    """KL divergence of a Q8_0 file from the F32 one as ``llama-perplexity --kl-divergence`` reports it, with its
    8-bit activation rounding reproduced (``ggml_rounding``): within 3 % (tests/test_family_olmo2.py)."""
    import re
    import subprocess

    from llama_cpp_sources import tool_path
    from test_eval_archs_vs_llama_perplexity import F32_PATH

    from ggufkit.eval import kl_divergence
    from ggufkit.quant import quantize_file

    text, path = text_file
    q8 = tmp_path / "q8.gguf"
    quantize_file(case["ours"], q8, "q8_0")
    base = tmp_path / "base.kld"

    def run(*args: str | Path) -> str:
        cmd = [str(tool_path("llama-perplexity")), "-f", str(path), "-c", str(CTX), "-b", str(CTX), "--chunks",
               str(CHUNKS), "-t", "2", "-nr", *F32_PATH, *map(str, args)]
        for _ in range(10):  # its asynchronous log sometimes loses the last lines
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-2000:]
            if "Minimum KLD" in r.stdout + r.stderr or "Final estimate" in r.stdout + r.stderr:
                return r.stdout + r.stderr
        raise AssertionError(r.stderr[-2000:])

    run("-m", case["ours"], "--kl-divergence-base", base)
    m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", run("-m", q8, "--kl-divergence-base", base, "--kl-divergence"))
    assert m is not None
    theirs = float(m.group(1))
    got = kl_divergence(q8, case["ours"], text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True,
                        kv_cache="f32").kld
    assert got is not None
    assert abs(got["mean_kld"] / theirs - 1) < 3e-2, (got["mean_kld"], theirs)


# -- the causal convolution against ggml's own ssm_conv -------------------------------------------------
def ggml_ssm_conv(sx: np.ndarray, c: np.ndarray) -> np.ndarray:
    """libggml's CPU ``ggml_ssm_conv`` (ggml-cpu/ops.cpp) through ctypes: ``sx`` float32 ``[n_seq, channels,
    d_conv - 1 + T]`` (the conv state, then the tokens, time last as llama.cpp's graph transposes ``bx``),
    kernel ``c`` ``[channels, d_conv]``; returns ``[n_seq, T, channels]``."""
    import ctypes

    from ggml_cpu_oracle import _InitParams, _libggml_base, libggml_cpu
    from ggml_oracle import GGMLQuantizationType as Q

    base, cpu = _libggml_base(), libggml_cpu()
    base.ggml_ssm_conv.restype = ctypes.c_void_p
    base.ggml_ssm_conv.argtypes = [ctypes.c_void_p] * 3
    cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    n_s, ch, n = sx.shape
    t = n - c.shape[1] + 1
    ctx = base.ggml_init(_InitParams(16 * 1024 * 1024 + 8 * (sx.size + c.size), None, False))
    try:
        def tensor(arr: np.ndarray) -> int:
            ne = list(arr.shape[::-1]) + [1] * (4 - arr.ndim)
            tt = base.ggml_new_tensor_4d(ctx, int(Q.F32), *ne)
            ctypes.memmove(base.ggml_get_data(tt), np.ascontiguousarray(arr, dtype=np.float32).ctypes.data, arr.nbytes)
            return tt

        out = base.ggml_ssm_conv(ctx, tensor(sx), tensor(c))
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, 1) == 0
        res = np.empty((n_s, t, ch), dtype=np.float32)
        ctypes.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
        return res
    finally:
        base.ggml_free(ctx)


@pytest.mark.parametrize("d_conv", [3, 4])  # LFM2's conv_L_cache, Mamba's d_conv
def test_causal_conv1d_is_ggml_ssm_conv(d_conv: int) -> None:
    """eval/layers_conv.py's causal_conv1d against libggml's ggml_ssm_conv from an empty (zero) conv state, as
    llama.cpp computes the first batch of a sequence (build_shortconv_block concatenates the cleared state and
    the tokens): the same float32 sums (up to the summation order of d_conv products)."""
    import torch

    from ggufkit.eval.layers_conv import causal_conv1d

    rng = np.random.default_rng(d_conv)
    x = rng.standard_normal((2, 37, 48)).astype(np.float32)
    w = rng.standard_normal((48, d_conv)).astype(np.float32)
    sx = np.concatenate([np.zeros((2, 48, d_conv - 1), np.float32), x.transpose(0, 2, 1)], axis=-1)
    want = ggml_ssm_conv(sx, w)
    got = causal_conv1d(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the [C, 1, K] layout of a checkpoint's Conv1d weight is the same kernel
    got3 = causal_conv1d(torch.from_numpy(x), torch.from_numpy(w)[:, None, :]).numpy()
    assert np.array_equal(got3, got)


@pytest.fixture(scope="module", params=list(HF_CLASSES))
def quant_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp(f"{request.param}-quant")
    model = quant_gguf(d / "model.gguf", request.param)
    return {"arch": request.param, "model": model,
            "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Any], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run): the conv
    kernels stay F32, and the attention-layer count its attn_v rules use is the layers with KV heads (2 of 8)."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    flags: tuple[str, ...] = ()
    options = QuantOptions(dry_run=True)
    if with_imatrix:
        flags = ("--imatrix", str(quant_model["imatrix"]))
        with open_gguf(quant_model["imatrix"]) as m:
            sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
        options = QuantOptions(dry_run=True, imatrix_sizes=sizes)
    mismatches = [t for t in TYPE_CHOICES
                  if planned_types(quant_model["model"], t, options) != dry_run_types(quant_model["model"], t, *flags)]
    assert not mismatches


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", False), ("q8_0", False),
                                                      ("q4_k_m", True), ("iq3_xxs", True)])
def test_whole_file_equals_llama_quantize(quant_model: dict[str, Any], tmp_path: Path, target: str,
                                          with_imatrix: bool) -> None:
    from fixtures_quantize import assert_same_quantized
    from test_family_olmo2 import llama_quantize_binary

    from ggufkit.quant import quantize_file

    flags = ("--imatrix", str(quant_model["imatrix"])) if with_imatrix else ()
    llama_quantize_binary(quant_model["model"], tmp_path / "ref.gguf", target, *flags)
    quantize_file(quant_model["model"], tmp_path / "ours.gguf", target,
                  imatrix=quant_model["imatrix"] if with_imatrix else None, threads=2)
    assert_same_quantized(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


# -- release -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(HF_CLASSES))
def test_release_end_to_end(arch: str, tmp_path: Path) -> None:
    """``release`` of a tiny LFM2 / LFM2-MoE in the released layout: F16 master, importance matrix
    (llama-imatrix's entries on that master), Q8_0 and Q4_K_M, card; every file loads in llama.cpp and the
    master's reported perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix

    from ggufkit.eval.perplexity import sample_text
    from ggufkit.quant.imatrix.collector import read_raw_imatrix
    from ggufkit.release import release

    wide = ({"hidden_size": 256, "intermediate_size": 384} if arch == "lfm2"
            else {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256})
    ckpt = make_lfm2(tmp_path / f"tiny-{arch}", arch, "release", **wide)
    text = tmp_path / "text.txt"
    text.write_text(sample_text()[:6000] + "\n", encoding="utf-8")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q8_0", "q4_k_m"], master="f16", imatrix_text=text, eval_text=text,
                     ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    imatrix = next(out / f for f in result.files if ".imatrix" in f)
    quants = [out / f for f in result.files if f.endswith(("-Q8_0.gguf", "-Q4_K_M.gguf"))]
    assert len(quants) == 2
    for path in (master, *quants):
        with open_gguf(path) as f:
            assert f.architecture == arch
        assert np.isfinite(llama_cpp_logits(path)).all()
    ref = tmp_path / "ref.gguf"
    llama_imatrix("-m", master, "-f", text, "-c", 64, "--chunks", 2, "-o", ref, *F32_ATTENTION)
    assert sorted(read_raw_imatrix(imatrix).entries) == sorted(read_raw_imatrix(ref).entries)
    manifest = json.loads((out / "manifest.json").read_text())
    reported = manifest["steps"]["eval-master"]["results"]["ppl"]
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    assert abs(reported / theirs - 1) < 1e-3, (reported, theirs)
