"""Cohere 2 (Command R7B, Command A: transformers' ``Cohere2ForCausalLM``) end to end (issue 33).

The shared runners hold the release-layout checkpoint: tests/test_convert_archs.py (bytes and keys against
llama.cpp's converter, llama.cpp's logits against transformers', ``ppl``, ``--check``),
tests/test_eval_archs_vs_llama_perplexity.py (F32 against llama-perplexity), tests/test_eval_imatrix_archs.py
(against llama-imatrix) and tests/test_quant_presets_oracle.py (every preset's plan, with and without an
importance matrix). Here: what only this family has.

* Config spellings. The released configs (c4ai-command-r7b-12-2024, command-a-03-2025) write ``rotary_pct``,
  ``rope_theta`` and ``sliding_window_pattern``; transformers 5's ``save_pretrained`` writes
  ``rope_parameters`` and ``layer_types`` and no ``rotary_pct``, which llama.cpp's converter reads in that
  spelling only (conversion/command_r.py ``Cohere2Model.set_gguf_parameters``: ``self.hparams["rotary_pct"]``,
  a KeyError). ggufkit converts a transformers-5 save to the file llama.cpp's converter writes for the same
  weights under the release config, and that file runs transformers' model.
* The schedule. llama.cpp's cohere2 loader fixes it (every 4th layer global, no RoPE there) and its converter
  writes no pattern key, so another ``sliding_window_pattern`` / ``layer_types`` would silently run another
  model: refused, as are an untied head, attention biases and rope scaling.
* F16 perplexity and KL divergence against llama-perplexity, whole quantized files against llama-quantize, and
  ``release``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from fixtures_quantize import arch_case, imatrix_values, make_gguf, write_imatrix_gguf
from llama_cpp_sources import tool_path
from test_convert_archs import EXTRA_KEYS, _compared_key, llama_cpp_convert
from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

from ggufkit.converters import convert
from ggufkit.eval.perplexity import perplexity, sample_text
from ggufkit.format import open_gguf

HF_CLASS = "Cohere2ForCausalLM"
CTX = 64
CHUNKS = 4


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights (seed 0) as transformers 5 saves them and under the released config's spelling."""
    d = tmp_path_factory.mktemp("cohere2")
    return {"v5": make_checkpoint(d / "v5", HF_CLASS), "release": make_checkpoint(d / "release", HF_CLASS,
                                                                                 config_style="release")}


