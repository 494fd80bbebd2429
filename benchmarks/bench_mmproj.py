"""``ggufkit convert --mmproj`` vs llama.cpp's ``convert_hf_to_gguf.py --mmproj``: wall time and peak RSS, one run.

The checkpoint is built here: Gemma 3's released layout with the real SigLIP-so400m tower of Gemma 3 4B-27B
(27 layers, width 1152, FFN 4304, 896 px images in 14 px patches), random bf16 weights: 0.82 GB of vision
weights, plus a small text embedding the projector leaves out. Each converter runs in its own fresh process
(``bench_convert.measure``: the child's ``ru_maxrss``).

Run: ``python -m pytest benchmarks/bench_mmproj.py --benchmark-enable -s`` (not part of CI). Target (issue 17):
at most half llama.cpp's time; the ratios are printed and stored in ``extra_info``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_convert import _bf16, measure, save_bf16
from llama_cpp_sources import llama_cpp_dir

VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
              image_size=896, patch_size=14, layer_norm_eps=1e-6, model_type="siglip_vision_model",
              vision_use_head=False)
TEXT = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, vocab_size=320, model_type="gemma3_text")


def build_checkpoint(d: Path) -> int:
    """Write the benchmark checkpoint into ``d``; returns its vision weight bytes."""
    d.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "mm_tokens_per_image": 256, "text_config": TEXT, "vision_config": VISION}
    (d / "config.json").write_text(json.dumps(config))
    (d / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "image_seq_length": 256, "size": {"height": 896, "width": 896}}))
    rng = np.random.default_rng(0)
    h, ff, n = VISION["hidden_size"], VISION["intermediate_size"], (896 // 14) ** 2
    p = "vision_tower.vision_model."
    tensors: dict[str, np.ndarray] = {
        "language_model.model.embed_tokens.weight": _bf16(rng, (320, TEXT["hidden_size"])),
        "multi_modal_projector.mm_input_projection_weight": _bf16(rng, (h, TEXT["hidden_size"])),
        "multi_modal_projector.mm_soft_emb_norm.weight": _bf16(rng, (h,)),
        p + "embeddings.patch_embedding.weight": _bf16(rng, (h, 3, 14, 14)),
        p + "embeddings.patch_embedding.bias": _bf16(rng, (h,)),
        p + "embeddings.position_embedding.weight": _bf16(rng, (n, h)),
        p + "post_layernorm.weight": _bf16(rng, (h,)), p + "post_layernorm.bias": _bf16(rng, (h,)),
    }
    for i in range(VISION["num_hidden_layers"]):
        q = f"{p}encoder.layers.{i}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
                            ("self_attn.out_proj", (h, h)), ("mlp.fc1", (ff, h)), ("mlp.fc2", (h, ff))):
            tensors[q + name + ".weight"] = _bf16(rng, shape)
            tensors[q + name + ".bias"] = _bf16(rng, (shape[0],))
        for norm in ("layer_norm1", "layer_norm2"):
            tensors[q + norm + ".weight"] = _bf16(rng, (h,))
            tensors[q + norm + ".bias"] = _bf16(rng, (h,))
    save_bf16(tensors, d / "model.safetensors")
    return sum(t.nbytes for k, t in tensors.items() if not k.startswith("language_model."))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench") / "gemma3-siglip-so400m"
    assert build_checkpoint(d) >= 800_000_000
    return d


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_mmproj_time_and_peak_rss_vs_llama_cpp(benchmark, checkpoint: Path, outtype: str, tmp_path: Path) -> None:
    llama_cpp = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    ours_cmd = [sys.executable, "-m", "ggufkit", "convert", str(checkpoint), "--mmproj", "-o",
                str(tmp_path / "ours.gguf"), "--outtype", outtype, "--quiet"]
    theirs_cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(checkpoint), "--mmproj",
                  "--outfile", str(tmp_path / "theirs.gguf"), "--outtype", outtype]
    # Numba compiles (and caches) the Q8_0 kernel once per machine, not per run.
    subprocess.run([sys.executable, "-c", "import numpy as np; from ggufkit.quant import quantize; "
                    "from gguf import GGMLQuantizationType as Q; quantize(np.ones((1, 256), np.float32), Q.Q8_0)"],
                   check=True)
    results: dict[str, tuple[float, int]] = {}

    def run_both() -> None:
        results["ggufkit"] = measure(ours_cmd)
        results["llama.cpp"] = measure(theirs_cmd, env)

    start = time.perf_counter()
    benchmark.pedantic(run_both, rounds=1, iterations=1)
    # Same projector from both (the tests check this on small fixtures; here the sizes at least).
    assert (tmp_path / "ours.gguf").stat().st_size > 0 and (tmp_path / "theirs.gguf").stat().st_size > 0
    (t_ours, rss_ours), (t_ref, rss_ref) = results["ggufkit"], results["llama.cpp"]
    info = {"outtype": outtype, "ggufkit_s": t_ours, "llama_cpp_s": t_ref, "time_ratio": t_ours / t_ref,
            "ggufkit_peak_rss_mb": rss_ours / 2**20, "llama_cpp_peak_rss_mb": rss_ref / 2**20,
            "rss_ratio": rss_ours / rss_ref, "total_s": time.perf_counter() - start}
    benchmark.extra_info.update(info)
    print(f"\nmmproj {outtype}: ggufkit {t_ours:.1f} s / {rss_ours / 2**20:.0f} MiB, llama.cpp {t_ref:.1f} s / "
          f"{rss_ref / 2**20:.0f} MiB -> time ratio {info['time_ratio']:.2f}, RSS ratio {info['rss_ratio']:.2f}")
