"""Llama 4 (``Llama4ForCausalLM`` and the text half of ``Llama4ForConditionalGeneration``, GGUF arch ``llama4``)
end to end against llama.cpp (issue 32).

Tiny random checkpoints of transformers' own classes: 4 layers (layer 3 NoPE, layers 0-2 RoPE with chunked
attention and the L2 q/k norm), MoE on every 2nd layer (``interleave_moe_layer_step`` 2: dense layers of
``intermediate_size_mlp`` 96, experts of ``intermediate_size`` 32), 4 experts, top-2, a shared expert, llama3
rope scaling as Llama-4-Scout's (``rope_freqs``), every parameter random. Llama 4 is top-1 as released; llama.cpp
honours ``num_experts_per_tok`` > 1 for llama4 (build_moe_ffn repeats the input per selected expert and weights
it before the experts, ``weight_before_ffn``; transformers' Llama4TextMoe does the same), so top-2 is tested.
Llama 3's BPE stands in for Llama 4's (check hash "llama4", converters/pretokenizer.py): llama.cpp ships no
vocab file of it to rebuild. Three layouts:

* ``tf5``: ``Llama4ForCausalLM`` as transformers 5's ``save_pretrained`` writes it (``rope_parameters``,
  ``layer_types``, ``moe_layers``, ``no_rope_layers`` spelled out);
* ``release``: ``Llama4ForConditionalGeneration`` (text under ``language_model.``, as transformers 5 saves it
  too, a vision tower and projector llama.cpp's converter leaves out) as
  meta-llama/Llama-4-Scout-17B-16E-Instruct's config spells its text_config (``rope_theta`` and ``rope_scaling`` at its root, ``no_rope_layers: []`` for the default,
  ``attn_temperature_tuning: 4``, ``moe_layers`` listed, no ``layer_types``), bf16 weights. transformers 5.24's
  strict config refuses the int ``4``, so transformers and llama.cpp's converter (through AutoConfig) read a copy
  saying ``true`` (``as_bool_tuning``); ggufkit converts the released spelling.

The text half converts to the llama4 file llama.cpp's converter writes (every tensor and key). llama.cpp fixes
the chunk size (8192), the NoPE step (4) and the temperature constants (floor 8192, scale 0.1): at 64-token
contexts the chunks and the temperature are no-ops there, so the evaluator's chunk mask and temperature are
checked against transformers with a 4-token chunk and floor (``test_chunks_and_temperature_...``).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from fixtures_models import TOKENS, llama_cpp_logits, make_checkpoint, transformers_logits
from test_family_qwen3next import (
    assert_every_preset_plans_as_llama_quantize,
    assert_same_file,
    llama_cpp_convert,
)

CAUSAL, VLM = "Llama4ForCausalLM", "Llama4ForConditionalGeneration"
#: Llama-4-Scout's rope scaling (llama3; low == high frequency factor: no smoothed band).
SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}
TEXT = dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            interleave_moe_layer_step=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope_parameters={"rope_theta": 500000.0, **SCOUT_ROPE}, bos_token_id=128000, eos_token_id=128001)
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32, projector_output_dim=64)

fixtures_models._BASE.setdefault(CAUSAL, TEXT)
fixtures_models._CLASSES.setdefault(CAUSAL, ("Llama4TextConfig", CAUSAL))
fixtures_models._VOCAB.setdefault(CAUSAL, "real:llama-bpe")
fixtures_models._BASE.setdefault(VLM, dict(text_config=TEXT, vision_config=VISION))
fixtures_models._CLASSES.setdefault(VLM, ("Llama4Config", VLM))
fixtures_models._VOCAB.setdefault(VLM, "real:llama-bpe")

LAYOUTS = ("tf5", "release")
MOE_ENTRIES = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
               "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 ``Llama4ForConditionalGeneration`` config.json as Llama-4-Scout's spells its
    text_config."""
    config = json.loads(path.read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    for key in ("layer_types", "moe_layers", "dtype"):
        text.pop(key, None)
    text.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, no_rope_layers=[], attn_temperature_tuning=4,
                moe_layers=list(range(1, text["num_hidden_layers"], 2)),
                cache_implementation="hybrid", for_llm_compressor=False, torch_dtype="bfloat16")
    config.pop("dtype", None)
    config.update(torch_dtype="bfloat16", transformers_version="4.51.0.dev0")
    path.write_text(json.dumps(config, indent=2))


