"""llama-quantize's per-tensor type choice, as data plus one pure function.

:func:`plan_quantization` reproduces ``llama_model_quantize`` (``src/llama-quant.cpp`` of the llama.cpp tree
vendored in llama-cpp-python 0.3.36) for every ``--type`` of llama-quantize: the output tensor order (by
layer and name, or the input's shard order with ``keep_split``), layer pruning and renaming, every tensor's
target type (``llama_tensor_get_type``: ``--pure``, ``--tensor-type`` overrides, the mixture rules of
:mod:`ggufkit.quant.llama_quantize.mixture`, the divisibility fallback), the importance-matrix rules and
``general.file_type``. Each entry says *why* it got its type, so a "Q4_K_M" file that is mostly Q5_0 is
never a surprise. The plan needs no kernel: types without one on this build can be planned (dry run),
and :meth:`QuantPlan.missing_kernels` says which of them a real run would need.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggufkit.errors import QuantizationError
from ggufkit.format.tensor_shape import n_elements
from ggufkit.quant.llama_quantize.mixture import (
    ATTN_K,
    ATTN_KV_B,
    ATTN_OUTPUT,
    ATTN_Q,
    ATTN_QKV,
    ATTN_V,
    ATTN_V_LIKE,
    FFN_DOWN,
    FFN_GATE,
    FFN_UP,
    OTHER,
    OUTPUT,
    TOKEN_EMBD,
    Counters,
    Model,
    fallback_type,
    layer_of,
    mixture_type,
)
from ggufkit.quant.llama_quantize.options import parse_prune_layers
from ggufkit.quant.llama_quantize.presets import ALIASES, PRESETS, Preset, PresetChoice, get_preset
from ggufkit.quant.registry import FLOAT_TYPES, TYPES

QT = GGMLQuantizationType

__all__ = ["NO_QUANTIZER_WITHOUT_IMATRIX", "QUANTIZATION_VERSION", "PlanEntry", "QuantOptions", "QuantPlan",
           "TensorSource", "llama_order_key", "model_info", "plan_quantization", "refuse_missing_imatrix",
           "tensor_category", "tensor_nbytes"]

#: ggml.c ``ggml_quantize_requires_imatrix``: ggml has no quantizer for these without importance weights and
#: ``ggml_quantize_chunk`` aborts (GGML_ASSERT) on any tensor, token_embd and output included, that gets none.
NO_QUANTIZER_WITHOUT_IMATRIX: frozenset[GGMLQuantizationType] = frozenset({QT.IQ2_XXS, QT.IQ2_XS, QT.IQ1_S})

#: llama.cpp's GGML_QNT_VERSION, written as ``general.quantization_version``.
QUANTIZATION_VERSION = 2


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
        imatrix_sizes: name -> number of values of each imatrix entry, or None without an imatrix (or
            when ``--include-weights``/``--exclude-weights`` left no entry).
        prune_layers: layers to drop (``--prune-layers``); later layers are renumbered and
            ``<arch>.block_count`` becomes the new count.
        keep_split: keep the input's shard layout and tensor order (``--keep-split``).
        only_copy: ``COPY``: every tensor is copied as is.
        dry_run: only planning; a tensor that needs a missing importance matrix is reported, not refused.
    """

    pure: bool = False
    tensor_types: tuple[tuple[str, GGMLQuantizationType], ...] = ()
    output_tensor_type: GGMLQuantizationType | None = None
    token_embedding_type: GGMLQuantizationType | None = None
    leave_output_tensor: bool = False
    allow_requantize: bool = False
    no_fallback: bool = False
    imatrix_sizes: Mapping[str, int] | None = None
    prune_layers: tuple[int, ...] = ()
    keep_split: bool = False
    only_copy: bool = False
    dry_run: bool = False


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
        src_name: the name in the input (differs from ``name`` when ``--prune-layers`` renumbers layers).
        shard: the input shard holding the tensor (the output shard under ``--keep-split``).
        requires_imatrix: llama-quantize refuses to write this tensor without imatrix data
            (``tensor_requires_imatrix``).
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
    src_name: str = ""
    shard: int = 0
    requires_imatrix: bool = False

    @property
    def n_elements(self) -> int:
        return n_elements(self.shape)

    @property
    def action(self) -> str:
        """``copy`` (same type), ``convert`` (from a float type) or ``requantize`` (from a quantized type)."""
        if self.src_type == self.dst_type:
            return "copy"
        return "convert" if self.src_type in FLOAT_TYPES else "requantize"

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / self.n_elements if self.n_elements else 0.0

    @property
    def aborts_without_imatrix(self) -> bool:
        """llama-quantize cannot write this tensor without its imatrix data: ``tensor_requires_imatrix``
        (llama-quant.cpp) or, for the token embeddings and output that check exempts, ggml's own assertion
        (``ggml_quantize_chunk``) for :data:`NO_QUANTIZER_WITHOUT_IMATRIX`."""
        return self.requires_imatrix or (self.action != "copy" and self.dst_type in NO_QUANTIZER_WITHOUT_IMATRIX)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "src_type": self.src_type.name,
                "dst_type": self.dst_type.name, "action": self.action, "reason": self.reason,
                "bytes": self.nbytes, "src_bytes": self.src_nbytes,
                "bits_per_weight": round(self.bits_per_weight, 4), "fallback": self.fallback,
                "imatrix": self.imatrix, "requires_imatrix": self.requires_imatrix}


