"""Cohere 2 hooks (Command R7B, Command A): refuse checkpoints llama.cpp's cohere2 loader and graph would
silently compute differently (src/models/cohere2.cpp; conversion/command_r.py ``Cohere2Model``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufkit.converters.gemma import is_sliding
from ggufkit.errors import UnsupportedArchitectureError

#: Every 4th layer attends globally (without RoPE), the others through the sliding window (with RoPE):
#: llama_model_cohere2::load_arch_hparams ``load_swa_pattern(ml, 4)``; Cohere2Model writes no pattern key.
SWA_PATTERN = 4


def _layer_types(config: Mapping[str, Any], n_layer: int) -> list[str] | None:
    """The schedule transformers runs: ``layer_types`` (transformers 5), else the release configs' period
    ``sliding_window_pattern`` (Cohere2Config.__post_init__: layer i slides when ``(i + 1) % period``)."""
    types = config.get("layer_types")
    if isinstance(types, list):
        return [str(t) for t in types]
    period = config.get("sliding_window_pattern", SWA_PATTERN)
    if not isinstance(period, int) or isinstance(period, bool) or period <= 0:
        return None
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layer)]


def check_config(config: Mapping[str, Any]) -> None:
    """A tied head, no biases, SiLU, no rope scaling, and llama.cpp's fixed layer schedule."""
    problems = []
    if config.get("tie_word_embeddings", True) is False or config.get("use_embedding_sharing", True) is False:
        problems.append("an lm_head not tied to the embeddings (llama.cpp's cohere2 loader uses token_embd as "
                        "the head)")
    if config.get("attention_bias") is True:
        problems.append("attention biases (llama.cpp's cohere2 graph has none; its converter drops them only "
                        "when they are all zero)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (llama.cpp's cohere2 FFN is SiLU-gated)")
    for name in ("rope_scaling", "rope_parameters"):
        scaling = config.get(name)
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
        if kind not in (None, "default"):
            problems.append(f"{name} type {kind!r} (llama.cpp's converter writes rope scaling 'none')")
    n_layer = config.get("num_hidden_layers")
    if isinstance(n_layer, int):
        want = ["sliding_attention" if is_sliding(i, SWA_PATTERN) else "full_attention" for i in range(n_layer)]
        if _layer_types(config, n_layer) != want:
            problems.append(f"a layer schedule other than llama.cpp's fixed one (every {SWA_PATTERN}th layer "
                            "global: layer_types / sliding_window_pattern)")
    if problems:
        raise UnsupportedArchitectureError("cohere2: llama.cpp would compute another model: " + "; ".join(problems))
