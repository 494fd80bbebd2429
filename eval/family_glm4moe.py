"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``glm4moe``) as llama.cpp's graph computes it (src/models/glm4-moe.cpp,
build_moe_ffn in src/llama-graph.cpp).

Each block: RMSNorm (``attn_norm``), self-attention (q/k/v with their biases, per-head q/k RMS norms when the file
has them, NEOX rope over the first ``rope.dimension_count`` dimensions of each head, scale ``1/sqrt(head_dim)``),
the result joins the stream; RMSNorm (``post_attention_norm``), then the first ``leading_dense_block_count``
blocks a dense SiLU-gated FFN and the others the routed experts plus an ungated shared expert; the result joins
the stream.

The router (:func:`ggufkit.eval.moe.route`): the expert gating function of the file (sigmoid when the key is
absent or 0, as load_arch_hparams), ``exp_probs_b`` added for the choice only, ``expert_group_count`` groups of
which the ``expert_group_used_count`` best stay selectable, the unbiased probabilities of the chosen experts
renormalised when ``expert_weights_norm`` and multiplied by ``expert_weights_scale``.

The last ``nextn_predict_layers`` blocks are the NextN (multi-token-prediction) layers, which llama.cpp's main
graph does not run (its ``graph_mtp`` does, for speculative decoding): the evaluator's block loop stops before
them (:attr:`ggufkit.eval.arch.HParams.n_trunk`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ggufkit.errors import MetadataValueError
from ggufkit.eval.family_forward import FamilyForward, uint_key
from ggufkit.eval.family_lfm2 import dense_ffn
from ggufkit.eval.moe import routed_moe
from ggufkit.eval.shapes import attention_shapes, ffn_shapes, global_shapes

if TYPE_CHECKING:
    import torch

    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

#: llama_expert_gating_func_type (src/llama-hparams.h): 0 none (glm4moe's loader makes it sigmoid), 1 softmax,
#: 2 sigmoid.
_GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The dense lead and the router's gating, groups, renormalisation and scale
    (llama_model_glm4_moe::load_arch_hparams and llama_model::load_hparams' defaults)."""
    gating = uint_key(file, f"{arch}.expert_gating_func", 0)
    if gating not in _GATING:
        raise MetadataValueError(f"unknown expert gating function {gating}", key=f"{arch}.expert_gating_func",
                                 path=file.path)
    norm = file.kv.get(f"{arch}.expert_weights_norm")
    scale = file.kv.get(f"{arch}.expert_weights_scale")
    n_group = uint_key(file, f"{arch}.expert_group_count", 0)
    return {"dense_lead": uint_key(file, f"{arch}.leading_dense_block_count", 0),
            "gating": _GATING[gating], "n_group": n_group,
            "topk_group": uint_key(file, f"{arch}.expert_group_used_count", 0) if n_group > 1 else 0,
            "norm": bool(norm.value) if norm is not None else False,
            "scale": float(scale.value) if scale is not None else 0.0}


def shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """The trunk's tensors (the NextN blocks' are not read by the main pass)."""
    out = global_shapes(hp, names)
    e = hp.n_embd
    for il in range(hp.n_trunk):
        b = f"blk.{il}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "post_attention_norm.weight"] = (e,)
        out.update(attention_shapes(hp, b, names))
        if il < hp.extra["dense_lead"]:
            out.update({b + "ffn_up.weight": (-1, e), b + "ffn_gate.weight": (-1, e), b + "ffn_down.weight": (e, -1)})
        else:
            out.update(ffn_shapes(hp, b, names))
            out.pop(b + "ffn_gate_inp_shexp.weight", None)
            out[b + "exp_probs_b.bias"] = (hp.n_expert,)
    return out


def moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s routed experts and ungated shared expert on ``h`` ``[B, T, n_embd]`` (module docstring)."""
    hp = model.hparams
    extra = hp.extra
    return routed_moe(model, h, p, gating=extra["gating"], n_group=extra["n_group"],
                      topk_group=extra["topk_group"], norm=extra["norm"], scale=extra["scale"])


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p`` on the residual stream (the model's loop stops before the NextN blocks: HParams.n_trunk)."""
    extra = model.hparams.extra
    il = int(p.split(".")[1])
    x = x + model.attention(model.norm(x, model.weight(p + "attn_norm.weight"), None), p)
    h = model.norm(x, model.weight(p + "post_attention_norm.weight"), None)
    return x + (dense_ffn(model, h, p) if il < extra["dense_lead"] else moe(model, h, p))


FORWARD = FamilyForward(read=read, shapes=shapes, block=block)
