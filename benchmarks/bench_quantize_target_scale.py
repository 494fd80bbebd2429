"""Wall time and peak memory of the ``--target-size`` search on SmolLM2-135M and on a 1.1B-weight synthetic
LLaMA, against a plain quantization of the same preset (ggufkit and llama-quantize, same threads).

Models (both F16, built in a temporary directory under /tmp and deleted afterwards):

- SmolLM2-135M-Instruct (``tests/real_models.py``: ``smollm2-135m-instruct-q4_1``) dequantized to F16 by
  ggufkit, as ``bench_quantize_target.py`` does (rows of 576: most tensors take only 32-blocks types);
- a TinyLlama-1.1B-shaped LLaMA with random weights: d = 2048, 22 layers, ffn 5632, 32 heads / 4 KV heads,
  vocabulary 32000 (LLaMA's SentencePiece vocabulary from llama.cpp's models/), untied output: 1.10e9
  weights, 2.2 GB of F16, written tensor by tensor by ggufkit's streaming writer (memory stays one tensor).

Both get a synthetic importance matrix (``fixtures_quantize.imatrix_values``: random positive sums for every
matrix), so the IQ2/IQ3 candidates are searched too, as in a publisher's run; the search's cost does not
depend on the values. It has a token_embd entry, which llama-imatrix never writes: without one, the search
at this commit offers IQ2_XXS/IQ2_XS to a token_embd of whole 256-blocks (llama-quantize's
tensor_requires_imatrix exempts token_embd) and then fails, since ggml has no quantizer for them without
weights (ggml.c ggml_quantize_requires_imatrix).

Steps, each a fresh ``ggufkit`` or ``llama-quantize`` process at ``THREADS`` threads, timed with its own
peak RSS (VmHWM) and the 1-minute load average before it, most telling first:

1. ``search cold``: ``ggufkit quantize F16 --target-like q4_k_m --imatrix IM --cache-dir EMPTY --dry-run``:
   measures every tensor x candidate (and the presets' types), plans, writes nothing;
2. ``search warm``: the same inputs, another size (``--target-like q3_k_m --dry-run``): all from the cache;
   it costs the model's SHA-256 (the cache key) and the plan;
3. ``plain llama.cpp``: ``llama-quantize --imatrix IM F16 OUT Q4_K_M THREADS``;
4. ``plain ggufkit``: ``ggufkit quantize F16 OUT --type q4_k_m --imatrix IM``;
5. ``target warm``: ``--target-like q3_k_m`` writing the file: the second target of a publisher's run.

A first target that writes costs ``search cold`` + (``target warm`` - ``search warm``).

Numba's kernels are compiled (or loaded from its cache) first, on a tiny model, and not counted: that is
paid once per install.

Result (2026-11-27, Intel Xeon Processor (Sapphire Rapids: AVX2, AVX-512 F/BF16/VNNI/FP16, AMX reported),
2 cores, 23 GiB, shared with five other jobs: the 1-minute load was mostly 8-14, so wall times are
inflated ~5x and noisy; CPU seconds are the steadier number where recorded). Not one clean run: the box was too
busy to finish every step before the deadline, so each number says which run gave it.

SmolLM2-135M (134,515,008 weights; first version of this script, which ran: plain ggufkit, plain llama.cpp, a cold
target *writing* the file, a warm target writing, a warm dry-run; it recorded no CPU seconds, and its peak RSS
came from ``wait4``, which reports at least the forking Python's 399 MiB, so only values above that mean
anything):

    step                         like      wall s  load  peak RSS MiB   bytes
    plain ggufkit                q4_k_m     142.8  11.5  <= 399         105458752
    plain llama.cpp              q4_k_m      37.3  11.4  <= 399         105458624
    target cold (measure+write)  q4_k_m     658.8  11.6     475         105371616
    target warm (write)          q3_k_m     191.4  11.2  <= 399          93483008
    dry-run warm                 q5_k_m       9.5  13.0  <= 399         -

The warm target is 1.34x the plain ggufkit quantization in wall time at that load (the search part alone, the
warm dry-run, is 9.5 s: hash, plan, predicted sizes; the rest is quantizing a different mix); the cold target
is 4.6x (measuring about 1800 tensor x type pairs, IQ2/IQ3 included: 1807 in bench_quantize_target.py's run).

Synthetic LLaMA 1.1B (1,100,048,384 weights, 2.2 GB F16; this version, steps as listed above):

    step                wall s   CPU s  load  peak RSS MiB  note
    search cold        >= 955     172   ~11   not read      killed (it could not end before the deadline) after
                                                            48 of 156 tensors (864 tensor x type pairs);
                                                            linear in tensors: ~560 CPU s for the model
    plain llama.cpp       886.6   190   14.1  442           667814752 bytes
    plain ggufkit         186.8  ~56    7.5   327           667819104 bytes
    model SHA-256          19.1     2.3   8.2  -             (the warm search's extra cost over a plan, in process)

llama-quantize ran beside the cold search, ggufkit after it was killed (different loads: compare CPU
seconds, which a /proc sampler read every 2 s, up to 2 s before each exit, as this run predates the script's
``wait4`` CPU field). At the cold search's rate the whole measurement would cost ~3x the CPU of llama-quantize's
plain Q4_K_M and ~10x ggufkit's; the warm search and the warm target did not run on the 1.1B model (the cold
search could not finish first), so "a second target is little more than a plain quantization" is shown on
SmolLM2 only (1.34x wall, of which the search is 9.5 s) and, for 1.1B, only by its parts: a SHA-256 of 2.3 CPU s
plus a plain quantization.
Memory: the search reads sampled rows through mmap and measures tensor by tensor; SmolLM2's cold target peaked
at 475 MiB (Python + Numba included), ggufkit's plain 1.1B quantization at 327 MiB; the 1.1B search's own peak
was not read (the run that would have read it was the one killed).

Run: ``python tests/llama_cpp_sources.py`` (fetches the model, builds the tools), then
``python benchmarks/bench_quantize_target_scale.py [--model smollm2|synthetic-1b ...]`` (not part of CI).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

THREADS = 2
PRESET = "q4_k_m"
SECOND = "q3_k_m"
DRY = "q5_k_m"
#: TinyLlama-1.1B's shape.
SYNTHETIC = {"n_embd": 2048, "n_layer": 22, "n_ff": 5632, "n_head": 32, "n_head_kv": 4, "n_vocab": 32000}
MODELS = ("smollm2", "synthetic-1b")


def write_synthetic_llama(path: Path, *, n_embd: int, n_layer: int, n_ff: int, n_head: int, n_head_kv: int,
                          n_vocab: int, seed: int = 0) -> int:
    """A LLaMA F16 GGUF with random N(0, 0.02) matrices and F32 norms, streamed one tensor at a time.

    Returns:
        The number of weights.
    """
    from fixtures_quantize import _TOKENIZER_KEYS, llama_tensor_shapes
    from gguf import GGMLQuantizationType as QT
    from llama_cpp_sources import vocab_dir

    from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
    from ggufkit.format.values import VT

    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.set("general.name", VT.STRING, "synthetic-llama-1.1b")
    for key, value in (("block_count", n_layer), ("context_length", 2048), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_head_kv), ("rope.dimension_count", n_embd // n_head),
                       ("vocab_size", n_vocab)):
        meta.set(f"llama.{key}", VT.UINT32, value)
    meta.set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-5)
    meta.set("general.file_type", VT.UINT32, 1)
    with open_gguf(vocab_dir() / "ggml-vocab-llama-spm.gguf") as vocab:
        for key in _TOKENIZER_KEYS:
            meta.put(key, vocab.kv[key])
        meta.set("tokenizer.ggml.tokens", VT.ARRAY, vocab.get("tokenizer.ggml.tokens")[:n_vocab], VT.STRING)
        meta.set("tokenizer.ggml.scores", VT.ARRAY, np.array(vocab.get("tokenizer.ggml.scores")[:n_vocab]),
                 VT.FLOAT32)
        meta.set("tokenizer.ggml.token_type", VT.ARRAY,
                 np.array(vocab.get("tokenizer.ggml.token_type")[:n_vocab]), VT.INT32)
    shapes = llama_tensor_shapes(n_embd, n_ff, n_layer, n_vocab, n_embd // n_head * n_head_kv, tied=False)
    specs = [TensorSpec(n, QT.F32 if len(s) == 1 else QT.F16, s) for n, s in shapes]

    def data() -> Iterator[np.ndarray]:
        for i, (_, shape) in enumerate(shapes):
            rng = np.random.default_rng([seed, i])
            if len(shape) == 1:
                yield (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
            else:
                yield (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)

    write_gguf(path, meta, specs, data(), slack_bytes=0)
    return sum(int(np.prod(s)) for _, s in shapes)


def synthetic_imatrix(model: Path, out: Path) -> Path:
    """Random imatrix entries for every matrix of ``model``, token_embd included (llama-imatrix has none for
    it; see the module docstring)."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    return write_imatrix_gguf(out, imatrix_values(model))


