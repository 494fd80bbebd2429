"""DeepSeek V2 / V3 and GLM-4.7-Flash hooks (GGUF arch ``deepseek2``): what registry.yaml cannot say
(conversion/deepseek.py ``DeepseekV2Model``, conversion/glm.py ``Glm4MoeLiteModel``, src/models/deepseek2.cpp).

- Multi-head latent attention: ``kv_b_proj`` ``[n_head * (qk_nope + v), kv_lora_rank]`` split per head into
  ``attn_k_b`` (the nope rows, transposed: ``[n_head, kv_lora_rank, qk_nope]``) and ``attn_v_b`` (``[n_head, v,
  kv_lora_rank]``), as DeepseekV2Model.modify_tensors splits it for the absorbed graph; the keys of the MQA view
  (key_length kv_lora_rank + qk_rope, value_length kv_lora_rank) and of the MLA heads.
- ``reference_view``: attn_k_b's and attn_v_b's rows where they lie in ``kv_b_proj``, for ``convert --check`` to
  round them in the GGUF's own rows (eval/convert_check.py).
- The router's ``e_score_correction_bias`` (no ``.weight``/``.bias`` suffix) as ``exp_probs_b.bias``.
- Keys llama.cpp's converter writes only when the config spells them, where the class's default differs from
  what llama.cpp's loader assumes without them: the gating function (``scoring_func``; the loader assumes
  softmax, V3 and GLM-4.7-Flash route by sigmoid), ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group`` /
  ``topk_group`` and the leading dense layers (GLM-4.7-Flash's transformers 5 config says them as
  ``mlp_layer_types``). Each is written from the class's default, the file llama.cpp's converter writes when
  the config spells the default out.
- yarn's ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier`` = 0.1 * mscale_all_dim (DeepseekV2Model
  set_gguf_parameters, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]; the loader divides the 0.1 out again).
- Refused: what llama.cpp's deepseek2 loader or graph cannot represent (module constants below).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ggufkit.errors import UnsupportedArchitectureError

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]
Loader = Callable[[], np.ndarray]
V2, V3, GLM_LITE = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"
#: Router defaults of each class's config (transformers 5 DeepseekV2Config, DeepseekV3Config,
#: Glm4MoeLiteConfig): gating, norm_topk_prob, routed_scaling_factor, n_group, topk_group, first_k_dense_replace.
#: V2's router never renormalises (DeepseekV2TopkRouter), whatever norm_topk_prob says.
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    V2: {"gating": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": None,
         "topk_group": None, "first_k_dense_replace": 0},
    V3: {"gating": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
         "topk_group": 4, "first_k_dense_replace": 3},
    GLM_LITE: {"gating": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 1.8, "n_group": 1,
               "topk_group": 1, "first_k_dense_replace": 1},
}
#: ExpertGatingFuncType (gguf-py constants.py)
GATING = {"softmax": 1, "sigmoid": 2}


def _class(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or [V3]
    return archs[0] if archs[0] in CLASS_DEFAULTS else V3


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedArchitectureError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def _get(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or the class's default where the config leaves it out (or null)."""
    value = config.get(key)
    return CLASS_DEFAULTS[_class(config)].get(key) if value is None else value


def dense_lead(config: Mapping[str, Any]) -> int:
    """The number of leading dense layers: ``first_k_dense_replace``, or the leading ``"dense"`` entries of
    GLM-4.7-Flash's transformers 5 ``mlp_layer_types``."""
    types = config.get("mlp_layer_types")
    if config.get("first_k_dense_replace") is None and isinstance(types, list):
        lead = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t != "sparse" for t in types[lead:]) or any(t != "dense" for t in types[:lead]):
            raise UnsupportedArchitectureError(
                f"{_class(config)}: llama.cpp would compute another model: mlp_layer_types {types} (the deepseek2 "
                "loader takes the dense layers as a leading block)")
        return lead
    return int(_get(config, "first_k_dense_replace"))


def _lite_layer_count(config: Mapping[str, Any]) -> bool:
    """The layer counts llama.cpp's deepseek2 loader reads without a q LoRA rank (llama_model_deepseek2::
    load_arch_hparams ``is_lite``): 26, 27, or 48 with a 128256-token vocabulary."""
    n = config.get("num_hidden_layers")
    return n in (26, 27) or (n == 48 and config.get("vocab_size") == 128256)


