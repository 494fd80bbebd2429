"""Granite 4 hooks (IBM Granite 4.0 H: ``GraniteMoeHybridForCausalLM``), as llama.cpp's converter writes the
family (conversion/granite.py ``GraniteHybridModel`` over conversion/mamba.py ``Mamba2Model`` and
``GraniteMoeModel``) and its loader reads it (src/models/granite-hybrid.cpp).

The schedule. Each layer is Mamba2 or attention. The released configs spell it ``layer_types`` with
``"mamba"`` / ``"attention"``; transformers 5 reads those and saves ``"linear_attention"`` /
``"full_attention"`` (``layers_block_type`` is its alias). llama.cpp's converter counts a layer as attention only
when its ``layer_types`` entry is exactly ``"attention"``, so a transformers-5 save comes out with every layer
Mamba2 (another model, whose attention tensors its loader then refuses), and it never reads
``layers_block_type``. ggufkit reads every spelling and writes what llama.cpp's converter writes from the
release spelling: the per-layer KV head count (0 on Mamba2 layers), which is how llama.cpp's loader tells the
layers apart. ``attn_layer_indices`` / ``attn_layer_period`` (Bamba's spellings, which llama.cpp's converter
reads when ``layer_types`` is absent) are refused: transformers' GraniteMoeHybridConfig ignores them and runs
every layer as Mamba2.

The tensors. ``A = -exp(A_log)`` and ``D`` as ``[n_head, 1]``, the conv kernel squeezed, the gated norm as
``[n_group, d_inner / n_group]``, ``dt_bias`` as ``ssm_dt.bias`` (Mamba2Model.modify_tensors); the experts'
fused ``input_linear`` split into gate and up experts and the shared MLP's into gate and up, written as the
shared expert, or as the dense FFN when the model has no experts (Granite 4 Micro; GraniteMoeModel.modify_tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufkit.converters.ssm_values import neg_exp
from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.format.values import VT

#: Schedule entries: Mamba2 (False) or attention (True), in every spelling.
_KINDS = {"mamba": False, "linear_attention": False, "attention": True, "full_attention": True}
#: llama.cpp's converter pads the token list (not the embedding) to a multiple of this for a hybrid model
#: (conversion/granite.py GraniteHybridModel.set_vocab: pad_vocab_size_multiple = 8).
VOCAB_MULTIPLE = 8
#: Keys llama.cpp's converter writes only when the config's value is truthy (``if x := hparams.get(...)``).
_TRUTHY_ONLY = ("attention.scale", "embedding_scale", "residual_scale", "logit_scale",
                "expert_shared_feed_forward_length")

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]


def schedule(config: Mapping[str, Any]) -> list[bool]:
    """Which layers are attention (True) and which Mamba2 (False), from ``layer_types`` or
    ``layers_block_type`` in any spelling; two spellings that disagree are refused."""
    found = {}
    for key in ("layer_types", "layers_block_type"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UnsupportedArchitectureError(f"granitehybrid: {key} is not a list of layer kinds")
        bad = sorted({v for v in value if v not in _KINDS})
        if bad:
            raise UnsupportedArchitectureError(f"granitehybrid: {key} has layer kinds {bad} (known: "
                                               f"{', '.join(_KINDS)})")
        found[key] = [_KINDS[v] for v in value]
    if not found:
        if config.get("attn_layer_indices") or config.get("attn_layer_period"):
            raise UnsupportedArchitectureError(
                "granitehybrid: the schedule is given only as attn_layer_indices / attn_layer_period, which "
                "transformers' GraniteMoeHybridConfig ignores (it runs every layer as Mamba2) and llama.cpp's "
                "converter reads: write layer_types")
        raise UnsupportedArchitectureError("granitehybrid: the config has no layer schedule (layer_types)")
    if len({tuple(v) for v in found.values()}) > 1:
        raise UnsupportedArchitectureError("granitehybrid: layer_types and layers_block_type disagree")
    return next(iter(found.values()))


def _first(config: Mapping[str, Any], *keys: str) -> Any:
    """The first key present (GraniteHybridModel.find_hparam: the keys, then each with the ``mamba_`` prefix)."""
    for key in (*keys, *(f"mamba_{k}" for k in keys)):
        if config.get(key) is not None:
            return config[key]
    return None


def _number(value: Any) -> Any:
    """A config number; transformers 5 saves infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def d_inner(config: Mapping[str, Any]) -> int:
    """The Mamba2 inner size as GraniteHybridModel computes it: ``expand * hidden_size``."""
    return int(_first(config, "expand", "num_heads")) * int(config["hidden_size"])


