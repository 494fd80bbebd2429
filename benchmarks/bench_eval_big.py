"""``ggufkit ppl`` and ``ggufkit imatrix`` on the DeepSeek-V3-shaped model vs ``llama-perplexity`` /
``llama-imatrix`` (issue 32, "Scale": they must run in 24 GB, weights kept quantized and dequantized per layer).

The model is bench_convert_fp8.py's FP8 checkpoint (DeepseekV3ForCausalLM, hidden 7168, MLA ranks 1536/512, 128
heads, 2 MoE layers of 32 routed experts of 2048 + a shared expert, groups 8/4, top-8, GPT-2's 50257-token
vocabulary; 4.0 G weights), converted by ggufkit to Q4_K_M and to BF16. On each file both tools run in a fresh
process each (whole process: imports, load, tokenization, evaluation), alternating, on the bundled sample text
with the same ``-c 512 --chunks 2`` and the same thread count (all cores: torch through OMP_NUM_THREADS, llama.cpp
``-t``), llama.cpp with its defaults otherwise. A small Python parent reports each child's wall time, CPU time
and peak RSS (``ru_maxrss``, file-backed pages of the mapped model included, for both tools). PPL of both are
printed, and the two importance matrices compared (same entries; relative L2 of all ``in_sum2``). ggufkit also
runs once with its float cache off (``GGUFKIT_EVAL_FLOAT_CACHE_MB=0``: only the block in flight dequantized).
Every step runs under ``flock /tmp/heavy.lock`` (one heavy job at a time on a shared machine).

Measured 2026-11-28 on the Q4_K_M file (2.30 GiB). The shared 2-core machine's heavy lock was held by another
hour-long benchmark, so the comparison ran on a lent GPU machine's CPU: "Intel(R) Xeon(R) Processor" (AVX-512),
16 cores, 128 GiB, load average 0.0-4.7, 16 threads, the file rebuilt there from a thin copy
(``--thin`` / ``--compare-thin``: every tensor's first 64 rows repeated to its full shape, so every expert is
alike; memory and time do not depend on the values), ggufkit's float cache set to what it takes by default on a
24 GiB machine (``GGUFKIT_BENCH_FLOAT_CACHE_MB=5376``, a quarter of ~21 GiB available):

=============================  ======  =======  ============
run                            wall s  CPU s    peak RSS GiB
=============================  ======  =======  ============
llama-perplexity                  7.3     70.6          4.04
ggufkit ppl                      15.1     87.8          8.34
llama-imatrix                     9.9     96.9          4.14
ggufkit imatrix                  14.7    100.2          8.01
ggufkit ppl, float cache 0       12.9     89.2          5.06
=============================  ======  =======  ============

ppl / llama-perplexity: wall 2.06x, CPU 1.24x, peak RSS 2.06x (1.25x with the float cache off); imatrix /
llama-imatrix: wall 1.49x, CPU 1.03x, RSS 1.93x (Intel Xeon, AVX-512, 16 threads). ggufkit's peak is 15.7 GiB
(imatrix 16.0 GiB) under 24 GiB; 18.9 GiB under it without the float cache. PPL 104158.34 vs llama-perplexity's
104810.19 (-0.62 %: llama.cpp rounds the activations to Q8_K for Q4_K/Q6_K weights, ggufkit multiplies float32;
random tiled weights); the imatrix files hold the same entries, ``in_sum2`` relative L2 8.5e-3. The 3.3 GiB
between the float-cache runs is the cache (every dense matrix and the head kept as float32 for the next forward
pass; two chunks are one pass, so here it buys nothing). ``--device cuda`` on the H200 (``--cuda``): ppl 9.8 s,
imatrix 10.1 s, peak CUDA allocation 4.02 GiB for the 2.30 GiB file (the rest: the head's 32768-row float chunk
and its dequantization, the largest single step), host RSS 3.5 GiB; PPL 104158.3926 vs 104158.3416 on the CPU.
Before eval/dequant.py's in-place Q4_K/Q6_K kernels the same runs peaked at 4.68 GiB CUDA, 6.05 GiB RSS (cache 0)
and 9.35 GiB RSS (default). The run on the shared 2-core machine (AMD EPYC Zen 3, AVX2, no AVX-512) is the
command below; its Q4_K_M conversion took 17:21 min wall at load 14-15, peak RSS 2.55 GiB.

Measured again 2026-11-29 on the shared machine, AMD EPYC Zen 3 (AVX2, no AVX-512), 2 cores, 2 threads, load
average 3.4-5.2 (other sessions' jobs), after the float cache stopped filling on a run's last forward pass (two
chunks in one batch: one pass, so it now keeps nothing); Q4_K_M built here (checkpoint 5 min, conversion 3 min):

===============================  ======  =======  ============
run                              wall s  CPU s    peak RSS GiB
===============================  ======  =======  ============
llama-perplexity                   56.7     58.1          4.04
ggufkit ppl                       167.0    132.8         11.63
llama-imatrix                      93.2     75.0          4.14
ggufkit imatrix                   138.7    120.7          8.80
ggufkit ppl, float cache 0        147.2    102.1          6.96
===============================  ======  =======  ============

ppl / llama-perplexity: wall 2.95x, CPU 2.29x, RSS 2.88x; imatrix: wall 1.49x, CPU 1.61x, RSS 2.13x. PPL 142377.9079
vs 142927.0305 (-0.384 %), the same with the cache off; imatrix same entries, in_sum2 rel L2 8.52e-3. These
whole-process peaks are the CLI's: ggufkit/cli/_malloc.py keep_freed_memory keeps freed blocks in glibc's heap,
and the heap then grows with fragmentation run to run (in one process, random 2 x 512 tokens and the
default float cache: 5.55 GiB without that tuning, 9.46 GiB with it). In one process without it: before the
change 7.13 GiB (2.94 GiB of floats held after the pass), now 5.55 GiB (none held), float cache 0 4.86 GiB (the
rest: with a cache budget the head is still dequantized whole, as before, so its logits are the same floats).

Run: ``python benchmarks/bench_eval_big.py /tmp/scaleeval`` (keeps the checkpoint and GGUF files there between
runs; delete it afterwards: ~4 GB checkpoint, 2.3 GB Q4_K_M, 8 GB BF16) or ``python -m pytest
benchmarks/bench_eval_big.py --benchmark-enable -s`` (a temporary folder). ``GGUFKIT_BENCH_OUTTYPES`` picks the
files (default ``q4_k_m,bf16``). Not part of CI.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CTX, CHUNKS = 512, 2
THREADS = int(os.environ.get("GGUFKIT_BENCH_THREADS", os.cpu_count() or 1))
OUTTYPES = os.environ.get("GGUFKIT_BENCH_OUTTYPES", "q4_k_m,bf16").split(",")
LIMIT = 24 * 2**30  # the machine

_RUN = ("import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "with open(sys.argv[1], 'w') as log:\n"
        "    rc = subprocess.run(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT).returncode\n"
        "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': rc, 'wall': time.perf_counter() - t, 'cpu': u.ru_utime + u.ru_stime,"
        " 'rss': u.ru_maxrss * 1024}))\n")


@contextlib.contextmanager
def heavy() -> Iterator[None]:
    """Hold /tmp/heavy.lock (the lock ``flock /tmp/heavy.lock`` takes; ``GGUFKIT_BENCH_LOCK``: another file)
    while a heavy step runs."""
    with open(os.environ.get("GGUFKIT_BENCH_LOCK", "/tmp/heavy.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Wall s, CPU s and peak RSS bytes of ``cmd`` in a fresh process; its output goes to ``log``."""
    out = subprocess.run([sys.executable, "-c", _RUN, str(log), *cmd], capture_output=True, text=True, env=env,
                         check=True)
    result = json.loads(out.stdout)
    if result["rc"]:
        raise RuntimeError(f"{cmd[:4]} exited {result['rc']}: {log.read_text()[-2000:]}")
    return result


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def prepare(work: Path, outtypes: list[str]) -> dict[str, Path]:
    """The checkpoint (bench_convert_fp8.py's builder) and ggufkit's conversion of it to each outtype, kept in
    ``work`` (built only when missing)."""
    from bench_convert_fp8 import build_checkpoint

    ckpt = work / "ckpt"
    if not (ckpt / "model.safetensors.index.json").exists():
        with heavy():
            build_checkpoint(ckpt)
    files = {}
    for outtype in outtypes:
        files[outtype] = work / f"{outtype}.gguf"
        if not files[outtype].exists():
            with heavy():
                subprocess.run([sys.executable, "-m", "ggufkit", "convert", str(ckpt), "-o", str(files[outtype]),
                                "--outtype", outtype, "--quiet", "--no-check"], check=True)
    return files