def _glm_lite_shape(config: Mapping[str, Any]) -> bool:
    """GLM-4.7-Flash's own shape, which llama.cpp's loader routes by sigmoid without a gating key
    (llama_model_deepseek2::load_arch_hparams: 47 or 48 layers of a 154880-token vocabulary)."""
    return config.get("num_hidden_layers") in (47, 48) and config.get("vocab_size") == 154880


def special_tokens(model_dir: Path, present: Mapping[str, Any]) -> dict[str, int]:
    """GLM-4.7-Flash's tokenizer roles as Glm4MoeLiteModel.set_vocab (_set_vocab_glm) names them
    (:func:`ggufkit.converters.glm4moe.special_tokens`); none for DeepSeek's classes."""
    from ggufkit.converters import glm4moe
    from ggufkit.converters.checkpoint import read_config

    if _class(read_config(Path(model_dir))) != GLM_LITE:
        return {}
    return glm4moe.special_tokens(model_dir, present)


def check_config(config: Mapping[str, Any]) -> list[str]:
    """Refuse checkpoints llama.cpp's deepseek2 loader or graph would compute differently; warn where it routes
    V2's groups by another score."""
    cls = _class(config)
    problems: list[str] = []
    warnings: list[str] = []
    _int(config, "n_routed_experts")
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        _int(config, key)
    if config.get("q_lora_rank") is None and not _lite_layer_count(config):
        problems.append(f"no q_lora_rank with {config.get('num_hidden_layers')} layers (the loader reads "
                        "attention.q_lora_rank unless the model has 26 or 27 layers, as DeepSeek-V2-Lite)")
    scoring = config.get("scoring_func")
    if scoring is not None and scoring != CLASS_DEFAULTS[cls]["gating"]:
        problems.append(f"scoring_func {scoring!r} ({cls} routes by {CLASS_DEFAULTS[cls]['gating']})")
    if cls == V2 and config.get("norm_topk_prob"):
        problems.append("norm_topk_prob true (DeepseekV2's router never renormalises; llama.cpp would)")
    if cls != V2 and config.get("rope_interleave") is False:
        problems.append("rope_interleave false (llama.cpp's deepseek2 rope rotates adjacent pairs)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (llama.cpp runs silu)")
    if config.get("attention_bias"):
        problems.append("attention biases (the deepseek2 loader has none)")
    n_group = _get(config, "n_group")
    if n_group and config["n_routed_experts"] % int(n_group):
        problems.append(f"n_routed_experts {config['n_routed_experts']} not a multiple of n_group {n_group}")
    if cls == V2 and (n_group or 1) > 1 and config.get("topk_method") == "group_limited_greedy" and \
            (_get(config, "topk_group") or n_group) < n_group:
        warnings.append("group_limited_greedy: DeepseekV2 picks expert groups by their best expert, llama.cpp's "
                        "build_moe_ffn by the sum of their two best (as DeepSeek V3)")
    dense_lead(config)
    if problems:
        raise UnsupportedArchitectureError(f"{cls}: llama.cpp would compute another model: " + "; ".join(problems))
    return warnings


def hparams(config: Mapping[str, Any], values: dict[str, Any], *_: Any) -> dict[str, Any]:
    """The MLA head sizes, the router keys from the class's defaults, yarn's log multiplier."""
    from ggufkit.format.values import VT

    arch = next(k for k in values if k.endswith(".block_count")).removesuffix(".block_count")
    cls = _class(config)
    out = dict(values)
    kv_lora = int(config.get("kv_lora_rank") or 512)
    rope, nope = _int(config, "qk_rope_head_dim"), _int(config, "qk_nope_head_dim")
    out[f"{arch}.attention.key_length"] = (VT.UINT32, kv_lora + rope)
    out[f"{arch}.attention.value_length"] = (VT.UINT32, kv_lora)
    out[f"{arch}.attention.key_length_mla"] = (VT.UINT32, nope + rope)
    out[f"{arch}.leading_dense_block_count"] = (VT.UINT32, dense_lead(config))
    for key, field in (("expert_group_count", "n_group"), ("expert_group_used_count", "topk_group")):
        if _get(config, field) is not None:
            out[f"{arch}.{key}"] = (VT.UINT32, int(_get(config, field)))
    if config.get("scoring_func") is not None or cls == V3 or (cls == GLM_LITE and not _glm_lite_shape(config)):
        out[f"{arch}.expert_gating_func"] = (VT.UINT32, GATING[CLASS_DEFAULTS[cls]["gating"]])
    if config.get("routed_scaling_factor") is not None or cls != V2:
        out[f"{arch}.expert_weights_scale"] = (VT.FLOAT32, float(_get(config, "routed_scaling_factor")))
    if cls != V2 and _get(config, "norm_topk_prob"):
        out[f"{arch}.expert_weights_norm"] = (VT.BOOL, True)
    for params in (config.get("rope_parameters"), config.get("rope_scaling")):
        if isinstance(params, Mapping) and params.get("mscale_all_dim") is not None:
            out[f"{arch}.rope.scaling.yarn_log_multiplier"] = (VT.FLOAT32, 0.1 * float(params["mscale_all_dim"]))
            break
    return out


