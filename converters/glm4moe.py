"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 hooks (``Glm4MoeForCausalLM`` -> ``glm4moe``; conversion/glm.py
``Glm4MoeModel``, src/models/glm4-moe.cpp).

llama.cpp's converter reads the config through ``AutoConfig`` (conversion/base.py ``ModelBase.load_hparams``),
so what config.json leaves out it sees as ``Glm4MoeConfig``'s default and what it spells otherwise as
transformers' spelling: the registry entry's defaults, and here the rope dimension (``head_dim`` or hidden /
heads, times ``partial_rotary_factor``, 0.5 when no spelling has it), the router's correction bias named as
llama.cpp names it, the tokenizer roles ``_set_vocab_glm`` fills in, and refusals of what llama.cpp's graph would
compute differently from transformers' model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ggufkit.errors import CheckpointError, TokenizerError, UnsupportedArchitectureError
from ggufkit.format.values import VT

#: Glm4MoeConfig's defaults for the keys the hooks read (transformers 5 configuration_glm4_moe.py).
_DEFAULTS: dict[str, Any] = {"hidden_size": 4096, "num_attention_heads": 96, "n_routed_experts": 128,
                             "n_group": 1, "topk_group": 1, "num_hidden_layers": 46, "first_k_dense_replace": 1}
#: Tokenizer roles llama.cpp's ``_set_vocab_glm`` sets by added-token text (conversion/base.py); gguf-py's
#: ``SpecialVocab._set_special_token`` keeps a role the tokenizer files already gave.
SPECIAL_TOKENS = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}
_ROLE_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eot": "tokenizer.ggml.eot_token_id",
              "unk": "tokenizer.ggml.unknown_token_id", "eom": "tokenizer.ggml.eom_token_id"}

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]


def _get(config: Mapping[str, Any], key: str) -> Any:
    value = config.get(key)
    return _DEFAULTS.get(key) if value is None else value


def partial_rotary_factor(config: Mapping[str, Any]) -> float:
    """``rope_parameters.partial_rotary_factor``, else the root key (transformers moves it there), else 0.5
    (Glm4MoeConfig's default, which Glm4MoeModel.set_gguf_parameters also assumes)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping) and rope.get("partial_rotary_factor") is not None:
        return float(rope["partial_rotary_factor"])
    if config.get("partial_rotary_factor") is not None:
        return float(config["partial_rotary_factor"])
    return 0.5


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse what llama.cpp's glm4moe graph computes differently from transformers' Glm4MoeForCausalLM."""
    problems = []
    n_group, topk = int(_get(config, "n_group")), int(_get(config, "topk_group"))
    n_expert = int(_get(config, "n_routed_experts"))
    if n_group > 1 and (topk >= n_group or n_expert % n_group):
        # llama_model::load_hparams asserts n_group_used < n_expert_groups and n_expert % n_expert_groups == 0
        problems.append(f"n_group {n_group} with topk_group {topk} over {n_expert} experts (llama.cpp's loader "
                        "needs topk_group < n_group and the experts split evenly)")
    if str(config.get("hidden_act", "silu")) != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (llama.cpp's glm4moe FFNs are SiLU-gated)")
    head = config.get("head_dim") or _get(config, "hidden_size") // _get(config, "num_attention_heads")
    if int(head * partial_rotary_factor(config)) % 2:
        problems.append(f"an odd rotary dimension {int(head * partial_rotary_factor(config))}")
    if problems:
        raise UnsupportedArchitectureError("glm4moe: llama.cpp would compute another model: " + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, tuple[VT, Any]],
            tensor_names: tuple[str, ...]) -> dict[str, tuple[VT, Any]]:
    """``rope.dimension_count``: the head size (``head_dim``, else hidden / heads) times the partial rotary
    factor, truncated (Glm4MoeModel.set_gguf_parameters)."""
    _check_layers(config, tensor_names)
    head = config.get("head_dim") or int(_get(config, "hidden_size")) // int(_get(config, "num_attention_heads"))
    out = dict(values)
    out["glm4moe.rope.dimension_count"] = (VT.UINT32, int(int(head) * partial_rotary_factor(config)))
    return out


