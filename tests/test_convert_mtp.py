"""Multi-token-prediction (MTP / NextN) layers as llama.cpp's converter writes them (issues 32 and 33).

Released Qwen3.5 and Qwen3-Next checkpoints carry an MTP block that transformers' classes drop on load and
leave out of ``save_pretrained``: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.norm`` and a full-attention decoder block ``mtp.layers.0.*`` (self_attn q/k/v/o and q/k norms,
input_layernorm, post_attention_layernorm, the layer's FFN: dense, or router, experts and shared expert), as
the releases' model.safetensors.index.json list them. The tiny checkpoints here are transformers' own
(tests/test_family_qwen35.py, test_family_qwen3next.py, test_family_qwen35moe.py) with such tensors added,
random, in the trunk's layout. llama.cpp's converter (conversion/qwen.py ``_QwenMtpMixin``) is the oracle for
its three modes: the default (MTP block kept as ``blk.{num_hidden_layers}``, ``block_count + 1``,
``nextn_predict_layers``), ``--no-mtp`` and ``--mtp`` (the draft: MTP block, embeddings, output norm, head).
llama.cpp's graph does not run the MTP block in the main pass, so the default file gives the --no-mtp file's
logits, perplexity and importance matrix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_family_qwen3next as qwen3next
import test_family_qwen35 as qwen35
import test_family_qwen35moe as qwen35moe
from fixtures_models import llama_cpp_logits
from llama_cpp_sources import llama_cpp_dir

MODES = {"default": None, "no-mtp": False, "mtp": True}
FLAGS = {"default": (), "no-mtp": ("--no-mtp",), "mtp": ("--mtp",)}


def add_mtp(d: Path, n_mtp: int = 1, seed: int = 7) -> Path:
    """Add random ``mtp.*`` tensors to the checkpoint in ``d`` as the releases store them: ``n_mtp`` copies of
    the last full-attention layer's tensor names under ``mtp.layers.{i}.`` and the head's fc and norms."""
    import torch
    from safetensors.torch import load_file, save_file

    path = d / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    prefix = next(p for p in ("model.language_model.", "model.") if f"{p}embed_tokens.weight" in tensors)
    last = max(int(m.group(1)) for n in tensors
               if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.self_attn\.q_proj\.", n)))
    embd = tensors[f"{prefix}embed_tokens.weight"]
    hidden = embd.shape[1]

    def rand(name: str, shape: tuple[int, ...]) -> Any:
        if len(shape) >= 2:
            v = torch.randn(shape, generator=g) * 0.15
        else:
            v = (1.0 if "norm" in name else 0.0) + torch.randn(shape, generator=g) * 0.1
        return v.to(embd.dtype)

    layer = f"{prefix}layers.{last}."
    for i in range(n_mtp):
        for name, value in list(tensors.items()):
            if name.startswith(layer):
                tensors[f"mtp.layers.{i}.{name[len(layer):]}"] = rand(name, tuple(value.shape))
    tensors["mtp.fc.weight"] = rand("fc", (hidden, 2 * hidden))
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        tensors[name] = rand(name, (hidden,))
    save_file(tensors, path, metadata={"format": "pt"})
    return d


def set_config(d: Path, **fields: Any) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(fields)
    (d / "config.json").write_text(json.dumps(config, indent=2))


def llama_cpp_convert(model: Path, out: Path, mode: str, outtype: str = "f32") -> Path:
    """llama.cpp's converter in ``mode``; ``out`` a folder: its default file name there."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype, *FLAGS[mode]], check=True, capture_output=True, env=env)
    if out.is_dir():
        (written,) = out.glob("*.gguf")
        return written
    return out


