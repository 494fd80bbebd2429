"""The ``mmproj:`` section of a registry.yaml entry: how a vision-language class's projector file is written.

A projector is the vision tower and the projector of a multimodal checkpoint in a GGUF of architecture
``clip``, read by llama.cpp's libmtmd (tools/mtmd/clip.cpp) beside the text model. Its section says:

    projector_type  clip.projector_type (a gguf ``VisionProjectorType`` value).
    rename      [[regex, replacement], ...] applied in order to every HF name before matching: each layout a
                checkpoint can have (released files, transformers 5's prefixes) is brought to one naming.
    keys        clip.* key -> a list of sources, or a mapping with from / default / required / type
                (u32, f32, bool, str, f32_list). Sources are dotted paths into ``config`` (config.json with
                its text_config merged onto the root, as the text conversion reads it), ``vision``
                (vision_config) or ``preprocessor`` (preprocessor_config.json with processor_config.json's
                image_processor merged in, as llama.cpp's MmprojModel reads them).
    tensors     HF name (after rename, without .weight/.bias; {bid} = block index) -> gguf MODEL_TENSOR of
                the ``clip`` architecture.
    transforms  MODEL_TENSOR -> transform (ggufkit.converters.transforms).
    types       MODEL_TENSOR -> f32 | f16 (always) | wide (f16 for --outtype f16, else f32): the per-tensor
                types llama.cpp's converter forces for projectors (MmprojModel.tensor_force_quant and the
                family's own).
    shapes      MODEL_TENSOR -> expected weight shape (torch order): ints, clip.* keys of this section, or
                "*" for any; a checkpoint whose tensors do not match its config is refused.
    token_rows  MODEL_TENSOR -> {embedding: [HF names of the text embedding], token: the token's text}: the
                text embedding's row of that token (found in tokenizer_config.json's added_tokens_decoder, else
                tokenizer.json's added_tokens, as llama.cpp's LlavaVisionModel.get_token_id does), written as a
                projector tensor (Pixtral's [IMG_BREAK]).
    ignore      fnmatch patterns of HF names (after rename) the projector leaves out (the text model).
    hooks       family module ggufkit.converters.<name> with ``mmproj_metadata`` (keys YAML cannot say).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, Keys, VisionProjectorType

from ggufkit.errors import RegistryError

ARCH = "clip"
VALUE_TYPES = frozenset({"u32", "f32", "bool", "str", "f32_list"})
TYPE_RULES = frozenset({"f32", "f16", "wide"})
SOURCE_ROOTS = ("config.", "vision.", "preprocessor.")
_FIELDS = {"projector_type", "rename", "keys", "tensors", "transforms", "types", "shapes", "token_rows", "ignore",
           "hooks"}
_KEY_FIELDS = {"from", "default", "required", "type"}


def _clip_keys() -> frozenset[str]:
    out: set[str] = set()
    stack: list[type] = [Keys.Clip, Keys.ClipVision]
    while stack:
        group = stack.pop()
        for value in vars(group).values():
            if isinstance(value, type):
                stack.append(value)
            elif isinstance(value, str) and value.startswith("clip."):
                out.add(value)
    return frozenset(out)


CLIP_KEYS = _clip_keys()
CLIP_TENSORS = frozenset(t.name for t in MODEL_TENSORS[MODEL_ARCH.MMPROJ])
PROJECTOR_TYPES = frozenset(v for k, v in vars(VisionProjectorType).items()
                            if not k.startswith("_") and isinstance(v, str))


@dataclass(frozen=True)
class ClipKey:
    """One clip.* key: the first present source, else the default."""

    key: str
    sources: tuple[str, ...]
    default: Any = None
    required: bool = False
    value_type: str = "u32"


@dataclass(frozen=True)
class TokenRow:
    """A row of the text embedding written as a projector tensor (Pixtral's ``[IMG_BREAK]``)."""

    tensor: str
    embedding: tuple[str, ...]
    token: str


@dataclass(frozen=True)
class ProjectorSpec:
    """A parsed ``mmproj:`` section."""

    projector_type: str
    rename: tuple[tuple[str, str], ...]
    keys: tuple[ClipKey, ...]
    tensors: tuple[Any, ...]  # registry.TensorRule
    types: tuple[tuple[str, str], ...]
    shapes: tuple[tuple[str, tuple[int | str, ...]], ...]
    token_rows: tuple[TokenRow, ...]
    ignore: tuple[str, ...]
    hooks: str | None


def _default_type(key: str) -> str:
    if key in {"clip.has_vision_encoder", "clip.use_gelu", "clip.use_silu"}:
        return "bool"
    if key.endswith(("image_mean", "image_std")):
        return "f32_list"
    if "epsilon" in key:
        return "f32"
    return "u32"


def parse_projector(parser: Any, raw: Any) -> ProjectorSpec:
    """Validate an entry's ``mmproj`` section (``parser`` is the registry's entry parser, for messages and
    the tensor rules)."""
    import re

    def fail(message: str) -> RegistryError:
        return parser.fail("mmproj", message)

    if not isinstance(raw, dict):
        raise fail("expected a mapping")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise fail(f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(_FIELDS))})")
    ptype = raw.get("projector_type")
    if ptype not in PROJECTOR_TYPES:
        raise fail(f"unknown projector_type {ptype!r}")
    rename = []
    for pair in raw.get("rename", []):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise fail(f"rename: expected [regex, replacement] pairs, got {pair!r}")
        try:
            re.compile(pair[0])
        except re.error as exc:
            raise fail(f"rename: bad regex {pair[0]!r}: {exc}") from None
        rename.append((pair[0], pair[1]))
    keys = []
    for key, spec in (raw.get("keys") or {}).items():
        if key not in CLIP_KEYS:
            raise fail(f"unknown clip key {key!r}")
        if isinstance(spec, list):
            spec = {"from": spec}
        if not isinstance(spec, dict) or set(spec) - _KEY_FIELDS:
            raise fail(f"{key}: expected a list of sources or a mapping of {', '.join(sorted(_KEY_FIELDS))}")
        sources = tuple(parser.str_list("mmproj", spec.get("from", [])))
        bad = [s for s in sources if not s.startswith(SOURCE_ROOTS)]
        if bad:
            raise fail(f"{key}: source {bad[0]!r} must start with one of {', '.join(SOURCE_ROOTS)}")
        vtype = spec.get("type", _default_type(key))
        if vtype not in VALUE_TYPES:
            raise fail(f"{key}: unknown type {vtype!r}")
        if not sources and spec.get("default") is None:
            raise fail(f"{key}: needs 'from' or 'default'")
        keys.append(ClipKey(key, sources, spec.get("default"), bool(spec.get("required", False)), vtype))
    tensors = parser.tensors(ARCH, raw.get("tensors", {}), raw.get("transforms", {}))
    kinds = {r.tensor for r in tensors}
    types = []
    for tensor, rule in (raw.get("types") or {}).items():
        if tensor not in MODEL_TENSOR.__members__ or rule not in TYPE_RULES:
            raise fail(f"types: {tensor!r}: {rule!r} (expected a MODEL_TENSOR and one of {sorted(TYPE_RULES)})")
        types.append((tensor, rule))
    shapes = []
    spec_hooks = raw.get("hooks")
    key_names = {k.key for k in keys}
    for tensor, dims in (raw.get("shapes") or {}).items():
        # a rule's tensor, or one the family's mmproj_rewrite makes (Qwen2.5-VL's Q, K, V split from qkv)
        made = tensor in kinds or (spec_hooks is not None and tensor in CLIP_TENSORS)
        if not made or not isinstance(dims, list):
            raise fail(f"shapes: {tensor!r} is not produced by a tensor rule, or its shape is not a list")
        for d in dims:
            if not (isinstance(d, int) or d == "*" or d in key_names):
                raise fail(f"shapes: {tensor}: {d!r} is not an int, '*' or a key of this section")
        shapes.append((tensor, tuple(dims)))
    rows = []
    for tensor, spec in (raw.get("token_rows") or {}).items():
        if tensor not in MODEL_TENSOR.__members__ or not isinstance(spec, dict) or set(spec) != {"embedding", "token"}:
            raise fail(f"token_rows: {tensor!r} needs a MODEL_TENSOR and exactly 'embedding' and 'token'")
        if not isinstance(spec["token"], str) or not spec["token"]:
            raise fail(f"token_rows: {tensor}: 'token' must be the token's text")
        rows.append(TokenRow(tensor, tuple(parser.str_list("mmproj", spec["embedding"])), spec["token"]))
    return ProjectorSpec(ptype, tuple(rename), tuple(keys), tuple(tensors), tuple(types), tuple(shapes),
                         tuple(rows), tuple(parser.str_list("mmproj", raw.get("ignore", []))),
                         parser.hooks(raw.get("hooks")))
