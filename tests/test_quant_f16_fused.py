"""The fused F16-input kernels (quant/kernels/legacy/cpu_f16.py, quant/kernels/kquants/cpu_f16.py, quant/kernels/lowbit/mxfp4_f16.py): same bytes as ggml on the widened values.

F16 input with enough rows (``dispatch._FUSED_MIN_ROWS``) takes the fused widen-and-quantize path on the
CPU; these tests feed float16 arrays of many distributions (f16 subnormals, zeros, huge values near the
f16 maximum, ties) and compare with ggml's ``ggml_quantize_chunk`` on the same values as float32.
Also the two other speed changes of the dispatcher: dynamic prange chunks for the K-quants (same bytes,
setting restored) and ``--device auto`` not importing ``numba.cuda`` on a machine without NVIDIA driver.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from ggml_oracle import ggml_quantize
from gguf import GGMLQuantizationType as T

from ggufkit.errors import QuantizationError
from ggufkit.quant import KERNELS, quantize
from ggufkit.quant.dispatch import _FUSED_MIN_ROWS

LEGACY = [t for t, k in KERNELS.items() if k.family == "legacy"]
FUSED = [t for t, k in KERNELS.items() if k.has_f16_kernel]
N = 256


def _f16_rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts = [
        rng.standard_normal((16, N)) * 0.02,
        rng.standard_t(3, (16, N)),
        np.zeros((8, N)),
        np.full((8, N), -0.37),
        rng.standard_normal((8, N)) * 1e-6,  # f16 subnormals
        rng.uniform(-65504, 65504, (8, N)),  # near the f16 maximum
        rng.integers(-16, 17, (8, N)) / 16,  # ties
        -np.abs(rng.standard_normal((8, N))),
    ]
    x = np.concatenate(parts).astype(np.float16)
    assert x.shape[0] >= _FUSED_MIN_ROWS  # the fused path, not the two-pass one
    return x


def test_the_fused_types_are_the_legacy_types_q6_k_and_mxfp4() -> None:
    assert set(FUSED) == {*LEGACY, T.Q6_K, T.MXFP4}


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_fused_f16_path_equals_ggml_on_widened_values(qtype: T, with_imatrix: bool) -> None:
    assert KERNELS[qtype].cpu_f16() is not None
    x = _f16_rows(int(qtype))
    imatrix = np.random.default_rng(5).uniform(0.0, 4.0, N).astype(np.float32) if with_imatrix else None
    got = quantize(x, qtype, imatrix=imatrix, threads=2)
    expected = ggml_quantize(x.astype(np.float32), qtype, imatrix)
    assert np.array_equal(got, expected)
    # and the bytes do not depend on the thread count
    assert np.array_equal(quantize(x, qtype, imatrix=imatrix, threads=1), got)


@pytest.mark.parametrize("n_blocks", [3, 21])
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["ref", "imatrix"])
def test_fused_q6_k_rows_of_many_blocks_equal_ggml(with_imatrix: bool, n_blocks: int) -> None:
    # The Q6_K kernel quantizes 16 blocks at a time (q6k_cpu.CHUNK): rows of 21 blocks end with a short run,
    # rows of 3 go 5 to a step (the last step short); rows of different kinds side by side.
    n = n_blocks * 256
    rng = np.random.default_rng(13)
    x = np.concatenate([_f16_rows(int(T.Q6_K) + k)[:, :256] for k in range(n_blocks)], axis=1)
    x[:, 300:316] = 0  # an all-zero sub-block inside a block of data
    x[3, 2 * 256:3 * 256] = 0  # an all-zero block: 210 zero bytes
    x = np.concatenate([x, (rng.standard_normal((17, n)) * 0.02).astype(np.float16)])
    imatrix = rng.uniform(0.0, 4.0, n).astype(np.float32) if with_imatrix else None
    if with_imatrix:
        imatrix[256:512] = 0.0  # a block without importance
    got = quantize(x, T.Q6_K, imatrix=imatrix, threads=2)
    assert np.array_equal(got, ggml_quantize(x.astype(np.float32), T.Q6_K, imatrix))
    assert np.array_equal(quantize(x, T.Q6_K, imatrix=imatrix, threads=1), got)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_fused_f16_path_reports_the_first_non_finite_value(qtype: T, bad: float) -> None:
    n = max(64, KERNELS[qtype].block_size)
    x = np.ones((_FUSED_MIN_ROWS, n), np.float16)
    x[40, 7] = bad
    x[50, 1] = bad
    with pytest.raises(QuantizationError, match=rf"blk\.3\.ffn_up\.weight.*non-finite.*index {40 * n + 7}"):
        quantize(x, qtype, name="blk.3.ffn_up.weight")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_dynamic_chunks_keep_the_bytes_and_restore_the_setting(qtype: T) -> None:
    x = np.random.default_rng(int(qtype)).standard_normal((40, 512)).astype(np.float32)
    before = numba.get_parallel_chunksize()
    got = quantize(x, qtype, threads=2)
    assert numba.get_parallel_chunksize() == before
    assert np.array_equal(got, ggml_quantize(x, qtype))


_PROBE = ("import sys; from ggufkit.quant import resolve_device; "
          "print(resolve_device('auto'), 'numba.cuda' in sys.modules)")


def test_device_auto_skips_the_numba_cuda_import_without_an_nvidia_driver() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    driver = any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg"))
    if driver:  # the probe must run (and decides)
        assert out[1] == "True"
    else:
        assert out == ["cpu", "False"]
    # Under Numba's CUDA simulator there is no driver either, and "auto" must still find the simulated GPU.
    sim = subprocess.run([sys.executable, "-c", _PROBE], env={**env, "NUMBA_ENABLE_CUDASIM": "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert sim[0] == "cuda"


_WAIT_PROBE = ("import ctypes, os, numba, numpy as np; from ggufkit.quant import quantize; "
               "quantize(np.ones((4, 256), np.float32), 34, threads=1); "
               "print(numba.threading_layer(), os.environ.get('OMP_WAIT_POLICY'), flush=True); "
               "numba.threading_layer() == 'omp' and ctypes.CDLL('libgomp.so.1').omp_display_env(1)")


@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_numba_threads_start_with_a_passive_openmp_wait_unless_the_user_chose(user_policy: str | None) -> None:
    # libgomp (Numba's "omp" layer) prints its settings with omp_display_env; GOMP_SPINCOUNT 0 is the
    # passive policy (libgomp's default spins 300000 times). The variable is not left in the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if user_policy:
        env["OMP_WAIT_POLICY"] = user_policy
    run = subprocess.run([sys.executable, "-c", _WAIT_PROBE], env=env, capture_output=True, text=True, check=True)
    layer, seen = run.stdout.split()
    assert seen == str(user_policy)
    if layer == "omp":
        spin = [line.split("=")[1].strip(" '") for line in run.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
        assert spin == (["0"] if user_policy is None else [spin[0]]) and (user_policy is None or spin[0] != "0")


_EVERY_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
_FINITE_F16 = _EVERY_F16[(_EVERY_F16 & 0x7C00) != 0x7C00]  # 63488 patterns: every finite half, both zeros


def test_every_finite_f16_widens_to_its_exact_value_on_both_f16_paths() -> None:
    # The two-pass path (any type; here the F32 target) and the fused one (64+ rows of a legacy type) take
    # every finite bit pattern -- subnormals, both zeros, the largest -- to the float32 numpy (IEEE) gives.
    halves = _FINITE_F16.view(np.float16)
    widened = quantize(halves.reshape(62, 1024), T.F32, threads=2).view(np.uint32).reshape(-1)
    assert np.array_equal(widened, halves.astype(np.float32).view(np.uint32))
    fused_rows = halves.reshape(124, 512)
    assert fused_rows.shape[0] >= _FUSED_MIN_ROWS
    for qtype in (T.Q8_0, T.Q4_0):
        assert np.array_equal(quantize(fused_rows, qtype, threads=2), ggml_quantize(fused_rows.astype(np.float32), qtype))


@pytest.mark.parametrize("pattern", [0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFFFF], ids=hex)
def test_each_inf_and_nan_pattern_is_refused_on_both_f16_paths(pattern: int) -> None:
    value = np.array([pattern], np.uint16).view(np.float16).astype(np.float32)[0]  # inf, -inf or nan
    for rows in (2, _FUSED_MIN_ROWS):  # the two-pass path, then the fused one
        x = np.full((rows, 64), 0x3C00, np.uint16)  # 1.0
        x[rows - 1, 63] = pattern
        with pytest.raises(QuantizationError, match=rf"non-finite value {value} at flat index {rows * 64 - 1};"):
            quantize(x.view(np.float16), T.Q8_0, threads=2)


def test_two_pass_f16_rows_reuse_one_widening_buffer_without_leaking_between_calls() -> None:
    # The two-pass path widens F16 into one reused float32 buffer per thread (dispatch._widening_buffer).
    # Calls of different sizes in a row, a failing call in between, and F32 outputs (which must own their
    # memory) keep every result equal to ggml on that call's own values.
    big = _f16_rows(11)[:40]  # fewer rows than _FUSED_MIN_ROWS: the two-pass path for every type
    small = _f16_rows(12)[:3, :64]
    assert big.shape[0] < _FUSED_MIN_ROWS
    for qtype in (T.TQ2_0, T.Q4_K, T.Q8_0):
        first = quantize(big, qtype, threads=2)
        smaller = small if qtype == T.Q8_0 else big[5:8]  # TQ2_0 and Q4_K need 256-wide rows
        assert np.array_equal(quantize(smaller, qtype, threads=2), ggml_quantize(smaller.astype(np.float32), qtype))
        bad = big.copy()
        bad[2, 5] = np.inf
        with pytest.raises(QuantizationError):
            quantize(bad, qtype, threads=2)
        assert np.array_equal(quantize(big, qtype, threads=2), first)
        assert np.array_equal(first, ggml_quantize(big.astype(np.float32), qtype))
    kept = quantize(big, T.F32, threads=2)
    quantize(small, T.Q8_0, threads=2)
    quantize(small, T.F32, threads=2)
    assert np.array_equal(kept.view(np.float32), big.astype(np.float32))