@dataclass(frozen=True)
class QuantPlan:
    """The whole plan: entries in output order, the file type and totals.

    Attributes:
        target: canonical preset name (``q4_k_m``).
        file_type: value written as ``general.file_type``.
        default_type: the preset's default tensor type.
        entries: one per tensor, in llama-quantize's output order.
        options: the options the plan was made with.
        block_count: the new ``<arch>.block_count`` after ``--prune-layers``, else None.
    """

    target: str
    file_type: LlamaFileType | int
    default_type: GGMLQuantizationType
    entries: tuple[PlanEntry, ...]
    options: QuantOptions = field(default_factory=QuantOptions)
    block_count: int | None = None

    def imatrix_required(self) -> tuple[PlanEntry, ...]:
        """Tensors llama-quantize would refuse ("this quantization requires an importance matrix", or
        "Missing importance matrix for tensor ... in a very low-bit quantization"): they need imatrix data,
        are converted, and have no usable entry."""
        have = self.options.imatrix_sizes is not None
        return tuple(e for e in self.entries if (e.requires_imatrix and (
            (not have) or (e.action != "copy" and e.imatrix != "used"))) or (
            e.aborts_without_imatrix and not e.requires_imatrix and e.imatrix != "used"))

    def missing_kernels(self) -> tuple[GGMLQuantizationType, ...]:
        """Output types a real run needs that have no kernel on this build (planning works without one)."""
        return tuple(sorted({e.dst_type for e in self.entries if e.action != "copy" and e.dst_type not in TYPES},
                            key=int))

    def cpu_only_types(self) -> tuple[GGMLQuantizationType, ...]:
        """Output types that have kernels but no CUDA kernel: they run on the CPU under ``--device cuda``."""
        return tuple(sorted({e.dst_type for e in self.entries if e.action != "copy" and e.dst_type in TYPES
                             and not TYPES[e.dst_type].is_float and not TYPES[e.dst_type].has_cuda}, key=int))

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
        ft = self.file_type
        return {"target": self.target, "file_type": int(ft),
                "file_type_name": ft.name if isinstance(ft, LlamaFileType) else str(int(ft)),
                "block_count": self.block_count,
                "imatrix_required": [e.name for e in self.imatrix_required()],
                "missing_kernels": [t.name for t in self.missing_kernels()],
                "cpu_only_types": [t.name for t in self.cpu_only_types()],
                "default_type": self.default_type.name, "tensors": [e.to_dict() for e in self.entries],
                "totals": {"tensors": len(self.entries), "parameters": self.n_elements, "bytes": self.nbytes,
                           "src_bytes": self.src_nbytes, "bits_per_weight": round(self.bits_per_weight, 4),
                           "fallbacks": len(self.fallbacks), "fallback_share": round(self.fallback_share, 6),
                           "types": self.type_counts()}}


