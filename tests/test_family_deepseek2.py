"""DeepSeek V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, also Kimi K2's class; GGUF arch
``deepseek2``) end to end against llama.cpp (issue 32).

Multi-head latent attention: ``kv_b_proj`` split into ``attn_k_b`` (transposed, ``[n_head, kv_lora_rank,
qk_nope]``) and ``attn_v_b`` as conversion/deepseek.py ``DeepseekV2Model.modify_tensors`` splits it; queries
through a LoRA (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``) or, V2-Lite's layout, one ``q_proj``. Routing:
V3's sigmoid with ``e_score_correction_bias`` (``exp_probs_b``), expert groups, renormalised top-k and routed
scaling; V2's softmax. Shared experts, ``first_k_dense_replace`` leading dense layers.

Tiny random checkpoints of transformers' own classes (every parameter random, the correction bias too), in two
layouts: ``release`` (config.json as deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite spell it: ``rope_scaling`` with
``type``, ``rope_theta`` at the root, ``scoring_func``, ``topk_method``, ``torch_dtype``) and ``tf5`` (what
transformers 5's ``save_pretrained`` writes: ``rope_parameters``, no ``scoring_func``). The tokenizer is GPT-2's
BPE rebuilt from llama.cpp's vocab file: DeepSeek V3's own ("deepseek-v3" hash) is not vendored by llama.cpp.
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

HF_CLASSES = {"v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
              "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM")}
LAYOUTS = ("release", "tf5")
_BASE: dict[str, dict[str, Any]] = {
    # 8 experts in 4 groups, 2 groups kept, top-2; one dense lead layer; one shared expert
    "v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
               routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=1,
               tie_word_embeddings=False),
    # softmax routing, greedy top-2 of 4 experts, no renormalisation; queries through a LoRA
    "v2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2,
               num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="greedy", first_k_dense_replace=1,
               norm_topk_prob=False, routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=48,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
               rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               bos_token_id=0, eos_token_id=1, tie_word_embeddings=False),
}


def build_model(version: str, vocab_size: int, seed: int = 0, std: float = 0.15, **overrides: Any) -> Any:
    """A randomized transformers model (float32): every parameter and V3's ``e_score_correction_bias``
    buffer (zeros at init) random, the bias large enough to change which experts run."""
    import torch
    import transformers
    from fixtures_models import randomize

    config_name, model_name = HF_CLASSES[version]
    config = getattr(transformers, config_name)(**{**_BASE[version], "vocab_size": vocab_size, **overrides})
    config.architectures = [model_name]
    model = getattr(transformers, model_name)(config)
    randomize(model, seed, std)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return model.eval()


def to_release_config(path: Path, version: str) -> None:
    """Rewrite a transformers 5 config.json as the released configs spell it (deepseek-ai/DeepSeek-V3,
    DeepSeek-V2-Lite: ``rope_scaling`` with ``type``, ``rope_theta`` at the root, the router's method names)."""
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", "default")
    config["rope_scaling"] = {"type": rope_type, **rope} if rope_type != "default" else None
    config["torch_dtype"] = config.pop("dtype", "bfloat16")
    config["transformers_version"] = "4.33.1" if version == "v3" else "4.39.3"
    for key in ("head_dim", "qk_head_dim", "rope_interleave"):
        config.pop(key, None)
    if version == "v3":
        config.update(scoring_func="sigmoid", topk_method="noaux_tc", ep_size=1, moe_layer_freq=1,
                      aux_loss_alpha=0.001, seq_aux=True, num_nextn_predict_layers=1, pretraining_tp=1)
    else:
        config.update(scoring_func="softmax", ep_size=1, moe_layer_freq=1, aux_loss_alpha=0.001, seq_aux=True)
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def make_deepseek(dir: Path, version: str = "v3", layout: str = "tf5", *, config_edit: Any = None,
                  **overrides: Any) -> Path:
    """A tiny checkpoint of DeepSeek ``version`` in ``layout``; ``config_edit(config)`` edits config.json last."""
    from fixtures_models import _write_tokenizer

    dir.mkdir(parents=True, exist_ok=True)
    n_tokens = _write_tokenizer(dir, "real:gpt-2")
    build_model(version, n_tokens, **overrides).save_pretrained(dir)
    if layout == "release":
        to_release_config(dir / "config.json", version)
    if config_edit is not None:
        config = json.loads((dir / "config.json").read_text())
        config_edit(config)
        (dir / "config.json").write_text(json.dumps(config, indent=2))
    return dir


def tiny_f32(dir: Path, version: str = "v3") -> Path:
    """A tiny checkpoint (transformers 5's layout) converted to F32 by ggufkit (tests/test_eval_imatrix_archs.py)."""
    ckpt = make_deepseek(Path(dir) / "ckpt", version, "tf5")
    return convert(ckpt, Path(dir) / "tiny-f32.gguf", outtype="f32").outputs[0]


def llama_cpp_f32(dir: Path, version: str = "v3", layout: str = "release", **overrides: Any) -> Path:
    """A tiny checkpoint converted to F32 by llama.cpp's own converter."""
    from test_convert_archs import llama_cpp_convert

    ckpt = make_deepseek(dir / "ckpt", version, layout, **overrides)
    return llama_cpp_convert(ckpt, dir / "f32.gguf")


def assert_same_file(theirs: Path, ours: Path, *, ordered: bool = True) -> None:
    from test_family_olmo2 import assert_same_file as same

    same(theirs, ours, ordered=ordered)


def _scoring(value: str) -> Any:
    def edit(config: dict[str, Any]) -> None:
        config["scoring_func"] = value
    return edit


# -- conversion, logits, --check -----------------------------------------------------------------------
CTX = 64
CHUNKS = 4


@pytest.fixture(scope="module", params=[(v, lay) for v in HF_CLASSES for lay in LAYOUTS], ids=lambda p: "-".join(p))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    version, layout = request.param
    d = make_deepseek(tmp_path_factory.mktemp(f"ds{version}-{layout}") / "m", version, layout)
    report = convert(d, d.parent / "ours.gguf", outtype="f32")
    return {"version": version, "layout": layout, "dir": d, "ours": report.outputs[0], "plan": report.plan}


def test_file_equals_llama_cpps_converter(case: dict[str, Any], tmp_path: Path) -> None:
    """Every tensor byte-identical (kv_b_proj split into attn_k_b [n_head, kv_lora, qk_nope] and attn_v_b,
    exp_probs_b.bias, stacked experts), every key equal. A transformers 5 V3 config has no ``scoring_func``:
    llama.cpp's converter then writes no gating function and its loader routes by softmax, so the file is
    compared with llama.cpp's for the same checkpoint with ``scoring_func`` spelled out (the class's sigmoid); on the
    unspelled config llama.cpp's own file runs another model (logits 45 % of the range off transformers', measured),
    which test_llama_cpp_logits_match_transformers shows ggufkit's does not."""
    import shutil

    from test_convert_archs import llama_cpp_convert

    d = case["dir"]
    if case["version"] == "v3" and case["layout"] == "tf5":
        d = Path(shutil.copytree(d, tmp_path / "spelled"))
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "scoring_func": "sigmoid"}))
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf")
    assert_same_file(theirs, case["ours"])
    with open_gguf(case["ours"]) as f:
        assert f.architecture == "deepseek2"
        assert f["blk.0.attn_k_b.weight"].ne == (16, 32, 4) and f["blk.0.attn_v_b.weight"].ne == (32, 16, 4)
        assert "blk.0.attn_kv_b.weight" not in f and "blk.0.ffn_gate_inp.weight" not in f
        assert ("blk.1.exp_probs_b.bias" in f) == (case["version"] == "v3")
        assert f.get("deepseek2.expert_gating_func") == (2 if case["version"] == "v3" else 1) or (
            case["layout"] == "tf5" and case["version"] == "v2" and "deepseek2.expert_gating_func" not in f.kv)
        assert f.get("deepseek2.attention.key_length") == 40 and f.get("deepseek2.attention.key_length_mla") == 24


