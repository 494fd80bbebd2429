"""Tiny vision-language checkpoints in each layout a user can have, for projector (mmproj) tests.

Built with transformers' own classes (:func:`fixtures_models.make_checkpoint`, real tokenizer files), then
re-saved with the tensor names of another layout: what this environment's transformers saves
(``transformers5``), the released files (``released``), or everything under ``model.`` (``prefixed``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_models import make_checkpoint
from llama_cpp_sources import llama_cpp_dir

from ggufkit.converters import convert_mmproj
from ggufkit.format import open_gguf

# Vision-language classes fixtures_models does not build itself: config, classes and tokenizer kind.
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
fixtures_models._BASE.setdefault("Idefics3ForConditionalGeneration", dict(
    text_config=dict(model_type="llama", tie_word_embeddings=False, **_TEXT),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=32, patch_size=8),
    scale_factor=2, image_token_id=5, tie_word_embeddings=False))
fixtures_models._CLASSES.setdefault("Idefics3ForConditionalGeneration",
                                    ("Idefics3Config", "Idefics3ForConditionalGeneration"))
fixtures_models._VOCAB.setdefault("Idefics3ForConditionalGeneration", "spm")
# SmolVLM2: Idefics3's model under another class (transformers' SmolVLM*, the same tensor names)
fixtures_models._BASE.setdefault("SmolVLMForConditionalGeneration",
                                 fixtures_models._BASE["Idefics3ForConditionalGeneration"])
fixtures_models._CLASSES.setdefault("SmolVLMForConditionalGeneration",
                                    ("SmolVLMConfig", "SmolVLMForConditionalGeneration"))
fixtures_models._VOCAB.setdefault("SmolVLMForConditionalGeneration", "spm")
_PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                head_dim=16, image_size=32, patch_size=8)
# Pixtral 12B's settings: the last layer's features, all of them
fixtures_models._BASE.setdefault("LlavaForConditionalGeneration", dict(
    text_config=dict(model_type="mistral", head_dim=16, tie_word_embeddings=False, sliding_window=None, **_TEXT),
    vision_config=_PIXTRAL, image_token_index=5, vision_feature_layer=-1, vision_feature_select_strategy="full",
    projector_hidden_act="gelu", multimodal_projector_bias=True, tie_word_embeddings=False))
fixtures_models._CLASSES.setdefault("LlavaForConditionalGeneration", ("LlavaConfig", "LlavaForConditionalGeneration"))
fixtures_models._VOCAB.setdefault("LlavaForConditionalGeneration", "spm")
# Mistral Small 3.1's: a patch merger (2x2), no projector biases
fixtures_models._BASE.setdefault("Mistral3ForConditionalGeneration", dict(
    text_config=dict(model_type="mistral", head_dim=16, tie_word_embeddings=False, sliding_window=None, **_TEXT),
    # 64 px: libmtmd upscales images below 8 tokens (clip.cpp: set_limit_image_tokens(8, 1024))
    vision_config={**_PIXTRAL, "image_size": 64}, image_token_index=5, vision_feature_layer=-1, spatial_merge_size=2,
    projector_hidden_act="gelu", multimodal_projector_bias=False, tie_word_embeddings=False))
fixtures_models._CLASSES.setdefault("Mistral3ForConditionalGeneration",
                                    ("Mistral3Config", "Mistral3ForConditionalGeneration"))
fixtures_models._VOCAB.setdefault("Mistral3ForConditionalGeneration", "spm")
# Qwen2.5-VL: 4 layers with a full-attention layer every 2 (window attention in the others), Qwen's patch 14 and
# 112-pixel window; Qwen3-VL: 3 layers, deepstack mergers reading layers 0 and 2, a 4x4 position-embedding grid.
# GPT-2's real BPE vocabulary: llama.cpp's converter writes the text halves only for a tokenizer it knows.
_QWEN_TEXT = dict(_TEXT, rms_norm_eps=1e-6, tie_word_embeddings=False)
fixtures_models._BASE.setdefault("Qwen2_5_VLForConditionalGeneration", dict(
    text_config=dict(model_type="qwen2_5_vl_text", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                    "mrope_section": [2, 3, 3]}, **_QWEN_TEXT),
    vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
                       fullatt_block_indexes=[1, 3], window_size=112, spatial_merge_size=2, temporal_patch_size=2),
    tie_word_embeddings=False))
fixtures_models._BASE.setdefault("Qwen3VLForConditionalGeneration", dict(
    text_config=dict(model_type="qwen3_vl_text", head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        **_QWEN_TEXT),
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, out_hidden_size=64,
                       num_position_embeddings=16, deepstack_visual_indexes=[0, 2], spatial_merge_size=2,
                       temporal_patch_size=2),
    tie_word_embeddings=False))
for _cls in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
    fixtures_models._CLASSES.setdefault(_cls, (_cls.replace("ForConditionalGeneration", "Config"), _cls))
    fixtures_models._VOCAB.setdefault(_cls, "real:gpt-2")
# Qwen3.5 (dense and MoE): the qwen35 / qwen35moe text model (gated delta-net layers and gated full attention,
# both kinds in the schedule, every 4th layer full attention as released; 2 key heads under 4 value heads, so
# llama.cpp's converter reorders the value heads)
# under model.language_model., and Qwen3-VL's vision tower without deepstack mergers (released vision_configs
# list none: "deepstack_visual_indexes": []). head_dim 32 at Qwen3.5's rotary fraction 0.25: 8 rotary dimensions,
# M-RoPE sections [2, 1, 1].
_QWEN35_TEXT = dict(_QWEN_TEXT, head_dim=32, num_hidden_layers=4,
                    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25})
_QWEN35_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, out_hidden_size=64,
                      num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)
fixtures_models._BASE.setdefault("Qwen3_5ForConditionalGeneration", dict(
    text_config=dict(model_type="qwen3_5_text", **_QWEN35_TEXT), vision_config=_QWEN35_VISION,
    tie_word_embeddings=False))
fixtures_models._BASE.setdefault("Qwen3_5MoeForConditionalGeneration", dict(
    text_config=dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32, **_QWEN35_TEXT),
    vision_config=_QWEN35_VISION, tie_word_embeddings=False))
for _cls in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
    fixtures_models._CLASSES.setdefault(_cls, (_cls.replace("ForConditionalGeneration", "Config"), _cls))
    # the text model's tokenizer (Qwen3.5's BPE where the text family's fixtures have it)
    fixtures_models._VOCAB.setdefault(_cls, fixtures_models._VOCAB.get(_cls.replace("ForConditional", "ForCausalLM")
                                                                       .replace("Generation", ""), "real:qwen2"))
#: Pixtral's [IMG_BREAK]: an added token after the sentencepiece pieces (embedding rows made for it).
IMG_BREAK_EXTRA = 4


def _gemma3_released(name: str) -> str:
    return "vision_tower.vision_model." + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") \
        else name


def _gemma3_prefixed(name: str) -> str:
    name = _gemma3_released(name)
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return name if name.startswith("lm_head") else "model." + name


def _llava_prefixed(name: str) -> str:
    # transformers 4.5x's own layout: model.language_model / model.vision_tower / model.multi_modal_projector
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head"):
        return name.removeprefix("language_model.")
    return "model." + name


def _llava_flat(name: str) -> str:
    # the text model at the root (model.*, lm_head): the only layout where llama.cpp's converter still sees the
    # embedding ("language_model." names are dropped first) and writes v.token_embd.img_break
    return name.removeprefix("language_model.")


def _qwen_prefixed(name: str) -> str:
    # transformers 4.5x's Qwen2.5-VL module layout: model.visual.*, model.language_model.*, lm_head
    if name.startswith("visual."):
        return "model." + name
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def _qwen_flat(name: str) -> str:
    # Qwen2.5-VL's released layout for Qwen3-VL's weights: visual.*, model.*, lm_head
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return "model." + name.removeprefix("model.language_model.") if name.startswith("model.language_model.") \
        else name


#: class -> layout -> rename of the names transformers saved (None: as saved).
LAYOUTS: dict[str, dict[str, Callable[[str], str] | None]] = {
    "Gemma3ForConditionalGeneration": {"transformers5": None, "released": _gemma3_released,
                                       "prefixed": _gemma3_prefixed},
    # The hub's SmolVLM / Idefics3 files and transformers 5 name tensors alike (model.vision_model.*,
    # model.connector.*, model.text_model.*).
    "Idefics3ForConditionalGeneration": {"released": None},
    "SmolVLMForConditionalGeneration": {"released": None},
    # transformers 5 saves what the hub's Pixtral / Mistral 3 files hold (language_model.model.*, vision_tower.*).
    "LlavaForConditionalGeneration": {"released": None, "prefixed": _llava_prefixed, "flat": _llava_flat},
    "Mistral3ForConditionalGeneration": {"released": None, "prefixed": _llava_prefixed, "flat": _llava_flat},
    # transformers 5 saves what the hub's files hold: Qwen2.5-VL flat, Qwen3-VL under model.
    "Qwen2_5_VLForConditionalGeneration": {"released": None, "prefixed": _qwen_prefixed},
    "Qwen3VLForConditionalGeneration": {"released": None, "flat": _qwen_flat},
    # transformers 5 saves what the hub's Qwen3.5 files hold (model.visual.*, model.language_model.*, lm_head)
    "Qwen3_5ForConditionalGeneration": {"released": None, "flat": _qwen_flat},
    "Qwen3_5MoeForConditionalGeneration": {"released": None, "flat": _qwen_flat},
}
#: The layout transformers saved (and loads), per class.
SAVED_LAYOUT = {cls: next(k for k, v in layouts.items() if v is None) for cls, layouts in LAYOUTS.items()}
#: The layout llama.cpp's converter (0.3.36) handles, per class.
ORACLE_LAYOUT = {"Gemma3ForConditionalGeneration": "released", "Idefics3ForConditionalGeneration": "released",
                 "SmolVLMForConditionalGeneration": "released",
                 "LlavaForConditionalGeneration": "flat", "Mistral3ForConditionalGeneration": "flat",
                 "Qwen2_5_VLForConditionalGeneration": "released", "Qwen3VLForConditionalGeneration": "released",
                 "Qwen3_5ForConditionalGeneration": "released", "Qwen3_5MoeForConditionalGeneration": "released"}


def _preprocessor(dir: Path, hf_class: str) -> None:
    config = json.loads((dir / "config.json").read_text())
    size = config["vision_config"].get("image_size")
    if hf_class == "Gemma3ForConditionalGeneration":
        # as the hub's Gemma 3 processor files say it: SigLIP's mean/std, image_seq_length = tokens per image
        data = {"image_processor_type": "Gemma3ImageProcessor", "do_normalize": True, "do_rescale": True,
                "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
                "rescale_factor": 1 / 255, "size": {"height": size, "width": size},
                "image_seq_length": config["mm_tokens_per_image"]}
    elif hf_class in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        # Idefics3ImageProcessor's fields (SmolVLMImageProcessor's are the same); the longest edge at the tile
        # size: one tile per image
        kind = "Idefics3" if hf_class.startswith("Idefics3") else "SmolVLM"
        data = {"image_processor_type": f"{kind}ImageProcessor", "do_convert_rgb": True, "do_image_splitting": True,
                "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 1,
                "rescale_factor": 1 / 255, "size": {"longest_edge": size}, "max_image_size": {"longest_edge": size}}
    elif hf_class in ("LlavaForConditionalGeneration", "Mistral3ForConditionalGeneration"):
        # PixtralImageProcessor's fields (CLIP's mean and std)
        data = {"image_processor_type": "PixtralImageProcessor", "do_convert_rgb": True, "do_normalize": True,
                "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": {"height": 8, "width": 8},
                "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": size}}
        if hf_class == "Mistral3ForConditionalGeneration":
            data["patch_size"] = {"height": 16, "width": 16}  # patch x spatial merge, as Mistral 3's file has it
    elif hf_class in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
        # Qwen2VLImageProcessor's fields (CLIP's mean and std), the patch and merge of the vision config
        vision = config["vision_config"]
        data = {"image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_normalize": True,
                "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 3136, "max_pixels": 12845056,
                "patch_size": vision["patch_size"], "merge_size": 2, "temporal_patch_size": 2, "resample": 3,
                "rescale_factor": 1 / 255}
    elif hf_class in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        # the hub's Qwen3.5 preprocessor_config.json (mean and std 0.5, pixel budgets as size's edges)
        vision = config["vision_config"]
        data = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": vision["patch_size"],
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast"}
    else:
        raise KeyError(hf_class)
    (dir / "preprocessor_config.json").write_text(json.dumps(data, indent=2))


def make_vlm(dir: Path, hf_class: str, **overrides: object) -> Path:
    """A tiny ``hf_class`` checkpoint as this environment's transformers saves it, with its preprocessor config."""
    pixtral = hf_class in ("LlavaForConditionalGeneration", "Mistral3ForConditionalGeneration")
    if pixtral:
        overrides.setdefault("extra_vocab", IMG_BREAK_EXTRA)
    make_checkpoint(dir, hf_class, **overrides)
    _preprocessor(dir, hf_class)
    if pixtral:
        path = dir / "tokenizer_config.json"
        config = json.loads(path.read_text())
        n = json.loads((dir / "config.json").read_text())["text_config"]["vocab_size"] - IMG_BREAK_EXTRA
        config.setdefault("added_tokens_decoder", {})[str(n)] = {
            "content": "[IMG_BREAK]", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
        path.write_text(json.dumps(config, indent=2))
    return dir


def copy_layout(src: Path, dst: Path, hf_class: str, layout: str) -> Path:
    """``src`` (saved as transformers saves it) re-saved in ``layout``."""
    from safetensors.torch import load_file, save_file  # torch: bf16 checkpoints too

    shutil.copytree(src, dst)
    rename = LAYOUTS[hf_class][layout]
    if rename is not None:
        tensors = load_file(str(src / "model.safetensors"))
        save_file({rename(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"),
                  metadata={"format": "pt"})
    return dst


# -- config.json as the released checkpoints write it ------------------------------------------------------------
@dataclass(frozen=True)
class Release:
    """A released checkpoint's config.json form, at the smallest vision tower llama.cpp's converter accepts."""

    hf_class: str
    #: the tower (vision_config overrides of the class's tiny one)
    tower: dict[str, Any]
    #: the keys the release's vision_config writes (the rest are transformers' defaults)
    vision_keys: tuple[str, ...]
    transformers_version: str
    #: text_config's (or the root's) "architectures": the text model's class, as SmolVLM's releases name it
    text_class: str | None = None
    #: vision_config fields the release writes that this transformers does not save (or saves otherwise)
    vision_extra: dict[str, Any] = field(default_factory=dict)
    #: the text model's fields at the root, no text_config (Qwen2.5-VL's releases)
    flat: bool = False


_SIGLIP_SIZES = ("hidden_size", "image_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                 "patch_size")
_QWEN3_VISION = ("deepstack_visual_indexes", "depth", "hidden_act", "hidden_size", "in_channels",
                 "initializer_range", "intermediate_size", "num_heads", "num_position_embeddings", "out_hidden_size",
                 "patch_size", "spatial_merge_size", "temporal_patch_size")
#: Smallest towers: llama.cpp's converter maps Pixtral's multi_modal_projector.linear_{1,2} and Qwen2.5-VL's
#: visual.merger.mlp.{0,2} through its block-numbered tensor map (gguf-py get_tensor_name_map(MMPROJ,
#: block_count)), so it needs 3 blocks there; 1 elsewhere.
RELEASES: dict[str, Release] = {
    # google/gemma-3-4b-it
    "gemma-3": Release("Gemma3ForConditionalGeneration", {"num_hidden_layers": 1},
                       (*_SIGLIP_SIZES, "model_type", "vision_use_head"), "4.50.0.dev0"),
    # HuggingFaceTB/SmolVLM-Instruct: the text model's class in text_config, a "smolvlm_vision" tower
    "smolvlm": Release("Idefics3ForConditionalGeneration", {"num_hidden_layers": 1},
                       (*_SIGLIP_SIZES, "max_image_size", "model_type", "size", "tie_word_embeddings",
                        "use_base_siglip"), "4.46.0", "VLlama3ForCausalLM",
                       {"model_type": "smolvlm_vision", "use_base_siglip": False, "tie_word_embeddings": False}),
    # HuggingFaceTB/SmolVLM2-500M-Video-Instruct: no num_hidden_layers, intermediate_size or layer_norm_eps in
    # vision_config (transformers' 12, 3072 and 1e-6)
    "smolvlm2": Release("SmolVLMForConditionalGeneration", {"num_hidden_layers": 12, "intermediate_size": 3072},
                        ("hidden_size", "image_size", "max_image_size", "model_type", "num_attention_heads",
                         "patch_size", "size", "tie_word_embeddings", "use_base_siglip"), "4.47.1",
                        "VLlama3ForCausalLM", {"use_base_siglip": False, "tie_word_embeddings": False}),
    # mistral-community/pixtral-12b
    "pixtral": Release("LlavaForConditionalGeneration", {"num_hidden_layers": 3},
                       (*_SIGLIP_SIZES, "head_dim", "hidden_act", "is_composition", "model_type", "rope_theta",
                        "tie_word_embeddings"), "4.45.0.dev0", None,
                       {"is_composition": True, "rope_theta": 10000.0, "tie_word_embeddings": False}),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503
    "mistral-3.1": Release("Mistral3ForConditionalGeneration", {"num_hidden_layers": 3},
                           (*_SIGLIP_SIZES, "attention_dropout", "head_dim", "hidden_act", "initializer_range",
                            "model_type", "num_channels", "rope_theta"), "4.50.0.dev0", None,
                           {"rope_theta": 10000.0}),
    # Qwen/Qwen2.5-VL-3B-Instruct: flat, no model_type in vision_config
    "qwen2.5-vl": Release("Qwen2_5_VLForConditionalGeneration", {"depth": 3, "fullatt_block_indexes": [2]},
                          ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "in_chans",
                           "out_hidden_size", "patch_size", "spatial_merge_size", "spatial_patch_size",
                           "window_size", "fullatt_block_indexes", "tokens_per_second", "temporal_patch_size"),
                          "4.49.0.dev0", None, {"in_chans": 3, "spatial_patch_size": 14, "tokens_per_second": 2},
                          flat=True),
    # Qwen/Qwen3-VL-2B-Instruct, with a 1-block tower and with the 2 blocks: merger.linear_fc2 is mm.2
    "qwen3-vl": Release("Qwen3VLForConditionalGeneration", {"depth": 1, "deepstack_visual_indexes": [0]},
                        (*_QWEN3_VISION, "model_type"), "4.57.0.dev0", None, {"model_type": "qwen3_vl"}),
    "qwen3-vl-2-blocks": Release("Qwen3VLForConditionalGeneration", {"depth": 2, "deepstack_visual_indexes": [0, 1]},
                                 (*_QWEN3_VISION, "model_type"), "4.57.0.dev0", None, {"model_type": "qwen3_vl"}),
}


def _v4_text(text: dict[str, Any]) -> dict[str, Any]:
    """transformers 4's spelling of a text config: torch_dtype, rope_theta with rope_scaling beside it."""
    out = {("torch_dtype" if k == "dtype" else k): v for k, v in text.items()}
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # (Gemma 3's per-layer-type rope stays as saved)
        out.pop("rope_parameters")
        out["rope_theta"] = rope["rope_theta"]
        rest = {k: v for k, v in rope.items() if k != "rope_theta"}
        if set(rest) - {"rope_type"}:
            out["rope_scaling"] = rest
    return out


def released_config(model: Path, name: str) -> Path:
    """Rewrite ``model``'s config.json (as this transformers saved it) in the form of release ``name``."""
    rel = RELEASES[name]
    config = json.loads((model / "config.json").read_text())
    vision = config["vision_config"]
    config["vision_config"] = {**{k: vision[k] for k in rel.vision_keys if k in vision}, **rel.vision_extra}
    config = {("torch_dtype" if k == "dtype" else k): v for k, v in config.items()}
    config["transformers_version"] = rel.transformers_version
    text = _v4_text(config.pop("text_config"))
    if rel.text_class is not None:
        text["architectures"] = [rel.text_class]
    if rel.flat:
        config = {**config, **text, "model_type": config["model_type"]}
    else:
        config["text_config"] = text
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def make_released(dir: Path, name: str, **tower: Any) -> Path:
    """A tiny checkpoint of release ``name``: its tensor layout (the one llama.cpp's converter handles), its
    config.json's form, the smallest tower llama.cpp's converter accepts (``tower``: other vision_config sizes)."""
    rel = RELEASES[name]
    vision = {**fixtures_models._BASE[rel.hf_class]["vision_config"], **rel.tower, **tower}
    base = make_vlm(dir.parent / f"{dir.name}-saved", rel.hf_class, vision_config=vision)
    return released_config(copy_layout(base, dir, rel.hf_class, ORACLE_LAYOUT[rel.hf_class]), name)


# Qwen3.5's released config.json (Qwen/Qwen3.5-9B, Qwen/Qwen3.5-35B-A3B: written by 4.57.0.dev0): rope_parameters
# as transformers 5 spells them, plus text keys transformers 5 no longer saves (full_attention_interval, the
# root partial_rotary_factor, attn_output_gate, mamba_ssm_dtype) and a vision_config with
# "deepstack_visual_indexes": [] and the old model_type ("qwen3_5", "qwen3_5_moe").
_QWEN35_RELEASE_VISION = ("deepstack_visual_indexes", "depth", "hidden_act", "hidden_size", "in_channels",
                          "initializer_range", "intermediate_size", "model_type", "num_heads",
                          "num_position_embeddings", "out_hidden_size", "patch_size", "spatial_merge_size",
                          "temporal_patch_size")


def qwen35_released_config(model: Path) -> Path:
    """Rewrite a Qwen3.5 VLM's config.json (as this transformers saved it) in the released form."""
    config = json.loads((model / "config.json").read_text())
    moe = config["architectures"][0] == "Qwen3_5MoeForConditionalGeneration"
    vision = {**config["vision_config"], "deepstack_visual_indexes": [],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5"}
    config["vision_config"] = {k: vision[k] for k in _QWEN35_RELEASE_VISION if k in vision}
    text = config["text_config"]
    kinds = text["layer_types"]
    text.update(attn_output_gate=True, mamba_ssm_dtype="float32", mtp_use_dedicated_embeddings=False,
                full_attention_interval=kinds.index("full_attention") + 1,
                partial_rotary_factor=text["rope_parameters"]["partial_rotary_factor"])
    config["transformers_version"] = "4.57.0.dev0"
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def llama_cpp_mmproj(model: Path, out: Path, outtype: str) -> subprocess.CompletedProcess[str]:
    """llama.cpp's converter with ``--mmproj`` (the sdist's convert_hf_to_gguf.py and gguf-py), not checked."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    return subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--mmproj",
                           "--outfile", str(out), "--outtype", outtype], capture_output=True, text=True, env=env)


#: Keys that name the file rather than describe the projector (left out of every comparison).
NAMING_KEYS = {"general.name"}


def layout_checkpoints(tmp_path_factory: pytest.TempPathFactory, classes: list[str]) -> dict[str, dict[str, Path]]:
    """Per class: each layout's checkpoint directory (same weights)."""
    out: dict[str, dict[str, Path]] = {}
    for hf_class in classes:
        root = tmp_path_factory.mktemp(hf_class)
        base = make_vlm(root / "base", hf_class)
        out[hf_class] = {layout: copy_layout(base, root / layout, hf_class, layout) for layout in LAYOUTS[hf_class]}
    return out


def projector_tensors(path: Path) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    """name -> (type, shape, bytes) of every tensor of a GGUF file."""
    with open_gguf(path) as g:
        return {t.name: (int(t.ggml_type), tuple(t.ne), bytes(g.raw(t))) for t in g.tensors}


def projector_keys(path: Path) -> dict[str, object]:
    """key -> (type, value) of a GGUF file, naming and ggufkit's provenance keys aside."""
    with open_gguf(path) as g:
        return {k: (g.kv[k].type, np.asarray(g.get(k)).tolist()) for k in g.kv
                if not k.startswith("ggufkit.") and k not in NAMING_KEYS}


def layout_projectors(layouts: dict[str, Path], tmp_path: Path) -> dict[str, tuple[dict, dict]]:
    """layout -> (tensors, keys) of the f16 projector ggufkit writes from that layout's checkpoint."""
    out = {}
    for layout, model in layouts.items():
        path = convert_mmproj(model, tmp_path / f"{layout}.gguf", outtype="f16").outputs[0]
        out[layout] = (projector_tensors(path), projector_keys(path))
    return out


def assert_refused(model: Path, tmp_path: Path, needle: str) -> None:
    """``convert --mmproj`` of ``model``: exit 2, one line holding ``needle``, nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    res = invoke("convert", str(model), "--mmproj", "-o", str(out))
    assert res.exit_code == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr
    assert list(out.iterdir()) == []
