"""llama-quantize's per-tensor type choice, as data plus one pure function.

:func:`plan_quantization` reproduces ``llama_model_quantize`` (``src/llama-quant.cpp`` of the llama.cpp tree
vendored in llama-cpp-python 0.3.36; reference/quant.md §7) for the presets ggufkit has kernels for: the
output tensor order, every tensor's target type (mixture rules, ``--pure``, ``--tensor-type`` overrides,
the divisibility fallback) and ``general.file_type``. Each entry says *why* it got its type, so a
"Q4_K_M" file that is mostly Q5_0 is never a surprise.

Presets are rows of :data:`PRESETS`; the mixture rules that differ between presets are fields of
:class:`Preset`, and the rules shared by all of them (output tensor, 70B llama, 8-expert models, the
fallback table) are small functions that cite the C they mirror.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggufkit.errors import MetadataKeyNotFoundError, QuantizationError, UsageError

QT = GGMLQuantizationType

#: Tensor types ggufkit can write: what ``--tensor-type``, ``--output-tensor-type`` and
#: ``--token-embedding-type`` accept (ggml type names, case-insensitive).
WRITABLE_TYPES: dict[str, GGMLQuantizationType] = {
    t.name.lower(): t
    for t in (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
}
#: Source types that are plain floats: converted to f32 exactly, never "requantized".
FLOAT_TYPES = frozenset({QT.F32, QT.F16, QT.BF16})

#: llama.cpp's GGML_QNT_VERSION, written as ``general.quantization_version``.
QUANTIZATION_VERSION = 2


@dataclass(frozen=True)
class Preset:
    """One llama-quantize TYPE: its ``general.file_type``, default tensor type and mixture rules.

    The rule fields mirror the branches of ``llama_tensor_get_type_impl`` that differ between the presets in
    scope; ``None`` means the branch does not apply and the tensor keeps the default type.

    Attributes:
        name: canonical lower-case name (``q4_k_m``).
        file_type: the ``llama_ftype`` written as ``general.file_type``.
        default_type: the tensor type everything starts from.
        attn_v_more_bits: attn_v/attn_qkv/attn_kv_b type when ``use_more_bits(i_attention_wv, n_attention_wv)``.
        attn_v_first: ``(n, type)``: attn_v-like tensors number ``i_attention_wv < n`` get ``type``.
        ffn_down_more_bits: ffn_down type when ``use_more_bits(i_layer, n_layer)`` (non-Falcon for Q4_K_M).
        ffn_down_first_eighth: ffn_down type for ``i_layer < n_layer/8`` (non-Falcon only).
        ffn_down_first_eighth_imatrix: as above, only when an imatrix is given (Q4_0 -> Q4_1, Q5_0 -> Q5_1).
        falcon_ffn_down_mix: Q4_K_M's Falcon ffn_down rule (Q6_K below n/16, Q5_K on use_more_bits, else Q4_K).
        attn_output_moe8: attn_output type in 8-expert models (non-Falcon).
    """

    name: str
    file_type: LlamaFileType
    default_type: GGMLQuantizationType
    attn_v_more_bits: GGMLQuantizationType | None = None
    attn_v_first: tuple[int, GGMLQuantizationType] | None = None
    ffn_down_more_bits: GGMLQuantizationType | None = None
    ffn_down_first_eighth: GGMLQuantizationType | None = None
    ffn_down_first_eighth_imatrix: GGMLQuantizationType | None = None
    falcon_ffn_down_mix: bool = False
    attn_output_moe8: GGMLQuantizationType | None = None

    @property
    def is_quantized(self) -> bool:
        return self.default_type not in FLOAT_TYPES


_LFT = LlamaFileType
#: llama-quantize's QUANT_OPTIONS that ggufkit has kernels for (tools/quantize/quantize.cpp).
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("q4_0", _LFT.MOSTLY_Q4_0, QT.Q4_0, ffn_down_first_eighth_imatrix=QT.Q4_1),
    Preset("q4_1", _LFT.MOSTLY_Q4_1, QT.Q4_1),
    Preset("q5_0", _LFT.MOSTLY_Q5_0, QT.Q5_0, ffn_down_first_eighth_imatrix=QT.Q5_1),
    Preset("q5_1", _LFT.MOSTLY_Q5_1, QT.Q5_1),
    Preset("q8_0", _LFT.MOSTLY_Q8_0, QT.Q8_0),
    Preset("q4_k_s", _LFT.MOSTLY_Q4_K_S, QT.Q4_K, attn_v_first=(4, QT.Q5_K), ffn_down_first_eighth=QT.Q5_K,
           attn_output_moe8=QT.Q5_K),
    Preset("q4_k_m", _LFT.MOSTLY_Q4_K_M, QT.Q4_K, attn_v_more_bits=QT.Q6_K, ffn_down_more_bits=QT.Q6_K,
           falcon_ffn_down_mix=True, attn_output_moe8=QT.Q5_K),
    Preset("q5_k_s", _LFT.MOSTLY_Q5_K_S, QT.Q5_K),
    Preset("q5_k_m", _LFT.MOSTLY_Q5_K_M, QT.Q5_K, attn_v_more_bits=QT.Q6_K, ffn_down_more_bits=QT.Q6_K),
    Preset("q6_k", _LFT.MOSTLY_Q6_K, QT.Q6_K),
    Preset("f16", _LFT.MOSTLY_F16, QT.F16),
    Preset("bf16", _LFT.MOSTLY_BF16, QT.BF16),
    Preset("f32", _LFT.ALL_F32, QT.F32),
)}
#: llama-quantize's aliases: ``Q4_K`` means Q4_K_M and ``Q5_K`` means Q5_K_M (file_type 15 and 17).
ALIASES: dict[str, str] = {"q4_k": "q4_k_m", "q5_k": "q5_k_m"}
#: Every name ``--type`` accepts, in the order ``--help`` lists them.
TYPE_CHOICES: tuple[str, ...] = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k",
                                 "q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "f16", "bf16", "f32")

# Fallback when a row is not a whole number of blocks (tensor_type_fallback); 32-block types stay and
# then fail the second check, which makes them F16.
_FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


def get_preset(target: str) -> Preset:
    """The preset for a ``--type`` name (case-insensitive; ``q4_k`` and ``q5_k`` are llama.cpp's aliases).

    Raises:
        UsageError: unknown name.
    """
    key = target.strip().lower()
    key = ALIASES.get(key, key)
    try:
        return PRESETS[key]
    except KeyError:
        raise UsageError(f"unknown quantization type {target!r}; choose one of {', '.join(TYPE_CHOICES)}") from None


def parse_type(name: str | GGMLQuantizationType, what: str = "tensor type") -> GGMLQuantizationType:
    """A ggml type from its name (``q8_0``, ``F16``), restricted to :data:`WRITABLE_TYPES`.

    Raises:
        UsageError: not a type ggufkit can write.
    """
    if isinstance(name, GGMLQuantizationType):
        if name not in WRITABLE_TYPES.values():
            raise UsageError(f"{what} {name.name} is not supported; choose one of {', '.join(WRITABLE_TYPES)}")
        return name
    try:
        return WRITABLE_TYPES[name.strip().lower()]
    except KeyError:
        raise UsageError(f"invalid {what} {name!r}; choose one of {', '.join(WRITABLE_TYPES)}") from None


def parse_tensor_type_option(option: str | tuple[str, str | GGMLQuantizationType]) -> tuple[str, GGMLQuantizationType]:
    """``PATTERN=TYPE`` (or a ``(pattern, type)`` pair) as llama-quantize's ``--tensor-type`` parses it.

    The pattern is lower-cased (quantize.cpp ``parse_tensor_type``) and must compile as a regular expression.

    Raises:
        UsageError: malformed option, bad regular expression or unknown type.
    """
    type_name: str | GGMLQuantizationType
    if isinstance(option, str):
        pattern, sep, type_name = option.partition("=")
        if not sep:
            raise UsageError(f"malformed --tensor-type {option!r}: expected PATTERN=TYPE, e.g. attn_v=q8_0")
    else:
        pattern, type_name = option
    if not pattern:
        raise UsageError(f"--tensor-type {option!r}: missing tensor name pattern")
    if isinstance(type_name, str) and not type_name:
        raise UsageError(f"--tensor-type {option!r}: missing quantization type")
    pattern = pattern.lower()
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"--tensor-type {option!r}: bad regular expression ({exc})") from None
    return pattern, parse_type(type_name, "--tensor-type type")


class TensorSource(Protocol):
    """What the planner needs to know about a tensor: a reader's ``TensorInfo`` or a writer's ``TensorSpec``."""

    @property
    def name(self) -> str: ...

    @property
    def ggml_type(self) -> GGMLQuantizationType: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class QuantOptions:
    """llama-quantize's options that change the plan.

    Attributes:
        pure: no mixture rules; everything quantizable gets the default type (fallback still applies).
        tensor_types: ``(pattern, type)`` pairs; the first pattern that ``re.search``-matches a name wins.
        output_tensor_type: type of ``output.weight`` (no fallback).
        token_embedding_type: type of ``token_embd.weight`` (no fallback).
        leave_output_tensor: copy ``output.weight`` unchanged.
        allow_requantize: dequantize already-quantized tensors and quantize them again.
        no_fallback: any divisibility fallback is an error.
        imatrix_sizes: name -> number of values of each imatrix entry, or None without an imatrix.
    """

    pure: bool = False
    tensor_types: tuple[tuple[str, GGMLQuantizationType], ...] = ()
    output_tensor_type: GGMLQuantizationType | None = None
    token_embedding_type: GGMLQuantizationType | None = None
    leave_output_tensor: bool = False
    allow_requantize: bool = False
    no_fallback: bool = False
    imatrix_sizes: Mapping[str, int] | None = None


@dataclass(frozen=True)
class PlanEntry:
    """One tensor of the output, in output order.

    Attributes:
        name: tensor name.
        shape: numpy-order shape (rows first).
        src_type: type in the input.
        dst_type: type in the output.
        reason: why ``dst_type`` was chosen, e.g. ``"attn_v use_more_bits layer -> q6_k"``.
        nbytes: bytes of the output tensor (before alignment padding).
        src_nbytes: bytes of the input tensor.
        fallback: ``dst_type`` is a divisibility fallback.
        imatrix: ``"used"``, ``"missing"``, ``"ignored (size mismatch)"``, or None (no imatrix or copied).
    """

    name: str
    shape: tuple[int, ...]
    src_type: GGMLQuantizationType
    dst_type: GGMLQuantizationType
    reason: str
    nbytes: int
    src_nbytes: int
    fallback: bool = False
    imatrix: str | None = None

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def action(self) -> str:
        """``copy`` (same type), ``convert`` (from a float type) or ``requantize`` (from a quantized type)."""
        if self.src_type == self.dst_type:
            return "copy"
        return "convert" if self.src_type in FLOAT_TYPES else "requantize"

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / self.n_elements if self.n_elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "src_type": self.src_type.name,
                "dst_type": self.dst_type.name, "action": self.action, "reason": self.reason,
                "bytes": self.nbytes, "src_bytes": self.src_nbytes,
                "bits_per_weight": round(self.bits_per_weight, 4), "fallback": self.fallback,
                "imatrix": self.imatrix}


@dataclass(frozen=True)
class QuantPlan:
    """The whole plan: entries in output order, the file type and totals.

    Attributes:
        target: canonical preset name (``q4_k_m``).
        file_type: value written as ``general.file_type``.
        default_type: the preset's default tensor type.
        entries: one per tensor, in llama-quantize's output order.
        options: the options the plan was made with.
    """

    target: str
    file_type: LlamaFileType
    default_type: GGMLQuantizationType
    entries: tuple[PlanEntry, ...]
    options: QuantOptions = field(default_factory=QuantOptions)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def src_nbytes(self) -> int:
        return sum(e.src_nbytes for e in self.entries)

    @property
    def n_elements(self) -> int:
        return sum(e.n_elements for e in self.entries)

    @property
    def bits_per_weight(self) -> float:
        n = self.n_elements
        return self.nbytes * 8 / n if n else 0.0

    @property
    def fallbacks(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.fallback)

    @property
    def fallback_share(self) -> float:
        """Share of all weights (elements) that live in fallback tensors."""
        n = self.n_elements
        return sum(e.n_elements for e in self.fallbacks) / n if n else 0.0

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.entries:
            counts[e.dst_type.name] = counts.get(e.dst_type.name, 0) + 1
        return counts

    def fallback_summary(self) -> str:
        """One line: how many tensors fell back and what share of the weights they hold."""
        fb = self.fallbacks
        if not fb:
            return f"no fallbacks: all {len(self.entries)} tensors got their planned type"
        kinds: dict[str, int] = {}
        for e in fb:
            kinds[e.dst_type.name] = kinds.get(e.dst_type.name, 0) + 1
        detail = ", ".join(f"{n} -> {k}" for k, n in kinds.items())
        return (f"fallback: {len(fb)} of {len(self.entries)} tensors ({self.fallback_share:.1%} of weights) "
                f"use a fallback type because their rows are not whole blocks ({detail})")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "file_type": int(self.file_type), "file_type_name": self.file_type.name,
                "default_type": self.default_type.name, "tensors": [e.to_dict() for e in self.entries],
                "totals": {"tensors": len(self.entries), "parameters": self.n_elements, "bytes": self.nbytes,
                           "src_bytes": self.src_nbytes, "bits_per_weight": round(self.bits_per_weight, 4),
                           "fallbacks": len(self.fallbacks), "fallback_share": round(self.fallback_share, 6),
                           "types": self.type_counts()}}


# --- tensor order (llama_model_loader::weight_name_comparer) -------------------------------------------
# sscanf(name, "blk.%d.", &layer): %d skips white space and takes an optional sign; the trailing "." need
# not match for the layer to count.
_LAYER_RE = re.compile(r"blk\.\s*([+-]?\d+)")


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def llama_order_key(name: str) -> tuple[int, bytes]:
    """Sort key of llama-quantize's output order: layer from ``blk.N.`` (-1 for others), then name bytes."""
    layer = _layer_of(name)
    return (-1 if layer is None else layer, name.encode("utf-8"))


# --- categories (tensor_get_category) -----------------------------------------------------------------
_OUTPUT, _TOKEN_EMBD = "output", "token_embd"
_ATTN_QKV, _ATTN_KV_B, _ATTN_V, _ATTN_K, _ATTN_Q = "attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q"
_ATTN_OUTPUT, _FFN_UP, _FFN_GATE, _FFN_DOWN, _OTHER = "attn_output", "ffn_up", "ffn_gate", "ffn_down", "other"
# Checked in this order; the first substring found decides (attn_qkv before attn_v, ffn_up before ffn_down).
_CATEGORY_SUBSTRINGS = (
    ("attn_qkv.weight", _ATTN_QKV), ("attn_kv_b.weight", _ATTN_KV_B), ("attn_v.weight", _ATTN_V),
    ("attn_k.weight", _ATTN_K), ("attn_q.weight", _ATTN_Q), ("attn_output.weight", _ATTN_OUTPUT),
    ("ffn_up", _FFN_UP), ("ffn_gate", _FFN_GATE), ("ffn_down", _FFN_DOWN),
)
_ATTN_V_LIKE = frozenset({_ATTN_V, _ATTN_QKV, _ATTN_KV_B})
_TOKEN_EMBD_NAMES = frozenset({"token_embd.weight", "per_layer_token_embd.weight"})


def tensor_category(name: str) -> str:
    """The broad category llama-quantize's mixture rules key on (``attn_v``, ``ffn_down``, ``output``...)."""
    if name == "output.weight":
        return _OUTPUT
    if name in _TOKEN_EMBD_NAMES:
        return _TOKEN_EMBD
    for sub, cat in _CATEGORY_SUBSTRINGS:
        if sub in name:
            return cat
    return _OTHER


# --- quantizable or not (tensor_allows_quantization) ---------------------------------------------------
_NEVER_QUANTIZED_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger",
    "a.rvq.codebook", "mm.a.code_embd",
)
# POS_EMBD and TOKEN_TYPES are compared by exact name (LLM_TN gives the same string for every arch).
_NEVER_QUANTIZED_NAMES = frozenset({"position_embd.weight", "token_types.weight"})


