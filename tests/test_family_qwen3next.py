"""Qwen3-Next (``Qwen3NextForCausalLM``, GGUF arch ``qwen3next``) end to end against llama.cpp (issue 33).

Qwen3-Next mixes gated delta-net (linear attention) layers with gated full-attention layers and runs a
mixture-of-experts FFN with a sigmoid-gated shared expert in every block. Tiny random checkpoints of
transformers' own class: 4 layers, every 2nd full attention (``full_attention_interval`` 2, so both layer
kinds appear twice), 2 key heads and 4 value heads (the fused ``in_proj_qkvz`` split per key head and the
grouped value heads matter), 4 experts, top-2; every parameter random (A_log, dt_bias, the norms, the conv
kernel included: tests/fixtures_models.py ``randomize``), Qwen2's BPE (check hash "qwen2", the tokenizer
Qwen3-Next ships). Two config layouts:

* ``release``: config.json as Qwen/Qwen3-Next-80B-A3B-* spell it: ``full_attention_interval`` and no
  ``layer_types``, ``rope_theta`` / ``partial_rotary_factor`` at the root, ``rope_scaling`` null;
* ``tf5``: transformers 5's ``save_pretrained``: ``layer_types`` only, ``rope_parameters``.

llama.cpp's converter reads both through AutoConfig (``layer_types`` either way), writes
``attention.recurrent_layers`` from it and always ``full_attention_interval`` 4 (AutoConfig's to_dict drops the
key). A checkpoint of transformers' class has no multi-token-prediction tensors (``mtp.*``), on which llama.cpp's
converter asserts unless ``--no-mtp``; ggufkit converts it without a flag to the same file.

The evaluator (``ggufkit ppl``, ``imatrix``) is compared with llama.cpp's tools on the file llama.cpp's converter
writes; quantization on a wider file of the same layout against the llama-quantize binary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import llama_cpp_dir

HF_CLASS = "Qwen3NextForCausalLM"
LAYOUTS = ("release", "tf5")

fixtures_models._BASE.setdefault(HF_CLASS, dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, full_attention_interval=2,
    max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
    eos_token_id=151645))
fixtures_models._CLASSES.setdefault(HF_CLASS, ("Qwen3NextConfig", HF_CLASS))
fixtures_models._VOCAB.setdefault(HF_CLASS, "real:qwen2")


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 config.json in the spelling of Qwen/Qwen3-Next-80B-A3B-Instruct's."""
    config = json.loads(path.read_text())
    types = config.pop("layer_types")
    interval = types.index("full_attention") + 1
    assert types == ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(types))]
    rope = config.pop("rope_parameters")
    config.update(full_attention_interval=interval, rope_theta=rope["rope_theta"],
                  partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None, torch_dtype="bfloat16",
                  use_sliding_window=False, transformers_version="4.57.0.dev0")
    config.pop("dtype", None)
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def make_model(dir: Path, hf_class: str, layout: str, release: Any, **overrides: Any) -> Path:
    """A tiny checkpoint of ``hf_class`` in ``layout`` (``release``: ``release(config_path)`` rewrites it)."""
    d = make_checkpoint(dir, hf_class, **overrides)
    if layout == "release":
        release(d / "config.json")
    return d


