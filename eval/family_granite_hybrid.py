"""IBM Granite 4 (``granitehybrid``: GraniteMoeHybridForCausalLM) as llama.cpp's graph computes it
(src/models/granite-hybrid.cpp, the Mamba2 mixer of src/models/mamba-base.cpp).

Each block: RMSNorm, then a Mamba2 mixer (:func:`ggufkit.eval.layers_mamba2.mamba2_mixer`) on the layers whose
``attention.head_count_kv`` entry is 0 (``is_recr``), self-attention on the others; the result times
``residual_scale`` joins the stream; RMSNorm, then a softmax-routed MoE with renormalised top-k weights plus an
ungated shared expert (``ffn_*_shexp``), or a dense SiLU-gated FFN (Granite 4 Micro), again times
``residual_scale``. The embeddings are multiplied by ``embedding_scale``; the queries' scale, the logits'
divisor and RoPE's switch are :class:`ggufkit.eval.arch.ArchTraits` ``granite``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ggufkit.errors import MetadataValueError
from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.layers_mamba2 import mamba2_mixer, mamba2_shapes, read_mamba2
from ggufkit.eval.moe import routed_experts, shared_expert

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The mixer's sizes, which layers are Mamba2 (KV heads 0), and the embedding / residual multipliers."""
    name = f"{arch}.attention.head_count_kv"
    field = file.kv.get(name)
    value = None if field is None else field.value
    if isinstance(value, (list, tuple, np.ndarray)):
        kv = [int(v) for v in value]
        if len(kv) != n_layer:
            raise MetadataValueError(f"{len(kv)} entries for {n_layer} layers", key=name, path=file.path)
    else:  # one count for every layer: all attention (llama_hparams::n_head_kv(il) of a scalar key)
        kv = [1] * n_layer
    return {"mamba2": read_mamba2(file, arch), "recurrent": tuple(n == 0 for n in kv),
            "embedding_scale": _scale(file, f"{arch}.embedding_scale"),
            "residual_scale": _scale(file, f"{arch}.residual_scale")}


def _scale(file: GGUFModel, name: str) -> float:
    """An optional float32 multiplier (0.0 when absent: not applied, as the graph's ``if (f_..._scale)``)."""
    field = file.kv.get(name)
    if field is None:
        return 0.0
    if isinstance(field.value, bool) or not isinstance(field.value, (int, float)):
        raise MetadataValueError(f"expected a float, got {field.type_label}", key=name, path=file.path)
    return float(np.float32(field.value))


def block_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    out = shapes.global_shapes(hp, names)
    e = hp.n_embd
    for i, recurrent in enumerate(hp.extra["recurrent"]):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "ffn_norm.weight"] = (e,)
        if recurrent:
            out.update(mamba2_shapes(hp.extra["mamba2"], e, b, names))
        else:
            out.update(shapes.attention_shapes(hp, b, names))
        ffn = shapes.ffn_shapes(hp, b, names)
        ffn.pop(b + "ffn_gate_inp_shexp.weight", None)  # Granite's shared expert has no gate
        out.update(ffn)
    return out


def _moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """build_moe_ffn with softmax gating and renormalised top-k (norm_w), plus the shared expert added
    ungated (granite-hybrid.cpp build_layer_ffn)."""
    hp = model.hparams
    x = h.reshape(-1, h.shape[-1])
    model.observe(h, p + "ffn_gate_inp.weight")
    probs = torch.softmax(model.linear(x, model.weight(p + "ffn_gate_inp.weight")), dim=-1)
    weights, selected = torch.topk(probs, hp.n_expert_used, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = routed_experts(model, h, p, weights, selected)
    if model.optional_weight(p + "ffn_up_shexp.weight") is not None:
        out = out + shared_expert(model, h, p, gated=False)
    return out.reshape(h.shape)


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    ex = model.hparams.extra
    rs = ex["residual_scale"]
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    if ex["recurrent"][int(p.split(".")[1])]:
        y = mamba2_mixer(model, h, p, ex["mamba2"])
    else:
        y = model.attention(h, p)
    x = (y * rs if rs else y) + x
    h = model.norm(x, model.weight(p + "ffn_norm.weight"), None)
    y = _moe(model, h, p) if model.hparams.n_expert else model.feed_forward(h, p)
    return (y * rs if rs else y) + x


def embed(model: GGUFCausalLM, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``ggml_scale(embeddings, f_embedding_scale)`` when the file has the key (build_inp_embd)."""
    scale = model.hparams.extra["embedding_scale"]
    return x * scale if scale else x


FORWARD = FamilyForward(read=read, shapes=block_shapes, block=block, embed=embed)
