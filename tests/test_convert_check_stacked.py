"""``convert --check`` of MoE checkpoints whose expert tensors are stacked from per-expert tensors, at outtypes
other than F32 (issue 32).

The GGUF stores ``ffn_*_exps`` as one ``[n_expert, rows, cols]`` tensor built from a checkpoint tensor per expert
(converters/rewrite.py ``StackLoader``), so no single checkpoint tensor held its rounded values and the check
was skipped at every outtype but F32: a DeepSeek V3 FP8 release was checked at F32 only. The reference now
takes each expert rounded as the GGUF stores it (the stack's rows are the experts' rows), read as transformers
loads it, and transformers fuses the rounded experts as its class stores them. The bound asserted is far tighter
than the check's tolerance: a reference whose experts were not rounded differs by 0.9 % of the largest logit at
Q8_0 here, the rounded one by float32 summation order.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from test_convert_check_sources import assert_exact
from test_convert_fp8 import store_fp8
from test_family_deepseek2 import make_deepseek
from test_family_glm4moe import N_LAYER, make_glm

from ggufkit.cli import cli
from ggufkit.converters import convert
from ggufkit.eval.convert_check import check_conversion


def test_check_of_an_fp8_deepseek_v3_at_bf16(tmp_path: Path) -> None:
    """DeepSeek V3 as released in FP8 (block scales with partial edge blocks; MLA, sigmoid-routed experts that
    transformers 5 fuses on load) converted to BF16: the check runs (it was skipped) and the two sides agree to
    float32 order."""
    d = make_deepseek(tmp_path / "m", "v3")
    store_fp8(d, scheme="block", block=(24, 40))
    report = convert(d, tmp_path / "m.gguf", outtype="bf16")
    assert any(e.name.endswith("ffn_down_exps.weight") for e in report.plan.entries)
    assert_exact(check_conversion(d, report.outputs[0], report.plan))


def test_convert_check_of_a_glm45_release_at_q8_0(tmp_path: Path) -> None:
    """``ggufkit convert --check`` of a GLM-4.5 in the released layout (one tensor per expert, and a NextN layer
    that llama.cpp's converter keeps and transformers' class drops on load) to Q8_0: the block-quantized stacks are
    rounded expert by expert in the reference, which transformers loads from the checkpoint's tensors, so the
    NextN layer's rounded tensors are dropped with the rest of it instead of skipping the check."""
    d = make_glm(tmp_path / "m", "release")
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(tmp_path / "m.gguf"), "--outtype", "q8_0",
                                      "--check", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert any(t["name"].startswith(f"blk.{N_LAYER}.nextn.") for t in data["tensors"]), data["tensors"][-3:]
    assert data["check"] == "passed", data.get("check_reason")