def llama_cpp_convert(model: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (``--no-mtp`` unless ``flags`` say otherwise)."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype, *(flags or ("--no-mtp",))], check=True, capture_output=True, env=env)
    return out


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = request.param
    d = make_model(tmp_path_factory.mktemp(f"qwen3next-{layout}") / "m", HF_CLASS, layout, to_release_config)
    return {"layout": layout, "dir": d, "theirs": llama_cpp_convert(d, d.parent / "theirs.gguf")}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("qwen3next-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def test_the_layouts_spell_the_schedule_as_released_and_as_transformers_5_saves_it(case: dict[str, Any]) -> None:
    config = json.loads((case["dir"] / "config.json").read_text())
    if case["layout"] == "release":
        assert config["full_attention_interval"] == 2 and "layer_types" not in config
        assert config["partial_rotary_factor"] == 0.25 and "rope_parameters" not in config
    else:
        assert config["layer_types"] == ["linear_attention", "full_attention"] * 2
        assert "full_attention_interval" not in config and config["rope_parameters"]["partial_rotary_factor"] == 0.25


# -- runtime and evaluator -----------------------------------------------------------------------------
def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    """llama.cpp's file computes transformers' model: llama.cpp's fused gated delta-net op sums token by token,
    transformers' chunked rule in chunks of 64, so the tolerance is float32 noise of a scan (measured 4e-6 of
    the logit range)."""
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["theirs"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_evaluator_logits_equal_llama_cpps(case: dict[str, Any]) -> None:
    import torch
    from fixtures_models import TOKENS

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(case["theirs"])
    with load_model(case["theirs"], device="cpu") as m:
        assert m.hparams.extra["recurrent"] == (True, False, True, False)
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


def test_ppl_equals_llama_perplexity(case: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """F32 and F16 files, 4 chunks of 64 tokens, each chunk from an empty recurrent state."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity

    text, path = sample
    f16 = llama_cpp_convert(case["dir"], tmp_path / "f16.gguf", "f16")
    for model, rounding in ((case["theirs"], False), (f16, True)):
        ours = perplexity(model, text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=rounding, kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, 64, 4, *F32_PATH)
        assert ours.chunks == n_chunks == 4
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def imatrix_against_llama(model: Path, text: Path, tmp_path: Path) -> dict[str, float]:
    """``ggufkit imatrix`` and llama-imatrix on ``model``: relative L2 of ``in_sum2`` per entry (both with the
    same entries, the untied head included)."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import CHUNKS, CTX, _collectable

    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", text, "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", model, "-o", ref, *common, *F32_ATTENTION)
    ours(model, "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert set(rel) == _collectable(model)
    return rel


MOE_ENTRIES = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
               "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"}


def test_imatrix_equals_llama_imatrix(case: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """Every matmul of both layer kinds (the delta-net's attn_qkv, attn_gate, ssm_ba and ssm_out; the gated
    attention's q/k/v/output), the router, experts and shared expert, and the head: llama-imatrix's entries,
    ``in_sum2`` within float32 noise. ssm_conv1d is not a matmul and has no entry."""
    from test_eval_imatrix_archs import F32_TOLERANCE

    rel = imatrix_against_llama(case["theirs"], sample[1], tmp_path)
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        "attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight", "ssm_out.weight", *MOE_ENTRIES}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.1.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", *MOE_ENTRIES}
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- conversion ------------------------------------------------------------------------------------------
#: Keys ggufkit writes and llama.cpp's converter leaves out: the unknown id, and a bos id equal to the eos id
#: where the config names none (converters/vocab.py: Qwen-style vocabularies use their end-of-text token in
#: both roles; without it llama.cpp's BPE falls back to id 11, an ordinary token).
EXTRA_KEYS = {"tokenizer.ggml.unknown_token_id", "tokenizer.ggml.bos_token_id"}


def assert_same_file(theirs: Path, ours: Path) -> None:
    """Every tensor byte-identical and in llama.cpp's order, every key of llama.cpp's file equal in ggufkit's
    (``general.*`` naming and ggufkit's provenance keys aside)."""
    from test_convert_archs import _compared_key

    from ggufkit.format import open_gguf

    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys = [k for k in a.kv if _compared_key(k)]
        extra = {k for k in b.kv if _compared_key(k)} - set(keys)
        assert extra <= EXTRA_KEYS, extra
        if "tokenizer.ggml.bos_token_id" in extra:
            assert b.get("tokenizer.ggml.bos_token_id") == b.get("tokenizer.ggml.eos_token_id")
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            assert (np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray))
                    else va == vb), key


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16"])
def test_ggufkit_converts_each_layout_as_llama_cpps_converter(case: dict[str, Any], outtype: str,
                                                              tmp_path: Path) -> None:
    """No flag needed without MTP tensors (llama.cpp's converter needs --no-mtp); the schedule written as
    attention.recurrent_layers from either spelling, full_attention_interval 4 as AutoConfig leaves it, the
    conv kernel F32 in every outtype."""
    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    theirs = case["theirs"] if outtype == "f32" else llama_cpp_convert(case["dir"], tmp_path / "t.gguf", outtype)
    ours = convert(case["dir"], tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        assert list(f.get("qwen3next.attention.recurrent_layers")) == [True, False, True, False]


def test_release_end_to_end(tmp_path: Path) -> None:
    """``ggufkit release`` of a Qwen3-Next checkpoint: F16 master, importance matrix, a quantized file, each
    loaded by llama.cpp; the master's perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.format import open_gguf
    from ggufkit.release import release
    from ggufkit.release.plan import TextInput

    ckpt = make_model(tmp_path / "Qwen3-Next-Tiny", HF_CLASS, "release", to_release_config, hidden_size=256,
                      moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_key_head_dim=64,
                      linear_value_head_dim=64, head_dim=64)
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q4_k_m"], master="f16", ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    quantized = next(out / f for f in result.files if f.endswith("-Q4_K_M.gguf"))
    with open_gguf(quantized) as f:
        assert f.architecture == "qwen3next" and f.get("quantize.imatrix.chunks_count") == 2
    for path in (master, quantized):
        assert np.isfinite(llama_cpp_logits(path)).all()
    text = tmp_path / "eval.txt"
    text.write_text(TextInput.bundled("evaluation").text, encoding="utf-8")
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    # release scores the F16 master without llama.cpp's F16 rounding of matmul inputs (test_ppl_equals_... uses
    # --ggml-rounding and holds 1e-3); on this peaked random model (ppl ~1e10) that alone moves it 0.26 %
    assert result.master is not None and abs(result.master["ppl"] / theirs - 1) < 5e-3, (result.master, theirs)


# -- the converter's hooks (what registry.yaml cannot say) ------------------------------------------------
def _config(**fields: Any) -> dict[str, Any]:
    return {"model_type": "qwen3_next", "num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
            "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, **fields}


@pytest.mark.parametrize(("config", "recurrent"), [
    # the release spelling: every full_attention_interval-th layer full attention (Qwen3NextConfig)
    (_config(full_attention_interval=4), [True, True, True, False] * 2),
    (_config(full_attention_interval=2), [True, False] * 4),
    # neither: transformers' default interval, 4
    (_config(), [True, True, True, False] * 2),
    # transformers 5's layer_types (any schedule), which wins over an interval that disagrees, as in AutoConfig
    (_config(layer_types=["full_attention"] + ["linear_attention"] * 7), [False] + [True] * 7),
    (_config(layer_types=["linear_attention", "full_attention"] * 4, full_attention_interval=4), [True, False] * 4),
])
def test_every_schedule_spelling_gives_llama_cpps_recurrent_layers(config: dict[str, Any],
                                                                   recurrent: list[bool]) -> None:
    """The keys Qwen3NextModel.set_gguf_parameters computes, from each spelling: attention.recurrent_layers (the
    schedule llama.cpp's loader reads first), ssm.inner_size and rope.dimension_count (partial_rotary_factor in
    rope_parameters, at the root, or Qwen3NextConfig's 0.25 when neither has it)."""
    from ggufkit.converters import qwen3next
    from ggufkit.format.values import VT

    qwen3next.check_config(config)
    out = qwen3next.hparams(config, {"qwen3next.block_count": (VT.UINT32, 8)})
    assert out["qwen3next.attention.recurrent_layers"] == (VT.ARRAY, recurrent)
    assert out["qwen3next.ssm.inner_size"] == (VT.UINT32, 64)
    assert out["qwen3next.rope.dimension_count"] == (VT.UINT32, 4)
    for spelling in ({"partial_rotary_factor": 0.5}, {"rope_parameters": {"partial_rotary_factor": 0.5}}):
        assert qwen3next.hparams({**config, **spelling}, {"qwen3next.block_count": (VT.UINT32, 8)})[
            "qwen3next.rope.dimension_count"] == (VT.UINT32, 8)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"linear_value_head_dim": 32}, "linear_key_head_dim 16 != linear_value_head_dim 32"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ({"mlp_only_layers": [1]}, "dense layers between the MoE layers"),
    ({"decoder_sparse_step": 2}, "dense layers between the MoE layers"),
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must list 8 entries"),
    ({"layer_types": ["linear_attention"] * 7 + ["sliding_attention"]}, "layer_types must list 8 entries"),
    ({"full_attention_interval": 0}, "full_attention_interval must be a positive integer"),
])
def test_checkpoints_llama_cpp_cannot_represent_are_refused(overrides: dict[str, Any], message: str) -> None:
    from ggufkit.converters import qwen3next
    from ggufkit.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
        qwen3next.check_config(_config(**overrides))


def test_a_refused_checkpoint_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI: exit 2, one line, nothing written (the refusal comes before any tensor is read)."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", HF_CLASS, norm_topk_prob=False)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "qwen3_next: llama.cpp would compute another model: norm_topk_prob false" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