# -- tensors ---------------------------------------------------------------------------------------
def _wrap(loaders: dict[str, Loader], old: str, new: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    inner = loaders[old]
    loaders[new] = lambda: fn(inner())


def _k_b(n_head: int, nope: int, v: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: np.ascontiguousarray(a.reshape(n_head, nope + v, -1)[:, :nope].transpose(0, 2, 1))


def _v_b(n_head: int, nope: int, v: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: np.ascontiguousarray(a.reshape(n_head, nope + v, -1)[:, nope:])


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Loader], config: Mapping[str, Any]) -> list[Raw]:
    """``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` in its place (DeepseekV2Model.modify_tensors), the
    correction bias named ``exp_probs_b.bias``."""
    n_head = _int(config, "num_attention_heads")
    nope, v = _int(config, "qk_nope_head_dim"), _int(config, "v_head_dim")
    out: list[Raw] = []
    for name, source, kind, shape, dtype, transform in raw:
        if kind == "ATTN_KV_B":
            if shape[0] != n_head * (nope + v):
                raise UnsupportedArchitectureError(f"{source}: {shape[0]} rows, expected num_attention_heads x "
                                                   f"(qk_nope_head_dim + v_head_dim) = {n_head * (nope + v)}")
            k_name, v_name = name.replace("attn_kv_b", "attn_k_b"), name.replace("attn_kv_b", "attn_v_b")
            _wrap(loaders, name, k_name, _k_b(n_head, nope, v))
            _wrap(loaders, name, v_name, _v_b(n_head, nope, v))
            del loaders[name]
            out.append((k_name, source, "ATTN_K_B", (n_head, shape[1], nope), dtype, transform))
            out.append((v_name, source, "ATTN_V_B", (n_head, v, shape[1]), dtype, transform))
            continue
        if kind == "FFN_EXP_PROBS_B" and not name.endswith((".weight", ".bias")):
            _wrap(loaders, name, name + ".bias", lambda a: a)
            del loaders[name]
            name += ".bias"
        out.append((name, source, kind, shape, dtype, transform))
    return out


def reference_view(gguf: str, source: str, w: np.ndarray, config: Mapping[str, Any]) -> np.ndarray | None:
    """The rows of ``attn_k_b`` / ``attn_v_b`` where they lie in ``w``, their ``kv_b_proj``, for ``convert --check``'s
    reference (eval/convert_check.py) to round them in the GGUF's own rows: a view of ``w`` (writing it writes
    ``w``) shaped as :func:`rewrite_tensors` computes the tensor, ``[n_head, qk_nope + v, kv_lora_rank]`` cut
    per head: attn_v_b's rows are kv_b_proj's rows after each head's nope ones, attn_k_b's are the nope rows'
    columns (the last two axes swapped); None for every other tensor."""
    kind = gguf.split(".")[-2]
    if kind not in ("attn_k_b", "attn_v_b") or not gguf.endswith(".weight") or not source.endswith("kv_b_proj.weight"):
        return None
    n_head = _int(config, "num_attention_heads")
    nope, v = _int(config, "qk_nope_head_dim"), _int(config, "v_head_dim")
    heads = w.reshape(n_head, nope + v, -1)  # a view of a contiguous w
    return heads[:, :nope].swapaxes(-1, -2) if kind == "attn_k_b" else heads[:, nope:]
