"""Falcon-H1 (TII: transformers' ``FalconH1ForCausalLM``, llama.cpp's ``falcon-h1``) end to end (issue 33).

Every block runs attention and a Mamba2 mixer side by side on the same normed input, then an FFN
(src/models/falcon-h1.cpp). llama.cpp's converter (conversion/falcon_h1.py ``FalconH1Model``) folds the muP
multipliers into the weights and stores ``A = -exp(A_log)``; the tiny checkpoints carry tiiuae/Falcon-H1-0.5B's
multipliers, two SSM groups and the gated group norm, random values in every parameter (A_log, D, dt_bias, conv
biases and norms included), and the real tokenizer kind (Llama 3's BPE standing in for Falcon-H1's, which splits
text the same way and which llama.cpp ships no vocab file of).

* Config spellings. The released configs (tiiuae/Falcon-H1-*) write ``rope_theta`` and ``head_dim``;
  transformers 5's ``save_pretrained`` writes ``rope_parameters``, and no ``head_dim`` unless the config was
  built with one (FalconH1Config has no such field; the model uses ``hidden_size // num_attention_heads``), which
  llama.cpp's converter reads in that spelling only (``self.hparams["head_dim"]``, a KeyError). Both convert to
  the file llama.cpp's converter writes from the release spelling.
* What llama.cpp would compute differently from transformers is refused in one line (exit 2).
* The evaluator (ppl vs llama-perplexity; imatrix vs llama-imatrix in tests/test_eval_imatrix_archs.py), whole
  quantized files vs llama-quantize, and ``release``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from fixtures_quantize import imatrix_values, write_imatrix_gguf
from gguf import GGMLQuantizationType
from llama_cpp_sources import tool_path
from test_convert_archs import EXTRA_KEYS, _compared_key, llama_cpp_convert
from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

from ggufkit.converters import convert
from ggufkit.eval.perplexity import perplexity, sample_text
from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.format.values import VT

HF_CLASS = "FalconH1ForCausalLM"
CTX = 64
CHUNKS = 4


def _to_release(src: Path, dst: Path) -> Path:
    """The same weights under the released config.json's spelling (tiiuae/Falcon-H1-0.5B-Base: rope_theta,
    rope_scaling null, head_dim, keys transformers does not read)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    params = config.pop("rope_parameters")
    config.pop("dtype", None)
    config.pop("time_step_limit", None)
    config.update(rope_theta=params["rope_theta"], rope_scaling=None,
                  head_dim=config["hidden_size"] // config["num_attention_heads"], attn_layer_indices=None,
                  mamba_use_mlp=True, torch_dtype="bfloat16", transformers_version="4.52.0.dev0")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights (seed 0) as transformers 5 saves them and under the released config's spelling."""
    d = tmp_path_factory.mktemp("falcon-h1")
    v5 = make_checkpoint(d / "v5", HF_CLASS)
    return {"v5": v5, "release": _to_release(v5, d / "release")}


