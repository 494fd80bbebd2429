"""What ggml's CPU backend rounds, so that the evaluator can reproduce llama.cpp's numbers (``ggml_rounding``).

llama.cpp multiplies a weight matrix by float32 activations in two steps (ggml-cpu/ggml-cpu.c,
``ggml_compute_forward_mul_mat``): the activations are first converted to the weight type's
``vec_dot_type`` (the ``type_traits_cpu`` table: F16 for F16, BF16 for BF16, Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL/
MXFP4, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants, IQ4_XS, the IQ2/IQ3/IQ1 grids and TQ1_0/TQ2_0), then each
output is a sum over blocks of (weight scale x activation scale) x an exact integer (or F16) dot product.
Up to the float32 order of that sum, the result equals the exactly dequantized weights times the
activations *rounded through* ``vec_dot_type``; :func:`round_activations` computes that rounding.

The x86 quantizers the oracle runs (ggml-cpu/arch/x86/quants.c):

* ``quantize_row_q8_0`` / ``quantize_row_q8_1`` (32 values): ``amax = max|x|``, ``d = amax / 127`` stored as
  F16, ``q = round_half_even(x * (127 / amax))``; the value is ``f16(d) * q``. Q8_1 also stores
  ``s = f16(d * sum(q))``, which Q4_1/Q5_1's dot product uses for the weight minimum's term
  (``ggml_vec_dot_q4_1_q8_1``: ``m_w * s``); :func:`q8_1_sum_correction` gives ``s - f16(d) * sum(q)``.
* ``quantize_row_q8_K`` (256 values, the reference ``quantize_row_q8_K_ref``): ``max`` is the first value of
  largest magnitude, ``iscale = -127 / max``, ``q = min(127, nearest_int(iscale * x))``, ``d = 1 / iscale``
  kept in float32; the value is ``d * q``.

Attention (src/llama-graph.cpp ``build_attn_mha``, ggml-cpu/ops.cpp ``ggml_compute_forward_flash_attn_ext``):
with llama.cpp's defaults (F16 K/V cache, flash attention on) the keys and values are stored in F16 and the
tiled flash-attention kernel (queries of 64 or more tokens) multiplies float32 queries by them in float32,
so only K and V are rounded (:func:`round_f16`; equal to libggml-cpu's op up to float32 order, measured
~1e-6 relative on Gemma 3's head shape). Its untiled kernel (fewer than 64 query tokens) also rounds
Q to F16 and accumulates in F16 (differences of ~1e-3 relative); that case is not reproduced.

GELU (ggml-cpu/vec.h, ``GGML_GELU_FP16`` is defined): ``ggml_vec_gelu_f32`` and ``ggml_vec_geglu_f32`` (Gemma's
gated FFN, GPT-NeoX's ``ggml_gelu``) look the value up in ``ggml_table_gelu_f16``: the input rounded to F16,
the tanh approximation of that F16 value rounded to F16 (ggml-cpu.c ``ggml_cpu_init``), inputs at or beyond
+-10 passed through or zeroed (:func:`gelu_f16_table`, equal to libggml-cpu's entry for entry). The evaluator
does not apply it yet (it would change ``ggml_rounding``'s numbers for Gemma and GPT-NeoX): measured with it on
the tiny Gemma 3, layer 0's ``ffn_down`` imatrix sums 1.1e-6 of llama-imatrix's instead of 1.3e-4 (its F16
rounding re-draws with every float32-order difference of the gate, so later layers stay at ~1e-4); on the
real Gemma 3 file's tail-quantized perplexity check, 1.9e-4 of llama-perplexity's instead of 2.3e-4.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
#: ggml-cpu/common.h ``GGML_FA_TILE_Q``: batches of at least this many tokens take the tiled flash attention.
FA_TILE_TOKENS = 64

#: ggml-cpu.c ``type_traits_cpu[type].vec_dot_type`` for every weight type the evaluator reads (F32: none).
VEC_DOT_TYPE: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    Q.F16: Q.F16, Q.BF16: Q.BF16,
    Q.Q4_0: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.Q8_0: Q.Q8_0, Q.IQ4_NL: Q.Q8_0, Q.MXFP4: Q.Q8_0, Q.Q1_0: Q.Q8_0,
    Q.Q4_1: Q.Q8_1, Q.Q5_1: Q.Q8_1,
    Q.Q2_K: Q.Q8_K, Q.Q3_K: Q.Q8_K, Q.Q4_K: Q.Q8_K, Q.Q5_K: Q.Q8_K, Q.Q6_K: Q.Q8_K, Q.IQ4_XS: Q.Q8_K,
    Q.IQ2_XXS: Q.Q8_K, Q.IQ2_XS: Q.Q8_K, Q.IQ2_S: Q.Q8_K, Q.IQ3_XXS: Q.Q8_K, Q.IQ3_S: Q.Q8_K,
    Q.IQ1_S: Q.Q8_K, Q.IQ1_M: Q.Q8_K, Q.TQ1_0: Q.Q8_K, Q.TQ2_0: Q.Q8_K,
}


def round_f16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to F16 (round to nearest even, as F16C's ``_cvtss_sh``), back in float32."""
    return x.to(torch.float16).to(torch.float32)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of {size}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _q8_0_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 d, F16-rounded d, q) of x86 ``quantize_row_q8_0`` on 32-value blocks ``[..., n/32, 32]``."""
    b = _blocks(x, 32)
    amax = b.abs().amax(dim=-1, keepdim=True)
    c127 = torch.full_like(amax, 127.0)
    d = amax / c127
    # torch computes ``scalar / tensor`` as ``scalar * (1 / tensor)``, rounded twice: divide tensors
    inv = torch.where(amax != 0, c127 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)  # _mm256_round_ps(_MM_ROUND_NEAREST): half to even, as torch.round
    return d, round_f16(d), q


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., n]`` through Q8_0 (``n`` a multiple of 32): the values ggml's dot products see."""
    _, d16, q = _q8_0_parts(x)
    return (d16 * q).reshape(x.shape)