def _not_quantizable_reason(name: str, n_dims: int, leave_output_tensor: bool) -> str | None:
    if n_dims < 2:
        return f"{n_dims}-D tensor: kept as is"
    # C++: name.rfind("weight") == name.size() - 6, which is also true for a 5-byte name without "weight"
    # (npos == size_t(-1)); mirrored so odd names are treated exactly as llama-quantize treats them.
    raw = name.encode("utf-8")
    if not (raw.endswith(b"weight") or len(raw) == 5):
        return "name does not end in 'weight': kept as is"
    if leave_output_tensor and name == "output.weight":
        return "--leave-output-tensor: kept as is"
    if name in _NEVER_QUANTIZED_NAMES:
        return "positional/token-type embedding: kept as is"
    for sub in _NEVER_QUANTIZED_SUBSTRINGS:
        if sub in name:
            return f"'{sub}' tensors are never quantized: kept as is"
    return None


# --- the mixture (llama_tensor_get_type_impl) ----------------------------------------------------------
def _use_more_bits(i: int, n: int) -> bool:
    # C integer division and remainder truncate toward zero; n >= 0 here, i - n//8 may be negative.
    q = n // 8
    d = i - q
    rem = abs(d) % 3 * (1 if d >= 0 else -1)
    return i < q or i >= 7 * n // 8 or rem == 2


