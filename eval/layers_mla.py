"""Multi-head latent attention (DeepSeek V2/V3, GLM-4.7-Flash) in the absorbed form llama.cpp's graph computes
(src/models/deepseek2.cpp, build_attn_mha in src/llama-graph.cpp).

Queries: ``attn_q_a`` -> RMSNorm ``attn_q_a_norm`` -> ``attn_q_b`` (or one ``attn_q``, DeepSeek-V2-Lite), per head
``qk_nope`` dims without and ``qk_rope`` dims with rope. Keys and values share one compressed latent:
``attn_kv_a_mqa`` gives ``kv_lora_rank`` latent dims (RMSNorm ``attn_kv_a_norm``) and ``qk_rope`` dims of a single
roped key head. Each head's nope query is absorbed into the latent space through its ``attn_k_b`` matrix
(``[n_head, kv_lora, qk_nope]``), so attention is MQA over ``[latent, k_pe]`` keys with the latent as the value;
the result is decompressed per head through ``attn_v_b`` (``[n_head, v_head, kv_lora]``) before ``attn_output``.
Scale ``1/sqrt(qk_nope + qk_rope)``, times yarn's mscale squared where the file has yarn scaling.
Rope: NORM (adjacent pairs), as transformers' interleaved DeepSeek rope.

llama-imatrix collects ``attn_k_b`` and ``attn_v_b`` as ggml_mul_mat with a 3-D weight: one row of sums per head
(the head's input squared), one count (the tokens) for the tensor (tools/imatrix/imatrix.cpp collect_imatrix).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ggufkit.eval.ggml_cpu import round_f16
from ggufkit.eval.qtensor import QTensor
from ggufkit.eval.rope import Yarn, rope_theta, yarn_theta

if TYPE_CHECKING:
    from ggufkit.eval.model import GGUFCausalLM


def rope_pairs(x: torch.Tensor, base: float, yarn: Yarn | None = None) -> torch.Tensor:
    """NORM rope (ggml_rope_ext mode 0: adjacent pairs ``(2i, 2i+1)`` rotated by ``pos * base^(-2i/n)``) of
    ``x`` ``[B, T, H, n]`` (all its dims rotated), float32; with ``yarn`` the shared YaRN angles and magnitude
    (:func:`ggufkit.eval.rope.yarn_theta`, ggml-cpu ops.cpp rope_yarn)."""
    n, t = x.shape[-1], x.shape[1]
    if yarn is None:
        theta, mscale = rope_theta(t, n, base), 1.0
    else:
        theta, mscale = yarn_theta(yarn, t, n, base, yarn.freq_scale)
    theta = theta.to(x.device)
    cos, sin = (theta.cos() * mscale)[None, :, None, :], (theta.sin() * mscale)[None, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def kq_mscale(yarn: Yarn) -> float:
    """The graph's ``mscale``, squared into the attention scale: llama_context's attention factor with rope_yarn's
    magnitude put back, times ``1 + 0.1 log_mul ln(1 / freq_scale)`` (llama_model_deepseek2's graph,
    [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])."""
    org = yarn.attn_factor * (1.0 + 0.1 * math.log(1.0 / yarn.freq_scale))
    return org * (1.0 + 0.1 * yarn.log_mul * math.log(1.0 / yarn.freq_scale))


def _head(model: GGUFCausalLM, t: QTensor, h: int) -> torch.Tensor:
    """Head ``h``'s matrix of a stacked ``[n_head, rows, cols]`` tensor, dequantized and marked for ggml's
    input rounding (as :func:`ggufkit.eval.moe.routed_experts` reads an expert)."""
    rows = t.shape[1]
    return model.tag_src1(t.row_range(h * rows, (h + 1) * rows, model.dtype), t, h * rows, (h + 1) * rows)


def per_head(model: GGUFCausalLM, x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` ``[B, T, H, n]`` times head ``h``'s matrix of the 3-D weight ``name`` for each head (ggml_mul_mat with
    a 3-D src0), ``float32[B, T, H, rows]``; the observer sees the input per head."""
    model.observe(x, name)
    t = model.tensors[name]
    return torch.stack([model.linear(x[:, :, h], _head(model, t, h)) for h in range(x.shape[2])], dim=2)


def mla_attention(model: GGUFCausalLM, h: torch.Tensor, p: str, *, nope: int, rope: int, kv_lora: int,
                  v_dim: int) -> torch.Tensor:
    """Block ``p``'s MLA on the normed stream ``h`` ``[B, T, n_embd]``, output projection included (module
    docstring); the file's YaRN (``hparams.yarn``) in the rope and the scale."""
    hp = model.hparams
    yarn = hp.yarn
    bsz, t, _ = h.shape
    n_head = hp.n_head
    lite = model.optional_weight(p + "attn_q.weight") is not None
    if lite:
        model.observe(h, p + "attn_q.weight", p + "attn_kv_a_mqa.weight")
        q = model.linear(h, model.weight(p + "attn_q.weight"))
    else:
        model.observe(h, p + "attn_q_a.weight", p + "attn_kv_a_mqa.weight")
        q = model.norm(model.linear(h, model.weight(p + "attn_q_a.weight")), model.weight(p + "attn_q_a_norm.weight"),
                       None)
        model.observe(q, p + "attn_q_b.weight")
        q = model.linear(q, model.weight(p + "attn_q_b.weight"))
    q = q.reshape(bsz, t, n_head, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv = model.linear(h, model.weight(p + "attn_kv_a_mqa.weight"))
    latent, k_pe = kv[..., :kv_lora], kv[..., kv_lora:].reshape(bsz, t, 1, rope)
    q_pe = rope_pairs(q_pe, hp.rope_base, yarn)
    k_pe = rope_pairs(k_pe, hp.rope_base, yarn)
    latent = model.norm(latent, model.weight(p + "attn_kv_a_norm.weight"), None).reshape(bsz, t, 1, kv_lora)
    q_abs = per_head(model, q_nope.contiguous(), p + "attn_k_b.weight")  # [B, T, H, kv_lora]
    qc = torch.cat([q_abs, q_pe], dim=-1)
    kc = torch.cat([latent, k_pe], dim=-1)
    if model.kv_f16:  # llama.cpp's F16 K cache (the value is a view of its latent part)
        kc = round_f16(kc)
    vc = kc[..., :kv_lora]
    # kq_scale = mscale^2 / sqrt(n_embd_head_k) (llama_model_deepseek2::graph)
    scale = (kq_mscale(yarn) ** 2 if yarn is not None else 1.0) / math.sqrt(nope + rope)
    qh, kh, vh = qc.transpose(1, 2).to(model.dtype), kc.transpose(1, 2).to(model.dtype), vc.transpose(1, 2)
    kh = kh.expand(bsz, n_head, t, kv_lora + rope)
    vh = vh.to(model.dtype).expand(bsz, n_head, t, kv_lora)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    o = o.transpose(1, 2).to(torch.float32).contiguous()  # [B, T, H, kv_lora]
    o = per_head(model, o, p + "attn_v_b.weight").reshape(bsz, t, n_head * v_dim)
    model.observe(o, p + "attn_output.weight")
    return model.linear(o, model.weight(p + "attn_output.weight"))
