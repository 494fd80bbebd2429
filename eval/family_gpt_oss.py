"""gpt-oss (GGUF ``gpt-oss``) as llama.cpp's graph computes it (src/models/openai-moe.cpp, src/llama-graph.cpp).

Each block: ``x += attn(rms_norm(x) * attn_norm)``, then ``x += moe(rms_norm(x) * post_attention_norm)``.

* Attention: Q/K/V and output projections with biases, NEOX rope with YaRN (the shared rope of
  :meth:`ggufkit.eval.model.GGUFCausalLM.apply_rope`, ggml's rope_yarn: :mod:`ggufkit.eval.rope`), scale
  ``1/sqrt(head_dim)``, a learned sink per head in the softmax (ggml_soft_max_ext with sinks: one more logit per
  row, no value), sliding-window attention on the even layers (the loader's fixed pattern 2,
  LLAMA_SWA_TYPE_STANDARD).
* MoE (build_moe_ffn, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT): router logits plus ``ffn_gate_inp.bias``,
  the top-k logits selected and weighted by their softmax; each expert ``down(swiglu_oai(gate x + b_g,
  up x + b_u)) + b_d``, ggml_swiglu_oai: ``g = min(g, 7)``, ``u = clamp(u, -7, 7)``, ``g * sigmoid(1.702 g) *
  (u + 1)``. Biases are ggml_add_id, not matmuls: llama-imatrix sees the router, the three expert matmuls per
  expert, Q/K/V, the output projection and the head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ggufkit.errors import EvaluationError
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.shapes import attention_shapes, global_shapes

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.eval.qtensor import QTensor
    from ggufkit.format.reader import GGUFModel

#: src/llama-graph.cpp build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
#: the loader's sliding-window period (openai-moe.cpp load_arch_hparams: load_swa_pattern(ml, 2))
SWA_PATTERN = 2


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The sliding window (llama_model::load_hparams); YaRN is the shared rope's (:mod:`ggufkit.eval.rope`)."""
    scaling = str(file.get(f"{arch}.rope.scaling.type", "none"))
    if scaling not in ("none", "", "yarn"):
        raise EvaluationError(f"rope scaling {scaling!r} is not supported for gpt-oss", path=file.path)
    window = file.kv.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise EvaluationError(f"missing key {arch}.attention.sliding_window", path=file.path)
    return {"n_swa": int(window.value)}


def shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    out = global_shapes(hp, names)
    e, n = hp.n_embd, hp.n_expert
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        out.update(attention_shapes(hp, b, names))
        out.update({b + "attn_norm.weight": (e,), b + "post_attention_norm.weight": (e,),
                    b + "attn_sinks.weight": (hp.n_head,), b + "ffn_gate_inp.weight": (n, e),
                    b + "ffn_gate_inp.bias": (n,), b + "ffn_gate_exps.weight": (n, -1, e),
                    b + "ffn_up_exps.weight": (n, -1, e), b + "ffn_down_exps.weight": (n, e, -1),
                    b + "ffn_gate_exps.bias": (n, -1), b + "ffn_up_exps.bias": (n, -1),
                    b + "ffn_down_exps.bias": (n, e)})
    return out


def attention(model: GGUFCausalLM, h: torch.Tensor, p: str, swa: bool) -> torch.Tensor:
    """Biased projections, YaRN rope, softmax with a sink per head, the window on sliding layers."""
    hp = model.hparams
    bsz, t, _ = h.shape
    hd = hp.head_dim
    model.observe(h, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
    q = model.linear(h, model.weight(p + "attn_q.weight"), model.weight(p + "attn_q.bias"))
    k = model.linear(h, model.weight(p + "attn_k.weight"), model.weight(p + "attn_k.bias"))
    v = model.linear(h, model.weight(p + "attn_v.weight"), model.weight(p + "attn_v.bias"))
    # the same frequency scale on every layer (openai-moe.cpp load_arch_hparams copies it to the window's)
    q = model.apply_rope(q.reshape(bsz, t, hp.n_head, hd), hp.rope_base, hp.rope_scale).transpose(1, 2)
    k = model.apply_rope(k.reshape(bsz, t, hp.n_head_kv, hd), hp.rope_base, hp.rope_scale).transpose(1, 2)
    v = v.reshape(bsz, t, hp.n_head_kv, hd).transpose(1, 2)
    rep = hp.n_head // hp.n_head_kv
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
    i = torch.arange(t, device=h.device)
    visible = i[None, :] <= i[:, None]
    if swa:
        visible = visible & (i[:, None] - i[None, :] < hp.extra["n_swa"])
    scores = scores.masked_fill(~visible, float("-inf"))
    sinks = model.weight(p + "attn_sinks.weight").reshape(1, hp.n_head, 1, 1).expand(bsz, -1, t, 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :t]
    o = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, t, hp.n_head * hd)
    model.observe(o, p + "attn_output.weight")
    return model.linear(o, model.weight(p + "attn_output.weight"), model.weight(p + "attn_output.bias"))


def _expert(model: GGUFCausalLM, t: QTensor, e: int) -> torch.Tensor:
    rows = t.shape[1]
    return model.tag_src1(t.row_range(e * rows, (e + 1) * rows, model.dtype), t, e * rows, (e + 1) * rows)


def moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Biased router, softmax over the selected logits, biased experts with the clamped SwiGLU."""
    hp = model.hparams
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    logits = model.linear(x, model.weight(p + "ffn_gate_inp.weight"), model.weight(p + "ffn_gate_inp.bias"))
    top, selected = torch.topk(logits, hp.n_expert_used, dim=-1)
    weights = torch.softmax(top, dim=-1)
    k = selected.shape[-1]
    ids = selected.reshape(*shape[:-1], k)
    gate, up, down = (model.tensors[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    b_gate, b_up, b_down = (model.weight(p + f"ffn_{n}_exps.bias") for n in ("gate", "up", "down"))
    model.observe_routed(p + "ffn_gate_exps.weight", h.unsqueeze(2), ids)
    model.observe_routed(p + "ffn_up_exps.weight", h.unsqueeze(2), ids)
    acts = x.new_zeros((x.shape[0], k, down.shape[2])) if model.observer is not None else None
    out = torch.zeros_like(x)
    for e in torch.unique(selected).tolist():
        rows, slot = torch.nonzero(selected == e, as_tuple=True)
        xe = x[rows]
        g = model.linear(xe, _expert(model, gate, e), b_gate[e]).clamp(max=SWIGLU_LIMIT)
        u = model.linear(xe, _expert(model, up, e), b_up[e]).clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        a = g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)
        if acts is not None:
            acts[rows, slot] = a
        y = model.linear(a, _expert(model, down, e), b_down[e])
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if acts is not None:
        model.observe_routed(p + "ffn_down_exps.weight", acts.reshape(*shape[:-1], k, -1), ids)
    return out.reshape(shape)


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    il = int(p.split(".")[1])
    swa = il % SWA_PATTERN < SWA_PATTERN - 1
    x = x + attention(model, model.norm(x, model.weight(p + "attn_norm.weight"), None), p, swa)
    return x + moe(model, model.norm(x, model.weight(p + "post_attention_norm.weight"), None), p)


FORWARD = FamilyForward(read=read, shapes=shapes, block=block)
