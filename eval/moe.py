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

if TYPE_CHECKING:
    from ggufkit.eval.model import GGUFCausalLM


def moe_ffn(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """The MoE FFN of block prefix ``p`` on ``h`` ``[B, T, n_embd]`` (float32)."""
    hp = model.hparams
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    router = model._linear(x, model._r(p + "ffn_gate_inp.weight"))
    probs = torch.softmax(router, dim=-1)
    weights, selected = torch.topk(probs, hp.n_expert_used, dim=-1)
    if hp.moe_norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    gate = model.tensors[p + "ffn_gate_exps.weight"]
    up = model.tensors[p + "ffn_up_exps.weight"]
    down = model.tensors[p + "ffn_down_exps.weight"]
    out = torch.zeros_like(x)
    for e in torch.unique(selected).tolist():
        rows, slot = torch.nonzero(selected == e, as_tuple=True)
        xe = x[rows]
        g = model._linear(xe, _expert(gate, e, model.dtype))
        u = model._linear(xe, _expert(up, e, model.dtype))
        y = model._linear(F.silu(g) * u, _expert(down, e, model.dtype))
        out.index_add_(0, rows, y * weights[rows, slot, None])
    shared_up = model._w(p + "ffn_up_shexp.weight")
    if shared_up is not None:
        su = model._linear(x, shared_up)
        sg = model._linear(x, model._r(p + "ffn_gate_shexp.weight"))
        y = model._linear(F.silu(sg) * su, model._r(p + "ffn_down_shexp.weight"))
        gate_inp = model._r(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
        out = out + y * torch.sigmoid(model._linear(x, gate_inp))
    return out.reshape(shape)


def _expert(t: object, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s matrix of a stacked ``[n_expert, rows, cols]`` tensor, dequantized."""
    from ggufkit.eval.model import QTensor

    assert isinstance(t, QTensor)
    rows = t.shape[1]
    return t.row_range(e * rows, (e + 1) * rows, dtype)
