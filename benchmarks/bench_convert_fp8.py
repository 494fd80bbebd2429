"""An FP8 release at DeepSeek-V3 widths: ``ggufkit convert`` vs llama.cpp's ``convert_hf_to_gguf.py`` (issue 32,
"Scale"): wall time and peak RSS side by side, one run.

The checkpoint is built here as DeepSeek-V3's release stores it: ``DeepseekV3ForCausalLM``, hidden 7168, MLA
(q LoRA rank 1536, kv LoRA rank 512, 128 heads of 128 + 64 rope dimensions, v 128), 32 routed experts of 2048
plus one shared expert in each of 2 MoE layers (groups 8/4, sigmoid routing with a correction bias), every
linear weight ``float8_e4m3fn`` with ``weight_scale_inv`` 128x128 block scales (``quant_method: fp8``), the
embeddings, norms and routers bf16/f32; about 4.0 G weights (3.3 G in FP8) in one safetensors shard per layer
with an index. The tokenizer is GPT-2's BPE rebuilt from llama.cpp's vocab file (llama.cpp's converter needs a
pre-tokenizer hash it knows; DeepSeek-V3's own is not vendored), so the vocabulary is 50257.

Outtypes:
- ``bf16``: ggufkit convert vs convert_hf_to_gguf.py --outtype bf16 (tensor bytes compared on a sample).
- ``q4_k_m`` in one pass: ggufkit convert --outtype q4_k_m vs the user's two-step pipeline, llama.cpp's bf16
  conversion then llama-quantize (``llama_model_quantize`` from llama-cpp-python's libllama): time the sum,
  peak RSS the larger of the two processes.

Each converter runs in its own fresh process under a small Python parent that reports the child's
``ru_maxrss``. The CPU (model, AVX2 / AVX-512) is printed beside every ratio.

Run: ``flock /tmp/heavy.lock python -m pytest benchmarks/bench_convert_fp8.py --benchmark-enable -s -p no:cacheprovider
-n 0`` (not part of CI; about 25 GB in the temporary folder; each result is printed as it lands). Targets (issue
32): time and peak RSS at most half of llama.cpp's.

Measured (stop 41, one run, AMD EPYC Zen 3, AVX2, no AVX-512, 2 cores shared with other jobs, load average
7.6-13.3; ggufkit at commit 2e1e160: stacked experts written one expert at a time, big tensors in row blocks):
- bf16: ggufkit 322.3 s, peak RSS 1035 MiB; llama.cpp's converter 872.2 s, 5799 MiB: time 0.37x, peak RSS 0.18x.
  ggufkit's peak was then the FP8 ``o_proj`` (7168 x 16384) dequantized whole to float32 (470 MB); its
  block-row pieces (``source_fp8.Dequantized.pieces``) reach the stream once plan.py hands them over.
- q4_k_m in one pass: ggufkit 234.5 s, peak RSS 549 MiB; llama.cpp's bf16 conversion above + llama-quantize
  384.6 s, 4396 MiB: time 0.19x, peak RSS 0.09x (load 3.7-10.3 then). The sampled bf16 tensors were equal.
Whole run 43.6 min including the checkpoint. Not yet measured: the o_proj row-block pieces (plan.py, commit
50ba4f3) and the release of passthrough pages after their write (commit 985f6bf).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import measure
from llama_cpp_sources import llama_cpp_dir

HIDDEN, Q_RANK, KV_RANK, N_HEAD, NOPE, ROPE, V_DIM = 7168, 1536, 512, 128, 128, 64, 128
N_EXPERT, EXPERT_FF, N_LAYER, VOCAB, BLOCK = 32, 2048, 2, 50257, 128

#: DeepSeek-V3's released config.json (deepseek-ai/DeepSeek-V3), cut to 2 MoE layers of 32 experts, no MTP layer.
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 0, "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": KV_RANK, "max_position_embeddings": 163840,
    "moe_intermediate_size": EXPERT_FF, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": N_EXPERT,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": N_HEAD, "num_experts_per_tok": 8,
    "num_hidden_layers": N_LAYER, "num_key_value_heads": N_HEAD, "num_nextn_predict_layers": 0,
    "pretraining_tp": 1, "q_lora_rank": Q_RANK, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [BLOCK, BLOCK]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": V_DIM, "vocab_size": VOCAB}


def layer_tensors(i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of layer ``i``'s tensors as DeepSeek-V3's release stores them."""
    p = f"model.layers.{i}."
    fp8: list[tuple[str, tuple[int, int]]] = [
        ("self_attn.q_a_proj", (Q_RANK, HIDDEN)), ("self_attn.q_b_proj", (N_HEAD * (NOPE + ROPE), Q_RANK)),
        ("self_attn.kv_a_proj_with_mqa", (KV_RANK + ROPE, HIDDEN)),
        ("self_attn.kv_b_proj", (N_HEAD * (NOPE + V_DIM), KV_RANK)), ("self_attn.o_proj", (HIDDEN, N_HEAD * V_DIM))]
    for e in [*(f"experts.{x}" for x in range(N_EXPERT)), "shared_experts"]:
        fp8 += [(f"mlp.{e}.gate_proj", (EXPERT_FF, HIDDEN)), (f"mlp.{e}.up_proj", (EXPERT_FF, HIDDEN)),
                (f"mlp.{e}.down_proj", (HIDDEN, EXPERT_FF))]
    out: list[tuple[str, str, tuple[int, ...]]] = [
        (p + "input_layernorm.weight", "BF16", (HIDDEN,)), (p + "post_attention_layernorm.weight", "BF16", (HIDDEN,)),
        (p + "self_attn.q_a_layernorm.weight", "BF16", (Q_RANK,)),
        (p + "self_attn.kv_a_layernorm.weight", "BF16", (KV_RANK,)),
        (p + "mlp.gate.weight", "BF16", (N_EXPERT, HIDDEN)), (p + "mlp.gate.e_score_correction_bias", "F32", (N_EXPERT,))]
    for name, (rows, cols) in fp8:
        out.append((p + name + ".weight", "F8_E4M3", (rows, cols)))
        out.append((p + name + ".weight_scale_inv", "F32", (-(-rows // BLOCK), -(-cols // BLOCK))))
    return out


_ITEM = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def _data(rng: np.random.Generator, dtype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "F8_E4M3":  # finite e4m3 bytes (0x7F / 0xFF are NaN)
        return (rng.integers(0, 0x7E, n, dtype=np.uint8) | (rng.integers(0, 2, n, dtype=np.uint8) << 7))
    if dtype == "F32":
        scale = name.endswith("scale_inv")
        return (rng.random(n, dtype=np.float32) * np.float32(1e-4 if scale else 1.0)).astype(np.float32)
    x = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    if "norm" in name:
        x += np.float32(1.0)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write_shard(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], rng: np.random.Generator) -> int:
    """A safetensors file of ``tensors`` (random data), written one tensor at a time; returns its data bytes."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        size = int(np.prod(shape)) * _ITEM[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, dtype, shape in tensors:
            f.write(memoryview(np.ascontiguousarray(_data(rng, dtype, shape, name))).cast("B"))
    return offset


def build_checkpoint(d: Path) -> tuple[int, int]:
    """Write the benchmark checkpoint into ``d``; returns (weights, FP8 weights)."""
    from fixtures_models import _write_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    assert _write_tokenizer(d, "real:gpt-2") == VOCAB
    (d / "config.json").write_text(json.dumps(CONFIG, indent=2))
    rng = np.random.default_rng(0)
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [
        [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN)), ("model.norm.weight", "BF16", (HIDDEN,)),
         ("lm_head.weight", "BF16", (VOCAB, HIDDEN))]]
    shards += [layer_tensors(i) for i in range(N_LAYER)]
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(d / name, tensors, rng)
        weight_map.update({t[0]: name for t in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    every = [t for s in shards for t in s if not t[0].endswith("scale_inv")]
    n = sum(int(np.prod(t[2])) for t in every)
    return n, sum(int(np.prod(t[2])) for t in every if t[1] == "F8_E4M3")


def cpu_name() -> str:
    """The CPU model and its widest vector extension, from /proc/cpuinfo."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{model} ({isa}, {os.cpu_count()} cores)"


def _tensor_chunks(path: Path, names: list[str]) -> Iterator[tuple[str, bytes]]:
    from ggufkit.format import open_gguf

    with open_gguf(path) as f:
        for name in names:
            yield name, bytes(f.raw(f[name]))


def same_sample(theirs: Path, ours: Path) -> list[str]:
    """Names of the sampled tensors whose bytes differ (the embedding, all of layer 1, the head)."""
    from ggufkit.format import open_gguf

    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type) for t in a.tensors] == [(t.name, t.ggml_type) for t in b.tensors]
        names = [t.name for t in a.tensors if t.name.startswith(("blk.1.", "token_embd", "output"))]
    return [n for (n, x), (_, y) in zip(_tensor_chunks(theirs, names), _tensor_chunks(ours, names)) if x != y]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench-fp8") / "DeepSeek-V3-shaped-FP8"
    n, n_fp8 = build_checkpoint(d)
    assert n >= 1_500_000_000
    print(f"\ncheckpoint: {n / 1e9:.2f} G weights ({n_fp8 / 1e9:.2f} G FP8 with 128x128 block scales), "
          f"{sum(p.stat().st_size for p in d.glob('*.safetensors')) / 2**30:.2f} GiB")
    return d


_LLAMA_QUANTIZE = ("import ctypes, sys, llama_cpp\n"
                   "p = llama_cpp.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3])\n"
                   "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
                   "ctypes.byref(p)))\n")
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def test_fp8_convert_time_and_peak_rss_vs_llama_cpp(benchmark: Callable[..., object], checkpoint: Path,
                                                    tmp_path: Path) -> None:
    llama_cpp = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    # Numba compiles (and caches) the kernels once; a user pays that once per machine, not per run.
    subprocess.run([sys.executable, "-c", "import numpy as np; from ggufkit.quant import quantize; "
                    "from gguf import GGMLQuantizationType as Q; "
                    "[quantize(np.ones((1, 256), np.float32), t) for t in (Q.Q4_K, Q.Q6_K)]"], check=True)
    results: dict[str, tuple[float, int]] = {}
    mismatched: list[str] = []

    def ours(outtype: str) -> list[str]:
        return [sys.executable, "-m", "ggufkit", "convert", str(checkpoint), "-o",
                str(tmp_path / f"ours-{outtype}.gguf"), "--outtype", outtype, "--quiet", "--no-check"]

    def timed(name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        results[name] = measure(cmd, env)  # printed as it lands: a run cut short still reports what it had
        print(f"{name}: {results[name][0]:.1f} s, peak RSS {results[name][1] / 2**20:.0f} MiB, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    def run_all() -> None:
        timed("ggufkit bf16", ours("bf16"))
        timed("llama.cpp bf16", [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(checkpoint),
                                 "--outfile", str(tmp_path / "theirs-bf16.gguf"), "--outtype", "bf16"], env)
        mismatched.extend(same_sample(tmp_path / "theirs-bf16.gguf", tmp_path / "ours-bf16.gguf"))
        (tmp_path / "ours-bf16.gguf").unlink()
        timed("ggufkit q4_k_m", ours("q4_k_m"))
        timed("llama-quantize q4_k_m", [sys.executable, "-c", _LLAMA_QUANTIZE, str(tmp_path / "theirs-bf16.gguf"),
                                        str(tmp_path / "theirs-q4_k_m.gguf"), str(LLAMA_FTYPE_MOSTLY_Q4_K_M)])
        for p in tmp_path.glob("*.gguf"):
            p.unlink()

    start = time.perf_counter()
    benchmark.pedantic(run_all, rounds=1, iterations=1)  # type: ignore[attr-defined]
    cpu = cpu_name()
    (t_b, r_b), (t_lb, r_lb) = results["ggufkit bf16"], results["llama.cpp bf16"]
    (t_q, r_q), (t_lq, r_lq) = results["ggufkit q4_k_m"], results["llama-quantize q4_k_m"]
    info = {"cpu": cpu, "bf16_time_ratio": t_b / t_lb, "bf16_rss_ratio": r_b / r_lb,
            "q4_k_m_time_ratio": t_q / (t_lb + t_lq), "q4_k_m_rss_ratio": r_q / max(r_lb, r_lq),
            "sample_mismatches": mismatched, "total_s": time.perf_counter() - start,
            **{f"{k} s": v[0] for k, v in results.items()}, **{f"{k} peak MiB": v[1] / 2**20 for k, v in results.items()}}
    benchmark.extra_info.update(info)  # type: ignore[attr-defined]
    print(f"bf16:   time {info['bf16_time_ratio']:.2f}x, peak RSS {info['bf16_rss_ratio']:.2f}x of llama.cpp's "
          f"converter on {cpu}")
    print(f"q4_k_m: time {info['q4_k_m_time_ratio']:.2f}x, peak RSS {info['q4_k_m_rss_ratio']:.2f}x of llama.cpp's "
          f"converter + llama-quantize on {cpu}")
    assert not mismatched, mismatched