@dataclass
class _Model:
    arch: str
    n_layer: int | None
    n_expert: int
    is_70b: bool


@dataclass
class _Counters:
    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    has_tied_embeddings: bool = True


def _tname(t: GGMLQuantizationType) -> str:
    return t.name.lower()


def _layer_info(counter: int, model: _Model, name: str) -> tuple[int, int]:
    if model.n_layer is None:
        raise MetadataKeyNotFoundError(f"{model.arch}.block_count",
                                       hint="llama-quantize needs the layer count for its mixture rules")
    if model.n_expert > 1:
        # Experts are not stored layer by layer, so llama-quantize reads the layer from the name.
        layer = _layer_of(name)
        if layer is None:
            raise QuantizationError("cannot determine the layer of this tensor (expected 'blk.N.')", tensor=name)
        if not 0 <= layer < model.n_layer:
            raise QuantizationError(f"layer {layer} is outside [0, {model.n_layer})", tensor=name)
        return layer, model.n_layer
    return counter, model.n_layer


def _mixture(preset: Preset, name: str, ne0: int, cat: str, model: _Model, c: _Counters,
             opts: QuantOptions, has_imatrix: bool) -> tuple[GGMLQuantizationType, str]:
    """Type and reason from the preset's mixture rules, starting from the default type."""
    t = preset.default_type
    falcon = model.arch == "falcon"
    if cat == _OUTPUT or (c.has_tied_embeddings and cat == _TOKEN_EMBD):
        what = "output" if cat == _OUTPUT else "tied token_embd (quantized like output)"
        if opts.output_tensor_type is not None:
            return opts.output_tensor_type, f"{what}: --output-tensor-type"
        block = GGML_QUANT_SIZES[t][0]
        if falcon:
            return QT.Q8_0, f"{what}: falcon -> q8_0"
        if ne0 % block:
            return QT.Q8_0, f"{what}: row length {ne0} not a multiple of {block} -> q8_0"
        if t != QT.Q8_0:
            return QT.Q6_K, f"{what} -> q6_k"
        return t, f"{what}: preset default"
    if cat == _TOKEN_EMBD:
        return t, "token_embd: preset default"
    if cat in _ATTN_V_LIKE:
        i, n = c.i_attention_wv, c.n_attention_wv
        c.i_attention_wv += 1
        reason = "preset default"
        if preset.attn_v_more_bits is not None and _use_more_bits(i, n):
            t, reason = preset.attn_v_more_bits, f"{cat} use_more_bits layer -> {_tname(preset.attn_v_more_bits)}"
        elif preset.attn_v_first is not None and i < preset.attn_v_first[0]:
            t = preset.attn_v_first[1]
            reason = f"{cat} #{i} < {preset.attn_v_first[0]} -> {_tname(t)}"
        if model.is_70b and t in (QT.Q3_K, QT.Q4_K):
            t, reason = QT.Q5_K, f"{cat} in a 70B model -> q5_k"
        if model.n_expert == 8:
            t, reason = QT.Q8_0, f"{cat} in an 8-expert model -> q8_0"
        return t, reason
    if cat == _ATTN_K:
        if model.n_expert == 8:
            return QT.Q8_0, "attn_k in an 8-expert model -> q8_0"
        return t, "preset default"
    if cat == _FFN_DOWN:
        i, n = _layer_info(c.i_ffn_down, model, name)
        c.i_ffn_down += 1
        if preset.falcon_ffn_down_mix and falcon:
            if i < n // 16:
                return QT.Q6_K, f"ffn_down layer {i} < n_layer/16 (falcon) -> q6_k"
            if _use_more_bits(i, n):
                return QT.Q5_K, "ffn_down use_more_bits layer (falcon) -> q5_k"
            return QT.Q4_K, "ffn_down (falcon) -> q4_k"
        if preset.ffn_down_more_bits is not None and _use_more_bits(i, n):
            return preset.ffn_down_more_bits, f"ffn_down use_more_bits layer -> {_tname(preset.ffn_down_more_bits)}"
        if preset.ffn_down_first_eighth is not None and not falcon and i < n // 8:
            return preset.ffn_down_first_eighth, f"ffn_down layer {i} < n_layer/8 -> {_tname(preset.ffn_down_first_eighth)}"
        if preset.ffn_down_first_eighth_imatrix is not None and has_imatrix and i < n // 8:
            u = preset.ffn_down_first_eighth_imatrix
            return u, f"ffn_down layer {i} < n_layer/8 with imatrix -> {_tname(u)}"
        return t, "preset default"
    if cat == _ATTN_OUTPUT:
        if not falcon and model.n_expert == 8 and preset.attn_output_moe8 is not None:
            return preset.attn_output_moe8, f"attn_output in an 8-expert model -> {_tname(preset.attn_output_moe8)}"
        return t, "preset default"
    if cat == _FFN_GATE:
        _layer_info(c.i_ffn_gate, model, name)
        c.i_ffn_gate += 1
    elif cat == _FFN_UP:
        _layer_info(c.i_ffn_up, model, name)
        c.i_ffn_up += 1
    return t, "preset default"


