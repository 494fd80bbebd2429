"""Falcon-H1 hooks (TII Falcon-H1, transformers' ``FalconH1ForCausalLM``; llama.cpp's ``falcon-h1``).

llama.cpp's converter (conversion/falcon_h1.py ``FalconH1Model``, a conversion/mamba.py ``Mamba2Model``) folds
the muP multipliers into the weights, stores ``A = -exp(A_log)`` and gives the SSM tensors the shapes its loader
wants (src/models/falcon-h1.cpp ``load_arch_tensors``): :func:`rewrite_tensors` does the same, value for value.
:func:`check_config` refuses what its graph would compute differently from transformers' model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ggufkit.converters.rewrite import Raw
from ggufkit.converters.ssm_values import neg_exp
from ggufkit.converters.stream import to_float32
from ggufkit.errors import UnsupportedArchitectureError

#: The multipliers transformers' FalconH1Config defaults to when config.json leaves one out (llama.cpp's
#: converter then fails: ``None * tensor``); transformers runs the model with these.
_DEFAULTS: dict[str, Any] = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0,
                             "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0,
                             "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0],
                             "ssm_multipliers": [1.0] * 5}


def _get(config: Mapping[str, Any], key: str) -> Any:
    value = config.get(key)
    return _DEFAULTS[key] if value is None else value


def _number(value: Any) -> float:
    """A JSON number, or transformers 5's spelling of a non-finite one (``{"__float__": "Infinity"}``)."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def check_config(config: Mapping[str, Any]) -> None:
    """SiLU, no projection biases, a convolution bias, the gate before the grouped norm, no dt limits, no rope
    scaling, a head tied only where both multipliers agree, and an explicit ``mamba_d_ssm``."""
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (its FFN is SiLU-gated)")
    if config.get("mamba_proj_bias") is True:
        problems.append("mamba_proj_bias (its loader has no ssm_in bias)")
    if config.get("projectors_bias") is True:
        problems.append("projectors_bias (its loader has no ssm_out bias)")
    if config.get("mamba_conv_bias", True) is False:
        problems.append("mamba_conv_bias false (its Mamba2 layer adds ssm_conv1d.bias unconditionally)")
    if config.get("attention_bias") is True and float(_get(config, "attention_in_multiplier")) != 1.0:
        problems.append("attention biases with attention_in_multiplier != 1 (its converter scales the q/k/v biases "
                        "by it; transformers multiplies the input)")
    if config.get("mamba_rms_norm") is True and config.get("mamba_norm_before_gate", True) is not False:
        problems.append("mamba_norm_before_gate with mamba_rms_norm (its Mamba2 layer gates before the grouped "
                        "RMSNorm)")
    limit = config.get("time_step_limit")
    if limit is not None and (len(limit) != 2 or _number(limit[0]) != 0.0 or not math.isinf(_number(limit[1]))):
        problems.append(f"time_step_limit {[_number(v) for v in limit]} (its scan does not clamp dt)")
    for name in ("rope_scaling", "rope_parameters"):
        scaling = config.get(name)
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
        if kind not in (None, "default"):
            problems.append(f"{name} type {kind!r} (its converter writes no rope scaling)")
    if (config.get("tie_word_embeddings") is True
            and float(_get(config, "lm_head_multiplier")) != float(_get(config, "embedding_multiplier"))):
        problems.append("a tied head with lm_head_multiplier != embedding_multiplier (its loader reuses "
                        "token_embd, which holds the embedding multiplier, as the head)")
    if config.get("mamba_d_ssm") is None:
        problems.append("no mamba_d_ssm (its converter reads the SSM width from it only; set it to "
                        "mamba_expand * hidden_size)")
    if problems:
        raise UnsupportedArchitectureError("falcon-h1: llama.cpp would compute another model: " + "; ".join(problems))


# -- tensor values, as FalconH1Model.modify_tensors computes them in torch ---------------------------
def _widen(arr: np.ndarray, dtype: str) -> np.ndarray:
    """llama.cpp's converter computes in the source dtype, bf16 widened to float32 first (conversion/base.py
    ``ModelBase.prepare_tensors``)."""
    if dtype == "BF16":
        return to_float32(arr, "BF16")
    return arr


def _scale(arr: np.ndarray, factor: float) -> np.ndarray:
    """``tensor * factor`` as torch computes it: the Python float rounded to float32, the product in float32 and
    rounded to the tensor's dtype (torch's CPU opmath for half)."""
    out = arr.astype(np.float32) * np.float32(factor)
    return out.astype(arr.dtype)


