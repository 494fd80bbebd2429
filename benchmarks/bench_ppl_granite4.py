"""``ggufkit ppl`` vs ``llama-perplexity`` on a Granite-4-shaped (``granitehybrid``) F16 model: tokens/s, whole
process, same threads, same text (issue 33: at least 0.8x llama-perplexity's tokens/s on the CPU).

The model is transformers' own GraniteMoeHybridForCausalLM with random weights (speed does not depend on them),
Granite 4.0 H Micro's layout scaled to about 175 M weights: d=768, 16 layers of which 3 attend (12/4 heads,
no RoPE), Mamba2 mixers of 24 heads x 64 (inner 1536, state 128, one group), a dense SiLU FFN of 2048, GPT-2's
50257-token BPE (embedding padded to 50264, tied head); converted to F16 by ggufkit (the bytes llama.cpp's
converter writes). Both tools run in a fresh process each, whole process included (imports, model load,
tokenization, evaluation), on the bundled sample text with the same ``-c``/``--chunks`` and thread count (all
cores, or ``GGUFKIT_BENCH_THREADS``; torch through OMP_NUM_THREADS, llama-perplexity ``-t``), alternating over
``GGUFKIT_BENCH_ROUNDS`` rounds; the fastest round of each counts (on a shared machine a slow round measures the
neighbours). llama-perplexity runs ``-nr`` (no weight repacking: the plain CPU kernels) and its defaults
otherwise; ggufkit its defaults (float32). The CPU (model name, AVX2 / AVX-512) is printed with the ratio.

Measured (2026-11-28, AMD EPYC, 2 cores, avx2 fma f16c, 2 threads, the machine shared with eight other jobs,
1-min load average 14-17, one round of 2 x 512 tokens): ggufkit 10.3 tok/s vs llama-perplexity 17.8 tok/s (ratio
0.58), and after the scan's launch count was cut 8.0 vs 13.7 tok/s (0.58) at a higher load; PPL equal within
0.0005 %. Below the issue's 0.8: in-process profiles under that load put a third of ggufkit's time in the
chunked scan's element-wise kernels (each launch costs tens of milliseconds when the cores are oversubscribed)
and most of the rest in the F16 matmuls. Quiet (same machine, nothing else running, one round): 2 x 512 tokens
119.9 vs 234.1 tok/s (0.51: ggufkit's fixed start-up of ~4 s weighs on a 4 s run); 8 x 512 tokens 223.1 vs 297.9
tok/s (0.75); 16 x 512 tokens 245.0 vs 331.9 tok/s (0.74: the gap is the steady state, not the start-up), PPL
equal within 0.0001 % (2026-11-28, later session).
After the scan's rewrite (eval/layers_mamba2.py: decays as running products, no copies, one matmul per chunk for
the states; half the scan's CPU time), 16 x 512 tokens, 2 rounds, 1-min load average 4-6 falling to 2 (the
machine nearly quiet): ggufkit 281.1 tok/s (29.1 s) vs llama-perplexity 349.5 tok/s (23.4 s), ratio 0.80; PPL
equal within 0.0001 % (2026-11-28, session 41). In-process, one thread, CPU time per 4 x 512 batch: 12.5 s before,
10.7 s after; the matmuls (oneDNN) are now ~80 % of it. The same command on the quiet machine (nothing else
running, 2 rounds): ggufkit 336.8 tok/s (24.3 s) vs llama-perplexity 394.9 tok/s (20.7 s), ratio 0.85; PPL
33053.6418 vs 33053.6843.

Run: ``python -m pytest benchmarks/bench_ppl_granite4.py --benchmark-enable -s`` (not part of CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CTX = 512
CHUNKS = int(os.environ.get("GGUFKIT_BENCH_CHUNKS", 4))
ROUNDS = int(os.environ.get("GGUFKIT_BENCH_ROUNDS", 2))
THREADS = int(os.environ.get("GGUFKIT_BENCH_THREADS", os.cpu_count() or 1))
SHAPE = dict(vocab_size=50264, hidden_size=768, intermediate_size=2048, shared_intermediate_size=2048,
             num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4, num_local_experts=0,
             num_experts_per_tok=0, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
             mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=True, position_embedding_type="nope",
             embedding_multiplier=12.0, logits_scaling=3.0, residual_multiplier=0.22, attention_multiplier=0.0156,
             max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=50256, eos_token_id=50256,
             layer_types=["attention" if i in (4, 9, 14) else "mamba" for i in range(16)])


def cpu_name() -> str:
    """The CPU's model name and its AVX2 / AVX-512 support (/proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    found = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    flags = set(found.group(1).split()) if found else set()
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model.group(1).strip() if model else 'unknown CPU'} ({os.cpu_count()} cores; {' '.join(simd) or 'no AVX2'})"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("bench_granite4"))


