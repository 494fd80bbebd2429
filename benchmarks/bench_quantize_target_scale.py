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

Steps, each a fresh ``ggufkit`` or ``llama-quantize`` process at ``THREADS`` threads, timed with its wall and
CPU (user + system, ``wait4``) seconds, its peak RSS (VmHWM, polled) and the 1-minute load average before it,
most telling first; the searches are proxy only (``--sensitivity off``: ``auto`` would also measure the KLD
sensitivity, these models being under 4e9 weights):

1. ``search cold``: ``ggufkit quantize F16 --target-like q4_k_m --imatrix IM --cache-dir EMPTY --dry-run``:
   measures every tensor x candidate (and the presets' types), plans, writes nothing;
2. ``search warm``: the same inputs, another size (``--target-like q3_k_m --dry-run``): all from the cache;
   it costs the model's SHA-256 (the cache key) and the plan;
3. ``target warm``: ``--target-like q3_k_m`` writing the file: the second target of a publisher's run;
4. ``plain ggufkit``: ``ggufkit quantize F16 OUT --type q4_k_m --imatrix IM``;
5. ``plain llama.cpp``: ``llama-quantize --imatrix IM F16 OUT Q4_K_M THREADS`` (``--no-llama`` skips it).

A first target that writes costs ``search cold`` + (``target warm`` - ``search warm``).

Numba's kernels are compiled (or loaded from its cache) first, on a tiny model, and not counted: that is
paid once per install.

Result (2026-11-27, Intel Xeon Processor (Sapphire Rapids: AVX2, FMA, F16C, AVX-512 F/BF16/VNNI/FP16, AMX
reported), 2 cores, 23 GiB, shared with five other jobs: the 1-minute load was 11-15 throughout, so wall times
are inflated ~3.5-5x and noisy; CPU seconds are the steadier number). Measurement version 2
(``ggufkit.quant.target.measure``: the grid types IQ2/IQ3 on 64 of the 256 sampled rows).

Synthetic LLaMA 1.1B (1,100,048,384 weights, 2.2 GB F16, 156 quantizable tensors, 18 candidate types each)::

    step               like     wall s   CPU s  load  peak RSS MiB   note
    search cold        q4_k_m    706.2   205.0  11.5   2294 (a)      2808 tensor x type pairs measured
    search warm        q3_k_m      9.3     2.9  14.8     -  (b)      0 measured, all cached
    target warm        q3_k_m    996.6   357.8  14.8    277         548300992 bytes (preset: 548408416) (c)
    plain ggufkit      q4_k_m    138.0    50.7  15.2    311         667819104 bytes
    plain llama.cpp    q4_k_m    507.7   168.9  14.3    442         667814752 bytes

(a) mostly the F16 file's pages mapped in while sampling rows (file-backed, reclaimable; the Python process
with Numba is ~400 MiB); (b) the VmHWM poll missed this short process's peak; (c) the search part is the
warm dry-run's 2.9 CPU s: the rest is quantizing the mix, which puts 16 tensors in IQ3_S, 2 in IQ2_XS and 49
in IQ4_XS (44 Q4_K, 44 Q6_K, 1 Q5_K): the grid quantizers cost ~10x Q4_K's per weight, so this second target
costs 7x the CPU of a plain Q4_K_M, not "little more" (a plain quantization of the same mix would cost the
same; it was not timed). The previous run's llama-quantize: 886.6 s wall, ~190 CPU s at load 14.1.
The cold search's CPU time was ~560 s with measurement version 1 (all 18 types on 256 rows; extrapolated from
48 of 156 tensors in the previous, killed run at a similar load): on a one-layer slice of this model, measured
interleaved in one process, the five tensor shapes cost 19.2 CPU s with version 1 and 7.5 with version 2
(2.5x; attn_q 2.49 -> 1.02, ffn_down 8.25 -> 2.97). The cold search is now 4.0x the CPU of
ggufkit's plain Q4_K_M (205 vs 50.7 s) and 1.2x llama-quantize's (168.9 s); in the slice,
the 13 non-grid types on 256 rows are now about half of it (attn_q: ~0.55 of 1.02 CPU s).

