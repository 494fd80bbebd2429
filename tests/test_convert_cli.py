"""``ggufkit convert``: thin shell behaviour, JSON keys, exit codes and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures_models import make_checkpoint

from ggufkit.cli import cli
from ggufkit.cli._errors import run_cli


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


def test_outtype_choices_match_the_library() -> None:
    from ggufkit.cli.convert import OUTTYPES as cli_types
    from ggufkit.converters import OUTTYPES as api_types
    from ggufkit.converters.outtypes import OUTTYPES as core_types

    assert cli_types == api_types == core_types


def test_outtype_choices_are_read_from_the_preset_table() -> None:
    # issue 31: one copy of the type lists; --help and the errors print these tuples, in this order
    from ggufkit.converters.outtypes import LORA_OUTTYPES, OUTTYPES
    from ggufkit.quant.llama_quantize.presets import ADAPTER_OUTTYPES, CONVERT_OUTTYPES

    assert OUTTYPES == ("auto", *CONVERT_OUTTYPES) == \
        ("auto", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q4_k_m")
    assert LORA_OUTTYPES == ("auto", *ADAPTER_OUTTYPES) == ("auto", "f32", "f16", "bf16", "q8_0")


def test_list_shows_every_registry_class_as_json() -> None:
    result = CliRunner().invoke(cli, ["convert", "--list", "--json"])
    assert result.exit_code == 0
    classes = {a["hf_class"] for a in json.loads(result.stdout)["architectures"]}
    assert {"LlamaForCausalLM", "OPTForCausalLM", "QWenLMHeadModel"} <= classes


def test_convert_json_reports_outputs_and_plan(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(cli, ["convert", str(llama), "-o", str(out), "--outtype", "f16", "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["outputs"] == [str(out)] and out.exists()
    assert d["architecture"] == "llama" and d["file_type"] == 1 and d["n_tensors"] == len(d["tensors"]) == 21


def test_dry_run_prints_the_plan_and_writes_nothing(llama: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(llama), "-o", str(tmp_path / "m.gguf"), "--dry-run"])
    assert result.exit_code == 0
    assert "model.layers.0.self_attn.q_proj.weight" in result.stdout and "permute_q" in result.stdout
    assert "dry run: nothing written" in result.stdout and not list(tmp_path.iterdir())


def test_missing_model_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(cli, ["convert", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "no such directory" in err


def test_unsupported_class_exits_2_naming_supported_ones(llama: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "m"
    d.mkdir()
    config = json.loads((llama / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (d / "config.json").write_text(json.dumps(config))
    code = run_cli(cli, ["convert", str(d)])
    err = capsys.readouterr().err
    assert code == 2 and "'BertModel' is not supported; supported: " in err and err.count("\n") == 1


def test_reported_size_is_the_files_real_size_header_included(llama: Path, tmp_path: Path) -> None:
    from ggufkit.cli._output import human_bytes

    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(cli, ["convert", str(llama), "-o", str(out), "--no-check", "--json"])
    d = json.loads(result.stdout)
    assert d["file_size"] == out.stat().st_size > d["nbytes"]  # nbytes: tensor data alone
    human = CliRunner().invoke(cli, ["convert", str(llama), "-o", str(out), "--no-check"])
    assert f"{human_bytes(out.stat().st_size)} on disk" in human.stdout


def test_pre_tokenizer_choice_and_method_are_reported(tmp_path: Path) -> None:
    # a freshly trained Llama 3 style vocabulary: no known hash, recognised by behaviour; Llama 3's regexes
    # are shared by other llama.cpp names (dbrx, smaug-bpe, ...), and the canonical one is chosen
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", vocab="llama-bpe")
    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(cli, ["convert", str(d), "-o", str(out), "--no-check", "--json"])
    assert result.exit_code == 0, result.output
    pre = json.loads(result.stdout)["pre_tokenizer"]
    assert (pre["name"], pre["method"]) == ("llama-bpe", "behaviour")
    assert "chose the canonical 'llama-bpe' over " in pre["note"] and "smaug-bpe" in pre["note"]
    human = CliRunner().invoke(cli, ["convert", str(d), "-o", str(out), "--no-check"])
    assert "pre-tokenizer: llama-bpe (by behaviour: its regexes reproduce the tokenizer); " in human.stdout
    dry = CliRunner().invoke(cli, ["convert", str(d), "--dry-run", "--json", "-o", str(tmp_path / "n.gguf")])
    assert json.loads(dry.stdout)["pre_tokenizer"]["name"] == "llama-bpe"


def test_sentencepiece_vocabulary_reports_no_pre_tokenizer(llama: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(llama), "--dry-run", "--json", "-o", str(tmp_path / "m.gguf")])
    assert json.loads(result.stdout)["pre_tokenizer"] is None
