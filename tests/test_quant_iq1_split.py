"""IQ1_S's and IQ1_M's split searches by contender replay (``ggufkit.quant.kernels.iq.iq1_split``) return exactly what
ggml's scans return, on every group: the scan (``iq1_s_scan``, ggml's loop, itself checked byte for byte against ggml in
test_quant_iq.py through the whole kernel) is the reference here, group by group, over data that reaches the
fast path, its lowered thresholds (IQ1_S: a ratio in the gap below the first threshold in 85 of the 3000
"normal" groups, 6 of them twice; IQ1_M: its gap fall-back) and the range fall-backs. The kernels are also compared with ggml over
many groups and with negative importances."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_oracle import ggml_quantize, row_bytes
from gguf import GGMLQuantizationType

from ggufkit.quant import KERNELS
from ggufkit.quant.kernels.iq.iq1_split import (
    M_KEYS,
    M_PRE,
    M_SCRATCH,
    PW0,
    PW1,
    PX0,
    PX1,
    iq1_m_scan,
    iq1_m_search,
    iq1_s_scan,
    iq1_s_search,
    split_scratch,
)


def _prefix_sums(xb: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's sorted prefix sums of w*x and w (stable sort, float32 sums in order)."""
    order = np.argsort(xb, kind="stable")
    sumx = np.zeros(33, np.float32)
    sumw = np.zeros(33, np.float32)
    for j, i in enumerate(order):
        sumx[j + 1] = sumx[j] + w[i] * xb[i]
        sumw[j + 1] = sumw[j] + w[i]
    return sumx, sumw


def _groups(kind: str, n: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for _ in range(n):
        x = (rng.standard_normal(32) * 0.02).astype(np.float32)
        w = rng.gamma(0.5, 2.0, 32).astype(np.float32)
        if kind == "ties":  # few distinct values: equal ratios among neighbouring splits
            x = rng.choice(np.float32([-0.02, -0.01, 0.0, 0.01, 0.02]), 32).astype(np.float32)
            w = np.ones(32, np.float32)
        elif kind == "zero_weights":  # splits across zero-weight entries give identical sums
            w[rng.random(32) < 0.5] = 0
        elif kind == "skewed":
            x = np.abs(x) * np.where(rng.random(32) < 0.9, 1, -30).astype(np.float32)
        elif kind == "tiny":  # total weight below the fast path's range: the fall-back
            x = x * np.float32(1e-20)
            w = w * np.float32(1e-20)
        elif kind == "huge":
            x = x * np.float32(1e18)
        out.append(_prefix_sums(x, w))
    return out


@pytest.mark.parametrize("kind", ["normal", "ties", "zero_weights", "skewed", "tiny", "huge"])
def test_contender_replay_equals_ggmls_scan(kind: str) -> None:
    rng = np.random.default_rng(11)
    sc = split_scratch()
    groups = _groups(kind, 3000 if kind == "normal" else 500, rng)
    for sumx, sumw in groups:
        amax = np.float32(0.05)
        got = iq1_s_search(sumx, sumw, amax, sc)
        want = iq1_s_scan(sumx, sumw, amax)
        assert got[1:] == want[1:]
        assert np.float32(got[0]).tobytes() == np.float32(want[0]).tobytes()


def _m_prefix_sums(xb: np.ndarray, w: np.ndarray) -> np.ndarray:
    """IQ1_M's prefix sums per half (quantize_row_iq1_m_impl's px/pw) in the kernel's layout."""
    pre = np.zeros(M_PRE, np.float32)
    for j, i in enumerate(np.argsort(xb, kind="stable")):
        for h, (ox, ow) in enumerate(((PX0, PW0), (PX1, PW1))):
            mine = (i < 8) == (h == 0)
            pre[ox + j + 1] = pre[ox + j] + w[i] * xb[i] if mine else pre[ox + j]
            pre[ow + j + 1] = pre[ow + j] + w[i] if mine else pre[ow + j]
    return pre


@pytest.mark.parametrize("kind", ["normal", "x_squared", "ties", "zero_weights", "skewed", "tiny", "huge"])
def test_iq1_m_contender_replay_equals_ggmls_scan(kind: str) -> None:
    rng = np.random.default_rng(12)
    sc = np.empty(M_SCRATCH, np.float32)
    keys = np.empty(M_KEYS, np.int64)
    for _ in range(3000 if kind in ("normal", "x_squared") else 500):
        x = (rng.standard_normal(16) * 0.02).astype(np.float32)
        w = rng.gamma(0.5, 2.0, 16).astype(np.float32)
        if kind == "x_squared":  # the weights without an imatrix
            w = x * x
        elif kind == "ties":
            x = rng.choice(np.float32([-0.02, -0.01, 0.0, 0.01, 0.02]), 16).astype(np.float32)
            w = np.ones(16, np.float32)
        elif kind == "zero_weights":
            w[rng.random(16) < 0.5] = 0
        elif kind == "skewed":
            x = np.abs(x) * np.where(rng.random(16) < 0.9, 1, -30).astype(np.float32)
        elif kind == "tiny":
            x = x * np.float32(1e-20)
            w = w * np.float32(1e-20)
        elif kind == "huge":
            x = x * np.float32(1e18)
        pre = _m_prefix_sums(x, w)
        amax = np.float32(np.abs(x).max())
        got = iq1_m_search(pre, amax, sc, sc.view(np.int32), keys)
        want = iq1_m_scan(pre, amax)
        assert got[1:] == want[1:]
        assert np.float32(got[0]).tobytes() == np.float32(want[0]).tobytes()


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.IQ1_S, GGMLQuantizationType.IQ1_M], ids=lambda t: t.name)
@pytest.mark.parametrize("imatrix", ["gamma", "some_negative"])
def test_kernel_over_many_groups_equals_ggml(qtype: GGMLQuantizationType, imatrix: str) -> None:
    """Whole kernel against ggml_quantize_chunk over ~2000 groups (the contender gap fall-backs occur on ~1%
    of them) and with negative importances (IQ1_M sends those groups to ggml's scan; negative weighted
    distances take the neighbour search's one-by-one minimum)."""
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((8, 4096)) * 0.02).astype(np.float16).astype(np.float32)
    qw = rng.gamma(0.5, 2.0, 4096).astype(np.float32)
    if imatrix == "some_negative":
        qw[rng.random(4096) < 0.05] *= -1
    quantize_rows, _ = KERNELS[qtype].cpu()
    out = np.full((8, row_bytes(qtype, 4096)), 0xAA, np.uint8)
    quantize_rows(x, qw, out)
    assert np.array_equal(out, ggml_quantize(x, qtype, qw))
