"""Liquid LFM2 (``lfm2``) and LFM2-MoE (``lfm2moe``) as llama.cpp's graphs compute them (src/models/lfm2.cpp,
lfm2moe.cpp, which share the graph).

Each block: RMSNorm (``attn_norm``, transformers' operator_norm), then on a layer whose
``attention.head_count_kv`` entry is 0 (``is_recr``) the short convolution, on the others self-attention with
per-head q/k RMS norms and NEOX RoPE (:meth:`ggufkit.eval.model.GGUFCausalLM.attention`); the result joins the
stream; RMSNorm (``ffn_norm``), then a dense SiLU-gated FFN (every LFM2 layer; the first
``leading_dense_block_count`` LFM2-MoE layers) or the sigmoid-routed MoE; the result joins the stream. After the
last block the output norm is ``token_embd_norm`` (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2; transformers'
``embedding_norm``).

The short convolution (build_shortconv_block): ``bcx = in_proj · h`` split into ``b, c, x`` (thirds, in that
order), ``bx = b * x``, the causal depthwise convolution ``ggml_ssm_conv`` of ``bx`` from an empty conv state
(:func:`ggufkit.eval.layers_conv.causal_conv1d`, kernel ``shortconv.conv`` ``[n_embd, l_cache]``), ``y = c * conv``,
``out_proj · y``. llama-imatrix collects ``in_proj`` and ``out_proj`` (build_lora_mm), not the convolution.

The MoE router (build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, ``exp_probs_b``, ``norm_w``):
``p = sigmoid(ffn_gate_inp · h)``, experts chosen by the top-k of ``p + exp_probs_b``, weighted by their
unbiased ``p`` divided by its sum (clamped below at 2^-14).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ggufkit.errors import EvaluationError, MetadataValueError
from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward, uint_key
from ggufkit.eval.layers_conv import causal_conv1d
from ggufkit.eval.moe import routed_experts

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

#: llama_expert_gating_func_type LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (the only one LFM2-MoE's converter writes).
GATING_SIGMOID = 2
#: build_moe_ffn clamps the top-k weights' sum below at the smallest normal F16.
_MIN_WEIGHT_SUM = 6.103515625e-5


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """Which layers are short convolutions (KV heads 0), the conv kernel size, and (MoE) the dense lead layers."""
    name = f"{arch}.attention.head_count_kv"
    field = file.kv.get(name)
    value = None if field is None else field.value
    if isinstance(value, (list, tuple, np.ndarray)):
        kv = [int(v) for v in value]
        if len(kv) != n_layer:
            raise MetadataValueError(f"{len(kv)} entries for {n_layer} layers", key=name, path=file.path)
        recurrent = tuple(v == 0 for v in kv)
    else:
        recurrent = (False,) * n_layer
    l_cache = uint_key(file, f"{arch}.shortconv.l_cache")
    if l_cache < 2:
        raise MetadataValueError(f"expected at least 2, got {l_cache}", key=f"{arch}.shortconv.l_cache",
                                 path=file.path)
    n_dense = n_layer
    if arch == "lfm2moe":  # llama_model_lfm2moe::load_arch_hparams: optional, default 0
        n_dense = uint_key(file, f"{arch}.leading_dense_block_count", 0)
        gating = uint_key(file, f"{arch}.expert_gating_func")
        if gating != GATING_SIGMOID:
            raise EvaluationError(f"{arch}: expert gating function {gating} is not supported (only sigmoid, "
                                  f"{GATING_SIGMOID})", path=file.path)
    return {"recurrent": recurrent, "l_cache": l_cache, "n_dense": n_dense}


def expected_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """token_embd (and an untied head), token_embd_norm, then per block its norms, short convolution or
    attention, and dense FFN or router, bias and stacked experts."""
    e = hp.n_embd
    out = shapes.global_shapes(hp, names)
    del out["output_norm.weight"]
    out["token_embd_norm.weight"] = (e,)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "ffn_norm.weight"] = (e,)
        if hp.extra["recurrent"][il]:
            out[b + "shortconv.conv.weight"] = (e, hp.extra["l_cache"])
            out[b + "shortconv.in_proj.weight"] = (3 * e, e)
            out[b + "shortconv.out_proj.weight"] = (e, e)
        else:
            out.update(shapes.attention_shapes(hp, b, names | {b + "attn_q_norm.weight"}))
        if il < hp.extra["n_dense"]:
            out[b + "ffn_up.weight"] = (-1, e)
            out[b + "ffn_gate.weight"] = (-1, e)
            out[b + "ffn_down.weight"] = (e, -1)
        else:
            out.update(shapes.ffn_shapes(hp, b, names))
            out[b + "exp_probs_b.bias"] = (hp.n_expert,)
    return out


def embed(model: GGUFCausalLM, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The embeddings as they are; the output norm the evaluator applies after the blocks is
    ``token_embd_norm`` (the lfm2 loader's output_norm), made visible under that name."""
    model.tensors.setdefault("output_norm.weight", model.tensors["token_embd_norm.weight"])
    return x


def shortconv(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s short convolution on the normed stream ``h`` ``[B, T, n_embd]`` (module docstring)."""
    model.observe(h, p + "shortconv.in_proj.weight")
    bcx = model.linear(h, model.weight(p + "shortconv.in_proj.weight"))
    b, c, x = bcx.chunk(3, dim=-1)
    conv = causal_conv1d(b * x, model.weight(p + "shortconv.conv.weight").to(torch.float32))
    y = c * conv
    model.observe(y, p + "shortconv.out_proj.weight")
    return model.linear(y, model.weight(p + "shortconv.out_proj.weight"))


def dense_ffn(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """``ffn_down · (silu(ffn_gate · h) * ffn_up · h)`` (build_ffn LLM_FFN_SILU, LLM_FFN_PAR)."""
    model.observe(h, p + "ffn_up.weight", p + "ffn_gate.weight")
    up = model.linear(h, model.weight(p + "ffn_up.weight"))
    a = F.silu(model.linear(h, model.weight(p + "ffn_gate.weight"))) * up
    model.observe(a, p + "ffn_down.weight")
    return model.linear(a, model.weight(p + "ffn_down.weight"))


def sigmoid_moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s sigmoid-routed experts on ``h`` ``[B, T, n_embd]`` (module docstring)."""
    x = h.reshape(-1, h.shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    probs = torch.sigmoid(model.linear(x, model.weight(p + "ffn_gate_inp.weight")))
    biased = probs + model.weight(p + "exp_probs_b.bias")
    selected = torch.topk(biased, model.hparams.n_expert_used, dim=-1).indices
    weights = probs.gather(-1, selected)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=_MIN_WEIGHT_SUM)
    return routed_experts(model, h, p, weights, selected).reshape(h.shape)


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p`` on the residual stream ``x`` ``[B, T, n_embd]`` (module docstring)."""
    extra = model.hparams.extra
    il = int(p.split(".")[1])
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    x = x + (shortconv(model, h, p) if extra["recurrent"][il] else model.attention(h, p))
    h = model.norm(x, model.weight(p + "ffn_norm.weight"), None)
    return x + (dense_ffn(model, h, p) if il < extra["n_dense"] else sigmoid_moe(model, h, p))


FORWARD = FamilyForward(read=read, shapes=expected_shapes, block=block, embed=embed)