def _llama_ppl(log: Path) -> float:
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", log.read_text())
    return float(found.group(1)) if found else float("nan")


def _ours_json(log: Path) -> dict:
    text = log.read_text()
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


def imatrix_difference(ours: Path, theirs: Path) -> tuple[bool, float]:
    """(same entry names, relative L2 of all in_sum2 together) of two imatrix files."""
    from ggufkit.quant.imatrix.collector import read_raw_imatrix

    a, b = read_raw_imatrix(ours).entries, read_raw_imatrix(theirs).entries
    names = sorted(set(a) & set(b))
    x = np.concatenate([a[n][0].ravel().astype(np.float64) for n in names])
    y = np.concatenate([b[n][0].ravel().astype(np.float64) for n in names])
    return sorted(a) == sorted(b), float(np.linalg.norm(x - y) / np.linalg.norm(y))


def llama_tool(name: str) -> Path:
    """llama.cpp's built tool ``name`` (``GGUFKIT_BENCH_LLAMA_BIN``: another folder of them)."""
    from llama_cpp_sources import tool_path

    folder = os.environ.get("GGUFKIT_BENCH_LLAMA_BIN")
    return Path(folder) / name if folder else tool_path(name)


def run(work: Path, outtypes: list[str] = OUTTYPES, report: Callable[[str], None] = print) -> dict[str, dict]:
    """Build the files (when missing) and measure both tools on each; returns ``{outtype: {run: numbers}}``."""
    work.mkdir(parents=True, exist_ok=True)
    return compare(prepare(work, outtypes), work, report)


