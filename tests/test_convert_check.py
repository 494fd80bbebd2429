"""``convert --check``: tokens and logits of the converted file against transformers' model and tokenizer.

The reference is transformers' own model running the values the GGUF stores (each weight rounded to its
GGUF type through ggufkit's quantizer), so one tight tolerance holds for every outtype; broken files are
made with ggufkit's writer from a faithful conversion, with two tensors' data swapped or a permutation
undone, and the check must fail them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from fixtures_models import make_checkpoint

from ggufkit.cli import cli
from ggufkit.converters import convert
from ggufkit.eval.convert_check import TOLERANCE, check_conversion
from ggufkit.format import open_gguf
from ggufkit.format.writer import TensorSpec, write_gguf


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


def test_check_passes_for_a_faithful_conversion_and_reports_it_in_json(qwen2: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(cli, ["convert", str(qwen2), "-o", str(out), "--outtype", "f16", "--check",
                                      "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["ok"] is True and d["check"] == "passed" and d["check_reason"] is None
    details = d["check_details"]
    assert details["tokens_compared"] > 100 and details["top1_agreement"] >= 0.95
    assert details["rel_diff"] < TOLERANCE[0] == 1e-3


@pytest.mark.parametrize(("hf_class", "outtype"), [("LlamaForCausalLM", "q4_0"), ("LlamaForCausalLM", "q4_k_m"),
                                                   ("GPTNeoXForCausalLM", "q4_1"), ("Qwen2ForCausalLM", "bf16")])
def test_faithful_quantized_conversions_pass_the_tight_tolerance(hf_class: str, outtype: str,
                                                                 tmp_path: Path) -> None:
    # Q/K permutation (llama), fused QKV regroup (gptneox), biases (qwen2), mixed per-tensor types (q4_k_m)
    d = make_checkpoint(tmp_path / "m", hf_class, **({"dtype": "bfloat16"} if outtype == "bf16" else {}))
    report = convert(d, tmp_path / "m.gguf", outtype=outtype)
    result = check_conversion(d, report.outputs[0], report.plan)
    assert result.status == "passed", result.failures
    assert result.rel_diff is not None and result.rel_diff < 1e-4  # measured ~1e-6: only float32 order differs


def _rewrite(src: Path, dst: Path, plan: Any, change: dict[str, np.ndarray]) -> None:
    """Write ``src``'s tensors (and its plan's metadata) with ggufkit's writer, some tensors' bytes replaced
    (same type and shape)."""
    with open_gguf(src) as m:
        specs = [TensorSpec(t.name, t.ggml_type, t.shape) for t in m.tensors]
        data = [change.get(t.name, np.frombuffer(m.raw(t), np.uint8).copy()) for t in m.tensors]
    write_gguf(dst, plan.metadata, specs, iter(data))


@pytest.fixture(scope="module")
def llama_q4_k_m(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    report = convert(llama, tmp_path_factory.mktemp("q") / "m.gguf", outtype="q4_k_m")
    return report.outputs[0], report.plan


def test_check_fails_a_quantized_file_with_two_tensors_swapped(llama: Path, llama_q4_k_m, tmp_path: Path) -> None:
    gguf, plan = llama_q4_k_m
    with open_gguf(gguf) as m:
        n0, n1 = (np.frombuffer(m.raw(m[f"blk.{i}.ffn_norm.weight"]), np.uint8).copy() for i in (0, 1))
    broken = tmp_path / "swapped.gguf"
    _rewrite(gguf, broken, plan, {"blk.0.ffn_norm.weight": n1, "blk.1.ffn_norm.weight": n0})
    result = check_conversion(llama, broken, plan)
    # the former q4_k_m tolerance (50 % of the largest logit, top-1 >= 50 %) passed this file: 47 %, 53 %
    assert result.status == "failed" and result.failures[0].startswith("logits differ by")


def test_check_fails_a_quantized_file_whose_q_permutation_is_undone(llama: Path, llama_q4_k_m,
                                                                     tmp_path: Path) -> None:
    gguf, plan = llama_q4_k_m
    with open_gguf(gguf) as m:
        q = np.frombuffer(m.raw(m["blk.0.attn_q.weight"]), np.uint8).reshape(64, -1)
    # quantized rows are independent, so the bytes can be put back into HF's rotate-half row order: the file a
    # converter that forgot permute_q would write for layer 0
    n_head, rows = 4, q.shape[0]
    hf_order = q.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(q.shape)
    assert not np.array_equal(hf_order, q)
    broken = tmp_path / "unpermuted.gguf"
    _rewrite(gguf, broken, plan, {"blk.0.attn_q.weight": np.ascontiguousarray(hf_order)})
    result = check_conversion(llama, broken, plan)
    assert result.status == "failed" and result.failures[0].startswith("logits differ by")


def test_check_fails_when_the_gguf_is_not_the_checkpoints_model(qwen2: Path, tmp_path: Path) -> None:
    # Same architecture and tokenizer, other weights: exactly what a broken conversion looks like.
    other = make_checkpoint(tmp_path / "other", "Qwen2ForCausalLM", seed=7)
    report = convert(other, tmp_path / "other.gguf", outtype="f32")
    result = check_conversion(qwen2, report.outputs[0], report.plan)
    assert result.status == "failed" and any(f.startswith("logits differ by") for f in result.failures)


def test_check_is_skipped_with_a_reason_when_transformers_has_no_class(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "qwen1", "QWenLMHeadModel")
    report = convert(d, tmp_path / "q.gguf", outtype="f32")
    result = check_conversion(d, report.outputs[0], report.plan)
    assert result.status == "skipped" and not result.passed and "QWenLMHeadModel" in (result.reason or "")


def test_architecture_feature_the_evaluator_cannot_run_skips_the_check_with_exit_0(tmp_path: Path) -> None:
    # llama.cpp and transformers run Qwen3-VL's text half (interleaved M-RoPE); ggufkit's evaluator does not
    from fixtures_mmproj import make_vlm

    d = make_vlm(tmp_path / "vl", "Qwen3VLForConditionalGeneration")
    out = tmp_path / "m.gguf"
    human = CliRunner().invoke(cli, ["convert", str(d), "-o", str(out), "--outtype", "f32"])
    assert human.exit_code == 0, human.output
    assert "check skipped: the evaluator cannot run this file: cannot evaluate 'qwen3vl'" in human.stdout
    assert "check passed" not in human.stdout and out.is_file()
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(out), "--outtype", "f32", "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 0 and data["ok"] is True
    assert data["check"] == "skipped" and "cannot evaluate 'qwen3vl'" in data["check_reason"]


def test_transformers_error_inside_the_check_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    # a config field the converter does not read but transformers cannot build a model from
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    config = json.loads((d / "config.json").read_text())
    config["hidden_act"] = "no_such_activation"
    (d / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(tmp_path / "m.gguf"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["check"] == "skipped"
    assert data["check_reason"].startswith("transformers cannot load the checkpoint (KeyError: ")
    assert "\n" not in data["check_reason"] and "Traceback" not in result.output


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError, as on a machine without PyTorch
from ggufkit.cli import main
sys.argv = ["ggufkit", *sys.argv[1:]]
main()
"""