def test_the_in_proj_qkvz_split_and_a_log_follow_llama_cpps_converter() -> None:
    """rewrite_tensors on Qwen3-Next's fused projection (rows per key head [q, k, v, z]) and A_log, against the
    arrays llama.cpp's converter computes (Qwen3NextModel.modify_tensors, re-done here with torch)."""
    import torch

    from ggufkit.converters import qwen3next

    config = _config()
    rng = np.random.default_rng(0)
    qkvz = rng.standard_normal((2 * (16 + 16 + 32 + 32), 64)).astype(np.float32)
    a_log = rng.standard_normal(4).astype(np.float32)
    raw = [("blk.0.attn_qkv.weight", "model.layers.0.linear_attn.in_proj_qkvz.weight", "ATTN_QKV", qkvz.shape,
            "F32", None), ("blk.0.ssm_a", "model.layers.0.linear_attn.A_log", "SSM_A", (4,), "F32", None)]
    loaders = {"blk.0.attn_qkv.weight": lambda: qkvz, "blk.0.ssm_a": lambda: a_log}
    out = qwen3next.rewrite_tensors(raw, loaders, config)
    assert [(r[0], r[2], r[3]) for r in out] == [("blk.0.attn_qkv.weight", "ATTN_QKV", (128, 64)),
                                                 ("blk.0.attn_gate.weight", "ATTN_GATE", (64, 64)),
                                                 ("blk.0.ssm_a", "SSM_A", (4,))]
    t = torch.from_numpy(qkvz).permute(1, 0).contiguous().view(-1, 2, 16 + 16 + 32 + 32)
    q, k, v, z = torch.split(t, [16, 16, 32, 32], dim=-1)
    want_qkv = torch.cat([x.contiguous().view(64, -1) for x in (q, k, v)], dim=-1).permute(1, 0)
    assert np.array_equal(loaders["blk.0.attn_qkv.weight"](), want_qkv.numpy())
    assert np.array_equal(loaders["blk.0.attn_gate.weight"](), z.contiguous().view(64, -1).permute(1, 0).numpy())
    assert np.array_equal(loaders["blk.0.ssm_a"](), (-torch.exp(torch.from_numpy(a_log))).numpy())


