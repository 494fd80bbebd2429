"""DeepSeek V2 / V3, Kimi K2 and GLM-4.7-Flash (``deepseek2``) as llama.cpp's graph computes them
(src/models/deepseek2.cpp, build_moe_ffn in src/llama-graph.cpp).

Each block: RMSNorm (``attn_norm``), multi-head latent attention in the absorbed form (eval/layers_mla.py), the
result joins the stream; RMSNorm (``ffn_norm``), then a dense SiLU-gated FFN on the ``leading_dense_block_count``
first layers, else the routed experts plus the ungated shared experts; the result joins the stream.

The router (:func:`ggufkit.eval.moe.route`): ``expert_gating_func`` softmax or sigmoid (a file without the key:
softmax, as the loader assumes for DeepSeek V2 files, but sigmoid for GLM-4.7-Flash's 47/48 layers of a
154880-token vocabulary), the ``exp_probs_b`` correction bias for the choice only, ``expert_group_count`` groups of
which ``expert_group_used_count`` stay selectable, renormalised top-k weights when ``expert_weights_norm``, times
``expert_weights_scale``. NextN (MTP) blocks after the trunk (``nextn_predict_layers``) are not run by the main
pass, as llama.cpp's graph loops over the trunk only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ggufkit.errors import MetadataValueError
from ggufkit.eval import shapes
from ggufkit.eval.family_forward import FamilyForward, uint_key
from ggufkit.eval.family_lfm2 import dense_ffn
from ggufkit.eval.layers_mla import mla_attention
from ggufkit.eval.moe import routed_moe

if TYPE_CHECKING:
    import torch

    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

#: llama_expert_gating_func_type
GATING = {1: "softmax", 2: "sigmoid"}
#: llama_model_deepseek2::load_arch_hparams: GLM-4.7-Flash files without a gating key route by sigmoid.
GLM_LITE_LAYERS, GLM_LITE_VOCAB = (47, 48), 154880


def _float_key(file: GGUFModel, name: str, default: float) -> float:
    field = file.kv.get(name)
    return default if field is None else float(field.value)


def read(file: GGUFModel, arch: str, n_layer: int) -> Mapping[str, Any]:
    """The MLA sizes, the leading dense layers, the router's settings and the trunk's length."""
    n_mtp = uint_key(file, f"{arch}.nextn_predict_layers", 0)
    n_trunk = n_layer - n_mtp
    if n_trunk <= 0:
        raise MetadataValueError(f"{n_mtp} NextN layers of {n_layer} blocks", key=f"{arch}.nextn_predict_layers",
                                 path=file.path)
    kv_lora = uint_key(file, f"{arch}.attention.kv_lora_rank")
    k_mla = uint_key(file, f"{arch}.attention.key_length_mla")
    rope = uint_key(file, f"{arch}.rope.dimension_count")
    if k_mla <= rope:
        raise MetadataValueError(f"key_length_mla {k_mla} leaves no dims without rope ({rope})",
                                 key=f"{arch}.attention.key_length_mla", path=file.path)
    gating = uint_key(file, f"{arch}.expert_gating_func", 0)
    if gating == 0:
        n_vocab = uint_key(file, f"{arch}.vocab_size", 0) or len(file.kv["tokenizer.ggml.tokens"].value)
        gating = 2 if n_trunk in GLM_LITE_LAYERS and n_vocab == GLM_LITE_VOCAB else 1
    if gating not in GATING:
        raise MetadataValueError(f"gating function {gating} (the evaluator runs softmax 1 and sigmoid 2)",
                                 key=f"{arch}.expert_gating_func", path=file.path)
    norm_field = file.kv.get(f"{arch}.expert_weights_norm")
    return {"n_trunk": n_trunk, "n_dense": uint_key(file, f"{arch}.leading_dense_block_count", 0),
            "kv_lora": kv_lora, "nope": k_mla - rope, "rope": rope,
            "v_dim": uint_key(file, f"{arch}.attention.value_length_mla"),
            "gating": GATING[gating], "n_group": uint_key(file, f"{arch}.expert_group_count", 0),
            "topk_group": uint_key(file, f"{arch}.expert_group_used_count", 0),
            "norm": bool(norm_field.value) if norm_field is not None else False,
            "scale": _float_key(file, f"{arch}.expert_weights_scale", 0.0)}


def expected_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Embeddings and head, then per trunk block its norms, MLA tensors, and dense FFN or router (and bias),
    stacked experts and shared experts."""
    x = hp.extra
    e, n_head, kv_lora = hp.n_embd, hp.n_head, x["kv_lora"]
    k_mla = x["nope"] + x["rope"]
    out = shapes.global_shapes(hp, names)
    for il in range(x["n_trunk"]):
        b = f"blk.{il}."
        out[b + "attn_norm.weight"] = (e,)
        out[b + "ffn_norm.weight"] = (e,)
        if b + "attn_q.weight" in names:
            out[b + "attn_q.weight"] = (n_head * k_mla, e)
        else:
            out[b + "attn_q_a.weight"] = (-1, e)
            out[b + "attn_q_a_norm.weight"] = (-1,)
            out[b + "attn_q_b.weight"] = (n_head * k_mla, -1)
        out[b + "attn_kv_a_mqa.weight"] = (kv_lora + x["rope"], e)
        out[b + "attn_kv_a_norm.weight"] = (kv_lora,)
        out[b + "attn_k_b.weight"] = (n_head, kv_lora, x["nope"])
        out[b + "attn_v_b.weight"] = (n_head, x["v_dim"], kv_lora)
        out[b + "attn_output.weight"] = (e, n_head * x["v_dim"])
        if il < x["n_dense"]:
            out.update({b + "ffn_up.weight": (-1, e), b + "ffn_gate.weight": (-1, e), b + "ffn_down.weight": (e, -1)})
            continue
        out.update(shapes.ffn_shapes(hp, b, names))
        out.pop(b + "ffn_gate_inp_shexp.weight", None)
        if b + "exp_probs_b.bias" in names:
            out[b + "exp_probs_b.bias"] = (hp.n_expert,)
    return out


def moe(model: GGUFCausalLM, h: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p``'s routed experts plus its ungated shared experts on ``h`` ``[B, T, n_embd]``."""
    x = model.hparams.extra
    return routed_moe(model, h, p, gating=x["gating"], n_group=x["n_group"], topk_group=x["topk_group"],
                      norm=x["norm"], scale=x["scale"])


def block(model: GGUFCausalLM, x: torch.Tensor, p: str) -> torch.Tensor:
    """Block ``p`` on the residual stream ``x`` ``[B, T, n_embd]`` (module docstring)."""
    extra = model.hparams.extra
    il = int(p.split(".")[1])
    if il >= extra["n_trunk"]:  # a NextN block: the draft model's, not the main pass's
        return x
    h = model.norm(x, model.weight(p + "attn_norm.weight"), None)
    x = x + mla_attention(model, h, p, nope=extra["nope"], rope=extra["rope"], kv_lora=extra["kv_lora"],
                          v_dim=extra["v_dim"])
    h = model.norm(x, model.weight(p + "ffn_norm.weight"), None)
    return x + (dense_ffn(model, h, p) if il < extra["n_dense"] else moe(model, h, p))


FORWARD = FamilyForward(read=read, shapes=expected_shapes, block=block)
