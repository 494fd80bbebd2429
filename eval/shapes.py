"""The numpy-order shapes of the tensors a forward pass reads, in parts a family's own table reuses.

:func:`transformer_shapes` is the table of every architecture built of transformer blocks; a recurrent or
hybrid family (:mod:`ggufkit.eval.families`) composes its own from :func:`global_shapes`,
:func:`attention_shapes` and :func:`ffn_shapes` plus its layers' tensors. ``-1`` leaves a size unchecked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ggufkit.eval.arch import HParams

Shapes = dict[str, tuple[int, ...]]


def transformer_shapes(hp: HParams, names: set[str]) -> Shapes:
    """Every tensor of a transformer: embeddings and head, then per block its norms, attention and FFN (the
    blocks the forward pass runs: an MTP block's are left out, not loaded)."""
    out = global_shapes(hp, names)
    for i in range(hp.n_trunk):
        b = f"blk.{i}."
        e = hp.n_embd
        if not hp.post_norm:
            out[b + "attn_norm.weight"] = (e,)
            if not hp.shared_norm:
                out[b + "ffn_norm.weight"] = (e,)
        if hp.norm == "layer" and hp.norm_bias:
            out[b + "attn_norm.bias"] = (e,)
            out[b + "ffn_norm.bias"] = (e,)
        out.update(attention_shapes(hp, b, names))
        if b + "post_attention_norm.weight" in names or hp.post_norm:
            out[b + "post_attention_norm.weight"] = (e,)
            out[b + "post_ffw_norm.weight"] = (e,)
        out.update(ffn_shapes(hp, b, names))
    return out


def global_shapes(hp: HParams, names: set[str]) -> Shapes:
    """Token embeddings, output norm and head, learned positions, rope factors."""
    e = hp.n_embd
    out: Shapes = {"token_embd.weight": (hp.n_vocab, e), "output_norm.weight": (e,)}
    if hp.norm == "layer" and hp.norm_bias:
        out["output_norm.bias"] = (e,)
    if "output.weight" in names and not hp.learned_positions:
        out["output.weight"] = (hp.n_vocab, e)
    if hp.learned_positions:
        out["position_embd.weight"] = (-1, e)
    if "rope_freqs.weight" in names:
        out["rope_freqs.weight"] = (hp.n_rot // 2,)
    return out


def attention_shapes(hp: HParams, b: str, names: set[str]) -> Shapes:
    """Block ``b``'s Q/K/V (fused or not, biases when present), q/k norms and output projection."""
    e, hd = hp.n_embd, hp.head_dim
    q, kv = hp.n_head * hd, hp.n_head_kv * hd
    out: Shapes = {}
    if b + "attn_qkv.weight" in names:
        out[b + "attn_qkv.weight"] = (q + 2 * kv, e)
        if b + "attn_qkv.bias" in names:
            out[b + "attn_qkv.bias"] = (q + 2 * kv,)
    else:
        for part, rows in (("q", q), ("k", kv), ("v", kv)):
            out[b + f"attn_{part}.weight"] = (rows, e)
            if b + f"attn_{part}.bias" in names:
                out[b + f"attn_{part}.bias"] = (rows,)
    if b + "attn_q_norm.weight" in names or hp.qk_norm_whole:
        out[b + "attn_q_norm.weight"] = (q,) if hp.qk_norm_whole else (hd,)
        out[b + "attn_k_norm.weight"] = (kv,) if hp.qk_norm_whole else (hd,)
    out[b + "attn_output.weight"] = (e, q)
    if b + "attn_output.bias" in names:
        out[b + "attn_output.bias"] = (e,)
    return out


def ffn_shapes(hp: HParams, b: str, names: set[str]) -> Shapes:
    """Block ``b``'s feed-forward: the dense FFN, or router, stacked experts and optional shared expert."""
    e = hp.n_embd
    out: Shapes = {}
    if hp.n_expert:
        n = hp.n_expert
        out[b + "ffn_gate_inp.weight"] = (n, e)
        out[b + "ffn_gate_exps.weight"] = (n, -1, e)
        out[b + "ffn_up_exps.weight"] = (n, -1, e)
        out[b + "ffn_down_exps.weight"] = (n, e, -1)
        if b + "ffn_up_shexp.weight" in names:
            out[b + "ffn_up_shexp.weight"] = (-1, e)
            out[b + "ffn_gate_shexp.weight"] = (-1, e)
            out[b + "ffn_down_shexp.weight"] = (e, -1)
            out[b + "ffn_gate_inp_shexp.weight"] = (1, e)
        return out
    out[b + "ffn_up.weight"] = (-1, e)
    if b + "ffn_up.bias" in names:
        out[b + "ffn_up.bias"] = (-1,)
    if hp.ffn in ("silu", "relu_sym") or b + "ffn_gate.weight" in names:
        out[b + "ffn_gate.weight"] = (-1, e)
    if b + "ffn_down_t.weight" in names:
        out[b + "ffn_down_t.weight"] = (-1, e)
        bias = b + "ffn_down_t.bias" if b + "ffn_down_t.bias" in names else b + "ffn_down.bias"
    else:
        out[b + "ffn_down.weight"] = (e, -1)
        bias = b + "ffn_down.bias"
    if bias in names:
        out[bias] = (e,)
    return out
