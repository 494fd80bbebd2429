"""Phi-3 hooks: refuse long-context (longrope) checkpoints, whose rope factor tensors and attention factor
this converter does not write yet (llama.cpp's conversion/phi.py ``generate_extra_tensors``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufkit.converters.hparams import rope_scaling
from ggufkit.errors import UnsupportedArchitectureError


def check_config(config: Mapping[str, Any]) -> None:
    """No ``long_factor`` rope scaling (Phi-3 128k)."""
    scaling = rope_scaling(config) or {}
    if scaling.get("long_factor") or scaling.get("rope_type", scaling.get("type")) in ("su", "longrope"):
        raise UnsupportedArchitectureError("Phi-3 with longrope scaling (long/short rope factors, the 128k "
                                           "models) is not supported yet")
