"""Llama 4 hooks (``Llama4ForCausalLM`` and the text half of ``Llama4ForConditionalGeneration``, GGUF arch
``llama4``): what registry.yaml cannot say (conversion/llama.py ``Llama4Model``).

- Tensors: the experts' fused ``gate_up_proj`` ``[n_expert, n_embd, 2 * n_ff]`` transposed and split into
  ``ffn_gate_exps`` and ``ffn_up_exps`` (gate first), ``down_proj`` ``[n_expert, n_ff, n_embd]`` transposed into
  ``ffn_down_exps`` (Llama4Model.modify_tensors); the llama3 ``rope_freqs`` (converters/llama.py).
- Refused: what llama.cpp's llama4 loader and graph (src/models/llama4.cpp) cannot represent. Its loader reads
  no key for the NoPE schedule, the chunked attention or the temperature tuning: it fixes them (a NoPE layer
  every 4th, full attention there and chunks of 8192 tokens on the others, ``floor_scale`` 8192, ``attn_scale``
  0.1) unless the file says ``attention.sliding_window`` 0, which the converter writes when every
  ``layer_types`` entry is ``full_attention`` (no ``attention_chunk_size``); then its graph still skips RoPE on
  the last layer and aborts on the temperature input (``n_attn_temp_floor_scale`` 0). The L2 q/k norm is on
  unless there are 128 experts (the loader's type 17B_128E), whatever ``use_qk_norm`` says. MoE layers are every
  ``interleave_moe_layer_step``-th (``moe_layers`` must agree). transformers reads the schedule from
  ``no_rope_layers`` (1 = RoPE; an empty list, as Llama-4-Scout's config writes it, means the default) or
  ``no_rope_layer_interval`` (4), and the chunked layers from ``layer_types`` or, without it, the RoPE layers
  when ``attention_chunk_size`` is set (Llama4TextConfig.__post_init__).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufkit.converters.llama import extra_tensors as llama3_rope_freqs
from ggufkit.converters.rewrite import Raw
from ggufkit.errors import UnsupportedArchitectureError

Loader = Callable[[], np.ndarray]
#: What llama.cpp's llama4 loader fixes (src/models/llama4.cpp load_arch_hparams).
NO_ROPE_STEP = 4
CHUNK_SIZE = 8192
FLOOR_SCALE = 8192
ATTN_SCALE = 0.1
#: The loader's LLM_TYPE_17B_128E, the one type without the L2 q/k norm.
N_EXPERT_NO_QK_NORM = 128
#: Llama4TextConfig's defaults, which llama.cpp's converter sees through AutoConfig where a config omits them.
DEFAULTS: dict[str, Any] = {"no_rope_layer_interval": 4, "attention_chunk_size": 8192, "floor_scale": 8192,
                            "attn_scale": 0.1, "attn_temperature_tuning": True, "use_qk_norm": True,
                            "num_local_experts": 16, "interleave_moe_layer_step": 1}


def _get(config: Mapping[str, Any], key: str) -> Any:
    return config[key] if key in config else DEFAULTS[key]


def rope_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which layers apply RoPE in transformers' Llama 4 (``no_rope_layers``, else every
    ``no_rope_layer_interval``-th layer without)."""
    n_layer = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags:  # Llama4TextConfig: `self.no_rope_layers if self.no_rope_layers else default`
        return [bool(f) for f in list(flags)[:n_layer]]
    interval = int(_get(config, "no_rope_layer_interval"))
    return [(il + 1) % interval != 0 for il in range(n_layer)]


