"""Whole-file quantization speed: ggufkit vs llama.cpp's quantizer vs gguf-py's numpy quantizers.

One run, side by side, on the same F16 llama GGUF of about 104M weights built in a temporary directory,
all at 2 threads:

* ``ggufkit``: :func:`ggufkit.quant.quantize_file` (CPU kernels, ``threads=2``), kernels compiled and cached
  by a warm-up on a tiny file first (compilation is paid once per install, not per run);
* ``llama.cpp``: ``llama_cpp.llama_model_quantize`` (llama-cpp-python 0.3.36, ``nthread=2``);
* ``gguf-py``: ``gguf.quants.quantize`` on every quantizable tensor (F16 -> f32 -> blocks, no file writing),
  for the types it implements (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

``--pure`` per type, plus the q4_k_m preset. Run::

    python -m pytest benchmarks/bench_quantize.py --benchmark-enable -s -p no:cacheprovider

The last test prints the ratios (the other tool's time / ggufkit's time: above 1 means ggufkit is faster)
and the peak RSS of a ggufkit run in a fresh process, next to the RSS before the run (interpreter, Numba,
kernels): the difference should stay a small multiple of the largest tensor, whatever the model size.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures_quantize import llama_quantize, make_llama_gguf

THREADS = 2
TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "q4_k_m"]
GGUF_PY_TYPES = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}
_TIMES: dict[tuple[str, str], float] = {}

_RSS_SCRIPT = """\
import sys, threading, time
import psutil
from ggufkit.quant import quantize_file
quantize_file(sys.argv[4], sys.argv[2], "q4_k_m", threads=int(sys.argv[3]), device="cpu")  # kernels loaded
proc, peak, done = psutil.Process(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.005)
base = proc.memory_info().rss
t = threading.Thread(target=sample)
t.start()
quantize_file(sys.argv[1], sys.argv[2], "q4_k_m", threads=int(sys.argv[3]), device="cpu")
done.set()
t.join()
print(base >> 10, peak[0] >> 10)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench_quantize")
    # 8 layers x (4 x 1024^2 + 3 x 1024 x 2816) + 2 x 512 x 1024 = 104M weights, 208 MB of F16
    path = make_llama_gguf(d / "model-f16.gguf", n_embd=1024, n_ff=2816, n_layer=8, n_head=8, n_head_kv=8,
                           n_vocab=512)
    tiny = make_llama_gguf(d / "tiny.gguf", n_layer=1, n_vocab=256)
    from ggufkit.quant import quantize_file

    for t in TYPES:  # compile (or load from Numba's cache) every kernel before timing
        quantize_file(tiny, d / "warm.gguf", t, pure=t != "q4_k_m", threads=THREADS, device="cpu")
    return path


def _pure(target: str) -> bool:
    return target != "q4_k_m"


def _run(benchmark, key: tuple[str, str], fn) -> None:
    start = time.perf_counter()
    benchmark.pedantic(fn, rounds=1, iterations=1)
    _TIMES[key] = time.perf_counter() - start


@pytest.mark.parametrize("target", TYPES)
def test_ggufkit(benchmark, model, tmp_path, target):
    from ggufkit.quant import quantize_file

    benchmark.group = target
    _run(benchmark, ("ggufkit", target), lambda: quantize_file(
        model, tmp_path / "out.gguf", target, pure=_pure(target), threads=THREADS, device="cpu"))


@pytest.mark.parametrize("target", TYPES)
def test_llama_cpp(benchmark, model, tmp_path, target):
    benchmark.group = target
    _run(benchmark, ("llama.cpp", target), lambda: llama_quantize(
        model, tmp_path / "out.gguf", target, pure=_pure(target), nthread=THREADS))


@pytest.mark.parametrize("target", sorted(GGUF_PY_TYPES))
def test_gguf_py(benchmark, model, target):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from ggufkit.format import open_gguf

    qtype = GGMLQuantizationType[target.upper()]

    def run() -> None:
        with open_gguf(model) as m:
            for t in m.tensors:
                if len(t.ne) >= 2:
                    quantize(np.asarray(m.data(t), dtype=np.float32), qtype)

    benchmark.group = target
    _run(benchmark, ("gguf-py", target), run)


def test_report_ratios_and_peak_rss(model, tmp_path):
    from ggufkit.format import open_gguf

    nan = float("nan")
    lines = [f"{'type':8} {'ggufkit s':>10} {'llama.cpp s':>12} {'ratio':>7} {'gguf-py s':>10} {'ratio':>7}"]
    for t in TYPES:
        ours = _TIMES.get(("ggufkit", t))
        if ours is None:
            continue
        llama = _TIMES.get(("llama.cpp", t), nan)
        gpy = _TIMES.get(("gguf-py", t), nan)
        lines.append(f"{t:8} {ours:10.2f} {llama:12.2f} {llama / ours:7.2f} {gpy:10.2f} {gpy / ours:7.2f}")
    tiny = model.parent / "tiny.gguf"
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(model), str(tmp_path / "rss.gguf"),
                           str(THREADS), str(tiny)], capture_output=True, text=True, check=True)
    base_kib, peak_kib = (int(v) for v in proc.stdout.split()[-2:])
    with open_gguf(model) as m:
        largest = max(t.nbytes for t in m.tensors)
    lines.append(f"RSS during a q4_k_m run (sampled every 5 ms): peak {peak_kib >> 10} MiB, {base_kib >> 10} MiB "
                 f"before it (model file {model.stat().st_size >> 20} MiB, largest tensor {largest >> 20} MiB)")
    print("\n" + "\n".join(lines))