def _fallback(name: str, ne0: int, t: GGMLQuantizationType) -> tuple[GGMLQuantizationType, str] | None:
    """tensor_type_fallback: the type to use when ``ne0`` is not a whole number of ``t`` blocks."""
    block = GGML_QUANT_SIZES[t][0]
    if ne0 % block == 0:
        return None
    new = _FALLBACK.get(t)
    if new is None:
        if block > 32:
            raise QuantizationError(f"no fallback is defined for {t.name} with row length {ne0}", tensor=name)
        new = t
    if ne0 % GGML_QUANT_SIZES[new][0]:
        return QT.F16, f"row length {ne0} not a multiple of {block} ({_tname(t)}) nor of 32 -> f16 (fallback)"
    return new, f"row length {ne0} not a multiple of {block} ({_tname(t)}) -> {_tname(new)} (fallback)"


def _meta_int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    value = getattr(value, "value", value)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


#: Architectures whose load_hparams sets LLM_TYPE_70B, by layer count (src/models/<arch>.cpp); the attn_v
#: rule upgrades Q3_K/Q4_K to Q5_K for them.
_TYPE_70B_LAYERS: dict[str, int] = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}


def _model_info(arch: str, metadata: Mapping[str, Any]) -> _Model:
    n_layer = _meta_int(metadata, f"{arch}.block_count")
    n_expert = _meta_int(metadata, f"{arch}.expert_count") or 0
    n_head = _meta_int(metadata, f"{arch}.attention.head_count")
    n_head_kv = _meta_int(metadata, f"{arch}.attention.head_count_kv")
    if n_head_kv is None:
        n_head_kv = n_head
    layers_70b = _TYPE_70B_LAYERS.get(arch)
    is_70b = layers_70b is not None and n_layer == layers_70b
    if arch == "llama":  # an 80-layer llama without grouped-query attention is LLaMA-1 65B
        is_70b = is_70b and n_head is not None and n_head != n_head_kv
    return _Model(arch, n_layer, max(n_expert, 0), is_70b)


