"""``--type`` is parsed once (issue 31): the CLI's parameter type turns each word into a
:class:`~ggufkit.quant.llama_quantize.presets.PresetChoice` and the planner takes it as it is; the library rules
the CLI used to hold (``--sensitivity auto``'s size limit, llama-quantize's default output name) live in quant/."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_quantize import make_llama_gguf

from ggufkit.cli.quantize import _TargetType
from ggufkit.errors import UsageError
from ggufkit.format import open_gguf
from ggufkit.quant.llama_quantize.pipeline import quantize_file
from ggufkit.quant.llama_quantize.plan import plan_quantization
from ggufkit.quant.llama_quantize.presets import PRESETS, PresetChoice, default_output_name, parse_preset
from ggufkit.quant.target.defaults import AUTO_SENSITIVITY_MAX_WEIGHTS, resolve_sensitivity


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_gguf(tmp_path_factory.mktemp("parse") / "m.gguf", n_layer=1, n_vocab=256)


def test_the_type_option_returns_parsed_choices():
    several = _TargetType(several=True).convert("q4_k,7", None, None)
    assert isinstance(several, tuple) and all(isinstance(c, PresetChoice) for c in several)
    assert [(c.word, c.name, c.preset.name) for c in several] == [("q4_k", "Q4_K", "q4_k_m"), ("7", "Q8_0", "q8_0")]
    one = _TargetType().convert("15", None, None)
    assert isinstance(one, PresetChoice) and (one.name, one.preset.name) == ("Q4_K", "q4_k_m")


def test_the_planner_takes_a_parsed_choice_without_parsing_its_word_again(model):
    # a choice's word is not read again: only its row decides
    choice = PresetChoice("not a type", PRESETS["q8_0"])
    with open_gguf(model) as m:
        plan = plan_quantization(m.tensors, choice, arch="llama", metadata=m.kv)
    assert plan.target == "q8_0"
    report = quantize_file(model, None, parse_preset("Q4_K"), dry_run=True)
    assert report.plan.target == "q4_k_m" and report.plan.to_dict() == quantize_file(
        model, None, "q4_k_m", dry_run=True).plan.to_dict()
    with pytest.raises(UsageError, match="unknown quantization type 'q4km'; did you mean Q4_K_M"):
        parse_preset("q4km")


def test_llama_quantizes_default_output_name_lives_with_the_presets():
    assert default_output_name(parse_preset("15").name) == "ggml-model-Q4_K.gguf"


def test_auto_sensitivity_is_decided_below_the_cli(model):
    assert AUTO_SENSITIVITY_MAX_WEIGHTS == 4_000_000_000
    assert resolve_sensitivity(model, "auto", None) == ("search", [])  # the test environment has PyTorch
    sensitivity, warnings = resolve_sensitivity(model, "auto", None, max_weights=1000)
    assert sensitivity == "off" and len(warnings) == 1 and "not measured by default above" in warnings[0]
    assert resolve_sensitivity(model, "auto", "text.txt", max_weights=1000) == ("search", [])
    assert resolve_sensitivity(model, "estimate", None) == ("estimate", [])
    with pytest.raises(UsageError, match="--calibration-text is read only by the KLD sensitivity"):
        resolve_sensitivity(model, "off", "text.txt")
