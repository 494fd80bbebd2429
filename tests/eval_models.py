"""Tiny random transformers models written as GGUF files, for the evaluator's tests and benchmark.

Each builder makes a real transformers model class (seeded), then writes its weights with ggufkit's writer
under llama.cpp's names and layouts (reference/convert.md §2: the LLaMA Q/K row permutation, GPT-NeoX's
[Q|K|V] reordering, Qwen 1's fused QKV; reference/powerinfer.md §3: OPT and ReLU-LLaMA in PowerInfer's layout
with ``ffn_down_t`` and the PWRI magic). The vocabulary is a synthetic SPM one (``<unk> <s> </s>``, the 256
byte tokens, then filler pieces) that llama.cpp loads; tests score token ids directly.

For quantized files, :func:`write_model_gguf` quantizes each 2-D weight with ggml's own quantizer in the
transformers layout, writes those bytes (the GGUF transforms only move whole rows, and quantization works row
by row) and puts their exact dequantization back into the transformers model, which is then the oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

from ggufkit.constants import GGUF_MAGIC, POWERINFER_MAGIC
from ggufkit.format import Metadata, TensorSpec, write_gguf

N_VOCAB = 320


def vocab_metadata(meta: Metadata, n_vocab: int = N_VOCAB) -> None:
    """A synthetic SPM vocabulary of ``n_vocab`` tokens (BOS 1 added, as LLaMA's)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    meta.set("tokenizer.ggml.model", VT.STRING, "llama")
    meta.set("tokenizer.ggml.tokens", VT.ARRAY, tokens, item_type=VT.STRING)
    meta.set("tokenizer.ggml.scores", VT.ARRAY, [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)],
             item_type=VT.FLOAT32)
    meta.set("tokenizer.ggml.token_type", VT.ARRAY, types, item_type=VT.INT32)
    meta.set("tokenizer.ggml.bos_token_id", VT.UINT32, 1)
    meta.set("tokenizer.ggml.eos_token_id", VT.UINT32, 2)
    meta.set("tokenizer.ggml.unknown_token_id", VT.UINT32, 0)
    meta.set("tokenizer.ggml.add_bos_token", VT.BOOL, True)
    meta.set("tokenizer.ggml.add_eos_token", VT.BOOL, False)


