"""llama-quantize's mixture rules (``llama_tensor_get_type_impl``, src/llama-quant.cpp) as rows of data.

Each table below is one ``else if`` chain of the C function: a list of :class:`Rule` rows tried in order,
the first row whose presets contain the file type and whose condition holds gives the type; no row
means the tensor keeps the preset's default type. :func:`mixture_type` walks the chains in the C's order
(glm5-next guard, output / tied embeddings, MXFP4_MOE, token embeddings, the IQ1/IQ2 family, then one
chain per tensor category) and keeps llama-quantize's counters (``i_attention_wv``, ``i_ffn_down``...)
exactly where the C increments them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggufkit.errors import MetadataKeyNotFoundError, QuantizationError

QT = GGMLQuantizationType
F = LlamaFileType

# tensor categories (tensor_get_category)
OUTPUT, TOKEN_EMBD = "output", "token_embd"
ATTN_QKV, ATTN_KV_B, ATTN_V, ATTN_K, ATTN_Q = "attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q"
ATTN_OUTPUT, FFN_UP, FFN_GATE, FFN_DOWN, OTHER = "attn_output", "ffn_up", "ffn_gate", "ffn_down", "other"
ATTN_V_LIKE = frozenset({ATTN_V, ATTN_QKV, ATTN_KV_B})  # category_is_attn_v


@dataclass
class Model:
    """The hparams the rules read (``llama_model`` after ``load_hparams``).

    Attributes:
        arch: ``general.architecture``.
        n_layer: ``<arch>.block_count`` (``n_layer_all``), None when missing.
        n_expert: ``<arch>.expert_count`` (0 without experts).
        n_gqa: ``n_head / n_head_kv`` of layer 0 (0 when ``n_head_kv`` is 0), ``llama_hparams::n_gqa``.
        is_70b: ``model.type == LLM_TYPE_70B``.
    """

    arch: str
    n_layer: int | None
    n_expert: int
    n_gqa: int
    is_70b: bool


@dataclass
class Counters:
    """``quantize_state_impl``'s counters, in tensor order."""

    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    has_tied_embeddings: bool = True


@dataclass(frozen=True)
class Ctx:
    """One tensor as a rule sees it."""

    ftype: LlamaFileType
    default: GGMLQuantizationType
    model: Model
    has_imatrix: bool
    ne0: int
    ne2: int
    cat: str
    i: int = 0  # layer (ffn_*), attention-v index (attn_v-like) or ffn_down counter (IQ1/IQ2 family)
    n: int = 0  # layer count or attention-v count

    @property
    def falcon(self) -> bool:
        return self.model.arch == "falcon"

    @property
    def moe8(self) -> bool:
        return self.model.n_expert == 8


def use_more_bits(i: int, n: int) -> bool:
    """``use_more_bits`` of llama_tensor_get_type_impl, with C's truncating ``/`` and ``%``."""
    q = n // 8
    d = i - q
    rem = abs(d) % 3 * (1 if d >= 0 else -1)
    return i < q or i >= 7 * n // 8 or rem == 2


@dataclass(frozen=True)
class Cond:
    """A rule condition: a description (``str.format`` over the :class:`Ctx` and its block size) and a test."""

    desc: str
    test: Callable[[Ctx], bool]


