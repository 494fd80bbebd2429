"""eval/layers_mamba2.py: the chunked Mamba-2 scan equals ggml_ssm_scan's token loop
(ggml/src/ggml-cpu/ops.cpp ggml_compute_forward_ssm_scan_f32), the gated group norm, the key reader."""

from __future__ import annotations

import pytest
import torch

from ggufkit.eval.layers_mamba2 import (
    Mamba2Dims,
    gated_group_norm,
    mamba2_shapes,
    softplus,
    ssm_scan,
    ssm_scan_reference,
)


@pytest.mark.parametrize(("bsz", "t", "nh", "hd", "ng", "ns", "chunk"), [
    (2, 37, 4, 3, 2, 5, 8),     # several chunks, the last one padded, two groups
    (1, 130, 6, 4, 3, 8, 64),   # three groups of two heads
    (1, 5, 2, 2, 1, 3, 64),     # shorter than one chunk
    (1, 64, 4, 4, 1, 4, 16),    # whole chunks
    (1, 1, 4, 2, 4, 2, 64),     # one token, a group per head
])
def test_chunked_scan_equals_token_loop(bsz: int, t: int, nh: int, hd: int, ng: int, ns: int, chunk: int) -> None:
    g = torch.Generator().manual_seed(t * 31 + nh)
    x = torch.randn(bsz, t, nh, hd, generator=g)
    dt = torch.randn(bsz, t, nh, generator=g) * 2
    a = -torch.exp(torch.randn(nh, generator=g))
    b = torch.randn(bsz, t, ng, ns, generator=g)
    c = torch.randn(bsz, t, ng, ns, generator=g)
    want = ssm_scan_reference(x, dt, a, b, c)
    got = ssm_scan(x, dt, a, b, c, chunk=chunk)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_scan_with_strong_decay_and_large_steps() -> None:
    # dt above softplus' threshold (20) and A far below zero: the state forgets within a step; no inf/nan
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 150, 2, 2, generator=g)
    dt = torch.full((1, 150, 2), 25.0)
    a = torch.tensor([-30.0, -0.01])
    b = torch.randn(1, 150, 1, 3, generator=g)
    c = torch.randn(1, 150, 1, 3, generator=g)
    got = ssm_scan(x, dt, a, b, c)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ssm_scan_reference(x, dt, a, b, c), rtol=1e-4, atol=1e-3)


def test_softplus_as_ggml() -> None:
    x = torch.tensor([-30.0, -1.0, 0.0, 19.5, 20.0, 20.5, 80.0])
    want = torch.tensor([float(v) if v > 20 else float(torch.log(1 + torch.exp(torch.tensor(v)))) for v in x.tolist()])
    torch.testing.assert_close(softplus(x), want)


def test_gated_group_norm_normalises_each_group() -> None:
    g = torch.Generator().manual_seed(3)
    y, z = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    w = torch.randn(2, 4, generator=g)
    got = gated_group_norm(y, z, w, 2, 1e-6)
    gated = (y * torch.nn.functional.silu(z)).reshape(2, 3, 2, 4)
    want = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(got, want.reshape(2, 3, 8))
    torch.testing.assert_close(gated_group_norm(y, z, None, 2, 1e-6), y * torch.nn.functional.silu(z))


def test_shapes_in_numpy_order() -> None:
    d = Mamba2Dims(d_conv=4, d_inner=64, d_state=16, n_head=8, n_group=2)
    assert (d.head_dim, d.conv_channels, d.d_in_proj) == (8, 128, 200)
    s = mamba2_shapes(d, 32, "blk.0.", {"blk.0.ssm_norm.weight"})
    assert s["blk.0.ssm_in.weight"] == (200, 32) and s["blk.0.ssm_conv1d.weight"] == (128, 4)
    assert s["blk.0.ssm_a"] == (8, 1) and s["blk.0.ssm_norm.weight"] == (2, 32)
    assert "blk.0.ssm_conv1d.bias" not in s