#: HF class and config per test architecture (tiny, but every feature of the family on).
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                       rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen2": ("Qwen2ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                       rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen 1 (remote code upstream) is Qwen2's math with a fused [Q;K;V] and no o_proj bias.
    "qwen": ("Qwen2ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
                                      rope_theta=10000.0, tie_word_embeddings=False)),
    "gptneox": ("GPTNeoXForCausalLM", dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                           num_attention_heads=4, rotary_pct=0.25, layer_norm_eps=1e-5,
                                           use_parallel_residual=True, tie_word_embeddings=False)),
    "gptneox_seq": ("GPTNeoXForCausalLM", dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                               num_attention_heads=4, rotary_pct=0.5, layer_norm_eps=1e-5,
                                               use_parallel_residual=False, tie_word_embeddings=False)),
    "opt": ("OPTForCausalLM", dict(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=256, word_embed_proj_dim=64,
                                   do_layer_norm_before=True, enable_bias=True)),
    "powerinfer_llama": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=4,
                                                  hidden_act="relu", rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # PowerInfer's Bamboo (arch ``bamboo``): the ReLU-LLaMA layout, its FFN relu(gate) * relu(up), and no epsilon
    # key (the evaluator's default 1e-5). transformers has no Bamboo class: this LLaMA computes relu(gate) * up,
    # so an oracle must apply the second ReLU itself (tests/test_eval_imatrix_archs.py).
    "bamboo": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, hidden_act="relu",
                                        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def make_hf_model(arch: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A seeded tiny transformers model of the class ``CONFIGS[arch]`` names (float32, eval mode)."""
    import transformers

    cls_name, kwargs = CONFIGS[arch]
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    config = config_cls(**{"vocab_size": N_VOCAB, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).float().eval()
    # Random init draws most weights ~N(0, 0.02), which makes every model near-uniform; widen the spread
    # (and randomise norms and biases) so that logits differ and differences in the runtime would show.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp NORM-RoPE rows (reference/convert.md §2.2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: torch.nn.Module, arch: str,
                 sd: dict[str, np.ndarray] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, array) pairs in llama.cpp's layout for ``arch``.

    ``sd`` replaces the model's state dict; its 2-D arrays may be quantized rows (``uint8[rows, row_bytes]``),
    which every transform here handles because they only move, stack or split whole rows.
    """
    cfg = model.config
    if sd is None:
        sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    n = cfg.num_hidden_layers
    if arch in ("llama", "qwen2", "qwen3", "qwen", "powerinfer_llama", "bamboo"):
        yield "token_embd.weight", sd["model.embed_tokens.weight"]
        yield "output_norm.weight", sd["model.norm.weight"]
        if not cfg.tie_word_embeddings:
            yield "output.weight", sd["lm_head.weight"]
        for i in range(n):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            q, k, v = (sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
            if arch in ("llama", "powerinfer_llama", "bamboo"):
                q, k = _permute(q, cfg.num_attention_heads), _permute(k, cfg.num_key_value_heads)
            yield b + "attn_norm.weight", sd[p + "input_layernorm.weight"]
            if arch == "qwen":
                yield b + "attn_qkv.weight", np.concatenate([q, k, v])
                yield b + "attn_qkv.bias", np.concatenate([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
            else:
                yield b + "attn_q.weight", q
                yield b + "attn_k.weight", k
                yield b + "attn_v.weight", v
                if p + "self_attn.q_proj.bias" in sd:
                    for x in "qkv":
                        yield b + f"attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"]
            if arch == "qwen3":
                yield b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]
                yield b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"]
            yield b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]
            yield b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]
            yield b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]
            yield b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"]
            if arch in ("powerinfer_llama", "bamboo"):
                down = sd[p + "mlp.down_proj.weight"]
                yield b + "ffn_down_t.weight", np.ascontiguousarray(down.T)
                rng = np.random.default_rng(i)  # a predictor, which scoring must ignore
                yield b + "fc1.weight", rng.standard_normal((16, cfg.hidden_size)).astype(np.float32)
                yield b + "fc2.weight", rng.standard_normal((cfg.intermediate_size, 16)).astype(np.float32)
            else:
                yield b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"]
    elif arch.startswith("gptneox"):
        yield "token_embd.weight", sd["gpt_neox.embed_in.weight"]
        yield "output_norm.weight", sd["gpt_neox.final_layer_norm.weight"]
        yield "output_norm.bias", sd["gpt_neox.final_layer_norm.bias"]
        yield "output.weight", sd["embed_out.weight" if "embed_out.weight" in sd else "lm_head.weight"]
        h, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        for i in range(n):
            p, b = f"gpt_neox.layers.{i}.", f"blk.{i}."
            w = sd[p + "attention.query_key_value.weight"].reshape(h, 3, hd, -1)
            bias = sd[p + "attention.query_key_value.bias"].reshape(h, 3, hd)
            for suffix, x in (("weight", p + "input_layernorm.weight"), ("bias", p + "input_layernorm.bias")):
                yield b + f"attn_norm.{suffix}", sd[x]
            yield b + "attn_qkv.weight", np.concatenate([w[:, j].reshape(h * hd, -1) for j in range(3)])
            yield b + "attn_qkv.bias", np.concatenate([bias[:, j].reshape(-1) for j in range(3)])
            for suffix in ("weight", "bias"):
                yield b + f"attn_output.{suffix}", sd[p + f"attention.dense.{suffix}"]
                yield b + f"ffn_norm.{suffix}", sd[p + f"post_attention_layernorm.{suffix}"]
                yield b + f"ffn_up.{suffix}", sd[p + f"mlp.dense_h_to_4h.{suffix}"]
                yield b + f"ffn_down.{suffix}", sd[p + f"mlp.dense_4h_to_h.{suffix}"]
    elif arch == "opt":
        d = "model.decoder."
        yield "token_embd.weight", sd[d + "embed_tokens.weight"]
        yield "position_embd.weight", sd[d + "embed_positions.weight"]
        yield "output_norm.weight", sd[d + "final_layer_norm.weight"]
        yield "output_norm.bias", sd[d + "final_layer_norm.bias"]
        for i in range(n):
            p, b = f"{d}layers.{i}.", f"blk.{i}."
            for suffix in ("weight", "bias"):
                yield b + f"attn_norm.{suffix}", sd[p + f"self_attn_layer_norm.{suffix}"]
                for x in "qkv":
                    yield b + f"attn_{x}.{suffix}", sd[p + f"self_attn.{x}_proj.{suffix}"]
                yield b + f"attn_output.{suffix}", sd[p + f"self_attn.out_proj.{suffix}"]
                yield b + f"ffn_norm.{suffix}", sd[p + f"final_layer_norm.{suffix}"]
                yield b + f"ffn_up.{suffix}", sd[p + f"fc1.{suffix}"]
            yield b + "ffn_down_t.weight", np.ascontiguousarray(sd[p + "fc2.weight"].T)
            yield b + "ffn_down_t.bias", sd[p + "fc2.bias"]
    else:
        raise ValueError(arch)


