"""``ggufkit release`` vs the same steps as separate ggufkit commands vs a script of llama.cpp's tools.

The checkpoint is built here: a LLaMA with a tiny trained sentencepiece vocabulary (320 tokens) and
hidden 768, FFN 2048, 15 layers (>= 100M parameters), f16 safetensors. Every pipeline makes the same work
from it: an F16 master, an importance matrix on the calibration part of the bundled sample, four types
(Q4_K_M, Q5_K_M, Q6_K, Q8_0) with that imatrix, and for each type perplexity plus KL divergence against the
master on the evaluation part (ctx 512, CHUNKS chunks each):

* ``release``: one ``ggufkit release`` (the master is scored once; types compared with its stored top-K);
* ``ggufkit steps``: ``ggufkit convert``, ``ggufkit imatrix``, ``ggufkit quantize`` x4, ``ggufkit ppl
  --baseline`` x4 (each scores the master again, side by side);
* ``llama.cpp``: ``convert_hf_to_gguf.py``, ``llama-imatrix``, ``llama-quantize`` x4, ``llama-perplexity
  --kl-divergence-base`` once for the master, then ``--kl-divergence`` x4. llama.cpp's tools run with
  ``--no-repack`` where they accept it: on the development machine ggml's AMX repacking dies with SIGILL.

Each command runs in its own process (import costs included); Numba's kernels are compiled (and cached on
disk) once before timing. Run once: ``python benchmarks/bench_release.py [WORKDIR] [--no-steps]`` (``--no-steps``:
release and llama.cpp only); prints the wall times
and ratios as one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_cpp_sources import llama_cpp_dir, tool_path

CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=15, num_attention_heads=12,
              num_key_value_heads=12, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, vocab_size=320, hidden_act="silu",
              model_type="llama", architectures=["LlamaForCausalLM"], torch_dtype="float16")
TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0")
LLAMA_FTYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q8_0": "Q8_0"}
CTX = 512
CHUNKS = int(os.environ.get("BENCH_RELEASE_CHUNKS", "8"))
THREADS = os.cpu_count() or 1


def build_checkpoint(d: Path) -> int:
    """Write the checkpoint; returns its parameter count."""
    from fixtures_tokenizers import make_spm_tokenizer
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    make_spm_tokenizer(d, 320)
    (d / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    h, ff, n_layer, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"], 320
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float16),
                                      "model.norm.weight": np.ones(h, np.float16),
                                      "lm_head.weight": (rng.standard_normal((v, h)) * 0.05).astype(np.float16)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (ff, h)), ("mlp.up_proj", (ff, h)),
                            ("mlp.down_proj", (h, ff))):
            tensors[p + name + ".weight"] = (rng.standard_normal(shape) * 0.03).astype(np.float16)
        tensors[p + "input_layernorm.weight"] = np.ones(h, np.float16)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, np.float16)
    save_file(tensors, str(d / "model.safetensors"))
    return sum(t.size for t in tensors.values())


def run(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return time.perf_counter() - t


def main(work: Path, steps: bool = True) -> dict[str, object]:
    from ggufkit.release.plan import TextInput

    ck = work / "ck"
    n_params = build_checkpoint(ck)
    calib, evalt = work / "calibration.txt", work / "eval.txt"
    calib.write_text(TextInput.bundled("calibration").text, encoding="utf-8")
    evalt.write_text(TextInput.bundled("evaluation").text, encoding="utf-8")
    gk = [sys.executable, "-m", "ggufkit"]
    # Warm Numba's on-disk cache for these kernels (a user pays compilation once per machine).
    tiny = work / "warm"
    run([*gk, "release", str(ck), "-o", str(tiny), "--types", ",".join(TYPES), "--master", "f16", "--ctx", "64",
         "--chunks", "1", "--imatrix-chunks", "1", "--device", "cpu", "-q"])
    shutil.rmtree(tiny)
    times: dict[str, dict[str, float]] = {}

    # 1. ggufkit release
    out = work / "release"
    times["release"] = {"total": run([*gk, "release", str(ck), "-o", str(out), "--types", ",".join(TYPES),
                                      "--master", "f16", "--imatrix-text", str(calib), "--eval-text", str(evalt),
                                      "--ctx", str(CTX), "--chunks", str(CHUNKS), "--imatrix-chunks", str(CHUNKS),
                                      "--device", "cpu", "-q"])}

    # 2. the same steps as separate ggufkit commands
    if steps:
        d = work / "steps"
        d.mkdir()
        master = d / "master-f16.gguf"
        t: dict[str, float] = {}
        t["convert"] = run([*gk, "convert", str(ck), "-o", str(master), "--outtype", "f16", "--no-check", "-q"])
        t["imatrix"] = run([*gk, "imatrix", str(master), "-f", str(calib), "-o", str(d / "im.gguf"), "--ctx", str(CTX),
                            "--chunks", str(CHUNKS), "--no-ppl", "--device", "cpu", "-q"])
        for q in TYPES:
            t[f"quantize {q}"] = run([*gk, "quantize", str(master), str(d / f"{q}.gguf"), "--type", q, "--imatrix",
                                      str(d / "im.gguf"), "--device", "cpu", "-q"])
        for q in TYPES:
            t[f"ppl {q}"] = run([*gk, "ppl", str(d / f"{q}.gguf"), "--baseline", str(master), "-f", str(evalt), "--ctx",
                                 str(CTX), "--chunks", str(CHUNKS), "--device", "cpu", "-q"])
        t["total"] = sum(t.values())
        times["ggufkit steps"] = t

    # 3. llama.cpp's tools
    d = work / "llama"
    d.mkdir()
    master = d / "master-f16.gguf"
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    th = ["-t", str(THREADS)]
    t = {}
    t["convert_hf_to_gguf"] = run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(ck), "--outfile",
                                   str(master), "--outtype", "f16"], env=env)
    t["llama-imatrix"] = run([str(tool_path("llama-imatrix")), "-m", str(master), "-f", str(calib), "-c", str(CTX),
                              "--chunks", str(CHUNKS), "-o", str(d / "im.gguf"), "--no-ppl", *th, "--no-repack"])
    for q in TYPES:
        t[f"llama-quantize {q}"] = run([str(tool_path("llama-quantize")), "--imatrix", str(d / "im.gguf"),
                                        str(master), str(d / f"{q}.gguf"), LLAMA_FTYPES[q], str(THREADS)])
    common = ["-f", str(evalt), "-c", str(CTX), "--chunks", str(CHUNKS), *th, "--no-repack"]
    t["llama-perplexity base"] = run([str(tool_path("llama-perplexity")), "-m", str(master), *common,
                                      "--kl-divergence-base", str(d / "base.kld")])
    for q in TYPES:
        t[f"llama-perplexity {q}"] = run([str(tool_path("llama-perplexity")), "-m", str(d / f"{q}.gguf"), *common,
                                          "--kl-divergence-base", str(d / "base.kld"), "--kl-divergence"])
    t["total"] = sum(t.values())
    times["llama.cpp"] = t

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    r = times["release"]["total"]
    return {"parameters": n_params, "types": list(TYPES), "ctx": CTX, "chunks": CHUNKS, "threads": THREADS,
            "cpu": cpu, "avx2": " avx2" in flags, "avx512f": " avx512f" in flags, "seconds": times,
            "ratios": {**({"release / ggufkit steps": r / times["ggufkit steps"]["total"]} if steps else {}),
                       "release / llama.cpp": r / times["llama.cpp"]["total"]}}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-steps"]
    with_steps = "--no-steps" not in sys.argv[1:]
    if args:
        base = Path(args[0])
        base.mkdir(parents=True, exist_ok=True)
        print(json.dumps(main(base, with_steps), indent=2))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-release-") as tmp:
            print(json.dumps(main(Path(tmp), with_steps), indent=2))