@pytest.fixture(scope="module")
def files(layouts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ggufkit's conversions (``v5-f32``, ``release-f32``, ``v5-f16``, ``v5-q8_0``) and llama.cpp's converter's
    of the release layout (``theirs-f32``, ``theirs-f16``)."""
    d = tmp_path_factory.mktemp("cohere2-files")
    out = {f"theirs-{t}": llama_cpp_convert(layouts["release"], d / f"theirs-{t}.gguf", t) for t in ("f32", "f16")}
    for name, outtype in (("v5", "f32"), ("release", "f32"), ("v5", "f16"), ("v5", "q8_0")):
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


def test_release_config_spelling_is_what_the_fixture_writes(layouts: dict[str, Path]) -> None:
    release = json.loads((layouts["release"] / "config.json").read_text())
    v5 = json.loads((layouts["v5"] / "config.json").read_text())
    assert release["rotary_pct"] == 1.0 and release["sliding_window_pattern"] == 4 and "layer_types" not in release
    assert "rotary_pct" not in v5 and "sliding_window_pattern" not in v5
    assert v5["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert v5["rope_parameters"]["rope_theta"] == release["rope_theta"] == 50000.0


def test_transformers5_save_converts_to_llama_cpps_file_of_the_release_config(layouts: dict[str, Path],
                                                                             files: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """llama.cpp's converter cannot read the transformers-5 spelling (no rotary_pct); ggufkit converts it to the
    file llama.cpp's converter writes from the released spelling of the same weights, and both run
    transformers' model in llama.cpp (f32: top-1 identical, within 1e-3 of the logit range)."""
    with pytest.raises(subprocess.CalledProcessError) as failed:
        llama_cpp_convert(layouts["v5"], tmp_path / "v5-theirs.gguf")
    assert "rotary_pct" in failed.value.stderr.decode()
    for name in ("v5", "release"):
        ours = files[f"{name}-f32"]
        _assert_same_file(files["theirs-f32"], ours)
        want, got = transformers_logits(layouts[name]), llama_cpp_logits(ours)
        assert (got.argmax(-1) == want.argmax(-1)).all()
        assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_f16_perplexity_equals_llama_perplexity(files: dict[str, Path], text_file: tuple[str, Path]) -> None:
    """The F16 file (llama.cpp's converter's bytes) scored by both tools on the bundled text: within 0.1 %, with
    llama.cpp's F16 rounding of each matmul's input reproduced (--ggml-rounding)."""
    f16 = files["v5-f16"]
    _assert_same_file(files["theirs-f16"], f16)
    text, path = text_file
    ours = perplexity(f16, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True, kv_cache="f32")
    theirs, n_chunks = llama_perplexity(f16, path, CTX, CHUNKS, *F32_PATH)
    assert ours.chunks == n_chunks == CHUNKS
    assert abs(ours.ppl / theirs - 1) < 1e-3, (ours.ppl, theirs)


def _llama_kld(model: Path, base: Path, text_file: Path, tmp_path: Path) -> float:
    """llama-perplexity's mean KL divergence of ``model`` from ``base`` (--kl-divergence-base, then
    --kl-divergence), on llama.cpp's float32 attention path."""
    logits = tmp_path / "base.kld"
    common = ["-f", str(text_file), "-c", str(CTX), "-b", str(CTX), "--chunks", str(CHUNKS), "-t", "2", "-nr",
              *F32_PATH]
    llama_ppl = str(tool_path("llama-perplexity"))
    subprocess.run([llama_ppl, "-m", str(base), "--kl-divergence-base", str(logits), *common], check=True,
                   capture_output=True)
    for _ in range(10):  # its logger thread sometimes loses the last lines (tests/test_eval_archs_vs_...)
        r = subprocess.run([llama_ppl, "-m", str(model), "--kl-divergence-base", str(logits), "--kl-divergence",
                            *common], check=True, capture_output=True, text=True)
        found = re.search(r"Mean\s+KLD:\s+([-0-9.]+)", r.stdout + r.stderr)
        if found is not None:
            return float(found.group(1))
    raise AssertionError((r.stdout + r.stderr)[-2000:])


def test_kl_divergence_of_a_q8_0_file_equals_llama_perplexitys(files: dict[str, Path], text_file: tuple[str, Path],
                                                               tmp_path: Path) -> None:
    """KLD of the Q8_0 conversion from the F32 one: ggufkit (llama.cpp's Q8_0 activations reproduced) against
    llama-perplexity's --kl-divergence, within 2 % of the value."""
    from ggufkit.eval import kl_divergence

    f32, q8 = files["v5-f32"], files["v5-q8_0"]
    text, path = text_file
    ours = kl_divergence(q8, f32, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True,
                         kv_cache="f32")
    theirs = _llama_kld(q8, f32, path, tmp_path)
    assert ours.kld is not None and theirs > 0
    assert abs(ours.kld["mean_kld"] / theirs - 1) < 2e-2, (ours.kld["mean_kld"], theirs)


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A cohere2 F16 file wide enough for every k-quant (tests/fixtures_quantize.py arch_case) and an
    importance matrix file for it."""
    d = tmp_path_factory.mktemp("cohere2-quant")
    arch, hp, tensors = arch_case("cohere2", n_layer=8)
    src = make_gguf(d / "cohere2.gguf", arch, hp, tensors, seed=4)
    return src, write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(src))


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q3_k_s", False), ("q2_k", True),
                                                      ("q5_k_s", True), ("iq3_xs", True)])
def test_quantized_file_equals_llama_quantize(quant_model: tuple[Path, Path], target: str, with_imatrix: bool,
                                              tmp_path: Path) -> None:
    """Whole files, byte for byte and key for key, as the llama-quantize binary writes them: the tied
    embedding quantized as the head (llama_tensor_get_type's has_tied_embeddings), every block tensor by its
    rules, with and without an importance matrix."""
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


def test_release_of_a_tiny_command_r7b(text_file: tuple[str, Path], tmp_path: Path) -> None:
    """``release`` end to end: F16 master, importance matrix, a Q8_0 file whose perplexity and KLD the manifest
    reports; every GGUF loads in llama.cpp."""
    from ggufkit.release import release

    ckpt = make_checkpoint(tmp_path / "tiny-command-r7b", HF_CLASS, config_style="release")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q8_0"], master="f16", imatrix_text=text_file[1], ctx=CTX, chunks=2,
                     imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    ggufs = [out / f for f in result.files if f.endswith(".gguf") and ".imatrix" not in f]
    assert len(ggufs) == 2 and any(p.name.endswith("-Q8_0.gguf") for p in ggufs), result.files
    for path in ggufs:
        with open_gguf(path) as f:
            assert f.architecture == "cohere2"
        assert np.isfinite(llama_cpp_logits(path)).all()


def _release_config(**changes: Any) -> dict[str, Any]:
    """Command R7B's released config.json (CohereLabs/c4ai-command-r7b-12-2024), with ``changes``."""
    config: dict[str, Any] = {
        "architectures": [HF_CLASS], "model_type": "cohere2", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "layer_norm_eps": 1e-5, "logit_scale": 0.25, "max_position_embeddings": 132096,
        "rope_theta": 50000, "rope_scaling": None, "rotary_pct": 1.0, "sliding_window": 4096,
        "sliding_window_pattern": 4, "layer_switch": 4, "order_of_interleaved_layers": "local_attn_first",
        "position_embedding_type": "rope_gptj", "attention_bias": False, "use_embedding_sharing": True,
        "use_gated_activation": True, "tie_word_embeddings": True, "vocab_size": 256000}
    config.update(changes)
    return config


def _v5_config(**changes: Any) -> dict[str, Any]:
    """The same model as transformers 5's save_pretrained writes it (layer_types, rope_parameters)."""
    config = _release_config()
    for key in ("rope_theta", "rope_scaling", "rotary_pct", "sliding_window_pattern", "layer_switch",
                "order_of_interleaved_layers", "position_embedding_type", "use_embedding_sharing",
                "use_gated_activation"):
        config.pop(key)
    config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    config.update(changes)
    return config


def test_released_and_transformers5_configs_pass_the_hooks() -> None:
    from ggufkit.converters.cohere2 import check_config

    check_config(_release_config())
    check_config(_v5_config())
    check_config({k: v for k, v in _release_config().items() if k != "sliding_window_pattern"})  # the default 4


@pytest.mark.parametrize(("config", "message"), [
    # every spelling of the schedule: the release configs' period, transformers 5's list
    (_release_config(sliding_window_pattern=2), "a layer schedule other than llama.cpp's fixed one"),
    (_v5_config(layer_types=["sliding_attention"] * 32), "a layer schedule other than llama.cpp's fixed one"),
    (_v5_config(layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 8),
     "a layer schedule other than llama.cpp's fixed one"),
    # layer_types wins over a stale period (transformers reads the list when both are there)
    (_release_config(layer_types=["sliding_attention"] * 32), "a layer schedule other than llama.cpp's fixed one"),
    (_release_config(tie_word_embeddings=False), "an lm_head not tied to the embeddings"),
    (_release_config(use_embedding_sharing=False), "an lm_head not tied to the embeddings"),
    (_release_config(attention_bias=True), "attention biases"),
    (_release_config(hidden_act="gelu"), "hidden_act 'gelu'"),
    (_release_config(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling type 'linear'"),
    (_v5_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 50000.0}),
     "rope_parameters type 'yarn'"),
])
def test_configs_llama_cpp_would_run_as_another_model_are_refused(config: dict[str, Any], message: str) -> None:
    from ggufkit.converters.cohere2 import check_config
    from ggufkit.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as e:
        check_config(config)
    assert str(e.value).startswith("cohere2: llama.cpp would compute another model: ") and message in str(e.value)


def test_keys_a_config_leaves_out_are_autoconfigs_defaults(tmp_path: Path) -> None:
    """llama.cpp's converter reads the config through AutoConfig, so a key config.json leaves out is written as
    Cohere2Config's default (and head_dim always): ggufkit writes the same values."""
    import transformers

    from ggufkit.converters.hparams import resolve_hparams
    from ggufkit.converters.registry import load_registry

    minimal = {"architectures": [HF_CLASS], "model_type": "cohere2", "hidden_size": 256, "intermediate_size": 512,
               "num_hidden_layers": 4, "num_attention_heads": 4, "rotary_pct": 1.0, "sliding_window": 8,
               "vocab_size": 256000}
    (tmp_path / "config.json").write_text(json.dumps(minimal))
    auto = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    got = resolve_hparams(load_registry().get(HF_CLASS), minimal)
    want = {"context_length": auto["max_position_embeddings"], "attention.layer_norm_epsilon": auto["layer_norm_eps"],
            "attention.head_count_kv": auto["num_key_value_heads"], "attention.key_length": auto["head_dim"],
            "attention.value_length": auto["head_dim"], "logit_scale": auto["logit_scale"],
            "rope.dimension_count": auto["head_dim"]}
    assert {k: got[f"cohere2.{k}"][1] for k in want} == pytest.approx(want)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"config_style": "release", "sliding_window_pattern": 2}, "a layer schedule other than llama.cpp's fixed one"),
    ({"layer_types": ["sliding_attention"] * 4}, "a layer schedule other than llama.cpp's fixed one"),
    ({"tie_word_embeddings": False}, "an lm_head not tied to the embeddings"),
])
def test_convert_refuses_them_in_one_line_and_writes_nothing(overrides: dict[str, Any], message: str,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", HF_CLASS, **overrides)
    if overrides.get("config_style") == "release":  # the fixture writes the model's own period; set another
        config = json.loads((d / "config.json").read_text())
        config["sliding_window_pattern"] = overrides["sliding_window_pattern"]
        (d / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "cohere2: llama.cpp would compute another model" in err and message in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()
