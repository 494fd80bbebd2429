"""registry.yaml, loaded safely into frozen, typed, validated objects.

One entry per Hugging Face class name (``config.json`` ``architectures[0]``). Every field is checked on
load: an unknown field, a wrong type, a GGUF architecture, tensor or key unknown to the ``gguf`` package
(and to PowerInfer's additions in :mod:`ggufkit.constants`), an unknown transform or derive rule, or a
duplicate YAML key is a :class:`~ggufkit.errors.RegistryError` naming the entry and the field. Top-level
keys starting with ``_`` only hold YAML anchors and are not entries.

``base: OtherClass`` makes an entry inherit another's fields: the mappings (``hparams``, ``tensors``,
``transforms``) merge key by key (a ``null`` value removes an inherited key), other fields replace the base's.
``hooks: family`` names the module ``ggufkit.converters.<family>`` with what YAML cannot say.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, Keys

from ggufkit.constants import (
    POWERINFER_ARCH_BAMBOO,
    POWERINFER_ARCH_OPT,
    TENSOR_POWERINFER_FC1,
    TENSOR_POWERINFER_FC2,
    TENSOR_POWERINFER_FFN_DOWN_T,
)
from ggufkit.converters.mtp import MtpSpec, parse_mtp
from ggufkit.errors import RegistryError

#: The registry shipped as package data of ``ggufkit`` (in the source tree ggufkit/registry.yaml links to the
#: repository's registry.yaml; wheels and sdists carry the file itself), read through importlib.resources.
DEFAULT_REGISTRY = resources.files("ggufkit").joinpath("registry.yaml")

#: PowerInfer's tensors, which ``gguf`` does not know (PowerInfer gguf-py constants.py: FFN_DOWN_T, FC1, FC2).
EXTRA_TENSORS: dict[str, str] = {
    "FFN_DOWN_T": TENSOR_POWERINFER_FFN_DOWN_T,
    "FC1": TENSOR_POWERINFER_FC1,
    "FC2": TENSOR_POWERINFER_FC2,
    # gpt-oss's stacked experts as its checkpoints name them (GPT_OSS_GATE_UP_PROJ_BLOCKS ->
    # blk.{bid}.experts.gate_up_proj_blocks), split, renamed and repacked by its hooks (converters/gpt_oss.py)
    **{f"GPT_OSS_{p.upper()}{s.upper()}": f"blk.{{bid}}.experts.{p}{s}" for p in ("gate_up_proj", "down_proj")
       for s in ("", "_bias", "_blocks", "_scales")},
}
#: Transforms a registry entry may name (implemented in ggufkit.converters.transforms).
TRANSFORM_NAMES = frozenset({"permute_q", "permute_k", "neox_qkv", "transpose", "add_one"})
#: Derive rules an hparam may name (implemented in ggufkit.converters.hparams).
DERIVE_NAMES = frozenset({"head_dim", "partial_rotary_dim", "mrope_sections", "deepstack_layers"})
VOCAB_KINDS = frozenset({"spm", "llama_hf", "bpe", "tiktoken"})
OUTPUT_MODES = frozenset({"optional", "required", "drop"})
VALUE_TYPES = frozenset({"u32", "i32", "f32", "bool", "str", "i32_list"})

_ENTRY_FIELDS = {"arch", "vocab", "hparams", "rope_scaling", "tensors", "transforms", "ignore", "output",
                 "strip_prefix", "powerinfer", "hooks", "add_space_prefix", "special_by_flag", "mmproj", "hybrid", "mtp"}
#: Fields that merge key by key with the base entry's (the others replace it).
_MERGED_FIELDS = ("hparams", "tensors", "transforms")
_HPARAM_FIELDS = {"from", "default", "required", "type", "derive"}


def known_architectures() -> frozenset[str]:
    """GGUF architecture strings: gguf's plus PowerInfer's own."""
    return frozenset(MODEL_ARCH_NAMES.values()) | {POWERINFER_ARCH_OPT, POWERINFER_ARCH_BAMBOO}


@functools.lru_cache(maxsize=1)
def known_key_suffixes() -> frozenset[str]:
    """Every per-architecture key gguf defines, without its ``{arch}.`` prefix (``attention.head_count``)."""
    out: set[str] = set()
    for group in vars(Keys).values():
        if not isinstance(group, type):
            continue
        for value in vars(group).values():
            if isinstance(value, str) and value.startswith("{arch}."):
                out.add(value.removeprefix("{arch}."))
    return frozenset(out)


def default_value_type(key: str) -> str:
    """The GGUF type llama.cpp's writer uses for a key (u32 counts, f32 eps/theta/factors, bool flags)."""
    if key in {"use_parallel_residual", "attention.causal"}:
        return "bool"
    if any(word in key for word in ("epsilon", "freq_base", "factor", "scale", "threshold", "clamp")):
        return "f32"
    return "u32"