@pytest.fixture(scope="module")
def files(layouts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ggufkit's conversions (``v5-f32``, ``release-f32``, ``v5-f16``) and llama.cpp's converter's of the release
    layout (``theirs-f32``, ``theirs-f16``)."""
    d = tmp_path_factory.mktemp("falcon-h1-files")
    out = {f"theirs-{t}": llama_cpp_convert(layouts["release"], d / f"theirs-{t}.gguf", t) for t in ("f32", "f16")}
    for name, outtype in (("v5", "f32"), ("release", "f32"), ("v5", "f16")):
        out[f"{name}-{outtype}"] = convert(layouts[name], d / f"{name}-{outtype}.gguf", outtype=outtype).outputs[0]
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def _assert_same_file(theirs: Path, ours: Path) -> None:
    """Every tensor byte-identical, every key of llama.cpp's file equal in ggufkit's (naming aside)."""
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = [k for k in a.kv if _compared_key(k)]
        extra = {k for k in b.kv if _compared_key(k)} - set(keys_a)
        assert extra <= set(EXTRA_KEYS), extra
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            assert (np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray))
                    else va == vb), key


def test_the_fixture_writes_both_spellings(layouts: dict[str, Path]) -> None:
    release = json.loads((layouts["release"] / "config.json").read_text())
    v5 = json.loads((layouts["v5"] / "config.json").read_text())
    assert "head_dim" not in v5 and "rope_theta" not in v5 and v5["rope_parameters"]["rope_theta"] == 1e11
    assert release["head_dim"] == 16 and release["rope_theta"] == 1e11 and "rope_parameters" not in release
    assert v5["time_step_limit"] == [0.0, {"__float__": "Infinity"}]  # transformers 5's spelling of inf


def test_both_spellings_convert_to_llama_cpps_file_and_run_transformers_model(layouts: dict[str, Path],
                                                                              files: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """llama.cpp's converter cannot read the transformers-5 save (no head_dim); ggufkit converts both spellings
    to the file llama.cpp's converter writes from the released one (multipliers folded, A = -exp(A_log), the SSM
    shapes), and that file gives transformers' logits in llama.cpp (f32: top-1 identical, within 1e-3 of the
    logit range; measured 3e-7)."""
    with pytest.raises(subprocess.CalledProcessError) as failed:
        llama_cpp_convert(layouts["v5"], tmp_path / "v5-theirs.gguf")
    assert "head_dim" in failed.value.stderr.decode()
    for name in ("v5", "release"):
        ours = files[f"{name}-f32"]
        _assert_same_file(files["theirs-f32"], ours)
        want, got = transformers_logits(layouts[name]), llama_cpp_logits(ours)
        assert (got.argmax(-1) == want.argmax(-1)).all()
        assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_convert_as_llama_cpp_computes_them(dtype: str, tmp_path: Path) -> None:
    """The multipliers applied in the checkpoint's own precision (f16: torch's float32 opmath rounded to f16;
    bf16: widened to float32 first), as FalconH1Model.modify_tensors computes them."""
    release = _to_release(make_checkpoint(tmp_path / "v5", HF_CLASS, dtype=dtype, seed=1), tmp_path / "release")
    outtype = "f16" if dtype == "float16" else "bf16"
    theirs = llama_cpp_convert(release, tmp_path / "theirs.gguf", outtype)
    _assert_same_file(theirs, convert(release, tmp_path / "ours.gguf", outtype=outtype).outputs[0])


def test_f16_and_f32_perplexity_equal_llama_perplexity(files: dict[str, Path], text_file: tuple[str, Path]) -> None:
    """The F32 and F16 files (llama.cpp's converter's bytes) scored by both tools on the bundled text: within
    0.1 % (F16 with llama.cpp's F16 rounding of each matmul's input, --ggml-rounding)."""
    _assert_same_file(files["theirs-f16"], files["v5-f16"])
    text, path = text_file
    for name, rounding in (("v5-f32", False), ("v5-f16", True)):
        ours = perplexity(files[name], text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=rounding,
                          kv_cache="f32")
        theirs, n_chunks = llama_perplexity(files[name], path, CTX, CHUNKS, *F32_PATH)
        assert ours.chunks == n_chunks == CHUNKS
        assert abs(ours.ppl / theirs - 1) < 1e-3, (name, ours.ppl, theirs)


def test_convert_check_runs_the_family(layouts: dict[str, Path], tmp_path: Path) -> None:
    """``convert --check``: the converted file's logits against transformers' on the checkpoint."""
    from cli_helpers import invoke

    r = invoke("convert", str(layouts["v5"]), "-o", str(tmp_path / "c.gguf"), "--outtype", "f32", "--check")
    assert r.exit_code == 0, r.stderr


def test_without_the_group_norm_as_released(text_file: tuple[str, Path], tmp_path: Path) -> None:
    """tiiuae/Falcon-H1-0.5B's switches: no gated group norm (``mamba_rms_norm`` false: no ssm_norm tensor,
    llama.cpp gates without norming), one SSM group. ggufkit's file is llama.cpp's converter's, runs
    transformers' model in llama.cpp, and ggufkit's perplexity of it equals llama-perplexity's."""
    release = _to_release(make_checkpoint(tmp_path / "v5", HF_CLASS, mamba_rms_norm=False, mamba_n_groups=1,
                                          seed=2), tmp_path / "release")
    theirs = llama_cpp_convert(release, tmp_path / "theirs.gguf")
    ours = convert(release, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    _assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        assert not any("ssm_norm" in t.name for t in f.tensors)
    want, got = transformers_logits(release), llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())
    text, path = text_file
    mine = perplexity(ours, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", kv_cache="f32")
    ref, _ = llama_perplexity(ours, path, CTX, CHUNKS, *F32_PATH)
    assert abs(mine.ppl / ref - 1) < 1e-3, (mine.ppl, ref)


def test_multipliers_a_config_leaves_out_are_transformers_defaults(tmp_path: Path) -> None:
    """llama.cpp's converter fails on a config without a multiplier (``None * tensor``); transformers runs it
    with FalconH1Config's defaults (1.0 each), so ggufkit writes the file llama.cpp's converter writes when the
    config spells those defaults out."""
    full = _to_release(make_checkpoint(tmp_path / "v5", HF_CLASS, seed=4), tmp_path / "full")
    config = json.loads((full / "config.json").read_text())
    config.update(key_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5, ssm_in_multiplier=1.0)
    (full / "config.json").write_text(json.dumps(config, indent=2))
    sparse = shutil.copytree(full, tmp_path / "sparse")
    for key in ("key_multiplier", "mlp_multipliers", "ssm_multipliers", "ssm_in_multiplier"):
        config.pop(key)
    (sparse / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(subprocess.CalledProcessError):
        llama_cpp_convert(sparse, tmp_path / "sparse-theirs.gguf")
    theirs = llama_cpp_convert(full, tmp_path / "theirs.gguf")
    _assert_same_file(theirs, convert(sparse, tmp_path / "ours.gguf", outtype="f32").outputs[0])


def _llama_kld(model: Path, base: Path, text_file: Path, tmp_path: Path) -> float:
    """llama-perplexity's mean KL divergence of ``model`` from ``base`` (--kl-divergence-base, then
    --kl-divergence), on llama.cpp's float32 attention path."""
    logits = tmp_path / "base.kld"
    common = ["-f", str(text_file), "-c", str(CTX), "-b", str(CTX), "--chunks", str(CHUNKS), "-t", "2", "-nr",
              *F32_PATH]
    llama_ppl = str(tool_path("llama-perplexity"))
    subprocess.run([llama_ppl, "-m", str(base), "--kl-divergence-base", str(logits), *common], check=True,
                   capture_output=True)
    for _ in range(10):  # its logger thread sometimes loses the last lines (tests/test_family_cohere2.py)
        r = subprocess.run([llama_ppl, "-m", str(model), "--kl-divergence-base", str(logits), "--kl-divergence",
                            *common], check=True, capture_output=True, text=True)
        found = re.search(r"Mean\s+KLD:\s+([-0-9.]+)", r.stdout + r.stderr)
        if found is not None:
            return float(found.group(1))
    raise AssertionError((r.stdout + r.stderr)[-2000:])


def test_kl_divergence_of_a_q8_0_file_equals_llama_perplexitys(text_file: tuple[str, Path], tmp_path: Path) -> None:
    """KLD of the Q8_0 conversion from the F32 one: ggufkit (llama.cpp's Q8_0 activations reproduced) against
    llama-perplexity's --kl-divergence, within 2 % of the value (measured 0.06 %). The head's multiplier is 4 here:
    with the release's 0.039 the tiny model's distributions are so flat that llama-perplexity prints 0.000000."""
    from ggufkit.eval import kl_divergence

    ckpt = make_checkpoint(tmp_path / "v5", HF_CLASS, lm_head_multiplier=4.0, seed=3)
    f32 = convert(ckpt, tmp_path / "f32.gguf", outtype="f32").outputs[0]
    q8 = convert(ckpt, tmp_path / "q8_0.gguf", outtype="q8_0").outputs[0]
    text, path = text_file
    ours = kl_divergence(q8, f32, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True,
                         kv_cache="f32")
    theirs = _llama_kld(q8, f32, path, tmp_path)
    assert ours.kld is not None and theirs > 1e-3
    assert abs(ours.kld["mean_kld"] / theirs - 1) < 2e-2, (ours.kld["mean_kld"], theirs)


# -- refusals -----------------------------------------------------------------------------------------
def _release_config(**changes: Any) -> dict[str, Any]:
    """tiiuae/Falcon-H1-0.5B-Base's config.json, with ``changes``."""
    config: dict[str, Any] = {
        "architectures": [HF_CLASS], "model_type": "falcon_h1", "attention_bias": False,
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.656854249492381,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048,
        "key_multiplier": 0.39062499999999994, "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128,
        "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128,
        "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_norm_before_gate": False,
        "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_use_mlp": True, "max_position_embeddings": 16384,
        "mlp_bias": False, "mlp_multipliers": [0.8838834764831844, 0.5859375], "num_attention_heads": 8,
        "num_hidden_layers": 36, "num_key_value_heads": 2, "projectors_bias": False, "rms_norm_eps": 1e-5,
        "rope_scaling": None, "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "vocab_size": 32784}
    config.update(changes)
    return config


def test_released_and_transformers5_configs_pass_the_hooks() -> None:
    from ggufkit.converters.falcon_h1 import check_config

    check_config(_release_config())
    check_config(_release_config(time_step_limit=[0.0, {"__float__": "Infinity"}],
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e11}))
    check_config(_release_config(mamba_rms_norm=True, mamba_norm_before_gate=False))
    check_config(_release_config(attention_bias=True, attention_in_multiplier=1.0))


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"projectors_bias": True}, "projectors_bias"),
    ({"mamba_conv_bias": False}, "mamba_conv_bias false"),
    ({"attention_bias": True, "attention_in_multiplier": 2.0}, "attention biases with attention_in_multiplier"),
    ({"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "mamba_norm_before_gate with mamba_rms_norm"),
    ({"mamba_rms_norm": True, "mamba_norm_before_gate": None}, "mamba_norm_before_gate with mamba_rms_norm"),
    ({"time_step_limit": [0.001, 0.1]}, "time_step_limit [0.001, 0.1]"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e11}}, "rope_parameters type 'linear'"),
    ({"tie_word_embeddings": True}, "a tied head with lm_head_multiplier != embedding_multiplier"),
    ({"mamba_d_ssm": None}, "no mamba_d_ssm"),
])
def test_configs_llama_cpp_would_run_as_another_model_are_refused(changes: dict[str, Any], message: str) -> None:
    from ggufkit.converters.falcon_h1 import check_config
    from ggufkit.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as e:
        check_config(_release_config(**changes))
    assert str(e.value).startswith("falcon-h1: llama.cpp would compute another model: ") and message in str(e.value)