def convert(model: Path, out: Path | str, mode: str, outtype: str = "f32") -> Path:
    from ggufkit.converters import convert as run

    return Path(run(model, out, outtype=outtype, mtp=MODES[mode]).outputs[0])


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Qwen3.5 dense in the release layout (``mtp_num_hidden_layers: 1``) with an MTP block: llama.cpp's file in
    each mode (--mtp into a folder, for its default name)."""
    root = tmp_path_factory.mktemp("mtp-qwen35")
    d = add_mtp(qwen35.make_qwen35(root / "Qwen3.5-Tiny", "release"))
    set_config(d, mtp_num_hidden_layers=1)
    (root / "draft").mkdir()
    theirs = {mode: llama_cpp_convert(d, root / ("draft" if mode == "mtp" else f"{mode}.gguf"), mode)
              for mode in MODES}
    return {"dir": d, "theirs": theirs, "root": root}


def test_each_mode_equals_llama_cpps_converter(dense: dict[str, Any], tmp_path: Path) -> None:
    """Default, --no-mtp and --mtp: every tensor byte-identical (the norms 1 + w, the MTP head's enorm / hnorm /
    shared_head_norm included) and every key equal; the draft's default name is llama.cpp's (mtp-, no size
    label)."""
    from ggufkit.format import open_gguf

    for mode in ("default", "no-mtp"):
        qwen35.assert_same_file(dense["theirs"][mode], convert(dense["dir"], tmp_path / f"{mode}.gguf", mode))
    out = tmp_path / "draft"
    out.mkdir()
    draft = convert(dense["dir"], str(out) + os.sep, "mtp")
    assert draft.name == dense["theirs"]["mtp"].name == "mtp-Qwen3.5-Tiny-F32.gguf"
    qwen35.assert_same_file(dense["theirs"]["mtp"], draft)
    with open_gguf(tmp_path / "default.gguf") as f:
        assert f.get("qwen35.block_count") == 5 and f.get("qwen35.nextn_predict_layers") == 1
        assert list(f.get("qwen35.attention.recurrent_layers")) == [True, True, True, False, False]
        assert {t.name for t in f.tensors if t.name.startswith("blk.4.nextn.")} == {
            f"blk.4.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    with open_gguf(draft) as f:
        assert {t.name.split(".")[1] for t in f.tensors if t.name.startswith("blk.")} == {"4"}
        assert {t.name for t in f.tensors if not t.name.startswith("blk.")} == {
            "token_embd.weight", "output_norm.weight", "output.weight"}


@pytest.mark.parametrize(("family", "layout", "mode"), [(qwen3next, "release", "default"),
                                                        (qwen35moe, "tf5", "mtp")])
def test_moe_classes_equal_llama_cpps_converter(family: Any, layout: str, mode: str, tmp_path: Path) -> None:
    """Qwen3-Next as released (no ``mtp_num_hidden_layers``: the count comes from the checkpoint, as
    _QwenMtpMixin's opt_num_mtp_layers) and Qwen3.5-MoE as transformers 5 saves it (fused experts): the MTP
    block's router, experts and shared expert stacked as the trunk's (one mode each: CI time)."""
    d = add_mtp(qwen3next.make_model(tmp_path / "m", family.HF_CLASS, layout, family.to_release_config))
    assert "mtp_num_hidden_layers" not in json.loads((d / "config.json").read_text())
    theirs = llama_cpp_convert(d, tmp_path / f"theirs-{mode}.gguf", mode)
    qwen35.assert_same_file(theirs, convert(d, tmp_path / f"{mode}.gguf", mode))


def test_the_default_file_runs_the_trunk_only(dense: dict[str, Any]) -> None:
    """llama.cpp loads the default file and does not run the MTP block: the --no-mtp file's logits exactly;
    ggufkit's evaluator (block loops up to block_count - nextn_predict_layers) gives the same."""
    import torch
    from fixtures_models import TOKENS

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(dense["theirs"]["no-mtp"])
    assert np.array_equal(llama_cpp_logits(dense["theirs"]["default"]), want)
    with load_model(dense["theirs"]["default"], device="cpu") as m:
        assert (m.hparams.n_layer, m.hparams.n_trunk) == (5, 4)
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


def test_ppl_and_imatrix_on_the_default_file_equal_llama_cpps(dense: dict[str, Any], tmp_path: Path) -> None:
    """``ggufkit ppl`` equals llama-perplexity's on the MTP-carrying file; llama-imatrix collects nothing from
    the MTP block (the main graph never multiplies by it), and neither does ggufkit imatrix."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity, sample_text

    text = sample_text()[:6000]
    path = tmp_path / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    model = dense["theirs"]["default"]
    ours = perplexity(model, text=text, ctx=64, chunks=4, device="cpu", kv_cache="f32")
    theirs, n_chunks = llama_perplexity(model, path, 64, 4, *F32_PATH)
    assert ours.chunks == n_chunks == 4 and abs(ours.ppl / theirs - 1) < 1e-3, (ours.ppl, theirs)
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, relative_l2
    from test_eval_imatrix import ours as ggufkit_imatrix
    from test_eval_imatrix_archs import CHUNKS, CTX, F32_TOLERANCE

    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", path, "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", model, "-o", ref, *common, *F32_ATTENTION)
    ggufkit_imatrix(model, "-o", mine, *common)
    rel = relative_l2(mine, ref)  # the same entries in both
    assert {name.split(".")[1] for name in rel if name.startswith("blk.")} == {"0", "1", "2", "3"}
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- options and refusals --------------------------------------------------------------------------------
def _cli(*args: str) -> tuple[int, str]:
    from cli_helpers import invoke

    result = invoke("convert", *args)
    return result.exit_code, result.stderr


def test_both_options_at_once_are_refused_in_one_line(tmp_path: Path) -> None:
    code, err = _cli(str(tmp_path), "--mtp", "--no-nextn", "-o", str(tmp_path / "x.gguf"))
    assert code == 2 and "--mtp writes only the multi-token-prediction layers, --no-mtp leaves them out" in err
    assert not (tmp_path / "x.gguf").exists()


def test_the_options_are_refused_for_a_class_without_mtp_layers(tmp_path: Path) -> None:
    from fixtures_models import make_checkpoint

    d = make_checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    for option in ("--mtp", "--no-mtp"):
        code, err = _cli(str(d), option, "-o", str(tmp_path / "x.gguf"))
        assert code == 2 and f"{option}: LlamaForCausalLM has no multi-token-prediction layers" in err, err
        assert err.strip().count("\n") == 0 and not (tmp_path / "x.gguf").exists()


def test_a_checkpoint_without_mtp_layers(tmp_path: Path) -> None:
    """Converts without a flag to llama.cpp's --no-mtp file (llama.cpp's converter asserts on such a Qwen3-Next
    without --no-mtp; tests/test_family_qwen3next.py compares the files), also where the config announces MTP
    layers as the Qwen3.5 release configs do (``mtp_num_hidden_layers: 1``; llama.cpp's converter would write
    block_count + 1 and nextn_predict_layers with no MTP tensors); --mtp is refused, --no-mtp accepted."""
    from ggufkit.format import open_gguf

    d = qwen3next.make_model(tmp_path / "m", qwen3next.HF_CLASS, "tf5", qwen3next.to_release_config)
    set_config(d, mtp_num_hidden_layers=1)
    default = convert(d, tmp_path / "default.gguf", "default")
    with open_gguf(default) as f:
        assert f.get("qwen3next.block_count") == 4 and "qwen3next.nextn_predict_layers" not in f.kv
    assert default.read_bytes() == convert(d, tmp_path / "no-mtp.gguf", "no-mtp").read_bytes()
    code, err = _cli(str(d), "--mtp", "-o", str(tmp_path / "x.gguf"))
    assert code == 2 and "--mtp: the checkpoint has no multi-token-prediction layers (mtp.layers.*)" in err, err


def test_a_config_count_the_checkpoint_disagrees_with_is_refused(tmp_path: Path) -> None:
    d = add_mtp(qwen3next.make_model(tmp_path / "m", qwen3next.HF_CLASS, "tf5", qwen3next.to_release_config))
    set_config(d, mtp_num_hidden_layers=2)
    code, err = _cli(str(d), "-o", str(tmp_path / "x.gguf"))
    assert code == 2 and "config.json says 2 multi-token-prediction layers (mtp_num_hidden_layers), the " \
        "checkpoint has 1" in err, err


# -- quantize --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_mtp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A qwen3next file of quantizable widths with one MTP block (blk.8), and an importance matrix with the
    entries llama-imatrix writes for it: none for the MTP block, which the main graph never runs."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("mtp-quant")
    model = qwen3next.hybrid_moe_gguf(d / "qwen3next-mtp.gguf", "qwen3next", n_mtp=1)
    values = {k: v for k, v in imatrix_values(model).items()
              if not k.endswith("ssm_conv1d.weight") and not k.startswith("blk.8.")}
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", values)}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize_with_an_mtp_block(quant_mtp: dict[str, Path],
                                                                with_imatrix: bool) -> None:
    """llama_tensor_get_type for every TYPE: the layer counts are block_count (n_layer_all, MTP block
    included: llama-quantize's n_ffn_down and layer_info), nextn.eh_proj by its default rules."""
    qwen3next.assert_every_preset_plans_as_llama_quantize(quant_mtp, with_imatrix)


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q3_k_s", False), ("q4_k_m", True),
                                                      ("iq4_xs", True)])
