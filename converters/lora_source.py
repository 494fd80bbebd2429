"""PEFT LoRA adapters and their base models, read for conversion (:mod:`ggufkit.converters.lora`).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``). Each
targeted module ``M`` has ``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``
(embeddings: ``M.lora_embedding_A`` ``[r, vocab]`` and ``M.lora_embedding_B`` ``[embd, r]``). PEFT adds
``scaling * B @ A`` to ``M.weight``, with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``),
``r`` and ``alpha`` per module from ``rank_pattern`` / ``alpha_pattern`` (peft ``LoraModel._create_and_replace``,
patterns matched by peft ``utils.other.get_pattern_key``).

The base is a checkpoint directory (its ``config.json`` names the registry entry), a hub id in the local
cache, or the base model's GGUF (its ``general.architecture`` and head counts; tensor names and shapes from
its header).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.converters.checkpoint import Checkpoint, read_config, resolve_model
from ggufkit.converters.hparams import resolve_hparams
from ggufkit.converters.plan import compile_rule
from ggufkit.converters.registry import ArchEntry, TensorRule, load_registry
from ggufkit.converters.transforms import Heads
from ggufkit.errors import CheckpointError, TensorMappingError, UsageError

ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."
_LORA_PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "A", ".lora_embedding_B": "B"}


@dataclass(frozen=True)
class LoraSettings:
    """What ``adapter_config.json`` says about scaling and about parts a GGUF adapter cannot hold."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_dora: bool
    fan_in_fan_out: bool
    base_model: str | None
    base_class: str | None

    def scaling(self, module: str, r: int) -> float:
        """PEFT's scaling of one module (name relative to the model, e.g. ``model.layers.0.mlp.up_proj``) whose
        adapter has rank ``r`` (``rank_pattern`` gave it; the tensors say it)."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict[str, Any], module: str) -> str:
    # peft utils/other.py get_pattern_key: the first pattern matching a dotted suffix of the module name.
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def read_settings(adapter_dir: Path) -> LoraSettings:
    """Parse ``adapter_config.json``.

    Raises:
        CheckpointError: missing, not JSON, not a LoRA adapter, or a rank/alpha that is not a positive number.
    """
    path = adapter_dir / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read adapter config: {e}", path=path) from None
    if not isinstance(raw, dict):
        raise CheckpointError("adapter config is not a JSON object", path=path)
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise CheckpointError(f"peft_type {kind!r} is not a LoRA adapter (only LORA converts)", path=path)
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise CheckpointError(f"adapter config needs a positive 'r' and 'lora_alpha' (found {r!r}, {alpha!r})",
                              path=path)
    mapping = raw.get("auto_mapping") or {}
    return LoraSettings(
        r=r, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")),
        rank_pattern=dict(raw.get("rank_pattern") or {}), alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        use_dora=bool(raw.get("use_dora")), fan_in_fan_out=bool(raw.get("fan_in_fan_out")),
        base_model=raw.get("base_model_name_or_path") or None,
        base_class=mapping.get("base_model_class") if isinstance(mapping, dict) else None)


@dataclass
class LoraModule:
    """One adapted base weight: the HF module, its A/B tensors and any parts a GGUF adapter cannot hold."""

    module: str
    embedding: bool = False
    a: str | None = None
    b: str | None = None
    magnitude: str | None = None  # DoRA
    bias: str | None = None  # lora_bias: lora_B.bias

    @property
    def hf_weight(self) -> str:
        return f"{self.module}.weight"


@dataclass
class AdapterTensors:
    """The adapter's tensors sorted into LoRA pairs and the rest."""

    modules: dict[str, LoraModule] = field(default_factory=dict)
    #: full weights saved by ``modules_to_save`` (or resized embeddings): HF weight name -> adapter tensor name
    replaced: dict[str, str] = field(default_factory=dict)
    #: embedding/lm_head copies PEFT saves beside an embedding LoRA (``...base_layer.weight``)
    base_copies: dict[str, str] = field(default_factory=dict)


def sort_adapter_tensors(ckpt: Checkpoint) -> AdapterTensors:
    """Group the adapter's tensors by module, in name order (the order llama.cpp's converter writes them)."""
    out = AdapterTensors()
    for name in sorted(ckpt.tensors):
        local = name.removeprefix(_PREFIX)
        for suffix, part in _LORA_PARTS.items():
            if local.endswith(suffix):
                module = local[: -len(suffix)]
                m = out.modules.setdefault(module, LoraModule(module, embedding="embedding" in suffix))
                setattr(m, part.lower(), name)
                break
        else:
            if local.endswith(".lora_magnitude_vector") or ".lora_magnitude_vector." in local:
                module = local.split(".lora_magnitude_vector")[0]
                out.modules.setdefault(module, LoraModule(module)).magnitude = name
            elif local.endswith(".lora_B.bias"):
                module = local.removesuffix(".lora_B.bias")
                out.modules.setdefault(module, LoraModule(module)).bias = name
            elif local.endswith(".base_layer.weight"):
                out.base_copies[local.removesuffix(".base_layer.weight") + ".weight"] = name
            else:
                out.replaced[local.replace(".modules_to_save.default.", ".")] = name
    broken = [m.module for m in out.modules.values() if (m.a is None) != (m.b is None)
              or (m.a is None and (m.magnitude or m.bias))]
    if broken:
        raise CheckpointError(f"adapter has lora_A without lora_B (or the reverse) for {', '.join(broken[:5])}",
                              path=ckpt.model_dir)
    return out


