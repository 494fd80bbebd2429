"""The target search's per-tensor measurement (``ggufkit.quant.target.measure``).

- With every row sampled, a measurement is the imatrix-weighted squared error of the tensor that the built
  ``llama-quantize`` writes (``--pure``, same imatrix; dequantized by gguf-py), and for a grid type the same
  error on every fourth row scaled by the energy of all rows.
- The measurements, hence the plan, are the same for any thread count and whatever other types are measured
  in the same call (the cache mixes calls).
- An interrupted search keeps what it measured; a second target on the same inputs measures nothing and does
  not rewrite the cache file.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numba
import numpy as np
import pytest
from fixtures_quantize import imatrix_values, make_llama_gguf, write_imatrix_gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from llama_cpp_sources import tool_path

from ggufkit.format import open_gguf
from ggufkit.quant.imatrix.reader import load_imatrix
from ggufkit.quant.target.measure import (
    GRID_SAMPLE_DIVISOR,
    MeasureCache,
    measure_all,
    measure_tensor,
)
from ggufkit.quant.target.search import quantize_to_target

TYPES = (QT.Q4_K, QT.Q5_0, QT.IQ4_XS, QT.IQ2_XS, QT.IQ3_S, QT.F16)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("measure")
    src = make_llama_gguf(d / "m.gguf", n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=1, n_vocab=256)
    return {"src": src, "im": write_imatrix_gguf(d / "im.gguf", imatrix_values(src))}


def _weighted_sse(x: np.ndarray, y: np.ndarray, a: np.ndarray) -> tuple[float, float]:
    x64 = x.astype(np.float64)
    return float((((x64 - y) ** 2) * a).sum()), float(((x64 ** 2) * a).sum())


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.IQ2_XS])
def test_measurement_is_the_error_of_llama_quantize_output(model, tmp_path, qtype):
    out = tmp_path / "ref.gguf"
    r = subprocess.run([str(tool_path("llama-quantize")), "--pure", "--imatrix", str(model["im"]), str(model["src"]),
                        str(out), qtype.name, "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    ref = {t.name: t for t in GGUFReader(out).tensors}
    im = load_imatrix(model["im"])
    with open_gguf(model["src"]) as m:
        for name in ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "blk.1.ffn_gate.weight"):
            info = m[name]
            w = im.for_tensor(name, info.shape)
            assert w is not None and QT(ref[name].tensor_type) == qtype
            ours = measure_tensor(m, info, [qtype], w, n_sample=10**6)[qtype]
            x = np.asarray(m.files[info.shard].data(info)).reshape(-1, info.ne[0]).astype(np.float32)
            y = gguf_dequantize(np.asarray(ref[name].data), qtype).reshape(x.shape)
            a = w[0].astype(np.float64)
            sse, energy = _weighted_sse(x, y, a)
            if qtype in (QT.IQ2_XS,):  # a grid type: every GRID_SAMPLE_DIVISOR-th row, scaled by energy
                sub_sse, sub_energy = _weighted_sse(x[::GRID_SAMPLE_DIVISOR], y[::GRID_SAMPLE_DIVISOR], a)
                sse = sub_sse / sub_energy * energy
            assert ours.energy == pytest.approx(energy, rel=1e-12)
            assert ours.sse == pytest.approx(sse, rel=1e-9)
            assert ours.sse > 0


def _measure(model: dict[str, Path], cache_dir: Path, threads: int, on_tensor=None):
    im = load_imatrix(model["im"])
    with open_gguf(model["src"]) as m:
        wanted = {t.name: list(TYPES) for t in m.tensors if len(t.ne) == 2}
        cache = MeasureCache(cache_dir, "k")
        return measure_all(m, wanted, im, dict.fromkeys(wanted, True), cache, 64, threads, on_tensor=on_tensor)


def test_same_measurements_and_plan_for_any_thread_count(model, tmp_path):
    most = numba.config.NUMBA_NUM_THREADS
    one, _, _ = _measure(model, tmp_path / "a", 1)
    many, _, _ = _measure(model, tmp_path / "b", most)
    assert one == many
    plans = [quantize_to_target(model["src"], None, target_like="q3_k_m", imatrix=model["im"], dry_run=True,
                                cache_dir=tmp_path / f"c{n}", threads=n) for n in (1, most)]
    assert plans[0].rules == plans[1].rules and plans[0].error == plans[1].error
    assert plans[0].measured > 0 and plans[1].measured == plans[0].measured


def test_a_type_measures_the_same_whatever_is_measured_with_it(model):
    im = load_imatrix(model["im"])
    with open_gguf(model["src"]) as m:
        info = m["blk.0.ffn_up.weight"]
        w = im.for_tensor(info.name, info.shape)
        together = measure_tensor(m, info, list(TYPES), w, 64)
        for t in TYPES:
            assert measure_tensor(m, info, [t], w, 64)[t] == together[t]


def test_interrupted_search_keeps_what_it_measured(model, tmp_path):
    seen: list[str] = []

    def stop_after_two(name: str) -> None:
        seen.append(name)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _measure(model, tmp_path, 1, stop_after_two)
    assert set(MeasureCache(tmp_path, "k").data) == set(seen)  # saved although SAVE_EVERY_S had not passed
    full, n_measured, n_cached = _measure(model, tmp_path, 1)
    assert n_cached == 2 * len(TYPES) and n_measured == (len(full) - 2) * len(TYPES)


def test_second_target_measures_nothing_and_leaves_the_cache_file(model, tmp_path):
    cache = tmp_path / "cache"
    first = quantize_to_target(model["src"], None, target_like="q4_k_m", imatrix=model["im"], dry_run=True,
                               cache_dir=cache)
    (path,) = cache.glob("*.json")
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    second = quantize_to_target(model["src"], tmp_path / "out.gguf", target_like="q3_k_m", imatrix=model["im"],
                                cache_dir=cache)
    assert first.measured > 0 and first.cached == 0
    assert second.measured == 0 and second.cached >= first.measured
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert second.output is not None and second.output.stat().st_size == second.predicted_size