def tensor_nbytes(t: GGMLQuantizationType, shape: Sequence[int]) -> int:
    """Bytes of a tensor of numpy-order ``shape`` in type ``t`` (rows must be whole blocks)."""
    block, size = GGML_QUANT_SIZES[t]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // block) * size


def plan_quantization(tensors: Sequence[TensorSource], target: str, *, arch: str,
                      metadata: Mapping[str, Any], options: QuantOptions | None = None,
                      powerinfer: bool = False) -> QuantPlan:
    """Choose every tensor's output type exactly as ``llama_model_quantize`` would.

    Args:
        tensors: the input tensors (any order): objects with ``name``, ``ggml_type`` and numpy-order ``shape``
            (a reader's ``TensorInfo``, a writer's ``TensorSpec``).
        target: a ``--type`` name (:data:`TYPE_CHOICES`, case-insensitive).
        arch: ``general.architecture`` (``falcon`` and 80-layer ``llama`` have special rules).
        metadata: the model's KV pairs (plain values or typed values with ``.value``); reads
            ``<arch>.block_count``, ``<arch>.expert_count`` and the head counts.
        options: see :class:`QuantOptions`.
        powerinfer: a PowerInfer (PWRI) file: PowerInfer's ``quantize`` rules instead (plan_powerinfer.py).

    Returns:
        The plan, entries in llama-quantize's output order (layer, then name).

    Raises:
        UsageError: unknown target.
        QuantizationError: a quantized input without ``allow_requantize``, a fallback with ``no_fallback``,
            an imatrix entry of the wrong size, a layer that cannot be determined.
        MetadataKeyNotFoundError: the mixture rules need ``<arch>.block_count`` and it is missing.
    """
    if powerinfer:  # PWRI files: PowerInfer's own quantize rules (see plan_powerinfer), tensors in file order
        from ggufkit.quant.plan_powerinfer import plan_powerinfer

        return plan_powerinfer(tensors, target, arch=arch, metadata=metadata, options=options)
    opts = options or QuantOptions()
    preset = get_preset(target)
    model = _model_info(arch, metadata)
    ordered = sorted(tensors, key=lambda t: llama_order_key(t.name))
    counters = _Counters()
    for t in ordered:
        cat = tensor_category(t.name)
        if cat in _ATTN_V_LIKE:
            counters.n_attention_wv += 1
        if cat == _OUTPUT:
            counters.has_tied_embeddings = False
    has_imatrix = bool(opts.imatrix_sizes)
    entries = [_plan_one(t, preset, model, counters, opts, has_imatrix) for t in ordered]
    plan = QuantPlan(preset.name, preset.file_type, preset.default_type, tuple(entries), opts)
    if opts.no_fallback and plan.fallbacks:
        first = plan.fallbacks[0]
        raise QuantizationError(f"{first.reason}; --no-fallback forbids it ({len(plan.fallbacks)} of "
                                f"{len(entries)} tensors, {plan.fallback_share:.1%} of weights, need a fallback)",
                                tensor=first.name)
    return plan