def test_whole_files_equal_llama_quantize_with_an_mtp_block(quant_mtp: dict[str, Path], target: str,
                                                            with_imatrix: bool, tmp_path: Path) -> None:
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.quant import quantize_file

    flags = ["--imatrix", str(quant_mtp["imatrix"])] if with_imatrix else []
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    subprocess.run([str(tool_path("llama-quantize")), *flags, str(quant_mtp["model"]), str(ref), target.upper(),
                    "2"], check=True, capture_output=True)
    quantize_file(quant_mtp["model"], ours, target, imatrix=quant_mtp["imatrix"] if with_imatrix else None,
                  threads=2)
    assert_same_quantized(ref, ours)


# -- release ---------------------------------------------------------------------------------------------
def test_release_of_an_mtp_checkpoint(dense: dict[str, Any], tmp_path: Path) -> None:
    """``ggufkit release`` keeps the MTP block as llama.cpp's converter does by default (master and quant carry
    blk.4 and nextn_predict_layers); llama.cpp loads the quant; the imatrix has no MTP entries."""
    from ggufkit.format import open_gguf
    from ggufkit.release import release

    out = tmp_path / "release"
    result = release(dense["dir"], out, types=["q8_0"], master="f32", ctx=64, chunks=2, imatrix_chunks=2,
                     device="cpu")
    assert result.ok, result.failures
    quantized = next(out / f for f in result.files if f.endswith("-Q8_0.gguf"))
    with open_gguf(quantized) as f:
        assert f.get("qwen35.nextn_predict_layers") == 1 and "blk.4.nextn.eh_proj.weight" in {t.name for t in f.tensors}
    assert np.isfinite(llama_cpp_logits(quantized)).all()
    imatrix = next(out / f for f in result.files if "imatrix" in f)
    with open_gguf(imatrix) as f:
        assert not any(t.name.startswith("blk.4.") for t in f.tensors)


