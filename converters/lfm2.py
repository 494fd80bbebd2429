"""LFM2 / LFM2-MoE hooks: the per-layer keys and tensor layouts registry.yaml cannot say, and refusals of the
checkpoints llama.cpp's lfm2 / lfm2moe graphs would compute differently (conversion/lfm2.py ``LFM2Model``,
``LFM2MoeModel``; src/models/lfm2.cpp, lfm2moe.cpp).

The layer schedule: transformers reads ``layer_types`` (``"conv"`` or ``"full_attention"`` per layer; the
release configs and transformers 5's save_pretrained write it), and without it LFM2's ``full_attn_idxs`` (the
attention layers' indices; every layer when that is absent too: Lfm2Config.__post_init__). llama.cpp's
converter reads ``layer_types`` of the AutoConfig-loaded config, so the same schedule, and writes it as
``{arch}.attention.head_count_kv`` per layer: 0 on a convolution layer (llama_model_lfm2::load_arch_hparams
marks those recurrent).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.format.values import VT

#: Lfm2Config / Lfm2MoeConfig defaults for keys a config.json may leave out (llama.cpp's converter loads the
#: config through AutoConfig, so it sees these).
_DEFAULTS = {"num_key_value_heads": 8, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
             "block_multiple_of": 256, "intermediate_size": 12288}
_KINDS = ("conv", "full_attention")


def _moe(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "lfm2_moe" or "Lfm2MoeForCausalLM" in (config.get("architectures") or [])


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """The schedule transformers runs: ``layer_types``, else (LFM2) ``full_attn_idxs``, else all attention."""
    n_layer = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, list):
        return [str(t) for t in types]
    idxs = config.get("full_attn_idxs")
    if not isinstance(idxs, list):
        idxs = list(range(n_layer))
    return ["full_attention" if i in idxs else "conv" for i in range(n_layer)]


def ffn_widths(config: Mapping[str, Any]) -> tuple[int, int]:
    """LFM2's dense FFN width as (llama.cpp's converter writes it, transformers' Lfm2MLP builds it).

    Both start from ``block_ff_dim`` (transformers pops it into ``intermediate_size``) and, with
    ``block_auto_adjust_ff_dim``, take 2/3 of it times ``block_ffn_dim_multiplier``; llama.cpp then always rounds
    up to ``block_multiple_of`` (LFM2Model._add_feed_forward_length), transformers only when the multiplier is
    set."""
    get = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "block_ffn_dim_multiplier"}}
    ff = int(get.get("block_ff_dim") or get["intermediate_size"])
    if not get["block_auto_adjust_ff_dim"]:
        return ff, ff
    ff = int(2 * ff / 3)
    mult, step = get["block_ffn_dim_multiplier"], int(get["block_multiple_of"])
    if mult is not None:
        ff = int(mult * ff)
        rounded = step * ((ff + step - 1) // step)
        return rounded, rounded
    return step * ((ff + step - 1) // step), ff


def check_config(config: Mapping[str, Any]) -> None:
    """The schedule llama.cpp can represent, no biases, and (MoE) the router llama.cpp's graph computes."""
    arch = "lfm2moe" if _moe(config) else "lfm2"
    problems = []
    n_layer = config.get("num_hidden_layers")
    if _moe(config) and not isinstance(config.get("layer_types"), list):
        problems.append("no layer_types (transformers' Lfm2MoeConfig needs it; llama.cpp's converter reads only it)")
    elif isinstance(n_layer, int):
        types = layer_types(config)
        if len(types) != n_layer or any(t not in _KINDS for t in types):
            problems.append(f"layer_types {types} (llama.cpp knows one of {list(_KINDS)} per layer, "
                            f"{n_layer} layers)")
        elif len(set(types)) < len(_KINDS):
            # llama.cpp's hybrid memory allocates no buffer for a kind without layers and aborts at the first
            # batch (GGML_ASSERT(buffer) in ggml-backend.cpp)
            problems.append(f"only {types[0]} layers (layer_types / full_attn_idxs; llama.cpp's hybrid memory "
                            "needs both kinds)")
    if config.get("conv_bias") is True:
        problems.append("conv_bias (llama.cpp's short convolution has no biases)")
    if not _moe(config):
        written, built = ffn_widths(config)
        if written != built:
            problems.append(f"block_ffn_dim_multiplier null: llama.cpp's converter writes feed_forward_length "
                            f"{written}, transformers builds {built}-wide FFNs (the file would not load)")
    else:
        if config.get("tie_word_embeddings", config.get("tie_embedding", True)) is False:
            problems.append("an untied lm_head (gguf-py's lfm2moe tensors have no output.weight)")
        if config.get("use_expert_bias", True) is False:
            problems.append("use_expert_bias false (llama.cpp's lfm2moe loader needs exp_probs_b)")
        if config.get("norm_topk_prob", True) is False:
            problems.append("norm_topk_prob false (llama.cpp always renormalises the top-k weights)")
        if float(config.get("routed_scaling_factor") or 1.0) != 1.0:
            problems.append(f"routed_scaling_factor {config.get('routed_scaling_factor')} (llama.cpp's converter "
                            "writes no expert weight scale)")
    if problems:
        raise UnsupportedArchitectureError(f"{arch}: llama.cpp would compute another model: " + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, tuple[VT, Any]],
            tensor_names: tuple[str, ...]) -> dict[str, tuple[VT, Any]]:
    """head_count_kv per layer (0 on convolution layers; an INT32 array as gguf-py's add_head_count_kv writes a
    list) and, for LFM2, the FFN width llama.cpp's converter computes."""
    arch = "lfm2moe" if _moe(config) else "lfm2"
    n_kv = int(config.get("num_key_value_heads") or _DEFAULTS["num_key_value_heads"])
    out = dict(values)
    out[f"{arch}.attention.head_count_kv"] = (VT.ARRAY, [n_kv if t == "full_attention" else 0
                                                         for t in layer_types(config)])
    if arch == "lfm2":
        out[f"{arch}.feed_forward_length"] = (VT.UINT32, ffn_widths(config)[0])
    return out


Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], Any]], config: Mapping[str, Any]) -> list[Raw]:
    """The conv kernels ``[C, 1, K]`` as ``[C, K]`` (LFM2Model.modify_tensors squeezes them; same bytes), and
    the expert bias, a buffer without ``.weight``/``.bias``, as ``exp_probs_b.bias`` (LFM2MoeModel.filter_tensors
    renames ``expert_bias`` to ``expert_bias.bias``)."""
    out = []
    for name, source, kind, shape, dtype, transform in raw:
        if kind == "SHORTCONV_CONV" and len(shape) == 3 and shape[1] == 1:
            shape = (shape[0], shape[2])
        if kind == "FFN_EXP_PROBS_B" and not name.endswith((".weight", ".bias")):
            if name in loaders:
                loaders[name + ".bias"] = loaders.pop(name)
            name += ".bias"
        out.append((name, source, kind, shape, dtype, transform))
    return out
