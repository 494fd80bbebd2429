"""The gated delta-net (linear attention) mixer of Qwen3.5 and Qwen3-Next, as llama.cpp computes it for prompt
processing, in float32, for one sequence that starts from an empty recurrent state (llama-perplexity clears
the memory before each chunk).

A family computes the layer's input projections itself (its own tensors, each matmul reported to the
observer where llama-imatrix collects it) and hands them to :func:`delta_net_mix`, which does what lies
between them and the output projection (src/models/qwen35.cpp ``build_layer_attn_linear``, qwen3next.cpp
likewise):

* the causal conv1d of the mixed ``[q | k | v]`` channels (``ggml_ssm_conv``, zero history) and SiLU;
* the split into ``q``/``k`` (``n_k_heads`` heads) and ``v`` (``n_v_heads`` heads), L2-normed ``q`` and ``k``
  (models.h ``build_gdn_l2_norm``: ``rms_norm(x, eps / n) / sqrt(n)``);
* ``beta = sigmoid(b)``, the log-decay ``g = softplus(a + dt_bias) * ssm_a`` (``ssm_a`` is ``-exp(A_log)`` as
  the converter stores it);
* the gated delta rule (:func:`gated_delta_rule`), with key heads broadcast to the value heads in tiled
  order (value head ``h`` reads key head ``h % n_k_heads``: ggml_repeat_4d, and ``iq1 = iv1 % neq1`` in
  ggml_compute_forward_gated_delta_net; llama.cpp's converter reorders the value heads to that order);
* the gated output norm ``rms_norm(o) * ssm_norm * silu(z)`` per value head (``build_norm_gated``).

:func:`gated_delta_rule` is the chunked form of src/models/delta-net-base.cpp ``build_delta_net_chunking``
(chunks of 64 tokens: a triangular solve and matmuls per chunk, one state update per chunk). llama.cpp's
CPU backend runs the fused ``ggml_gated_delta_net`` op (the per-token recurrence of ggml-cpu/ops.cpp) when
``fused_gdn_ch`` resolves on; both compute the same function and differ only in float32 rounding.
Device-agnostic torch (CPU or CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ggufkit.errors import MetadataValueError
from ggufkit.eval.layers_conv import causal_conv1d
from ggufkit.eval.layers_mamba2 import positive_int

if TYPE_CHECKING:
    from ggufkit.format.reader import GGUFModel

#: Tokens per chunk of the chunked form (delta-net-base.cpp ``CS`` for a scalar per-head gate).
CHUNK = 64


@dataclass(frozen=True)
class DeltaNetDims:
    """A delta-net layer's sizes (GGUF ``ssm.group_count`` = key heads, ``ssm.time_step_rank`` = value
    heads, ``ssm.state_size`` = key head size, ``ssm.inner_size / value heads`` = value head size) and the
    RMS epsilon of its norms (``attention.layer_norm_rms_epsilon``)."""

    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d (and rows of the ``[q | k | v]`` projection): ``2 * key_dim + value_dim``."""
        return 2 * self.key_dim + self.value_dim


