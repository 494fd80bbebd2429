"""Gemma 3n hooks (conversion/gemma.py ``Gemma3NModel``; src/models/gemma3n.cpp).

llama.cpp's gemma3n loader reads few of the keys its converter writes and fixes the rest: 4 AltUp streams with
stream 0 active, per-layer inputs 256 wide, LAuReL rank 64 (src/llama-hparams.h: ``n_altup``, ``i_altup_act``,
``n_embd_altup``, ``laurel_rank``), a final soft-cap of 30 (``f_final_logit_softcapping``, never read for
gemma3n), activation sparsity (the gaussian top-k at the 95th percentile) on layers 0-9 exactly
(llama_model_gemma3n::graph ``n_layer_sparsity``, ``f_sparsity_std_mul``), K/V computed by layers 0-19 only,
later layers reusing layer 18's (sliding) or 19's (global) (``n_layer_kv_from_start = 20``; llama-model.cpp
create_memory's reuse callback). A checkpoint configured otherwise would load into another model (or not load):
refused, one line. The schedule is read from ``layer_types`` (release configs and transformers 5 both write
it; transformers derives every 5th layer global when it is absent, where llama.cpp's converter fails on the
missing key), the sparsity from ``activation_sparsity_pattern`` (transformers' default when absent: 0.95 on the
first 10 layers of a model deeper than 10).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from statistics import NormalDist
from typing import Any

import numpy as np

from ggufkit.converters.rewrite import Raw
from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.format.values import VT

#: What llama.cpp's gemma3n loader and graph fix (src/llama-hparams.h, src/models/gemma3n.cpp).
N_ALTUP = 4
ALTUP_ACTIVE = 0
N_EMBD_ALTUP = 256
LAUREL_RANK = 64
FINAL_SOFTCAP = 30.0
N_LAYER_SPARSITY = 10
SPARSITY = 0.95
N_LAYER_KV_FROM_START = 20


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per layer ``sliding_attention`` / ``full_attention``: ``layer_types``, else transformers' default
    (Gemma3nTextConfig.__post_init__: every 5th layer global)."""
    types = config.get("layer_types")
    if isinstance(types, list):
        return [str(t) for t in types]
    n = int(config.get("num_hidden_layers", 35))
    return ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(n)]


def sparsity_pattern(config: Mapping[str, Any]) -> list[float]:
    """Per layer sparsity: ``activation_sparsity_pattern``, else transformers' default (0.95 on the first 10
    layers when there are more than 10)."""
    pattern = config.get("activation_sparsity_pattern")
    n = int(config.get("num_hidden_layers", 35))
    if isinstance(pattern, list):
        return [float(p) for p in pattern]
    if isinstance(pattern, (int, float)) and not isinstance(pattern, bool):
        return [float(pattern)] * n
    sparse = N_LAYER_SPARSITY if n > N_LAYER_SPARSITY else 0
    return [SPARSITY] * sparse + [0.0] * (n - sparse)


