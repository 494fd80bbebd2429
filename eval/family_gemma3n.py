"""Gemma 3n (``gemma3n``) as llama.cpp's graph computes it (src/models/gemma3n.cpp, llama_model_gemma3n::graph).

State: 4 AltUp streams ``[n_altup, B, T, n_embd]`` plus the per-layer inputs ``[B, T, n_layer, 256]`` and the
K/V of the layers that compute them (layers 20 on reuse layer 18's, sliding, or 19's, global).

* embed: the scaled token embeddings are stream 0; streams 1-3 are ``altup_proj[i] · x`` rescaled to stream 0's
  magnitude. Per-layer inputs: ``per_layer_token_embd`` rows times sqrt(256), plus the RMS-normed
  (``per_layer_proj_norm``) ``per_layer_model_proj · x / sqrt(n_embd)``, times 1/sqrt(2)
  (build_inp_per_layer, project_per_layer_inputs).
* block: AltUp predict (router ``tanh(altup_router · rms(x_0)·w / n_embd)``, ``altup_predict_coef`` mixes the
  streams), on the active prediction: attention (q/k RMS norms with weights, v without, NEOX RoPE, query scale
  1, sliding window per layer) and LAuReL, sandwich-normed; the FFN with the gaussian top-k on layers 0-9
  (``relu(g - mean - 1.6448533 * std)``, std with n - 1) before tanh GELU; AltUp correct; the per-layer input
  gate (``gelu(inp_gate · (x_0 * altup_correct_scale)) * per_layer_input``, ``proj``, ``post_norm``) added to
  streams 1-3.
* finish: streams 1-3 through ``altup_unembd_proj`` rescaled to stream 0's magnitude, the 4 averaged.

GELU is llama.cpp's CPU one, a lookup in an F16 table (ggml-cpu/vec.h GGML_GELU_FP16;
:func:`ggufkit.eval.ggml_cpu.gelu_f16_table`): over Gemma 3n's 30-35 layers of AltUp streams the float32 GELU
drifts from llama-perplexity by more than 0.1 % (measured 0.3 % on the 22-layer test model).

Every ``build_lora_mm`` / ``ggml_mul_mat`` with a ``blk.*`` weight is observed where llama-imatrix collects it
(its filter: tools/imatrix/imatrix.cpp collect_imatrix): altup_router twice (predict, correct), altup_predict_coef,
altup_correct_coef, laurel_l/r, attn_q (and attn_k/attn_v where the layer has K/V), attn_output, ffn_up/gate/down,
inp_gate, proj; ``altup_proj``, ``altup_unembd_proj`` and ``per_layer_model_proj`` are not ``blk.*``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.ggml_cpu import gelu_f16_table

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

#: What llama.cpp fixes for gemma3n (src/llama-hparams.h; gemma3n.cpp load_arch_hparams and graph).
N_ALTUP = 4
N_EMBD_ALTUP = 256
N_LAYER_KV_FROM_START = 20
N_LAYER_SPARSITY = 10
F_SPARSITY_STD_MUL = 1.6448533535003662


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The fixed AltUp / per-layer sizes (llama.cpp reads none of their keys)."""
    del file, arch
    return {"n_altup": N_ALTUP, "n_embd_altup": N_EMBD_ALTUP, "kv_from_start": min(N_LAYER_KV_FROM_START, n_layer)}