@pytest.mark.parametrize("outtype", ["q8_0"])
def test_other_outtypes_equal_llama_cpps_converter(outtype: str, tmp_path: Path) -> None:
    """Matrices (attn_k_b / attn_v_b and the stacked experts too) in the outtype, norms, the router and its
    bias F32, byte for byte, in llama-quantize's tensor order (Q8_0 alone, for CI time: the float outtypes take
    the same path as F32 and F16 elsewhere)."""
    from test_convert_archs import llama_cpp_convert

    d = make_deepseek(tmp_path / "m", "v3", "release")
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", outtype)
    ours = convert(d, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert_same_file(theirs, ours, ordered=outtype != "q8_0")


def test_llama_cpp_logits_match_transformers(case: dict[str, Any]) -> None:
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def _add_mtp_layer(d: Path) -> None:
    """DeepSeek V3's release layout of its multi-token-prediction layer: ``model.layers.{num_hidden_layers}``
    (a decoder block plus eh_proj, enorm, hnorm and shared_head.norm)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    for name, value in list(tensors.items()):
        if name.startswith(f"model.layers.{n - 1}."):
            tensors[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = value + 0.5
    rng = np.random.default_rng(3)
    for name, shape in (("eh_proj", (64, 128)), ("enorm", (64,)), ("hnorm", (64,)), ("shared_head.norm", (64,))):
        tensors[f"model.layers.{n}.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_mtp_layers_are_left_out_and_the_options_refused(tmp_path: Path) -> None:
    """DeepSeek V3's MTP layer is dropped as DeepseekV2Model does (skip_mtp); asking to keep or drop it is
    refused in one line, as llama.cpp's converter refuses --mtp / --no-mtp (no supports_mtp_export)."""
    from test_convert_archs import llama_cpp_convert

    from ggufkit.errors import UsageError

    d = make_deepseek(tmp_path / "m", "v3", "release")
    _add_mtp_layer(d)
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(llama_cpp_convert(d, tmp_path / "theirs.gguf"), ours)
    with open_gguf(ours) as f:
        assert f.get("deepseek2.block_count") == 3 and not any(t.name.startswith("blk.3.") for t in f.tensors)
    for mtp, option in ((True, "--mtp"), (False, "--no-mtp")):
        with pytest.raises(UsageError, match=option):
            convert(d, tmp_path / "x.gguf", outtype="f32", mtp=mtp)
        assert not (tmp_path / "x.gguf").exists()


def _no_q_lora(config: dict[str, Any]) -> None:
    config["q_lora_rank"] = None


def _set(**values: Any) -> Any:
    def edit(config: dict[str, Any]) -> None:
        config.update(values)
    return edit


@pytest.mark.parametrize(("version", "edit", "message"), [
    ("v3", _scoring("softmax"), "scoring_func 'softmax'"),
    ("v2", _scoring("sigmoid"), "scoring_func 'sigmoid'"),
    ("v2", _set(norm_topk_prob=True), "norm_topk_prob true"),
    ("v3", _set(rope_interleave=False), "rope_interleave false"),
    ("v3", _set(attention_bias=True), "attention biases"),
], ids=["v3-softmax", "v2-sigmoid", "v2-renorm", "v3-neox-rope", "bias"])
def test_convert_refuses_them_in_one_line_and_writes_nothing(version: str, edit: Any, message: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_deepseek(tmp_path / "m", version, config_edit=edit)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "llama.cpp would compute another model" in err and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


# -- evaluator -------------------------------------------------------------------------------------------
EVAL_CASES = [("v3", "release"), ("v2", "tf5")]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("ds-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


@pytest.mark.parametrize("case", EVAL_CASES, indirect=True, ids=lambda p: "-".join(p))
def test_evaluator_logits_equal_llama_cpps(case: dict[str, Any]) -> None:
    """The absorbed MLA, the grouped sigmoid (V3) or softmax (V2) router and the shared experts as llama.cpp's
    graph computes them: the evaluator's logits within float32 noise of llama.cpp's on the F32 file."""
    import torch
    from fixtures_models import TOKENS

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(case["ours"])
    with load_model(case["ours"], device="cpu") as m:
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


@pytest.mark.parametrize("case", EVAL_CASES, indirect=True, ids=lambda p: "-".join(p))
def test_ppl_equals_llama_perplexity(case: dict[str, Any], text_file: tuple[str, Path], tmp_path: Path) -> None:
    """F32, and F16 with llama.cpp's F16 rounding of each matmul's input (--ggml-rounding)."""
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


@pytest.mark.parametrize("case", EVAL_CASES, indirect=True, ids=lambda p: "-".join(p))
def test_imatrix_equals_llama_imatrix(case: dict[str, Any], text_file: tuple[str, Path], tmp_path: Path) -> None:
    """The same entries as llama-imatrix: the MLA matrices (attn_k_b / attn_v_b one row per head and one count,
    as ggml_mul_mat with a 3-D weight), the router and every expert (counts per expert, experts that never
    fire included), the shared experts, the dense lead layer; in_sum2 within float32 noise."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import F32_TOLERANCE

    from ggufkit.quant.imatrix.collector import read_raw_imatrix

    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", text_file[1], "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", case["ours"], "-o", ref, *common, *F32_ATTENTION)
    ours(case["ours"], "-o", mine, *common)
    rel = relative_l2(mine, ref)
    q = ({"attn_q_a.weight", "attn_q_b.weight"})
    attn = {*q, "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        *attn, "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.2.")} == {
        *attn, "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
        "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
    sums, counts = read_raw_imatrix(mine).entries["blk.1.attn_k_b.weight"]
    assert sums.size == 4 * 16 and counts.size == 1
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- quantization --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A DeepSeek-V3-shaped F16 file wide enough for k-quants (hidden 256, MLA ranks 256, heads of 128 + 64,
    8 experts of 256, one dense lead layer, 4 layers; a 400-token BPE) and an importance matrix for it."""
    import fixtures_tokenizers as ft
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("ds-quant")
    ckpt = d / "ckpt"
    ckpt.mkdir()
    ft.make_bpe_tokenizer(ckpt, 400, flavor="gpt-2")
    build_model("v3", 400, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
                kv_lora_rank=256, q_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                num_attention_heads=2, num_key_value_heads=2).save_pretrained(ckpt)
    model = convert(ckpt, d / "model.gguf", outtype="f16").outputs[0]
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Any], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run): the MLA tensors
    (attn_k_b rows of 128, attn_v_b, attn_kv_a_mqa, attn_q_a/b), the router F32, 8 experts' stacks."""
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


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", True), ("iq3_xxs", True)])
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
def test_release_end_to_end(tmp_path: Path) -> None:
    """``release`` of a tiny DeepSeek V3 in the released layout (weights N(0, 0.05): a ppl near the vocabulary
    size, where release's scoring without F16 matmul-input rounding stays within 0.1 %): F16 master, importance matrix (llama-imatrix's
    entries on that master, attn_k_b / attn_v_b among them), Q8_0 and Q4_K_M, card; every file loads in
    llama.cpp and the master's reported perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix

    from ggufkit.eval.perplexity import sample_text
    from ggufkit.quant.imatrix.collector import read_raw_imatrix
    from ggufkit.release import release

    ckpt = make_deepseek(tmp_path / "tiny-deepseek", "v3", "release", hidden_size=256, moe_intermediate_size=256,
                         intermediate_size=256, kv_lora_rank=256, q_lora_rank=256, std=0.05)
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
            assert f.architecture == "deepseek2"
        assert np.isfinite(llama_cpp_logits(path)).all()
    ref = tmp_path / "ref.gguf"
    llama_imatrix("-m", master, "-f", text, "-c", 64, "--chunks", 2, "-o", ref, *F32_ATTENTION)
    entries = sorted(read_raw_imatrix(imatrix).entries)
    assert entries == sorted(read_raw_imatrix(ref).entries) and "blk.1.attn_v_b.weight" in entries
    manifest = json.loads((out / "manifest.json").read_text())
    reported = manifest["steps"]["eval-master"]["results"]["ppl"]
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    assert abs(reported / theirs - 1) < 1e-3, (reported, theirs)


def test_yarn_rope_scaling_as_llama_cpp(tmp_path: Path) -> None:
    """YaRN as DeepSeek-V2-Lite's release config spells it (``rope_scaling`` type yarn with mscale = mscale_all_dim
    0.707): the keys llama.cpp's converter writes (yarn_log_multiplier 0.1 * mscale_all_dim), llama.cpp runs
    transformers' model, and the evaluator computes llama.cpp's rope_yarn angles, attention factor and the
    mscale-squared attention scale ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])."""
    import torch
    from fixtures_models import TOKENS
    from test_convert_archs import llama_cpp_convert

    from ggufkit.eval.model import load_model

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    d = make_deepseek(tmp_path / "m", "v2", "release", rope_parameters=rope)
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(llama_cpp_convert(d, tmp_path / "theirs.gguf"), ours)
    with open_gguf(ours) as f:
        assert f.get("deepseek2.rope.scaling.type") == "yarn"
        assert abs(f.get("deepseek2.rope.scaling.yarn_log_multiplier") - 0.0707) < 1e-7
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())
    with load_model(ours, device="cpu") as m:
        ev = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (ev.argmax(-1) == got.argmax(-1)).all()
    assert np.abs(ev - got).max() < 1e-4 * (got.max() - got.min())


def test_v2_lite_layout_without_q_lora(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite's queries through one q_proj (``q_lora_rank`` null) -> ``attn_q``: llama.cpp's loader reads
    no q LoRA rank only at V2-Lite's 26/27 layers, so the tiny model has 26 (all but the first MoE). The file equals
    llama.cpp's converter's, llama.cpp runs transformers' model, the evaluator llama.cpp's; with 3 layers the
    converter refuses (llama.cpp's loader would demand attention.q_lora_rank)."""
    import torch
    from fixtures_models import TOKENS
    from test_convert_archs import llama_cpp_convert

    from ggufkit.errors import UnsupportedArchitectureError
    from ggufkit.eval.model import load_model

    d = make_deepseek(tmp_path / "m", "v2", "tf5", q_lora_rank=None, num_hidden_layers=26)
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(llama_cpp_convert(d, tmp_path / "theirs.gguf"), ours)
    with open_gguf(ours) as f:
        assert f["blk.0.attn_q.weight"].ne == (64, 96) and "blk.0.attn_q_a.weight" not in f
        assert "deepseek2.attention.q_lora_rank" not in f.kv
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())
    with load_model(ours, device="cpu") as m:
        ev = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert np.abs(ev - got).max() < 1e-4 * (got.max() - got.min())
    short = make_deepseek(tmp_path / "short", "v2", "tf5", q_lora_rank=None)
    with pytest.raises(UnsupportedArchitectureError, match="no q_lora_rank with 3 layers"):
        convert(short, tmp_path / "x.gguf", outtype="f32")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("case", [("v3", "tf5")], indirect=True, ids=lambda p: "-".join(p))
def test_check_passes_and_fails_on_other_weights(case: dict[str, Any], tmp_path: Path) -> None:
    """``convert --check``: transformers' model against the evaluator's forward of the file."""
    from ggufkit.eval.convert_check import check_conversion

    ok = check_conversion(case["dir"], case["ours"], case["plan"], device="cpu")
    assert ok.status == "passed", ok.failures
    other = make_deepseek(tmp_path / "other", "v3", "tf5", seed=7)
    bad = check_conversion(case["dir"], convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0],
                           case["plan"], device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)