def _in_proj(arr: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """ssm_in: times ssm_in_multiplier, then each of z, x, B, C, dt times its ssm_multipliers entry."""
    out = _scale(arr, float(_get(config, "ssm_in_multiplier")))
    m = [float(v) for v in _get(config, "ssm_multipliers")]
    d_inner = int(config["mamba_d_ssm"])
    gs = int(config.get("mamba_n_groups") or 1) * int(config["mamba_d_state"])
    bounds = [0, d_inner, 2 * d_inner, 2 * d_inner + gs, 2 * d_inner + 2 * gs, out.shape[0]]
    for i in range(5):
        part = out[bounds[i]:bounds[i + 1]]
        out[bounds[i]:bounds[i + 1]] = _scale(part, m[i])
    return out


def _value_rule(source: str, config: Mapping[str, Any]) -> Callable[[np.ndarray], np.ndarray] | None:
    """FalconH1Model.modify_tensors' multiplier for an HF tensor name (its tests, in its order)."""
    mlp = [float(v) for v in _get(config, "mlp_multipliers")]
    aim = float(_get(config, "attention_in_multiplier"))
    if "down_proj" in source:
        return lambda a: _scale(a, mlp[1])
    if "gate_proj" in source:
        return lambda a: _scale(a, mlp[0])
    if "k_proj" in source:
        key = float(_get(config, "key_multiplier"))
        return lambda a: _scale(_scale(a, key), aim)
    if "q_proj" in source or "v_proj" in source:
        return lambda a: _scale(a, aim)
    if "o_proj" in source:
        return lambda a: _scale(a, float(_get(config, "attention_out_multiplier")))
    if "out_proj" in source:
        return lambda a: _scale(a, float(_get(config, "ssm_out_multiplier")))
    if "in_proj" in source:
        return lambda a: _in_proj(a, config)
    if "lm_head" in source:
        return lambda a: _scale(a, float(_get(config, "lm_head_multiplier")))
    if "embed_tokens" in source:
        return lambda a: _scale(a, float(_get(config, "embedding_multiplier")))
    return None


def _shape_rule(kind: str, gguf: str, shape: tuple[int, ...],
                config: Mapping[str, Any]) -> tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray] | None]:
    """Mamba2Model.modify_tensors' renames, reshapes and A = -exp(A_log), and gguf-py's name for the FFN norm:
    (gguf name, shape, value rule)."""
    if kind == "SSM_A":
        return gguf, (*shape, 1), lambda a: neg_exp(a.reshape(*a.shape, 1))
    if kind == "SSM_D":
        return gguf, (*shape, 1), lambda a: a.reshape(*a.shape, 1)
    if kind == "SSM_DT":  # dt_bias -> dt_proj.bias (Mamba2Model.filter_tensors)
        return f"{gguf}.bias", shape, None
    if kind == "SSM_CONV1D" and gguf.endswith(".weight"):
        squeezed = tuple(d for d in shape if d != 1)
        return gguf, squeezed, lambda a: a.reshape(squeezed)
    if kind == "FFN_PRE_NORM":  # gguf-py maps "pre_ff_layernorm.weight" whole: no suffix (tensor_mapping.py)
        return gguf.removesuffix(".weight"), shape, None
    if kind == "SSM_NORM":
        n_group = int(config.get("mamba_n_groups") or 1)
        grouped = (n_group, int(config["mamba_d_ssm"]) // n_group)
        return gguf, grouped, lambda a: a.reshape(grouped)
    return gguf, shape, None


def _chain(load: Callable[[], np.ndarray], dtype: str,
           rules: Sequence[Callable[[np.ndarray], np.ndarray]]) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        arr = _widen(load(), dtype)
        for rule in rules:
            arr = rule(arr)
        return np.ascontiguousarray(arr)

    return run


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], np.ndarray]],
                    config: Mapping[str, Any]) -> list[Raw]:
    """The tensors as FalconH1Model.modify_tensors yields them: shapes (A and D as [n_head, 1], conv1d as
    [channels, kernel], ssm_norm as [n_group, d_inner / n_group]), ``ssm_dt.bias``, A = -exp(A_log), and every
    muP multiplier folded into its weight. A BF16 source is computed in float32, as llama.cpp's converter does
    (its planned source dtype becomes F32)."""
    out: list[Raw] = []
    for gguf, source, kind, shape, dtype, transform in raw:
        load = loaders.pop(gguf)
        name, new_shape, shape_rule = _shape_rule(kind, gguf, shape, config)
        value_rule = _value_rule(source, config)
        rules = [r for r in (shape_rule, value_rule) if r is not None]
        changes_values = kind == "SSM_A" or value_rule is not None
        new_dtype = "F32" if dtype == "BF16" and changes_values else dtype
        out.append((name, source, kind, new_shape, new_dtype, transform))
        loaders[name] = _chain(load, dtype if changes_values else "", rules) if rules else load
    return out
