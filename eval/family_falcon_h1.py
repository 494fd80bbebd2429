"""TII Falcon-H1 (``falcon-h1``: FalconH1ForCausalLM) as llama.cpp's graph computes it (src/models/falcon-h1.cpp,
the Mamba2 mixer of src/models/mamba-base.cpp).

Every block runs self-attention (NEOX RoPE, queries scaled by ``1/sqrt(head_dim)``) and a Mamba2 mixer
(:func:`ggufkit.eval.layers_mamba2.mamba2_mixer`) side by side on the same RMS-normed input, adds both to the
stream, then a SiLU-gated FFN after ``ffn_norm`` (named without ``.weight``, as gguf-py maps
``pre_ff_layernorm.weight``). The muP multipliers are in the weights already (llama.cpp's converter folds them,
conversion/falcon_h1.py), so the graph has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward
from ggufkit.eval.layers_mamba2 import mamba2_mixer, mamba2_shapes, read_mamba2

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The mixer's sizes (every layer has one: llama_model_falcon_h1 sets is_recr_impl for all)."""
    return {"mamba2": read_mamba2(file, arch)}


def block_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    out = shapes.global_shapes(hp, names)
    e = hp.n_embd
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "ffn_norm"] = (e,)
        out.update(shapes.attention_shapes(hp, b, names))
        out.update(mamba2_shapes(hp.extra["mamba2"], e, b, names))
        out.update(shapes.ffn_shapes(hp, b, names))
    return out


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    y = model.attention(h, p) + mamba2_mixer(model, h, p, model.hparams.extra["mamba2"])
    x = y + x
    h = model.norm(x, model.weight(p + "ffn_norm"), None)
    return model.feed_forward(h, p) + x


FORWARD = FamilyForward(read=read, shapes=block_shapes, block=block)
