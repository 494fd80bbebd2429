"""PowerInfer's per-tensor type choice, for PowerInfer (``PWRI``) files.

PowerInfer quantizes with its own fork of llama.cpp (github.com/SJTU-IPADS/PowerInfer, commit d3ebd7c),
whose rules predate today's llama-quantize and differ from :mod:`ggufkit.quant.llama_quantize.plan` in ways that matter:

* tensors are written in the input file's order (``llama_model_quantize_internal`` walks
  ``ml.get_tensor_meta(i)``), and the attn_v counters run in that order;
* ``output.weight`` becomes Q8_0 when its rows are not a multiple of 256 (QK_K) or the model is Falcon,
  otherwise Q6_K unless the target is Q8_0 - for *every* preset, F16 and F32 included;
* ``token_embd.weight`` gets the preset's type (there is no tied-embedding rule);
* the predictor (``fc1``/``fc2``) becomes Q4_0 for Q4_0 and Q5_0 for every other preset;
* ``ffn_down_t`` is not ``ffn_down``: it matches none of the mixture rules and gets the preset's type;
* the K-quant fallback (rows not a multiple of 256) maps Q2_K/Q3_K/Q4_K/Q5_K/Q6_K to
  Q4_0/Q4_1/Q5_0/Q5_1/Q8_0; 1-D tensors and names not ending in ``weight`` are copied.

All of it is ``get_k_quant_type`` and ``llama_model_quantize_internal`` in PowerInfer's ``llama.cpp``, and the
presets are ``QUANT_OPTIONS`` in its ``examples/quantize/quantize.cpp``. Options PowerInfer's ``quantize``
does not have (an imatrix, per-tensor overrides) and types it does not offer (BF16) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggufkit.errors import QuantizationError, UsageError
from ggufkit.quant.llama_quantize.plan import (
    PlanEntry,
    QuantOptions,
    QuantPlan,
    TensorSource,
    refuse_requantize,
    tensor_nbytes,
)
from ggufkit.quant.registry import FLOAT_TYPES, SUPPORTED_TYPES

QT = GGMLQuantizationType
_LFT = LlamaFileType

#: PowerInfer's quantize.cpp QUANT_OPTIONS: name -> (llama_ftype, the type everything starts from).
POWERINFER_PRESETS: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "q4_0": (_LFT.MOSTLY_Q4_0, QT.Q4_0), "q4_1": (_LFT.MOSTLY_Q4_1, QT.Q4_1),
    "q5_0": (_LFT.MOSTLY_Q5_0, QT.Q5_0), "q5_1": (_LFT.MOSTLY_Q5_1, QT.Q5_1),
    "q2_k": (_LFT.MOSTLY_Q2_K, QT.Q2_K),
    "q3_k_s": (_LFT.MOSTLY_Q3_K_S, QT.Q3_K), "q3_k_m": (_LFT.MOSTLY_Q3_K_M, QT.Q3_K),
    "q3_k_l": (_LFT.MOSTLY_Q3_K_L, QT.Q3_K),
    "q4_k_s": (_LFT.MOSTLY_Q4_K_S, QT.Q4_K), "q4_k_m": (_LFT.MOSTLY_Q4_K_M, QT.Q4_K),
    "q5_k_s": (_LFT.MOSTLY_Q5_K_S, QT.Q5_K), "q5_k_m": (_LFT.MOSTLY_Q5_K_M, QT.Q5_K),
    "q6_k": (_LFT.MOSTLY_Q6_K, QT.Q6_K), "q8_0": (_LFT.MOSTLY_Q8_0, QT.Q8_0),
    "f16": (_LFT.MOSTLY_F16, QT.F16), "f32": (_LFT.ALL_F32, QT.F32),
}
#: The aliases of the same table: Q3_K, Q4_K and Q5_K mean their _M presets.
POWERINFER_ALIASES: dict[str, str] = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}

QK_K = 256
# get_k_quant_type's convert_incompatible_tensor switch.
_FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_1, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}
#: ffn_down_t types PowerInfer's CPU sparse FFN reads correctly: ggml.c ggml_compute_forward_mul_mat_axpy
#: reads every row as ggml_fp16_t, except Q4_0, which has its own kernel (..._axpy_q4_0).
SPARSE_CPU_FFN_DOWN_T_TYPES = frozenset({QT.F16, QT.Q4_0})


def powerinfer_preset(target: str) -> tuple[str, LlamaFileType, GGMLQuantizationType]:
    """``(canonical name, file type, default type)`` of a PowerInfer ``quantize`` type name.

    Raises:
        UsageError: a name PowerInfer's ``quantize`` does not offer (``bf16``, ``iq4_nl``, ...).
    """
    key = target.strip().lower()
    key = POWERINFER_ALIASES.get(key, key)
    if key not in POWERINFER_PRESETS:
        offered = ", ".join([*POWERINFER_PRESETS, *POWERINFER_ALIASES])
        raise UsageError(f"PowerInfer's quantize does not offer {target!r} for PowerInfer (PWRI) files; "
                         f"choose one of {offered}")
    file_type, default = POWERINFER_PRESETS[key]
    return key, file_type, default


def _use_more_bits(i: int, n: int) -> bool:
    # C integer division and remainder truncate toward zero; i - n/8 may be negative.
    d = i - n // 8
    rem = abs(d) % 3 * (1 if d >= 0 else -1)
    return i < n // 8 or i >= 7 * n // 8 or rem == 2


def _is_70b(arch: str, metadata: Mapping[str, Any]) -> bool:
    """llm_load_hparams: only an 80-layer llama with grouped-query attention is MODEL_70B."""
    def get(key: str) -> int | None:
        v = metadata.get(key)
        v = getattr(v, "value", v)
        return int(v) if isinstance(v, int) else None

    n_head = get(f"{arch}.attention.head_count")
    n_head_kv = get(f"{arch}.attention.head_count_kv")
    return arch == "llama" and get(f"{arch}.block_count") == 80 and n_head_kv is not None and n_head != n_head_kv


class _State:
    """quantize_state_internal's counters."""

    def __init__(self, n_attention_wv: int, n_ffn_down: int) -> None:
        self.n_attention_wv, self.i_attention_wv = n_attention_wv, 0
        self.n_ffn_down, self.i_ffn_down = n_ffn_down, 0


