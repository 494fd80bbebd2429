"""``ggufkit convert`` vs llama.cpp's ``convert_hf_to_gguf.py``: wall time and peak RSS, side by side, one run.

The checkpoint is built here: a LLaMA with a tiny (trained sentencepiece) vocabulary and big layers, bf16,
two safetensors shards with an index, >= 1 GB. Each converter runs in its own fresh process, wrapped by a
small Python parent that reports the child's ``ru_maxrss``, so import costs and peak memory are measured the
way a user experiences them. llama.cpp's converter comes from the llama-cpp-python 0.3.36 sdist's vendored
tree (``tests/llama_cpp_sources.py``), run with its own gguf-py on PYTHONPATH.

For ``q4_k_m``, which llama.cpp's converter cannot write, its side is the user's two-step pipeline: convert to
f16, then ``llama_model_quantize`` (llama-quantize's library entry point in llama-cpp-python's libllama); time
is the sum of both processes, peak RSS the larger.

Run: ``python -m pytest benchmarks/bench_convert.py --benchmark-enable -s`` (not part of CI). Targets: at
most half llama.cpp's time and half its peak RSS; the ratios are printed and stored in ``extra_info``, with
each converter's time over the I/O floor (``cat`` of the shards into one file, then ``sync``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_cpp_sources import llama_cpp_dir

#: hidden 2048, FFN 8192, 9 layers, GQA 16/4: 9 x (2048 x (2048 + 2 x 512 + 2048) + 3 x 2048 x 8192) params: 1.09 GB in bf16.
CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=9, num_attention_heads=16,
              num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, vocab_size=320, hidden_act="silu",
              model_type="llama", architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")

_RUN = ("import resource, subprocess, sys, time\n"
        "t = time.perf_counter(); rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL,"
        " stderr=subprocess.DEVNULL).returncode\n"
        "print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n")


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def build_checkpoint(d: Path) -> int:
    """Write the benchmark checkpoint into ``d``; returns its weight bytes."""
    from fixtures_tokenizers import make_spm_tokenizer
    d.mkdir(parents=True, exist_ok=True)
    make_spm_tokenizer(d, 320)
    (d / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    h, ff, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], 4 * 128
    n_layer = CONFIG["num_hidden_layers"]
    weight_map, total = {}, 0
    for shard, layers in enumerate((range(0, n_layer // 2), range(n_layer // 2, n_layer))):
        tensors: dict[str, np.ndarray] = {}
        if shard == 0:
            tensors["model.embed_tokens.weight"] = _bf16(rng, (320, h))
        else:
            tensors["model.norm.weight"] = _bf16(rng, (h,))
            tensors["lm_head.weight"] = _bf16(rng, (320, h))
        for i in layers:
            p = f"model.layers.{i}."
            for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                                ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                                ("mlp.gate_proj", (ff, h)), ("mlp.up_proj", (ff, h)), ("mlp.down_proj", (h, ff))):
                tensors[p + name + ".weight"] = _bf16(rng, shape)
            tensors[p + "input_layernorm.weight"] = _bf16(rng, (h,))
            tensors[p + "post_attention_layernorm.weight"] = _bf16(rng, (h,))
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_bf16(tensors, d / name)
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({k: name for k in tensors})
        del tensors
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    return total


def save_bf16(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file of BF16 tensors given as uint16 bits (safetensors.numpy has no bfloat16)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for arr in tensors.values():
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``cmd`` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _RUN, *cmd], capture_output=True, text=True, env=env, check=True)
    rc, seconds, rss = out.stdout.split()
    if rc != "0":
        raise RuntimeError(f"{cmd[:3]} exited {rc}")
    return float(seconds), int(rss)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench") / "big-llama"
    size = build_checkpoint(d)
    assert size >= 1_000_000_000
    return d


#: llama.cpp's converter has no K-quant outtypes: a user converts to f16, then runs llama-quantize (here its
#: library entry point, llama_model_quantize, from llama-cpp-python's bundled libllama).
_LLAMA_QUANTIZE = ("import ctypes, sys, llama_cpp\n"
                   "p = llama_cpp.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3])\n"
                   "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
                   "ctypes.byref(p)))\n")
_LLAMA_FTYPES = {"q4_k_m": 15}  # LLAMA_FTYPE_MOSTLY_Q4_K_M


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_k_m"])
def test_convert_time_and_peak_rss_vs_llama_cpp(benchmark, checkpoint: Path, outtype: str, tmp_path: Path) -> None:
    llama_cpp = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    ours_cmd = [sys.executable, "-m", "ggufkit", "convert", str(checkpoint), "-o", str(tmp_path / "ours.gguf"),
                "--outtype", outtype, "--quiet", "--no-check"]
    two_step = outtype in _LLAMA_FTYPES
    theirs_out = tmp_path / ("theirs-f16.gguf" if two_step else "theirs.gguf")
    theirs_cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile",
                  str(theirs_out), "--outtype", "f16" if two_step else outtype]
    quantize_cmd = [sys.executable, "-c", _LLAMA_QUANTIZE, str(theirs_out), str(tmp_path / "theirs.gguf"),
                    str(_LLAMA_FTYPES.get(outtype, 0))]
    # Numba compiles (and caches) the kernels once; a user pays that once per machine, not per run.
    subprocess.run([sys.executable, "-c", "import numpy as np; from ggufkit.quant import quantize; "
                    "from gguf import GGMLQuantizationType as Q; "
                    "[quantize(np.ones((1, 256), np.float32), t) for t in (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)]"],
                   check=True)
    results: dict[str, tuple[float, int]] = {}
    shards = sorted(str(p) for p in checkpoint.glob("*.safetensors"))
    floor_out = tmp_path / "floor.bin"
    # The I/O floor: the same bytes read and written once, and on disk (sync) before the clock stops.
    floor_cmd = ["sh", "-c", 'out="$1"; shift; cat "$@" > "$out" && sync "$out"', "sh", str(floor_out), *shards]

    def run_both() -> None:
        results["ggufkit"] = measure(ours_cmd)
        (tmp_path / "ours.gguf").unlink()
        seconds, rss = measure(theirs_cmd, env)
        if two_step:
            # The user's pipeline: its time is the sum, its peak the larger of the two processes'.
            q_seconds, q_rss = measure(quantize_cmd)
            seconds, rss = seconds + q_seconds, max(rss, q_rss)
            theirs_out.unlink()
        results["llama.cpp"] = (seconds, rss)
        (tmp_path / "theirs.gguf").unlink()
        results["cat+sync"] = measure(floor_cmd)
        floor_out.unlink()

    start = time.perf_counter()
    benchmark.pedantic(run_both, rounds=1, iterations=1)
    (t_ours, rss_ours), (t_ref, rss_ref) = results["ggufkit"], results["llama.cpp"]
    t_floor = results["cat+sync"][0]
    info = {"outtype": outtype, "ggufkit_s": t_ours, "llama_cpp_s": t_ref, "time_ratio": t_ours / t_ref,
            "io_floor_s": t_floor, "ggufkit_vs_io_floor": t_ours / t_floor, "llama_cpp_vs_io_floor": t_ref / t_floor,
            "ggufkit_peak_rss_mb": rss_ours / 2**20, "llama_cpp_peak_rss_mb": rss_ref / 2**20,
            "rss_ratio": rss_ours / rss_ref, "total_s": time.perf_counter() - start,
            "llama_cpp_path": "convert_hf_to_gguf f16 + llama_model_quantize" if two_step else "convert_hf_to_gguf"}
    benchmark.extra_info.update(info)
    print(f"\n{outtype}: ggufkit {t_ours:.1f} s / {rss_ours / 2**20:.0f} MiB, llama.cpp {t_ref:.1f} s / "
          f"{rss_ref / 2**20:.0f} MiB -> time ratio {info['time_ratio']:.2f}, RSS ratio {info['rss_ratio']:.2f}; "
          f"cat+sync of the shards {t_floor:.1f} s (ggufkit {info['ggufkit_vs_io_floor']:.2f}x, "
          f"llama.cpp {info['llama_cpp_vs_io_floor']:.2f}x)")