SmolLM2-135M (134,515,008 weights; 211 tensors, 1807 pairs; the grid types only fit the 30 ffn_down tensors,
rows of 1536), cold search in process (``quantize_to_target(..., dry_run=True)``, load 8-14)::

    measurement                                     cold CPU s   plan at Q4_K_M / Q3_K_M / Q2_K size
    A: grid types on all 256 rows (version 1)          84.2      reference
    B: grid types on 64 of them (version 2)            50.8      identical (0 of 211 tensors differ)
    C: like A on another row sample (255 rows)         85.0      identical; est. error +0.3/+1.6/+2.4 %

Those three plans hardly use the grid types (this F16 was made from a Q4_1 file, so Q4_1 re-creates it), so
the same caches were planned again without Q4_1/Q5_1/Q8_0/F16 (nothing measured): at 70 MB (all 30 ffn_down
in grid types) B's plan differs from A's in 2 of 211 tensors, its error under A's measurements is +0.07 %
(3.14094 vs 3.13887), and C's differs in 2 (+0.02 %); at 75 MB B's plan is A's, C's too; at 82 MB (no grid
type chosen) B's is A's, C's differs in 8 (+0.09 %). Per (tensor, grid type), B's relative error is within
0.84 % of A's at the median (p90 2.1 %, max 3.5 %), C's within 0.51 % (p90 1.35 %, max 2.6 %); for the other
types C's row sample alone moves them 0.66 % at the median (p90 4.0 %). The quarter sample costs about 1.6x
the row sample's own noise on the grid types, and changes no plan beyond what another row sample does.
The earlier run (version 1, load ~11.5, wall only): plain ggufkit Q4_K_M 142.8 s, plain llama.cpp 37.3 s,
cold target writing 658.8 s, warm target writing Q3_K_M's size 191.4 s, warm dry-run 9.5 s.

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
#: Proxy only: ``auto`` would also measure the KLD sensitivity on models up to 4e9 weights (both of these).
SENSITIVITY = "off"


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


def bench_model(name: str, f16: Path, im: Path | None, work: Path, steps: tuple[str, ...] = ("plain llama.cpp",)
                ) -> dict:
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
                                       str(cache), "--sensitivity", SENSITIVITY, "--json", *extra)))
        rows[tag].update({"like": like, "measured": rep["measured"], "cached": rep["cached"],
                          "predicted_size": rep["predicted_size"], "in_process_s": rep["seconds"]})

    # most telling first (a run cut short still has the search's cost)
    target("search cold", PRESET, "--dry-run")
    target("search warm", SECOND, "--dry-run")
    target("target warm", SECOND)
    step("plain ggufkit", _ggufkit(str(f16), str(out), "--type", PRESET, *ggufkit_im))
    if "plain llama.cpp" in steps:
        step("plain llama.cpp", [str(tool_path("llama-quantize")), *llama_im, str(f16), str(out), PRESET.upper(),
                                 str(THREADS)])
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
                                  "--sensitivity", SENSITIVITY,
                                  "--cache-dir", str(work / f"cache-tiny-{tag}"))).seconds
    return {"seconds": round(seconds, 1)}


def main(models: tuple[str, ...] = MODELS, with_imatrix: bool = True, llama: bool = True) -> dict:
    from _target_common import load, machine
    from real_models import real_model_path

    from ggufkit.quant.llama_quantize.pipeline import quantize_file

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
            rows = bench_model(name, f16, im, work, ("plain llama.cpp",) if llama else ())
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
    ap.add_argument("--no-llama", action="store_true", help="skip the plain llama-quantize step")
    a = ap.parse_args()
    main(tuple(a.model or MODELS), not a.no_imatrix, not a.no_llama)