def expected_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Global AltUp and per-layer tensors, then per block attention, FFN, AltUp, LAuReL and per-layer gate."""
    e, a, n = hp.n_embd, N_EMBD_ALTUP, N_ALTUP
    out = shapes.global_shapes(hp, names)
    out["altup_proj.weight"] = (n - 1, e, e)
    out["altup_unembd_proj.weight"] = (n - 1, e, e)
    out["per_layer_token_embd.weight"] = (hp.n_vocab, a * hp.n_layer)
    out["per_layer_model_proj.weight"] = (a * hp.n_layer, e)
    out["per_layer_proj_norm.weight"] = (a,)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        out.update(shapes.attention_shapes(hp, b, names | {b + "attn_q_norm.weight"}))
        out[b + "ffn_up.weight"] = (-1, e)
        out[b + "ffn_gate.weight"] = (-1, e)
        out[b + "ffn_down.weight"] = (e, -1)
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm",
                     "altup_correct_scale", "altup_router_norm", "laurel_post_norm"):
            out[b + norm + ".weight"] = (e,)
        out[b + "inp_gate.weight"] = (a, e)
        out[b + "proj.weight"] = (e, a)
        out[b + "altup_correct_coef.weight"] = (n, n)
        out[b + "altup_predict_coef.weight"] = (n * n, n)
        out[b + "altup_router.weight"] = (n, e)
        out[b + "laurel_l.weight"] = (-1, e)
        out[b + "laurel_r.weight"] = (e, -1)
    return out


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    return x.square().sum(dim=-1, keepdim=True).sqrt()


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return x * target / _magnitude(x)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def embed(model: GGUFCausalLM, tokens: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    """Streams and per-layer inputs from the scaled embeddings ``x`` (module docstring)."""
    hp = model.hparams
    a = N_EMBD_ALTUP
    per_tok = model.tensors["per_layer_token_embd.weight"].rows(tokens) * _f32(math.sqrt(a))
    proj = model.linear(x, model.weight("per_layer_model_proj.weight")) * _f32(1.0 / math.sqrt(hp.n_embd))
    proj = proj.reshape(*x.shape[:2], hp.n_layer, a)
    proj = model.norm(proj, model.weight("per_layer_proj_norm.weight"), None)
    per_layer = (proj + per_tok.reshape(proj.shape)) * _f32(1.0 / math.sqrt(2.0))
    w = model.weight("altup_proj.weight")
    target = _magnitude(x)
    streams = [x] + [_rescaled(model.linear(x, w[i]), target) for i in range(N_ALTUP - 1)]
    return {"streams": torch.stack(streams), "per_layer": per_layer, "kv": {}}


def _router(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """``tanh(altup_router · (rms(x) * altup_router_norm / n_embd))`` ``[B, T, n_altup]``."""
    h = model.norm(x, model.weight(p + "altup_router_norm.weight"), None) * _f32(1.0 / model.hparams.n_embd)
    model.observe(h, p + "altup_router.weight")
    return torch.tanh(model.linear(h, model.weight(p + "altup_router.weight")))


def _attention(model: GGUFCausalLM, h: torch.Tensor, p: str, il: int, kv: dict[int, Any]) -> torch.Tensor:
    hp = model.hparams
    bsz, t, _ = h.shape
    hd = hp.head_dim
    own = il < model.hparams.extra["kv_from_start"]
    model.observe(h, *(p + f"attn_{x}.weight" for x in ("qkv" if own else "q")))
    q = model.linear(h, model.weight(p + "attn_q.weight")).reshape(bsz, t, hp.n_head, hd)
    q = model.norm(q, model.weight(p + "attn_q_norm.weight"), None)
    swa = hp.is_swa(il)
    base, scale = (hp.rope_base_swa, hp.rope_scale_swa) if swa else (hp.rope_base, hp.rope_scale)
    q = model.apply_rope(q, base, scale)
    if own:
        k = model.linear(h, model.weight(p + "attn_k.weight")).reshape(bsz, t, hp.n_head_kv, hd)
        v = model.linear(h, model.weight(p + "attn_v.weight")).reshape(bsz, t, hp.n_head_kv, hd)
        k = model.apply_rope(model.norm(k, model.weight(p + "attn_k_norm.weight"), None), base, scale)
        v = _rms(v, hp.eps)
        kv[il] = (k, v)
    else:  # llama.cpp's reuse callback: layer n_layer_kv_from_start - 2 (sliding) or - 1 (global)
        k, v = kv[model.hparams.extra["kv_from_start"] - (2 if swa else 1)]
    rep = hp.n_head // hp.n_head_kv
    qh, kh, vh = (z.transpose(1, 2) for z in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2))  # f_attention_scale = 1
    i = torch.arange(t, device=h.device)
    visible = i[None, :] <= i[:, None]
    if swa:
        visible = visible & (i[:, None] - i[None, :] < hp.n_swa)
    o = torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1), vh)
    o = o.transpose(1, 2).reshape(bsz, t, hp.n_head * hd)
    model.observe(o, p + "attn_output.weight")
    return model.linear(o, model.weight(p + "attn_output.weight"))


def _ffn(model: GGUFCausalLM, h: torch.Tensor, p: str, il: int) -> torch.Tensor:
    model.observe(h, p + "ffn_up.weight", p + "ffn_gate.weight")
    up = model.linear(h, model.weight(p + "ffn_up.weight"))
    gate = model.linear(h, model.weight(p + "ffn_gate.weight"))
    if il < N_LAYER_SPARSITY:  # gaussian_topk
        mean = gate.mean(dim=-1, keepdim=True)
        std = ((gate - mean).square().sum(dim=-1, keepdim=True) * _f32(1.0 / (gate.shape[-1] - 1))).sqrt()
        gate = torch.relu(gate - (mean + std * _f32(F_SPARSITY_STD_MUL)))
    a = up * gelu_f16_table(gate)
    model.observe(a, p + "ffn_down.weight")
    return model.linear(a, model.weight(p + "ffn_down.weight"))


def block(model: GGUFCausalLM, state: dict[str, Any], p: str) -> dict[str, Any]:
    """Block ``p`` on the AltUp streams (module docstring)."""
    il = int(p.split(".")[1])
    n = N_ALTUP
    streams = state["streams"]  # [n, B, T, E]
    coefs = model.linear(_observed(model, _router(model, streams[0], p), p + "altup_predict_coef.weight"),
                         model.weight(p + "altup_predict_coef.weight"))  # [B, T, n*n]: index k + n*j
    coefs = coefs.reshape(*coefs.shape[:2], n, n)  # [B, T, j, k]
    predictions = torch.einsum("kbte,btjk->jbte", streams, coefs) + streams
    active = predictions[0]
    cur = model.norm(active, model.weight(p + "attn_norm.weight"), None)
    model.observe(cur, p + "laurel_l.weight")
    lr = model.linear(cur, model.weight(p + "laurel_l.weight"))
    model.observe(lr, p + "laurel_r.weight")
    lr = model.linear(lr, model.weight(p + "laurel_r.weight"))
    laurel = model.norm(lr, model.weight(p + "laurel_post_norm.weight"), None) + cur
    attn = model.norm(_attention(model, cur, p, il, state["kv"]), model.weight(p + "post_attention_norm.weight"),
                      None) + active
    attn_laurel = (attn + laurel) * _f32(1.0 / math.sqrt(2.0))
    ffn = _ffn(model, model.norm(attn_laurel, model.weight(p + "ffn_norm.weight"), None), p, il)
    activated = model.norm(ffn, model.weight(p + "post_ffw_norm.weight"), None) + attn_laurel
    # altup_correct
    modalities = _router(model, activated, p)
    model.observe(modalities, p + "altup_correct_coef.weight")
    ccoef = model.linear(modalities, model.weight(p + "altup_correct_coef.weight")) + 1.0  # [B, T, n]
    innovation = activated - active
    corrected = innovation[None] * ccoef.permute(2, 0, 1)[..., None] + predictions
    first = corrected[0] * model.weight(p + "altup_correct_scale.weight")
    model.observe(first, p + "inp_gate.weight")
    gated = gelu_f16_table(model.linear(first, model.weight(p + "inp_gate.weight")))
    gated = gated * state["per_layer"][:, :, il]
    model.observe(gated, p + "proj.weight")
    out = model.norm(model.linear(gated, model.weight(p + "proj.weight")), model.weight(p + "post_norm.weight"), None)
    corrected = torch.cat([corrected[:1], corrected[1:] + out[None]])
    return {**state, "streams": corrected}


def _observed(model: GGUFCausalLM, x: torch.Tensor, name: str) -> torch.Tensor:
    model.observe(x, name)
    return x


def finish(model: GGUFCausalLM, state: dict[str, Any]) -> torch.Tensor:
    """Streams 1-3 through ``altup_unembd_proj``, rescaled to stream 0's magnitude, the 4 averaged."""
    streams = state["streams"]
    w = model.weight("altup_unembd_proj.weight")
    target = _magnitude(streams[0])
    cur = streams[0]
    for i in range(N_ALTUP - 1):
        cur = cur + _rescaled(model.linear(streams[i + 1], w[i]), target)
    return cur * _f32(1.0 / N_ALTUP)


FORWARD = FamilyForward(read=read, shapes=expected_shapes, block=block, embed=embed, finish=finish)
