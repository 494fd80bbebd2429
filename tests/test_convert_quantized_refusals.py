"""Checkpoints quantized by a method ggufkit does not convert (issue 32): GPTQ, AWQ, bitsandbytes (4-bit and
8-bit, with or without ``quant_method`` in the config), ModelOpt's ``hf_quant_config.json`` and an unknown
``quant_method`` are refused in one line naming the method, exit 2, nothing written.

Before issue 32 an unknown method whose weights kept their names (``hqq`` below: int8 ``weight`` tensors) was
converted into a file of garbage weights (the integers read as values); the others failed on their extra tensor
names without naming the quantization.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import invoke
from fixtures_models import build_model
from test_convert_fp8 import quantized_linear


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's config and weights (float16), no tokenizer: the refusal comes before the vocabulary."""
    import torch

    d = tmp_path_factory.mktemp("refusals") / "llama"
    build_model("LlamaForCausalLM", 320).to(torch.float16).save_pretrained(d)
    return d


def _gptq(name: str, t: Any, bits: int = 4, group: int = 32) -> dict[str, Any]:
    import torch

    rows, cols = t.shape
    stem = name.removesuffix(".weight")
    return {f"{stem}.qweight": torch.zeros(cols * bits // 32, rows, dtype=torch.int32),
            f"{stem}.qzeros": torch.zeros(cols // group, rows * bits // 32, dtype=torch.int32),
            f"{stem}.scales": torch.ones(cols // group, rows, dtype=torch.float16),
            f"{stem}.g_idx": torch.arange(cols, dtype=torch.int32) // group}


def _awq(name: str, t: Any, group: int = 32) -> dict[str, Any]:
    import torch

    rows, cols = t.shape
    stem = name.removesuffix(".weight")
    return {f"{stem}.qweight": torch.zeros(cols, rows // 8, dtype=torch.int32),
            f"{stem}.qzeros": torch.zeros(cols // group, rows // 8, dtype=torch.int32),
            f"{stem}.scales": torch.ones(cols // group, rows, dtype=torch.float16)}


def _bnb4(name: str, t: Any) -> dict[str, Any]:
    import torch

    n = t.numel()
    return {name: torch.zeros(n // 2, 1, dtype=torch.uint8), f"{name}.absmax": torch.ones(n // 64),
            f"{name}.quant_map": torch.linspace(-1, 1, 16),
            f"{name}.quant_state.bitsandbytes__nf4": torch.zeros(64, dtype=torch.uint8)}


def _int8(name: str, t: Any, scb: bool) -> dict[str, Any]:
    import torch

    q = torch.clamp(torch.round(t.float() / t.float().abs().max() * 127), -127, 127).to(torch.int8)
    return {name: q, **({name.removesuffix("weight") + "SCB": t.float().abs().amax(1)} if scb else {})}


#: (case, quantization_config, what the one-line message names)
CASES: list[tuple[str, dict[str, Any] | None, str]] = [
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
     "gptq 4-bit (quant_method 'gptq')"),
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
     "awq 4-bit (quant_method 'awq')"),
    ("bnb-4bit", {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                  "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"},
     "bitsandbytes 4-bit nf4 (quant_method 'bitsandbytes')"),
    # a config written before transformers named the method: only the load_in_8bit flag
    ("bnb-8bit-legacy", {"load_in_8bit": True, "llm_int8_threshold": 6.0}, "bitsandbytes 8-bit"),
    ("hqq", {"quant_method": "hqq", "nbits": 8}, "hqq (quant_method 'hqq')"),
    # ModelOpt writes hf_quant_config.json beside a config without quantization_config
    ("modelopt", None, "modelopt (quant_method 'modelopt')"),
]


def quantize_as(d: Path, case: str, quant: dict[str, Any] | None) -> None:
    """Rewrite ``d``'s linear weights in the layout the method stores them, and its config."""
    from safetensors.torch import load_file, save_file

    state = load_file(d / "model.safetensors")
    out: dict[str, Any] = {}
    for name, t in state.items():
        if not quantized_linear(name, tuple(t.shape)):
            out[name] = t
        elif case == "gptq":
            out.update(_gptq(name, t))
        elif case == "awq":
            out.update(_awq(name, t))
        elif case == "bnb-4bit":
            out.update(_bnb4(name, t))
        elif case in ("bnb-8bit-legacy", "hqq"):
            out.update(_int8(name, t, scb=case != "hqq"))
        else:  # modelopt: FP8 weights with a per-tensor weight_scale
            import torch

            out[name] = t.to(torch.float8_e4m3fn)
            out[name + "_scale"] = torch.tensor(1.0)
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    else:
        (d / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    (d / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize(("case", "quant", "named"), CASES, ids=[c[0] for c in CASES])
def test_other_quantization_is_refused_in_one_line(base: Path, tmp_path: Path, case: str,
                                                   quant: dict[str, Any] | None, named: str) -> None:
    d = tmp_path / case
    shutil.copytree(base, d)
    quantize_as(d, case, quant)
    out = tmp_path / "out.gguf"
    result = invoke("convert", str(d), "-o", str(out), "--outtype", "f16", "--no-check")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"quantized with {named}" in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.glob("*.gguf*"))