def compare(files: dict[str, Path], work: Path, report: Callable[[str], None] = print) -> dict[str, dict]:
    """Both tools on each file, alternating (module docstring); ``GGUFKIT_BENCH_FLOAT_CACHE_MB`` sets ggufkit's
    float cache for its main runs (default: its own, a quarter of the available RAM)."""
    from bench_convert_fp8 import cpu_name

    from ggufkit.eval.perplexity import sample_text

    text = work / "text.txt"
    text.write_text(sample_text() + "\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    ours_env = dict(env)
    if os.environ.get("GGUFKIT_BENCH_FLOAT_CACHE_MB"):
        ours_env["GGUFKIT_EVAL_FLOAT_CACHE_MB"] = os.environ["GGUFKIT_BENCH_FLOAT_CACHE_MB"]
    no_cache = {**env, "GGUFKIT_EVAL_FLOAT_CACHE_MB": "0"}
    common = ["-f", str(text), "-c", str(CTX), "--chunks", str(CHUNKS)]
    cpu, results = cpu_name(), {}
    for outtype, model in files.items():
        m = str(model)
        steps: list[tuple[str, list[str], dict[str, str]]] = [
            ("llama-perplexity", [str(llama_tool("llama-perplexity")), "-m", m, *common, "-t", str(THREADS)], env),
            ("ggufkit ppl", [sys.executable, "-m", "ggufkit", "ppl", m, *common, "--device", "cpu", "--json"],
             ours_env),
            ("llama-imatrix", [str(llama_tool("llama-imatrix")), "-m", m, *common, "-t", str(THREADS), "-o",
                               str(work / f"theirs-{outtype}.imatrix.gguf")], env),
            ("ggufkit imatrix", [sys.executable, "-m", "ggufkit", "imatrix", m, *common, "--device", "cpu", "--json",
                                 "-o", str(work / f"ours-{outtype}.imatrix.gguf")], ours_env),
            ("ggufkit ppl, float cache 0", [sys.executable, "-m", "ggufkit", "ppl", m, *common, "--device", "cpu",
                                            "--json"], no_cache)]
        got: dict[str, dict] = {}
        for name, cmd, step_env in steps:
            log = work / f"{outtype}-{name.replace(' ', '_').replace(',', '')}.log"
            with heavy():
                load = load_average()
                got[name] = {**measure(cmd, log, step_env), "load": load, "log": str(log)}
            report(f"{outtype} {name}: {got[name]['wall']:.1f} s wall, {got[name]['cpu']:.1f} s CPU, peak RSS "
                   f"{got[name]['rss'] / 2**30:.2f} GiB (load {load})")
        ppl_ours = float(_ours_json(Path(got["ggufkit ppl"]["log"]))["ppl"])
        ppl_theirs = _llama_ppl(Path(got["llama-perplexity"]["log"]))
        same, rel = imatrix_difference(work / f"ours-{outtype}.imatrix.gguf", work / f"theirs-{outtype}.imatrix.gguf")
        got["summary"] = {"ppl_ggufkit": ppl_ours, "ppl_llama": ppl_theirs, "imatrix_same_entries": same,
                          "imatrix_rel_l2": rel, "cpu": cpu, "threads": THREADS}
        for ours, theirs in (("ggufkit ppl", "llama-perplexity"), ("ggufkit imatrix", "llama-imatrix")):
            a, b = got[ours], got[theirs]
            report(f"{outtype} {ours} / {theirs} on {cpu}, {THREADS} threads: wall {a['wall'] / b['wall']:.2f}x, CPU "
                   f"{a['cpu'] / b['cpu']:.2f}x, peak RSS {a['rss'] / b['rss']:.2f}x; ggufkit's peak "
                   f"{(LIMIT - a['rss']) / 2**30:.1f} GiB under 24 GiB")
        report(f"{outtype}: PPL ggufkit {ppl_ours:.4f} vs llama-perplexity {ppl_theirs:.4f} "
               f"({100 * (ppl_ours / ppl_theirs - 1):+.3f} %); imatrix same entries {same}, in_sum2 rel L2 {rel:.2e}")
        for name in got:
            if name != "summary":
                assert got[name]["rss"] < LIMIT, (outtype, name, got[name]["rss"])
        results[outtype] = got
    return results


def thin_copy(src: Path, dst: Path, rows: int = 64) -> None:
    """A small GGUF with ``src``'s metadata and the first ``rows`` rows of each tensor, the full shapes in the key
    ``bench.shapes`` (JSON): what travels to a GPU machine, where :func:`expand` rebuilds a file of the full size
    (each tensor its rows repeated; the values do not matter to memory)."""
    from gguf import GGUFValueType

    from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf

    with open_gguf(src) as f:
        meta = Metadata()
        for key, kv in f.kv.items():
            meta.put(key, kv)
        meta.set("bench.shapes", GGUFValueType.STRING, json.dumps({t.name: list(t.shape) for t in f.tensors}))
        specs, data = [], []
        for t in f.tensors:
            n_rows = int(np.prod(t.shape[:-1]))
            k = min(rows, n_rows)
            specs.append(TensorSpec(t.name, t.ggml_type, (k, t.shape[-1]) if len(t.shape) > 1 else t.shape))
            data.append(np.frombuffer(f.raw(t), np.uint8).reshape(n_rows, -1)[:k].copy())
        write_gguf(dst, meta, specs, data)


def expand(thin: Path, dst: Path) -> None:
    """The full-size GGUF of a :func:`thin_copy`: every tensor its kept rows repeated to its full shape."""
    from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf

    with open_gguf(thin) as f:
        shapes = json.loads(f.get("bench.shapes"))
        meta = Metadata()
        for key, kv in f.kv.items():
            if key != "bench.shapes":
                meta.put(key, kv)
        specs = [TensorSpec(t.name, t.ggml_type, tuple(shapes[t.name])) for t in f.tensors]

        def pieces(t: Any, shape: list[int]) -> Iterator[np.ndarray]:
            kept = np.frombuffer(f.raw(t), np.uint8).reshape(int(np.prod(t.shape[:-1])), -1)
            n_rows = int(np.prod(shape[:-1]))
            step = max(1, (64 << 20) // kept.nbytes) * kept.shape[0]
            for a in range(0, n_rows, step):
                n = min(step, n_rows - a)
                yield np.tile(kept, (-(-n // kept.shape[0]), 1))[:n]

        write_gguf(dst, meta, specs, (pieces(t, shapes[t.name]) for t in f.tensors))


_CUDA_PEAK = ("import atexit, runpy, sys, torch\n"
              "atexit.register(lambda: print('CUDA_PEAK_BYTES', torch.cuda.max_memory_allocated(), flush=True))\n"
              "sys.argv = ['ggufkit', *sys.argv[1:]]\n"
              "runpy.run_module('ggufkit', run_name='__main__', alter_sys=True)\n")


def run_cuda(thin: Path, work: Path, report: Callable[[str], None] = print) -> dict[str, dict]:
    """On a GPU machine: rebuild the full-size file from ``thin`` and run ``ggufkit ppl`` / ``imatrix`` with
    ``--device cuda`` (and ``ppl`` on the CPU), each in a fresh process: wall, peak RSS and torch's peak CUDA
    allocation beside the file size."""
    from ggufkit.eval.perplexity import sample_text

    work.mkdir(parents=True, exist_ok=True)
    model = work / "model.gguf"
    expand(thin, model)
    size = model.stat().st_size
    text = work / "text.txt"
    text.write_text(sample_text() + "\n", encoding="utf-8")
    common = ["-f", str(text), "-c", str(CTX), "--chunks", str(CHUNKS), "--json"]
    got: dict[str, dict] = {}
    for name, args in (("ppl cuda", ["ppl", str(model), *common, "--device", "cuda"]),
                       ("imatrix cuda", ["imatrix", str(model), *common, "--device", "cuda", "-o",
                                         str(work / "imatrix.gguf")]),
                       ("ppl cpu", ["ppl", str(model), *common, "--device", "cpu"])):
        log = work / f"{name.replace(' ', '_')}.log"
        got[name] = measure([sys.executable, "-c", _CUDA_PEAK, *args], log)
        found = re.search(r"CUDA_PEAK_BYTES (\d+)", log.read_text())
        got[name]["cuda_peak"] = int(found.group(1)) if found else 0
        if name.startswith("ppl"):
            got[name]["ppl"] = float(_ours_json(log)["ppl"])
        report(f"{name}: {got[name]['wall']:.1f} s, peak RSS {got[name]['rss'] / 2**30:.2f} GiB, peak CUDA "
               f"{got[name]['cuda_peak'] / 2**30:.2f} GiB (file {size / 2**30:.2f} GiB)"
               + (f", PPL {got[name]['ppl']:.4f}" if "ppl" in got[name] else ""))
    return got


def test_ppl_and_imatrix_of_the_deepseek_v3_shaped_model_vs_llama_cpp(benchmark, tmp_path: Path) -> None:
    results: dict[str, dict] = {}
    benchmark.pedantic(lambda: results.update(run(tmp_path)), rounds=1, iterations=1)
    benchmark.extra_info.update({k: {n: {x: y for x, y in v.items() if x != "log"} for n, v in r.items()}
                                 for k, r in results.items()})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--thin"]:  # python bench_eval_big.py --thin MODEL.gguf THIN.gguf
        thin_copy(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    if sys.argv[1:2] == ["--compare-thin"]:  # python bench_eval_big.py --compare-thin THIN.gguf WORKDIR
        work = Path(sys.argv[3])
        work.mkdir(parents=True, exist_ok=True)
        expand(Path(sys.argv[2]), work / "tiled.gguf")
        out = compare({"q4_k_m-tiled": work / "tiled.gguf"}, work)
    elif sys.argv[1:2] == ["--cuda"]:  # python bench_eval_big.py --cuda THIN.gguf WORKDIR (on the GPU machine)
        out = run_cuda(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        out = run(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/bench-eval-big"))
    print(json.dumps(out, indent=1, default=str))
