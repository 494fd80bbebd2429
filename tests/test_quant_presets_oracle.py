"""Every llama-quantize TYPE plans exactly as llama.cpp's own ``llama-quantize`` chooses, tensor by tensor.

Oracle: the ``llama-quantize`` binary built from the llama.cpp vendored in llama-cpp-python 0.3.36
(``tests/llama_cpp_sources.py: tool_path``). Its ``--dry-run`` prints every tensor's target type without
needing kernels, so every preset is compared on every test model, kernels or not: GQA (n_gqa 4 and 2) and
plain multi-head llama, rows that are whole 256-blocks and rows that are not (288/600, tied embeddings),
16 layers (the n_layer/16 rules), a Mixtral-style model with 8 experts and 3-D expert tensors, GPT-NeoX
(fused attn_qkv) and Qwen2 (tied); with and without an importance matrix (which changes IQ3_XXS, IQ4_*,
Q4_0/Q5_0). Where llama-quantize fails (Q1_0 has no fallback for 288-wide rows), the planner fails too.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from cli_helpers import invoke
from fixtures_quantize import arch_case, imatrix_values, make_gguf, make_llama_gguf, write_imatrix_gguf
from gguf import GGMLQuantizationType as QT
from llama_cpp_sources import llama_cpp_dir, tool_path

from ggufkit.errors import GGUFKitError
from ggufkit.format import open_gguf
from ggufkit.quant.llama_quantize.plan import QuantOptions, plan_quantization
from ggufkit.quant.llama_quantize.presets import PRESETS, TYPE_CHOICES
from ggufkit.quant.registry import bits_per_weight

# "[   4/  21] blk.0.attn_k.weight - [ 256, 128, 1, 1], type =    f16, size = 0.06 MiB -> 0.01 MiB (iq2_xxs)"
_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =.*?(?:\((\w+)\))?\s*$")


def dry_run_types(model: Path, target: str, *flags: str) -> list[tuple[str, QT]] | None:
    """(name, type) of every tensor as ``llama-quantize --dry-run`` plans it, or None when it fails."""
    res = subprocess.run([str(tool_path("llama-quantize")), "--dry-run", *flags, str(model), target.upper()],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return None
    out = []
    for line in (res.stdout + res.stderr).splitlines():
        m = _LINE.match(line)
        if m:
            out.append((m.group(1), QT[(m.group(3) or m.group(2)).upper()]))
    assert out, res.stderr[-2000:]
    return out


def planned_types(model: Path, target: str, options: QuantOptions) -> list[tuple[str, QT]] | None:
    with open_gguf(model) as m:
        try:
            plan = plan_quantization(m.tensors, target, arch=m.architecture or "", metadata=m.kv, options=options)
        except GGUFKitError:
            return None
    return [(e.name, e.dst_type) for e in plan.entries]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("preset_models")
    out = {
        "gqa4": make_llama_gguf(d / "gqa4.gguf", n_embd=256, n_ff=512, n_layer=8, n_head=4, n_head_kv=1,
                                n_vocab=256),
        "mha_tied_odd": make_llama_gguf(d / "odd.gguf", n_embd=288, n_ff=600, n_layer=8, n_head=4, n_head_kv=4,
                                        n_vocab=256, tied=True, seed=2),
        "gqa2_16": make_llama_gguf(d / "l16.gguf", n_embd=256, n_ff=256, n_layer=16, n_head=4, n_head_kv=2,
                                   n_vocab=256, seed=3),
    }
    for arch_name in ("mixtral", "gptneox", "qwen2", "smollm3", "cohere2"):
        arch, hp, tensors = arch_case(arch_name, n_layer=8)
        out[arch_name] = make_gguf(d / f"{arch_name}.gguf", arch, hp, tensors, seed=4)
    return out


@pytest.fixture(scope="module")
def imatrices(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("preset_imatrix")
    return {k: write_imatrix_gguf(d / f"{k}.imatrix.gguf", imatrix_values(p)) for k, p in models.items()}


MODELS = ["gqa4", "mha_tied_odd", "gqa2_16", "mixtral", "gptneox", "qwen2", "smollm3", "cohere2"]


@pytest.mark.parametrize("model", MODELS)
def test_every_preset_plans_as_llama_quantize(models, model):
    mismatches = []
    for target in TYPE_CHOICES:
        expected = dry_run_types(models[model], target)
        ours = planned_types(models[model], target, QuantOptions(dry_run=True))
        if ours != expected:
            mismatches.append((target, ours if ours is None or expected is None else
                               [(a, b) for a, b in zip(ours, expected) if a != b][:4], expected is None))
    assert not mismatches


@pytest.mark.parametrize("model", ["gqa4", "mha_tied_odd", "mixtral", "smollm3", "cohere2"])
def test_every_preset_with_imatrix_plans_as_llama_quantize(models, imatrices, model):
    with open_gguf(imatrices[model]) as m:
        sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
    mismatches = []
    for target in TYPE_CHOICES:
        expected = dry_run_types(models[model], target, "--imatrix", str(imatrices[model]))
        ours = planned_types(models[model], target, QuantOptions(dry_run=True, imatrix_sizes=sizes))
        if ours != expected:
            mismatches.append(target)
    assert not mismatches


@pytest.mark.parametrize("model", ["gqa4", "mha_tied_odd", "mixtral"])
def test_every_pure_type_plans_as_llama_quantize(models, model):
    mismatches = [t for t in TYPE_CHOICES if planned_types(models[model], t, QuantOptions(dry_run=True, pure=True))
                  != dry_run_types(models[model], t, "--pure")]
    assert not mismatches


@pytest.mark.parametrize("flags,options", [
    (["--tensor-type", "attn_v=iq2_xxs", "--tensor-type", "ffn_down=q2_k"],
     dict(tensor_types=(("attn_v", QT.IQ2_XXS), ("ffn_down", QT.Q2_K)))),
    (["--output-tensor-type", "iq4_nl", "--token-embedding-type", "tq2_0"],
     dict(output_tensor_type=QT.IQ4_NL, token_embedding_type=QT.TQ2_0)),
    (["--leave-output-tensor"], dict(leave_output_tensor=True)),
    (["--prune-layers", "1,5"], dict(prune_layers=(1, 5))),
])
@pytest.mark.parametrize("target", ["q2_k", "iq3_xs", "q4_k_m", "iq2_m"])
def test_options_plan_as_llama_quantize(models, flags, options, target):
    for model in ("gqa4", "mha_tied_odd"):
        expected = dry_run_types(models[model], target, *flags)
        assert planned_types(models[model], target, QuantOptions(dry_run=True, **options)) == expected, model


def test_preset_table_mirrors_quant_options_and_default_types():
    """PRESETS is QUANT_OPTIONS of tools/quantize/quantize.cpp row for row (names, ftype ids, descriptions,
    order; Q2_0 left out: gguf 0.19 has no type 42), and each default type is llama_ftype_get_default_type's."""
    src = llama_cpp_dir()
    options = re.findall(r'\{\s*"(\w+)",\s*LLAMA_FTYPE_(\w+),\s*"([^"]*)"', (src / "tools/quantize/quantize.cpp").read_text())
    options = [(n.lower(), f, d.strip()) for n, f, d in options if n != "Q2_0"]
    assert [(p.name, p.file_type.name, p.desc) for p in PRESETS.values()] == options
    body = (src / "src/llama-quant.cpp").read_text().split("ggml_type llama_ftype_get_default_type")[1]
    body = body.split("default: return GGML_TYPE_COUNT")[0]
    defaults: dict[str, str] = {}
    pending: list[str] = []
    for ftype, ret in re.findall(r"case LLAMA_FTYPE_(\w+):\s*(?:return GGML_TYPE_(\w+);)?", body):
        pending.append(ftype)
        if ret:
            defaults.update(dict.fromkeys(pending, ret))
            pending = []
    for p in PRESETS.values():
        assert defaults[p.file_type.name] == p.default_type.name, p.name