def build(d: Path) -> Path:
    """The F16 model in folder ``d`` (also benchmarks/gpu_hybrid_vs_llama_cpp.py's)."""
    import torch
    import transformers
    from fixtures_models import _write_tokenizer, randomize

    from ggufkit.converters import convert

    ckpt = d / "granite-4-bench"
    ckpt.mkdir()
    _write_tokenizer(ckpt, "real:gpt-2")
    config = transformers.GraniteMoeHybridConfig(**SHAPE)
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    model = transformers.GraniteMoeHybridForCausalLM(config)
    randomize(model, 0, std=0.02)  # every parameter set (a fresh model's init leaves some to torch.empty)
    model = model.to(torch.bfloat16)
    model.save_pretrained(ckpt)
    del model
    return Path(convert(ckpt, d / "granite4-f16.gguf", outtype="f16").outputs[0])


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - t, r.stdout + r.stderr


def test_cpu_tokens_per_second_vs_llama_perplexity(benchmark, model_file: Path, tmp_path: Path) -> None:
    from llama_cpp_sources import tool_path

    from ggufkit.eval.perplexity import sample_text
    from ggufkit.format import open_gguf

    with open_gguf(model_file) as f:
        n_weights = sum(t.n_elements for t in f.tensors)
    text = tmp_path / "text.txt"
    text.write_text(sample_text() + "\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    ours_cmd = [sys.executable, "-m", "ggufkit", "ppl", str(model_file), "-f", str(text), "-c", str(CTX),
                "--chunks", str(CHUNKS), "--device", "cpu", "--json"]
    theirs_cmd = [str(tool_path("llama-perplexity")), "-m", str(model_file), "-f", str(text), "-c", str(CTX),
                  "--chunks", str(CHUNKS), "-t", str(THREADS), "-nr"]
    results: dict[str, list[tuple[float, str]]] = {"llama.cpp": [], "ggufkit": []}

    def both() -> None:
        # Alternate the tools so that a burst of load from elsewhere hits both; the best round counts.
        results["llama.cpp"].append(_timed(theirs_cmd, env))
        results["ggufkit"].append(_timed(ours_cmd, env))

    benchmark.pedantic(both, rounds=ROUNDS, iterations=1)
    best = {tool: min(runs) for tool, runs in results.items()}
    n = CTX * CHUNKS
    ours, theirs = n / best["ggufkit"][0], n / best["llama.cpp"][0]
    ppl_ours = float(json.loads(best["ggufkit"][1][best["ggufkit"][1].index("{"):])["ppl"] or "nan")
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", best["llama.cpp"][1])
    ppl_theirs = float(found.group(1)) if found else float("nan")
    cpu = cpu_name()
    benchmark.extra_info.update(ggufkit_tokens_per_s=ours, llama_cpp_tokens_per_s=theirs, ratio=ours / theirs,
                                ppl_ggufkit=ppl_ours, ppl_llama_cpp=ppl_theirs, threads=THREADS, cpu=cpu,
                                weights=n_weights)
    print(f"\ngranitehybrid F16, {n_weights / 1e6:.0f} M weights, {CHUNKS} x {CTX} tokens, {cpu}, {THREADS} threads:"
          f" ggufkit {ours:.1f} tok/s ({best['ggufkit'][0]:.1f} s), llama-perplexity {theirs:.1f} tok/s "
          f"({best['llama.cpp'][0]:.1f} s), ratio {ours / theirs:.2f} (whole process); "
          f"PPL {ppl_ours:.4f} vs {ppl_theirs:.4f} ({100 * (ppl_ours / ppl_theirs - 1):+.3f}%)")