def test_the_draft_is_written_by_the_cli_and_its_check_skipped(dense: dict[str, Any], tmp_path: Path) -> None:
    """``convert --mtp`` (check on by default): the draft file, exit 0, and the check skipped and said so (the
    draft has no trunk, transformers no MTP block)."""
    from cli_helpers import invoke

    out = tmp_path / "draft.gguf"
    result = invoke("convert", str(dense["dir"]), "--mtp", "--outtype", "f32", "-o", str(out), "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["check"] == "skipped" and "--mtp draft" in data["check_reason"]
    assert out.read_bytes() == convert(dense["dir"], tmp_path / "api.gguf", "mtp").read_bytes()


def test_declared_layers_without_tensors() -> None:
    """``mtp.declared`` (GLM: llama.cpp's converter announces the config's NextN count, AutoConfig's default 1
    where config.json has none, even when the checkpoint holds no NextN tensors): block_count + n and
    nextn_predict_layers without tensors; --no-mtp drops the announcement, --mtp is refused; without
    ``declared`` such a checkpoint converts as --no-mtp. A malformed value is a registry error."""
    from ggufkit.converters.mtp import MtpSpec, mtp_layers
    from ggufkit.converters.registry import parse_registry
    from ggufkit.errors import RegistryError, UsageError
    from ggufkit.format.values import VT

    spec = MtpSpec("model.layers.{bid}", "model.layers.{bid}", count=("num_nextn_predict_layers",), declared=1)
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    hp = {"glm4moe.block_count": (VT.UINT32, 2)}
    for config, n in (({}, 1), ({"num_nextn_predict_layers": 2}, 2), ({"num_nextn_predict_layers": 0}, 0)):
        layers = mtp_layers(spec, "Glm4MoeForCausalLM", "", config, names, 2, None)
        assert layers.n_mtp == n and layers.split(names) == (names, [])
        want = {"glm4moe.block_count": (VT.UINT32, 2 + n), "glm4moe.nextn_predict_layers": (VT.UINT32, n)}
        assert layers.hparams(hp, "glm4moe") == (want if n else hp)
    assert mtp_layers(spec, "Glm4MoeForCausalLM", "", {}, names, 2, False).hparams(hp, "glm4moe") == hp
    with pytest.raises(UsageError, match="--mtp: the checkpoint has no multi-token-prediction layers"):
        mtp_layers(spec, "Glm4MoeForCausalLM", "", {}, names, 2, True)
    plain = MtpSpec("model.layers.{bid}", "model.layers.{bid}", count=("num_nextn_predict_layers",))
    assert mtp_layers(plain, "X", "", {"num_nextn_predict_layers": 1}, names, 2, None).hparams(hp, "glm4moe") == hp
    text = ("X:\n  arch: llama\n  vocab: [bpe]\n  hparams: {block_count: [num_hidden_layers]}\n"
            "  tensors: {model.embed_tokens: TOKEN_EMBD}\n"
            "  mtp: {blocks: {'model.layers.{bid}': 'model.layers.{bid}'}, declared: -1}\n")
    with pytest.raises(RegistryError, match="declared: expected a non-negative integer"):
        parse_registry(text)