def _check_layers(config: Mapping[str, Any], tensor_names: tuple[str, ...]) -> None:
    """Every trunk block has its attention and, by ``first_k_dense_replace``, a dense FFN or a router (the
    registry entry is ``hybrid``, so no per-block check runs otherwise; llama.cpp's loader would fail on it)."""
    if not tensor_names:
        return
    names = set(tensor_names)
    n_layer, dense = int(_get(config, "num_hidden_layers")), int(_get(config, "first_k_dense_replace"))
    missing = []
    for il in range(n_layer):
        p = f"model.layers.{il}."
        need = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj"]
        need += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] if il < dense else ["mlp.gate"]
        missing += [p + n for n in need if p + n + ".weight" not in names]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise CheckpointError(f"glm4moe: no {', '.join(missing[:4])}{more} (num_hidden_layers {n_layer}, "
                              f"first_k_dense_replace {dense} dense layers)")


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], Any]], config: Mapping[str, Any]) -> list[Raw]:
    """The router's correction bias, a buffer named without ``.weight``/``.bias``, as ``exp_probs_b.bias``
    (gguf-py's tensor map of ``mlp.gate.e_score_correction_bias``)."""
    out = []
    for name, source, kind, shape, dtype, transform in raw:
        if kind == "FFN_EXP_PROBS_B" and not name.endswith((".weight", ".bias")):
            if name in loaders:
                loaders[name + ".bias"] = loaders.pop(name)
            name += ".bias"
        out.append((name, source, kind, shape, dtype, transform))
    return out


def special_tokens(model_dir: Path, present: Mapping[str, Any]) -> dict[str, int]:
    """The tokenizer roles ``_set_vocab_glm`` sets that ``present`` (the vocabulary's keys) lacks: key -> id of
    the added token named in :data:`SPECIAL_TOKENS`.

    Raises:
        TokenizerError: tokenizer.json lacks one of those added tokens (llama.cpp's converter fails on it).
    """
    path = Path(model_dir) / "tokenizer.json"
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
        added = {a["content"]: int(a["id"]) for a in tokenizer["added_tokens"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"GLM's tokenizer roles need tokenizer.json's added tokens ({e})", path=path) from None
    missing = {role: key for role, key in _ROLE_KEYS.items() if key not in present}
    if "bos" not in missing and not _files_name_bos(Path(model_dir), tokenizer):
        missing["bos"] = _ROLE_KEYS["bos"]  # ggufkit's eos-as-bos fallback, which SpecialVocab does not have
    if not missing:
        return {}
    out = {}
    for role, key in missing.items():
        text = SPECIAL_TOKENS[role]
        if text not in added:
            raise TokenizerError(f"no added token {text} (GLM's {role} token, as llama.cpp's _set_vocab_glm "
                                 "names it)", path=path)
        out[key] = added[text]
    return out


def _files_name_bos(model_dir: Path, tokenizer: Mapping[str, Any]) -> bool:
    """Whether the tokenizer files give a bos token as gguf-py's SpecialVocab reads them: tokenizer_config's
    ``bos_token`` / ``cls_token``, config.json's ``bos_token_id``, a TemplateProcessing post-processor that
    starts with a special token."""
    def read(name: str) -> Any:
        try:
            return json.loads((model_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    tok_cfg, config = read("tokenizer_config.json") or {}, read("config.json") or {}
    if tok_cfg.get("bos_token") or tok_cfg.get("cls_token") or config.get("bos_token_id") is not None:
        return True
    post = tokenizer.get("post_processor") or {}
    procs = post.get("processors", [post]) if isinstance(post, Mapping) else []
    return any(isinstance(p, Mapping) and p.get("type") == "TemplateProcessing" and len(p.get("single") or []) > 1
               and "SpecialToken" in (p["single"][0] or {}) for p in procs)