def make_model(d: Path, layout: str, **overrides: Any) -> Path:
    if layout == "tf5":
        return make_checkpoint(d, CAUSAL, **overrides)
    ckpt = make_checkpoint(d, VLM, **({"dtype": "bfloat16"} if layout == "release" else {}), **overrides)
    if layout == "release":
        to_release_config(ckpt / "config.json")
    return ckpt


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, Any]]:
    """Each layout's case, built once for the module (:func:`build_case`)."""
    return {}


def build_case(built: dict[str, dict[str, Any]], layout: str, factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The checkpoint of ``layout`` and llama.cpp's F32 conversion of it."""
    if layout not in built:
        d = make_model(factory.mktemp(f"llama4-{layout}") / "m", layout)
        ref = d if layout != "release" else as_bool_tuning(d)
        built[layout] = {"layout": layout, "dir": d, "ref": ref,
                         "theirs": llama_cpp_convert(ref, d.parent / "theirs.gguf", "f32", "--verbose")}
    return built[layout]


@pytest.fixture(params=LAYOUTS)
def case(request: pytest.FixtureRequest, built: dict[str, dict[str, Any]],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return build_case(built, request.param, tmp_path_factory)


@pytest.fixture
def tf5(built: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The transformers-5 ``Llama4ForCausalLM`` case (scored and calibrated: the layouts differ only in values)."""
    return build_case(built, "tf5", tmp_path_factory)


def as_bool_tuning(d: Path) -> Path:
    """A copy of the release checkpoint ``d`` whose ``attn_temperature_tuning`` is ``true``, not Scout's ``4``:
    transformers 5's strict config refuses the int, so neither transformers nor llama.cpp's converter (through
    AutoConfig) loads the released spelling here; both read the value only as a truth value (Llama4TextAttention,
    and llama.cpp not at all). ggufkit converts the released spelling itself (its tokenizer loaded without
    config.json where AutoTokenizer fails on it, converters/vocab.py)."""
    out = d.parent / "m-bool"
    out.mkdir()
    for f in d.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["attn_temperature_tuning"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def llama_cpp_file(case: dict[str, Any], outtype: str) -> Path:
    """llama.cpp's conversion of the case to ``outtype``, made once per module."""
    if outtype not in case:
        case[outtype] = llama_cpp_convert(case["ref"], case["dir"].parent / f"theirs-{outtype}.gguf", outtype,
                                          "--verbose")
    return Path(case[outtype])


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("llama4-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def _reference_logits(d: Path) -> np.ndarray:
    """transformers' logits for ``TOKENS``: Llama4ForCausalLM, or the ConditionalGeneration's language model."""
    import torch
    import transformers

    config = json.loads((d / "config.json").read_text())
    if config["architectures"][0] == CAUSAL:
        return transformers_logits(d)
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        # its text-only forward fails in transformers 5.24 (no image_outputs on the text model's output)
        return model.language_model(input_ids=torch.tensor([TOKENS])).logits[0].float().numpy()


# -- conversion ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("case", "outtype"), [("tf5", "f32"), ("tf5", "f16"), ("release", "f32")],
                         indirect=["case"])
def test_ggufkit_converts_each_layout_as_llama_cpps_converter(case: dict[str, Any], outtype: str,
                                                              tmp_path: Path) -> None:
    """Every tensor byte-identical and every key equal: the experts split and transposed, rope_freqs, the dense
    layers' feed_forward_length from intermediate_size_mlp, the experts' from intermediate_size, the MoE step; the
    ConditionalGeneration's text half only (its BF16 weights widened to F32 as llama.cpp widens them; F16 on the
    other layout, whose llama.cpp file the ppl test reuses)."""
    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    ours = convert(case["dir"], tmp_path / "ours.gguf", outtype=outtype).outputs[0]  # the released spelling
    assert_same_file(llama_cpp_file(case, outtype), ours)
    with open_gguf(ours) as f:
        assert f.architecture == "llama4" and f.get("llama4.interleave_moe_layer_step") == 2
        assert f.get("llama4.feed_forward_length") == 96 and f.get("llama4.expert_feed_forward_length") == 32
        assert f.get("llama4.expert_used_count") == 2 and f.get("tokenizer.ggml.pre") == "llama-bpe"
        names = {t.name for t in f.tensors}
        assert "rope_freqs.weight" in names and "blk.1.ffn_up_exps.weight" in names and "blk.0.ffn_up.weight" in names
        assert not any(n.startswith(("v.", "mm.")) for n in names)


# -- runtime and evaluator -----------------------------------------------------------------------------
def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    """llama.cpp's file computes transformers' model (the VLM: its language model, loaded from the whole
    ConditionalGeneration checkpoint)."""
    want = _reference_logits(case["ref"])
    got = llama_cpp_logits(case["theirs"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_evaluator_logits_equal_llama_cpps(case: dict[str, Any]) -> None:
    import torch

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(case["theirs"])
    with load_model(case["theirs"], device="cpu") as m:
        assert m.hparams.extra["moe"] == (False, True, False, True) and m.hparams.n_expert_used == 2
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """A Llama4ForCausalLM with a 400-token BPE, ggufkit's F32 file of it and the conversion's plan."""
    from ggufkit.converters import convert

    d = tmp_path_factory.mktemp("llama4-tiny")
    ckpt = make_checkpoint(d / "m", CAUSAL, vocab="llama-bpe")
    report = convert(ckpt, d / "f32.gguf", outtype="f32")
    return ckpt, Path(report.outputs[0]), report.plan


def test_check_passes_and_fails_on_other_weights(tiny: tuple[Path, Path, Any], tmp_path: Path) -> None:
    """``convert --check``: transformers' model against the evaluator's forward of the file."""
    from ggufkit.converters import convert
    from ggufkit.eval.convert_check import check_conversion

    ok = check_conversion(tiny[0], tiny[1], tiny[2], device="cpu")
    assert ok.status == "passed", ok.failures
    other = make_checkpoint(tmp_path / "other", CAUSAL, vocab="llama-bpe", seed=7)
    bad = check_conversion(tiny[0], convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0], tiny[2],
                           device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


def test_kld_equals_llama_perplexitys(tiny: tuple[Path, Path, Any], sample: tuple[str, Path],
                                      tmp_path: Path) -> None:
    """KL divergence of a Q8_0 file from the F32 one as ``llama-perplexity --kl-divergence`` reports it (its 8-bit
    activation rounding reproduced): within 3 % (tests/test_family_lfm2.py); 4 chunks of 64 tokens (with fewer its
    summary is not printed)."""
    from llama_cpp_sources import tool_path
    from test_eval_archs_vs_llama_perplexity import F32_PATH

    from ggufkit.eval import kl_divergence
    from ggufkit.quant import quantize_file

    text, path = sample
    q8, base = tmp_path / "q8.gguf", tmp_path / "base.kld"
    quantize_file(tiny[1], q8, "q8_0")

    def run(*args: str | Path) -> str:
        cmd = [str(tool_path("llama-perplexity")), "-f", str(path), "-c", "64", "-b", "64", "--chunks", "4", "-t",
               "2", "-nr", *F32_PATH, *map(str, args)]
        for _ in range(10):  # its asynchronous log sometimes loses the last lines
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-2000:]
            if "Minimum KLD" in r.stdout + r.stderr or "Final estimate" in r.stdout + r.stderr:
                return r.stdout + r.stderr
        raise AssertionError(r.stderr[-2000:])

    run("-m", tiny[1], "--kl-divergence-base", base)
    m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", run("-m", q8, "--kl-divergence-base", base, "--kl-divergence"))
    assert m is not None
    got = kl_divergence(q8, tiny[1], text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=True,
                        kv_cache="f32").kld
    assert got is not None
    assert abs(got["mean_kld"] / float(m.group(1)) - 1) < 3e-2, (got["mean_kld"], m.group(1))


def test_chunks_and_temperature_are_transformers_own(tiny: tuple[Path, Path, Any]) -> None:
    """The evaluator's chunked mask and NoPE temperature against transformers', at a chunk and floor of 4 tokens
    (llama.cpp fixes 8192, so no llama.cpp file can say 4: the evaluator's constants are set after loading)."""
    import torch
    import transformers

    from ggufkit.eval.family_llama4 import chunk_mask, temperature
    from ggufkit.eval.model import load_model

    assert chunk_mask(6, 4).tolist()[5] == [False, False, False, False, True, True]
    assert torch.allclose(temperature(9, 4, 0.1), torch.tensor(
        [1.0, 1.0, 1.0] + [1 + 0.1 * np.log(2)] * 4 + [1 + 0.1 * np.log(3)] * 2, dtype=torch.float32))
    d, f32, _ = tiny
    ref = transformers.Llama4ForCausalLM.from_pretrained(d, dtype=torch.float32, attention_chunk_size=4,
                                                         floor_scale=4).eval()
    with torch.no_grad():
        want = ref(torch.tensor([TOKENS])).logits[0].numpy()
    with load_model(f32, device="cpu") as m:
        full = m.logits(torch.tensor([TOKENS]))[0].numpy()
        m.hparams.extra.update(chunk=4, floor_scale=4)  # type: ignore[attr-defined]
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())
    assert np.abs(full - want).max() > 1e-2 * (want.max() - want.min())  # the chunks and temperature matter


def test_the_router_weights_the_expert_input(tiny: tuple[Path, Path, Any]) -> None:
    """build_moe_ffn for llama4: the top-k router logits choose, their sigmoids weight the experts' INPUT (not
    their output; SiLU-gated experts are not linear, so the two differ)."""
    import torch

    from ggufkit.eval.family_llama4 import route, routed_experts_weighted_input
    from ggufkit.eval.model import load_model
    from ggufkit.eval.moe import routed_experts

    with load_model(tiny[1], device="cpu") as m:
        h = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(0))
        logits = h.reshape(-1, 64) @ m.weight("blk.1.ffn_gate_inp.weight").T
        weights, selected = route(logits, 2)
        assert torch.equal(selected, torch.topk(logits, 2).indices)
        assert torch.allclose(weights, torch.sigmoid(torch.topk(logits, 2).values))
        got = routed_experts_weighted_input(m, h, "blk.1.", weights, selected)
        want = torch.zeros_like(got)
        for slot in range(2):
            xw = h.reshape(-1, 64) * weights[:, slot:slot + 1]
            want += routed_experts(m, xw.reshape(h.shape), "blk.1.", torch.ones(9, 1), selected[:, slot:slot + 1])
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got, routed_experts(m, h, "blk.1.", weights, selected), atol=1e-3)


def test_ppl_equals_llama_perplexity(tf5: dict[str, Any], sample: tuple[str, Path]) -> None:
    """F32 and F16 files, 4 chunks of 64 tokens."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity

    text, path = sample
    f16 = llama_cpp_file(tf5, "f16")
    for model, rounding in ((tf5["theirs"], False), (f16, True)):
        ours = perplexity(model, text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=rounding, kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, 64, 4, *F32_PATH)
        assert ours.chunks == n_chunks == 4
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(tf5: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """Dense layers' q/k/v/output and FFN, MoE layers' router, experts (the weighted inputs of gate/up, per expert)
    and shared expert, and the head: llama-imatrix's entries and counts, ``in_sum2`` within float32 noise."""
    from test_eval_imatrix_archs import F32_TOLERANCE
    from test_family_qwen3next import imatrix_against_llama

    rel = imatrix_against_llama(tf5["theirs"], sample[1], tmp_path)
    attn = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        *attn, "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.1.")} == {*attn, *MOE_ENTRIES}
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- the converter's hooks ---------------------------------------------------------------------------
def _config(**fields: Any) -> dict[str, Any]:
    return {"model_type": "llama4_text", "num_hidden_layers": 8, **fields}


