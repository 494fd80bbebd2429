"""Nemotron-H (``nemotron_h``) and its MoE variant (``nemotron_h_moe``): NVIDIA's hybrid of Mamba2, attention
and feed-forward layers, each layer ONE of them, as llama.cpp computes it (src/models/nemotron-h.cpp,
src/models/nemotron-h-moe.cpp).

The file says which layer is which (llama_model_nemotron_h::load_arch_hparams): a layer whose
``attention.head_count_kv`` and ``feed_forward_length`` entries are both 0 is a Mamba2 layer, one with a
zero FFN length an attention layer, any other an FFN layer. Every layer is ``x + mixer(rms_norm(x))`` with
its ``attn_norm``:

* Mamba2: :func:`ggufkit.eval.layers_mamba2.mamba2_mixer` (grouped scan, gated group RMSNorm);
* attention: the standard attention without RoPE (llama.cpp applies none), ``1/sqrt(head_dim)`` scale;
* FFN: ``ffn_down(relu(ffn_up x)^2)`` (LLM_FFN_RELU_SQR, no gate); in a MoE file (``expert_count``) every
  FFN layer is a MoE layer: a sigmoid router whose selection adds ``exp_probs_b``, the top-k sigmoid
  weights (renormalised when ``expert_weights_norm``, times ``expert_weights_scale``), ungated squared-ReLU
  experts (optionally inside a latent projection, ``ffn_latent_down`` / ``ffn_latent_up``) and an ungated
  squared-ReLU shared expert (build_ffn_layer, build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ggufkit.errors import EvaluationError, MetadataKeyNotFoundError, MetadataValueError
from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.layers_mamba2 import mamba2_mixer, mamba2_shapes, read_mamba2

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

SSM, ATTENTION, FFN = "ssm", "attention", "ffn"


def _per_layer(file: GGUFModel, name: str, n_layer: int) -> list[int]:
    """A per-layer count: an array with one entry per layer, or one number for every layer."""
    field = file.kv.get(name)
    if field is None:
        raise MetadataKeyNotFoundError(name, path=file.path, hint="the evaluator needs it")
    value = field.value
    values = [value] * n_layer if isinstance(value, (int, float)) else list(np.asarray(value).reshape(-1))
    if len(values) < n_layer or any(isinstance(v, bool) or not float(v).is_integer() or v < 0 for v in values):
        raise MetadataValueError(f"expected {n_layer} non-negative integers", key=name, path=file.path)
    return [int(v) for v in values[:n_layer]]


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The layer kinds, per-layer FFN widths, Mamba2 sizes and MoE routing of a nemotron_h(_moe) file."""
    n_kv = _per_layer(file, f"{arch}.attention.head_count_kv", n_layer)
    n_ff = _per_layer(file, f"{arch}.feed_forward_length", n_layer)
    kinds = tuple(SSM if kv == 0 and ff == 0 else ATTENTION if ff == 0 else FFN for kv, ff in zip(n_kv, n_ff))
    if len({kv for kv, kind in zip(n_kv, kinds) if kind == ATTENTION}) > 1:
        raise EvaluationError("attention layers with different KV head counts are not supported by the evaluator",
                              path=file.path)
    groups = file.get(f"{arch}.expert_group_count", 1)
    if isinstance(groups, (int, float)) and groups > 1:
        raise EvaluationError(f"grouped expert selection ({groups} groups) is not supported by the evaluator",
                              path=file.path)
    return {"kinds": kinds, "n_ff": tuple(n_ff), "mamba": read_mamba2(file, arch),
            "weights_norm": bool(file.get(f"{arch}.expert_weights_norm", False)),
            "weights_scale": float(file.get(f"{arch}.expert_weights_scale", 0.0) or 0.0)}


