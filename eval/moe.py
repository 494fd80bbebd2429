"""Mixture-of-experts feed-forward for the evaluator: router, top-k experts, optional shared expert.

As llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp) with softmax gating: probabilities over all experts,
the ``n_expert_used`` largest selected, optionally renormalised to sum to one (the architecture's trait),
each selected expert's SiLU-gated FFN weighted by its probability and summed. A shared expert
(``ffn_*_shexp``), when present, is added gated by ``sigmoid(ffn_gate_inp_shexp · x)`` (qwen2moe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ggufkit.eval.qtensor import QTensor

if TYPE_CHECKING:
    from ggufkit.eval.model import GGUFCausalLM


def moe_ffn(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """The MoE FFN of block prefix ``p`` on ``h`` ``[B, T, n_embd]`` (float32), through the model's layer
    interface (:class:`ggufkit.eval.model.GGUFCausalLM`'s docstring): softmax router, top-k experts, the
    optional sigmoid-gated shared expert."""
    hp = model.hparams
    x = h.reshape(-1, h.shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    router = model.linear(x, model.weight(p + "ffn_gate_inp.weight"))
    probs = torch.softmax(router, dim=-1)
    weights, selected = torch.topk(probs, hp.n_expert_used, dim=-1)
    if hp.moe_norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = routed_experts(model, h, p, weights, selected)
    if model.optional_weight(p + "ffn_up_shexp.weight") is not None:
        out = out + shared_expert(model, h, p)
    return out.reshape(h.shape)


def route(logits: torch.Tensor, n_used: int, *, gating: str = "softmax", bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 0, norm: bool = False, scale: float = 0.0,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of build_moe_ffn (src/llama-graph.cpp) on the gate's ``logits`` ``float32[N, n_expert]``.

    ``gating`` ``"softmax"`` or ``"sigmoid"`` gives the probabilities; ``bias`` (``ffn_exp_probs_b``,
    DeepSeek V3's e_score_correction_bias) is added for the selection only; with ``n_group`` > 1 the experts
    form ``n_group`` consecutive groups, each scored by the sum of its two best biased probabilities, and
    only the ``topk_group`` best groups stay selectable; the ``n_used`` best experts are then picked and
    weighted by their unbiased probabilities, renormalised to sum to one when ``norm`` (the sum clamped to
    F16's smallest normal) and multiplied by ``scale`` unless it is 0 or 1 (expert_weights_scale).

    Returns:
        ``(weights float32[N, n_used], selected int64[N, n_used])``.
    """
    if gating == "softmax":
        probs = torch.softmax(logits, dim=-1)
    elif gating == "sigmoid":
        probs = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown gating {gating!r}")
    select = probs if bias is None else probs + bias
    if n_group > 1:
        n, n_expert = select.shape
        groups = select.reshape(n, n_group, n_expert // n_group)
        group_scores = torch.topk(groups, 2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        select = groups.masked_fill(~mask[..., None], float("-inf")).reshape(n, n_expert)
    selected = torch.topk(select, n_used, dim=-1).indices
    weights = torch.gather(probs, 1, selected)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=6.103515625e-5)
    if scale not in (0.0, 1.0):
        weights = weights * scale
    return weights, selected


def routed_moe(model: GGUFCausalLM, h: torch.Tensor, p: str, **router: Any) -> torch.Tensor:
    """Block ``p``'s experts picked by :func:`route` (``router``: its gating, groups, renormalisation, scale)
    over ``ffn_gate_inp``'s logits with the file's selection bias (``exp_probs_b``), plus its ungated shared
    experts where the file has them, on ``h`` ``[B, T, n_embd]`` (build_moe_ffn and the shared-expert sum of
    src/models/deepseek2.cpp, glm4-moe.cpp, ernie4-5-moe.cpp)."""
    flat = h.reshape(-1, h.shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    logits = model.linear(flat, model.weight(p + "ffn_gate_inp.weight"))
    bias = model.optional_weight(p + "exp_probs_b.bias")
    weights, selected = route(logits, model.hparams.n_expert_used, bias=None if bias is None else bias.reshape(-1),
                              **router)
    out = routed_experts(model, h, p, weights, selected)
    if p + "ffn_up_shexp.weight" in model.tensors:
        out = out + shared_expert(model, h, p, gated=False)
    return out.reshape(h.shape)


def routed_experts(model: GGUFCausalLM, h: torch.Tensor, p: str, weights: torch.Tensor, selected: torch.Tensor,
                   act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """The selected experts of block ``p`` on ``h`` ``[B, T, n_embd]``, each weighted and summed, as
    build_moe_ffn's expert part: ``down(act(gate x) * up x)`` (``act`` SiLU unless given).

    Args:
        weights: ``float32[B*T, k]`` each slot's weight (what the family's router computed).
        selected: ``int64[B*T, k]`` each slot's expert.

    Returns:
        ``float32[B*T, n_embd]``. The observer sees the inputs of ``ffn_{gate,up,down}_exps`` per expert.
    """
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    k = selected.shape[-1]
    gate = model.tensors[p + "ffn_gate_exps.weight"]
    up = model.tensors[p + "ffn_up_exps.weight"]
    down = model.tensors[p + "ffn_down_exps.weight"]
    out = torch.zeros_like(x)
    ids = selected.reshape(*shape[:-1], k)
    model.observe_routed(p + "ffn_gate_exps.weight", h.unsqueeze(2), ids)
    model.observe_routed(p + "ffn_up_exps.weight", h.unsqueeze(2), ids)
    # ffn_down_exps' input differs per (token, slot): collected only when an observer wants it.
    acts = x.new_zeros((x.shape[0], k, down.shape[2])) if model.observer is not None else None
    for e in torch.unique(selected).tolist():
        rows, slot = torch.nonzero(selected == e, as_tuple=True)
        xe = x[rows]
        g = model.linear(xe, _expert(model, gate, e))
        u = model.linear(xe, _expert(model, up, e))
        a = act(g) * u
        if acts is not None:
            acts[rows, slot] = a
        y = model.linear(a, _expert(model, down, e))
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if acts is not None:
        model.observe_routed(p + "ffn_down_exps.weight", acts.reshape(*shape[:-1], k, -1), ids)
    return out


def shared_expert(model: GGUFCausalLM, h: torch.Tensor, p: str, gated: bool = True) -> torch.Tensor:
    """Block ``p``'s shared expert (``ffn_*_shexp``) on ``h`` ``[B, T, n_embd]``, SiLU-gated, times
    ``sigmoid(ffn_gate_inp_shexp · x)`` when ``gated`` (qwen2moe); ``float32[B*T, n_embd]``."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    names = (p + "ffn_up_shexp.weight", p + "ffn_gate_shexp.weight")
    # ffn_gate_inp_shexp is a vector, but llama.cpp multiplies it as a matrix (ggml_mul_mat in
    # src/models/qwen2moe.cpp), so llama-imatrix collects it too.
    model.observe(h, *names, *((p + "ffn_gate_inp_shexp.weight",) if gated else ()))
    su = model.linear(x, model.weight(names[0]))
    sg = model.linear(x, model.weight(names[1]))
    a = F.silu(sg) * su
    model.observe(a.reshape(*shape[:-1], -1), p + "ffn_down_shexp.weight")
    y = model.linear(a, model.weight(p + "ffn_down_shexp.weight"))
    if not gated:
        return y
    gate_inp = model.weight(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    return y * torch.sigmoid(model.linear(x, gate_inp))


def _expert(model: GGUFCausalLM, t: QTensor, e: int) -> torch.Tensor:
    """Expert ``e``'s matrix of a stacked ``[n_expert, rows, cols]`` tensor, dequantized (and marked for
    ggml's input rounding, as :meth:`GGUFCausalLM.weight` marks a dense weight)."""
    rows = t.shape[1]
    return model.tag_src1(t.row_range(e * rows, (e + 1) * rows, model.dtype), t, e * rows, (e + 1) * rows)
