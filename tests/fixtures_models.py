"""Tiny random checkpoints built with transformers' real model classes, for converter tests.

Weights come from an explicit ``torch.Generator`` (seeded), with a larger spread than transformers'
default init so that the logits are peaked: top-1 comparisons then test the conversion, not noise.
Tokenizer files come from :mod:`fixtures_tokenizers` (trained locally). Nothing is downloaded.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import fixtures_tokenizers as ft

#: Per class: transformers config class, model class, tokenizer builder, base config.
_BASE: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "Qwen2ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                             tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6,
                             tie_word_embeddings=True),
    "GPTNeoXForCausalLM": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=128, rotary_pct=0.25, partial_rotary_factor=0.25,
                               rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5,
                               tie_word_embeddings=False),
    # sliding_window beyond every test's context: llama.cpp's llama graph has none (the converter warns).
    "MistralForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                               tie_word_embeddings=False, sliding_window=None, bos_token_id=1, eos_token_id=2),
    "MixtralForCausalLM": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                               num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                               sliding_window=None, bos_token_id=1, eos_token_id=2),
    "Qwen2MoeForCausalLM": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen3MoeForCausalLM": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # sliding window (8) shorter than the test contexts, both soft-cappings on, query scale = head size.
    "Gemma2ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # 6 layers: five sliding-window layers (rope base 10000) and one global one (rope base 1e6).
    "Gemma3ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                              final_logit_softcapping=30.0, max_position_embeddings=128, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "Phi3ForCausalLM": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=128,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0),
    # Gemma 3 with a (tiny) vision tower: converted to its text model, as llama.cpp's converter does. No final
    # soft-capping, as in Google's configs (with it, transformers' multimodal class gave logits without the
    # cap here, unlike its Gemma3ForCausalLM and llama.cpp).
    "Gemma3ForConditionalGeneration": dict(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                         max_position_embeddings=128, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=3, eoi_token_index=4, image_token_index=5,
        tie_word_embeddings=True),
    # OLMo 2: GQA (as the 32B), an untied head as every released OLMo 2 (test_family_olmo2.py).
    "Olmo2ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, pad_token_id=None, eos_token_id=50256),
    # SmolLM3 (release config layout: tied head, rope_theta 5e6): 4 layers, so that layer 3 is a NoPE layer.
    "SmolLM3ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                               rope_theta=5000000.0, tie_word_embeddings=True),
    # Cohere 2 (Command R7B's shape, scaled down): 4 layers, so that layer 3 is global (no RoPE) and 0-2 slide
    # through a window (8) shorter than the test contexts; a logit scale other than transformers' default.
    "Cohere2ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128, layer_norm_eps=1e-5,
                               logit_scale=0.25, sliding_window=8,
                               rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                               tie_word_embeddings=True, bos_token_id=5, eos_token_id=255001, pad_token_id=0),
    # Falcon-H1 (tiiuae/Falcon-H1-0.5B's multipliers and switches, scaled down): attention and a Mamba2 mixer in
    # every layer, 2 SSM groups, the gated group RMSNorm on; no head_dim (transformers 5's save of a config built
    # without it: the model uses hidden_size // num_attention_heads)
    "FalconH1ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                                mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                                mamba_d_conv=4, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
                                embedding_multiplier=5.656854249492381, key_multiplier=0.39062499999999994,
                                lm_head_multiplier=0.0390625, mlp_multipliers=[0.8838834764831844, 0.5859375],
                                ssm_in_multiplier=1.25, ssm_out_multiplier=0.23570226039551587,
                                ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5,
                                                 0.3535533905932738],
                                rope_parameters={"rope_type": "default", "rope_theta": 100000000000.0},
                                tie_word_embeddings=False, bos_token_id=1, eos_token_id=11, pad_token_id=0),
    # Nemotron-H (transformers 5's layers_block_type; tests/test_family_nemotron_h.py writes the release
    # hybrid_override_pattern): Mamba2 (2 groups), MLP, attention (head_dim 24, not hidden/heads) layers; the
    # MoE variant overrides the schedule. Embedding rows a multiple of 8 (pass extra_vocab=7 with gpt-2's BPE).
    "NemotronHForCausalLM": dict(hidden_size=64, intermediate_size=96, layers_block_type=[
                                     "linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                     "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                 ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4,
                                 max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                                 routed_scaling_factor=2.5, tie_word_embeddings=False),
    "OPTForCausalLM": dict(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=2048, word_embed_proj_dim=64, do_layer_norm_before=True,
                           activation_function="relu", enable_bias=True, tie_word_embeddings=True),
}
_CLASSES = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "OPTForCausalLM": ("OPTConfig", "OPTForCausalLM"),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM"),
    "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("Phi3Config", "Phi3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
    "Olmo2ForCausalLM": ("Olmo2Config", "Olmo2ForCausalLM"),
    "SmolLM3ForCausalLM": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM"),
    "NemotronHForCausalLM": ("NemotronHConfig", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("FalconH1Config", "FalconH1ForCausalLM"),
}
#: Tokenizer per class (Llama defaults to SPM; vocab="bpe" picks a Llama-3 style BPE).
_VOCAB = {"LlamaForCausalLM": "spm", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen2",
          "GPTNeoXForCausalLM": "gpt-2", "OPTForCausalLM": "gpt-2", "QWenLMHeadModel": "tiktoken",
          "MistralForCausalLM": "spm", "MixtralForCausalLM": "spm",
          # llama.cpp's converter accepts only BPE tokenizers whose check hash it knows
          "Qwen2MoeForCausalLM": "real:gpt-2", "Qwen3MoeForCausalLM": "real:gpt-2",
          "Gemma2ForCausalLM": "spm-no-prefix", "Gemma3ForCausalLM": "spm-no-prefix", "Phi3ForCausalLM": "spm",
          "Gemma3ForConditionalGeneration": "spm-no-prefix", "Olmo2ForCausalLM": "real:gpt-2",
          # SmolLM3 ships Llama 3's BPE (llama.cpp's check hash "llama-bpe")
          "SmolLM3ForCausalLM": "real:llama-bpe",
          # Cohere's 256k BPE (llama.cpp's check hash "command-r")
          "Cohere2ForCausalLM": "command-r",
          # Nemotron-H's 131k BPE has no llama.cpp vocab file; GPT-2's (check hash "gpt-2") stands in
          "NemotronHForCausalLM": "real:gpt-2",
          # Falcon-H1's BPE (check hash "falcon-h1") splits as Llama 3's (llama-vocab.cpp: LLAMA3 pre-tokenizer);
          # llama.cpp ships no vocab file of it, so Llama 3's (check hash "llama-bpe") stands in
          "FalconH1ForCausalLM": "real:llama-bpe"}
SUPPORTED = (*_CLASSES, "QWenLMHeadModel")


def _write_tokenizer(dir: Path, kind: str) -> int:
    """Tokenizer files of ``kind``; returns the number of tokens."""
    if kind == "llama-hf":
        # a Llama-2 style tokenizer saved by transformers as tokenizer.json only (no tokenizer.model)
        import transformers

        ft.make_spm_tokenizer(dir, 320)
        tok = transformers.AutoTokenizer.from_pretrained(dir)
        (dir / "tokenizer.model").unlink()
        tok.save_pretrained(dir)
        return 320
    if kind in ("spm", "spm-no-prefix"):
        ft.make_spm_tokenizer(dir, 320, dummy_prefix=kind == "spm")
        return 320
    if kind == "command-r":
        for name, data in _command_r_tokenizer_files().items():
            (dir / name).write_bytes(data)
        return 256000
    if kind.startswith("real:"):
        # a real model's tokenizer rebuilt from llama.cpp's vocab file (a check hash llama.cpp knows)
        from llama_cpp_sources import llama_cpp_dir

        flavor = kind.removeprefix("real:")
        ft.rebuild_bpe_tokenizer(llama_cpp_dir() / "models" / f"ggml-vocab-{flavor}.gguf", dir, flavor)
        data = json.loads((dir / "tokenizer.json").read_text(encoding="utf-8"))
        ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
        return max(ids) + 1
    if kind == "tiktoken":
        ft.make_tiktoken_vocab(dir, 400)
        return 400 + len(ft.QWEN1_SPECIALS)
    ft.make_bpe_tokenizer(dir, 400, flavor=kind)
    return 400


def randomize(model: Any, seed: int, std: float = 0.15) -> None:
    """Overwrite every parameter from an explicit generator: matrices N(0, std), norms 1 + N(0, 0.1),
    biases N(0, 0.05)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name or "ln" in name.split(".")[-2]:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def build_model(hf_class: str, vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    """A randomized transformers model of ``hf_class`` (float32, eval mode)."""
    import transformers

    config_name, model_name = _CLASSES[hf_class]
    cfg = {**_BASE[hf_class], "vocab_size": vocab_size, **overrides}
    if "text_config" in cfg:  # a multimodal class: the text model's fields live in text_config
        cfg["text_config"] = {**cfg["text_config"], "vocab_size": cfg.pop("vocab_size")}
    config = getattr(transformers, config_name)(**cfg)
    config.architectures = [hf_class]
    model = getattr(transformers, model_name)(config)
    randomize(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def make_checkpoint(dir: Path, hf_class: str, **overrides: Any) -> Path:
    """Build a tiny random checkpoint of ``hf_class`` in ``dir`` (safetensors, config.json, tokenizer).

    Overrides (besides any config field): ``vocab`` (tokenizer kind: ``spm``, ``llama-bpe``, ``qwen2``,
    ``gpt-2``), ``dtype`` (``float32``, ``float16``, ``bfloat16``: the stored dtype), ``seed``,
    ``extra_vocab`` (embedding rows beyond the tokenizer, padded with fillers), ``config_style``
    (``"v4"`` rewrites config.json with transformers-4 key names), ``bin`` (save ``pytorch_model.bin``).

    Returns:
        ``dir``.
    """
    import torch

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    vocab = overrides.pop("vocab", _VOCAB[hf_class])
    dtype = overrides.pop("dtype", "float32")
    seed = overrides.pop("seed", 0)
    extra_vocab = overrides.pop("extra_vocab", 0)
    config_style = overrides.pop("config_style", None)
    as_bin = overrides.pop("bin", False)
    n_tokens = _write_tokenizer(dir, vocab)
    if hf_class == "QWenLMHeadModel":
        _make_qwen1(dir, n_tokens + extra_vocab, seed, dtype, **overrides)
        return dir
    model = build_model(hf_class, n_tokens + extra_vocab, seed, **overrides)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(dir, safe_serialization=not as_bin)
    if as_bin and not (dir / "pytorch_model.bin").exists():
        torch.save(model.state_dict(), dir / "pytorch_model.bin")
        for p in dir.glob("*.safetensors"):
            p.unlink()
    if config_style == "v4":
        _to_v4_config(dir / "config.json")
    elif config_style == "release":
        _to_release_config(dir / "config.json")
    return dir


def _to_v4_config(path: Path) -> None:
    """transformers-4 spelling: rope_theta / rotary_pct / rotary_emb_base at the root, no rope_parameters."""
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters", None) or {}
    config.pop("partial_rotary_factor", None)
    if config.get("model_type") == "gpt_neox":
        config["rotary_pct"] = params.get("partial_rotary_factor", 0.25)
        config["rotary_emb_base"] = params.get("rope_theta", 10000)
    elif "rope_theta" in params:
        config["rope_theta"] = params["rope_theta"]
    path.write_text(json.dumps(config, indent=2))


# -- Cohere 2 ----------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _command_r_tokenizer_files() -> dict[str, bytes]:
    """Cohere's tokenizer (Command R / R7B / A: 256000 tokens) rebuilt from llama.cpp's
    ``models/ggml-vocab-command-r.gguf`` as the hub's tokenizer.json has it: NFC, single digits, GPT-2's
    byte-level regex, ``<BOS_TOKEN>`` added by a TemplateProcessing post-processor (so its check hash is the
    one llama.cpp's table lists for "command-r"). Built once per process (about 20 s)."""
    import tempfile

    from llama_cpp_sources import llama_cpp_dir
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ft.rebuild_bpe_tokenizer(llama_cpp_dir() / "models" / "ggml-vocab-command-r.gguf", d, "gpt-2")
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
        bos = "<BOS_TOKEN>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
        tok.save(str(d / "tokenizer.json"))
        config = {"tokenizer_class": "CohereTokenizer", "add_bos_token": True, "add_eos_token": False,
                  "bos_token": bos, "eos_token": "<|END_OF_TURN_TOKEN|>", "pad_token": "<PAD>",
                  "clean_up_tokenization_spaces": False, "model_max_length": 2048}
        return {"tokenizer.json": (d / "tokenizer.json").read_bytes(),
                "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def _to_release_config(path: Path) -> None:
    """The released config.json's spelling of a transformers-5 save (Cohere 2: CohereLabs/c4ai-command-r7b-12-2024
    and command-a-03-2025 write rope_theta, rotary_pct and sliding_window_pattern, plus keys transformers does not
    read; no layer_types, no rope_parameters)."""
    config = json.loads(path.read_text())
    if config.get("model_type") != "cohere2":
        raise ValueError(f"no release layout for {config.get('model_type')!r}")
    params = config.pop("rope_parameters", None) or {}
    types = config.pop("layer_types")
    dtype = config.pop("dtype", "bfloat16")
    period = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    config.update(rope_theta=params.get("rope_theta", 10000.0), rope_scaling=None, rotary_pct=1.0,
                  sliding_window_pattern=period, layer_switch=period, order_of_interleaved_layers="local_attn_first",
                  position_embedding_type="rope_gptj", use_embedding_sharing=config.get("tie_word_embeddings", True),
                  use_gated_activation=True, cache_implementation="hybrid", torch_dtype=dtype,
                  transformers_version="4.48.0.dev0")
    path.write_text(json.dumps(config, indent=2))


# -- Qwen 1 ------------------------------------------------------------------------------------------
# transformers has no Qwen 1 class (its code lives in the model repos). Qwen 1 is Qwen2 without GQA and
# with a fused [Q;K;V] c_attn, so the checkpoint is a Qwen2 model's weights under Qwen 1's names, and that
# Qwen2 model is the oracle (:func:`qwen1_reference`).
_QWEN1_NAMES = {
    "model.embed_tokens.weight": "transformer.wte.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}
_QWEN1_LAYER = {
    "input_layernorm.weight": "ln_1.weight",
    "post_attention_layernorm.weight": "ln_2.weight",
    "self_attn.o_proj.weight": "attn.c_proj.weight",
    "mlp.up_proj.weight": "mlp.w1.weight",
    "mlp.gate_proj.weight": "mlp.w2.weight",
    "mlp.down_proj.weight": "mlp.c_proj.weight",
}


def _qwen1_config(vocab_size: int) -> dict[str, Any]:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                tie_word_embeddings=False, vocab_size=vocab_size)


def _make_qwen1(dir: Path, vocab_size: int, seed: int, dtype: str, **overrides: Any) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = {**_qwen1_config(vocab_size), **overrides}
    model = build_model("Qwen2ForCausalLM", vocab_size, seed, **{k: v for k, v in cfg.items() if k != "vocab_size"})
    sd = model.state_dict()
    out: dict[str, Any] = {}
    for hf, q1 in _QWEN1_NAMES.items():
        out[q1] = sd[hf]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, q1 in _QWEN1_LAYER.items():
            out[f"transformer.h.{i}.{q1}"] = sd[p + hf]
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([sd[p + f"self_attn.{x}_proj.weight"]
                                                                  for x in "qkv"])
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
    out = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in out.items()}
    save_file(out, str(dir / "model.safetensors"), metadata={"format": "pt"})
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    (dir / "config.json").write_text(json.dumps({
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen", "auto_map": {},
        "hidden_size": h, "intermediate_size": 2 * cfg["intermediate_size"], "num_attention_heads": heads,
        "num_hidden_layers": cfg["num_hidden_layers"], "kv_channels": h // heads,
        "layer_norm_epsilon": cfg["rms_norm_eps"], "max_position_embeddings": cfg["max_position_embeddings"],
        "seq_length": cfg["max_position_embeddings"], "rotary_emb_base": cfg["rope_theta"], "rotary_pct": 1.0,
        "no_bias": True, "use_dynamic_ntk": False, "use_logn_attn": False, "vocab_size": vocab_size,
        "tie_word_embeddings": False,
    }, indent=2))


def qwen1_reference(dir: Path) -> Any:
    """The Qwen2 transformers model equivalent to a Qwen 1 checkpoint made by :func:`make_checkpoint`."""
    import torch
    import transformers
    from safetensors.torch import load_file

    q1 = json.loads((Path(dir) / "config.json").read_text())
    sd = load_file(str(Path(dir) / "model.safetensors"))
    cfg = _qwen1_config(q1["vocab_size"])
    config = transformers.Qwen2Config(**cfg)
    model = transformers.Qwen2ForCausalLM(config)
    out = {hf: sd[q1n] for hf, q1n in _QWEN1_NAMES.items()}
    h = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        p, t = f"model.layers.{i}.", f"transformer.h.{i}."
        for hf, q1n in _QWEN1_LAYER.items():
            out[p + hf] = sd[t + q1n]
        for j, x in enumerate("qkv"):
            out[p + f"self_attn.{x}_proj.weight"] = sd[t + "attn.c_attn.weight"][j * h:(j + 1) * h]
            out[p + f"self_attn.{x}_proj.bias"] = sd[t + "attn.c_attn.bias"][j * h:(j + 1) * h]
    model.load_state_dict({k: v.to(torch.float32) for k, v in out.items()})
    return model.eval()


def reference_model(dir: Path) -> Any:
    """transformers' model for a checkpoint made here, in float32 (the logits oracle)."""
    import torch
    import transformers

    config = json.loads((Path(dir) / "config.json").read_text())
    if config["architectures"][0] == "QWenLMHeadModel":
        return qwen1_reference(dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)
    return model.eval()


# -- PowerInfer predictors ---------------------------------------------------------------------------
def make_predictor(dir: Path, *, n_layer: int, n_embd: int, n_ff: int, rank: int = 32, seed: int = 1,
                   threshold: float | None = 0.0, extra_keys: bool = False) -> Path:
    """A PowerInfer predictor directory: ``model_N.pt`` (state dicts with fc1.weight [rank, n_embd] and
    fc2.weight [n_ff, rank], saved with torch.save) and ``config.json`` with ``sparse_threshold``."""
    import torch

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(n_layer):
        state = {"fc1.weight": torch.randn(rank, n_embd, generator=g) * 0.1,
                 "fc2.weight": torch.randn(n_ff, rank, generator=g) * 0.1}
        if extra_keys:
            state["fc1.bias"] = torch.zeros(rank)
        torch.save(state, dir / f"model_{i}.pt")
    if threshold is not None:
        (dir / "config.json").write_text(json.dumps({"sparse_threshold": threshold}))
    return dir


# -- logits oracles ----------------------------------------------------------------------------------
#: Token ids used for logits comparisons (all below every fixture's vocabulary size).
TOKENS = [1, 5, 77, 200, 13, 250, 3, 99, 150, 42, 7, 300, 64, 128, 11, 290]


def transformers_logits(dir: Path, tokens: list[int] = TOKENS) -> Any:
    """float32 logits [T, n_vocab] of transformers' model for the checkpoint in ``dir``."""
    import torch

    model = reference_model(dir)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def llama_cpp_logits(gguf: Path, tokens: list[int] = TOKENS) -> Any:
    """float32 logits [T, n_vocab] of llama.cpp (llama-cpp-python) for a GGUF file; f32 KV cache so an f32
    model is compared at f32 precision."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, verbose=False,
                          type_k=0, type_v=0)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)
    finally:
        llm.close()
