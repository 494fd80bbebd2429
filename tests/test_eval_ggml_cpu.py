"""ggufkit.eval.ggml_cpu against ggml's own CPU backend (tests/ggml_cpu_oracle.py, the x86 kernels
llama-perplexity runs): the vec_dot_type table, the activation conversions bit for bit, and whole matmuls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_cpu_oracle import decode_activations, libggml_cpu, matmul, to_vec_dot, vec_dot_type
from ggml_oracle import ggml_quantize
from gguf import GGMLQuantizationType

from ggufkit.eval.dequant import dequantize
from ggufkit.eval.ggml_cpu import VEC_DOT_TYPE, q8_1_sum_correction, round_activations
from ggufkit.eval.qtensor import QTensor

Q = GGMLQuantizationType


def activations(rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Rows with per-column scales spread over orders of magnitude, an all-zero 256-block, a constant block,
    values on Q8 rounding ties, and a largest value that is negative (Q8_K keeps its sign)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * np.exp(2 * rng.standard_normal((1, n)))).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :32] = 0.25
    x[2, :32] = np.arange(32, dtype=np.float32) - 12.5  # amax 18.5: x * 127 / amax hits .5 for some x
    x[3, 5] = -1e4
    return x


def test_ggml_cpu_oracle_is_the_x86_build() -> None:
    assert libggml_cpu().ggml_cpu_has_avx2() == 1


def test_vec_dot_types_are_ggml_cpu_s() -> None:
    for qtype, vdt in VEC_DOT_TYPE.items():
        assert vec_dot_type(qtype) == vdt, qtype.name
    assert vec_dot_type(Q.F32) == Q.F32 and Q.F32 not in VEC_DOT_TYPE


@pytest.mark.parametrize("vdt", [Q.Q8_0, Q.Q8_1, Q.Q8_K, Q.F16, Q.BF16])
def test_activation_rounding_is_ggml_s_bit_for_bit(vdt: GGMLQuantizationType) -> None:
    x = activations(16, 1024)
    want, sums = decode_activations(to_vec_dot(x, vdt), vdt)
    got = round_activations(torch.from_numpy(x), vdt).numpy()
    np.testing.assert_array_equal(got, want)
    if vdt == Q.Q8_1:
        assert sums is not None
        qsum = want.reshape(16, -1, 32).sum(-1, dtype=np.float64)  # exact: f16(d) * sum(q)
        correction = q8_1_sum_correction(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(correction.astype(np.float64), sums.astype(np.float64) - qsum)
        assert np.count_nonzero(correction) > 0


#: Weight types with a reference quantizer (no imatrix needed) and their vec_dot.
WEIGHT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
                Q.IQ4_XS, Q.TQ2_0, Q.MXFP4, Q.F16, Q.BF16]


@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: t.name)
def test_rounded_matmul_equals_ggml_s(qtype: GGMLQuantizationType) -> None:
    """Dequantized weights times the rounded activations (plus Q8_1's block-sum term) give ggml's dot
    products up to float32 summation order, where the float32 activations miss by far more."""
    n, rows = 512, 24
    rng = np.random.default_rng(1)
    w = rng.standard_normal((rows, n)).astype(np.float32)
    raw = ggml_quantize(w, qtype)
    x = activations(6, n, seed=2)
    want = matmul(raw, qtype, n, x).astype(np.float64)
    t = QTensor("w", qtype, (rows, n), torch.from_numpy(raw))
    wf = dequantize(t.raw, qtype, n).double()
    xt = torch.from_numpy(x)
    got = round_activations(xt, VEC_DOT_TYPE[qtype]).double() @ wf.T
    if qtype in (Q.Q4_1, Q.Q5_1):
        got = got + q8_1_sum_correction(xt).double() @ t.block_mins().double().T
    plain = xt.double() @ wf.T
    scale = np.abs(want).max()
    err = np.abs(got.numpy() - want).max() / scale
    assert err < 2e-6, err
    assert np.abs(plain.numpy() - want).max() / scale > 50 * max(err, 1e-7)


@pytest.mark.parametrize("window", [0, 40])
def test_f16_cache_attention_equals_ggml_flash_attention(window: int) -> None:
    """llama.cpp's default attention (F16 K/V cache, ggml_flash_attn_ext's tiled CPU kernel for batches of 64
    or more queries): the evaluator's emulation, K and V rounded to F16 then float32 attention (the model's
    scaled_dot_product_attention, or its capped/windowed one), equals ggml's up to float32 order (< 1e-5),
    where unrounded K/V miss by far more; Gemma 3's shape (4 query heads on 1 KV head of 256)."""
    from ggml_cpu_oracle import flash_attn_ext

    from ggufkit.eval.ggml_cpu import FA_TILE_TOKENS, round_f16
    from ggufkit.eval.model import _capped_attention

    rng = np.random.default_rng(3)
    n_head, t, d, scale = 4, 2 * FA_TILE_TOKENS + 37, 256, 1 / 16
    q = (2 * rng.standard_normal((n_head, t, d))).astype(np.float32)
    k, v = (rng.standard_normal((2, 1, t, d))).astype(np.float32)
    want = flash_attn_ext(q, k, v, scale, kv_type=Q.F16, window=window, n_threads=2)
    assert np.isfinite(want).all()

    def ours(kk: torch.Tensor, vv: torch.Tensor) -> np.ndarray:
        qq = torch.from_numpy(q)[None]
        if window:
            return _capped_attention(qq, kk[None], vv[None], scale, 0.0, window)[0].numpy()
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk[None], vv[None], is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out[0].numpy()

    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    scale_out = np.abs(want).max()
    err = np.abs(ours(round_f16(kt), round_f16(vt)) - want).max() / scale_out
    plain = np.abs(ours(kt, vt) - want).max() / scale_out
    assert err < 1e-5, err
    assert plain > 1e-4, plain
    # f32 cache (``-ctk f32 -ctv f32`` with flash attention on): nothing rounded
    want32 = flash_attn_ext(q, k, v, scale, kv_type=Q.F32, window=window)
    assert np.abs(ours(kt, vt) - want32).max() / scale_out < 1e-5
