"""Mixture-of-experts feed-forward for the evaluator: router, top-k experts, optional shared expert.

As llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp) with softmax gating: probabilities over all experts,
the ``n_expert_used`` largest selected, optionally renormalised to sum to one (the architecture's trait),
each selected expert's SiLU-gated FFN weighted by its probability and summed. A shared expert
(``ffn_*_shexp``), when present, is added gated by ``sigmoid(ffn_gate_inp_shexp · x)`` (qwen2moe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ggufkit.eval.qtensor import QTensor

if TYPE_CHECKING:
    from ggufkit.eval.model import GGUFCausalLM


def moe_ffn(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """The MoE FFN of block prefix ``p`` on ``h`` ``[B, T, n_embd]`` (float32), through the model's layer
    interface (:class:`ggufkit.eval.model.GGUFCausalLM`'s docstring)."""
    hp = model.hparams
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    router = model.linear(x, model.weight(p + "ffn_gate_inp.weight"))
    probs = torch.softmax(router, dim=-1)
    weights, selected = torch.topk(probs, hp.n_expert_used, dim=-1)
    if hp.moe_norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    gate = model.tensors[p + "ffn_gate_exps.weight"]
    up = model.tensors[p + "ffn_up_exps.weight"]
    down = model.tensors[p + "ffn_down_exps.weight"]
    out = torch.zeros_like(x)
    ids = selected.reshape(*shape[:-1], hp.n_expert_used)
    model.observe_routed(p + "ffn_gate_exps.weight", h.unsqueeze(2), ids)
    model.observe_routed(p + "ffn_up_exps.weight", h.unsqueeze(2), ids)
    # ffn_down_exps' input differs per (token, slot): collected only when an observer wants it.
    acts = x.new_zeros((x.shape[0], hp.n_expert_used, down.shape[2])) if model.observer is not None else None
    for e in torch.unique(selected).tolist():
        rows, slot = torch.nonzero(selected == e, as_tuple=True)
        xe = x[rows]
        g = model.linear(xe, _expert(model, gate, e))
        u = model.linear(xe, _expert(model, up, e))
        a = F.silu(g) * u
        if acts is not None:
            acts[rows, slot] = a
        y = model.linear(a, _expert(model, down, e))
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if acts is not None:
        model.observe_routed(p + "ffn_down_exps.weight", acts.reshape(*shape[:-1], hp.n_expert_used, -1), ids)
    shared_up = model.optional_weight(p + "ffn_up_shexp.weight")
    if shared_up is not None:
        # ffn_gate_inp_shexp is a vector, but llama.cpp multiplies it as a matrix (ggml_mul_mat in
        # src/models/qwen2moe.cpp), so llama-imatrix collects it too.
        model.observe(h, p + "ffn_up_shexp.weight", p + "ffn_gate_shexp.weight", p + "ffn_gate_inp_shexp.weight")
        su = model.linear(x, shared_up)
        sg = model.linear(x, model.weight(p + "ffn_gate_shexp.weight"))
        a = F.silu(sg) * su
        model.observe(a.reshape(*shape[:-1], -1), p + "ffn_down_shexp.weight")
        y = model.linear(a, model.weight(p + "ffn_down_shexp.weight"))
        gate_inp = model.weight(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
        out = out + y * torch.sigmoid(model.linear(x, gate_inp))
    return out.reshape(shape)


def _expert(model: GGUFCausalLM, t: QTensor, e: int) -> torch.Tensor:
    """Expert ``e``'s matrix of a stacked ``[n_expert, rows, cols]`` tensor, dequantized (and marked for
    ggml's input rounding, as :meth:`GGUFCausalLM.weight` marks a dense weight)."""
    rows = t.shape[1]
    return model.tag_src1(t.row_range(e * rows, (e + 1) * rows, model.dtype), t, e * rows, (e + 1) * rows)