ANY = Cond("", lambda c: True)
GQA4 = Cond("n_gqa >= 4", lambda c: c.model.n_gqa >= 4)
NO_IMATRIX = Cond("without imatrix", lambda c: not c.has_imatrix)
WITH_IMATRIX_FIRST_EIGHTH = Cond("layer {i} < n_layer/8 with imatrix", lambda c: c.has_imatrix and c.i < c.n // 8)
FIRST_EIGHTH = Cond("layer {i} < n_layer/8", lambda c: c.i < c.n // 8)
FIRST_SIXTEENTH = Cond("layer {i} < n_layer/16", lambda c: c.i < c.n // 16)
MORE_BITS = Cond("use_more_bits layer", lambda c: use_more_bits(c.i, c.n))
FALCON = Cond("falcon", lambda c: c.falcon)


@dataclass(frozen=True)
class Rule:
    """One branch: presets (file types; empty = any), condition, resulting type."""

    ftypes: frozenset[LlamaFileType]
    cond: Cond
    then: GGMLQuantizationType


def _r(ftypes: LlamaFileType | tuple[LlamaFileType, ...], cond: Cond, then: GGMLQuantizationType) -> Rule:
    return Rule(frozenset(ftypes if isinstance(ftypes, tuple) else (ftypes,)), cond, then)


_IQ1_IQ2 = (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M)
_IQ2_S_M = (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)

#: output.weight, and token_embd.weight when tied to it (no --output-tensor-type).
OUTPUT_RULES = (
    _r(F.MOSTLY_MXFP4_MOE, ANY, QT.Q8_0),
    Rule(frozenset(), FALCON, QT.Q8_0),
    Rule(frozenset(), Cond("row length {ne0} not a multiple of {block}",
                           lambda c: c.ne0 % GGML_QUANT_SIZES[c.default][0] != 0), QT.Q8_0),
    _r((F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M,
        F.MOSTLY_IQ1_M), ANY, QT.Q5_K),
    Rule(frozenset(), Cond("", lambda c: c.default != QT.Q8_0), QT.Q6_K),
)
#: MXFP4_MOE: expert tensors (ne[2] > 1; in bailingmoe3 only the ffn experts) MXFP4, the rest Q8_0.
MXFP4_RULES = (
    Rule(frozenset(), Cond("expert tensor", lambda c: c.ne2 > 1 and (
        c.model.arch != "bailingmoe3" or c.cat in (FFN_UP, FFN_GATE, FFN_DOWN))), QT.MXFP4),
    Rule(frozenset(), Cond("non-expert tensor", lambda c: True), QT.Q8_0),
)
TOKEN_EMBD_RULES = (
    _r((F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M), ANY, QT.Q2_K),
    _r(_IQ2_S_M, ANY, QT.IQ3_S),
    _r(F.MOSTLY_IQ3_XXS, ANY, QT.IQ3_S),
    _r((F.MOSTLY_TQ1_0, F.MOSTLY_TQ2_0), ANY, QT.Q4_K),
)
#: The IQ1/IQ2 family has its own chains, keyed by category.
IQ1_IQ2_RULES: dict[str, tuple[Rule, ...]] = {
    ATTN_V: (
        _r(_IQ1_IQ2, Cond("n_gqa >= 4 or n_expert >= 4",
                          lambda c: c.model.n_gqa >= 4 or c.model.n_expert >= 4), QT.Q4_K),
        _r(_IQ2_S_M, ANY, QT.IQ3_S),
        _r(_IQ1_IQ2, ANY, QT.Q2_K),
    ),
    ATTN_K: (_r(_IQ1_IQ2, Cond("8 experts", lambda c: c.moe8), QT.Q4_K),),
    # the counter i_ffn_down, not the layer, against n_layer/8
    FFN_DOWN: (
        _r(_IQ2_S_M, Cond("#{i} < n_layer/8", lambda c: c.i < c.n // 8), QT.IQ3_S),
        _r(_IQ1_IQ2, Cond("#{i} < n_layer/8", lambda c: c.i < c.n // 8), QT.Q2_K),
    ),
    ATTN_OUTPUT: (
        _r(_IQ1_IQ2, Cond("8 experts", lambda c: c.moe8), QT.Q5_K),
        _r((F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M), ANY, QT.IQ2_XXS),
        _r(_IQ2_S_M, ANY, QT.IQ3_S),
    ),
}
#: attn_v, attn_qkv, attn_kv_b (then the 70B and 8-expert bumps below).
ATTN_V_RULES = (
    _r(F.MOSTLY_Q2_K, GQA4, QT.Q4_K), _r(F.MOSTLY_Q2_K, ANY, QT.Q3_K),
    _r(F.MOSTLY_Q2_K_S, GQA4, QT.Q4_K),
    _r(F.MOSTLY_IQ3_XXS, GQA4, QT.Q4_K), _r(F.MOSTLY_IQ3_XXS, NO_IMATRIX, QT.IQ3_S),
    _r(F.MOSTLY_IQ3_XXS, ANY, QT.IQ3_XXS),
    _r((F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S), GQA4, QT.Q4_K),
    _r(F.MOSTLY_IQ3_M, ANY, QT.Q4_K),
    _r(F.MOSTLY_Q3_K_M, Cond("#{i} < 2", lambda c: c.i < 2), QT.Q5_K), _r(F.MOSTLY_Q3_K_M, ANY, QT.Q4_K),
    _r(F.MOSTLY_Q3_K_L, ANY, QT.Q5_K),
    _r((F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS), GQA4, QT.Q5_K),
    _r((F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M), MORE_BITS, QT.Q6_K),
    _r(F.MOSTLY_Q4_K_S, Cond("#{i} < 4", lambda c: c.i < 4), QT.Q5_K),
)
ATTN_K_RULES = (
    Rule(frozenset(), Cond("8 experts", lambda c: c.moe8), QT.Q8_0),
    _r(F.MOSTLY_IQ3_XS, ANY, QT.IQ3_XXS),
    _r(F.MOSTLY_IQ3_XXS, ANY, QT.IQ2_S),
)
ATTN_Q_RULES = (
    _r(F.MOSTLY_IQ3_XS, ANY, QT.IQ3_XXS),
    _r(F.MOSTLY_IQ3_XXS, ANY, QT.IQ2_S),
)
FFN_DOWN_RULES = (
    _r(F.MOSTLY_Q2_K, ANY, QT.Q3_K),
    _r(F.MOSTLY_Q2_K_S, FIRST_EIGHTH, QT.Q4_K),
    _r(F.MOSTLY_Q2_K_S, ANY, QT.Q2_K),  # the C's branch ends here for Q2_K_S
    _r(F.MOSTLY_IQ3_XXS, Cond("layer {i} < n_layer/8 without imatrix",
                              lambda c: not c.has_imatrix and c.i < c.n // 8), QT.Q4_K),
    _r(F.MOSTLY_IQ3_XXS, NO_IMATRIX, QT.Q3_K),
    _r(F.MOSTLY_Q3_K_M, FIRST_SIXTEENTH, QT.Q5_K),
    _r(F.MOSTLY_Q3_K_M, Cond("not falcon or use_more_bits layer",
                             lambda c: not c.falcon or use_more_bits(c.i, c.n)), QT.Q4_K),
    _r(F.MOSTLY_Q3_K_M, ANY, QT.Q3_K),
    _r(F.MOSTLY_IQ3_M, Cond("layer {i} < n_layer/8, or use_more_bits with 8 experts",
                            lambda c: c.i < c.n // 8 or (c.moe8 and use_more_bits(c.i, c.n))), QT.Q4_K),
    _r(F.MOSTLY_Q3_K_L, FALCON, QT.Q4_K), _r(F.MOSTLY_Q3_K_L, ANY, QT.Q5_K),
    _r(F.MOSTLY_Q4_K_M, Cond("falcon, layer {i} < n_layer/16", lambda c: c.falcon and c.i < c.n // 16), QT.Q6_K),
    _r(F.MOSTLY_Q4_K_M, Cond("falcon, use_more_bits layer", lambda c: c.falcon and use_more_bits(c.i, c.n)),
       QT.Q5_K),
    _r(F.MOSTLY_Q4_K_M, FALCON, QT.Q4_K),
    _r(F.MOSTLY_Q4_K_M, MORE_BITS, QT.Q6_K),
    _r(F.MOSTLY_Q4_K_M, ANY, QT.Q4_K),  # the C's branch ends here for Q4_K_M
    _r((F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS), Cond("layer {i} < n_layer/8 without imatrix",
                                                lambda c: not c.has_imatrix and c.i < c.n // 8), QT.Q5_K),
    _r(F.MOSTLY_Q5_K_M, MORE_BITS, QT.Q6_K),
    _r(F.MOSTLY_Q4_K_S, Cond("layer {i} < n_layer/8 (not falcon)", lambda c: not c.falcon and c.i < c.n // 8),
       QT.Q5_K),
    _r(F.MOSTLY_Q4_0, WITH_IMATRIX_FIRST_EIGHTH, QT.Q4_1),
    _r(F.MOSTLY_Q5_0, WITH_IMATRIX_FIRST_EIGHTH, QT.Q5_1),
)
_NOT_FALCON_MOE8 = Cond("8 experts", lambda c: not c.falcon and c.moe8)
_NOT_FALCON_DENSE = Cond("", lambda c: not c.falcon and not c.moe8)
ATTN_OUTPUT_RULES = (
    _r((F.MOSTLY_Q2_K, F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_IQ4_NL,
        F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M, F.MOSTLY_IQ3_S, F.MOSTLY_IQ3_M, F.MOSTLY_IQ4_XS), _NOT_FALCON_MOE8, QT.Q5_K),
    _r(F.MOSTLY_Q2_K, _NOT_FALCON_DENSE, QT.Q3_K),
    _r(F.MOSTLY_IQ3_XXS, _NOT_FALCON_DENSE, QT.IQ3_S),
    _r(F.MOSTLY_Q3_K_M, _NOT_FALCON_DENSE, QT.Q4_K),
    _r(F.MOSTLY_Q3_K_L, _NOT_FALCON_DENSE, QT.Q5_K),
    _r(F.MOSTLY_IQ3_M, _NOT_FALCON_DENSE, QT.Q4_K),
    _r(F.MOSTLY_Q3_K_L, FALCON, QT.Q4_K),
)
_IQ3_XS_MIDDLE = Cond("n_layer/8 <= layer {i} < 7*n_layer/8", lambda c: c.n // 8 <= c.i < 7 * c.n // 8)
FFN_GATE_UP_RULES = (_r(F.MOSTLY_IQ3_XS, _IQ3_XS_MIDDLE, QT.IQ3_XXS),)
# The C's ATTENTION_QKV branch (Q3_K_M/L, IQ3_M -> Q4_K, Q4_K_M -> Q5_K, Q5_K_M -> Q6_K) is unreachable:
# attn_qkv is attn_v-like and takes that branch first. It is not ported.

#: glm5-next keeps these at Q8_0 or better (the guard at the top of llama_tensor_get_type_impl).
_GLM5_NEXT_Q8 = ("attn_q_a", "attn_q_b", "nextn.eh_proj")


def _tname(t: GGMLQuantizationType) -> str:
    return t.name.lower()


def _first(rules: tuple[Rule, ...], c: Ctx, what: str) -> tuple[GGMLQuantizationType, str] | None:
    for rule in rules:
        if (not rule.ftypes or c.ftype in rule.ftypes) and rule.cond.test(c):
            desc = rule.cond.desc.format(i=c.i, n=c.n, ne0=c.ne0, block=GGML_QUANT_SIZES[c.default][0])
            return rule.then, f"{what}{' ' + desc if desc else ''} -> {_tname(rule.then)}"
    return None


# sscanf(name, "blk.%d.", &layer): %d skips white space and takes an optional sign; the trailing "." need
# not match for the layer to count.
_LAYER_RE = re.compile(r"blk\.\s*([+-]?\d+)")


def layer_of(name: str) -> int | None:
    """The layer ``sscanf(name, "blk.%d.")`` reads, or None."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _layer(c: Counters, counter: int, model: Model, name: str) -> tuple[int, int]:
    """``layer_info``: the counter, or with experts the layer parsed from ``blk.N.``."""
    if model.n_layer is None:
        raise MetadataKeyNotFoundError(f"{model.arch}.block_count",
                                       hint="llama-quantize needs the layer count for its mixture rules")
    if max(model.n_expert, 1) > 1:
        # Experts are not stored layer by layer, so llama-quantize reads the layer from the name.
        layer = layer_of(name)
        if layer is None:
            raise QuantizationError("cannot determine the layer of this tensor (expected 'blk.N.')", tensor=name)
        if not 0 <= layer < model.n_layer:
            raise QuantizationError(f"layer {layer} is outside [0, {model.n_layer})", tensor=name)
        return layer, model.n_layer
    return counter, model.n_layer


def mixture_type(ftype: LlamaFileType, default: GGMLQuantizationType, name: str, shape: tuple[int, ...],
                 cat: str, model: Model, c: Counters, *, has_imatrix: bool,
                 output_tensor_type: GGMLQuantizationType | None) -> tuple[GGMLQuantizationType, str]:
    """``llama_tensor_get_type_impl``: the type of one tensor under a preset's mixture, and why.

    ``shape`` is numpy-order (``ne`` reversed); counters in ``c`` advance as in the C.
    """
    ne0 = shape[-1] if shape else 1
    ne2 = shape[-3] if len(shape) >= 3 else 1
    ctx = Ctx(ftype, default, model, has_imatrix, ne0, ne2, cat)
    keep = (default, "preset default")
    if model.arch == "glm5-next" and any(s in name for s in _GLM5_NEXT_Q8) and default not in (
            QT.F32, QT.F16, QT.BF16):
        return QT.Q8_0, "glm5-next attention/nextn projection -> q8_0"
    if cat == OUTPUT or (c.has_tied_embeddings and cat == TOKEN_EMBD):
        what = "output" if cat == OUTPUT else "tied token_embd (quantized like output)"
        if output_tensor_type is not None:
            return output_tensor_type, f"{what}: --output-tensor-type"
        return _first(OUTPUT_RULES, ctx, what) or (default, f"{what}: preset default")
    if ftype == F.MOSTLY_MXFP4_MOE:
        return _first(MXFP4_RULES, ctx, cat) or keep
    if cat == TOKEN_EMBD:
        return _first(TOKEN_EMBD_RULES, ctx, "token_embd") or (default, "token_embd: preset default")
    if ftype in _IQ1_IQ2:
        if cat in ATTN_V_LIKE:
            c.i_attention_wv += 1
            return _first(IQ1_IQ2_RULES[ATTN_V], ctx, cat) or keep
        if cat == ATTN_K and model.n_expert == 8:
            return _first(IQ1_IQ2_RULES[ATTN_K], ctx, cat) or keep
        if cat == FFN_DOWN:
            if model.n_layer is None:
                _layer(c, 0, model, name)  # raises: the rule needs the layer count
            ctx = Ctx(ftype, default, model, has_imatrix, ne0, ne2, cat, c.i_ffn_down, model.n_layer or 0)
            c.i_ffn_down += 1
            return _first(IQ1_IQ2_RULES[FFN_DOWN], ctx, cat) or keep
        if cat == ATTN_OUTPUT:
            return _first(IQ1_IQ2_RULES[ATTN_OUTPUT], ctx, cat) or keep
        return keep
    if cat in ATTN_V_LIKE:
        ctx = Ctx(ftype, default, model, has_imatrix, ne0, ne2, cat, c.i_attention_wv, c.n_attention_wv)
        c.i_attention_wv += 1
        t, reason = _first(ATTN_V_RULES, ctx, cat) or keep
        if model.is_70b and t in (QT.Q3_K, QT.Q4_K):
            t, reason = QT.Q5_K, f"{cat} in a 70B model -> q5_k"
        if model.n_expert == 8:
            t, reason = QT.Q8_0, f"{cat} in an 8-expert model -> q8_0"
        return t, reason
    if cat == ATTN_K:
        return _first(ATTN_K_RULES, ctx, cat) or keep
    if cat == ATTN_Q:
        return _first(ATTN_Q_RULES, ctx, cat) or keep
    if cat in (FFN_DOWN, FFN_GATE, FFN_UP):
        counter = {FFN_DOWN: c.i_ffn_down, FFN_GATE: c.i_ffn_gate, FFN_UP: c.i_ffn_up}[cat]
        i, n = _layer(c, counter, model, name)
        ctx = Ctx(ftype, default, model, has_imatrix, ne0, ne2, cat, i, n)
        if cat == FFN_DOWN:
            c.i_ffn_down += 1
            return _first(FFN_DOWN_RULES, ctx, cat) or keep
        if cat == FFN_GATE:
            c.i_ffn_gate += 1
        else:
            c.i_ffn_up += 1
        return _first(FFN_GATE_UP_RULES, ctx, cat) or keep
    if cat == ATTN_OUTPUT:
        return _first(ATTN_OUTPUT_RULES, ctx, cat) or keep
    return keep


#: tensor_type_fallback: the type to use when a row is not a whole number of blocks.
FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    **dict.fromkeys((QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ4_XS),
                    QT.IQ4_NL),
    **dict.fromkeys((QT.Q2_K, QT.Q3_K, QT.TQ1_0, QT.TQ2_0), QT.Q4_0),
    QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
}


def fallback_type(name: str, ne0: int, t: GGMLQuantizationType) -> tuple[GGMLQuantizationType, str] | None:
    """tensor_type_fallback: ``(type, reason)`` when ``ne0`` is not a whole number of ``t`` blocks, else None.

    A 32-element-block type stays and then fails the second check, which makes it F16, as in the C.

    Raises:
        QuantizationError: a type with blocks over 32 and no fallback (Q1_0's 128), as the C throws.
    """
    block = GGML_QUANT_SIZES[t][0]
    if ne0 % block == 0:
        return None
    new = FALLBACK.get(t)
    if new is None:
        if block > 32:
            raise QuantizationError(f"no tensor type fallback is defined for type {t.name} (row length {ne0})",
                                    tensor=name)
        new = t
    if ne0 % GGML_QUANT_SIZES[new][0]:
        return QT.F16, f"row length {ne0} not a multiple of {block} ({_tname(t)}) nor of 32 -> f16 (fallback)"
    return new, f"row length {ne0} not a multiple of {block} ({_tname(t)}) -> {_tname(new)} (fallback)"