def _k_quant_type(t: GGMLQuantizationType, name: str, ne0: int, preset: str, arch: str, is_70b: bool,
                  s: _State) -> tuple[GGMLQuantizationType, str]:
    """get_k_quant_type before its fallback step: the type and why."""
    falcon = arch == "falcon"
    if name == "output.weight":
        if falcon or ne0 % QK_K:
            why = "falcon" if falcon else f"row length {ne0} not a multiple of {QK_K}"
            return QT.Q8_0, f"output: {why} -> q8_0"
        if t != QT.Q8_0:
            return QT.Q6_K, "output -> q6_k"
        return t, "output: preset default -> q8_0"
    if "attn_v.weight" in name:
        i, n = s.i_attention_wv, s.n_attention_wv
        s.i_attention_wv += 1
        new, why = t, ""
        if preset == "q2_k":
            new, why = QT.Q3_K, "attn_v (q2_k) -> q3_k"
        elif preset == "q3_k_m":
            new = QT.Q5_K if i < 2 else QT.Q4_K
            why = f"attn_v #{i} (q3_k_m) -> {new.name.lower()}"
        elif preset == "q3_k_l":
            new, why = QT.Q5_K, "attn_v (q3_k_l) -> q5_k"
        elif preset in ("q4_k_m", "q5_k_m") and _use_more_bits(i, n):
            new, why = QT.Q6_K, "attn_v use_more_bits layer -> q6_k"
        elif preset == "q4_k_s" and i < 4:
            new, why = QT.Q5_K, f"attn_v #{i} < 4 -> q5_k"
        if is_70b and new in (QT.Q3_K, QT.Q4_K):
            new, why = QT.Q5_K, "attn_v in a 70B model -> q5_k"
        return new, why or "preset default"
    if "ffn_down.weight" in name:  # never in a PWRI file (it has ffn_down_t), kept for completeness
        i, n = s.i_ffn_down, s.n_ffn_down
        s.i_ffn_down += 1
        more = _use_more_bits(i, n)
        new = t
        if preset == "q2_k":
            new = QT.Q3_K
        elif preset == "q3_k_m":
            new = QT.Q5_K if i < 2 else QT.Q4_K if (not falcon or more) else QT.Q3_K
        elif preset == "q3_k_l":
            new = QT.Q4_K if falcon else QT.Q5_K
        elif preset == "q4_k_m":
            if falcon:
                new = QT.Q6_K if i < 2 else QT.Q5_K if more else QT.Q4_K
            elif more:
                new = QT.Q6_K
        elif preset == "q5_k_m" and more:
            new = QT.Q6_K
        elif preset == "q4_k_s" and not falcon and i < 4:
            new = QT.Q5_K
        return new, "preset default" if new == t else f"ffn_down #{i} ({preset}) -> {new.name.lower()}"
    if "attn_output.weight" in name:
        rules = {"q3_k_l": QT.Q4_K} if falcon else {"q2_k": QT.Q3_K, "q3_k_m": QT.Q4_K, "q3_k_l": QT.Q5_K}
        if preset in rules:
            return rules[preset], f"attn_output ({preset}) -> {rules[preset].name.lower()}"
        return t, "preset default"
    if "attn_qkv.weight" in name:
        rules = {"q3_k_m": QT.Q4_K, "q3_k_l": QT.Q4_K, "q4_k_m": QT.Q5_K, "q5_k_m": QT.Q6_K}
        if preset in rules:
            return rules[preset], f"attn_qkv ({preset}) -> {rules[preset].name.lower()}"
        return t, "preset default"
    if "ffn_gate.weight" in name or "ffn_up.weight" in name:
        if preset == "q2_k":
            return QT.Q3_K, "ffn_gate/ffn_up (q2_k) -> q3_k"
        return t, "preset default"
    if "fc1.weight" in name or "fc2.weight" in name:
        new = QT.Q4_0 if preset == "q4_0" else QT.Q5_0
        return new, f"predictor fc1/fc2 -> {new.name.lower()}"
    return t, "preset default"