def _metadata(model: torch.nn.Module, arch: str) -> Metadata:
    cfg = model.config
    gguf_arch = {"powerinfer_llama": "llama", "gptneox_seq": "gptneox"}.get(arch, arch)
    a = gguf_arch
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, a)
    meta.set("general.name", VT.STRING, f"tiny-{arch}")
    meta.set(f"{a}.block_count", VT.UINT32, cfg.num_hidden_layers)
    meta.set(f"{a}.context_length", VT.UINT32, 2050 if a == "opt" else 2048)
    meta.set(f"{a}.embedding_length", VT.UINT32, cfg.hidden_size)
    # Qwen 1 writes twice the FFN width (its w1/w2 are each half of it; reference/convert.md §1.4).
    n_ff = cfg.ffn_dim if a == "opt" else cfg.intermediate_size * (2 if a == "qwen" else 1)
    meta.set(f"{a}.feed_forward_length", VT.UINT32, n_ff)
    meta.set(f"{a}.attention.head_count", VT.UINT32, cfg.num_attention_heads)
    if a in ("llama", "qwen2", "qwen3"):
        meta.set(f"{a}.attention.head_count_kv", VT.UINT32, cfg.num_key_value_heads)
    if a in ("gptneox", "opt"):
        meta.set(f"{a}.attention.layer_norm_epsilon", VT.FLOAT32, getattr(cfg, "layer_norm_eps", 1e-5))
    elif a != "bamboo":  # PowerInfer's Bamboo files carry no epsilon key
        meta.set(f"{a}.attention.layer_norm_rms_epsilon", VT.FLOAT32, cfg.rms_norm_eps)
    if a != "opt":
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if a != "gptneox":
            meta.set(f"{a}.rope.freq_base", VT.FLOAT32, float(theta))
    if a == "qwen3":
        meta.set(f"{a}.attention.key_length", VT.UINT32, cfg.head_dim)
        meta.set(f"{a}.attention.value_length", VT.UINT32, cfg.head_dim)
    if a == "llama":
        meta.set(f"{a}.rope.dimension_count", VT.UINT32, cfg.hidden_size // cfg.num_attention_heads)
    if a == "gptneox":
        rope = getattr(cfg, "rope_parameters", None) or {}
        pct = rope.get("partial_rotary_factor", getattr(cfg, "rotary_pct", 1.0))
        meta.set(f"{a}.rope.dimension_count", VT.UINT32, int(pct * (cfg.hidden_size // cfg.num_attention_heads)))
        meta.set(f"{a}.use_parallel_residual", VT.BOOL, bool(cfg.use_parallel_residual))
    vocab_metadata(meta, cfg.vocab_size)
    return meta


def write_model_gguf(model: torch.nn.Module, arch: str, path: Path, qtype: Q = Q.F32) -> Path:
    """Write ``model`` as a GGUF (PWRI for the PowerInfer layouts); 2-D weights in ``qtype``, the rest F32.

    For another ``qtype`` than F32 the model's 2-D weights are first replaced, in place, by the exact
    dequantization (ggml's) of the bytes written, so the transformers model is what the file holds.
    Quantized files support only the layouts that move whole rows (not ``ffn_down_t``).
    """
    from ggml_oracle import ggml_dequantize, ggml_quantize

    block, size = GGML_QUANT_SIZES[qtype]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if qtype != Q.F32:
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in list(sd.items()):
                if v.ndim == 2:
                    raw = ggml_quantize(v, qtype)
                    sd[k] = raw
                    if k in params:
                        params[k].copy_(torch.from_numpy(ggml_dequantize(raw, qtype, v.shape)))
    specs, data = [], []
    for name, arr in gguf_tensors(model, arch, sd):
        if arr.dtype == np.uint8:
            specs.append(TensorSpec(name, qtype, (arr.shape[0], arr.shape[1] // size * block)))
        else:
            specs.append(TensorSpec(name, Q.F32, tuple(arr.shape)))
        data.append(np.ascontiguousarray(arr))
    magic = POWERINFER_MAGIC if arch in ("opt", "powerinfer_llama", "bamboo") else GGUF_MAGIC
    write_gguf(path, _metadata(model, arch), specs, data, magic=magic)
    return path
