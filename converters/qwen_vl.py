"""Qwen2.5-VL and Qwen3-VL projectors: what registry.yaml cannot say (conversion/qwenvl.py ``Qwen2VLVisionModel``,
conversion/qwen3vl.py ``Qwen3VLVisionModel``).

- The patch embedding is a 3-D convolution over two frames; libmtmd runs it as two 2-D convolutions whose outputs
  it adds (tools/mtmd/models/qwen2vl.cpp ``build_inp_with_temporal_merge``), so its kernel is written as
  ``v.patch_embd.weight`` (frame 0) and ``v.patch_embd.weight.1`` (frame 1).
- Qwen2.5-VL's fused attention ``qkv`` is written as separate Q, K and V; Qwen3-VL's stays fused.
- Qwen3-VL's deepstack mergers are numbered by the vision layer they read, not by their list position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any

import numpy as np

from ggufkit.errors import TensorMappingError, UnsupportedArchitectureError

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]
#: libmtmd's Qwen2.5-VL window, in pixels (tools/mtmd/clip.cpp: attn_window_size, 112 when the file has none;
#: llama.cpp's converter writes none) and its merge size (clip.cpp: n_merge 2 when the file has none).
_WINDOW_PX = 112
_MERGE = 2


def _vision(config: Mapping[str, Any]) -> Mapping[str, Any]:
    vision = config.get("vision_config")
    return vision if isinstance(vision, Mapping) else {}


def _is_qwen25(config: Mapping[str, Any]) -> bool:
    # conversion/qwenvl.py picks the projector by the root model_type, which the merged config loses to
    # text_config's ("qwen2_5_vl_text"), and released vision_configs name none: the class decides.
    archs = config.get("architectures")
    return isinstance(archs, list) and bool(archs) and archs[0] == "Qwen2_5_VLForConditionalGeneration"


def mmproj_metadata(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL: clip.vision.n_wa_pattern from fullatt_block_indexes (evenly spaced, as the converter
    requires), refusing a window or merge size libmtmd would not use. Qwen3-VL: the image size derived from the
    position-embedding count where the config has none, and clip.vision.is_deepstack_layers."""
    from gguf import Keys

    from ggufkit.format.values import VT

    vision = _vision(config)
    if _is_qwen25(config):
        full = vision.get("fullatt_block_indexes")
        if not isinstance(full, list) or not full or not all(isinstance(i, int) for i in full):
            raise UnsupportedArchitectureError("--mmproj: Qwen2.5-VL needs vision_config.fullatt_block_indexes "
                                               "(the layers without window attention)")
        pattern = full[0] + 1
        if any(b - a != pattern for a, b in pairwise(full)):
            raise UnsupportedArchitectureError(f"--mmproj: fullatt_block_indexes {full} are not evenly spaced "
                                               "(libmtmd has one full-attention layer every n_wa_pattern)")
        problems = []
        if int(vision.get("window_size", _WINDOW_PX)) != _WINDOW_PX:
            problems.append(f"window_size {vision.get('window_size')} (libmtmd uses {_WINDOW_PX})")
        if int(vision.get("spatial_merge_size", _MERGE)) != _MERGE:
            problems.append(f"spatial_merge_size {vision.get('spatial_merge_size')} (libmtmd uses {_MERGE})")
        if vision.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {vision.get('hidden_act')!r} (libmtmd runs silu)")
        if problems:
            raise UnsupportedArchitectureError("--mmproj: llama.cpp would compute another vision tower: "
                                               + "; ".join(problems))
        return {Keys.ClipVision.N_WA_PATTERN: (VT.UINT32, pattern, None)}
    out: dict[str, Any] = {}
    if vision.get("image_size") is None:
        # num_position_embeddings = (image_size / patch_size) ** 2 (conversion/qwen3vl.py Qwen3VLVisionModel)
        size = int(int(vision.get("num_position_embeddings", 2304)) ** 0.5 * int(vision.get("patch_size", 16)))
        out[Keys.ClipVision.IMAGE_SIZE] = (VT.UINT32, size, None)
    depth = int(vision.get("depth", 0) or 0)
    indexes = _deepstack_indexes(vision, depth)
    if depth:
        flags = [i in indexes for i in range(depth)]
        out[Keys.ClipVision.IS_DEEPSTACK_LAYERS] = (VT.ARRAY, flags, VT.BOOL)
    return out