def chunked_layers(config: Mapping[str, Any], rope: list[bool]) -> list[bool]:
    """Which layers attend in chunks in transformers' Llama 4 (``layer_types``, else the RoPE layers when
    ``attention_chunk_size`` is set)."""
    types = config.get("layer_types")
    if types is None:
        return [r and _get(config, "attention_chunk_size") is not None for r in rope]
    return [t == "chunked_attention" for t in list(types)[:len(rope)]]


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """The MoE layers in transformers' Llama 4 (``moe_layers``, else every ``interleave_moe_layer_step``-th)."""
    n_layer = int(config["num_hidden_layers"])
    listed = config.get("moe_layers")
    if listed is not None:
        return sorted(int(i) for i in listed)
    step = int(_get(config, "interleave_moe_layer_step"))
    return list(range(step - 1, n_layer, step)) if step > 0 else []


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse Llama 4 configs llama.cpp's llama4 graph would compute otherwise (module docstring)."""
    n_layer = int(config["num_hidden_layers"])
    problems = []
    rope = rope_layers(config)
    want_rope = [(il + 1) % NO_ROPE_STEP != 0 for il in range(n_layer)]
    chunked = chunked_layers(config, rope)
    if len(chunked) == n_layer and not any(chunked):
        problems.append("no chunked-attention layer (attention_chunk_size null / layer_types all full_attention): "
                        "llama.cpp's converter then writes sliding_window 0, and its llama4 graph skips RoPE on the "
                        "last layer and aborts on the temperature-tuning input")
    elif len(rope) < n_layer or rope != want_rope:
        problems.append(f"NoPE layers {[il for il, r in enumerate(rope) if not r]} (no_rope_layers / "
                        f"no_rope_layer_interval), but llama.cpp's llama4 graph skips RoPE on every {NO_ROPE_STEP}th "
                        f"layer ({[il for il, r in enumerate(want_rope) if not r]}) and reads no key for it")
    elif chunked != want_rope:
        problems.append(f"chunked-attention layers {[il for il, c in enumerate(chunked) if c]} (layer_types), but "
                        "llama.cpp's llama4 graph chunks exactly the RoPE layers")
    else:
        if _get(config, "attention_chunk_size") != CHUNK_SIZE:
            problems.append(f"attention_chunk_size {_get(config, 'attention_chunk_size')} (llama.cpp's llama4 "
                            f"loader fixes {CHUNK_SIZE})")
        nope = not all(want_rope)
        if nope and not _get(config, "attn_temperature_tuning"):
            problems.append("attn_temperature_tuning off (llama.cpp's llama4 graph always scales the NoPE layers' "
                            "queries)")
        if nope and _get(config, "floor_scale") != FLOOR_SCALE:
            problems.append(f"floor_scale {_get(config, 'floor_scale')} (llama.cpp's llama4 loader fixes "
                            f"{FLOOR_SCALE})")
        if nope and float(_get(config, "attn_scale")) != ATTN_SCALE:
            problems.append(f"attn_scale {_get(config, 'attn_scale')} (llama.cpp's llama4 loader fixes {ATTN_SCALE})")
    n_expert = int(_get(config, "num_local_experts"))
    if n_expert < 1:
        problems.append("no experts (llama.cpp's llama4 loader refuses zero experts)")
    qk_norm = bool(_get(config, "use_qk_norm"))
    if qk_norm != (n_expert != N_EXPERT_NO_QK_NORM):
        problems.append(f"use_qk_norm {str(qk_norm).lower()} with {n_expert} experts (llama.cpp's llama4 loader "
                        f"applies the L2 q/k norm exactly when there are not {N_EXPERT_NO_QK_NORM} experts)")
    step = _get(config, "interleave_moe_layer_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        problems.append(f"interleave_moe_layer_step {step!r} (llama.cpp needs a positive step)")
    elif moe_layers(config) != list(range(step - 1, n_layer, step)):
        problems.append(f"MoE layers {moe_layers(config)} (moe_layers), but llama.cpp's llama4 loader makes every "
                        f"interleave_moe_layer_step-th layer ({step}) one")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (llama.cpp runs silu)")
    if config.get("attention_bias"):
        problems.append("attention biases (the llama4 loader has none)")
    if problems:
        raise UnsupportedArchitectureError("llama4: llama.cpp would compute another model: " + "; ".join(problems))


def extra_tensors(config: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """``rope_freqs.weight`` for llama3 rope scaling (Llama4Model inherits LlamaModel.generate_extra_tensors)."""
    return llama3_rope_freqs(config)


def _transposed(load: Loader, part: slice | None = None) -> Loader:
    def run() -> np.ndarray:
        arr = load()
        if part is not None:
            arr = arr[..., part]
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2))

    return run


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Loader], config: Mapping[str, Any]) -> list[Raw]:
    """The stacked experts as Llama4Model.modify_tensors yields them: ``gate_up_proj`` transposed and split
    (gate, then up), ``down_proj`` transposed; both named with ``.weight``."""
    out: list[Raw] = []
    for gguf, source, kind, shape, dtype, transform in raw:
        if kind == "FFN_GATE_EXP" and source.endswith("gate_up_proj"):
            load = loaders.pop(gguf)
            n_expert, n_embd, width = shape
            half = width // 2
            for name, part in ((gguf + ".weight", slice(0, half)),
                               (gguf.replace("ffn_gate_exps", "ffn_up_exps") + ".weight", slice(half, width))):
                out.append((name, source, "FFN_GATE_EXP" if part.start == 0 else "FFN_UP_EXP",
                            (n_expert, half, n_embd), dtype, transform))
                loaders[name] = _transposed(load, part)
            continue
        if kind == "FFN_DOWN_EXP" and source.endswith("experts.down_proj"):
            load = loaders.pop(gguf)
            name = gguf + ".weight"
            out.append((name, source, kind, (shape[0], shape[2], shape[1]), dtype, transform))
            loaders[name] = _transposed(load)
            continue
        out.append((gguf, source, kind, shape, dtype, transform))
    return out
