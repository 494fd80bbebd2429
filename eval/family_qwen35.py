"""Qwen3.5 (GGUF ``qwen35``): gated delta-net layers and gated full-attention layers, as llama.cpp's graph
computes them (src/models/qwen35.cpp, delta-net-base.cpp).

Each block: ``x += mixer(rms_norm(x) * attn_norm)``, then ``x += ffn(rms_norm(x) * post_attention_norm)``
(the post-attention norm is the FFN's pre-norm; a dense SiLU-gated FFN). The mixer is

* on a delta-net layer (``attention.recurrent_layers``, else all but every ``full_attention_interval``-th):
  the projections ``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha`` of the normed stream, then
  :func:`ggufkit.eval.layers_delta_net.delta_net_mix` and ``ssm_out``;
* on a full-attention layer: ``attn_q`` gives each head's query and output gate side by side
  (``[q_h | gate_h]`` per head), per-head RMS q/k norms, M-RoPE (:func:`imrope`), causal softmax attention
  scaled by ``1/sqrt(head_dim)``, the output times ``sigmoid(gate)``, then ``attn_output``.

Blocks from ``block_count - nextn_predict_layers`` on are multi-token-prediction layers: the main pass does
not run them (qwen35.cpp: "MTP/NextN layers are loaded as extra decoder blocks but not executed").
Every weight matmul reports its input to the observer, where llama-imatrix collects it (build_lora_mm).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ggufkit.errors import MetadataValueError
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.ggml_cpu import round_f16
from ggufkit.eval.layers_delta_net import DeltaNetDims, delta_net_mix, read_dims, recurrent_layers
from ggufkit.eval.shapes import ffn_shapes, global_shapes

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The delta-net sizes, the layer schedule, the MTP layer count and the M-RoPE sections."""
    nextn = file.kv.get(f"{arch}.nextn_predict_layers")
    n_mtp = int(nextn.value) if nextn is not None else 0
    if not 0 <= n_mtp < n_layer:
        raise MetadataValueError(f"{n_mtp} MTP layers of {n_layer} blocks", key=f"{arch}.nextn_predict_layers",
                                 path=file.path)
    eps_field = file.kv.get(f"{arch}.attention.layer_norm_rms_epsilon")
    eps = float(eps_field.value) if eps_field is not None else 1e-6
    field = file.kv.get(f"{arch}.rope.dimension_sections")
    sections = [int(v) for v in field.value] if field is not None else []
    if field is None or len(sections) > 4 or sum(sections) <= 0 or min(sections) < 0:
        raise MetadataValueError(f"expected up to 4 M-RoPE sections, got {sections}",
                                 key=f"{arch}.rope.dimension_sections", path=file.path)
    return {"delta_net": read_dims(file, arch, eps), "n_trunk": n_layer - n_mtp,
            "recurrent": recurrent_layers(file, arch, n_layer, n_layer - n_mtp),
            "sections": (*sections, *[0] * (4 - len(sections)))}


def shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """The trunk's tensors (an MTP block's are left out: not loaded, the main pass does not read them)."""
    out = global_shapes(hp, names)
    d: DeltaNetDims = hp.extra["delta_net"]
    e, hd = hp.n_embd, hp.head_dim
    for i in range(hp.extra["n_trunk"]):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "post_attention_norm.weight"] = (e,)
        if hp.extra["recurrent"][i]:
            out.update({b + "attn_qkv.weight": (d.conv_dim, e), b + "attn_gate.weight": (d.value_dim, e),
                        b + "ssm_beta.weight": (d.n_v_heads, e), b + "ssm_alpha.weight": (d.n_v_heads, e),
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


def imrope(x: torch.Tensor, n_rot: int, base: float, sections: tuple[int, ...]) -> torch.Tensor:
    """Interleaved M-RoPE (``ggml_rope_multi``, LLAMA_ROPE_TYPE_IMROPE) of ``x`` ``float32[B, T, H, hd]`` for
    text: the first ``n_rot`` dims rotated in split halves (NEOX), pair ``i`` by position ``t`` times
    ``base^(-2i/n_rot)`` -- the temporal, height and width positions of a text token are all ``t``, and the
    fourth section's position is 0 (llm_graph_input_pos::set_input), so a pair ggml_mrope_cache_init gives
    that section is not rotated."""
    t = x.shape[1]
    s = list(sections)
    sect = sum(s)
    half = n_rot // 2
    keep = []
    for i in range(half):
        sector = i % sect
        keep.append((sector % 3 == 1 and sector < 3 * s[1]) or (sector % 3 == 2 and sector < 3 * s[2])
                    or (sector % 3 == 0 and sector < 3 * s[0]))
    inv_freq = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.int64).float() / n_rot))
    inv_freq = inv_freq * torch.tensor(keep, dtype=torch.float32)
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq).to(x.device)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def gated_attention(model: GGUFCausalLM, h: torch.Tensor, p: str, sections: tuple[int, ...] | None) -> torch.Tensor:
    """A full-attention layer of Qwen3.5 / Qwen3-Next on the normed stream ``h`` (qwen35.cpp build_layer_attn):
    ``attn_q`` holds ``[q_h | gate_h]`` per head; M-RoPE with ``sections`` (None: plain NEOX RoPE over
    ``n_rot`` dims, as qwen3next.cpp)."""
    hp = model.hparams
    bsz, t, _ = h.shape
    hd = hp.head_dim
    model.observe(h, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
    qg = model.linear(h, model.weight(p + "attn_q.weight")).reshape(bsz, t, hp.n_head, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = model.linear(h, model.weight(p + "attn_k.weight")).reshape(bsz, t, hp.n_head_kv, hd)
    v = model.linear(h, model.weight(p + "attn_v.weight")).reshape(bsz, t, hp.n_head_kv, hd)
    q = model.norm(q, model.weight(p + "attn_q_norm.weight"), None)
    k = model.norm(k, model.weight(p + "attn_k_norm.weight"), None)
    rope = sections if sections is not None else (hp.n_rot // 2, 0, 0, 0)
    q, k = imrope(q, hp.n_rot, hp.rope_base, rope), imrope(k, hp.n_rot, hp.rope_base, rope)
    if model.kv_f16:  # llama.cpp's F16 K/V cache
        k, v = round_f16(k), round_f16(v)
    q, k, v = (z.transpose(1, 2).to(model.dtype) for z in (q, k, v))
    if hp.n_head_kv != hp.n_head:
        rep = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hp.attn_scale or 1.0 / math.sqrt(hd))
    o = o.transpose(1, 2).float() * torch.sigmoid(gate)
    o = o.reshape(bsz, t, hp.n_head * hd)
    model.observe(o, p + "attn_output.weight")
    return model.linear(o, model.weight(p + "attn_output.weight"))


def delta_net_layer(model: GGUFCausalLM, h: torch.Tensor, p: str, dims: DeltaNetDims) -> torch.Tensor:
    """A delta-net layer of Qwen3.5 on the normed stream ``h`` (qwen35.cpp build_layer_attn_linear)."""
    model.observe(h, p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight", p + "ssm_alpha.weight")
    qkv = model.linear(h, model.weight(p + "attn_qkv.weight"))
    z = model.linear(h, model.weight(p + "attn_gate.weight"))
    b = model.linear(h, model.weight(p + "ssm_beta.weight"))
    a = model.linear(h, model.weight(p + "ssm_alpha.weight"))
    y = delta_net_mix(qkv, z, b, a, model.weight(p + "ssm_conv1d.weight"), model.weight(p + "ssm_dt.bias"),
                      model.weight(p + "ssm_a"), model.weight(p + "ssm_norm.weight"), dims)
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
        x = x + gated_attention(model, h, p, extra["sections"])
    return x + model.feed_forward(model.norm(x, model.weight(p + "post_attention_norm.weight"), None), p)


FORWARD = FamilyForward(read=read, shapes=shapes, block=block)
