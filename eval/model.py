"""A PyTorch runtime for GGUF causal language models, for scoring (no sampling, no KV cache).

Weights stay in their GGUF type on the device (raw bytes, ``uint8``) and are dequantized with
:mod:`ggufkit.eval.dequant` layer by layer while a batch passes through, so device memory is about the file
size plus one layer in float plus the activations. On the CPU the dequantized matrices are also kept between
forward passes, up to :attr:`GGUFCausalLM.float_cache_bytes` (by default a quarter of the RAM available at
load, ``GGUFKIT_EVAL_FLOAT_CACHE_MB`` to change it; 0 on a GPU): a small model is dequantized once, not once
per batch. A driver that knows how many passes it runs says so (:attr:`GGUFCausalLM.passes_left`), and the
last pass keeps nothing. Hyperparameters come from the GGUF keys alone.

Architectures and how they run (each matches transformers' model class and llama.cpp's graph):

* ``llama`` (Q/K rows permuted for NORM RoPE by the converter), ``qwen2`` (NEOX RoPE, q/k/v biases),
  ``qwen3`` (per-head RMS q/k norms), ``qwen`` (Qwen 1: fused [Q;K;V] with bias): RMSNorm, SiLU-gated FFN.
* ``olmo2``: post-norm blocks (RMSNorm of the attention's and the FFN's outputs, none before them), RMS q/k
  norms over the whole projections, NEOX RoPE, SiLU-gated FFN.
* ``gptneox``: LayerNorm, fused [Q|K|V], partial NEOX RoPE, parallel or sequential residual, GELU FFN.
* ``cohere2``: one LayerNorm without bias before attention and FFN in parallel, NORM RoPE on the
  sliding-window layers only, logits times the file's logit scale, LM head tied to ``token_embd``.
* ``opt`` (PowerInfer layout): learned positions read at ``pos + 2``, LayerNorm with biases, ReLU FFN with
  ``ffn_down_t`` (the down projection stored transposed), LM head tied to ``token_embd``.
* PowerInfer files (magic ``PWRI``, ``llama``/``bamboo``): the ReLU FFN PowerInfer's sparse graph computes
  (``relu(gate)*up``; bamboo ``relu(gate)*relu(up)``), run densely; the predictor tensors are ignored.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from ggufkit.errors import DeviceUnavailableError, EvaluationError
from ggufkit.eval.arch import SUPPORTED_ARCHS, HParams, expected_shapes, read_hparams
from ggufkit.eval.dequant import can_dequantize
from ggufkit.eval.families import FORWARDS
from ggufkit.eval.ggml_cpu import VEC_DOT_TYPE, q8_1_sum_correction, round_activations, round_f16
from ggufkit.eval.moe import moe_ffn
from ggufkit.eval.qtensor import QTensor
from ggufkit.eval.rope import yarn_theta
from ggufkit.format.reader import GGUFModel, TensorInfo
from ggufkit.format.shards import open_gguf
from ggufkit.format.tensor_shape import n_elements

__all__ = ["DTYPES", "SUPPORTED_ARCHS", "GGUFCausalLM", "HParams", "load_model", "read_hparams",
           "resolve_device", "resolve_dtype"]

#: ``--dtype`` choices and the torch type each computes matmuls in.
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
#: Output-projection rows dequantized at a time, so a 150k vocabulary never needs a whole float copy.
_VOCAB_CHUNK = 32768
#: Environment variable: MiB of dequantized weights a CPU model keeps between forward passes.
FLOAT_CACHE_ENV = "GGUFKIT_EVAL_FLOAT_CACHE_MB"
_EMB_OPT_POS_OFFSET = 2  # OPT's learned position table starts at row 2 (HF OPTLearnedPositionalEmbedding)


class ActivationObserver(Protocol):
    """What :attr:`GGUFCausalLM.observer` is called with during a forward pass."""

    def dense(self, names: tuple[str, ...], x: torch.Tensor) -> None:
        """``x`` float32 ``[B, T, n]`` is about to be multiplied by each weight in ``names``."""

    def routed(self, name: str, x: torch.Tensor, ids: torch.Tensor) -> None:
        """MoE: token t's slot j (input ``x[b, t, j or 0]``) goes to expert ``ids[b, t, j]`` of ``name``."""


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU raises DeviceUnavailableError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda was asked for, but PyTorch sees no CUDA device")
        return torch.device(device)
    if device == "cpu":
        return torch.device("cpu")
    raise EvaluationError(f"unknown device {device!r} (expected auto, cpu or cuda)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 everywhere, so GPU and CPU give the same numbers; f16/bf16 only on request."""
    if dtype == "auto":
        return torch.float32
    if dtype not in DTYPES:
        raise EvaluationError(f"unknown dtype {dtype!r} (expected auto, f32, f16 or bf16)")
    if device.type == "cpu" and dtype != "f32":
        raise EvaluationError(f"--dtype {dtype} needs a GPU; the CPU path computes in f32")
    return DTYPES[dtype]


class GGUFCausalLM:
    """A GGUF model ready to score token sequences.

    Use :func:`load_model` to build one. ``logits(tokens)`` returns float32 ``[B, T, n_vocab]``.

    Layer interface: what a layer kept in its own module (:mod:`ggufkit.eval.moe`) and a measurement that
    runs the blocks itself (:mod:`ggufkit.eval.target_calibration`) build on; ``p`` is a block's tensor-name
    prefix (``blk.{i}.``):

    * :meth:`weight` / :meth:`optional_weight`: a tensor of :attr:`tensors` dequantized (kept between passes
      in the float cache, tagged for ggml's input rounding);
    * :meth:`linear`: ``x @ w.T (+ b)``, the input rounded as ggml's CPU backend rounds it when
      :attr:`ggml_rounding` is on; :meth:`tag_src1` tags a matrix made outside :meth:`weight` (an expert's rows);
    * :meth:`norm`: the architecture's RMSNorm or LayerNorm;
    * :meth:`observe` / :meth:`observe_routed`: report a matmul's input to :attr:`observer`, if any;
    * :meth:`attention` / :meth:`feed_forward`: a block's self-attention and its dense or MoE FFN;
      :meth:`apply_rope`: the file's RoPE on ``[B, T, H, head_dim]``;
    * :meth:`block`: one transformer block on the residual stream ``[B, T, n_embd]``;
    * :meth:`embed` / :meth:`trunk_block` / :meth:`head`: :meth:`logits` in three steps (the state entering
      block 0, block ``i`` on the family's state, the logits from the last state), for a measurement that
      restarts from a stored state.

    An architecture whose blocks are not this transformer's (recurrent and hybrid families) has a
    :class:`ggufkit.eval.family_forward.FamilyForward` in :data:`ggufkit.eval.families.FORWARDS`: its ``block``
    replaces :meth:`block`, and its optional ``embed``/``finish`` hooks shape the stream between the embeddings
    and the output norm.
    """

    def __init__(self, path: Path, hparams: HParams, tensors: dict[str, QTensor], device: torch.device,
                 dtype: torch.dtype, model_sha256: str, file: GGUFModel) -> None:
        self.path = path
        self.hparams = hparams
        self.tensors = tensors
        self.device = device
        self.dtype = dtype
        self.model_sha256 = model_sha256
        self.file = file  # kept open: CPU tensors are zero-copy views of its mmap
        self._rope_cache: dict[tuple[int, float, float], tuple[torch.Tensor, torch.Tensor]] = {}
        #: Round each matmul's input as ggml's CPU backend does (:func:`load_model`'s ``ggml_rounding``).
        self.ggml_rounding = False
        #: Round K and V to F16 as llama.cpp's default K/V cache does (:func:`load_model`'s ``kv_f16``).
        self.kv_f16 = False
        #: Bytes of dequantized tensors kept between forward passes (load_model sets it on the CPU).
        self.float_cache_bytes = 0
        #: Forward passes (:meth:`logits` calls) still to come, this one included, when the caller knows (ppl and
        #: imatrix do); None: unknown. The float cache keeps tensors only while another pass follows; its
        #: accounting runs either way, so the head is split into the same chunks (the same figures).
        self.passes_left: int | None = None
        # name, row range, rounding -> (the QTensor it was made from, its dequantization or None when not kept
        # because no pass follows, its size in bytes)
        self._float_cache: dict[tuple[str, int, int, bool], tuple[QTensor, torch.Tensor | None, int]] = {}
        self._float_cached = 0
        #: Sees the input of every weight matmul (ggufkit.eval.imatrix collects importance matrices with
        #: it); None: no cost.
        self.observer: ActivationObserver | None = None

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    @property
    def float_cache_held(self) -> int:
        """Bytes of dequantized tensors the float cache holds now (what :attr:`float_cache_bytes` bounds)."""
        return sum(size for _, w, size in self._float_cache.values() if w is not None)

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def close(self) -> None:
        self.tensors = {}
        self._float_cache = {}
        self.file.close()

    def __enter__(self) -> GGUFCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building blocks (the public ones: the class docstring's layer interface) --------------------
    def optional_weight(self, name: str) -> torch.Tensor | None:
        """An optional tensor, dequantized: matrices in the compute dtype, vectors in float32."""
        t = self.tensors.get(name)
        if t is None:
            return None
        key = (name, 0, -1, self.ggml_rounding)
        w = self._kept(key, t)
        if w is None:
            # Norm weights and biases stay float32 (they are added in the float32 residual stream).
            w = t.float(torch.float32) if len(t.shape) == 1 else self.tag_src1(t.float(self.dtype), t)
            self._keep(key, t, w)
        return w

    def _row_range(self, t: QTensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of matrix ``t`` in the compute dtype, tagged as :meth:`tag_src1` tags them."""
        key = (t.name, start, stop, self.ggml_rounding)
        w = self._kept(key, t)
        if w is None:
            w = self.tag_src1(t.row_range(start, stop, self.dtype), t, start, stop)
            self._keep(key, t, w)
        return w

    def _kept(self, key: tuple[str, int, int, bool], t: QTensor) -> torch.Tensor | None:
        """The kept dequantization of ``t`` under ``key``; None when none, or when it was made from another
        tensor of that name (a caller swapped ``tensors[name]``, e.g. to measure a quantized probe)."""
        hit = self._float_cache.get(key)
        return hit[1] if hit is not None and hit[0] is t else None

    def _keep(self, key: tuple[str, int, int, bool], t: QTensor, w: torch.Tensor) -> None:
        """Keep a dequantized tensor for the next forward passes while :attr:`float_cache_bytes` allows; on
        the last pass (:attr:`passes_left`) only its bytes are counted, as if kept. (Callers never modify what
        :meth:`optional_weight` returns, so a kept tensor stays the exact dequantization.)"""
        size = w.numel() * w.element_size()
        old = self._float_cache.pop(key, None)
        if old is not None:
            self._float_cached -= old[2]
        if self._float_cached + size <= self.float_cache_bytes:
            follows = self.passes_left is None or self.passes_left > 1
            self._float_cache[key] = (t, w if follows else None, size)
            self._float_cached += size

    def _fits_cache(self, t: QTensor) -> bool:
        """Whether all of ``t``, dequantized, still fits in the float cache (or is already in it)."""
        hit = self._float_cache.get((t.name, 0, t.shape[0], self.ggml_rounding))
        if hit is not None and hit[0] is t:
            return True
        size = n_elements(t.shape) * torch.empty((), dtype=self.dtype).element_size()
        return self._float_cached + size <= self.float_cache_bytes

    def tag_src1(self, w: torch.Tensor, t: QTensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Mark ``w``, rows ``start:stop`` of ``t`` dequantized, so that :meth:`linear` rounds its input
        through the type ggml's CPU backend converts it to (:data:`ggufkit.eval.ggml_cpu.VEC_DOT_TYPE`;
        only with ``ggml_rounding``, else ``w`` as it is)."""
        vec_dot = VEC_DOT_TYPE.get(t.qtype) if self.ggml_rounding else None
        if vec_dot is not None:
            w.ggml_src1 = vec_dot  # type: ignore[attr-defined]
            if t.qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1):
                w.ggml_mins = t.block_mins(start, stop)  # type: ignore[attr-defined]
        return w

    def weight(self, name: str) -> torch.Tensor:
        """A required tensor (load_model checked that it exists), dequantized like :meth:`optional_weight`."""
        w = self.optional_weight(name)
        if w is None:
            raise EvaluationError(f"missing tensor {name!r}", path=self.path)
        return w

    def norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The architecture's norm of ``x`` with weight ``w`` (and bias ``b``, LayerNorm only)."""
        hp = self.hparams
        if hp.norm == "layer":
            return F.layer_norm(x, (x.shape[-1],), w, b, hp.eps)
        return _rms_norm(x, w, hp.eps)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               src1: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """``x @ w.T (+ b)``; with ``ggml_rounding``, ``x`` as ggml's CPU backend converts it (``src1``: that
        conversion already made by :meth:`_src1` for the same ``x`` and weight tensor)."""
        vec_dot = getattr(w, "ggml_src1", None)
        if vec_dot is None:
            y = _mm(x.to(w.dtype), w).to(torch.float32)
        else:
            rounded, correction = src1 if src1 is not None else self._src1(x, w)
            y = _mm(rounded.to(w.dtype), w).to(torch.float32)
            mins = getattr(w, "ggml_mins", None)
            if mins is not None and correction is not None:
                y = y + _mm(correction, mins)  # Q4_1/Q5_1 x Q8_1: the minimum's term uses Q8_1's F16 block sum
        return y if b is None else y + b

    @staticmethod
    def _src1(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` rounded through tagged weight ``w``'s vec_dot_type, and Q8_1's block-sum correction where
        ``w`` is Q4_1/Q5_1."""
        rounded = round_activations(x, w.ggml_src1)  # type: ignore[attr-defined]
        return rounded, q8_1_sum_correction(x) if getattr(w, "ggml_mins", None) is not None else None

    def observe(self, x: torch.Tensor, *names: str) -> None:
        """Report ``x`` (float32 ``[B, T, n]``), the input of the matmuls with the weights ``names``."""
        if self.observer is not None:
            self.observer.dense(names, x)

    def observe_routed(self, name: str, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Report an expert matmul: input ``[B, T, k or 1, n]``, chosen experts ``ids`` ``[B, T, k]``."""
        if self.observer is not None:
            self.observer.routed(name, x, ids)

    def _rope(self, t: int, base: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[t, n_rot]`` in transformers' rotate-half layout, the first half of sin negated
        (rotate-half's sign: ``-a * s`` and ``a * -s`` are the same float): computed as transformers does, or as
        ggml's rope_yarn when the file has YaRN scaling (:func:`ggufkit.eval.rope.yarn_theta`, frequency scale
        ``1 / scale``)."""
        cached = self._rope_cache.get((t, base, scale))
        if cached is not None:
            return cached
        hp = self.hparams
        factors = self.tensors.get("rope_freqs.weight")
        if hp.yarn is not None:
            theta, mscale = yarn_theta(hp.yarn, t, hp.n_rot, base, 1.0 / scale,
                                       factors.float() if factors is not None else None)
            emb = torch.cat([theta, theta], dim=-1)
            cos, sin = emb.cos() * mscale, emb.sin() * mscale
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, hp.n_rot, 2, dtype=torch.int64).float() / hp.n_rot))
            if factors is not None:  # llama3 long-context correction: theta_i / factor_i (llama.cpp rope_freqs)
                inv_freq = inv_freq / factors.float().cpu()
            if scale != 1.0:
                inv_freq = inv_freq / scale
            freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
        sin[:, : hp.n_rot // 2].neg_()
        result = (cos.to(self.device), sin.to(self.device))
        self._rope_cache[(t, base, scale)] = result
        return result

    def apply_rope(self, x: torch.Tensor, base: float, scale: float) -> torch.Tensor:
        """x: [B, T, H, hd] float32."""
        hp = self.hparams
        if hp.rope_mode == "none":
            return x
        # NORM-mode files had their Q/K rows put back in rotate-half order at load (_to_rotate_half), so
        # one rotate-half path serves both modes.
        n = hp.n_rot
        rot, rest = x[..., :n], x[..., n:]
        cos, sin = self._rope(x.shape[1], base, scale)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        half = torch.cat([rot[..., n // 2:], rot[..., : n // 2]], dim=-1)
        rot = (rot * cos).add_(half.mul_(sin))  # rot * cos + rotate_half(rot) * sin
        return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot

    def attention(self, h: torch.Tensor, p: str) -> torch.Tensor:
        """Block ``p``'s self-attention on the normed stream ``h`` ``[B, T, n_embd]``, output projection included."""
        hp = self.hparams
        bsz, t, _ = h.shape
        hd = hp.head_dim
        nq, nkv = hp.n_head * hd, hp.n_head_kv * hd
        qkv_w = self.optional_weight(p + "attn_qkv.weight")
        if qkv_w is not None:
            self.observe(h, p + "attn_qkv.weight")
            qkv = self.linear(h, qkv_w, self.optional_weight(p + "attn_qkv.bias"))
            del qkv_w
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        else:
            self.observe(h, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
            q = self.linear(h, self.weight(p + "attn_q.weight"), self.optional_weight(p + "attn_q.bias"))
            k = self.linear(h, self.weight(p + "attn_k.weight"), self.optional_weight(p + "attn_k.bias"))
            v = self.linear(h, self.weight(p + "attn_v.weight"), self.optional_weight(p + "attn_v.bias"))
        q_norm = self.optional_weight(p + "attn_q_norm.weight")
        if q_norm is not None and hp.qk_norm_whole:  # olmo2: RMSNorm of the whole q and k, before the heads
            q = _rms_norm(q, q_norm, hp.eps)
            k = _rms_norm(k, self.weight(p + "attn_k_norm.weight"), hp.eps)
        q = q.reshape(bsz, t, hp.n_head, hd)
        k = k.reshape(bsz, t, hp.n_head_kv, hd)
        v = v.reshape(bsz, t, hp.n_head_kv, hd)
        if q_norm is not None and not hp.qk_norm_whole:  # qwen3: RMSNorm of each head before RoPE
            q = _rms_norm(q, q_norm, hp.eps)
            k = _rms_norm(k, self.weight(p + "attn_k_norm.weight"), hp.eps)
        il = int(p.split(".")[1])
        swa = hp.is_swa(il)
        base, rscale = (hp.rope_base_swa, hp.rope_scale_swa) if swa else (hp.rope_base, hp.rope_scale)
        if hp.uses_rope(il):
            q, k = self.apply_rope(q, base, rscale), self.apply_rope(k, base, rscale)
        if self.kv_f16:  # llama.cpp's F16 K/V cache, read by its flash attention in float32
            k, v = round_f16(k), round_f16(v)
        q, k, v = (z.transpose(1, 2).to(self.dtype) for z in (q, k, v))  # [B, H, T, hd]
        gqa = hp.n_head_kv != hp.n_head
        scale = hp.attn_scale or 1.0 / math.sqrt(hd)
        if hp.attn_softcap or swa:
            o = _capped_attention(q, k, v, scale, hp.attn_softcap, hp.n_swa if swa else 0)
        else:
            if gqa and self.device.type != "cpu":
                # CUDA's memory-efficient float32 kernel has no GQA mode: share the KV heads explicitly there
                # (the CPU kernels support it and skip the copies; both give the same values).
                rep = hp.n_head // hp.n_head_kv
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
                gqa = False
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        # One output projection for every attention path (soft-capped, sliding-window or plain), its input
        # always reported: llama.cpp's build_attn (src/llama-graph.cpp) ends every path in
        # build_lora_mm(wo, cur), whose src1 llama-imatrix collects (tools/imatrix/imatrix.cpp collect_imatrix).
        o = o.transpose(1, 2).reshape(bsz, t, hp.n_head * hd)
        self.observe(o, p + "attn_output.weight")
        return self.linear(o, self.weight(p + "attn_output.weight"), self.optional_weight(p + "attn_output.bias"))

    def _ffn(self, h: torch.Tensor, p: str) -> torch.Tensor:
        hp = self.hparams
        self.observe(h, p + "ffn_up.weight", p + "ffn_gate.weight")
        up = self.linear(h, self.weight(p + "ffn_up.weight"), self.optional_weight(p + "ffn_up.bias"))
        gate_w = self.optional_weight(p + "ffn_gate.weight")
        if hp.ffn == "gelu":
            a = F.gelu(up)  # exact erf GELU, transformers' "gelu" (GPT-NeoX's default hidden_act)
        elif hp.ffn == "silu_fused":  # Phi-3: [gate; up] in one matrix
            g, u = up.chunk(2, dim=-1)
            a = F.silu(g) * u
        elif gate_w is None:
            a = F.relu(up)
        else:
            g = self.linear(h, gate_w)
            if hp.ffn == "silu":
                a = F.silu(g, inplace=True).mul_(up)  # g is this call's own tensor
            elif hp.ffn == "gelu_tanh":
                a = F.gelu(g, approximate="tanh") * up
            elif hp.ffn == "relu":
                a = F.relu(g) * up
            else:
                a = F.relu(g) * F.relu(up)
        del up, gate_w
        down_t = self.tensors.get(p + "ffn_down_t.weight")
        if down_t is not None:
            # ffn_down_t stores the down projection transposed ([n_ff, n_embd] in numpy order).
            w = down_t.float(self.dtype)
            y = torch.matmul(a.to(w.dtype), w).to(torch.float32)
            b = self.optional_weight(p + "ffn_down_t.bias")
            b = b if b is not None else self.optional_weight(p + "ffn_down.bias")
            return y if b is None else y + b
        self.observe(a, p + "ffn_down.weight")
        return self.linear(a, self.weight(p + "ffn_down.weight"), self.optional_weight(p + "ffn_down.bias"))

    # -- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor, *, start: int = 0) -> torch.Tensor:
        """Run the model on a batch of sequences, each from position 0 with an empty context.

        Args:
            tokens: ``int64[B, T]`` token ids (any device).
            start: return logits only for positions ``start .. T-1`` (the scored half of a chunk), which
                saves the output projection of the other positions.

        Returns:
            ``float32[B, T - start, n_vocab]`` on the model's device.

        Raises:
            EvaluationError: a token id is outside the vocabulary.
        """
        state = self.embed(tokens)
        for i in range(self.hparams.n_trunk):
            state = self.trunk_block(state, i)
        out = self.head(state, start)
        if self.passes_left is not None:
            self.passes_left -= 1
        return out

    def embed(self, tokens: torch.Tensor) -> Any:
        """The stream state entering block 0 (:meth:`logits`' first step): the token embeddings (Gemma's
        ``sqrt(n_embd)`` scale, OPT's learned positions), turned into the family's state by its ``embed`` hook.

        Raises:
            EvaluationError: ``tokens`` is not ``[B, T]``, a token id is outside the vocabulary, or the
                context is longer than the learned positions.
        """
        hp = self.hparams
        if tokens.dim() != 2:
            raise EvaluationError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        tokens = tokens.to(self.device, torch.int64)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= hp.n_vocab):
            raise EvaluationError(f"token ids must be in 0..{hp.n_vocab - 1}")
        t = tokens.shape[1]
        x = self.tensors["token_embd.weight"].rows(tokens)
        if hp.embd_scale:  # Gemma: embeddings times sqrt(n_embd), as a float32 constant
            x = x * torch.tensor(math.sqrt(hp.n_embd), dtype=torch.float32)
        pos = self.tensors.get("position_embd.weight")
        if pos is not None:
            if t + _EMB_OPT_POS_OFFSET > pos.shape[0]:
                raise EvaluationError(f"context {t} is longer than the model's {pos.shape[0] - 2} positions")
            x = x + pos.rows(torch.arange(t, device=self.device) + _EMB_OPT_POS_OFFSET)[None]
        family = FORWARDS.get(hp.arch)
        return family.embed(self, tokens, x) if family is not None and family.embed else x

    def trunk_block(self, state: Any, i: int) -> Any:
        """Block ``i`` (below :attr:`HParams.n_trunk`) on the stream state: the family's block
        (:data:`ggufkit.eval.families.FORWARDS`), else :meth:`block`."""
        family = FORWARDS.get(self.hparams.arch)
        return self.block(state, f"blk.{i}.") if family is None else family.block(self, state, f"blk.{i}.")

    def head(self, state: Any, start: int = 0) -> torch.Tensor:
        """Logits ``float32[B, T - start, n_vocab]`` from the state after the last block (:meth:`logits`'
        last step): the family's ``finish``, the output norm, the LM head, the final soft-cap and logit scale."""
        hp = self.hparams
        family = FORWARDS.get(hp.arch)
        x = family.finish(self, state) if family is not None and family.finish else state
        x = x[:, start:]
        x = self.norm(x, self.weight("output_norm.weight"), self.optional_weight("output_norm.bias"))
        head = self.tensors.get("output.weight") if not hp.learned_positions else None
        if head is None:  # tied LM head
            head = self.tensors["token_embd.weight"]
        self.observe(x, head.name)
        parts = []
        src1 = None  # every chunk is a slice of one tensor: round the input once
        # A head kept whole in the float cache is one matmul (no concatenation of the logits).
        step = hp.n_vocab if self._fits_cache(head) else _VOCAB_CHUNK
        for a in range(0, hp.n_vocab, step):
            stop = min(a + step, hp.n_vocab)
            w = self._row_range(head, a, stop)
            if src1 is None and getattr(w, "ggml_src1", None) is not None:
                src1 = self._src1(x, w)
            parts.append(self.linear(x, w, src1=src1))
            del w
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if hp.final_softcap:
            out = torch.tanh(out / hp.final_softcap) * hp.final_softcap
        if hp.logit_scale:  # Cohere: ggml_scale(logits, f_logit_scale)
            out = out * hp.logit_scale
        return out

    def block(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Block ``p`` (``blk.{i}.``) on the residual stream ``x`` ``[B, T, n_embd]``: attention, then the
        dense or MoE feed-forward, with the architecture's norms and residual layout."""
        hp = self.hparams
        if hp.post_norm:  # OLMo 2 (src/models/olmo2.cpp): no pre-norms; each output normed, then added
            x = x + self.norm(self.attention(x, p), self.weight(p + "post_attention_norm.weight"), None)
            return x + self.norm(self.feed_forward(x, p), self.weight(p + "post_ffw_norm.weight"), None)
        h = self.norm(x, self.weight(p + "attn_norm.weight"), self.optional_weight(p + "attn_norm.bias"))
        attn = self.attention(h, p)
        post = self.optional_weight(p + "post_attention_norm.weight")
        if post is not None:  # Gemma 2/3: sandwich norms around attention and FFN
            attn = self.norm(attn, post, None)
            x = x + attn
            y = self.feed_forward(self.norm(x, self.weight(p + "ffn_norm.weight"), None), p)
            return x + self.norm(y, self.weight(p + "post_ffw_norm.weight"), None)
        if hp.parallel_residual:
            if hp.shared_norm:  # Cohere 2 (src/models/cohere2.cpp): the FFN reads the attention's input norm
                return x + self.feed_forward(h, p) + attn
            h2 = self.norm(x, self.weight(p + "ffn_norm.weight"), self.optional_weight(p + "ffn_norm.bias"))
            return x + attn + self.feed_forward(h2, p)
        x = x + attn
        h2 = self.norm(x, self.weight(p + "ffn_norm.weight"), self.optional_weight(p + "ffn_norm.bias"))
        return x + self.feed_forward(h2, p)

    def feed_forward(self, h: torch.Tensor, p: str) -> torch.Tensor:
        """The block's FFN: dense, or mixture-of-experts when the file has experts."""
        if self.hparams.n_expert:
            return moe_ffn(self, h, p)
        return self._ffn(h, p)


def float_cache_budget() -> int:
    """Bytes of dequantized weights a CPU model keeps between forward passes: ``GGUFKIT_EVAL_FLOAT_CACHE_MB``
    MiB when set, else a quarter of the RAM available now."""
    env = os.environ.get(FLOAT_CACHE_ENV)
    if env is not None:
        try:
            return max(0, int(float(env) * 2**20))
        except ValueError:
            raise EvaluationError(f"{FLOAT_CACHE_ENV}={env!r} is not a number of MiB") from None
    from ggufkit.sysmem import available_memory_bytes

    return available_memory_bytes() // 4


def _onednn_linear() -> Any:
    """oneDNN's linear (the kernel torch.compile uses for float32 CPU linears), when this torch has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN_LINEAR = _onednn_linear()


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T``. Float32 on the CPU goes through oneDNN, which picks its kernels by ISA (AVX-512 where
    there is one) where MKL's sgemm runs its AVX2 path on AMD CPUs: ~1.3x faster for the evaluator's shapes;
    the values differ from F.linear's only in float32 summation order."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu" and w.dtype == torch.float32 and x.dtype == w.dtype:
        return _ONEDNN_LINEAR(x, w, None, "none", [], "")
    return F.linear(x, w)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                      window: int) -> torch.Tensor:
    """Causal attention ``[B, H, T, hd]`` with scores soft-capped (``cap * tanh(s / cap)``, when ``softcap``)
    and keys limited to the last ``window`` positions (when ``window``), as llama.cpp's build_attn with
    f_attn_logit_softcapping and LLAMA_SWA_TYPE_STANDARD (key j visible from i when i - j < window)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(torch.float32) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    t = q.shape[2]
    i = torch.arange(t, device=q.device)
    visible = i[None, :] <= i[:, None]
    if window:
        visible = visible & (i[:, None] - i[None, :] < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v).to(torch.float32)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x * rsqrt(mean(x^2) + eps) * w, as transformers' RMSNorm, in one fused kernel.
    return F.rms_norm(x.to(torch.float32), (x.shape[-1],), w, eps)


def _check_ffn_widths(tensors: dict[str, QTensor], hp: HParams, path: Path) -> None:
    """The FFN tensors of a layer must agree on its width (their shapes were checked only against n_embd)."""
    for i in range(hp.n_trunk):
        b = f"blk.{i}."
        widths = {name: t.shape[0] for name, t in ((n, tensors.get(b + n)) for n in
                  ("ffn_up.weight", "ffn_gate.weight", "ffn_down_t.weight", "ffn_up.bias")) if t is not None}
        down = tensors.get(b + "ffn_down.weight")
        if down is not None:
            widths["ffn_down.weight"] = down.shape[1]
        if hp.ffn == "silu_fused" and "ffn_up.weight" in widths:
            widths["ffn_up.weight"] //= 2
        if len(set(widths.values())) > 1:
            raise EvaluationError(f"layer {i}: the FFN tensors disagree on its width: "
                                  + ", ".join(f"{n} {w}" for n, w in widths.items()), path=path)


def _to_rotate_half(tensors: dict[str, QTensor], hp: HParams) -> None:
    """Undo the converter's LLaMA Q/K permutation (convert_hf_to_gguf.py: LlamaModel.permute) on the raw rows.

    NORM RoPE rotates adjacent pairs (2i, 2i+1); transformers' rotate-half pairs (i, i + d/2). Moving row
    ``h*d + 2i + j`` back to ``h*d + j*d/2 + i`` once at load lets the forward use the rotate-half path with
    no per-token reordering; attention scores do not depend on the order of the head dimensions.
    """
    d = hp.head_dim
    for i in range(hp.n_layer):
        for part, n_head in (("q", hp.n_head), ("k", hp.n_head_kv)):
            # new_row[h*d + j*d/2 + i] = old_row[h*d + 2i + j]
            order = torch.arange(n_head * d).reshape(n_head, d // 2, 2).transpose(1, 2).reshape(-1)
            for suffix in ("weight", "bias"):
                t = tensors.get(f"blk.{i}.attn_{part}.{suffix}")
                if t is not None:
                    if suffix == "bias":  # a float vector: view each element as a row of its bytes
                        t.raw = t.raw.reshape(n_head * d, -1)
                        t.permute_rows(order)
                        t.raw = t.raw.reshape(1, -1)
                    else:
                        t.permute_rows(order)


def _strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A numpy-order shape without leading 1s (ggml_n_dims), at least one dimension."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _load_tensor(model: GGUFModel, info: TensorInfo, device: torch.device, hasher: Any) -> QTensor:
    view = model.raw(info)
    hasher.update(view)
    with warnings.catch_warnings():
        # The mmap is read-only and the tensor is never written to; torch warns about that regardless.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8) if info.nbytes else torch.empty(0, dtype=torch.uint8)
    if device.type != "cpu":
        raw = raw.to(device)
    return QTensor(info.name, info.ggml_type, info.shape, raw)


def load_model(path: str | os.PathLike[str], *, device: str = "auto", dtype: str = "auto",
               ggml_rounding: bool = False, kv_f16: bool = False) -> GGUFCausalLM:
    """Open a GGUF model for scoring.

    Args:
        path: a GGUF or PowerInfer (PWRI) file, or any shard of a gguf-split set.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        dtype: ``auto``/``f32`` (float32 everywhere), or ``f16``/``bf16`` matmuls on a GPU.
        ggml_rounding: round the input of every weight matmul through the weight type's ``vec_dot_type``
            first (F16, BF16, or 8-bit Q8_0/Q8_1/Q8_K blocks; :mod:`ggufkit.eval.ggml_cpu`), as llama.cpp's
            plain CPU kernels do (``--no-repack``, or a CPU without AMX). Off: float32 inputs times the
            exactly dequantized weights, as transformers computes.
        kv_f16: round K and V to F16 before attention, as llama.cpp's default F16 K/V cache read by its
            flash attention (``-fa on`` or ``auto`` on a CPU, with at least 64 tokens per batch). Off: as
            ``-fa off -ctk f32 -ctv f32``.

    Returns:
        The model; its weights stay in their GGUF types on ``device``.

    Raises:
        GGUFFormatError: the file is malformed.
        EvaluationError: unsupported architecture or tensor type, or a tensor has an unexpected shape.
        DeviceUnavailableError: ``device="cuda"`` without a GPU.

    Example:
        >>> with load_model("model.gguf", device="cpu") as m:          # doctest: +SKIP
        ...     m.logits(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 32000])
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model = open_gguf(path)
    try:
        hp = read_hparams(model)
        if hp.n_layer > len(model.tensors):  # a corrupt count must not drive a billion-step loop
            raise EvaluationError(f"block count {hp.n_layer} exceeds the {len(model.tensors)} tensors in the file",
                                  path=model.path)
        expected = expected_shapes(hp, set(model))
        hasher = hashlib.sha256()
        tensors: dict[str, QTensor] = {}
        for info in model.tensors:
            if info.name not in expected:
                hasher.update(model.raw(info))  # predictor tensors etc.: hashed, not loaded
                continue
            # ggml shapes end in implicit 1s (llama-quantize writes qwen2moe's [1, n_embd] shared-expert gate
            # as [n_embd]): compared without leading 1s, as llama.cpp's loader compares them
            want, have = _strip_ones(expected[info.name]), _strip_ones(info.shape)
            if len(want) != len(have) or any(w not in (-1, s) for w, s in zip(want, have)):
                raise EvaluationError(f"tensor {info.name!r} has shape {list(info.shape)}, expected "
                                      f"{[w if w >= 0 else '*' for w in want]}", path=model.path)
            if not can_dequantize(info.ggml_type):
                raise EvaluationError(f"tensor {info.name!r} has type {info.ggml_type.name}, which the evaluator "
                                      f"cannot dequantize", path=model.path)
            tensors[info.name] = _load_tensor(model, info, dev, hasher)
        missing = [n for n in expected if n not in tensors]
        if missing:
            raise EvaluationError(f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                        if len(missing) > 1 else ""), path=model.path)
        _check_ffn_widths(tensors, hp, model.path)
        if hp.rope_mode == "norm":
            if any(name.endswith("attn_qkv.weight") for name in tensors) or hp.n_rot != hp.head_dim:
                raise EvaluationError("NORM RoPE with a fused attn_qkv or partial rotation is not supported",
                                      path=model.path)
            _to_rotate_half(tensors, hp)
        lm = GGUFCausalLM(Path(path), hp, tensors, dev, torch_dtype, hasher.hexdigest(), model)
        lm.ggml_rounding = ggml_rounding
        lm.kv_f16 = kv_f16
        if dev.type == "cpu":
            lm.float_cache_bytes = float_cache_budget()
        return lm
    except BaseException:
        model.close()
        raise