# -- quantization ----------------------------------------------------------------------------------------
def hybrid_moe_gguf(path: Path, arch: str, n_layer: int = 8, d: int = 256, ff: int = 256, n_exp: int = 4,
                    n_mtp: int = 0) -> Path:
    """A ``qwen3next`` or ``qwen35moe`` file as llama.cpp's converter writes it (its tensor order; layers 3 and 7
    full attention, the others delta-net with 2 key and 4 value heads of 64), 4 experts and a shared expert,
    F16 matrices and F32 vectors (the conv kernel, the routers F32, as the converter keeps them), seeded
    random values: enough for llama-quantize, which loads the hparams. ``n_mtp`` multi-token-prediction blocks
    follow (full attention plus nextn.eh_proj / enorm / hnorm / shared_head_norm; block_count counts them,
    nextn_predict_layers, recurrent_layers false), as llama.cpp's converter writes them by default."""
    from gguf import GGMLQuantizationType as QT

    from ggufkit.format import Metadata, TensorSpec, write_gguf
    from ggufkit.format.values import VT

    hd, nk, nv = 64, 2, 4
    kd, vd = nk * hd, nv * hd
    conv = 2 * kd + vd
    recurrent = [(i + 1) % 4 != 0 for i in range(n_layer)]
    gates = [("ssm_ba.weight", (2 * nv, d))] if arch == "qwen3next" else [("ssm_alpha.weight", (nv, d)),
                                                                           ("ssm_beta.weight", (nv, d))]
    moe = [("ffn_down_exps.weight", (n_exp, d, ff)), ("ffn_gate_exps.weight", (n_exp, ff, d)),
           ("ffn_up_exps.weight", (n_exp, ff, d)), ("ffn_gate_inp.weight", (n_exp, d)),
           ("ffn_down_shexp.weight", (d, ff)), ("ffn_gate_shexp.weight", (ff, d)), ("ffn_up_shexp.weight", (ff, d)),
           ("ffn_gate_inp_shexp.weight", (1, d)), ("post_attention_norm.weight", (d,))]
    linear = [("attn_norm.weight", (d,)), ("ssm_a", (nv,)), ("ssm_conv1d.weight", (conv, 4)),
              ("ssm_dt.bias", (nv,)), *gates, ("attn_qkv.weight", (conv, d)), ("attn_gate.weight", (vd, d)),
              ("ssm_norm.weight", (hd,)), ("ssm_out.weight", (d, vd)), *moe]
    full = [("attn_norm.weight", (d,)), *moe, ("attn_k_norm.weight", (hd,)), ("attn_k.weight", (2 * hd, d)),
            ("attn_output.weight", (d, 4 * hd)), ("attn_q_norm.weight", (hd,)), ("attn_q.weight", (2 * 4 * hd, d)),
            ("attn_v.weight", (2 * hd, d))]
    tensors = [("output.weight", (256, d)), ("token_embd.weight", (256, d))]
    for i in range(n_layer):
        tensors += [(f"blk.{i}.{n}", s) for n, s in (linear if recurrent[i] else full)]
    nextn = [("nextn.eh_proj.weight", (d, 2 * d)), ("nextn.enorm.weight", (d,)), ("nextn.hnorm.weight", (d,)),
             ("nextn.shared_head_norm.weight", (d,))]
    for i in range(n_layer, n_layer + n_mtp):
        tensors += [(f"blk.{i}.{n}", s) for n, s in (*full, *nextn)]
    recurrent += [False] * n_mtp
    tensors.append(("output_norm.weight", (d,)))
    hp: dict[str, int | float] = {
        "block_count": n_layer + n_mtp, "context_length": 256, "embedding_length": d, "attention.head_count": 4,
        "attention.head_count_kv": 2, "rope.freq_base": 1e7, "attention.layer_norm_rms_epsilon": 1e-6,
        "expert_count": n_exp, "expert_used_count": 2, "attention.key_length": hd, "attention.value_length": hd,
        "expert_feed_forward_length": ff, "expert_shared_feed_forward_length": ff, "ssm.conv_kernel": 4,
        "ssm.state_size": hd, "ssm.group_count": nk, "ssm.time_step_rank": nv, "ssm.inner_size": vd,
        "full_attention_interval": 4, "rope.dimension_count": 16}
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, arch)
    for key, value in hp.items():
        meta.set(f"{arch}.{key}", VT.FLOAT32 if isinstance(value, float) else VT.UINT32, value)
    meta.set(f"{arch}.attention.recurrent_layers", VT.ARRAY, recurrent, VT.BOOL)
    if n_mtp:
        meta.set(f"{arch}.nextn_predict_layers", VT.UINT32, n_mtp)
    if arch == "qwen35moe":
        meta.set(f"{arch}.rope.dimension_sections", VT.ARRAY, [11, 11, 10, 0], VT.INT32)
    rng = np.random.default_rng(5)
    specs, arrays = [], []
    for name, shape in tensors:
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        f32 = len(shape) == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "gate_inp_shexp.weight"))
        specs.append(TensorSpec(name, QT.F32 if f32 else QT.F16, shape))
        arrays.append(arr if f32 else arr.astype(np.float16))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