@dataclass(frozen=True)
class HParam:
    """How one GGUF key is filled: the first present config field, a derive rule, or a default."""

    key: str
    sources: tuple[str, ...] = ()
    default: Any = None
    required: bool = False
    value_type: str = "u32"
    derive: str | None = None


@dataclass(frozen=True)
class TensorRule:
    """HF name template (``{bid}`` = block index, no .weight/.bias) -> GGUF tensor."""

    hf_template: str
    tensor: str  # MODEL_TENSOR member name, or a key of EXTRA_TENSORS
    gguf_template: str  # e.g. "blk.{bid}.attn_q"
    transform: str | None = None


@dataclass(frozen=True)
class ArchEntry:
    """One registry entry (an HF class)."""

    hf_class: str
    arch: str
    vocab: tuple[str, ...]
    hparams: tuple[HParam, ...]
    tensors: tuple[TensorRule, ...]
    ignore: tuple[str, ...] = ()
    rope_scaling: bool = False
    output: str = "optional"
    strip_prefix: str = ""
    powerinfer: bool = False
    hooks: str | None = None
    add_space_prefix: bool | None = None
    special_by_flag: bool = False
    #: blocks of different kinds (recurrent / attention / FFN-only): no block is required to have every
    #: per-block tensor another block has (the family's hooks check the layer schedule)
    hybrid: bool = False
    #: the projector file's spec (ggufkit.converters.mmproj_registry.ProjectorSpec), for vision-language classes
    mmproj: Any = None
    #: how the class's multi-token-prediction layers are found and named (ggufkit.converters.mtp.MtpSpec)
    mtp: MtpSpec | None = None


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last), checked before ``<<`` merges
    so an explicit key may still override a merged one. libyaml's parser when PyYAML has it: every
    conversion loads the registry, and the pure-Python parser takes 0.17 s of it, libyaml 0.02 s."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise RegistryError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
        seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=deep))


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _tensor_template(name: str) -> str | None:
    if name in EXTRA_TENSORS:
        return EXTRA_TENSORS[name]
    member = MODEL_TENSOR.__members__.get(name)
    return TENSOR_NAMES.get(member) if member is not None else None


def _arch_tensors(arch: str) -> set[str] | None:
    """MODEL_TENSOR names gguf allows for ``arch`` (None for PowerInfer-only archs gguf does not know)."""
    for member, name in MODEL_ARCH_NAMES.items():
        if name == arch:
            return {t.name for t in MODEL_TENSORS.get(member, [])}
    return None