def test_a_tied_head_with_equal_multipliers_passes() -> None:
    from ggufkit.converters.falcon_h1 import check_config

    check_config(_release_config(tie_word_embeddings=True, lm_head_multiplier=2.0, embedding_multiplier=2.0))


def test_convert_refuses_in_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", HF_CLASS, mamba_norm_before_gate=True)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "falcon-h1: llama.cpp would compute another model" in err
    assert "mamba_norm_before_gate" in err and err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


# -- quantization -------------------------------------------------------------------------------------
def _quant_source(path: Path, n_layer: int = 4, d: int = 256) -> Path:
    """A falcon-h1 F16 file wide enough for every k-quant, laid out as llama.cpp's converter writes one: F32
    vectors, SSM A/D/norm and conv kernel, F16 matrices; untied head; seeded random data."""
    d_inner, d_state, n_group, n_head, ff, vocab = 256, 16, 2, 4, 512, 256
    conv = d_inner + 2 * n_group * d_state
    hp: dict[str, int | float] = {
        "context_length": 256, "embedding_length": d, "block_count": n_layer, "feed_forward_length": ff,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 64,
        "attention.value_length": 64, "rope.freq_base": 1e11, "attention.layer_norm_rms_epsilon": 1e-5,
        "ssm.conv_kernel": 4, "ssm.inner_size": d_inner, "ssm.state_size": d_state, "ssm.time_step_rank": n_head,
        "ssm.group_count": n_group, "vocab_size": vocab}
    tensors = [("token_embd.weight", (vocab, d)), ("output_norm.weight", (d,)), ("output.weight", (vocab, d))]
    per = [("attn_norm.weight", (d,)), ("attn_q.weight", (d, d)), ("attn_k.weight", (d // 2, d)),
           ("attn_v.weight", (d // 2, d)), ("attn_output.weight", (d, d)),
           ("ssm_in.weight", (d_inner + conv + n_head, d)), ("ssm_conv1d.weight", (conv, 4)),
           ("ssm_conv1d.bias", (conv,)), ("ssm_dt.bias", (n_head,)), ("ssm_a", (n_head, 1)), ("ssm_d", (n_head, 1)),
           ("ssm_norm.weight", (n_group, d_inner // n_group)), ("ssm_out.weight", (d, d_inner)),
           ("ffn_norm", (d,)), ("ffn_gate.weight", (ff, d)), ("ffn_up.weight", (ff, d)), ("ffn_down.weight", (d, ff))]
    tensors += [(f"blk.{i}.{n}", s) for i in range(n_layer) for n, s in per]
    rng = np.random.default_rng(4)
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "falcon-h1")
    for key, value in hp.items():
        meta.set(f"falcon-h1.{key}", VT.FLOAT32 if isinstance(value, float) else VT.UINT32, value)
    specs, arrays = [], []
    for name, shape in tensors:
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        wide = name.endswith(".weight") and len(shape) == 2 and "norm" not in name and "conv1d" not in name
        specs.append(TensorSpec(name, GGMLQuantizationType.F16 if wide else GGMLQuantizationType.F32, shape))
        arrays.append(arr.astype(np.float16) if wide else arr)
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("falcon-h1-quant")
    src = _quant_source(d / "falcon-h1.gguf")
    return src, write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(src))


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q3_k_s", False), ("q6_k", False),
                                                      ("q8_0", False), ("q2_k", True), ("q5_k_s", True),
                                                      ("iq3_xs", True), ("iq2_xs", True)])
def test_quantized_file_equals_llama_quantize(quant_model: tuple[Path, Path], target: str, with_imatrix: bool,
                                              tmp_path: Path) -> None:
    """Whole files, byte for byte and key for key, as the llama-quantize binary writes them: ssm_conv1d and the
    small SSM tensors as llama-quantize keeps them, every attention layer counted (all of Falcon-H1's blocks have
    one), with and without an importance matrix."""
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    src, imat = quant_model
    flags = ["--imatrix", str(imat)] if with_imatrix else []
    r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(src), str(tmp_path / "ref.gguf"),
                        target.upper(), "2"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    quantize_file(src, tmp_path / "ours.gguf", target, imatrix=imat if with_imatrix else None, threads=2,
                  device="cpu")
    with open_gguf(tmp_path / "ref.gguf") as a, open_gguf(tmp_path / "ours.gguf") as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        keys = [k for k in a.kv if not k.startswith("ggufkit.")]
        assert keys == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray)) \
                else va == vb, key


# -- release ------------------------------------------------------------------------------------------
def test_release_of_a_tiny_falcon_h1(text_file: tuple[str, Path], tmp_path: Path) -> None:
    """``release`` end to end: F16 master, importance matrix, a Q8_0 file whose perplexity and KLD the manifest
    reports; every GGUF loads in llama.cpp."""
    from ggufkit.release import release

    ckpt = _to_release(make_checkpoint(tmp_path / "v5", HF_CLASS), tmp_path / "tiny-falcon-h1")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q8_0"], master="f16", imatrix_text=text_file[1], ctx=CTX, chunks=2,
                     imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    ggufs = [out / f for f in result.files if f.endswith(".gguf") and ".imatrix" not in f]
    assert len(ggufs) == 2 and any(p.name.endswith("-Q8_0.gguf") for p in ggufs), result.files
    for path in ggufs:
        with open_gguf(path) as f:
            assert f.architecture == "falcon-h1"
        assert np.isfinite(llama_cpp_logits(path)).all()
