"""LoRA adapters: ``ggufkit convert ADAPTER`` vs llama.cpp's ``convert_lora_to_gguf.py``, and ``--merge`` vs
``llama-export-lora``; wall time and peak RSS, side by side, each tool in its own fresh process, one run.

The base is bench_convert.py's 1.09 GB bf16 LLaMA (two shards); the adapter (r=64 on every attention and MLP
projection, float32, alpha 128) is written here. llama.cpp's merge path needs GGUF inputs: its time is the
whole chain a user runs from the same checkpoint (convert base to f16, convert the adapter, llama-export-lora),
and llama-export-lora alone is reported too. The CPU is printed beside the ratios.

Run: ``python -m pytest benchmarks/bench_lora.py --benchmark-enable -s -p no:cacheprovider`` (not part of CI).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import CONFIG, build_checkpoint, measure
from llama_cpp_sources import llama_cpp_dir, tool_path

RANK = 64


def cpu_name() -> str:
    """The CPU model and its AVX2/AVX-512 support, from /proc/cpuinfo."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return f"{model} (AVX2 {'yes' if ' avx2' in flags else 'no'}, AVX-512 {'yes' if ' avx512f' in flags else 'no'})"


def build_adapter(d: Path, base: Path) -> None:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    h, ff, kv, n_layer = CONFIG["hidden_size"], CONFIG["intermediate_size"], 4 * 128, CONFIG["num_hidden_layers"]
    rng = np.random.default_rng(1)
    tensors = {}
    for i in range(n_layer):
        for name, (out, inp) in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                                 ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                                 ("mlp.gate_proj", (ff, h)), ("mlp.up_proj", (ff, h)), ("mlp.down_proj", (h, ff))):
            p = f"base_model.model.model.layers.{i}.{name}"
            tensors[p + ".lora_A.weight"] = rng.standard_normal((RANK, inp), dtype=np.float32) * np.float32(0.01)
            tensors[p + ".lora_B.weight"] = rng.standard_normal((out, RANK), dtype=np.float32) * np.float32(0.01)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "base_model_name_or_path": str(base),
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bench_lora")
    build_checkpoint(d / "base")
    build_adapter(d / "adapter", d / "base")
    return {"base": d / "base", "adapter": d / "adapter", "dir": d}


def _report(what: str, ours: tuple[float, int], theirs: tuple[float, int], label: str) -> None:
    print(f"\n[{cpu_name()}] {what}: ggufkit {ours[0]:.1f} s / {ours[1] / 2**20:.0f} MiB, {label} {theirs[0]:.1f} s / "
          f"{theirs[1] / 2**20:.0f} MiB -> time ratio {ours[0] / theirs[0]:.2f}, RSS ratio {ours[1] / theirs[1]:.2f}")


def test_adapter_conversion_and_merge_vs_llama_cpp(benchmark, models: dict[str, Path]) -> None:
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    d = models["dir"]
    results: dict[str, tuple[float, int]] = {}

    def run_all() -> None:
        results["ours_adapter"] = measure([sys.executable, "-m", "ggufkit", "convert", str(models["adapter"]),
                                           "--base", str(models["base"]), "--outtype", "f16", "-o",
                                           str(d / "ours-lora.gguf"), "--quiet"])
        results["theirs_adapter"] = measure([sys.executable, str(root / "convert_lora_to_gguf.py"), "--base",
                                             str(models["base"]), "--outtype", "f16", "--outfile",
                                             str(d / "theirs-lora.gguf"), str(models["adapter"])], env)
        results["ours_merge"] = measure([sys.executable, "-m", "ggufkit", "convert", str(models["adapter"]),
                                         "--base", str(models["base"]), "--merge", "--outtype", "f16", "-o",
                                         str(d / "ours-merged.gguf"), "--quiet", "--no-check"])
        base_f16 = measure([sys.executable, str(root / "convert_hf_to_gguf.py"), str(models["base"]), "--outfile",
                            str(d / "base-f16.gguf"), "--outtype", "f16"], env)
        export = measure([str(tool_path("llama-export-lora")), "-m", str(d / "base-f16.gguf"), "--lora",
                          str(d / "theirs-lora.gguf"), "-o", str(d / "theirs-merged.gguf"), "-t", "2"])
        results["export_lora"] = export
        chain = results["theirs_adapter"]
        results["theirs_chain"] = (base_f16[0] + chain[0] + export[0], max(base_f16[1], chain[1], export[1]))

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    _report("adapter f16", results["ours_adapter"], results["theirs_adapter"], "convert_lora_to_gguf.py")
    _report("merge f16 (HF in)", results["ours_merge"], results["theirs_chain"],
            "convert base + convert_lora + llama-export-lora")
    _report("merge f16 vs export-lora alone", results["ours_merge"], results["export_lora"], "llama-export-lora")
    benchmark.extra_info.update({k: {"seconds": v[0], "peak_rss_mb": v[1] / 2**20} for k, v in results.items()})
