"""Qwen3-Next (GGUF ``qwen3next``): gated delta-net layers and gated full-attention layers with a
mixture-of-experts FFN, as llama.cpp's graph computes them (src/models/qwen3next.cpp, delta-net-base.cpp).

Each block: ``x += mixer(rms_norm(x) * attn_norm)``, then ``x += moe(rms_norm(x) * post_attention_norm)`` (a
softmax router with renormalised top-k weights plus a sigmoid-gated shared expert: the standard MoE FFN). The
mixer differs from Qwen3.5's (:mod:`ggufkit.eval.family_qwen35`) in three ways:

* the beta and decay projections are one tensor, ``ssm_ba`` (SSM_BETA_ALPHA), whose rows are grouped per key head:
  ``[b (r values), a (r values)]`` for each of the ``n_k_heads`` key heads, ``r = n_v_heads / n_k_heads``
  (build_layer_attn_linear: ``mixed_ba`` reshaped to ``[2r, n_k_heads]``);
* the value heads stay grouped by key head (value head ``h`` reads key head ``h // r``: ``ggml_repeat_4d`` of
  ``[head_k_dim, 1, n_k_heads]`` to ``[head_k_dim, r, n_k_heads]``); the layer here reorders them to the tiled
  order :func:`ggufkit.eval.layers_delta_net.delta_net_mix` computes (each head is computed on its own, so only
  the order changes) and back before ``ssm_out``;
* full attention ropes plain NEOX over ``n_rot`` dimensions (no M-RoPE sections).

Blocks from ``block_count - nextn_predict_layers`` on are multi-token-prediction layers, not run by the main
pass. Every weight matmul reports its input to the observer, where llama-imatrix collects it (build_lora_mm).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ggufkit.errors import MetadataValueError
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.family_qwen35 import gated_attention
from ggufkit.eval.layers_delta_net import DeltaNetDims, delta_net_mix, read_dims, recurrent_layers
from ggufkit.eval.shapes import ffn_shapes, global_shapes

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The delta-net sizes, the layer schedule and the MTP layer count."""
    nextn = file.kv.get(f"{arch}.nextn_predict_layers")
    n_mtp = int(nextn.value) if nextn is not None else 0
    if not 0 <= n_mtp < n_layer:
        raise MetadataValueError(f"{n_mtp} MTP layers of {n_layer} blocks", key=f"{arch}.nextn_predict_layers",
                                 path=file.path)
    eps_field = file.kv.get(f"{arch}.attention.layer_norm_rms_epsilon")
    eps = float(eps_field.value) if eps_field is not None else 1e-6
    return {"delta_net": read_dims(file, arch, eps), "n_trunk": n_layer - n_mtp,
            "recurrent": recurrent_layers(file, arch, n_layer, n_layer - n_mtp)}


def shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """The trunk's tensors (an MTP block's are not read by the main pass)."""
    out = global_shapes(hp, names)
    d: DeltaNetDims = hp.extra["delta_net"]
    e, hd = hp.n_embd, hp.head_dim
    for i in range(hp.extra["n_trunk"]):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "post_attention_norm.weight"] = (e,)
        if hp.extra["recurrent"][i]:
            out.update({b + "attn_qkv.weight": (d.conv_dim, e), b + "attn_gate.weight": (d.value_dim, e),
                        b + "ssm_ba.weight": (2 * d.n_v_heads, e),
                        b + "ssm_conv1d.weight": (d.conv_dim, -1), b + "ssm_dt.bias": (d.n_v_heads,),
                        b + "ssm_a": (d.n_v_heads,), b + "ssm_norm.weight": (d.head_v_dim,),
                        b + "ssm_out.weight": (e, d.value_dim)})
        else:
            q, kv = hp.n_head * hd, hp.n_head_kv * hd
            out.update({b + "attn_q.weight": (2 * q, e), b + "attn_k.weight": (kv, e), b + "attn_v.weight": (kv, e),
                        b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,),
                        b + "attn_output.weight": (e, q)})
        out.update(ffn_shapes(hp, b, names))
    return out


def _tiled(x: torch.Tensor, n_k: int, r: int, size: int) -> torch.Tensor:
    """Value heads along the last dimension from grouped order (``kh * r + j``) to tiled (``j * n_k + kh``)."""
    shape = x.shape
    return x.reshape(*shape[:-1], n_k, r, size).transpose(-3, -2).reshape(shape)


def _grouped(x: torch.Tensor, n_k: int, r: int, size: int) -> torch.Tensor:
    """The inverse of :func:`_tiled`."""
    shape = x.shape
    return x.reshape(*shape[:-1], r, n_k, size).transpose(-3, -2).reshape(shape)


def delta_net_layer(model: GGUFCausalLM, h: torch.Tensor, p: str, d: DeltaNetDims) -> torch.Tensor:
    """A delta-net layer of Qwen3-Next on the normed stream ``h`` (qwen3next.cpp build_layer_attn_linear)."""
    model.observe(h, p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_ba.weight")
    qkv = model.linear(h, model.weight(p + "attn_qkv.weight"))
    z = model.linear(h, model.weight(p + "attn_gate.weight"))
    ba = model.linear(h, model.weight(p + "ssm_ba.weight"))
    bsz, t, _ = h.shape
    r = d.n_v_heads // d.n_k_heads
    ba = ba.reshape(bsz, t, d.n_k_heads, 2 * r)
    b, a = ba[..., :r].reshape(bsz, t, d.n_v_heads), ba[..., r:].reshape(bsz, t, d.n_v_heads)
    conv = model.weight(p + "ssm_conv1d.weight")
    dt_bias, ssm_a = model.weight(p + "ssm_dt.bias"), model.weight(p + "ssm_a")
    if r > 1:
        kd, nk = 2 * d.key_dim, d.n_k_heads
        qkv = torch.cat([qkv[..., :kd], _tiled(qkv[..., kd:], nk, r, d.head_v_dim)], dim=-1)
        conv = torch.cat([conv[:kd], _tiled(conv[kd:].T, nk, r, d.head_v_dim).T])
        z = _tiled(z, nk, r, d.head_v_dim)
        b, a = _tiled(b, nk, r, 1), _tiled(a, nk, r, 1)
        dt_bias, ssm_a = _tiled(dt_bias, nk, r, 1), _tiled(ssm_a, nk, r, 1)
    y = delta_net_mix(qkv, z, b, a, conv, dt_bias, ssm_a, model.weight(p + "ssm_norm.weight"), d)
    if r > 1:
        y = _grouped(y, d.n_k_heads, r, d.head_v_dim)
    model.observe(y, p + "ssm_out.weight")
    return model.linear(y, model.weight(p + "ssm_out.weight"))


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p`` on the residual stream (MTP blocks pass it through)."""
    extra = model.hparams.extra
    il = int(p.split(".")[1])
    if il >= extra["n_trunk"]:
        return x
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    if extra["recurrent"][il]:
        x = x + delta_net_layer(model, h, p, extra["delta_net"])
    else:
        # plain NEOX rope: one section covering every rotated pair, all of them the token's position
        half = model.hparams.n_rot // 2
        x = x + gated_attention(model, h, p, (half, half, half, 0))
    return x + model.feed_forward(model.norm(x, model.weight(p + "post_attention_norm.weight"), None), p)


FORWARD = FamilyForward(read=read, shapes=shapes, block=block)