def _experts(config: Mapping[str, Any]) -> int:
    return int(_first(config, "num_local_experts", "num_experts") or 0)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse what llama.cpp's converter or graph would compute as another model (one line)."""
    attn = schedule(config)
    problems = []
    n_layer = config.get("num_hidden_layers")
    if n_layer is not None and n_layer != len(attn):
        problems.append(f"num_hidden_layers {n_layer} but a schedule of {len(attn)} layers")
    if all(attn):
        problems.append("no Mamba2 layer (llama.cpp's converter writes such a model as granite / granitemoe)")
    if not any(attn):
        problems.append("no attention layer")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (llama.cpp's FFN and Mamba2 use SiLU)")
    expand = _first(config, "expand", "num_heads")
    if expand != 2:
        problems.append(f"mamba_expand {expand} (llama.cpp's granitehybrid loader requires 2)")
    heads, head_dim = config.get("mamba_n_heads"), config.get("mamba_d_head")
    if isinstance(heads, int) and isinstance(head_dim, int) and expand == 2 and heads * head_dim != d_inner(config):
        problems.append(f"mamba_n_heads x mamba_d_head {heads * head_dim} is not the inner size {d_inner(config)}")
    if config.get("mamba_proj_bias") is True:
        problems.append("mamba_proj_bias (llama.cpp's Mamba2 projections have no bias)")
    if config.get("mamba_conv_bias") is False:
        problems.append("no conv bias (llama.cpp's Mamba2 graph adds ssm_conv1d.bias unconditionally)")
    if config.get("attention_bias") is True:
        problems.append("attention biases")
    if config.get("position_embedding_type") == "rope":
        problems.append("RoPE (llama.cpp's granitehybrid applies none on a model with Mamba2 layers)")
    limit = [_number(v) for v in config.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        problems.append(f"time_step_limit {limit} (llama.cpp's scan does not clamp the time step)")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab % VOCAB_MULTIPLE:
        problems.append(f"vocab_size {vocab} not a multiple of {VOCAB_MULTIPLE} (llama.cpp's converter pads the "
                        "token list but not the embedding, and its loader refuses the file)")
    n_expert = _experts(config)
    used = int(_first(config, "num_experts_per_tok", "num_experts_per_token") or 0)
    if n_expert and not 0 < used <= n_expert:
        problems.append(f"{used} experts per token of {n_expert}")
    if not n_expert and config.get("shared_intermediate_size") != config.get("intermediate_size"):
        problems.append(f"no experts, and the shared MLP's width {config.get('shared_intermediate_size')} is not "
                        f"intermediate_size {config.get('intermediate_size')} (llama.cpp's dense FFN reads that)")
    if problems:
        raise UnsupportedArchitectureError("granitehybrid: llama.cpp would compute another model: " + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, tuple[VT, Any]],
            tensor_names: tuple[str, ...] = ()) -> dict[str, tuple[VT, Any]]:
    """The keys YAML cannot say, as GraniteHybridModel.set_gguf_parameters writes them: the per-layer KV head
    counts (INT32 array, 0 on Mamba2 layers), the Mamba2 inner size, the rope dimensions (``attn_rotary_emb``,
    else ``hidden_size / num_attention_heads``: GraniteModel drops head_dim); Granite's multipliers and the
    shared FFN width only when non-zero. Without experts (Granite 4 Micro) ``expert_used_count`` is 0, as the
    released config says (a transformers-5 save keeps the default 2, which llama.cpp's loader aborts on)."""
    arch = "granitehybrid"
    attn = schedule(config)
    out = {k: v for k, v in values.items() if k.removeprefix(f"{arch}.") not in _TRUTHY_ONLY or v[1]}
    n_kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    out[f"{arch}.attention.head_count_kv"] = (VT.ARRAY, [n_kv if a else 0 for a in attn])
    rope = config.get("attn_rotary_emb") or int(config["hidden_size"]) // int(config["num_attention_heads"])
    out[f"{arch}.rope.dimension_count"] = (VT.UINT32, int(rope))
    out[f"{arch}.ssm.inner_size"] = (VT.UINT32, d_inner(config))
    if not _experts(config) and f"{arch}.expert_used_count" in out:
        out[f"{arch}.expert_used_count"] = (VT.UINT32, 0)
    return out


def _wrapped(load: Callable[[], Any], fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: fn(np.asarray(load()))


def _rows(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    """Rows ``start:stop`` of the second-to-last axis (one half of a fused gate/up tensor)."""
    return lambda a: np.ascontiguousarray(a[..., start:stop, :])


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], Any]], config: Mapping[str, Any]) -> list[Raw]:
    """The tensors as GraniteHybridModel.modify_tensors yields them (module docstring), in the same order."""
    n_group = int(_first(config, "n_groups", "num_groups") or 1)
    dense = not _experts(config)
    out: list[Raw] = []
    for name, source, kind, shape, dtype, transform in raw:
        load = loaders.pop(name)
        fn: Callable[[np.ndarray], np.ndarray] | None = None
        if kind == "SSM_DT" and not name.endswith((".weight", ".bias")):
            name += ".bias"
        elif kind == "SSM_A":  # llama.cpp's converter widens bf16 to float32 before modify_tensors
            shape, fn = (int(np.prod(shape)), 1), lambda a, d=dtype: neg_exp(a, d).reshape(-1, 1)
            dtype = "F32" if dtype == "BF16" else dtype
        elif kind == "SSM_D":
            shape, fn = (int(np.prod(shape)), 1), lambda a: a.reshape(-1, 1)
        elif kind == "SSM_CONV1D" and name.endswith(".weight") and len(shape) == 3:
            shape, fn = (shape[0], shape[2]), lambda a: a.reshape(a.shape[0], a.shape[-1])
        elif kind == "SSM_NORM" and len(shape) == 1:
            shape, fn = (n_group, shape[0] // n_group), lambda a: a.reshape(n_group, -1)
        elif kind in ("FFN_GATE_EXP", "FFN_GATE_SHEXP"):  # [.., 2 * n_ff, n_embd]: gate rows, then up rows
            half = shape[-2] // 2
            if kind == "FFN_GATE_EXP":
                parts = (("ffn_gate_exps", "FFN_GATE_EXP"), ("ffn_up_exps", "FFN_UP_EXP"))
            elif dense:
                parts = (("ffn_gate", "FFN_GATE"), ("ffn_up", "FFN_UP"))
            else:
                parts = (("ffn_gate_shexp", "FFN_GATE_SHEXP"), ("ffn_up_shexp", "FFN_UP_SHEXP"))
            block = name.rsplit(".", 2)[0]
            for i, (part, part_kind) in enumerate(parts):
                part_name = f"{block}.{part}.weight"
                out.append((part_name, source, part_kind, (*shape[:-2], half, shape[-1]), dtype, transform))
                loaders[part_name] = _wrapped(load, _rows(i * half, (i + 1) * half))
            continue
        elif kind == "FFN_DOWN_SHEXP" and dense:
            name, kind = name.replace(".ffn_down_shexp.", ".ffn_down."), "FFN_DOWN"
        out.append((name, source, kind, shape, dtype, transform))
        loaders[name] = load if fn is None else _wrapped(load, fn)
    return out