class _EntryParser:
    def __init__(self, name: str, raw: Any) -> None:
        self.name = name
        self.raw = raw

    def fail(self, field: str | None, message: str) -> RegistryError:
        return RegistryError(message, entry=self.name, field=field)

    def typed(self, field: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise self.fail(field, f"expected {what}, got {type(value).__name__} {value!r}")
        return value

    def str_list(self, field: str, value: Any) -> tuple[str, ...]:
        self.typed(field, value, list, "a list of strings")
        for item in value:
            self.typed(field, item, str, "a list of strings")
        return tuple(value)

    def parse(self) -> ArchEntry:
        raw = self.raw
        if not isinstance(raw, dict):
            raise self.fail(None, f"expected a mapping of fields, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _ENTRY_FIELDS)
        if unknown:
            raise self.fail(unknown[0], f"unknown field (allowed: {', '.join(sorted(_ENTRY_FIELDS))})")
        for required in ("arch", "vocab", "hparams", "tensors"):
            if required not in raw:
                raise self.fail(required, "missing")
        arch = self.typed("arch", raw["arch"], str, "a string")
        if arch not in known_architectures():
            raise self.fail("arch", f"unknown GGUF architecture {arch!r}")
        vocab = self.str_list("vocab", raw["vocab"])
        for kind in vocab:
            if kind not in VOCAB_KINDS:
                raise self.fail("vocab", f"unknown vocabulary kind {kind!r} (known: {', '.join(sorted(VOCAB_KINDS))})")
        output = self.typed("output", raw.get("output", "optional"), str, "a string")
        if output not in OUTPUT_MODES:
            raise self.fail("output", f"unknown output mode {output!r} (known: {', '.join(sorted(OUTPUT_MODES))})")
        return ArchEntry(
            hf_class=self.name, arch=arch, vocab=vocab, hparams=self.hparams(raw["hparams"]),
            tensors=self.tensors(arch, raw["tensors"], raw.get("transforms", {})),
            ignore=self.str_list("ignore", raw.get("ignore", [])),
            rope_scaling=self.typed("rope_scaling", raw.get("rope_scaling", False), bool, "true or false"),
            output=output,
            strip_prefix=self.typed("strip_prefix", raw.get("strip_prefix", ""), str, "a string"),
            powerinfer=self.typed("powerinfer", raw.get("powerinfer", False), bool, "true or false"),
            hooks=self.hooks(raw.get("hooks")),
            add_space_prefix=None if raw.get("add_space_prefix") is None else
            self.typed("add_space_prefix", raw["add_space_prefix"], bool, "true or false"),
            special_by_flag=self.typed("special_by_flag", raw.get("special_by_flag", False), bool, "true or false"),
            hybrid=self.typed("hybrid", raw.get("hybrid", False), bool, "true or false"),
            mmproj=self.mmproj(raw.get("mmproj")),
            mtp=parse_mtp(self, raw.get("mtp")),
        )

    def mmproj(self, value: Any) -> Any:
        if value is None:
            return None
        from ggufkit.converters.mmproj_registry import parse_projector

        return parse_projector(self, value)

    def hooks(self, value: Any) -> str | None:
        if value is None:
            return None
        from ggufkit.converters.hooks import HOOK_FAMILIES

        self.typed("hooks", value, str, "a hooks module name")
        if value not in HOOK_FAMILIES:
            raise self.fail("hooks", f"unknown hooks module {value!r} (known: {', '.join(sorted(HOOK_FAMILIES))})")
        return str(value)

    def hparams(self, raw: Any) -> tuple[HParam, ...]:
        self.typed("hparams", raw, dict, "a mapping of GGUF key -> config fields")
        out = []
        for key, spec in raw.items():
            if not isinstance(key, str) or key not in known_key_suffixes():
                raise self.fail("hparams", f"unknown GGUF key {{arch}}.{key}")
            if isinstance(spec, list):
                out.append(HParam(key, self.str_list("hparams", spec), value_type=default_value_type(key)))
                continue
            self.typed("hparams", spec, dict, f"a list of config fields or a mapping for {key!r}")
            unknown = sorted(set(spec) - _HPARAM_FIELDS)
            if unknown:
                raise self.fail("hparams", f"{key}: unknown field {unknown[0]!r}")
            vtype = self.typed("hparams", spec.get("type", default_value_type(key)), str, "a type name")
            if vtype not in VALUE_TYPES:
                raise self.fail("hparams", f"{key}: unknown type {vtype!r}")
            derive = spec.get("derive")
            if derive is not None and derive not in DERIVE_NAMES:
                raise self.fail("hparams", f"{key}: unknown derive rule {derive!r}")
            sources = self.str_list("hparams", spec.get("from", []))
            if not sources and derive is None and spec.get("default") is None:
                raise self.fail("hparams", f"{key}: needs 'from', 'derive' or 'default' (a constant)")
            out.append(HParam(key, sources, spec.get("default"),
                              self.typed("hparams", spec.get("required", False), bool, "true or false"),
                              vtype, derive))
        return tuple(out)

    def tensors(self, arch: str, raw: Any, transforms: Any) -> tuple[TensorRule, ...]:
        self.typed("tensors", raw, dict, "a mapping of HF name -> GGUF tensor")
        self.typed("transforms", transforms, dict, "a mapping of GGUF tensor -> transform")
        allowed = _arch_tensors(arch)
        rules = []
        for hf, tensor in raw.items():
            self.typed("tensors", hf, str, "HF tensor names")
            self.typed("tensors", tensor, str, "GGUF tensor names")
            template = _tensor_template(tensor)
            if template is None:
                raise self.fail("tensors", f"unknown GGUF tensor {tensor!r}")
            # NEXTN_* for an entry with MTP layers: llama.cpp's gguf-py lists them for more archs than gguf's
            if allowed is not None and tensor not in allowed and tensor not in EXTRA_TENSORS and not (
                    tensor.startswith("NEXTN_") and self.raw.get("mtp")):
                raise self.fail("tensors", f"GGUF tensor {tensor!r} is not part of architecture {arch!r}")
            rules.append(TensorRule(hf, tensor, template, transforms.get(tensor)))
        used = {r.tensor for r in rules}
        for tensor, transform in transforms.items():
            if tensor not in used:
                raise self.fail("transforms", f"{tensor!r} is not produced by any tensor rule")
            if transform not in TRANSFORM_NAMES:
                raise self.fail("transforms", f"unknown transform {transform!r}")
        return tuple(rules)


@dataclass(frozen=True)
class Registry:
    """All entries, by HF class name."""

    entries: Mapping[str, ArchEntry]

    def get(self, hf_class: str) -> ArchEntry:
        """The entry for ``hf_class``.

        Raises:
            UnsupportedArchitectureError: no entry; the message lists the supported classes.
        """
        from ggufkit.errors import UnsupportedArchitectureError

        entry = self.entries.get(hf_class)
        if entry is None:
            raise UnsupportedArchitectureError(
                f"model class {hf_class!r} is not supported; supported: {', '.join(sorted(self.entries))}")
        return entry


def parse_registry(text: str) -> Registry:
    """Parse and validate registry YAML text.

    Raises:
        RegistryError: anything malformed, naming the entry and field.
    """
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise RegistryError(f"not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise RegistryError("expected a mapping of HF class name -> entry")
    names = [name for name in raw if not (isinstance(name, str) and name.startswith("_"))]
    resolved: dict[Any, Any] = {}
    entries = {name: _EntryParser(name, _inherit(raw, name, resolved, ())).parse() for name in names}
    return Registry(entries)


def _inherit(raw: dict[Any, Any], name: Any, resolved: dict[Any, Any], chain: tuple[Any, ...]) -> Any:
    """Entry ``name``'s fields with its ``base`` chain applied (memoised in ``resolved``)."""
    if name in resolved:
        return resolved[name]
    fields = raw[name]
    if not isinstance(fields, dict) or "base" not in fields:
        resolved[name] = fields
        return fields
    base = fields["base"]
    if not isinstance(base, str) or base.startswith("_") or base not in raw:
        raise RegistryError(f"unknown base entry {base!r}", entry=str(name), field="base")
    if base in (*chain, name):
        raise RegistryError(f"base entries form a cycle: {' -> '.join(map(str, (*chain, name, base)))}",
                            entry=str(name), field="base")
    parent = _inherit(raw, base, resolved, (*chain, name))
    if not isinstance(parent, dict):
        raise RegistryError(f"base entry {base!r} is not a mapping of fields", entry=str(name), field="base")
    merged = dict(parent)
    for field, value in fields.items():
        if field == "base":
            continue
        if field in _MERGED_FIELDS and isinstance(value, dict) and isinstance(parent.get(field), dict):
            combined = {**parent[field], **value}
            merged[field] = {k: v for k, v in combined.items() if v is not None}
        else:
            merged[field] = value
    resolved[name] = merged
    return merged


@functools.lru_cache(maxsize=4)
def load_registry(path: str | os.PathLike[str] | None = None) -> Registry:
    """Load (once) and validate ``path``, by default the shipped registry.yaml."""
    source = DEFAULT_REGISTRY if path is None else Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise RegistryError(f"cannot read {source}: {exc.strerror or exc}") from None
    return parse_registry(text)