@pytest.mark.parametrize("config", [
    _config(),  # Llama4TextConfig's defaults
    _config(no_rope_layers=[], attn_temperature_tuning=4),  # Llama-4-Scout's spelling
    _config(no_rope_layers=[1, 1, 1, 0] * 2, layer_types=(["chunked_attention"] * 3 + ["full_attention"]) * 2,
            moe_layers=list(range(8))),  # transformers 5's
    _config(num_local_experts=128, use_qk_norm=False, interleave_moe_layer_step=2, moe_layers=[1, 3, 5, 7]),
])
def test_configs_llama_cpp_computes_pass(config: dict[str, Any]) -> None:
    from ggufkit.converters import llama4

    llama4.check_config(config)


@pytest.mark.parametrize(("config", "message"), [
    (_config(no_rope_layer_interval=2), "NoPE layers [1, 3, 5, 7]"),
    (_config(no_rope_layers=[1] * 8), "NoPE layers []"),
    (_config(attention_chunk_size=None), "no chunked-attention layer"),
    (_config(layer_types=["full_attention"] * 8), "no chunked-attention layer"),
    (_config(layer_types=["chunked_attention"] * 8), "chunked-attention layers [0, 1, 2, 3, 4, 5, 6, 7]"),
    (_config(attention_chunk_size=4096), "attention_chunk_size 4096"),
    (_config(attn_temperature_tuning=False), "attn_temperature_tuning off"),
    (_config(floor_scale=4096), "floor_scale 4096"),
    (_config(attn_scale=0.2), "attn_scale 0.2"),
    (_config(use_qk_norm=False), "use_qk_norm false with 16 experts"),
    (_config(num_local_experts=128), "use_qk_norm true with 128 experts"),
    (_config(interleave_moe_layer_step=2, moe_layers=[0, 2, 4, 6]), "MoE layers [0, 2, 4, 6]"),
    (_config(interleave_moe_layer_step=0), "interleave_moe_layer_step 0"),
    (_config(hidden_act="gelu"), "hidden_act 'gelu'"),
    (_config(attention_bias=True), "attention biases"),
])
def test_checkpoints_llama_cpp_cannot_represent_are_refused(config: dict[str, Any], message: str) -> None:
    from ggufkit.converters import llama4
    from ggufkit.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
        llama4.check_config(config)