# --- tensor order (llama_model_loader::weight_name_comparer) -------------------------------------------
def llama_order_key(name: str) -> tuple[int, bytes]:
    """Sort key of llama-quantize's output order: layer from ``blk.N.`` (-1 for others), then name bytes."""
    layer = layer_of(name)
    return (-1 if layer is None else layer, name.encode("utf-8"))


# --- categories (tensor_get_category) -----------------------------------------------------------------
# Checked in this order; the first substring found decides (attn_qkv before attn_v, ffn_up before ffn_down).
_CATEGORY_SUBSTRINGS = (
    ("attn_qkv.weight", ATTN_QKV), ("attn_kv_b.weight", ATTN_KV_B), ("attn_v.weight", ATTN_V),
    ("attn_k.weight", ATTN_K), ("attn_q.weight", ATTN_Q), ("attn_output.weight", ATTN_OUTPUT),
    ("ffn_up", FFN_UP), ("ffn_gate", FFN_GATE), ("ffn_down", FFN_DOWN),
)
_TOKEN_EMBD_NAMES = frozenset({"token_embd.weight", "per_layer_token_embd.weight"})


def tensor_category(name: str) -> str:
    """The broad category llama-quantize's mixture rules key on (``attn_v``, ``ffn_down``, ``output``...)."""
    if name == "output.weight":
        return OUTPUT
    if name in _TOKEN_EMBD_NAMES:
        return TOKEN_EMBD
    for sub, cat in _CATEGORY_SUBSTRINGS:
        if sub in name:
            return cat
    return OTHER


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
#: Extra tensors glm5-next keeps as they are.
_GLM5_NEXT_KEPT = ("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
                   "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight",
                   "ssm_g_b.weight", "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight",
                   "attn_v_b.weight")
# POS_EMBD and TOKEN_TYPES are compared by exact name (LLM_TN gives the same string for every arch).
_NEVER_QUANTIZED_NAMES = frozenset({"position_embd.weight", "token_types.weight"})


def _not_quantizable_reason(name: str, n_dims: int, arch: str, opts: QuantOptions) -> str | None:
    if opts.only_copy:
        return "COPY: kept as is"
    if n_dims < 2:
        return f"{n_dims}-D tensor: kept as is"
    # C++: name.rfind("weight") == name.size() - 6, which is also true for a 5-byte name without "weight"
    # (npos == size_t(-1)); mirrored so odd names are treated exactly as llama-quantize treats them.
    raw = name.encode("utf-8")
    if not (raw.endswith(b"weight") or len(raw) == 5):
        return "name does not end in 'weight': kept as is"
    if opts.leave_output_tensor and name == "output.weight":
        return "--leave-output-tensor: kept as is"
    if name in _NEVER_QUANTIZED_NAMES:
        return "positional/token-type embedding: kept as is"
    for sub in _NEVER_QUANTIZED_SUBSTRINGS + (_GLM5_NEXT_KEPT if arch == "glm5-next" else ()):
        if sub in name:
            return f"'{sub}' tensors are never quantized: kept as is"
    return None


def _tname(t: GGMLQuantizationType) -> str:
    return t.name.lower()


def _meta_int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    value = getattr(value, "value", value)
    if isinstance(value, (list, tuple)) or hasattr(value, "shape"):  # per-layer arrays: layer 0
        try:
            value = value[0]
        except (IndexError, TypeError):
            return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


#: Architectures whose load_hparams sets LLM_TYPE_70B, by layer count (src/models/<arch>.cpp); the attn_v
#: rule upgrades Q3_K/Q4_K to Q5_K for them.
_TYPE_70B_LAYERS: dict[str, int] = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}