def test_help_lists_every_type_with_bits_per_weight_and_imatrix_need(models):
    res = invoke("quantize", "--help")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    table = lines[next(i for i, x in enumerate(lines) if re.match(r"\s+id\s+name\s", x)) + 1:]  # not the prose
    for p in PRESETS.values():
        line = next(x for x in table if re.match(rf"\s+(\d+\s+)?{p.name.upper()}\s", x))
        assert ("needs imatrix" in line) == p.needs_imatrix, line
        assert p.only_copy or f"{bits_per_weight(p.default_type):.3f} bpw" in line, line
    # numeric ids and any case work as in llama-quantize: 15 is Q4_K (= Q4_K_M), 0 is F32
    for value, target, file_type in (("15", "q4_k_m", 15), ("Q4_k", "q4_k_m", 15), ("iq2_xxs", "iq2_xxs", 19),
                                     ("0", "f32", 0), ("Q3_K", "q3_k_m", 12)):
        res = invoke("quantize", str(models["gqa4"]), "--type", value, "--dry-run", "--json")
        assert res.exit_code == 0, res.output
        d = json.loads(res.stdout)
        assert (d["target"], d["file_type"]) == (target, file_type)
    res = invoke("quantize", str(models["gqa4"]), "--type", "q9_9", "--dry-run")
    assert res.exit_code == 2 and "unknown quantization type 'q9_9'" in res.output


@pytest.mark.parametrize("override", ["llama.attention.head_count_kv=int:1", "llama.block_count=int:16",
                                      "llama.attention.head_count_kv=str:1"])
def test_overridden_hparams_plan_as_llama_quantize(models, override):
    """--override-kv changes the hparams the rules read (int overrides of integer keys) as in the loader."""
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    for target in ("q2_k", "q3_k_m", "iq3_xxs"):
        expected = dry_run_types(models["mha_tied_odd"], target, "--override-kv", override)
        report = quantize_file(models["mha_tied_odd"], None, target, override_kv=[override], dry_run=True)
        assert [(e.name, e.dst_type) for e in report.plan.entries] == expected, target
