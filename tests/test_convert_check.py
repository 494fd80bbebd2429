"""``convert --check``: tokens and logits of the converted file against transformers' model and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fixtures_models import make_checkpoint

from ggufkit.cli import cli
from ggufkit.converters import convert
from ggufkit.eval.convert_check import check_conversion


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM")


def test_check_passes_for_a_faithful_conversion_and_reports_it_in_json(qwen2: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(cli, ["convert", str(qwen2), "-o", str(out), "--outtype", "f16", "--check",
                                      "--json"])
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["check"]
    assert check["ok"] and check["skipped"] is None and check["tokens_compared"] > 100
    assert check["top1_agreement"] >= 0.95 and check["rel_diff"] < 0.02


def test_check_fails_when_the_gguf_is_not_the_checkpoints_model(qwen2: Path, tmp_path: Path) -> None:
    # Same architecture and tokenizer, other weights: exactly what a broken conversion looks like.
    other = make_checkpoint(tmp_path / "other", "Qwen2ForCausalLM", seed=7)
    gguf = convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0]
    result = check_conversion(qwen2, gguf, outtype="f32", n_params=100_000)
    assert not result.ok and any(f.startswith("logits differ by") for f in result.failures)


def test_check_is_skipped_with_a_reason_when_transformers_has_no_class(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "qwen1", "QWenLMHeadModel")
    gguf = convert(d, tmp_path / "q.gguf", outtype="f32").outputs[0]
    result = check_conversion(d, gguf, outtype="f32", n_params=100_000)
    assert result.ok and "QWenLMHeadModel" in (result.skipped or "")


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
    assert d["ok"] is False and d["check"]["failures"][0] == \
        "the GGUF's logits are not finite (weights overflowing the outtype, e.g. f16?)"
    assert "check failed (output kept)" in result.stderr
    assert d["warnings"] == [f"token_embd.weight: {n_inf} values exceed f16's range and became inf; use --outtype "
                             "bf16 or f32"]