def model_info(arch: str, metadata: Mapping[str, Any]) -> Model:
    """The hparams the mixture rules read, from the model's KV pairs (as ``llama_model::load_hparams``)."""
    n_layer = _meta_int(metadata, f"{arch}.block_count")
    n_expert = max(_meta_int(metadata, f"{arch}.expert_count") or 0, 0)
    n_head = _meta_int(metadata, f"{arch}.attention.head_count") or 0
    n_head_kv = _meta_int(metadata, f"{arch}.attention.head_count_kv")
    if n_head_kv is None:
        n_head_kv = n_head
    layers_70b = _TYPE_70B_LAYERS.get(arch)
    is_70b = layers_70b is not None and n_layer == layers_70b
    if arch == "llama":  # an 80-layer llama without grouped-query attention is LLaMA-1 65B; 8 experts: no size
        is_70b = is_70b and n_head != n_head_kv and n_expert != 8
    return Model(arch, n_layer, n_expert, n_head // n_head_kv if n_head_kv else 0, is_70b)


def tensor_nbytes(t: GGMLQuantizationType, shape: Sequence[int]) -> int:
    """Bytes of a tensor of numpy-order ``shape`` in type ``t`` (rows must be whole blocks)."""
    block, size = GGML_QUANT_SIZES[t]
    return n_elements(shape[:-1]) * (shape[-1] // block) * size


_BLK_RE = re.compile(r"blk\.(\d+)\.")


def _prune_names(names: Sequence[str], prune: Sequence[int]) -> tuple[dict[str, str], int]:
    """remap_layer: input name -> output name ("" when pruned), visiting names in llama-quantize's order,
    and the new block count (``blk_id`` after the last layer)."""
    mapped: dict[int, str] = {}
    next_id = 0
    out: dict[str, str] = {}
    for name in names:
        m = _BLK_RE.search(name) if prune else None
        if m is None:
            out[name] = name
            continue
        blk = int(m.group(1))
        if blk not in mapped:
            if blk in prune:
                mapped[blk] = ""
            elif blk < prune[0]:
                mapped[blk], next_id = str(blk), blk + 1
            else:
                mapped[blk], next_id = str(next_id), next_id + 1
        out[name] = mapped[blk] and name[:m.start(1)] + mapped[blk] + name[m.end(1):]
    return out, next_id


def plan_quantization(tensors: Sequence[TensorSource], target: str | PresetChoice, *, arch: str,
                      metadata: Mapping[str, Any], options: QuantOptions | None = None) -> QuantPlan:
    """Choose every tensor's output type exactly as ``llama_model_quantize`` would.

    Args:
        tensors: the input tensors (any order): objects with ``name``, ``ggml_type`` and numpy-order ``shape``
            (a reader's ``TensorInfo``, a writer's ``TensorSpec``); ``shard``/``offset`` when present order
            the output under ``keep_split``.
        target: a ``--type`` value (``TYPE_CHOICES`` of :mod:`~ggufkit.quant.llama_quantize.presets` or a
            numeric file type, case-insensitive), or one already parsed (:class:`PresetChoice`).
        arch: ``general.architecture`` (``falcon`` and 80-layer ``llama`` have special rules).
        metadata: the model's KV pairs (plain values or typed values with ``.value``, ``--override-kv``
            already applied); reads ``<arch>.block_count``, ``<arch>.expert_count`` and the head counts.
        options: see :class:`QuantOptions`.

    Returns:
        The plan, entries in llama-quantize's output order.

    Raises:
        UsageError: unknown target; a pruned layer out of range.
        QuantizationError: a quantized input without ``allow_requantize``, a fallback with ``no_fallback``,
            an imatrix entry of the wrong size, a layer that cannot be determined, a tensor that needs an
            importance matrix and has none (unless ``dry_run``: then it is listed in
            :meth:`QuantPlan.imatrix_required`).
        MetadataKeyNotFoundError: the mixture rules need ``<arch>.block_count`` and it is missing.
    """
    opts = options or QuantOptions()
    preset = get_preset(target)
    if preset.only_copy:
        opts = QuantOptions(**{**opts.__dict__, "only_copy": True})
    model = model_info(arch, metadata)
    prune = parse_prune_layers(opts.prune_layers, model.n_layer) if opts.prune_layers else ()
    ordered = sorted(tensors, key=lambda t: llama_order_key(t.name))
    renamed, n_layer_out = _prune_names([t.name for t in ordered], prune)
    kept = [t for t in ordered if renamed[t.name]]
    if opts.keep_split:  # sorted by (shard, offset): the input's own order
        kept.sort(key=lambda t: (getattr(t, "shard", 0), getattr(t, "offset", 0)))
    counters = Counters()
    for t in kept:
        cat = tensor_category(renamed[t.name])
        if cat in ATTN_V_LIKE:
            counters.n_attention_wv += 1
        if cat == OUTPUT:
            counters.has_tied_embeddings = False
    has_imatrix = bool(opts.imatrix_sizes)
    entries = [_plan_one(t, renamed[t.name], preset, model, counters, opts, has_imatrix) for t in kept]
    file_type = preset.file_type if not preset.only_copy else _input_file_type(metadata, kept)
    plan = QuantPlan(preset.name, file_type, preset.default_type, tuple(entries), opts,
                     n_layer_out if prune else None)
    if opts.no_fallback and plan.fallbacks:
        first = plan.fallbacks[0]
        raise QuantizationError(f"{first.reason}; --no-fallback forbids it ({len(plan.fallbacks)} of "
                                f"{len(entries)} tensors, {plan.fallback_share:.1%} of weights, need a fallback)",
                                tensor=first.name)
    if not opts.dry_run:
        refuse_missing_imatrix(plan)
    return plan


def refuse_missing_imatrix(plan: QuantPlan) -> None:
    """Raise for the first tensor that needs an importance matrix and has none, as llama-quantize stops
    ("Missing importance matrix for tensor ... in a very low-bit quantization", llama-quant.cpp).

    Without any imatrix llama-quantize stops at its check of every tensor before writing, so a tensor of
    ``tensor_requires_imatrix`` is named first; with one it stops at the first tensor written without data,
    which may be the token embeddings or output that ggml itself cannot quantize without one.

    Raises:
        QuantizationError: naming the tensor and its type.
    """
    need = plan.imatrix_required()
    if not need:
        return
    if plan.options.imatrix_sizes is None:
        need = tuple(sorted(need, key=lambda e: not e.requires_imatrix))
    e = need[0]
    if e.requires_imatrix:
        raise QuantizationError(f"missing importance matrix for {e.dst_type.name} (a very low-bit type): "
                                "pass --imatrix with an entry for this tensor", tensor=e.name)
    cat = tensor_category(e.name)
    which = {TOKEN_EMBD: "--token-embedding-type", OUTPUT: "--output-tensor-type"}.get(cat, "--tensor-type")
    has = {"missing": "the imatrix has no entry for it", None: "no --imatrix is given"}.get(
        e.imatrix, "its imatrix entry has the wrong size")
    if cat == TOKEN_EMBD and e.imatrix == "missing":
        has += " (llama-imatrix never collects the token embeddings)"
    raise QuantizationError(f"missing importance matrix for {e.dst_type.name}: ggml has no {e.dst_type.name} "
                            f"quantizer without one and llama-quantize aborts here; {has}; "
                            f"choose another type for this tensor with {which}"
                            + (" or drop --pure" if plan.options.pure else ""), tensor=e.name)


def _input_file_type(metadata: Mapping[str, Any], tensors: Sequence[TensorSource]) -> LlamaFileType | int:
    """COPY writes the input's file type: ``general.file_type``, else the loader's guess from the most common
    tensor type, marked ``LLAMA_FTYPE_GUESSED`` (llama_model_loader)."""
    ft = _meta_int(metadata, "general.file_type")
    if ft is not None:
        try:
            return LlamaFileType(ft)
        except ValueError:
            return ft
    counts: dict[GGMLQuantizationType, int] = {}
    best, n_best = QT.F32, 0
    for t in tensors:
        counts[t.ggml_type] = counts.get(t.ggml_type, 0) + 1
        if counts[t.ggml_type] > n_best:
            best, n_best = t.ggml_type, counts[t.ggml_type]
    guess = next((p.file_type for p in PRESETS.values() if p.default_type == best and p.name not in ALIASES),
                 LlamaFileType.ALL_F32)
    return int(guess) | int(LlamaFileType.GUESSED)


def _plan_one(t: TensorSource, name: str, preset: Preset, model: Model, c: Counters, opts: QuantOptions,
              has_imatrix: bool) -> PlanEntry:
    shape, src = tuple(int(d) for d in t.shape), t.ggml_type
    # llama-quantize counts dimensions with ggml_n_dims (trailing ne of 1 dropped) and writes them so
    # (gguf_add_tensor): qwen2moe's ffn_gate_inp_shexp, stored [1, n_embd], is a vector it keeps as is.
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    ne0 = shape[-1] if shape else 1
    cat = tensor_category(name)
    fallback = False
    keep = _not_quantizable_reason(name, len(shape), model.arch, opts)
    if keep is not None:
        dst, reason = src, keep
    elif opts.token_embedding_type is not None and cat == TOKEN_EMBD and not (
            name == "per_layer_token_embd.weight" and _match_override(name, opts) is not None):
        dst, reason = opts.token_embedding_type, "user override --token-embedding-type"
    elif opts.output_tensor_type is not None and cat == OUTPUT:
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
            dst, reason = mixture_type(preset.file_type, preset.default_type, name, shape, cat, model, c,
                                       has_imatrix=has_imatrix, output_tensor_type=opts.output_tensor_type)
        fb = fallback_type(name, ne0, dst)
        if fb is not None:
            dst, reason = fb
            fallback = True
    if reason == "preset default" or reason.endswith(": preset default"):
        reason = f"{reason} -> {_tname(dst)}"
    if src != dst and src not in FLOAT_TYPES:
        if GGML_QUANT_SIZES[src][0] == 1:  # I8..I64, F64: llama_tensor_dequantize_impl refuses them too
            raise QuantizationError(f"cannot convert a {src.name} tensor to {dst.name}", tensor=name)
        refuse_requantize(src, dst, name, opts)
    # tensor_requires_imatrix: never the token embeddings or output.
    requires = keep is None and name not in _TOKEN_EMBD_NAMES and name != "output.weight" and (
        preset.requires_imatrix(dst))
    imatrix = _imatrix_status(t.name, name, shape, src, dst, cat, opts)
    return PlanEntry(name, shape, src, dst, reason, tensor_nbytes(dst, shape), tensor_nbytes(src, shape),
                     fallback, imatrix, src_name=t.name, shard=int(getattr(t, "shard", 0)),
                     requires_imatrix=requires)


def refuse_requantize(src: GGMLQuantizationType, dst: GGMLQuantizationType, name: str, opts: QuantOptions) -> None:
    """A quantized input tensor becomes ``dst`` only with ``allow_requantize`` (llama-quant.cpp
    ``llama_model_quantize_impl``: "requantizing from type ... is disabled") and a dequantizer for ``src``.

    Raises:
        QuantizationError: naming the tensor.
    """
    if not opts.allow_requantize:
        raise QuantizationError(f"already quantized as {src.name}; pass --allow-requantize to dequantize it "
                                f"and quantize it again as {dst.name}", tensor=name)
    if src not in TYPES:
        raise QuantizationError(f"cannot requantize from {src.name}: ggufkit has no dequantizer for it",
                                tensor=name)


def _match_override(name: str, opts: QuantOptions) -> tuple[str, GGMLQuantizationType] | None:
    for pattern, qtype in opts.tensor_types:
        if re.search(pattern, name):
            return pattern, qtype
    return None


def _imatrix_status(src_name: str, name: str, shape: tuple[int, ...], src: GGMLQuantizationType,
                    dst: GGMLQuantizationType, cat: str, opts: QuantOptions) -> str | None:
    if opts.imatrix_sizes is None or src == dst:
        return None
    size = opts.imatrix_sizes.get(src_name)  # remap_imatrix: entries keep the input's layer numbers
    if size is None:
        return "missing"
    # llama-quantize uses an entry only when it has ne0 * ne2 values (one row per expert).
    expected = shape[-1] * (shape[-3] if len(shape) >= 3 else 1)
    if size != expected:
        if cat == TOKEN_EMBD:
            return "ignored (size mismatch)"
        raise QuantizationError(f"imatrix entry has {size} values, the tensor needs {expected} "
                                f"(row length x experts); was the imatrix computed for another model?", tensor=name)
    return "used"
