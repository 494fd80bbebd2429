"""PEFT LoRA adapters -> GGUF adapters, checked against llama.cpp's own converter (convert_lora_to_gguf.py from
the vendored llama.cpp), llama.cpp applying the adapter (llama-cpp-python ``lora_path``) and transformers + peft.

Adapters are made here with peft on tiny random checkpoints (random A and B: ``init_lora_weights=False``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_models import TOKENS, make_checkpoint
from llama_cpp_sources import llama_cpp_dir

from ggufkit.converters import convert, convert_lora, merge_lora
from ggufkit.errors import TensorMappingError, UsageError
from ggufkit.format import open_gguf

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(base: Path, out: Path, seed: int = 0, **lora: Any) -> Path:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ATTN_MLP, "init_lora_weights": False, **lora})
    peft_model = get_peft_model(model, cfg)
    if lora.get("use_dora"):  # DoRA's magnitudes start at ||W||: move them so that they matter
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_magnitude_vector" in n:
                    p.mul_(1.0 + 0.2 * torch.rand_like(p))
    if lora.get("lora_bias"):
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if n.endswith("lora_B.default.bias"):
                    p.copy_(torch.randn_like(p) * 0.1)
    peft_model.save_pretrained(out)
    return out


def _peft_logits(base: Path, adapter: Path, tokens: list[int] = TOKENS) -> np.ndarray:
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _llama_cpp_logits(model: Path, lora: Path | None = None, tokens: list[int] = TOKENS) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(model), lora_path=str(lora) if lora else None, logits_all=True, n_ctx=64,
                          n_batch=64, n_threads=1, verbose=False, type_k=0, type_v=0)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def _llama_cpp_convert_lora(adapter: Path, base: Path, out: Path, outtype: str) -> Path:
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_lora_to_gguf.py"), "--base", str(base), "--outtype",
                    outtype, "--outfile", str(out), str(adapter)], check=True, capture_output=True, env=env)
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / (b.max() - b.min()))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An untied Llama base, its f32 GGUF, and an r=4/alpha=8 adapter on attention, MLP, embeddings and lm_head."""
    d = tmp_path_factory.mktemp("lora_llama")
    base = make_checkpoint(d / "base", "LlamaForCausalLM")
    gguf = convert(base, d / "base-f32.gguf", outtype="f32").outputs[0]
    adapter = _make_adapter(base, d / "adapter", target_modules=[*ATTN_MLP, "embed_tokens", "lm_head"])
    return {"base": base, "gguf": gguf, "adapter": adapter, "dir": d}


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("base_kind", ["hf", "gguf"])
def test_adapter_is_byte_identical_to_llama_cpp_converter(llama: dict[str, Path], outtype: str, base_kind: str,
                                                          tmp_path: Path) -> None:
    theirs = _llama_cpp_convert_lora(llama["adapter"], llama["base"], tmp_path / "theirs.gguf", outtype)
    base = llama["base"] if base_kind == "hf" else llama["gguf"]
    ours = convert_lora(llama["adapter"], tmp_path / "ours.gguf", base=base, outtype=outtype).output
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        for key in ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"):
            assert a.get(key) == b.get(key), key
        # A local base gets no made-up hub address (llama.cpp's converter writes https://huggingface.co//tmp/...).
        assert "general.base_model.0.repo_url" not in b.kv
        assert "general.base_model.0.repo_url" in a.kv


def test_llama_cpp_applies_the_adapter_as_peft_does(llama: dict[str, Path], tmp_path: Path) -> None:
    ours = convert_lora(llama["adapter"], tmp_path / "a.gguf", base=llama["gguf"]).output
    theirs = _llama_cpp_convert_lora(llama["adapter"], llama["base"], tmp_path / "theirs.gguf", "f32")
    with_ours = _llama_cpp_logits(llama["gguf"], ours)
    assert np.array_equal(with_ours, _llama_cpp_logits(llama["gguf"], theirs))
    want = _peft_logits(llama["base"], llama["adapter"])
    without = _llama_cpp_logits(llama["gguf"])
    assert _rel(without, want) > 1e-2  # the adapter changes the logits ...
    assert _rel(with_ours, want) < 1e-3  # ... exactly as peft applies it


