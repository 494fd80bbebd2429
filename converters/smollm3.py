"""SmolLM3 hooks: refuse the NoPE schedules and sliding-window layers llama.cpp's smollm3 graph does not compute.

llama.cpp's loader fixes the NoPE step at 4, whatever the checkpoint says, and its converter writes no key for
it (src/models/smollm3.cpp: ``load_arch_hparams`` sets ``n_no_rope_layer_step = 4``; the graph skips RoPE on
layer ``il`` when ``(il + 1) % 4 == 0``; conversion/llama.py ``SmolLM3Model`` adds nothing to LlamaModel). The
graph has no sliding window either. transformers reads the schedule from ``no_rope_layers`` (one entry per
layer, 1 = RoPE; release configs and transformers 5's save_pretrained both write it), or, when that list is
absent, builds it from ``no_rope_layer_interval`` (default 4); a layer slides when ``layer_types`` says
``sliding_attention``, which transformers derives from ``use_sliding_window`` and ``sliding_window`` for the
NoPE layers when ``layer_types`` is absent (transformers' SmolLM3Config.__post_init__ and SmolLM3Attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufkit.converters.hparams import rope_scaling
from ggufkit.errors import UnsupportedArchitectureError

#: llama.cpp's ``n_no_rope_layer_step`` for smollm3 (src/models/smollm3.cpp load_arch_hparams).
NO_ROPE_STEP = 4


def uses_rope(il: int, step: int = NO_ROPE_STEP) -> bool:
    """Layer ``il`` applies RoPE in llama.cpp's smollm3 graph (``(il + 1) % n_no_rope_layer_step != 0``)."""
    return (il + 1) % step != 0


def rope_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which layers apply RoPE in transformers' SmolLM3 for this config (every spelling it reads)."""
    n_layer = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or NO_ROPE_STEP)
        return [uses_rope(il, interval) for il in range(n_layer)]
    return [bool(f) for f in list(flags)[:n_layer]]


def sliding_layers(config: Mapping[str, Any], rope: list[bool]) -> list[bool]:
    """Which layers attend through a sliding window in transformers' SmolLM3 for this config."""
    types = config.get("layer_types")
    if types is None:
        window = bool(config.get("use_sliding_window")) and config.get("sliding_window") is not None
        return [window and not r for r in rope]
    return [t == "sliding_attention" for t in types[:len(rope)]]


def check_config(config: Mapping[str, Any]) -> None:
    """A NoPE schedule equal to llama.cpp's fixed one, no sliding-window layer, no llama3 rope scaling."""
    rope = rope_layers(config)
    want = [uses_rope(il) for il in range(len(rope))]
    if len(rope) < int(config["num_hidden_layers"]) or rope != want:
        nope = [il for il, r in enumerate(rope) if not r]
        raise UnsupportedArchitectureError(
            f"smollm3: llama.cpp would compute another model: NoPE layers {nope} (no_rope_layers / "
            f"no_rope_layer_interval), but llama.cpp's smollm3 graph skips RoPE on every {NO_ROPE_STEP}th layer "
            f"({[il for il, r in enumerate(want) if not r]}) and reads no key for it")
    sliding = [il for il, s in enumerate(sliding_layers(config, rope)) if s]
    if sliding:
        raise UnsupportedArchitectureError(
            f"smollm3: llama.cpp would compute another model: sliding-window layers {sliding} (layer_types / "
            f"use_sliding_window), but llama.cpp's smollm3 graph has no sliding window")
    scaling = rope_scaling(config) or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        # conversion/llama.py LlamaModel.generate_extra_tensors writes rope_freqs.weight, which the smollm3
        # loader never creates (src/models/smollm3.cpp load_arch_tensors): llama.cpp refuses that file
        raise UnsupportedArchitectureError(
            "smollm3: llama3 rope scaling: llama.cpp's converter writes a rope_freqs tensor that its smollm3 "
            "loader does not read (the file would not load)")
