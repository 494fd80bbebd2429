"""Hooks for what registry.yaml cannot say, one module per family, named by an entry's ``hooks:`` field.

A hooks module ``ggufkit.converters.<family>`` defines any of these module-level functions:
    ``architecture(config) -> str``: the GGUF architecture for this config when one HF class has several
    (Nemotron-H: ``nemotron_h``, or ``nemotron_h_moe`` with experts); runs before ``check_config``.
    ``hparams(config, values, tensor_names) -> values``: keys the registry cannot say (per-layer arrays,
    values computed from several fields or from the checkpoint's tensor names, a tuple, empty for
    ``--vocab-only``): ``values`` maps a full key to ``(value type, value)``; an array's item type follows
    its first item (bool, float, int), as gguf-py's ``add_array``.
    ``check_config(config) -> None``: refuse configs the target runtime cannot run (raise a GGUFKitError), or
    return warnings (a list of strings) where llama.cpp computes something harmlessly different.
    ``extra_tensors(config) -> list[(gguf_name, float32 array)]``: tensors computed from the config, written
    before the checkpoint's tensors (as llama.cpp's ``generate_extra_tensors``).
    ``rewrite_tensors(raw, loaders, config) -> raw``: merge, split or rewrite planned tensors (``Raw`` tuples
    of :mod:`ggufkit.converters.rewrite`; ``loaders`` holds every planned tensor's loader: wrap or replace
    them, and new tensors get one there) after the registry's mapping and expert stacking, before output types
    are chosen.
    ``mmproj_metadata(config, preprocessor) -> {key: (type, value, item type)}``: projector keys YAML cannot
    say (written after clip.projector_type; see :mod:`ggufkit.converters.mmproj`).
    ``special_tokens(model_dir, metadata) -> {key: token id}``: tokenizer ids the family's llama.cpp converter
    sets by token text where the tokenizer files gave none (GLM's ``_set_vocab_glm``), written after the
    vocabulary.
    ``mmproj_rewrite(raw, loaders, config) -> raw``: as ``rewrite_tensors``, for a projector's planned tensors
    (split a fused tensor, renumber), before its types are chosen and its shapes checked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

HOOK_KINDS = ("architecture", "hparams", "check_config", "extra_tensors", "rewrite_tensors", "mmproj_metadata", "mmproj_rewrite",
              "special_tokens")
#: Families with a hooks module (registry.yaml ``hooks:`` values).
HOOK_FAMILIES = frozenset({"llama", "opt", "qwen_moe", "gemma", "phi3", "llava", "qwen_vl", "smollm3", "cohere2",
                           "falcon_h1", "gemma3n", "lfm2", "qwen3next", "nemotron_h",
                           "granite_hybrid", "ernie", "llama4", "deepseek2", "gpt_oss", "glm4moe"})


def hooks_module(family: str) -> Any:
    """The hooks module of ``family``."""
    if family not in HOOK_FAMILIES:
        raise ValueError(f"unknown hooks module {family!r}")
    return importlib.import_module(f"ggufkit.converters.{family}")


def hooks_for(family: str | None) -> dict[str, Callable[..., Any]]:
    """The hooks ``family``'s module defines (none for None)."""
    if family is None:
        return {}
    module = hooks_module(family)
    return {kind: getattr(module, kind) for kind in HOOK_KINDS if callable(getattr(module, kind, None))}