@pytest.mark.parametrize("kind", ["rslora", "patterns"])
def test_rslora_and_rank_alpha_patterns_are_folded_into_lora_b(llama: dict[str, Path], kind: str,
                                                                tmp_path: Path) -> None:
    extra: dict[str, Any] = ({"use_rslora": True, "r": 16, "lora_alpha": 8} if kind == "rslora" else
                             {"rank_pattern": {"q_proj": 8, "down_proj": 2}, "alpha_pattern": {"v_proj": 32}})
    adapter = _make_adapter(llama["base"], tmp_path / kind, seed=3, **extra)
    report = convert_lora(adapter, tmp_path / "a.gguf", base=llama["base"])
    assert report.folded  # the scaling differs from alpha/r somewhere and was folded
    got = _llama_cpp_logits(llama["gguf"], report.output)
    assert _rel(got, _peft_logits(llama["base"], adapter)) < 1e-3
    # llama.cpp's own converter writes the plain alpha: rslora/patterns come out wrong there.
    theirs = _llama_cpp_convert_lora(adapter, llama["base"], tmp_path / "theirs.gguf", "f32")
    assert _rel(_llama_cpp_logits(llama["gguf"], theirs), _peft_logits(llama["base"], adapter)) > 1e-2


@pytest.fixture(scope="module")
def unexpressible(llama: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lora_extra")
    return {"dora": _make_adapter(llama["base"], d / "dora", seed=5, use_dora=True),
            "lora_bias": _make_adapter(llama["base"], d / "bias", seed=6, lora_bias=True),
            "modules_to_save": _make_adapter(llama["base"], d / "mts", seed=7, modules_to_save=["norm"])}


@pytest.mark.parametrize("kind", ["dora", "lora_bias", "modules_to_save"])
def test_what_an_adapter_file_cannot_hold_is_refused_in_one_line(llama: dict[str, Path],
                                                                  unexpressible: dict[str, Path], kind: str,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    r = invoke("convert", str(unexpressible[kind]), "--base", str(llama["base"]), "-o", str(out))
    assert r.exit_code == 2
    assert kind.replace("dora", "DoRA") in r.stderr and "--merge" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("kind", ["dora", "lora_bias", "modules_to_save"])
def test_merge_equals_peft_merge_and_unload(llama: dict[str, Path], unexpressible: dict[str, Path], kind: str,
                                            tmp_path: Path) -> None:
    import torch
    import transformers
    from peft import PeftModel

    adapter = unexpressible[kind]
    if kind == "lora_bias":
        # The Llama fixture has no biases for lora_bias to land in: merging must refuse clearly.
        with pytest.raises(TensorMappingError, match="bias"):
            merge_lora(adapter, tmp_path / "m.gguf", base=llama["base"], outtype="f32")
        return
    merged = merge_lora(adapter, tmp_path / "m.gguf", base=llama["base"], outtype="f32").outputs[0]
    want = _peft_logits(llama["base"], adapter)
    assert _rel(_llama_cpp_logits(merged), want) < 1e-3
    model = transformers.AutoModelForCausalLM.from_pretrained(llama["base"], dtype=torch.float32)
    reference = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    with open_gguf(merged) as m:
        down = m.data(m["blk.1.ffn_down.weight"])
        np.testing.assert_allclose(down, reference["model.layers.1.mlp.down_proj.weight"].numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_qwen2_tied_head_and_shape_mismatch_are_refused(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "qwen", "Qwen2ForCausalLM")
    adapter = _make_adapter(base, tmp_path / "qa", target_modules=["q_proj", "v_proj", "lm_head"])
    with pytest.raises(UsageError, match="ties it to the token embedding"):
        convert_lora(adapter, tmp_path / "a.gguf", base=base)
    plain = _make_adapter(base, tmp_path / "qb", target_modules=ATTN_MLP)
    ours = convert_lora(plain, tmp_path / "b.gguf", base=base).output
    theirs = _llama_cpp_convert_lora(plain, base, tmp_path / "theirs.gguf", "f32")
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert all(bytes(a.raw(t)) == bytes(b.raw(b[t.name])) for t in a.tensors)
    other = make_checkpoint(tmp_path / "wide", "Qwen2ForCausalLM", intermediate_size=96)
    with pytest.raises(TensorMappingError, match=r"layers\.0\.mlp\.down_proj: the adapter is for a 64x128 weight "
                                                 r"but the base's blk\.0\.ffn_down\.weight is 64x96"):
        convert_lora(plain, tmp_path / "c.gguf", base=other)


def test_bad_adapter_inputs_exit_2_with_one_line(llama: dict[str, Path], tmp_path: Path) -> None:
    cases = []
    missing_base = tmp_path / "orphan"
    missing_base.mkdir()
    cfg = json.loads((llama["adapter"] / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "nowhere")
    (missing_base / "adapter_config.json").write_text(json.dumps(cfg))
    (missing_base / "adapter_model.safetensors").write_bytes((llama["adapter"] / "adapter_model.safetensors").read_bytes())
    cases.append(([str(missing_base)], "was not found"))
    cases.append(([str(llama["base"]), "--base", str(llama["gguf"])], "apply to a PEFT adapter"))
    cases.append(([str(llama["adapter"]), "--base", str(llama["gguf"]), "--merge"], "not a GGUF file"))
    for args, message in cases:
        r = invoke("convert", *args, "-o", str(tmp_path / "out.gguf"))
        assert r.exit_code == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "out.gguf").exists()


def test_info_and_verify_show_rank_alpha_targets_and_base(llama: dict[str, Path], tmp_path: Path) -> None:
    out = convert_lora(llama["adapter"], tmp_path / "a.gguf", base=llama["gguf"], outtype="f16").output
    info = json.loads(invoke("info", str(out), "--json").stdout)["adapter"]
    assert info["type"] == "lora" and info["alpha"] == 8.0 and info["ranks"] == [4]
    assert "blk.0.attn_q.weight" in info["targets"] and "token_embd.weight" in info["targets"]
    assert len(info["targets"]) == 2 * 7 + 2 and info["unpaired"] == []
    assert info["base"] and info["base_url"] is None
    r = invoke("verify", str(out), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["adapter"]["ranks"] == [4]


def test_merge_to_a_quantized_type_in_one_pass(llama: dict[str, Path], tmp_path: Path) -> None:
    r = invoke("convert", str(llama["adapter"]), "--base", str(llama["base"]), "--merge", "--outtype", "q8_0",
               "-o", str(tmp_path / "m.gguf"), "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["check"] == "skipped"  # visible, never reported as a pass
    with open_gguf(tmp_path / "m.gguf") as m:
        assert m["blk.0.attn_q.weight"].type_name == "Q8_0"
    got = _llama_cpp_logits(tmp_path / "m.gguf")
    assert _rel(got, _peft_logits(llama["base"], llama["adapter"])) < 0.05


def test_lora_bias_merges_into_a_base_with_biases(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "qwen", "Qwen2ForCausalLM")
    adapter = _make_adapter(base, tmp_path / "qa", seed=9, target_modules=["q_proj", "k_proj", "v_proj"],
                            lora_bias=True)
    merged = merge_lora(adapter, tmp_path / "m.gguf", base=base, outtype="f32").outputs[0]
    assert _rel(_llama_cpp_logits(merged), _peft_logits(base, adapter)) < 1e-3
