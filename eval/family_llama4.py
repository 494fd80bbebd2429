"""Llama 4 (``llama4``) as llama.cpp's graph computes it (src/models/llama4.cpp, build_moe_ffn in
src/llama-graph.cpp).

Each block: RMSNorm (``attn_norm``), self-attention, the result joins the stream; RMSNorm (``ffn_norm``), then a
dense SiLU-gated FFN or, on every ``interleave_moe_layer_step``-th layer, the routed experts plus an ungated
shared expert; the result joins the stream.

Attention: no q/k norm weights. On a RoPE layer (all but every 4th, the loader's ``n_no_rope_layer_step``) Q and K
are rotated (NORM rope, llama3 ``rope_freqs``), then L2-normalised per head (``ggml_rms_norm`` without a weight,
transformers' Llama4TextL2Norm; unless the file has 128 experts, the loader's ``use_kq_norm``), and the layer
attends in chunks: a token sees the earlier tokens of its own chunk of ``n_swa`` = 8192 (LLAMA_SWA_TYPE_CHUNKED).
On a NoPE layer the queries are multiplied by the temperature ``log(floor((pos + 1) / 8192) + 1) * 0.1 + 1``
(build_inp_attn_scale) and attention is causal over the whole context. Scale ``1/sqrt(head_dim)``.

The router (LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID with llama4's weight-before-FFN): the ``n_expert_used`` largest
router logits choose the experts, each weighted by the sigmoid of its logit; the weight multiplies the expert's
INPUT (``ffn_moe_weighted`` before the expert matmuls), so llama-imatrix collects the weighted rows for
``ffn_gate_exps`` / ``ffn_up_exps``; the expert outputs are summed as they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ggufkit.errors import EvaluationError
from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.family_lfm2 import dense_ffn
from ggufkit.eval.ggml_cpu import round_f16
from ggufkit.eval.moe import shared_expert

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

#: llama_model_llama4::load_arch_hparams: n_no_rope_layer_step (default 4), n_swa, the temperature constants.
NO_ROPE_STEP = 4
CHUNK = 8192
FLOOR_SCALE = 8192
TEMP_SCALE = 0.1
#: LLM_TYPE_17B_128E: the loader's one type without the L2 q/k norm.
N_EXPERT_NO_QK_NORM = 128


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The MoE step (required), whether q/k are L2-normalised, and the chunk size and temperature constants the
    loader fixes; a file with ``attention.sliding_window`` 0 is refused (llama.cpp's graph aborts on it)."""
    name = f"{arch}.interleave_moe_layer_step"
    field = file.kv.get(name)
    if field is None:
        raise EvaluationError(f"missing key {name!r} (llama.cpp's llama4 loader requires it)", path=file.path)
    step = field.value
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise EvaluationError(f"{name} must be a non-negative integer, not {step!r}", path=file.path)
    window = file.kv.get(f"{arch}.attention.sliding_window")
    if window is not None and window.value == 0:
        raise EvaluationError("llama4 with attention.sliding_window 0 (no chunked attention) is not supported: "
                              "llama.cpp's graph aborts on its temperature-tuning input", path=file.path)
    n_expert = int(getattr(file.kv.get(f"{arch}.expert_count"), "value", 0) or 0)
    return {"moe": tuple(step > 0 and (il + 1) % step == 0 for il in range(n_layer)),
            "qk_norm": n_expert != N_EXPERT_NO_QK_NORM, "chunk": CHUNK, "floor_scale": FLOOR_SCALE,
            "temp_scale": TEMP_SCALE}


def expected_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Embeddings, head and rope factors, then per block its norms, attention, and dense FFN or router,
    stacked experts and shared expert."""
    e = hp.n_embd
    out = shapes.global_shapes(hp, names)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "ffn_norm.weight"] = (e,)
        out.update(shapes.attention_shapes(hp, b, names))
        if hp.extra["moe"][il]:
            out.update(shapes.ffn_shapes(hp, b, names))
            for n in ("ffn_up_shexp.weight", "ffn_gate_shexp.weight"):
                out[b + n] = (-1, e)
            out[b + "ffn_down_shexp.weight"] = (e, -1)
            out.pop(b + "ffn_gate_inp_shexp.weight", None)
        else:
            out[b + "ffn_up.weight"] = (-1, e)
            out[b + "ffn_gate.weight"] = (-1, e)
            out[b + "ffn_down.weight"] = (e, -1)
    return out


def temperature(t: int, floor_scale: int = FLOOR_SCALE, scale: float = TEMP_SCALE,
                device: torch.device | None = None) -> torch.Tensor:
    """The NoPE layers' query scale per position ``float32[t]`` (llm_graph_input_attn_temp::set_input)."""
    pos = torch.arange(t, dtype=torch.float32)
    out = torch.log(torch.floor((pos + 1.0) / floor_scale) + 1.0) * scale + 1.0
    return out.to(device) if device is not None else out


