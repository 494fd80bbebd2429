"""The table of type traits is consistent: every row's kernels exist under the naming convention, sizes come
from gguf, scale offsets fit the block, and everything derived from it (CLI choices, plan, help) agrees."""

from __future__ import annotations

import importlib

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ggufkit.quant.llama_quantize.presets import (
    ADAPTER_OUTTYPES,
    CONVERT_OUTTYPES,
    PRESETS,
    TENSOR_TYPES,
    has_kernel,
)
from ggufkit.quant.registry import FLOAT_TYPES, KERNELS, REQUIRES_IMATRIX, TYPES, type_name


def test_float_rows_and_kernel_rows_partition_the_table():
    assert {QT.F32, QT.F16, QT.BF16} == FLOAT_TYPES
    assert set(KERNELS) | FLOAT_TYPES == set(TYPES) and not set(KERNELS) & FLOAT_TYPES
    assert list(KERNELS) == sorted(KERNELS, key=int)
    assert set(TYPES) <= set(TENSOR_TYPES.values())


@pytest.mark.parametrize("qtype", list(KERNELS), ids=lambda t: t.name)
def test_every_row_names_existing_kernels(qtype):
    row = TYPES[qtype]
    assert (row.block_size, row.type_size) == GGML_QUANT_SIZES[qtype] and row.type_id == int(qtype)
    assert row.cpu_quantize == f"quantize_rows_{type_name(qtype)}"
    quantize, dequantize = row.cpu()
    assert callable(quantize) and callable(dequantize)
    assert (row.cpu_f16() is not None) == row.has_f16_kernel
    if row.has_cuda:  # named, not imported here (numba.cuda is tested under the simulator)
        spec = importlib.util.find_spec(row.cuda_module)
        assert spec is not None and spec.origin is not None
        with open(spec.origin) as f:
            source = f.read()
        assert row.cuda_quantize in source and row.cuda_dequantize in source
    assert all(0 <= off <= row.type_size - 2 for off in row.scale_offsets)
    assert row.needs_imatrix == (qtype in REQUIRES_IMATRIX)


def test_k_types_keep_their_capital_k():
    assert type_name(QT.Q2_K) == "q2_K" and type_name(QT.IQ2_XXS) == "iq2_xxs" and type_name(QT.TQ1_0) == "tq1_0"


def test_every_preset_default_type_is_a_tensor_type():
    for p in PRESETS.values():
        assert p.default_type in TENSOR_TYPES.values()
        assert has_kernel(p.default_type) == (p.default_type in TYPES)


def test_convert_outtypes_come_from_the_preset_table():
    """convert's --outtype names (models; --mmproj and LoRA adapters) are a column of the preset table, in the
    order convert's help lists them; each names a preset whose default type ggufkit can write."""
    assert CONVERT_OUTTYPES == ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q4_k_m")
    assert ADAPTER_OUTTYPES == ("f32", "f16", "bf16", "q8_0")
    assert all(has_kernel(PRESETS[n].default_type) for n in CONVERT_OUTTYPES)


def test_plan_names_cpu_only_and_missing_kernel_types():
    """Whatever the table holds: a plan using every tensor type reports exactly the rows without a CUDA kernel
    as CPU-only and exactly the types without a row as plan-only (the CLI prints both)."""
    from ggufkit.format import TensorSpec
    from ggufkit.quant.llama_quantize.plan import QuantOptions, plan_quantization

    names = list(TENSOR_TYPES)
    specs = [TensorSpec(f"blk.0.t{i}.weight", QT.F16, (4, 256)) for i in range(len(names))]
    rules = tuple((rf"\.t{i}\.", t) for i, t in enumerate(TENSOR_TYPES.values()))
    plan = plan_quantization(specs, "q8_0", arch="llama", metadata={"llama.block_count": 1},
                             options=QuantOptions(tensor_types=rules, dry_run=True))
    assert {e.dst_type for e in plan.entries} == set(TENSOR_TYPES.values())
    assert set(plan.missing_kernels()) == set(TENSOR_TYPES.values()) - set(TYPES)
    assert set(plan.cpu_only_types()) == {t for t, r in KERNELS.items() if not r.has_cuda}
    d = plan.to_dict()
    assert d["missing_kernels"] == [t.name for t in plan.missing_kernels()]
    assert d["cpu_only_types"] == [t.name for t in plan.cpu_only_types()]


def test_type_lists_are_derived_from_the_trait_table():
    """One list of writable types (the table's rows), the grid types a column of it; no second names."""
    from ggufkit.quant import registry
    from ggufkit.quant.llama_quantize import plan
    from ggufkit.quant.registry import GRID_TYPES

    assert list(TENSOR_TYPES.values()) == sorted(TYPES, key=int)
    assert {QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S} == GRID_TYPES
    assert {t for t, r in TYPES.items() if r.is_grid} == GRID_TYPES
    assert not hasattr(registry, "QuantKernels") and not hasattr(plan, "WRITABLE_TYPES")


def test_the_q2_k_s_imatrix_rule_is_the_presets():
    """tensor_requires_imatrix: the very low-bit types always, Q2_K only inside a Q2_K_S file; the preset's
    own need and the planner's per-tensor flag both ask the preset."""
    from ggufkit.format import TensorSpec
    from ggufkit.quant.llama_quantize.plan import QuantOptions, plan_quantization

    q2_k_s, q2_k = PRESETS["q2_k_s"], PRESETS["q2_k"]
    assert q2_k_s.requires_imatrix(QT.Q2_K) and not q2_k.requires_imatrix(QT.Q2_K)
    assert q2_k.requires_imatrix(QT.IQ2_XXS) and not q2_k_s.requires_imatrix(QT.Q4_K)
    assert q2_k_s.needs_imatrix and not q2_k.needs_imatrix and PRESETS["iq2_xxs"].needs_imatrix
    specs = [TensorSpec("blk.0.attn_q.weight", QT.F16, (256, 256))]
    for name, required in (("q2_k_s", True), ("q2_k", False)):
        p = plan_quantization(specs, name, arch="llama", metadata={"llama.block_count": 1},
                              options=QuantOptions(pure=True, dry_run=True))
        assert p.entries[0].requires_imatrix == required, name