def _refuse_foreign_options(opts: QuantOptions) -> None:
    foreign = [flag for flag, used in (
        ("--imatrix", opts.imatrix_sizes is not None), ("--tensor-type", bool(opts.tensor_types)),
        ("--output-tensor-type", opts.output_tensor_type is not None),
        ("--token-embedding-type", opts.token_embedding_type is not None)) if used]
    if foreign:
        raise UsageError(f"PowerInfer's quantize has no {', '.join(foreign)}: PowerInfer (PWRI) files are quantized "
                         "by its rules only (--pure, --leave-output-tensor and --allow-requantize are available)")


def plan_powerinfer(tensors: Sequence[TensorSource], target: str, *, arch: str, metadata: Mapping[str, Any],
                    options: QuantOptions | None = None) -> QuantPlan:
    """Choose every tensor's output type exactly as PowerInfer's ``quantize`` would.

    Args:
        tensors: the input tensors **in file order** (PowerInfer keeps it, and its counters follow it).
        target: a PowerInfer ``quantize`` type name (:data:`POWERINFER_PRESETS`, :data:`POWERINFER_ALIASES`).
        arch: ``general.architecture``.
        metadata: the model's KV pairs (reads the head and block counts for the 70B rule).
        options: only ``pure``, ``leave_output_tensor``, ``allow_requantize`` and ``no_fallback`` apply.

    Returns:
        The plan, entries in input order.

    Raises:
        UsageError: a type or an option PowerInfer's ``quantize`` does not offer.
        QuantizationError: a planned type ggufkit has no kernel for, rows that are not whole blocks of the
            planned type, a quantized input without ``allow_requantize``, a fallback with ``no_fallback``.
    """
    opts = options or QuantOptions()
    _refuse_foreign_options(opts)
    preset, file_type, default = powerinfer_preset(target)
    state = _State(sum("attn_v.weight" in t.name or "attn_qkv.weight" in t.name for t in tensors),
                   sum("ffn_down.weight" in t.name for t in tensors))
    is_70b = _is_70b(arch, metadata)
    entries = []
    for t in tensors:
        name, shape, src = t.name, tuple(int(d) for d in t.shape), t.ggml_type
        ne0 = shape[-1] if shape else 1
        dst, reason, fallback = src, "", False
        raw = name.encode("utf-8")
        # C++: name.rfind("weight") == name.size() - 6 (also true for a 5-byte name: npos == size_t(-1)).
        if len(shape) != 2:
            reason = f"{len(shape)}-D tensor: kept as is"
        elif not (raw.endswith(b"weight") or len(raw) == 5):
            reason = "name does not end in 'weight': kept as is"
        elif opts.leave_output_tensor and name == "output.weight":
            reason = "--leave-output-tensor: kept as is"
        elif opts.pure:
            dst, reason = default, "--pure: preset default"
        else:
            dst, reason = _k_quant_type(default, name, ne0, preset, arch, is_70b, state)
            fallback = dst in _FALLBACK and ne0 % QK_K != 0
        if fallback:
            dst, reason, fallback = _FALLBACK[dst], (f"row length {ne0} not a multiple of {QK_K} "
                                                    f"({dst.name.lower()}) -> {_FALLBACK[dst].name.lower()} "
                                                    "(fallback)"), True
        if reason == "preset default" or reason.endswith(": preset default"):
            reason = f"{reason} -> {dst.name.lower()}"
        entries.append(_entry(name, shape, src, dst, reason, fallback, opts))
    plan = QuantPlan(preset, file_type, default, tuple(entries), opts)
    if opts.no_fallback and plan.fallbacks:
        first = plan.fallbacks[0]
        raise QuantizationError(f"{first.reason}; --no-fallback forbids it ({len(plan.fallbacks)} of "
                                f"{len(entries)} tensors need a fallback)", tensor=first.name)
    for e in plan.entries:
        if e.src_type != e.dst_type and e.dst_type not in SUPPORTED_TYPES:
            raise QuantizationError(f"PowerInfer's {preset} makes it {e.dst_type.name}, which ggufkit has no "
                                    "kernel for", tensor=e.name)
    return plan