def chunk_mask(t: int, chunk: int, device: torch.device | None = None) -> torch.Tensor:
    """``bool[t, t]``: query ``i`` sees key ``j`` when ``j <= i`` and both lie in the same chunk of ``chunk``
    tokens (llama_hparams::is_masked_swa, LLAMA_SWA_TYPE_CHUNKED: ``p0 < (p1 / n_swa) * n_swa`` is masked)."""
    pos = torch.arange(t, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] >= (pos[:, None] // chunk) * chunk)


def attention(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s self-attention on the normed stream ``h`` ``[B, T, n_embd]`` (module docstring)."""
    hp = model.hparams
    extra = hp.extra
    bsz, t, _ = h.shape
    hd = hp.head_dim
    model.observe(h, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
    q = model.linear(h, model.weight(p + "attn_q.weight")).reshape(bsz, t, hp.n_head, hd)
    k = model.linear(h, model.weight(p + "attn_k.weight")).reshape(bsz, t, hp.n_head_kv, hd)
    v = model.linear(h, model.weight(p + "attn_v.weight")).reshape(bsz, t, hp.n_head_kv, hd)
    il = int(p.split(".")[1])
    rope = (il + 1) % NO_ROPE_STEP != 0
    if rope:
        q, k = model.apply_rope(q, hp.rope_base, hp.rope_scale), model.apply_rope(k, hp.rope_base, hp.rope_scale)
        if extra["qk_norm"]:  # Llama4TextL2Norm: ggml_rms_norm without a weight, per head
            q = F.rms_norm(q, (hd,), eps=hp.eps)
            k = F.rms_norm(k, (hd,), eps=hp.eps)
    else:
        q = q * temperature(t, extra["floor_scale"], extra["temp_scale"], q.device)[None, :, None, None]
    if model.kv_f16:  # llama.cpp's F16 K/V cache
        k, v = round_f16(k), round_f16(v)
    q, k, v = (z.transpose(1, 2).to(model.dtype) for z in (q, k, v))  # [B, H, T, hd]
    if hp.n_head_kv != hp.n_head:
        rep = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(hd)
    if rope and t > extra["chunk"]:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask(t, extra["chunk"], q.device), scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    o = o.transpose(1, 2).reshape(bsz, t, hp.n_head * hd).to(torch.float32)
    model.observe(o, p + "attn_output.weight")
    return model.linear(o, model.weight(p + "attn_output.weight"))


def route(logits: torch.Tensor, n_used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama4's router: the ``n_used`` largest logits choose the experts, weighted by their sigmoids
    (build_moe_ffn: ``selection_probs = logits`` for LLM_ARCH_LLAMA4, weights from ``sigmoid(logits)``, no
    renormalisation). Returns ``(weights float32[N, k], selected int64[N, k])``."""
    selected = torch.topk(logits, n_used, dim=-1).indices
    return torch.sigmoid(logits).gather(-1, selected), selected


def routed_experts_weighted_input(model: GGUFCausalLM, h: torch.Tensor, p: str, weights: torch.Tensor,
                                  selected: torch.Tensor) -> torch.Tensor:
    """The selected experts of block ``p`` on ``h`` ``[B, T, n_embd]``, each fed its input times its weight and
    summed as they are (``weight_before_ffn``); ``float32[B*T, n_embd]``. The observer sees the weighted inputs of
    ``ffn_{gate,up}_exps`` and the activations of ``ffn_down_exps``, per slot and expert."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    k = selected.shape[-1]
    xw = x[:, None, :] * weights[:, :, None]  # [N, k, n_embd] (ggml_mul of the repeated input by the weights)
    ids = selected.reshape(*shape[:-1], k)
    model.observe_routed(p + "ffn_gate_exps.weight", xw.reshape(*shape[:-1], k, -1), ids)
    model.observe_routed(p + "ffn_up_exps.weight", xw.reshape(*shape[:-1], k, -1), ids)
    gate, up, down = (model.tensors[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    acts = x.new_zeros((x.shape[0], k, down.shape[2])) if model.observer is not None else None
    out = torch.zeros_like(x)
    for e in torch.unique(selected).tolist():
        rows, slot = torch.nonzero(selected == e, as_tuple=True)
        xe = xw[rows, slot]
        a = F.silu(model.linear(xe, _expert(model, gate, e))) * model.linear(xe, _expert(model, up, e))
        if acts is not None:
            acts[rows, slot] = a
        out.index_add_(0, rows, model.linear(a, _expert(model, down, e)))
    if acts is not None:
        model.observe_routed(p + "ffn_down_exps.weight", acts.reshape(*shape[:-1], k, -1), ids)
    return out


def _expert(model: GGUFCausalLM, t: Any, e: int) -> torch.Tensor:
    """Expert ``e``'s rows of a stacked ``[n_expert, rows, cols]`` tensor, dequantized and tagged for ggml's
    input rounding (as :func:`ggufkit.eval.moe.routed_experts` reads them)."""
    rows = t.shape[1]
    return model.tag_src1(t.row_range(e * rows, (e + 1) * rows, model.dtype), t, e * rows, (e + 1) * rows)


def moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s routed experts plus its ungated shared expert on ``h`` ``[B, T, n_embd]``."""
    x = h.reshape(-1, h.shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    weights, selected = route(model.linear(x, model.weight(p + "ffn_gate_inp.weight")), model.hparams.n_expert_used)
    out = routed_experts_weighted_input(model, h, p, weights, selected)
    return (out + shared_expert(model, h, p, gated=False)).reshape(h.shape)


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p`` on the residual stream ``x`` ``[B, T, n_embd]`` (module docstring)."""
    il = int(p.split(".")[1])
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    x = x + attention(model, h, p)
    h = model.norm(x, model.weight(p + "ffn_norm.weight"), None)
    return x + (moe(model, h, p) if model.hparams.extra["moe"][il] else dense_ffn(model, h, p))


FORWARD = FamilyForward(read=read, shapes=expected_shapes, block=block)