def test_without_pytorch_the_check_is_skipped_with_how_to_enable_it(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    run = subprocess.run([sys.executable, "-c", _NO_TORCH, "convert", str(llama), "-o", str(out), "--outtype",
                          "f16"], capture_output=True, text=True, env={**os.environ, "GGUFKIT_DEBUG": ""})
    assert run.returncode == 0, run.stderr
    assert "check skipped: PyTorch is not installed; to enable it: pip install 'ggufkit[torch]'" in run.stdout
    assert "Traceback" not in run.stderr and out.is_file()


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="Linux only: /proc/meminfo")
def test_memory_gate_reads_available_memory_not_free_pages() -> None:
    # free pages leave out the reclaimable page cache; a warm cache would skip models that fit
    before = _meminfo_available()
    from ggufkit.sysmem import available_memory_bytes

    got = available_memory_bytes()
    after = _meminfo_available()
    assert got is not None and min(before, after) - (64 << 20) <= got <= max(before, after) + (64 << 20)


def test_check_fails_with_exit_1_and_keeps_the_output_when_f16_overflows(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    d = make_checkpoint(tmp_path / "big", "LlamaForCausalLM")
    tensors = load_file(str(d / "model.safetensors"))
    # Beyond f16's range (65504): fine in transformers' float32, inf in an f16 GGUF. Token 1 is BOS, first in
    # every checked sequence.
    tensors["model.embed_tokens.weight"][1] *= 1e6
    with np.errstate(over="ignore"):
        n_inf = int(np.isinf(tensors["model.embed_tokens.weight"][1].astype(np.float16)).sum())
    assert n_inf > 0
    save_file(tensors, str(d / "model.safetensors"))
    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(out), "--outtype", "f16", "--json"])
    assert result.exit_code == 1
    assert out.exists()
    d = json.loads(result.stdout)
    assert d["ok"] is False and d["check"] == "failed" and d["check_details"]["failures"][0] == \
        "the GGUF's logits are not finite (weights overflowing the outtype, e.g. f16?); try --outtype bf16 or f32"
    assert "check failed (output kept)" in result.stderr
    assert d["warnings"] == [f"token_embd.weight: {n_inf} values exceed f16's range and became inf; use --outtype "
                             "bf16 or f32"]


def test_rounded_tensor_without_a_single_checkpoint_source_skips_the_check(llama: Path, tmp_path: Path) -> None:
    # a tensor built from several checkpoint tensors (stacked MoE experts) cannot be rounded into the
    # reference: at a type other than F32 the check says so instead of failing on rounding differences
    import dataclasses

    report = convert(llama, tmp_path / "m.gguf", outtype="f16")
    plan = report.plan
    entries = [dataclasses.replace(e, source=f"{e.source} .. x (stacked)") if e.name == "blk.0.ffn_up.weight"
               else e for e in plan.entries]
    result = check_conversion(llama, report.outputs[0], dataclasses.replace(plan, entries=entries))
    assert result.status == "skipped"
    assert result.reason.startswith("blk.0.ffn_up.weight is built from several checkpoint tensors")
