"""``convert --check`` of MoE checkpoints whose expert tensors are stacked from per-expert tensors, and of MLA models
(DeepSeek V3, Kimi K2, GLM-4.7-Flash), at outtypes other than F32 (issue 32).

The GGUF stores ``ffn_*_exps`` as one ``[n_expert, rows, cols]`` tensor built from a checkpoint tensor per expert
(converters/rewrite.py ``StackLoader``), so no single checkpoint tensor held its rounded values and the check
was skipped at every outtype but F32: a DeepSeek V3 FP8 release was checked at F32 only. The reference now
takes each expert rounded as the GGUF stores it (the stack's rows are the experts' rows), read as transformers
loads it, and transformers fuses the rounded experts as its class stores them. The bound asserted is far tighter
than the check's tolerance: a reference whose experts were not rounded differs by 0.9 % of the largest logit at
Q8_0 here, the rounded one by float32 summation order.

MLA: ``attn_k_b`` / ``attn_v_b`` are split from ``kv_b_proj`` by the deepseek2 hooks, so the check was skipped at
block-quantized outtypes. The family's ``reference_view`` places their rows inside ``kv_b_proj`` (attn_v_b's are
rows of it, attn_k_b's per-head column segments) and the reference rounds them there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from test_convert_check_sources import EXACT, assert_exact
from test_convert_fp8 import store_fp8
from test_family_deepseek2 import make_deepseek
from test_family_glm4moe import N_LAYER, make_glm

from ggufkit.cli import cli
from ggufkit.converters import convert
from ggufkit.eval.convert_check import check_conversion

N_LITE = 3  # test_family_glm4moelite's layers: its NextN layer is blk.3


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


def test_check_of_a_deepseek_v3_release_at_q8_0_rounds_mla_in_the_gguf_rows(tmp_path: Path) -> None:
    """DeepSeek V3 in the released layout with qk_nope_head_dim and v_head_dim 32, so that attn_k_b (rows of
    qk_nope) and attn_v_b (rows of kv_lora_rank) are both Q8_0, converted to Q8_0: the check runs (it was skipped:
    "attn_k_b ... is computed from ...kv_b_proj.weight by the deepseek2 converter's hooks") and passes to float32
    order. Negative control: the GGUF's attn_k_b / attn_v_b are the reference's kv_b_proj split, and not the split
    of kv_b_proj unrounded or rounded in its own rows (attn_k_b's rows are not kv_b_proj's); as references those
    two differ by 67 % and 51 % of the largest logit here (measured), where the check allows 0.1 %."""
    from gguf import GGMLQuantizationType as Q

    from ggufkit.converters import deepseek2
    from ggufkit.converters.checkpoint import Checkpoint, read_config
    from ggufkit.format import open_gguf
    from ggufkit.quant import dequantize

    d = make_deepseek(tmp_path / "m", "v3", "release", qk_nope_head_dim=32, v_head_dim=32)
    report = convert(d, tmp_path / "m.gguf", outtype="q8_0")
    types = {e.name: e.ggml_type for e in report.plan.entries}
    assert types["blk.0.attn_k_b.weight"] == types["blk.0.attn_v_b.weight"] == Q.Q8_0
    result = check_conversion(d, report.outputs[0], report.plan)
    assert result.reason is None and "attn_k_b" not in str(result.as_dict())
    assert_exact(result)

    from ggufkit.eval.convert_check import _as_stored, _views  # the reference's own rounding

    config, source = read_config(d), "model.layers.0.self_attn.kv_b_proj.weight"
    ckpt = Checkpoint(d)
    try:
        w = np.asarray(ckpt.read(source), dtype=np.float32)
        views = _views(ckpt, report.plan, deepseek2.reference_view, config)
    finally:
        ckpt.close()
    assert sorted(e.name for e in views.by_source[source]) == ["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"]
    split = {"attn_k_b": deepseek2._k_b(4, 32, 32), "attn_v_b": deepseek2._v_b(4, 32, 32)}
    with open_gguf(report.outputs[0]) as f:
        for kind, cut in split.items():
            t = f[f"blk.0.{kind}.weight"]
            stored = dequantize(np.frombuffer(f.raw(t), np.uint8), Q.Q8_0, tuple(reversed(t.ne)))
            assert np.array_equal(cut(views.rounded(source, w)), stored), kind
            assert not np.array_equal(cut(w), stored), kind
            if kind == "attn_k_b":
                assert not np.array_equal(cut(_as_stored(w, Q.Q8_0, None)), stored)


def test_convert_check_of_a_glm47_flash_release_at_q8_0(tmp_path: Path) -> None:
    """``ggufkit convert --check`` of GLM-4.7-Flash in the released layout (per-expert tensors and a NextN layer,
    which llama.cpp's converter keeps and transformers' class drops) to Q8_0: attn_v_b (rows of kv_lora_rank 32)
    is Q8_0 and rounded inside kv_b_proj, the NextN layer's kv_b_proj given to transformers rounded with the rest
    of the layer (dropped on load); attn_k_b (rows of qk_nope 16) stays F16. Skipped before on attn_v_b."""
    from test_family_glm4moelite import make_glm_lite

    d = make_glm_lite(tmp_path / "m", "release")
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(tmp_path / "m.gguf"), "--outtype", "q8_0",
                                      "--check", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    types = {t["name"]: t["type"] for t in data["tensors"]}
    assert types["blk.0.attn_v_b.weight"] == types[f"blk.{N_LITE}.attn_v_b.weight"] == "Q8_0"
    assert types["blk.0.attn_k_b.weight"] == "F16"
    assert data["check"] == "passed", data.get("check_reason")
    assert data["check_details"]["rel_diff"] < EXACT


def test_reference_views_are_the_hooks_rows() -> None:
    """Each family's reference_view is a view of the source (writing it writes the source) holding the values
    rewrite_tensors writes for the GGUF tensor: gpt-oss's gate (even) / up (odd) columns of gate_up_proj and
    down_proj, transposed; DeepSeek's attn_k_b (each head's nope rows of kv_b_proj, transposed) and attn_v_b (each
    head's v rows); no other tensor is placed."""
    from ggufkit.converters import deepseek2, gpt_oss

    cases = [
        (gpt_oss, "model.layers.0.mlp.experts.gate_up_proj", "GPT_OSS_GATE_UP_PROJ", (2, 6, 8), {}),
        (gpt_oss, "model.layers.0.mlp.experts.down_proj", "GPT_OSS_DOWN_PROJ", (2, 4, 6), {}),
        (deepseek2, "model.layers.0.self_attn.kv_b_proj.weight", "ATTN_KV_B", (3 * (5 + 7), 4),
         {"num_attention_heads": 3, "qk_nope_head_dim": 5, "v_head_dim": 7}),
    ]
    for module, source, kind, shape, config in cases:
        w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        name = "blk.0.attn_kv_b.weight" if kind == "ATTN_KV_B" else "blk.0.experts"
        raw = [(name, source, kind, shape, "F32", None)]
        loaders = {name: lambda w=w: w.copy()}
        written = module.rewrite_tensors(raw, loaders, config)  # type: ignore[arg-type]
        assert len(written) == (1 if kind == "GPT_OSS_DOWN_PROJ" else 2)
        for name, *_ in written:
            view = module.reference_view(name, source, w, config)
            assert view is not None and np.array_equal(view, loaders[name]()), name
            view[...] = -1  # the rows lie in the source
            assert np.array_equal(loaders[name](), view), name
            w[...] = np.arange(w.size, dtype=np.float32).reshape(shape)
    assert gpt_oss.reference_view("blk.0.ffn_gate_exps.bias", "model.layers.0.mlp.experts.gate_up_proj_bias",
                                  np.zeros((2, 8), np.float32), {}) is None
    assert deepseek2.reference_view("blk.0.attn_q_b.weight", "model.layers.0.self_attn.q_b_proj.weight",
                                    np.zeros((8, 4), np.float32), {}) is None
