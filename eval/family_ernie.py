"""Baidu Ernie 4.5 MoE (``ernie4_5-moe``) as llama.cpp's graph computes it (src/models/ernie4-5-moe.cpp).

Each block is LLaMA's (RMSNorm, attention with NORM rope, the architecture's ARCH_TRAITS row), then after
``ffn_norm`` either a dense SiLU-gated FFN or the mixture of experts: a layer is MoE when ``il >=
leading_dense_block_count`` and ``(il + 1) % interleave_moe_layer_step == 0`` (the converter writes only files
whose step is 1). The router is build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX and ``norm_w``:
``p = softmax(ffn_gate_inp · h)``, the experts chosen by the top-k of ``p + exp_probs_b`` (transformers'
``moe_statics.e_score_correction_bias``), weighted by their unbiased ``p`` divided by its sum (clamped below at
2^-14), no weight scale (the ernie loader reads none); the shared expert (``ffn_*_shexp``, when
``expert_shared_feed_forward_length`` > 0) is added ungated. The dense ``ernie4_5`` runs the standard transformer
block (its ARCH_TRAITS row only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ggufkit.errors import MetadataValueError
from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward, uint_key
from ggufkit.eval.family_lfm2 import dense_ffn
from ggufkit.eval.moe import routed_moe

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """Which layers are MoE (llama_model_ernie4_5::load_arch_hparams: the step required and positive, the dense
    lead optional, default 0)."""
    step = uint_key(file, f"{arch}.interleave_moe_layer_step", None)
    if step == 0:
        raise MetadataValueError("expected a positive integer, got 0", key=f"{arch}.interleave_moe_layer_step",
                                 path=file.path)
    n_dense = uint_key(file, f"{arch}.leading_dense_block_count", 0)
    return {"moe": tuple(il >= n_dense and (il + 1) % step == 0 for il in range(n_layer))}


def block_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Embeddings and head, then per block its norms, attention, and dense FFN or router, correction bias,
    stacked experts and optional shared expert."""
    e, n = hp.n_embd, hp.n_expert
    out = shapes.global_shapes(hp, names)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "ffn_norm.weight"] = (e,)
        out.update(shapes.attention_shapes(hp, b, names))
        ffn = {"up": (-1, e), "gate": (-1, e), "down": (e, -1)}
        if not hp.extra["moe"][il]:
            out.update({f"{b}ffn_{k}.weight": s for k, s in ffn.items()})
            continue
        out[b + "ffn_gate_inp.weight"] = (n, e)
        out.update({f"{b}ffn_{k}_exps.weight": (n, *s) for k, s in ffn.items()})
        if b + "exp_probs_b.bias" in names:
            out[b + "exp_probs_b.bias"] = (n,)
        if b + "ffn_up_shexp.weight" in names:
            out.update({f"{b}ffn_{k}_shexp.weight": s for k, s in ffn.items()})
    return out


def moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s experts and shared expert on the normed stream ``h`` ``[B, T, n_embd]`` (module docstring)."""
    return routed_moe(model, h, p, gating="softmax", norm=True)


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p`` on the residual stream ``x`` ``[B, T, n_embd]`` (module docstring)."""
    il = int(p.split(".")[1])
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    x = x + model.attention(h, p)
    h = model.norm(x, model.weight(p + "ffn_norm.weight"), None)
    return x + (moe(model, h, p) if model.hparams.extra["moe"][il] else dense_ffn(model, h, p))


FORWARD = FamilyForward(read=read, shapes=block_shapes, block=block)
