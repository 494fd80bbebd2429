"""Qwen3-Next and Qwen3.5-MoE hooks: what registry.yaml cannot say (conversion/qwen.py ``Qwen3NextModel``,
``_LinearAttentionVReorderBase``, ``Qwen3_5MoeTextModel``).

- The layer schedule in each spelling: ``layer_types`` (transformers 5, Qwen3.5 releases) or
  ``full_attention_interval`` (the Qwen3-Next release config). llama.cpp's converter reads the config through
  AutoConfig, which turns the interval into ``layer_types``, and writes ``attention.recurrent_layers`` from it.
- ``ssm.inner_size`` (value heads x value head size) and the rope dimensions (``partial_rotary_factor``, 0.25 by
  default as in Qwen3NextConfig).
- Tensor values: ``A = -exp(A_log)``, the conv kernel squeezed to ``[channels, kernel]``, ``dt_bias`` as
  ``ssm_dt.bias``, Qwen3-Next's fused ``in_proj_qkvz`` split per key head into ``attn_qkv`` and ``attn_gate``,
  and Qwen3.5's V heads reordered from grouped (by K head) to tiled where there are more V than K heads.
- Refused: what llama.cpp's loaders cannot represent (K and V head sizes that differ, dense layers between the
  MoE ones, another router normalisation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufkit.converters.ssm_values import neg_exp
from ggufkit.errors import UnsupportedArchitectureError

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]
Loader = Callable[[], np.ndarray]
LINEAR, FULL = "linear_attention", "full_attention"
#: Qwen3NextConfig / Qwen3_5MoeTextConfig defaults llama.cpp's converter sees through AutoConfig.
DEFAULT_INTERVAL = 4
DEFAULT_ROTARY_FACTOR = 0.25


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedArchitectureError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per layer ``linear_attention`` or ``full_attention``: ``layer_types`` where the config has it, else every
    ``full_attention_interval``-th layer (default 4) is full attention, as Qwen3NextConfig builds it."""
    n_layer = _int(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layer or any(t not in (LINEAR, FULL) for t in types):
            raise UnsupportedArchitectureError(
                f"config.json: layer_types must list {n_layer} entries, each {LINEAR!r} or {FULL!r}")
        return list(types)
    interval = config.get("full_attention_interval", DEFAULT_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise UnsupportedArchitectureError(f"config.json: full_attention_interval must be a positive integer, "
                                           f"not {interval!r}")
    return [LINEAR if (i + 1) % interval else FULL for i in range(n_layer)]


def _rotary_factor(config: Mapping[str, Any]) -> float:
    for params in (config.get("rope_parameters"), config.get("rope_scaling"), config):
        if isinstance(params, Mapping) and params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    return DEFAULT_ROTARY_FACTOR


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse checkpoints llama.cpp's qwen3next / qwen35moe loaders and graphs would compute differently."""
    model_type = str(config.get("model_type", "qwen3_next"))
    layer_types(config)
    problems = []
    hk, hv = _int(config, "linear_key_head_dim"), _int(config, "linear_value_head_dim")
    nk, nv = _int(config, "linear_num_key_heads"), _int(config, "linear_num_value_heads")
    if hk != hv:
        problems.append(f"linear_key_head_dim {hk} != linear_value_head_dim {hv} (the loader takes both from "
                        "ssm.state_size)")
    if nv % nk:
        problems.append(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1:
        problems.append("dense layers between the MoE layers (mlp_only_layers / decoder_sparse_step)")
    if config.get("norm_topk_prob", True) is False:
        problems.append("norm_topk_prob false (llama.cpp's graph renormalises the top-k expert weights)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (llama.cpp runs silu)")
    if config.get("attention_bias"):
        problems.append("attention biases (the loader has none)")
    if problems:
        raise UnsupportedArchitectureError(f"{model_type}: llama.cpp would compute another model: "
                                           + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, Any], *_: Any) -> dict[str, Any]:
    """The keys Qwen3NextModel.set_gguf_parameters computes: ssm.inner_size, attention.recurrent_layers (BOOL
    items, one per block, false for the MTP blocks after the trunk) and rope.dimension_count with
    Qwen3NextConfig's default factor."""
    from ggufkit.format.values import VT

    arch = next(k for k in values if k.endswith(".block_count")).removesuffix(".block_count")
    out = dict(values)
    out[f"{arch}.ssm.inner_size"] = (VT.UINT32, _int(config, "linear_value_head_dim")
                                     * _int(config, "linear_num_value_heads"))
    recurrent = [t == LINEAR for t in layer_types(config)]
    # multi-token-prediction blocks after the trunk (block_count already counts them) are never recurrent
    recurrent += [False] * (int(values[f"{arch}.block_count"][1]) - len(recurrent))
    out[f"{arch}.attention.recurrent_layers"] = (VT.ARRAY, recurrent)
    head_dim = config.get("head_dim") or _int(config, "hidden_size") // _int(config, "num_attention_heads")
    out[f"{arch}.rope.dimension_count"] = (VT.UINT32, int(int(head_dim) * _rotary_factor(config)))
    return out


# -- tensors ---------------------------------------------------------------------------------------
def _tile_v_heads(arr: np.ndarray, axis: int, n_k: int, v_per_k: int, head: int) -> np.ndarray:
    """V heads from grouped (by K head: G0_v0..v{r-1}, G1_v0..) to tiled order (G0_v0, G1_v0, .., G0_v1, ..)
    along ``axis`` (_LinearAttentionVReorderBase._reorder_v_heads)."""
    shape = arr.shape
    split = arr.reshape(*shape[:axis], n_k, v_per_k, head, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(split, axis, axis + 1).reshape(shape))


class _Dims:
    def __init__(self, config: Mapping[str, Any]) -> None:
        self.hk = _int(config, "linear_key_head_dim")
        self.hv = _int(config, "linear_value_head_dim")
        self.nk = _int(config, "linear_num_key_heads")
        self.nv = _int(config, "linear_num_value_heads")
        self.v_per_k = self.nv // self.nk
        self.key_dim = self.hk * self.nk


def _qwen35_value_rule(kind: str, gguf: str, d: _Dims) -> Callable[[np.ndarray], np.ndarray] | None:
    """Qwen3.5's V-head reorder of one tensor (_LinearAttentionVReorderBase.modify_tensors), or None."""
    if d.nk == d.nv:
        return None
    tile = _tile_v_heads
    if kind == "ATTN_QKV":
        return lambda a: np.concatenate([a[:2 * d.key_dim], tile(a[2 * d.key_dim:], 0, d.nk, d.v_per_k, d.hv)])
    if kind == "ATTN_GATE":
        return lambda a: tile(a, 0, d.nk, d.v_per_k, d.hv)
    if kind in ("SSM_BETA", "SSM_ALPHA", "SSM_A", "SSM_DT"):
        return lambda a: tile(a, 0, d.nk, d.v_per_k, 1)
    if kind == "SSM_CONV1D":
        return lambda a: np.concatenate([a[:2 * d.key_dim], tile(a[2 * d.key_dim:], 0, d.nk, d.v_per_k, d.hv)])
    if kind == "SSM_OUT":
        return lambda a: tile(a, 1, d.nk, d.v_per_k, d.hv)
    return None


def _split_qkvz(arr: np.ndarray, d: _Dims) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's ``in_proj_qkvz`` rows, per key head ``[q, k, v, z]``, as ``[all q | all k | all v]`` and
    ``[all z]`` (Qwen3NextModel.modify_tensors)."""
    n_embd = arr.shape[-1]
    v = d.v_per_k * d.hv
    grouped = arr.reshape(d.nk, 2 * d.hk + 2 * v, n_embd)
    q, k = grouped[:, :d.hk], grouped[:, d.hk:2 * d.hk]
    vv, z = grouped[:, 2 * d.hk:2 * d.hk + v], grouped[:, 2 * d.hk + v:]
    qkv = np.concatenate([q.reshape(-1, n_embd), k.reshape(-1, n_embd), vv.reshape(-1, n_embd)])
    return np.ascontiguousarray(qkv), np.ascontiguousarray(z.reshape(-1, n_embd))


def _chain(load: Loader, rules: list[Callable[[np.ndarray], np.ndarray]]) -> Loader:
    def run() -> np.ndarray:
        arr = load()
        for rule in rules:
            arr = rule(arr)
        return arr

    return run


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Loader], config: Mapping[str, Any]) -> list[Raw]:
    """The tensors as Qwen3NextModel / Qwen3_5MoeTextModel ``modify_tensors`` yield them (module docstring),
    in the same order; ``loaders`` holds every planned tensor's loader."""
    d = _Dims(config)
    qwen35 = str(config.get("model_type", "")).startswith("qwen3_5")
    out: list[Raw] = []
    for gguf, source, kind, shape, dtype, transform in raw:
        load = loaders.pop(gguf)
        rules: list[Callable[[np.ndarray], np.ndarray]] = []
        reorder = _qwen35_value_rule(kind, gguf, d) if qwen35 else None
        if kind == "SSM_CONV1D" and len(shape) == 3:  # [channels, 1, kernel] -> [channels, kernel]
            shape = (shape[0], shape[2])
            rules.append(lambda a: a.reshape(a.shape[0], a.shape[-1]))
        if reorder is not None:
            rules.append(reorder)
        if kind == "SSM_A":
            src_dtype = dtype
            rules.append(lambda a, s=src_dtype: neg_exp(a, s))  # type: ignore[misc]
            dtype = "F32" if dtype == "BF16" else dtype
        if kind == "SSM_DT" and not gguf.endswith(".bias"):  # dt_bias -> dt_proj.bias
            gguf += ".bias"
        if kind == "ATTN_QKV" and source.endswith("in_proj_qkvz.weight"):
            name_gate = gguf.replace(".attn_qkv.", ".attn_gate.")
            n_embd = shape[1]
            value = d.nv * d.hv
            out.append((gguf, source, kind, (2 * d.key_dim + value, n_embd), dtype, transform))
            out.append((name_gate, source, "ATTN_GATE", (value, n_embd), dtype, transform))
            loaders[gguf] = _chain(load, [lambda a: _split_qkvz(a, d)[0]])
            loaders[name_gate] = _chain(load, [lambda a: _split_qkvz(a, d)[1]])
            continue
        out.append((gguf, source, kind, shape, dtype, transform))
        loaders[gguf] = _chain(load, rules) if rules else load
    return out