def read_dims(file: GGUFModel, arch: str, eps: float) -> DeltaNetDims:
    """A file's delta-net sizes from its ``{arch}.ssm.*`` keys (src/models/qwen35.cpp load_arch_hparams)."""
    n_v = positive_int(file, f"{arch}.ssm.time_step_rank")
    inner = positive_int(file, f"{arch}.ssm.inner_size")
    dims = DeltaNetDims(positive_int(file, f"{arch}.ssm.group_count"), n_v,
                        positive_int(file, f"{arch}.ssm.state_size"), inner // n_v, eps)
    if inner % n_v or dims.n_v_heads % dims.n_k_heads or dims.head_k_dim != dims.head_v_dim:
        raise MetadataValueError(f"{dims.n_k_heads} key heads of {dims.head_k_dim} and an inner size {inner} for "
                                 f"{n_v} value heads: not a delta-net layout llama.cpp runs",
                                 key=f"{arch}.ssm.inner_size", path=file.path)
    return dims


def recurrent_layers(file: GGUFModel, arch: str, n_layer: int, n_trunk: int) -> tuple[bool, ...]:
    """Which of the ``n_layer`` blocks are delta-net layers: ``{arch}.attention.recurrent_layers`` (a bool per
    block), else every block below ``n_trunk`` but each ``full_attention_interval``-th (default 4;
    qwen35.cpp / qwen3next.cpp load_arch_hparams). Blocks from ``n_trunk`` on (MTP) are never recurrent."""
    field = file.kv.get(f"{arch}.attention.recurrent_layers")
    if field is not None:
        value = field.value
        if not isinstance(value, (list, tuple, np.ndarray)) or len(value) != n_layer:
            raise MetadataValueError(f"expected {n_layer} booleans", key=f"{arch}.attention.recurrent_layers",
                                     path=file.path)
        return tuple(bool(v) for v in value)
    name = f"{arch}.full_attention_interval"
    interval = positive_int(file, name) if name in file.kv else 4
    return tuple(i < n_trunk and (i + 1) % interval != 0 for i in range(n_layer))


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``ggml_rms_norm`` over the last dimension: ``x / sqrt(mean(x^2) + eps)``, float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """models.h ``build_gdn_l2_norm``: ``rms_norm(x, eps / n) / sqrt(n)`` over the last dimension (size n)."""
    n = x.shape[-1]
    return rms_norm(x, eps / n) * (1.0 / n ** 0.5)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule from a zero state, in the chunked form of delta-net-base.cpp.

    Per head, with state ``S`` ``[S_k, S_v]`` starting at zero, token by token::

        S = exp(g_t) * S;  S += k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t / sqrt(S_k)

    computed chunk by chunk: inside a chunk the WY form ``(I + tril(beta k k^T * decay, -1))^-1`` (a
    triangular solve, ``ggml_solve_tri``), across chunks one state update.

    Args:
        q, k: ``float32[B, T, H, S_k]`` (L2-normed), ``H`` the value heads (key heads already broadcast).
        v: ``float32[B, T, H, S_v]``.
        g: ``float32[B, T, H]``, the log decay (<= 0).
        beta: ``float32[B, T, H]``.
        chunk: tokens per chunk.

    Returns:
        ``float32[B, T, H, S_v]``.
    """
    b, t, h, s_k = q.shape
    s_v = v.shape[-1]
    pad = (chunk - t % chunk) % chunk
    n = (t + pad) // chunk
    scale = 1.0 / s_k ** 0.5

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(b, h, n, chunk, *x.shape[3:])

    q_c = chunks(q * scale)
    k_c = chunks(k)
    v_c = chunks(v)
    g_c = chunks(g.unsqueeze(-1)).squeeze(-1)  # [B, H, N, C]
    beta_c = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]
    k_b = k_c * beta_c
    v_b = v_c * beta_c

    g_cs = g_c.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (g_cs.unsqueeze(-1) - g_cs.unsqueeze(-2)).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # [.., i, j] = exp(g_i - g_j) for j <= i, else 0

    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    a = (k_b @ k_c.transpose(-1, -2) * decay).tril(-1)
    # attn = (I + A)^-1: solve (I + A) X = -A, then X + I (delta-net-base.cpp: ggml_solve_tri)
    attn = torch.linalg.solve_triangular(a + eye, -a, upper=False, unitriangular=True) + eye
    u = attn @ v_b  # [B, H, N, C, S_v]
    g_exp = g_cs.exp().unsqueeze(-1)
    k_cd = attn @ (k_b * g_exp)  # [B, H, N, C, S_k]
    q_g = q_c * g_exp
    kq = (q_c @ k_c.transpose(-1, -2) * decay).tril()
    g_last = g_cs[..., -1:]  # [B, H, N, 1]
    k_g = k_c * (g_last - g_cs).exp().unsqueeze(-1)
    decay_last = g_last.exp().unsqueeze(-1)  # [B, H, N, 1, 1]

    state = q.new_zeros(b, h, s_k, s_v)
    out = []
    for i in range(n):
        v_new = u[:, :, i] - k_cd[:, :, i] @ state
        out.append(q_g[:, :, i] @ state + kq[:, :, i] @ v_new)
        state = state * decay_last[:, :, i] + k_g[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, 2).reshape(b, h, n * chunk, s_v)[:, :, :t]
    return o.transpose(1, 2)


def delta_net_mix(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                  dt_bias: torch.Tensor, ssm_a: torch.Tensor, norm: torch.Tensor, dims: DeltaNetDims,
                  chunk: int = CHUNK) -> torch.Tensor:
    """A delta-net layer between its input projections and its output projection (``ssm_out``).

    Args:
        qkv: ``float32[B, T, conv_dim]``, the ``[q | k | v]`` projection (``attn_qkv``) before the conv.
        z: ``float32[B, T, value_dim]``, the output gate projection (``attn_gate``).
        b: ``float32[B, T, n_v_heads]``, the beta projection (``ssm_beta``) before its sigmoid.
        a: ``float32[B, T, n_v_heads]``, the decay projection (``ssm_alpha``) before ``dt_bias``.
        conv: the conv1d kernel ``[conv_dim, K]`` (``ssm_conv1d``).
        dt_bias: ``[n_v_heads]`` (``ssm_dt.bias``). ssm_a: ``[n_v_heads]`` (``ssm_a``, ``-exp(A_log)``).
        norm: ``[head_v_dim]`` (``ssm_norm``).
        dims: the layer's sizes.

    Returns:
        ``float32[B, T, value_dim]``: the input of ``ssm_out``.
    """
    bsz, t, _ = qkv.shape
    x = F.silu(causal_conv1d(qkv, conv))
    kd = dims.key_dim
    q = l2_norm(x[..., :kd].reshape(bsz, t, dims.n_k_heads, dims.head_k_dim), dims.eps)
    k = l2_norm(x[..., kd:2 * kd].reshape(bsz, t, dims.n_k_heads, dims.head_k_dim), dims.eps)
    v = x[..., 2 * kd:].reshape(bsz, t, dims.n_v_heads, dims.head_v_dim)
    if dims.n_v_heads != dims.n_k_heads:  # tiled broadcast: value head h reads key head h % n_k_heads
        reps = dims.n_v_heads // dims.n_k_heads
        q = q.repeat(1, 1, reps, 1)
        k = k.repeat(1, 1, reps, 1)
    beta = torch.sigmoid(b)
    g = F.softplus(a + dt_bias.to(a.dtype)) * ssm_a.to(a.dtype)
    o = gated_delta_rule(q, k, v, g, beta, chunk)
    o = rms_norm(o, dims.eps) * norm.to(o.dtype) * F.silu(z.reshape(bsz, t, dims.n_v_heads, dims.head_v_dim))
    return o.reshape(bsz, t, dims.value_dim)
