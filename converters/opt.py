"""OPT hooks: refuse OPT variants PowerInfer's OPT graph cannot run (PowerInfer llama.cpp: llm_load_tensors and the OPT graph)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError


def check_config(config: Mapping[str, Any]) -> None:
    """Pre-LN, ReLU, biases, no project_in/out: the OPT-1.3B+ shape that PowerInfer's build_opt assumes."""
    problems = []
    hidden = config.get("hidden_size")
    proj = config.get("word_embed_proj_dim", hidden)
    if proj != hidden:
        problems.append(f"word_embed_proj_dim {proj} != hidden_size {hidden} (project_in/out)")
    if config.get("do_layer_norm_before", True) is not True:
        problems.append("post-LayerNorm blocks (do_layer_norm_before: false)")
    if config.get("activation_function", "relu") != "relu":
        problems.append(f"activation {config.get('activation_function')!r} (PowerInfer's OPT graph is ReLU)")
    if config.get("enable_bias", True) is not True:
        problems.append("no biases (enable_bias: false)")
    if problems:
        raise UnsupportedArchitectureError("this OPT variant cannot be run by PowerInfer's OPT graph: "
                                           + "; ".join(problems))