def _ggufkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "ggufkit", "quantize", *args, "-t", str(THREADS), "--device", "cpu", "-q"]


def _json(text: str) -> dict:
    line = next(ln for ln in reversed(text.splitlines()) if ln.startswith("{"))
    return dict(json.loads(line))


def bench_model(name: str, f16: Path, im: Path | None, work: Path) -> dict:
    """The five steps of the module docstring on one model; outputs are deleted as soon as they are timed."""
    from _target_common import timed
    from llama_cpp_sources import tool_path

    out = work / "out.gguf"
    cache = work / f"cache-{name}"
    rows: dict = {}
    ggufkit_im = ("--imatrix", str(im)) if im is not None else ()
    llama_im = ["--imatrix", str(im)] if im is not None else []

    def step(tag: str, cmd: list[str]) -> str:
        r = timed(cmd)
        rows[tag] = {**r.row(), "bytes": out.stat().st_size if out.exists() else None}
        out.unlink(missing_ok=True)
        print(json.dumps({name: {tag: rows[tag]}}), flush=True)
        return r.output

    def target(tag: str, like: str, *extra: str) -> None:
        rep = _json(step(tag, _ggufkit(str(f16), str(out), "--target-like", like, *ggufkit_im, "--cache-dir",
                                       str(cache), "--json", *extra)))
        rows[tag].update({"like": like, "measured": rep["measured"], "cached": rep["cached"],
                          "predicted_size": rep["predicted_size"], "in_process_s": rep["seconds"]})

    # most telling first (a run cut short still has the search's cost)
    target("search cold", PRESET, "--dry-run")
    target("search warm", SECOND, "--dry-run")
    step("plain llama.cpp", [str(tool_path("llama-quantize")), *llama_im, str(f16), str(out), PRESET.upper(),
                             str(THREADS)])
    step("plain ggufkit", _ggufkit(str(f16), str(out), "--type", PRESET, *ggufkit_im))
    target("target warm", SECOND)
    return rows


