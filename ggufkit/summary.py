"""A JSON-friendly description of a GGUF model: header, metadata, tensors and size statistics."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from gguf import Keys, LlamaFileType

from ggufkit.constants import KEY_SLACK
from ggufkit.format.reader import GGUFModel
from ggufkit.format.values import VT, summarize


def file_type_name(value: Any) -> str | None:
    """``general.file_type`` decoded: 15 -> ``MOSTLY_Q4_K_M``."""
    try:
        return LlamaFileType(int(value)).name
    except (ValueError, TypeError):
        return None


def adapter_summary(model: GGUFModel) -> dict[str, Any] | None:
    """A LoRA adapter's type, alpha, ranks, adapted tensors and base (None for other files).

    The rank of each adapted tensor is ``lora_b``'s row length (``lora_a`` of ``token_embd`` is stored transposed),
    as llama.cpp reads it (llama-adapter.cpp: ``llama_adapter_lora_init_impl``); unpaired tensors are listed.
    """
    if model.get(Keys.General.TYPE) != "adapter":
        return None
    pairs: dict[str, dict[str, Any]] = {}
    for t in model.tensors:
        for part in ("lora_a", "lora_b"):
            if t.name.endswith("." + part):
                pairs.setdefault(t.name.removesuffix("." + part), {})[part] = t.ne
    ranks = sorted({p["lora_b"][0] for p in pairs.values() if "lora_b" in p})
    return {
        "type": model.get(Keys.Adapter.TYPE),
        "alpha": model.get(Keys.Adapter.LORA_ALPHA),
        "ranks": ranks,
        "targets": sorted(pairs),
        "unpaired": sorted(n for n, p in pairs.items() if len(p) != 2),
        "base": model.get(Keys.General.BASE_MODEL_NAME.format(id=0)),
        "base_url": model.get(Keys.General.BASE_MODEL_REPO_URL.format(id=0)),
    }


#: Projector types whose image tokens are the patches divided by ``n_merge`` per side (clip.cpp
#: clip_n_output_tokens: GEMMA3, IDEFICS3, ...) and their ``n_merge`` when the file has no
#: ``clip.vision.projector.scale_factor`` (clip.cpp clip_model_loader::load_hparams: Gemma 3 defaults to 4,
#: the rest keep clip_hparams' 1).
_SCALED = {"gemma3": 4, "idefics3": 1, "internvl": 1, "llama4": 1}
#: Projector types merging 2x2 patches whatever ``clip.vision.spatial_merge_size`` says (clip_n_output_tokens:
#: "2 conv, so double patch size").
_DOUBLE_PATCH = frozenset({"qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "glm4v"})
#: Projector types whose images libmtmd resizes to a token budget (mtmd-image.cpp
#: ``mtmd_image_preprocessor_dyn_size``): (min, max) tokens as clip.cpp load_hparams sets them with
#: ``set_limit_image_tokens``.
_TOKEN_LIMITS = {"pixtral": (8, 1024), "qwen2vl_merger": (8, 4096), "qwen2.5vl_merger": (8, 4096),
                 "qwen3vl_merger": (8, 4096)}


def _resized_side(side: int, align: int, min_tokens: int, max_tokens: int) -> int:
    """The side of a square image after mtmd-image.cpp ``calc_size_preserved_ratio`` (float32, as in C)."""
    f32 = np.float32
    min_px, max_px = min_tokens * align * align, max_tokens * align * align
    s = max(align, int(np.round(f32(side) / f32(align))) * align)
    if s * s > max_px:
        beta = np.sqrt(f32(side) * f32(side) / f32(max_px), dtype=f32)
        return max(align, int(np.floor(f32(f32(side) / beta) / f32(align))) * align)
    if s * s < min_px:
        beta = np.sqrt(f32(min_px) / (f32(side) * f32(side)), dtype=f32)
        return int(np.ceil(f32(f32(side) * beta) / f32(align))) * align
    return s
#: Projector types whose tokens are the patches themselves (clip_n_output_tokens: "do nothing").
_PLAIN = frozenset({"mlp", "mlp_norm", "janus_pro", "phi4"})


def tokens_per_image(projector_type: str | None, image_size: Any, patch_size: Any, *,
                     scale_factor: Any = None, spatial_merge_size: Any = None,
                     img_break: bool = False) -> int | None:
    """Image tokens libmtmd gives an ``image_size`` x ``image_size`` image (one tile for tiling models), as
    tools/mtmd/clip.cpp ``clip_n_output_tokens`` computes them; None for projector types not covered here.

    Pixtral (and Mistral 3, the same projector type with a spatial merge) adds one ``[IMG_BREAK]`` token after
    every row of patches but the last when the file has ``v.token_embd.img_break``. Pixtral and Qwen-VL images
    are first resized to their token budget (Pixtral at most 1024 tokens, Qwen-VL 8 to 4096).
    """
    if not projector_type or not image_size or not patch_size:
        return None
    side = int(image_size) // int(patch_size)
    n_patches = side * side
    if projector_type in _PLAIN:
        return n_patches
    if projector_type in _SCALED:
        merge = int(scale_factor) if scale_factor else _SCALED[projector_type]
        return n_patches // (merge * merge)
    if projector_type in _TOKEN_LIMITS:
        # The image is first resized to the type's token budget; then one token per merged patch.
        merge = 2 if projector_type in _DOUBLE_PATCH else int(spatial_merge_size or 1)
        align = int(patch_size) * merge
        per_side = _resized_side(int(image_size), align, *_TOKEN_LIMITS[projector_type]) // align
        return per_side * per_side + (per_side - 1 if img_break else 0)
    if projector_type in _DOUBLE_PATCH:
        return (int(image_size) // (int(patch_size) * 2)) ** 2
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def projector_summary(model: GGUFModel) -> dict[str, Any] | None:
    """A vision projector's (``clip`` architecture, libmtmd's mmproj file) projector type, modalities, image and
    patch size, tokens per image, tower size and every ``clip.*`` key (None for other files). Keys as
    tools/mtmd/clip.cpp reads them: ``clip.projector_type`` (or ``clip.vision.projector_type`` in files with
    several encoders)."""
    if model.architecture != "clip":
        return None
    get = model.get
    image, patch = get("clip.vision.image_size"), get("clip.vision.patch_size")
    patches = (int(image) // int(patch)) ** 2 if image and patch else None
    proj = get("clip.vision.projector_type") or get("clip.projector_type")
    names = {t.name for t in model.tensors}
    modalities = [m for m in ("vision", "audio") if get(f"clip.has_{m}_encoder")]
    return {
        "projector_type": proj,
        "has_vision_encoder": bool(get("clip.has_vision_encoder")),
        "modalities": modalities,
        "image_size": image,
        "patch_size": patch,
        "patches_per_image": patches,
        "tokens_per_image": tokens_per_image(
            proj, image, patch, scale_factor=get("clip.vision.projector.scale_factor"),
            spatial_merge_size=get("clip.vision.spatial_merge_size"),
            img_break="v.token_embd.img_break" in names),
        "embedding_length": get("clip.vision.embedding_length"),
        "block_count": get("clip.vision.block_count"),
        "projection_dim": get("clip.vision.projection_dim"),
        "clip_keys": {k: _plain(get(k)) for k in sorted(model.kv) if k.startswith("clip.")},
    }


def describe(model: GGUFModel, *, first_items: int = 8) -> dict[str, Any]:
    """Describe ``model`` (a file or shard set).

    Returns:
        A dict with ``path``, ``magic``, ``powerinfer``, ``version``, ``alignment``, ``shards``,
        ``architecture``, ``file_type`` (value and name), ``metadata`` (key -> {type, value}; arrays summarised
        as type, length and first items), ``tensors`` (name, type, shape, ne, bytes, offset, shard),
        ``totals`` (tensors, parameters, bytes, bits_per_weight) and ``by_type`` (per tensor type).
    """
    first = model.files[0]
    metadata: dict[str, Any] = {}
    for field in first.iter_kv():
        if field.key == KEY_SLACK:
            metadata[field.key] = {"type": "str", "value": f"<{len(field.value)} bytes reserved>"}
            continue
        value = summarize(field.head(first_items) if field.type == VT.ARRAY else field.value, field.type,
                          field.item_type, field.count, first_items)
        metadata[field.key] = {"type": field.type_label, "value": value}
    tensors = []
    by_type: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "parameters": 0, "bytes": 0})
    total_params = total_bytes = 0
    for t in model.tensors:
        tensors.append({"name": t.name, "type": t.type_name, "shape": list(t.shape), "ne": list(t.ne),
                        "bytes": t.nbytes, "offset": t.offset, "shard": t.shard})
        stats = by_type[t.type_name]
        stats["tensors"] += 1
        stats["parameters"] += t.n_elements
        stats["bytes"] += t.nbytes
        total_params += t.n_elements
        total_bytes += t.nbytes
    file_type = model.get(Keys.General.FILE_TYPE)
    return {
        "path": str(model.path),
        "magic": model.magic.decode("ascii"),
        "powerinfer": model.is_powerinfer,
        "version": first.version,
        "alignment": first.alignment,
        "shards": [str(f.path) for f in model.files],
        "file_size": model.file_size,
        "architecture": model.architecture,
        "file_type": {"value": file_type, "name": file_type_name(file_type)} if file_type is not None else None,
        "metadata": metadata,
        "adapter": adapter_summary(model),
        "projector": projector_summary(model),
        "tensors": tensors,
        "totals": {
            "tensors": len(tensors),
            "parameters": total_params,
            "bytes": total_bytes,
            "bits_per_weight": (8 * total_bytes / total_params) if total_params else None,
        },
        "by_type": {
            name: {**s, "bits_per_weight": 8 * s["bytes"] / s["parameters"] if s["parameters"] else None}
            for name, s in sorted(by_type.items())
        },
    }