def layer_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes: the embeddings and head, then per layer its norm and its one mixer."""
    out = shapes.global_shapes(hp, names)
    e = hp.n_embd
    for i, kind in enumerate(hp.extra["kinds"]):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (e,)
        if kind == SSM:
            out.update(mamba2_shapes(hp.extra["mamba"], e, b, names))
        elif kind == ATTENTION:
            out.update(shapes.attention_shapes(hp, b, names))
        elif hp.n_expert:
            n, latent = hp.n_expert, -1 if b + "ffn_latent_down.weight" in names else e
            out[b + "ffn_gate_inp.weight"] = (n, e)
            out[b + "exp_probs_b.bias"] = (n,)
            out[b + "ffn_up_exps.weight"] = (n, -1, latent)
            out[b + "ffn_down_exps.weight"] = (n, latent, -1)
            out[b + "ffn_up_shexp.weight"] = (-1, e)
            out[b + "ffn_down_shexp.weight"] = (e, -1)
            if b + "ffn_latent_down.weight" in names:
                out[b + "ffn_latent_down.weight"] = (-1, e)
                out[b + "ffn_latent_up.weight"] = (e, -1)
        else:
            n_ff = hp.extra["n_ff"][i]
            out[b + "ffn_up.weight"] = (n_ff, e)
            out[b + "ffn_down.weight"] = (e, n_ff)
            for bias, size in (("ffn_up.bias", n_ff), ("ffn_down.bias", e)):
                if b + bias in names:
                    out[b + bias] = (size,)
    return out


def _relu_sqr(x: torch.Tensor) -> torch.Tensor:
    r = F.relu(x)
    return r * r  # ggml_relu then ggml_sqr (build_ffn's LLM_FFN_RELU_SQR)


def _mlp(model: GGUFCausalLM, h: torch.Tensor, p: str, up: str, down: str) -> torch.Tensor:
    """``down(relu(up h)^2)``, the observer at both matmuls."""
    model.observe(h, p + up + ".weight")
    a = _relu_sqr(model.linear(h, model.weight(p + up + ".weight"), model.optional_weight(p + up + ".bias")))
    model.observe(a, p + down + ".weight")
    return model.linear(a, model.weight(p + down + ".weight"), model.optional_weight(p + down + ".bias"))


def _expert_rows(model: GGUFCausalLM, name: str, e: int) -> torch.Tensor:
    t = model.tensors[name]
    rows = t.shape[1]
    return model.tag_src1(t.row_range(e * rows, (e + 1) * rows, model.dtype), t, e * rows, (e + 1) * rows)


def _moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """The MoE layer: sigmoid router (selection biased by ``exp_probs_b``), ungated squared-ReLU experts,
    shared expert (src/models/nemotron-h.cpp build_ffn_layer, src/llama-graph.cpp build_moe_ffn)."""
    hp, extra = model.hparams, model.hparams.extra
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    probs = torch.sigmoid(model.linear(x, model.weight(p + "ffn_gate_inp.weight")))
    selection = probs + model.weight(p + "exp_probs_b.bias").reshape(1, -1)
    selected = torch.topk(selection, hp.n_expert_used, dim=-1).indices
    weights = probs.gather(1, selected)
    if extra["weights_norm"]:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=6.103515625e-5)
    if extra["weights_scale"] not in (0.0, 1.0):
        weights = weights * extra["weights_scale"]
    latent_down = model.optional_weight(p + "ffn_latent_down.weight")
    xl = x
    if latent_down is not None:
        model.observe(h, p + "ffn_latent_down.weight")
        xl = model.linear(x, latent_down)
    k = selected.shape[-1]
    ids = selected.reshape(*shape[:-1], k)
    model.observe_routed(p + "ffn_up_exps.weight", xl.reshape(*shape[:-1], 1, -1), ids)
    down = model.tensors[p + "ffn_down_exps.weight"]
    acts = xl.new_zeros((xl.shape[0], k, down.shape[2])) if model.observer is not None else None
    out = xl.new_zeros((xl.shape[0], down.shape[1]))
    for e in torch.unique(selected).tolist():
        rows, slot = torch.nonzero(selected == e, as_tuple=True)
        a = _relu_sqr(model.linear(xl[rows], _expert_rows(model, p + "ffn_up_exps.weight", e)))
        if acts is not None:
            acts[rows, slot] = a
        y = model.linear(a, _expert_rows(model, p + "ffn_down_exps.weight", e))
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if acts is not None:
        model.observe_routed(p + "ffn_down_exps.weight", acts.reshape(*shape[:-1], k, -1), ids)
    if latent_down is not None:
        model.observe(out.reshape(*shape[:-1], -1), p + "ffn_latent_up.weight")
        out = model.linear(out, model.weight(p + "ffn_latent_up.weight"))
    return out.reshape(shape) + _mlp(model, h, p, "ffn_up_shexp", "ffn_down_shexp")


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Layer ``p``: ``x + mixer(rms_norm(x))`` with the layer's one mixer."""
    kind = model.hparams.extra["kinds"][int(p.split(".")[1])]
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    if kind == SSM:
        y = mamba2_mixer(model, h, p, model.hparams.extra["mamba"])
    elif kind == ATTENTION:
        y = model.attention(h, p)
    elif model.hparams.n_expert:
        y = _moe(model, h, p)
    else:
        y = _mlp(model, h, p, "ffn_up", "ffn_down")
    return x + y


FORWARD = FamilyForward(read=read, shapes=layer_shapes, block=block)
