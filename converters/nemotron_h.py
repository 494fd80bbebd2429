"""Nemotron-H hooks (NVIDIA Nemotron-H, Nemotron Nano 2 and 3: ``NemotronHForCausalLM``), as llama.cpp's
converter writes the family (conversion/nemotron.py ``NemotronHModel`` over conversion/granite.py
``GraniteHybridModel`` and conversion/mamba.py ``Mamba2Model``) and its loaders read it
(src/models/nemotron-h.cpp, nemotron-h-moe.cpp).

One HF class, two GGUF architectures: ``nemotron_h_moe`` when the schedule has MoE layers, else
``nemotron_h``. The schedule is one kind per layer: Mamba2 (``M`` / ``mamba`` / ``linear_attention``),
attention (``*`` / ``attention`` / ``full_attention``), squared-ReLU MLP (``-`` / ``mlp``) or MoE (``E`` /
``moe``). The release configs spell it ``hybrid_override_pattern`` (a string); transformers 5 saves
``layers_block_type`` (a list) and no ``num_hidden_layers``. llama.cpp's converter, which reads the config
through transformers' AutoConfig, gets the list form for EVERY checkpoint once transformers knows nemotron_h
(5.x), counts only ``moe`` list entries as FFN layers, and takes any config with ``num_experts_per_tok``
(which AutoConfig always fills in) for the MoE architecture: a dense checkpoint then comes out as
``nemotron_h_moe`` with every FFN width 0, which its loader reads as Mamba2 layers and refuses (missing
``ssm_in``). ggufkit reads every spelling and writes what llama.cpp's converter writes from the release
config.json as written (its fallback when AutoConfig does not know the model): the file llama.cpp runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufkit.converters.ssm_values import neg_exp
from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.format.values import VT

#: Pattern characters (the release configs' hybrid_override_pattern) and transformers' list names.
_CHARS = {"M": "M", "*": "*", "-": "-", "E": "E"}
_NAMES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
#: llama.cpp's converter writes no rope for hybrid models and this context length
#: (conversion/granite.py GraniteHybridModel.set_gguf_parameters: add_context_length(2**20)).
CONTEXT_LENGTH = 2**20
#: llama.cpp's converter pads the token list (not the embedding) to a multiple of this
#: (conversion/nemotron.py NemotronHModel.set_vocab: pad_vocab_size_multiple = 8).
VOCAB_MULTIPLE = 8

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]


def _pattern(value: Any, where: str) -> str:
    if isinstance(value, str):
        bad = sorted(set(value) - set(_CHARS))
        if bad:
            raise UnsupportedArchitectureError(f"nemotron_h: {where} has layer kinds {bad} (known: M, *, -, E)")
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        bad = sorted({v for v in value if v not in _NAMES})
        if bad:
            raise UnsupportedArchitectureError(f"nemotron_h: {where} has layer kinds {bad} (known: "
                                               f"{', '.join(_NAMES)})")
        return "".join(_NAMES[v] for v in value)
    raise UnsupportedArchitectureError(f"nemotron_h: {where} is neither a pattern string nor a list of layer kinds")


def schedule(config: Mapping[str, Any]) -> str:
    """The layer schedule as a pattern string (``M``, ``*``, ``-``, ``E`` per layer) from every spelling:
    ``hybrid_override_pattern`` (release configs), ``layers_block_type`` or ``layer_types`` (transformers 5;
    NemotronHConfig's attribute_map). Two spellings that disagree are refused."""
    found = {key: _pattern(config[key], key) for key in ("hybrid_override_pattern", "layers_block_type",
                                                         "layer_types") if config.get(key) is not None}
    if not found:
        raise UnsupportedArchitectureError("nemotron_h: the config has no layer schedule (hybrid_override_pattern "
                                           "or layers_block_type)")
    if len(set(found.values())) > 1:
        raise UnsupportedArchitectureError(f"nemotron_h: the layer schedules disagree ({', '.join(found)})")
    return next(iter(found.values()))


def is_moe(config: Mapping[str, Any]) -> bool:
    return "E" in schedule(config)


def architecture(config: Mapping[str, Any]) -> str:
    """``nemotron_h_moe`` when the schedule has MoE layers, else ``nemotron_h``."""
    return "nemotron_h_moe" if is_moe(config) else "nemotron_h"


def _head_dim(config: Mapping[str, Any]) -> Any:
    # NemotronHModel.__init__: head_dim, else attention_head_dim (the Nemotron-H 8B/47B/56B release configs)
    return config.get("head_dim") if config.get("head_dim") is not None else config.get("attention_head_dim")


def _number(value: Any) -> Any:
    """A config number; transformers 5 saves infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse what llama.cpp's converter or graph cannot represent (one line)."""
    pattern = schedule(config)
    problems = []
    n_layer = config.get("num_hidden_layers")
    if n_layer is not None and n_layer != len(pattern):
        problems.append(f"num_hidden_layers {n_layer} but a schedule of {len(pattern)} layers")
    if "E" in pattern and "-" in pattern:
        problems.append("both dense MLP and MoE layers (llama.cpp's nemotron_h_moe makes every FFN layer MoE)")
    if not isinstance(_head_dim(config), int):
        problems.append("no head_dim / attention_head_dim")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab % VOCAB_MULTIPLE:
        problems.append(f"vocab_size {vocab} not a multiple of {VOCAB_MULTIPLE} (llama.cpp's converter pads the "
                        "token list but not the embedding, and its loader refuses the file)")
    if config.get("mlp_hidden_act", "relu2") != "relu2":
        problems.append(f"mlp_hidden_act {config.get('mlp_hidden_act')!r} (llama.cpp's FFN is squared ReLU)")
    if config.get("mamba_hidden_act", "silu") != "silu":
        problems.append(f"mamba_hidden_act {config.get('mamba_hidden_act')!r} (llama.cpp's Mamba2 uses SiLU)")
    if config.get("mamba_proj_bias") is True:
        problems.append("mamba_proj_bias (llama.cpp's Mamba2 projections have no bias)")
    if config.get("attention_bias") is True:
        problems.append("attention biases (llama.cpp's converter does not map them)")
    limit = [_number(v) for v in config.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        problems.append(f"time_step_limit {limit} (llama.cpp's scan does not clamp the time step)")
    if config.get("sliding_window") is not None:
        problems.append("a sliding window (llama.cpp's nemotron_h attention is global)")
    if config.get("num_nextn_predict_layers"):
        problems.append("multi-token-prediction layers (num_nextn_predict_layers; not converted yet)")
    if config.get("moe_latent_size") is not None:
        problems.append("a latent MoE projection (moe_latent_size; not converted yet)")
    if problems:
        raise UnsupportedArchitectureError("nemotron_h: llama.cpp would compute another model: " + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, tuple[VT, Any]],
            tensor_names: tuple[str, ...] = ()) -> dict[str, tuple[VT, Any]]:
    """The keys YAML cannot say, as NemotronHModel.set_gguf_parameters writes them: the block count and the
    per-layer KV head counts and FFN widths from the schedule (INT32 arrays: 0 on the Mamba2 layers, KV heads
    on the attention layers, the FFN width on FFN layers), the rope dimensions from ``hidden_size /
    num_attention_heads`` (GraniteModel drops head_dim first), K/V lengths from head_dim, the Mamba2 inner
    size (``mamba_num_heads * mamba_head_dim``) and, for the MoE architecture, the expert keys."""
    pattern = schedule(config)
    arch = architecture(config)
    moe = arch == "nemotron_h_moe"
    n_kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    n_ff = int(config["moe_intermediate_size"] if moe else config["intermediate_size"])
    ffn = "E" if moe else "-"
    head_dim = int(_head_dim(config))
    out = dict(values)
    out[f"{arch}.block_count"] = (VT.UINT32, len(pattern))
    out[f"{arch}.feed_forward_length"] = (VT.ARRAY, [n_ff if c == ffn else 0 for c in pattern])
    out[f"{arch}.attention.head_count_kv"] = (VT.ARRAY, [n_kv if c == "*" else 0 for c in pattern])
    out[f"{arch}.rope.dimension_count"] = (VT.UINT32, int(config["hidden_size"]) // int(config["num_attention_heads"]))
    out[f"{arch}.attention.key_length"] = (VT.UINT32, head_dim)
    out[f"{arch}.attention.value_length"] = (VT.UINT32, head_dim)
    out[f"{arch}.ssm.inner_size"] = (VT.UINT32, int(config["mamba_num_heads"]) * int(config["mamba_head_dim"]))
    if moe:
        for key, name, vtype in (("expert_count", "n_routed_experts", VT.UINT32),
                                 ("expert_used_count", "num_experts_per_tok", VT.UINT32),
                                 ("expert_feed_forward_length", "moe_intermediate_size", VT.UINT32),
                                 ("expert_shared_feed_forward_length", "moe_shared_expert_intermediate_size",
                                  VT.UINT32),
                                 ("expert_shared_count", "n_shared_experts", VT.UINT32),
                                 ("expert_weights_norm", "norm_topk_prob", VT.BOOL),
                                 ("expert_weights_scale", "routed_scaling_factor", VT.FLOAT32),
                                 ("expert_group_count", "n_group", VT.UINT32),
                                 ("expert_group_used_count", "topk_group", VT.UINT32)):
            value = config.get(name, _MOE_DEFAULTS.get(name))
            if value is not None:
                out[f"{arch}.{key}"] = (vtype, bool(value) if vtype == VT.BOOL else
                                        float(value) if vtype == VT.FLOAT32 else int(value))
    return out


#: NemotronHConfig's defaults for MoE keys a config.json may leave out (llama.cpp's converter reads the config
#: through AutoConfig, which fills them in).
_MOE_DEFAULTS = {"n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
                 "topk_group": 1}


def _wrap(loaders: dict[str, Callable[[], Any]], old: str, new: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    load = loaders.pop(old, None)
    if load is not None:
        loaders[new] = lambda: fn(np.asarray(load()))


def _a_from_log(src_dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """``A`` as ``[n_head, 1]`` from ``A_log`` stored as ``src_dtype`` (bf16 widened to float32 first)."""
    def load(a: np.ndarray) -> np.ndarray:
        return neg_exp(a, src_dtype).reshape(-1, 1)

    return load


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], Any]], config: Mapping[str, Any]) -> list[Raw]:
    """The Mamba2 tensors as Mamba2Model.modify_tensors writes them: ``A = -exp(A_log)`` and ``D`` as
    ``[n_head, 1]``, the conv kernel ``[C, 1, K]`` squeezed to ``[C, K]``, the gated norm as
    ``[n_group, d_inner / n_group]``; ``dt_bias`` and the router's ``e_score_correction_bias`` (no
    ``.weight``/``.bias`` suffix in the checkpoint) as ``ssm_dt.bias`` / ``exp_probs_b.bias``."""
    n_group = int(config.get("n_groups") or config.get("mamba_n_groups") or 1)
    out = []
    for name, source, kind, shape, dtype, transform in raw:
        new = name
        if kind in ("SSM_DT", "FFN_EXP_PROBS_B") and not name.endswith((".weight", ".bias")):
            new = name + ".bias"
            _wrap(loaders, name, new, lambda a: a)
        elif kind == "SSM_A":
            # llama.cpp's converter widens bf16 to float32 before modify_tensors (numpy holds bf16 as its bits)
            shape = (int(np.prod(shape)), 1)
            _wrap(loaders, name, name, _a_from_log(dtype))
            dtype = "F32" if dtype == "BF16" else dtype
        elif kind == "SSM_D":
            shape = (int(np.prod(shape)), 1)
            _wrap(loaders, name, name, lambda a: a.reshape(-1, 1))
        elif kind == "SSM_CONV1D" and name.endswith(".weight") and len(shape) == 3:
            shape = (shape[0], shape[2])
            _wrap(loaders, name, name, lambda a: a.reshape(a.shape[0], a.shape[-1]))
        elif kind == "SSM_NORM" and len(shape) == 1:
            shape = (n_group, shape[0] // n_group)
            _wrap(loaders, name, name, lambda a: a.reshape(n_group, -1))
        out.append((new, source, kind, shape, dtype, transform))
    return out
