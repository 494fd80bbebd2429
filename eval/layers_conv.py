"""The causal depthwise convolution of recurrent layers (Mamba2's and delta-net's ``conv1d``, LFM2's short
convolution), as ggml's ``ggml_ssm_conv`` computes it for one sequence that starts from an empty state.

``ggml_ssm_conv`` (ggml/src/ggml-cpu/ops.cpp, ggml_compute_forward_ssm_conv_f32) reads the conv state (the
previous ``d_conv - 1`` inputs, zeros at a sequence's start, as llama-perplexity clears the memory before
each chunk) followed by the chunk, and writes for each token ``t`` and channel ``c``
``sum_k x[t + k, c] * w[c, k]`` over the kernel, in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution of ``x`` ``float32[B, T, C]`` with kernel ``w`` ``[C, K]`` (the GGUF
    tensor's numpy order; a ``[C, 1, K]`` tensor is accepted too), zero history before token 0.

    Returns ``float32[B, T, C]``: ``y[b, t, c] = sum_k xpad[b, t + k, c] * w[c, k] (+ bias[c])`` where
    ``xpad`` is ``x`` after ``K - 1`` zero rows.
    """
    if w.dim() == 3:
        w = w.reshape(w.shape[0], w.shape[-1])
    c, k = w.shape
    if x.shape[-1] != c:
        raise ValueError(f"conv kernel has {c} channels, input has {x.shape[-1]}")
    xt = F.pad(x.transpose(1, 2), (k - 1, 0))  # [B, C, T + K - 1]
    y = F.conv1d(xt, w.to(x.dtype).unsqueeze(1), None if bias is None else bias.to(x.dtype), groups=c)
    return y.transpose(1, 2)