def q8_1_sum_correction(x: torch.Tensor) -> torch.Tensor:
    """Per 32-block of ``x``: Q8_1's stored sum ``f16(d * sum(q))`` minus the sum of the rounded values
    ``f16(d) * sum(q)``, ``[..., n/32]``. A Q4_1/Q5_1 dot product adds ``m_w`` times the stored sum."""
    d, d16, q = _q8_0_parts(x)
    qsum = q.sum(dim=-1, keepdim=True)
    return (round_f16(d * qsum) - d16 * qsum).squeeze(-1)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., n]`` through Q8_K (``n`` a multiple of 256), as ``quantize_row_q8_K_ref``."""
    b = _blocks(x, 256)
    idx = b.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as its strict ``>``
    mx = b.gather(-1, idx)
    zero = mx == 0
    iscale = torch.full_like(mx, -127.0) / torch.where(zero, torch.ones_like(mx), mx)
    q = torch.round(iscale * b).clamp(max=127.0)  # nearest_int: the 1.5 * 2^23 trick, half to even
    d = torch.ones_like(iscale) / iscale
    return torch.where(zero, torch.zeros_like(b), d * q).reshape(x.shape)


#: ggml-cpu/vec.h: GELU_COEF_A and SQRT_2_OVER_PI of ggml_gelu_f32, as float32.
_GELU_COEF_A = float(np.float32(0.044715))
_SQRT_2_OVER_PI = float(np.float32(0.79788456080286535587989211986876))


@functools.cache
def _gelu_table() -> torch.Tensor:
    """``ggml_table_gelu_f16`` as ggml-cpu.c's ``ggml_cpu_init`` fills it (``ggml_gelu_f32`` of every F16 value,
    rounded to F16), float32 ``[65536]`` indexed by the F16 bits. Its float32 arithmetic is done in float64 and
    rounded to float32 after each operation (products of two float32 values are exact in float64), with
    ``1.0f + GELU_COEF_A*x*x`` as one fused multiply-add (GCC contracts it when the target has FMA, as
    ``-march=native`` builds do) and ``tanhf`` correctly rounded: equal to libggml-cpu's table entry for entry."""
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)

    def f32(v: np.ndarray) -> np.ndarray:
        return v.astype(np.float32).astype(np.float64)

    with np.errstate(invalid="ignore", over="ignore"):
        inner = f32(f32(_SQRT_2_OVER_PI * x) * f32(f32(_GELU_COEF_A * x) * x + 1.0))
        y = f32(f32(0.5 * x) * f32(1.0 + f32(np.tanh(inner))))
    return torch.from_numpy(y.astype(np.float16).astype(np.float32))


def gelu_f16_table(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU of float32 ``x`` (``ggml_vec_gelu_f32`` with ``GGML_GELU_FP16``): the table entry of ``x``
    rounded to F16 (:func:`_gelu_table`); 0 for ``x <= -10``, ``x`` for ``x >= 10``."""
    x = x.to(torch.float32)
    bits = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    y = _gelu_table().to(x.device)[bits]
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


def round_activations(x: torch.Tensor, vec_dot_type: GGMLQuantizationType) -> torch.Tensor:
    """float32 ``x`` as ggml's CPU matmul sees it after converting it to ``vec_dot_type``.

    Raises:
        ValueError: an unknown ``vec_dot_type``, or a row length that is not a multiple of its block.
    """
    if vec_dot_type == Q.F16:
        return round_f16(x)
    if vec_dot_type == Q.BF16:
        return x.to(torch.bfloat16).to(torch.float32)
    if vec_dot_type in (Q.Q8_0, Q.Q8_1):
        return round_q8_0(x)
    if vec_dot_type == Q.Q8_K:
        return round_q8_k(x)
    if vec_dot_type == Q.F32:
        return x
    raise ValueError(f"no rounding for vec_dot_type {vec_dot_type.name}")
