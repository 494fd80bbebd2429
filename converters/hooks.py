"""Per-class hooks for what registry.yaml cannot say, registered with ``@hook("HFClassName", "<kind>")``.

Kinds:
    ``check_config(config) -> None``: refuse configs the target runtime cannot run (raise a GGUFKitError).
    ``extra_tensors(config) -> list[(gguf_name, float32 array)]``: tensors computed from the config, written
    before the checkpoint's tensors (as llama.cpp's ``generate_extra_tensors``).

Hooks live in ``converters/<family>.py``; :func:`hooks_for` imports those modules on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: hf_class -> kind -> function
HOOKS: dict[str, dict[str, Callable[..., Any]]] = {}
HOOK_KINDS = ("check_config", "extra_tensors")
#: Modules that register hooks (one per family).
HOOK_MODULES = ("ggufkit.converters.llama", "ggufkit.converters.opt")


def hook(hf_class: str, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as ``hf_class``'s ``kind`` hook (at most one per class and kind)."""
    if kind not in HOOK_KINDS:
        raise ValueError(f"unknown hook kind {kind!r}")

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        kinds = HOOKS.setdefault(hf_class, {})
        if kind in kinds and kinds[kind] is not func:
            raise ValueError(f"{hf_class} already has a {kind} hook")
        kinds[kind] = func
        return func

    return register


def load_hooks() -> dict[str, dict[str, Callable[..., Any]]]:
    for name in HOOK_MODULES:
        importlib.import_module(name)
    return HOOKS


def hooks_for(hf_class: str) -> dict[str, Callable[..., Any]]:
    """The hooks registered for ``hf_class`` (possibly none)."""
    return load_hooks().get(hf_class, {})
