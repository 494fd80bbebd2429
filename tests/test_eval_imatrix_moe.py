"""``ggufkit imatrix`` on mixture-of-experts models against llama.cpp's ``llama-imatrix``, end to end.

Tiny random Mixtral (4 experts, top-2, renormalised) and Qwen2-MoE (4 experts, top-2, plus a sigmoid-gated
shared expert) checkpoints from transformers' classes, converted by ggufkit to F32 and to Q4_K_M: the same
tensor set, keys and counts (per expert: one per routed token and slot), and ``in_sum2`` within float32
noise of llama-imatrix's on the F32 files; on Q4_K_M llama.cpp quantizes the activations to 8 bits
(``vec_dot_type`` Q8_K) where ggufkit multiplies them in float32, which flips a few near-tied routings.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_models import make_checkpoint
from llama_cpp_sources import tool_path

from ggufkit.converters import convert
from ggufkit.quant import quantize_file
from ggufkit.quant.imatrix.collector import read_raw_imatrix

CTX = 64
CHUNKS = 4
N_EXPERT = 4
#: Float32 attention in llama.cpp (its default K/V cache is F16), as in test_eval_imatrix.py.
F32_ATTENTION = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine on quiet hills"
ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("imatrix-moe")
    rng = np.random.default_rng(0)
    (d / "text.txt").write_text(" ".join(rng.choice(WORDS.split(), 4 * CHUNKS * CTX)) + "\n")
    out = {"text": d / "text.txt", "dir": d}
    for name, hf_class in ARCHS.items():
        f32 = convert(make_checkpoint(d / name, hf_class), d / f"{name}.gguf", outtype="f32").outputs[0]
        out[name] = Path(f32)
        out[f"{name}-q4km"] = d / f"{name}-q4km.gguf"
        quantize_file(f32, out[f"{name}-q4km"], "q4_k_m")
    return out


def run_both(files: dict[str, Path], model: str, *extra: str, llama_extra: tuple[str, ...] = ()
             ) -> tuple[dict, dict]:
    """(ggufkit's entries, llama-imatrix's entries), each ``name -> (sums, counts)``, after checking the keys."""
    d = files["dir"]
    tag = model + "".join(extra)
    ref, mine = d / f"ref-{tag}.gguf", d / f"ours-{tag}.gguf"
    common = ["-f", str(files["text"]), "-c", str(CTX), "--chunks", str(CHUNKS), *extra]
    r = subprocess.run([str(tool_path("llama-imatrix")), "-t", "2", "-m", str(files[model]), "-o", str(ref),
                        *common, *F32_ATTENTION, *llama_extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = invoke("imatrix", str(files[model]), "-o", str(mine), *common, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["chunk_count"] == CHUNKS
    x, y = read_raw_imatrix(mine), read_raw_imatrix(ref)
    assert sorted(x.entries) == sorted(y.entries)
    assert (x.chunk_count, x.chunk_size, x.datasets) == (y.chunk_count, y.chunk_size, y.datasets)
    return x.entries, y.entries


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("process_output", [False, True], ids=["blocks", "process-output"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_f32_moe_matches_llama_imatrix_per_expert(files: dict[str, Path], arch: str, process_output: bool) -> None:
    extra = ("--process-output",) if process_output else ()
    mine, ref = run_both(files, arch, *extra)
    experts = [n for n in ref if "_exps." in n]
    # router, attention and three stacked expert tensors per block (qwen2moe: also the shared expert and
    # its vector gate, which llama.cpp multiplies with ggml_mul_mat); the head only with --process-output
    per_block = 8 if arch == "mixtral" else 12
    assert len(ref) == 2 * per_block + process_output and ("output.weight" in ref) == process_output
    assert len(experts) == 6
    for name, (sums, counts) in ref.items():
        assert np.array_equal(mine[name][1], counts), name
        if name in experts:  # per expert, one count per routed (token, slot): k per token in all
            assert counts.shape == (N_EXPERT,) and counts.sum() == 2 * CHUNKS * CTX and counts.min() > 0, name
            assert sums.shape == (N_EXPERT * (sums.size // N_EXPERT),)
        else:
            assert counts.tolist() == [CHUNKS * CTX], name
        # measured worst: 5.0e-7 (mixtral), 4.4e-7 (qwen2moe)
        assert rel_l2(mine[name][0], sums) <= 1e-4, name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_q4_k_m_moe_is_llama_imatrixs_within_its_8_bit_activations(files: dict[str, Path], arch: str) -> None:
    # --no-repack: llama.cpp's repacked (AMX/tiled) Q4_K kernels are another numerics, and on some CPUs
    # that advertise AMX the repacked path dies of SIGILL; its plain CPU kernels are the reference here.
    mine, ref = run_both(files, f"{arch}-q4km", llama_extra=("--no-repack",))
    moved = 0
    for name, (sums, counts) in ref.items():
        got_sums, got_counts = mine[name]
        if "_exps." in name:
            # the same routed pairs in all; only near-tied routings may move (measured: 4 of 512 per block)
            assert got_counts.sum() == counts.sum() == 2 * CHUNKS * CTX, name
            moved += int(np.abs(got_counts - counts).sum())
            # measured worst: 2.8e-2 (mixtral), 4.1e-2 (qwen2moe)
            assert rel_l2(got_sums, sums) <= 6e-2, name
        else:
            assert np.array_equal(got_counts, counts), name
            assert rel_l2(got_sums, sums) <= 3e-2, name  # measured worst: 6.1e-3 (mixtral), 1.4e-2 (qwen2moe)
    assert moved <= 0.05 * 6 * 2 * CHUNKS * CTX


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_imatrix_quantizes_like_llama_quantize_both_ways(files: dict[str, Path], arch: str) -> None:
    """llama-quantize and ggufkit's quantizer given ggufkit's MoE imatrix write the same bytes (per-expert
    entries and qwen2moe's vector entry included); ggufkit's quantizer takes llama-imatrix's file too."""
    from ggufkit.format import open_gguf

    d = files["dir"]
    run_both(files, arch)
    mine, ref = d / f"ours-{arch}.gguf", d / f"ref-{arch}.gguf"
    theirs = d / f"{arch}-q2k-llama.gguf"
    r = subprocess.run([str(tool_path("llama-quantize")), "--imatrix", str(mine), str(files[arch]), str(theirs), "q2_k",
                        "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    quantize_file(files[arch], d / f"{arch}-q2k-ours.gguf", "q2_k", imatrix=mine, threads=1, device="cpu")
    quantize_file(files[arch], d / f"{arch}-q2k-ref.gguf", "q2_k", imatrix=ref, threads=1, device="cpu")
    quantize_file(files[arch], d / f"{arch}-q2k-none.gguf", "q2_k", threads=1, device="cpu")
    with open_gguf(theirs) as a, open_gguf(d / f"{arch}-q2k-ours.gguf") as b, \
            open_gguf(d / f"{arch}-q2k-ref.gguf") as c, open_gguf(d / f"{arch}-q2k-none.gguf") as e:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        assert [t.name for t in a.tensors] == [t.name for t in c.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        # the experts (rows of 64/96 columns: Q2_K falls back to Q4_0, which weighs by the imatrix too) are
        # quantized with the imatrix: not as without one
        experts = [t for t in c.tensors if len(t.ne) == 3]
        assert len(experts) == 6 and all(t.ggml_type.name == "Q4_0" for t in experts)
        assert all(bytes(c.raw(t)) != bytes(e.raw(e[t.name])) for t in experts)
