"""``convert --check`` on checkpoints as released (issue 32): FP8, compressed-tensors and gpt-oss's MXFP4 sources,
and gpt-oss's block-quantized outtypes.

The check's reference is transformers' float32 model holding the GGUF's own weight values (eval/convert_check.py):
- an FP8 / compressed-tensors source: the weights come from ggufkit's dequantizing reader (llama.cpp's
  ``dequant_model``), read as transformers loads them into the unquantized model of the class;
- an MXFP4 source: transformers dequantizes the experts itself (``Mxfp4Config(dequantize=True)``) and the GGUF
  keeps their MXFP4 codes;
- gpt-oss's expert tensors, which its hooks compute (transposed, gate and up from the even and odd columns of
  ``gate_up_proj``), are rounded in the GGUF's own rows (``converters/gpt_oss.py reference_view``).
Before, each of these checks was skipped (transformers could not load the FP8 source; the MXFP4 and rewritten
expert tensors had no reference). The bound asserted is far tighter than :data:`TOLERANCE`: the two sides hold
the same numbers, so a reference dequantized or rounded otherwise would show.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fixtures_models import make_checkpoint
from test_convert_compressed_tensors import store_compressed
from test_convert_fp8 import store_fp8

from ggufkit.cli import cli
from ggufkit.converters import convert
from ggufkit.eval.convert_check import check_conversion

#: the largest difference between the two sides, relative to the largest logit: float32 summation order only
EXACT = 1e-4


def assert_exact(result: Any) -> None:
    assert result.status == "passed", result.as_dict()
    assert result.rel_diff is not None and result.rel_diff < EXACT and result.top1_agreement == 1.0


def test_convert_check_of_an_fp8_source_runs_against_the_dequantized_weights(tmp_path: Path) -> None:
    """``ggufkit convert --check`` of an FP8 checkpoint (128x128-style blocks with partial edge blocks) to
    q8_0: transformers runs the weights dequantized as the conversion reads them, rounded to Q8_0."""
    d = make_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", dtype="bfloat16", vocab="real:gpt-2")
    store_fp8(d, scheme="block", block=(24, 40))
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(tmp_path / "m.gguf"), "--outtype", "q8_0",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["check"] == "passed", data.get("check_reason")


@pytest.mark.parametrize("hf_class,outtype,store", [
    # DeepSeek V3 as released in FP8 (MLA, routed experts that transformers 5 fuses on load): F32, as for a
    # bf16 source (stacked experts stored rounded have no single checkpoint tensor to round)
    ("DeepseekV3ForCausalLM", "f32", lambda d: store_fp8(d, scheme="block", block=(24, 40))),
    ("LlamaForCausalLM", "bf16", lambda d: store_fp8(d, scheme="mixed", block=(0, 0))),  # per-channel, per-tensor
    ("LlamaForCausalLM", "q8_0", lambda d: store_compressed(d, "pack-quantized", zero_point=True)),  # INT4
])
def test_check_of_quantized_sources_compares_the_dequantized_model(tmp_path: Path, hf_class: str, outtype: str,
                                                                   store: Any) -> None:
    if hf_class == "DeepseekV3ForCausalLM":
        from test_family_deepseek2 import make_deepseek

        d = make_deepseek(tmp_path / "m", "v3")
    else:
        d = make_checkpoint(tmp_path / "m", hf_class)
    store(d)
    report = convert(d, tmp_path / "m.gguf", outtype=outtype)
    assert_exact(check_conversion(d, report.outputs[0], report.plan))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GptOssForCausalLM as transformers 5 saves it and as released in MXFP4 (tests/test_family_gpt_oss.py)."""
    import test_family_gpt_oss as g

    root = tmp_path_factory.mktemp("gpt-oss")
    tf5 = g.make_checkpoint(root / "tf5", g.HF_CLASS)
    release = Path(shutil.copytree(tf5, root / "release"))
    g.to_release_config(release / "config.json")
    return {"tf5": tf5, "mxfp4": g.to_mxfp4(release, root / "mxfp4")}


def test_check_of_an_mxfp4_source_runs_against_transformers_dequantizing_it(gpt_oss: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """The default conversion (bf16, the experts kept MXFP4) of gpt-oss as released."""
    d = gpt_oss["mxfp4"]
    report = convert(d, tmp_path / "m.gguf")
    assert {e.ggml_type.name for e in report.plan.entries if "_exps.weight" in e.name} == {"MXFP4"}
    assert_exact(check_conversion(d, report.outputs[0], report.plan))


def test_check_of_gpt_oss_block_quantized_experts_rounds_them_in_the_gguf_rows(gpt_oss: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """Q4_K_M: gate, up and down experts each block-quantized, each rounded in its own rows of its source."""
    d = gpt_oss["tf5"]
    report = convert(d, tmp_path / "m.gguf", outtype="q4_k_m")
    types = {e.name.split(".")[-2]: e.ggml_type.name for e in report.plan.entries if e.name.startswith("blk.0.")}
    assert all(types[k] not in ("F32", "F16", "BF16") for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert_exact(check_conversion(d, report.outputs[0], report.plan))


def _vision_or_text_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The text layers' linear weights (as the FP8 releases store them) and, here, the vision tower's too."""
    vision = ".blocks." in name and name.endswith(("qkv.weight", "attn.proj.weight", "linear_fc1.weight",
                                                   "linear_fc2.weight"))
    return len(shape) == 2 and (vision or (".layers." in name and name.endswith("proj.weight")))


def test_projector_of_an_fp8_checkpoint_reads_it_dequantized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``convert --mmproj`` of a Qwen3-VL FP8 checkpoint whose vision tower is FP8 as well (block scales): the
    projector of the dequantized weights, the file llama.cpp's converter writes from the same checkpoint
    dequantized (its own --mmproj stops at the first ``weight_scale_inv``: MmprojModel maps it as a tensor).
    Before, ggufkit refused the checkpoint in one line (no rule for the ``*_scale_inv`` tensors)."""
    import test_convert_fp8
    from fixtures_mmproj import llama_cpp_mmproj, make_vlm, projector_keys, projector_tensors

    from ggufkit.converters import convert_mmproj

    d = make_vlm(tmp_path / "m", "Qwen3VLForConditionalGeneration", dtype="bfloat16")
    monkeypatch.setattr(test_convert_fp8, "quantized_linear", _vision_or_text_linear)
    store_fp8(d, scheme="block", block=(24, 40), dequantized=tmp_path / "dequantized")
    theirs = tmp_path / "theirs.gguf"
    run = llama_cpp_mmproj(tmp_path / "dequantized", theirs, "q8_0")
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(d, tmp_path / "ours.gguf", outtype="q8_0").outputs[0]
    a, b = projector_tensors(theirs), projector_tensors(ours)
    assert "v.blk.0.attn_qkv.weight" in a and a == b
    assert projector_keys(theirs) == projector_keys(ours)