def warm_up(work: Path) -> dict:
    """Compile (or load) every kernel the steps use, on a tiny model: not part of the numbers."""
    from _target_common import timed
    from fixtures_quantize import make_llama_gguf

    tiny = make_llama_gguf(work / "tiny.gguf", n_embd=256, n_ff=512, n_layer=2, n_vocab=512)
    im = synthetic_imatrix(tiny, work / "tiny-imatrix.gguf")
    seconds = 0.0
    for tag, extra in (("im", ("--imatrix", str(im))), ("plain", ())):
        seconds += timed(_ggufkit(str(tiny), str(work / "tiny-out.gguf"), "--target-like", PRESET, *extra,
                                  "--cache-dir", str(work / f"cache-tiny-{tag}"))).seconds
    return {"seconds": round(seconds, 1)}


def main(models: tuple[str, ...] = MODELS, with_imatrix: bool = True) -> dict:
    from _target_common import load, machine
    from real_models import real_model_path

    from ggufkit.quant.pipeline import quantize_file

    result: dict = {"cpu": machine(), "threads": THREADS, "imatrix": with_imatrix, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench_quantize_target_scale_", dir="/tmp") as d:
        work = Path(d)
        result["warm_up"] = warm_up(work)
        print(json.dumps({"warm_up": result["warm_up"]}), flush=True)
        for name in models:
            f16 = work / f"{name}-f16.gguf"
            lo = load()
            if name == "smollm2":
                quantize_file(real_model_path("smollm2-135m-instruct-q4_1"), f16, "f16", allow_requantize=True,
                              threads=THREADS, device="cpu")
                from ggufkit.format import open_gguf

                with open_gguf(f16) as m:
                    n = sum(t.n_elements for t in m.tensors)
            else:
                n = write_synthetic_llama(f16, **SYNTHETIC)
            im = synthetic_imatrix(f16, work / f"{name}-imatrix.gguf") if with_imatrix else None
            rows = bench_model(name, f16, im, work)
            result["models"][name] = {"weights": n, "f16_bytes": f16.stat().st_size, "load_at_build": lo,
                                      "steps": rows}
            f16.unlink()
            shutil.rmtree(work / f"cache-{name}", ignore_errors=True)
    print(f"\n{result['cpu']}, {THREADS} threads; warm-up (kernel compilation, not counted): "
          f"{result['warm_up']['seconds']} s")
    print(f"{'model':14} {'step':16} {'like':7} {'wall s':>8} {'CPU s':>8} {'CPU x plain':>11} {'peak RSS MiB':>12} "
          f"{'load':>5} {'measured':>8} {'cached':>7}")
    for name, m in result["models"].items():
        plain = m["steps"]["plain ggufkit"]["cpu_seconds"]
        for tag, r in m["steps"].items():
            print(f"{name:14} {tag:16} {r.get('like', PRESET):7} {r['seconds']:8.1f} {r['cpu_seconds']:8.1f} "
                  f"{r['cpu_seconds'] / plain:11.2f} {r['peak_rss_mib']:12.0f} {r['load']:5.2f} "
                  f"{r.get('measured', ''):>8} {r.get('cached', ''):>7}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="target search wall time and memory (see the module docstring)")
    ap.add_argument("--model", action="append", choices=MODELS)
    ap.add_argument("--no-imatrix", action="store_true", help="no importance matrix (no IQ2/IQ3 candidates)")
    a = ap.parse_args()
    main(tuple(a.model or MODELS), not a.no_imatrix)
