"""``ggufkit ppl`` vs ``llama-perplexity`` on a Qwen3.5-shaped F16 model: tokens/s, whole process (issue 33).

The model: transformers' ``Qwen3_5ForCausalLM`` with random weights (speed does not depend on them), 12 layers
(9 gated delta-net layers with 4 key and 8 value heads of 128, 3 gated full-attention layers with 8 heads of
128 and 2 KV heads), d=768, FFN 2048, Qwen2's 151k BPE, untied head: about 210 M weights (88 M in the blocks),
converted to F16 by ggufkit. Both tools score the same text (the bundled sample), the same ``--ctx`` and
chunks, each in a fresh process timed from start to exit (imports, model load, tokenization, evaluation), with
the same thread count (``-t T`` for llama-perplexity, ``OMP_NUM_THREADS=T`` for torch), alternating over
rounds; the fastest round of each counts (on a shared machine a slow round measures the neighbours).
llama-perplexity runs ``-nr`` (no weight repacking, as the other benchmarks) and its default CPU path for the
delta-net layers (the fused ``ggml_gated_delta_net`` op); ggufkit the chunked gated delta rule
(eval/layers_delta_net.py, chunks of 64 tokens).

Run: ``python benchmarks/bench_ppl_qwen35.py [--threads T] [--ctx 512] [--chunks 4] [--rounds 2]``; prints the
CPU (model name, AVX2 / AVX-512), both tokens/s and the ratio ggufkit / llama.cpp (the issue asks >= 0.8).

Measured (2026-11-28, AMD EPYC, 2 cores, avx2 fma f16c, 2 threads, 2 x 512 tokens, one round, the machine shared
with eight other jobs, load average 17): ggufkit 362 s (2.8 tok/s) vs llama-perplexity 194 s (5.3 tok/s), ratio
0.53, PPL equal within 0.03 % (random weights). Quiet (same machine, nothing else running, 8 x 512 tokens, one
round): ggufkit 199.6 tok/s (20.5 s) vs llama-perplexity 206.9 tok/s (19.8 s), ratio 0.96.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def cpu_name() -> str:
    """The CPU model and its AVX2 / AVX-512 flags (/proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = set((re.search(r"^flags\s*:\s*(.+)$", info, re.M) or re.match("(.*)", "")).group(1).split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni") if f in flags]
    return f"{model.group(1).strip() if model else 'unknown CPU'} ({os.cpu_count()} cores; {' '.join(simd) or 'no AVX2'})"


def build(d: Path) -> Path:
    """The F16 model, built once per folder."""
    out = d / "qwen35-f16.gguf"
    if out.exists():
        return out
    import fixtures_models
    import test_family_qwen35  # noqa: F401  (registers the class with fixtures_models)

    from ggufkit.converters import convert

    fixtures_models._BASE["Qwen3_5ForCausalLM"] = SHAPE
    ckpt = fixtures_models.make_checkpoint(d / "ckpt", "Qwen3_5ForCausalLM", dtype="float16")
    convert(ckpt, out, outtype="f16")
    return out


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed: {r.stderr[-1500:]}")
    return wall, r.stdout + r.stderr


def main() -> None:
    from llama_cpp_sources import tool_path

    from ggufkit.eval.perplexity import sample_text

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ggufkit-bench-qwen35")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    model = build(args.dir)
    text = args.dir / "text.txt"
    text.write_text(sample_text() + "\n", encoding="utf-8")
    t = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}
    ours_cmd = [sys.executable, "-m", "ggufkit", "ppl", str(model), "-f", str(text), "-c", str(args.ctx),
                "--chunks", str(args.chunks), "--device", "cpu"]
    theirs_cmd = [str(tool_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(args.ctx),
                  "-b", str(args.ctx), "--chunks", str(args.chunks), "-t", t, "-nr"]
    best = {"ggufkit": float("inf"), "llama.cpp": float("inf")}
    ppl: dict[str, str] = {}
    for _ in range(args.rounds):
        for name, cmd in (("ggufkit", ours_cmd), ("llama.cpp", theirs_cmd)):
            wall, out = timed(cmd, env)
            best[name] = min(best[name], wall)
            m = re.search(r"(?:Final estimate: PPL = |PPL\s*[=:]\s*)([0-9.]+)", out)
            ppl[name] = m.group(1) if m else "?"
    tokens = args.ctx * args.chunks
    rate = {k: tokens / v for k, v in best.items()}
    print(f"CPU: {cpu_name()}; {args.threads} threads; {args.chunks} x {args.ctx} tokens; F16 {model.name} "
          f"({model.stat().st_size / 2**20:.0f} MiB)")
    for k in ("ggufkit", "llama.cpp"):
        print(f"  {k:9s}: {best[k]:7.2f} s whole process, {rate[k]:7.1f} tok/s, PPL {ppl[k]}")
    print(f"  ratio ggufkit / llama.cpp (tokens/s): {rate['ggufkit'] / rate['llama.cpp']:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
