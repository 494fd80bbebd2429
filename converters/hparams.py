"""Hyperparameters: GGUF keys filled from config.json as registry.yaml declares.

config.json is parsed directly (never through transformers' AutoConfig), so transformers-4 and -5
spellings (``rope_scaling`` / ``rope_parameters``, ``rotary_pct`` / ``partial_rotary_factor``) both work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufkit.converters.registry import ArchEntry, HParam
from ggufkit.errors import CheckpointError
from ggufkit.format.values import VT, Metadata

_VT = {"u32": VT.UINT32, "i32": VT.INT32, "f32": VT.FLOAT32, "bool": VT.BOOL, "str": VT.STRING,
       "i32_list": VT.ARRAY}
_MISSING = object()


def lookup(config: Mapping[str, Any], path: str) -> Any:
    """``config[path]`` where ``path`` may be dotted (``rope_parameters.rope_theta``); missing or null -> _MISSING."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return _MISSING
        node = node[part]
    return node


def first_of(config: Mapping[str, Any], paths: tuple[str, ...] | list[str]) -> Any:
    for p in paths:
        value = lookup(config, p)
        if value is not _MISSING:
            return value
    return _MISSING


def _head_dim(config: Mapping[str, Any]) -> Any:
    head_dim = lookup(config, "head_dim")
    if head_dim is not _MISSING:
        return head_dim
    hidden, heads = first_of(config, ["hidden_size", "n_embd", "dim"]), first_of(config, ["num_attention_heads",
                                                                                            "n_head", "n_heads"])
    if hidden is _MISSING or heads is _MISSING or not heads:
        return _MISSING
    return int(hidden) // int(heads)


def _partial_rotary_dim(config: Mapping[str, Any]) -> Any:
    # transformers 5 moved rotary_pct into rope_parameters.partial_rotary_factor (transformers 5 GPTNeoXConfig).
    pct = first_of(config, ["rotary_pct", "partial_rotary_factor", "rope_parameters.partial_rotary_factor"])
    head = _head_dim(config)
    if head is _MISSING:
        return _MISSING
    return int((1.0 if pct is _MISSING else float(pct)) * head)


def _mrope_sections(config: Mapping[str, Any]) -> Any:
    # M-RoPE's [temporal, height, width] rotary sections padded with zeros to the 4 llama.cpp reads
    # (conversion/base.py TextModel.set_gguf_parameters: mrope_section, add_rope_dimension_sections).
    sections = first_of(config, ["rope_parameters.mrope_section", "rope_scaling.mrope_section", "mrope_section"])
    if sections is _MISSING or not isinstance(sections, list) or len(sections) > 4:
        return _MISSING if sections is _MISSING else sections
    return [*sections, *[0] * (4 - len(sections))]


def _deepstack_layers(config: Mapping[str, Any]) -> Any:
    # Qwen3-VL: one deepstack input per listed vision layer (conversion/qwen3vl.py Qwen3VLTextModel).
    indexes = lookup(config, "vision_config.deepstack_visual_indexes")
    return len(indexes) if isinstance(indexes, list) else 0


DERIVE: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "head_dim": _head_dim,
    "partial_rotary_dim": _partial_rotary_dim,
    "mrope_sections": _mrope_sections,
    "deepstack_layers": _deepstack_layers,
}


def _typed(hp: HParam, value: Any, arch: str) -> Any:
    key = f"{arch}.{hp.key}"
    try:
        if hp.value_type == "i32_list":
            if not isinstance(value, list) or len(value) > 4 or any(isinstance(v, bool) or int(v) != v
                                                                   for v in value):
                raise ValueError(value)
            return [int(v) for v in value]
        if hp.value_type in ("u32", "i32"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if hp.value_type == "f32":
            return float(value)
        if hp.value_type == "bool":
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        return str(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"config.json: {key} would be {value!r}, expected {hp.value_type}") from None


def resolve_hparams(entry: ArchEntry, config: Mapping[str, Any]) -> dict[str, tuple[VT, Any]]:
    """Every GGUF key of ``entry`` that the config determines, in registry order: full key -> (type, value).

    Raises:
        CheckpointError: a required key has no source, or a value has the wrong type.
    """
    out: dict[str, tuple[VT, Any]] = {}
    for hp in entry.hparams:
        value = first_of(config, hp.sources) if hp.sources else _MISSING
        if value is _MISSING and hp.derive is not None:
            value = DERIVE[hp.derive](config)
        if value is _MISSING and hp.default is not None:
            value = hp.default
        if value is _MISSING:
            if hp.required:
                raise CheckpointError(f"config.json has none of {', '.join(hp.sources)} "
                                      f"(needed for {entry.arch}.{hp.key})")
            continue
        out[f"{entry.arch}.{hp.key}"] = (_VT[hp.value_type], _typed(hp, value, entry.arch))
    if entry.rope_scaling:
        out.update(rope_scaling_keys(entry.arch, config))
    return out


def rope_scaling(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The rope scaling dict (``rope_scaling``, or transformers 5's ``rope_parameters``; per layer type, the
    ``full_attention`` one, as llama.cpp's TextModel reads it), or None."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, Mapping):
            full = value.get("full_attention")
            return dict(full) if isinstance(full, Mapping) else dict(value)
    return None


def rope_scaling_keys(arch: str, config: Mapping[str, Any]) -> dict[str, tuple[VT, Any]]:
    """``{arch}.rope.scaling.*`` as llama.cpp writes them (convert_hf_to_gguf.py: TextModel.set_gguf_parameters): linear, yarn, longrope; llama3
    writes none (a rope_freqs tensor instead), default/unknown none."""
    scaling = rope_scaling(config)
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    out: dict[str, tuple[VT, Any]] = {}
    if kind in ("linear", "yarn") and scaling.get("factor") is not None:
        out[f"{arch}.rope.scaling.type"] = (VT.STRING, kind)
        out[f"{arch}.rope.scaling.factor"] = (VT.FLOAT32, float(scaling["factor"]))
    if kind == "yarn":
        if scaling.get("original_max_position_embeddings") is None:
            raise CheckpointError("config.json: yarn rope scaling needs original_max_position_embeddings")
        out[f"{arch}.rope.scaling.original_context_length"] = (VT.UINT32,
                                                               int(scaling["original_max_position_embeddings"]))
        for gguf_key, names in (("yarn_ext_factor", ("extrapolation_factor",)),
                                ("yarn_attn_factor", ("attention_factor", "attn_factor")),
                                ("yarn_beta_fast", ("beta_fast",)), ("yarn_beta_slow", ("beta_slow",))):
            value = first_of(scaling, list(names))
            if value is not _MISSING:
                out[f"{arch}.rope.scaling.{gguf_key}"] = (VT.FLOAT32, float(value))
    elif kind in ("su", "longrope"):
        out[f"{arch}.rope.scaling.type"] = (VT.STRING, "longrope")
    return out


def hparams_metadata(values: Mapping[str, tuple[VT, Any]]) -> Metadata:
    meta = Metadata()
    for key, (vtype, value) in values.items():
        meta.set(key, vtype, value, _item_type(value) if vtype == VT.ARRAY else None)
    return meta


def _item_type(value: Any) -> VT:
    """An array's item type as gguf-py's add_array picks it (GGUFValueType.get_type of the first item):
    BOOL, FLOAT32 or INT32 (a registry ``i32_list``, a hook's per-layer counts)."""
    first = value[0] if len(value) else 0
    return VT.BOOL if isinstance(first, (bool, np.bool_)) else VT.FLOAT32 if isinstance(first, float) else VT.INT32