def _plan_one(t: TensorSource, preset: Preset, model: _Model, c: _Counters, opts: QuantOptions,
              has_imatrix: bool) -> PlanEntry:
    name, shape, src = t.name, tuple(int(d) for d in t.shape), t.ggml_type
    ne0 = shape[-1] if shape else 1
    cat = tensor_category(name)
    fallback = False
    keep = _not_quantizable_reason(name, len(shape), opts.leave_output_tensor)
    if keep is not None:
        dst, reason = src, keep
    elif opts.token_embedding_type is not None and cat == _TOKEN_EMBD and not (
            name == "per_layer_token_embd.weight" and _match_override(name, opts) is not None):
        dst, reason = opts.token_embedding_type, "user override --token-embedding-type"
    elif opts.output_tensor_type is not None and cat == _OUTPUT:
        dst, reason = opts.output_tensor_type, "user override --output-tensor-type"
    elif not preset.is_quantized:
        dst, reason = preset.default_type, "preset default"
    else:
        override = _match_override(name, opts)
        if override is not None:
            dst, reason = override[1], f"user override --tensor-type {override[0]}={_tname(override[1])}"
        elif opts.pure:
            dst, reason = preset.default_type, "--pure: preset default"
        else:
            dst, reason = _mixture(preset, name, ne0, cat, model, c, opts, has_imatrix)
        fb = _fallback(name, ne0, dst)
        if fb is not None:
            dst, reason = fb
            fallback = True
    if reason == "preset default" or reason.endswith(": preset default"):
        reason = f"{reason} -> {_tname(dst)}"
    if src != dst and src not in FLOAT_TYPES:
        if GGML_QUANT_SIZES[src][0] == 1:  # I8..I64, F64: llama_tensor_dequantize_impl refuses them too
            raise QuantizationError(f"cannot convert a {src.name} tensor to {dst.name}", tensor=name)
        if not opts.allow_requantize:
            raise QuantizationError(f"already quantized as {src.name}; pass --allow-requantize to dequantize it "
                                    f"and quantize it again as {dst.name}", tensor=name)
        if src not in WRITABLE_TYPES.values():
            raise QuantizationError(f"cannot requantize from {src.name}: ggufkit has no dequantizer for it",
                                    tensor=name)
    imatrix = _imatrix_status(name, shape, src, dst, cat, opts)
    return PlanEntry(name, shape, src, dst, reason, tensor_nbytes(dst, shape), tensor_nbytes(src, shape),
                     fallback, imatrix)


def _match_override(name: str, opts: QuantOptions) -> tuple[str, GGMLQuantizationType] | None:
    for pattern, qtype in opts.tensor_types:
        if re.search(pattern, name):
            return pattern, qtype
    return None


def _imatrix_status(name: str, shape: tuple[int, ...], src: GGMLQuantizationType, dst: GGMLQuantizationType,
                    cat: str, opts: QuantOptions) -> str | None:
    if opts.imatrix_sizes is None or src == dst:
        return None
    size = opts.imatrix_sizes.get(name)
    if size is None:
        return "missing"
    # llama-quantize uses an entry only when it has ne0 * ne2 values (one row per expert).
    expected = shape[-1] * (shape[-3] if len(shape) >= 3 else 1)
    if size != expected:
        if cat == _TOKEN_EMBD:
            return "ignored (size mismatch)"
        raise QuantizationError(f"imatrix entry has {size} values, the tensor needs {expected} "
                                f"(row length x experts); was the imatrix computed for another model?", tensor=name)
    return "used"