def check_config(config: Mapping[str, Any]) -> None:
    """AltUp, LAuReL, per-layer input width, soft-cap, sparsity and KV sharing as llama.cpp fixes them."""
    problems = []
    n = config.get("num_hidden_layers")
    n_layer = int(n) if isinstance(n, int) else 35
    fixed = (("altup_num_inputs", N_ALTUP, 4), ("altup_active_idx", ALTUP_ACTIVE, 0),
             ("hidden_size_per_layer_input", N_EMBD_ALTUP, 256), ("laurel_rank", LAUREL_RANK, 64))
    for key, want, default in fixed:
        if config.get(key, default) != want:
            problems.append(f"{key} {config.get(key)} (llama.cpp's gemma3n loader fixes {want})")
    cap = config.get("final_logit_softcapping", FINAL_SOFTCAP)
    if cap is None or not math.isclose(float(cap), FINAL_SOFTCAP):
        problems.append(f"final_logit_softcapping {cap} (llama.cpp's gemma3n graph caps at {FINAL_SOFTCAP:g})")
    if config.get("altup_correct_scale", True) is not True:
        problems.append("altup_correct_scale false (llama.cpp's graph always scales the corrected stream)")
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {config.get('hidden_activation')!r} (llama.cpp's FFN is tanh GELU)")
    if config.get("attention_bias") is True:
        problems.append("attention biases (llama.cpp's gemma3n graph has none)")
    if config.get("tie_word_embeddings", True) is False:
        problems.append("an lm_head not tied to the embeddings (llama.cpp's converter drops it)")
    want_sparsity = [SPARSITY if i < N_LAYER_SPARSITY else 0.0 for i in range(n_layer)]
    if sparsity_pattern(config) != want_sparsity:
        problems.append(f"activation_sparsity_pattern other than {SPARSITY} on layers 0-{N_LAYER_SPARSITY - 1} "
                        "and 0 after (llama.cpp's graph fixes it)")
    types = layer_types(config)
    if len(types) != n_layer or any(t not in ("sliding_attention", "full_attention") for t in types):
        problems.append(f"layer_types is not one of sliding_attention / full_attention per layer ({n_layer})")
    shared = int(config.get("num_kv_shared_layers", 15) or 0)
    if n_layer > N_LAYER_KV_FROM_START or shared:
        if n_layer - shared != N_LAYER_KV_FROM_START:
            problems.append(f"num_kv_shared_layers {shared} of {n_layer} layers (llama.cpp computes K/V in the "
                            f"first {N_LAYER_KV_FROM_START} layers only)")
        elif types[N_LAYER_KV_FROM_START - 2:N_LAYER_KV_FROM_START] != ["sliding_attention", "full_attention"]:
            problems.append(f"layers {N_LAYER_KV_FROM_START - 2} and {N_LAYER_KV_FROM_START - 1} are not sliding "
                            "and global (llama.cpp's shared layers reuse their K/V)")
    if problems:
        raise UnsupportedArchitectureError("gemma3n: llama.cpp would compute another model: " + "; ".join(problems))


def _std_multiplier(p: float) -> float:
    """``torch.distributions.Normal(0, 1).icdf(p)`` as Gemma3NModel writes it: ``erfinv(2p - 1) * sqrt(2)`` in
    float32 steps (-inf for 0)."""
    t = np.float32(np.float32(2) * np.float32(p) - np.float32(1))
    if t <= -1:
        return -math.inf
    erfinv = np.float32(NormalDist().inv_cdf((float(t) + 1) / 2) / math.sqrt(2))
    return float(np.float32(erfinv * np.float32(math.sqrt(2))))


def hparams(config: Mapping[str, Any], values: dict[str, tuple[VT, Any]],
            names: tuple[str, ...] = ()) -> dict[str, tuple[VT, Any]]:
    """The per-layer arrays Gemma3NModel.set_gguf_parameters writes: feed_forward_length (the config's list, or
    its one value), attention.sliding_window_pattern (BOOL per layer), activation_sparsity_scale (FLOAT32 per
    layer)."""
    del names
    out = dict(values)
    ff = config.get("intermediate_size")
    if isinstance(ff, list):
        out["gemma3n.feed_forward_length"] = (VT.ARRAY, [int(v) for v in ff])
    elif ff is not None:
        out["gemma3n.feed_forward_length"] = (VT.UINT32, int(ff))
    out["gemma3n.activation_sparsity_scale"] = (VT.ARRAY, [_std_multiplier(p) for p in sparsity_pattern(config)])
    out["gemma3n.attention.sliding_window_pattern"] = (VT.ARRAY, [t == "sliding_attention"
                                                                 for t in layer_types(config)])
    return out


def _padded(load: Callable[[], np.ndarray], rows: int) -> Callable[[], np.ndarray]:
    def pad() -> np.ndarray:
        arr = load()
        out = np.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
        out[:arr.shape[0]] = arr
        return out

    return pad


def _zeros(shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: np.zeros(shape, dtype=np.float32)


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], np.ndarray]],
                    config: Mapping[str, Any]) -> list[Raw]:
    """The token and per-layer embeddings padded with zero rows to ``vocab_size`` (the vision and audio token
    slots: Gemma3NModel.modify_tensors), ``altup.correct_output_scale`` named ``.weight`` (its
    ``filter_tensors``), and K/V weights for the KV-sharing layers where the checkpoint has none.

    transformers 5 builds no k_proj / v_proj / k_norm in the layers that reuse another layer's K/V (Gemma3nText
    Attention ``is_kv_shared_layer``); the released checkpoints carry them (unused), and llama.cpp's loader
    requires them in every layer (load_arch_tensors ``create_tensor_qkv(..., 0)``, attn_k_norm) though its graph
    never reads them there (``hparams.has_kv(il)`` false): written as zeros, where the release order has them.
    """
    vocab = config.get("vocab_size")
    names = {r[0] for r in raw}
    n_layer = int(config.get("num_hidden_layers", 0))
    shared = int(config.get("num_kv_shared_layers", 0) or 0)
    head_dim = int(config.get("head_dim", 256))
    kv_rows = int(config.get("num_key_value_heads", 1)) * head_dim
    n_embd = int(config.get("hidden_size", 0))
    missing_kv = {il for il in range(n_layer - shared, n_layer) if f"blk.{il}.attn_k.weight" not in names}
    out: list[Raw] = []

    def add(name: str, kind: str, shape: tuple[int, ...]) -> None:
        out.append((name, "(zeros: a KV-sharing layer)", kind, shape, "F32", None))
        loaders[name] = _zeros(shape)

    for gguf, source, kind, shape, dtype, transform in raw:
        if kind == "ALTUP_CORRECT_SCALE" and not gguf.endswith(".weight"):
            loaders[gguf + ".weight"] = loaders.pop(gguf)
            gguf += ".weight"
        if kind in ("TOKEN_EMBD", "PER_LAYER_TOKEN_EMBD") and isinstance(vocab, int) and shape[0] < vocab:
            loaders[gguf] = _padded(loaders[gguf], vocab)
            shape = (vocab, *shape[1:])
        il = int(gguf.split(".")[1]) if gguf.startswith("blk.") else -1
        if il in missing_kv and kind == "ATTN_OUT":
            add(f"blk.{il}.attn_k_norm.weight", "ATTN_K_NORM", (head_dim,))
            add(f"blk.{il}.attn_k.weight", "ATTN_K", (kv_rows, n_embd))
        out.append((gguf, source, kind, shape, dtype, transform))
        if il in missing_kv and kind == "ATTN_Q":
            add(f"blk.{il}.attn_v.weight", "ATTN_V", (kv_rows, n_embd))
    return out
