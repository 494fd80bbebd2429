"""eval/layers_mamba2.py's fast paths (issue 33's speed target): the chunked scan with ``D`` folded in equals
ggml_ssm_scan's token loop plus ``x * D`` (ggml/src/ggml-cpu/ops.cpp ggml_compute_forward_ssm_scan_f32, then the
graph's ``ggml_add(y, ggml_mul(x, ssm_d))`` in src/models/mamba-base.cpp build_mamba2_layer), on inputs laid out as
the mixer passes them (slices of the projection, the tokens' axis innermost after the convolution), over several
chunks with groups, decays that underflow inside a chunk, and the same numbers on 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch

from ggufkit.eval.layers_mamba2 import ssm_scan, ssm_scan_reference


def _inputs(bsz: int, t: int, nh: int, hd: int, ng: int, ns: int, seed: int, a_scale: float = 1.0
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # x as the mixer's conv output: [B, C, T] memory read as [B, T, H, P] (tokens innermost)
    x = torch.randn(bsz, nh * hd + 7, t, generator=g)[:, 3:3 + nh * hd].transpose(1, 2).reshape(bsz, t, nh, hd)
    dt = torch.randn(bsz, t, nh, generator=g) * 2
    a = -torch.exp(torch.randn(nh, generator=g)) * a_scale
    b = torch.randn(bsz, t, ng, ns, generator=g)
    c = torch.randn(bsz, t, ng, ns, generator=g)
    d = torch.randn(nh, generator=g)
    return x, dt, a, b, c, d


@pytest.mark.parametrize(("bsz", "t", "nh", "hd", "ng", "ns", "chunk", "a_scale"), [
    (2, 300, 6, 4, 3, 8, 64, 1.0),   # five chunks (the last padded), three groups of two heads
    (1, 256, 4, 8, 1, 16, 32, 1.0),  # eight whole chunks, one group
    (1, 200, 4, 4, 2, 4, 128, 30.0),  # decays that underflow to zero inside a chunk
    (2, 40, 4, 4, 4, 4, 128, 1.0),   # one chunk (no state carried), a group per head
])
def test_scan_with_d_equals_token_loop(bsz: int, t: int, nh: int, hd: int, ng: int, ns: int, chunk: int,
                                       a_scale: float) -> None:
    x, dt, a, b, c, d = _inputs(bsz, t, nh, hd, ng, ns, t * 7 + nh, a_scale)
    want = ssm_scan_reference(x, dt, a, b, c) + x * d.reshape(1, 1, nh, 1)
    got = ssm_scan(x, dt, a, b, c, chunk=chunk, d=d)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # without D: the scan alone, as before
    torch.testing.assert_close(ssm_scan(x, dt, a, b, c, chunk=chunk), want - x * d.reshape(1, 1, nh, 1),
                               rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_scan_same_numbers_on_one_and_two_threads() -> None:
    x, dt, a, b, c, d = _inputs(2, 512, 24, 16, 1, 32, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ssm_scan(x, dt, a, b, c, d=d)
        torch.set_num_threads(2)
        two = ssm_scan(x, dt, a, b, c, d=d)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