def _entry(name: str, shape: tuple[int, ...], src: GGMLQuantizationType, dst: GGMLQuantizationType, reason: str,
           fallback: bool, opts: QuantOptions) -> PlanEntry:
    if src != dst:
        block = GGML_QUANT_SIZES[dst][0]
        if shape[-1] % block:
            # PowerInfer would quantize across row ends and write a file ggml cannot load.
            raise QuantizationError(f"row length {shape[-1]} is not a multiple of {block}, the block of "
                                    f"{dst.name}", tensor=name)
        if src not in FLOAT_TYPES:
            refuse_requantize(src, dst, name, opts)
    return PlanEntry(name, shape, src, dst, reason, tensor_nbytes(dst, shape), tensor_nbytes(src, shape), fallback)


def sparse_ffn_warnings(plan: QuantPlan) -> tuple[str, ...]:
    """One warning when ``ffn_down_t`` tensors get a type PowerInfer's CPU sparse FFN reads wrongly.

    PowerInfer's own ``quantize`` makes the same choice; its ``main`` then runs, but the sparse FFN reads
    those rows as F16 (ggml.c ``ggml_compute_forward_mul_mat_axpy``), so its CPU output is wrong.
    """
    bad = sorted({e.dst_type.name for e in plan.entries
                  if "ffn_down_t" in e.name and e.dst_type not in SPARSE_CPU_FFN_DOWN_T_TYPES})
    if not bad:
        return ()
    return (f"ffn_down_t becomes {'/'.join(bad)} (as PowerInfer's quantize makes it), but PowerInfer's CPU sparse "
            "FFN reads ffn_down_t correctly only as F16 or Q4_0: use q4_0 for CPU sparse inference",)
