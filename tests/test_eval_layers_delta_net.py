"""eval/layers_delta_net.py: the chunked gated delta rule against the per-token recurrence llama.cpp's CPU
backend runs (ggml-cpu/ops.cpp ggml_compute_forward_gated_delta_net), and the whole mixer against
transformers' own Qwen3.5 gated delta-net layer with its weights laid out as llama.cpp's converter writes them
(value heads reordered from grouped to tiled, A_log stored as -exp(A_log))."""

from __future__ import annotations

import pytest
import torch

from ggufkit.eval.layers_delta_net import DeltaNetDims, delta_net_mix, gated_delta_rule, l2_norm


def recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """ggml_compute_forward_gated_delta_net (K=1) in float64, token by token, from a zero state."""
    b, t, h, s_k = q.shape
    state = torch.zeros(b, h, s_k, v.shape[-1], dtype=torch.float64)
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kv = torch.einsum("bhs,bhsv->bhv", k[:, i], state)
        delta = (v[:, i] - kv) * beta[:, i][..., None]
        state = state + k[:, i][..., None] * delta[..., None, :]
        out.append(torch.einsum("bhs,bhsv->bhv", q[:, i], state) / s_k ** 0.5)
    return torch.stack(out, 1)


@pytest.mark.parametrize("t", [1, 5, 64, 130])
def test_chunked_rule_equals_the_per_token_recurrence(t: int) -> None:
    g0 = torch.Generator().manual_seed(t)
    b, h, s = 2, 3, 16
    q = l2_norm(torch.randn(b, t, h, s, generator=g0), 1e-6)
    k = l2_norm(torch.randn(b, t, h, s, generator=g0), 1e-6)
    v = torch.randn(b, t, h, s, generator=g0)
    g = -torch.rand(b, t, h, generator=g0) * 2.0
    beta = torch.rand(b, t, h, generator=g0)
    got = gated_delta_rule(q, k, v, g, beta)
    want = recurrence(q, k, v, g, beta)
    assert got.shape == (b, t, h, s)
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)


def test_a_small_chunk_gives_the_same_outputs() -> None:
    g0 = torch.Generator().manual_seed(1)
    q, k = (l2_norm(torch.randn(1, 40, 2, 8, generator=g0), 1e-6) for _ in range(2))
    v = torch.randn(1, 40, 2, 8, generator=g0)
    g, beta = -torch.rand(1, 40, 2, generator=g0), torch.rand(1, 40, 2, generator=g0)
    assert torch.allclose(gated_delta_rule(q, k, v, g, beta, chunk=8), gated_delta_rule(q, k, v, g, beta),
                          atol=1e-5)


def _tiled(x: torch.Tensor, dim: int, n_k: int, per_k: int, head: int) -> torch.Tensor:
    """llama.cpp's converter's value-head reorder (conversion/qwen.py _LinearAttentionVReorderBase)."""
    shape = list(x.shape)
    x = x.reshape(*shape[:dim], n_k, per_k, head, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape)


@pytest.mark.parametrize("n_k,n_v", [(2, 2), (2, 4)])
def test_mixer_equals_transformers_qwen35_layer(n_k: int, n_v: int) -> None:
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    hd, e, t = 16, 32, 70
    config = transformers.Qwen3_5TextConfig(hidden_size=e, linear_num_key_heads=n_k, linear_num_value_heads=n_v,
                                            linear_key_head_dim=hd, linear_value_head_dim=hd,
                                            linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    layer = Qwen3_5GatedDeltaNet(config, 0).eval()
    g0 = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if p.ndim >= 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=g0) * scale + (1.0 if name == "norm.weight" else 0.0))
        x = torch.randn(1, t, e, generator=g0)
        want = layer(x)
        dims = DeltaNetDims(n_k, n_v, hd, hd, 1e-6)
        per = n_v // n_k
        kd = dims.key_dim
        w_qkv = layer.in_proj_qkv.weight
        w_qkv = torch.cat([w_qkv[:2 * kd], _tiled(w_qkv[2 * kd:], 0, n_k, per, hd)])
        conv = layer.conv1d.weight.squeeze(1)
        conv = torch.cat([conv[:2 * kd], _tiled(conv[2 * kd:], 0, n_k, per, hd)])
        w_z = _tiled(layer.in_proj_z.weight, 0, n_k, per, hd)
        w_b = _tiled(layer.in_proj_b.weight, 0, n_k, per, 1)
        w_a = _tiled(layer.in_proj_a.weight, 0, n_k, per, 1)
        dt = _tiled(layer.dt_bias[:, None], 0, n_k, per, 1)[:, 0]
        ssm_a = -_tiled(layer.A_log[:, None], 0, n_k, per, 1)[:, 0].exp()
        w_out = _tiled(layer.out_proj.weight, 1, n_k, per, hd)
        mixed = delta_net_mix(x @ w_qkv.T, x @ w_z.T, x @ w_b.T, x @ w_a.T, conv, dt, ssm_a, layer.norm.weight, dims)
        got = mixed @ w_out.T
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