def test_a_refused_checkpoint_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", CAUSAL, vocab="llama-bpe", attention_chunk_size=None)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "llama4: llama.cpp would compute another model: no chunked-attention layer" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


# -- quantization and release --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A llama4 F16 file wide enough for whole k-quant blocks, 8 experts (llama_tensor_get_type's n_expert >= 8
    rules), and a random importance matrix of it."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    from ggufkit.converters import convert

    d = tmp_path_factory.mktemp("llama4-quant")
    ckpt = make_checkpoint(d / "m", CAUSAL, vocab="llama-bpe", hidden_size=256, intermediate_size=256,
                           intermediate_size_mlp=512, num_local_experts=8, head_dim=64)
    model = Path(convert(ckpt, d / "f16.gguf", outtype="f16").outputs[0])
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    assert_every_preset_plans_as_llama_quantize(quant_model, with_imatrix)


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", True), ("iq4_xs", True)])
def test_quantized_file_equals_llama_quantizes(quant_model: dict[str, Path], target: str, with_imatrix: bool,
                                               tmp_path: Path) -> None:
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.quant import quantize_file

    flags = ["--imatrix", str(quant_model["imatrix"])] if with_imatrix else []
    r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(quant_model["model"]), str(tmp_path / "ref.gguf"),
                        target.upper(), "2"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    quantize_file(quant_model["model"], tmp_path / "ours.gguf", target,
                  imatrix=quant_model["imatrix"] if with_imatrix else None, threads=2)
    assert_same_quantized(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_release_end_to_end(tmp_path: Path) -> None:
    """``ggufkit release`` of a Llama 4 checkpoint: F16 master, importance matrix, a quantized file, each loaded by
    llama.cpp; the master's perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.format import open_gguf
    from ggufkit.release import release
    from ggufkit.release.plan import TextInput

    ckpt = make_checkpoint(tmp_path / "Llama-4-Tiny", CAUSAL, vocab="llama-bpe", hidden_size=256,
                           intermediate_size=256, intermediate_size_mlp=256, head_dim=64)
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q4_k_m"], master="f16", ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    quantized = next(out / f for f in result.files if f.endswith("-Q4_K_M.gguf"))
    with open_gguf(quantized) as f:
        assert f.architecture == "llama4" and f.get("quantize.imatrix.chunks_count") == 2
    for path in (master, quantized):
        assert np.isfinite(llama_cpp_logits(path)).all()
    text = tmp_path / "eval.txt"
    text.write_text(TextInput.bundled("evaluation").text, encoding="utf-8")
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    # release scores the F16 master without llama.cpp's F16 rounding of matmul inputs
    assert result.master is not None and abs(result.master["ppl"] / theirs - 1) < 5e-3, (result.master, theirs)


def tiny_f32(d: Path) -> Path:
    """A tiny Llama 4 as transformers 5 saves it (a 400-token BPE: CI time), converted to F32 by ggufkit
    (tests/test_eval_imatrix_archs.py)."""
    from ggufkit.converters import convert

    ckpt = make_checkpoint(d / "ckpt", CAUSAL, vocab="llama-bpe")
    return Path(convert(ckpt, d / "f32.gguf", outtype="f32").outputs[0])


@pytest.mark.parametrize("rope", [SCOUT_ROPE, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}],
                         ids=["scout", "smoothed-band"])
def test_rope_freqs_are_llama_cpps_converters_bit_for_bit(rope: dict[str, Any]) -> None:
    """``rope_freqs.weight`` as LlamaModel.generate_extra_tensors computes it (its own code run here on the
    config), the smoothed band between the two wavelengths included (torch float32 arithmetic)."""
    import sys
    from types import SimpleNamespace

    import gguf  # noqa: F401  (the installed gguf stays the one imported: llama.cpp's gguf-py is only a fallback)
    from llama_cpp_sources import llama_cpp_dir

    from ggufkit.converters import llama4

    root = llama_cpp_dir()
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    try:
        from conversion.llama import LlamaModel
    finally:
        del sys.path[:2]
    for theta, head_dim in ((500000.0, 128), (10000.0, 64)):
        params = {"rope_theta": theta, **rope}
        fake = SimpleNamespace(rope_parameters=params, hparams={"head_dim": head_dim},
                               format_tensor_name=lambda *_: "rope_freqs.weight")
        [(_, want)] = list(LlamaModel.generate_extra_tensors(fake))  # type: ignore[arg-type]
        [(name, got)] = llama4.extra_tensors({"rope_parameters": params, "head_dim": head_dim, "hidden_size": 256,
                                              "num_attention_heads": 2})
        assert name == "rope_freqs.weight" and got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.numpy().view(np.uint32))