@dataclass
class LoraBase:
    """What the conversion needs from the base model."""

    entry: ArchEntry
    heads: Heads
    n_layer: int
    name: str
    repo: str | None
    path: Path
    #: GGUF tensor name -> shape (numpy order); None when only a config (no weights) is at hand
    shapes: dict[str, tuple[int, ...]] | None
    tied_output: bool
    config_dir: Path | None  # the checkpoint directory (merging needs its weights)

    def gguf_name(self, hf_weight: str) -> tuple[str, TensorRule]:
        """The GGUF name and registry rule of one HF weight name.

        Raises:
            TensorMappingError: no rule of the base's registry entry maps it.
        """
        local = hf_weight.removeprefix(self.entry.strip_prefix) if self.entry.strip_prefix else hf_weight
        for rule in self.entry.tensors:
            m = compile_rule(rule).match(local)
            if m is None:
                continue
            if "{xid}" in rule.hf_template:  # one expert of a stacked tensor: no adapter pair can hold it
                raise TensorMappingError(f"the adapter targets {hf_weight}, one expert of a stacked GGUF tensor, "
                                         "which a GGUF adapter cannot hold; use --merge")
            bid = m.group("bid") if "{bid}" in rule.hf_template else None
            if bid is not None and int(bid) >= self.n_layer:
                break
            return rule.gguf_template.format(bid=bid) + (m.group("suffix") or ""), rule
        raise TensorMappingError(f"the adapter targets {hf_weight}, which {self.entry.hf_class} has no tensor for")


def _heads_from(get: Any, arch: str) -> Heads:
    n_head = int(get(f"{arch}.attention.head_count", 0))
    return Heads(n_head, int(get(f"{arch}.attention.head_count_kv", n_head) or n_head))


def open_base(base: str | Path | None, settings: LoraSettings, adapter_dir: Path) -> LoraBase:
    """Resolve the base: ``base`` (checkpoint directory, cached hub id or GGUF file), else the adapter's
    ``base_model_name_or_path``.

    Raises:
        UsageError: no base given and the adapter's base cannot be found locally (the message says where
            ggufkit looked).
        CheckpointError, UnsupportedArchitectureError: the base cannot be read or is not supported.
    """
    if base is None:
        if not settings.base_model:
            raise UsageError("the adapter names no base model (base_model_name_or_path); give --base")
        try:
            return _open_base_dir(settings.base_model, settings)
        except (CheckpointError, OSError) as e:
            raise UsageError(f"base model {settings.base_model!r} named by the adapter was not found (looked for a "
                             f"local directory and the hub cache: {e}); give --base DIR|GGUF") from None
    if Path(base).is_file():
        return _open_base_gguf(Path(base), settings)
    return _open_base_dir(base, settings)


def _open_base_dir(base: str | Path, settings: LoraSettings) -> LoraBase:
    model_dir, repo, _ = resolve_model(base)
    config = read_config(model_dir)
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise CheckpointError("config.json has no 'architectures' list naming the model class", path=model_dir)
    entry = load_registry().get(archs[0])
    hp = resolve_hparams(entry, config)
    heads = _heads_from(lambda k, d: hp.get(k, (None, d))[1], entry.arch)
    n_layer = int(hp[f"{entry.arch}.block_count"][1])
    shapes: dict[str, tuple[int, ...]] | None = None
    base_obj = LoraBase(entry, heads, n_layer, model_dir.name, repo, model_dir, None,
                        bool(config.get("tie_word_embeddings", False)), model_dir)
    try:
        ckpt = Checkpoint(model_dir)
    except CheckpointError:
        ckpt = None  # a config-only base: shapes cannot be checked, llama.cpp checks them when loading
    if ckpt is not None:
        shapes = {}
        for t in ckpt:
            try:
                shapes[base_obj.gguf_name(t.name)[0]] = t.shape
            except TensorMappingError:
                continue
        base_obj.shapes = shapes
        base_obj.tied_output = "output.weight" not in shapes
    return base_obj


def _open_base_gguf(path: Path, settings: LoraSettings) -> LoraBase:
    from ggufkit.format import open_gguf

    with open_gguf(path) as model:
        arch = str(model.get("general.architecture"))
        entries = [e for e in load_registry().entries.values() if e.arch == arch]
        if not entries:
            raise UsageError(f"{path.name}: architecture {arch!r} has no converter entry for LoRA tensor names")
        entry = next((e for e in entries if e.hf_class == settings.base_class), entries[0])
        kv = {k: model.get(k) for k in model.kv}
        heads = _heads_from(lambda k, d: kv.get(k, d), arch)
        shapes = {t.name: tuple(reversed(t.ne)) for t in model.tensors}
        name = str(kv.get("general.name", path.stem))
        n_layer = int(kv.get(f"{arch}.block_count", 0))
    return LoraBase(entry, heads, n_layer, name, None, path, shapes, "output.weight" not in shapes, None)