def quant_case(d: Path, arch: str) -> dict[str, Path]:
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    model = hybrid_moe_gguf(d / f"{arch}.gguf", arch)
    values = {k: v for k, v in imatrix_values(model).items() if not k.endswith("ssm_conv1d.weight")}
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", values)}


def assert_every_preset_plans_as_llama_quantize(case: dict[str, Path], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run)."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.format import open_gguf
    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    flags: tuple[str, ...] = ()
    options = QuantOptions(dry_run=True)
    if with_imatrix:
        flags = ("--imatrix", str(case["imatrix"]))
        with open_gguf(case["imatrix"]) as m:
            sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
        options = QuantOptions(dry_run=True, imatrix_sizes=sizes)
    mismatches = [t for t in TYPE_CHOICES
                  if planned_types(case["model"], t, options) != dry_run_types(case["model"], t, *flags)]
    assert not mismatches


def assert_whole_files_equal_llama_quantize(case: dict[str, Path], tmp_path: Path, with_imatrix: bool) -> None:
    """Every TYPE, whole files (tensors, bytes, keys) against the llama-quantize binary; where it refuses (an
    IQ type without an importance matrix) ggufkit refuses too."""
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.errors import GGUFKitError
    from ggufkit.quant import quantize_file
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    flags = ["--imatrix", str(case["imatrix"])] if with_imatrix else []
    compared = 0
    for target in TYPE_CHOICES:
        ref, ours = tmp_path / f"ref-{target}.gguf", tmp_path / f"ours-{target}.gguf"
        r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(case["model"]), str(ref),
                            target.upper(), "2"], capture_output=True)
        try:
            quantize_file(case["model"], ours, target, imatrix=case["imatrix"] if with_imatrix else None, threads=2)
        except GGUFKitError:
            assert r.returncode != 0, target
            continue
        assert r.returncode == 0, target
        assert_same_quantized(ref, ours)
        compared += 1
        ref.unlink()
        ours.unlink()
    assert compared >= 25  # without an importance matrix llama-quantize refuses the IQ1/IQ2 types


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return quant_case(tmp_path_factory.mktemp("qwen3next-quant"), "qwen3next")


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    """The conv kernel and routers kept, the delta-net's attn_qkv counted with the attention layers' attn_v
    (category ATTENTION_QKV, n_attention_wv), the experts and shared expert by their rules."""
    assert_every_preset_plans_as_llama_quantize(quant_model, with_imatrix)


def tiny_f32(d: Path) -> Path:
    """A tiny Qwen3-Next as transformers 5 saves it, converted to F32 by ggufkit (tests/test_eval_imatrix_archs.py)."""
    from ggufkit.converters import convert

    return Path(convert(make_model(d / "ckpt", HF_CLASS, "tf5", to_release_config), d / "f32.gguf",
                        outtype="f32").outputs[0])