def _deepstack_indexes(vision: Mapping[str, Any], depth: int) -> list[int]:
    indexes = vision.get("deepstack_visual_indexes") or []
    if not isinstance(indexes, list) or not all(isinstance(i, int) and 0 <= i < depth for i in indexes):
        raise TensorMappingError(f"vision_config.deepstack_visual_indexes {indexes!r}: expected layer indexes "
                                 f"below depth {depth}")
    return list(indexes)


class _Parts:
    """Slices of one source tensor, read once: the tensor is kept from its first part until its last has been
    taken (the writer streams the parts one after the other), so memory stays bounded by one tensor."""

    def __init__(self, load: Callable[[], np.ndarray], n: int) -> None:
        self._load, self._n, self._taken = load, n, 0
        self._arr: np.ndarray | None = None

    def part(self, index: Any) -> Callable[[], np.ndarray]:
        def take() -> np.ndarray:
            arr = self._arr
            if arr is None:
                arr = self._arr = self._load()
                self._taken = 0
            out = np.ascontiguousarray(arr[index])
            self._taken += 1
            if self._taken == self._n:
                self._arr = None
            return out

        return take


def mmproj_rewrite(raw: list[Raw], loaders: dict[str, Callable[[], np.ndarray]],
                   config: Mapping[str, Any]) -> list[Raw]:
    """Split the patch embedding by frame, Qwen2.5-VL's qkv into Q/K/V (rows [0, c), [c, 2c), [2c, 3c)), and
    renumber deepstack mergers by ``deepstack_visual_indexes``.

    Raises:
        TensorMappingError: a patch embedding that is not over 2 frames, a qkv whose rows are not 3 equal parts,
            or more deepstack mergers than listed layers.
    """
    vision = _vision(config)
    split_qkv = _is_qwen25(config)
    indexes: list[int] | None = None
    out: list[Raw] = []
    # taken out first: a renumbered deepstack name may be another merger's old one
    old = {r[0]: loaders.pop(r[0]) for r in raw}
    for gguf, source, kind, shape, dtype, transform in raw:
        load = old[gguf]
        if kind == "V_ENC_EMBD_PATCH" and gguf.endswith(".weight"):
            if len(shape) != 5 or shape[2] != 2:
                raise TensorMappingError(f"{source} has shape {list(shape)}; libmtmd needs a 3-D convolution over "
                                         "2 frames ([out, in, 2, patch, patch])")
            frames = _Parts(load, 2)
            for t, name in enumerate((gguf, f"{gguf}.1")):
                out.append((name, f"{source}[:, :, {t}]", kind, (*shape[:2], *shape[3:]), dtype, transform))
                loaders[name] = frames.part(np.s_[:, :, t])
            continue
        if kind == "V_ENC_ATTN_QKV" and split_qkv:
            if shape[0] % 3:
                raise TensorMappingError(f"{source} has {shape[0]} rows, not 3 equal parts (q, k, v)")
            c = shape[0] // 3
            parts = _Parts(load, 3)
            for i, part in enumerate(("Q", "K", "V")):
                name = gguf.replace(".attn_qkv.", f".attn_{part.lower()}.")
                out.append((name, f"{source}[{i * c}:{(i + 1) * c}]", f"V_ENC_ATTN_{part}", (c, *shape[1:]), dtype,
                            transform))
                loaders[name] = parts.part(np.s_[i * c:(i + 1) * c])
            continue
        if kind.startswith("V_DS_"):
            if indexes is None:
                indexes = _deepstack_indexes(vision, int(vision.get("depth", 0) or 0))
            position = int(gguf.split(".")[2])
            if position >= len(indexes):
                raise TensorMappingError(f"{source}: deepstack merger {position}, but deepstack_visual_indexes "
                                         f"lists {len(indexes)} layers")
            pieces = gguf.split(".")
            pieces[2] = str(indexes[position])
            gguf = ".".join(pieces)
        out.append((gguf, source, kind, shape, dtype, transform))
        loaders[gguf] = load
    return out
