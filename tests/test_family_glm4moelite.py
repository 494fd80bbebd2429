"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, GGUF arch ``deepseek2``; conversion/glm.py ``Glm4MoeLiteModel``)
against llama.cpp (issue 32).

DeepSeek V3's layers (MLA with a q LoRA, kv_b_proj split into attn_k_b / attn_v_b, sigmoid router with the
correction bias, renormalised and scaled top-k, a shared expert, one dense lead layer; tests/test_family_deepseek2.py
covers them in depth) with GLM's tokenizer roles (_set_vocab_glm: bos [gMASK], eot <|user|>, unk <|endoftext|>,
eom <|observation|>) and a NextN layer kept by default as llama.cpp keeps it (blk.{num_hidden_layers},
``nextn_predict_layers``), left out with ``--no-mtp``. Layouts: ``release`` (config.json as zai-org/GLM-4.7-Flash
spells it: ``first_k_dense_replace``, ``rope_theta`` at the root, ``num_nextn_predict_layers`` 1 and the NextN
layer's tensors) and ``tf5`` (transformers 5's save_pretrained: ``mlp_layer_types``, ``rope_parameters``, no NextN
layer). Neither spells ``scoring_func``: llama.cpp's converter then writes no gating function and its loader routes
by sigmoid only at GLM-4.7-Flash's own size (47/48 layers, 154880 tokens), by softmax otherwise; ggufkit writes
the class's sigmoid there, the file llama.cpp's converter writes with ``scoring_func: sigmoid`` spelled out. tf5's
``mlp_layer_types`` likewise: llama.cpp's converter reads only ``first_k_dense_replace`` (and its loader then
refuses the file); compared with it spelled out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, transformers_logits
from test_family_deepseek2 import CHUNKS, CTX, _add_mtp_layer, assert_same_file
from test_family_glm4moe import GLM_ADDED, _write_glm_tokenizer

from ggufkit.converters import convert
from ggufkit.format import open_gguf

LAYOUTS = ("release", "tf5")
_BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
             num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
             kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
             mlp_layer_types=["dense", "sparse", "sparse"],
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def make_glm_lite(dir: Path, layout: str = "tf5", seed: int = 0) -> Path:
    """A tiny GLM-4.7-Flash checkpoint in ``layout`` (every parameter and the correction bias random)."""
    import torch
    import transformers
    from fixtures_models import randomize

    dir.mkdir(parents=True, exist_ok=True)
    n_vocab = _write_glm_tokenizer(dir)
    config = transformers.Glm4MoeLiteConfig(**{**_BASE, "vocab_size": n_vocab})
    config.architectures = ["Glm4MoeLiteForCausalLM"]
    model = transformers.Glm4MoeLiteForCausalLM(config)
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    model.eval().save_pretrained(dir)
    if layout == "release":
        path = dir / "config.json"
        c = json.loads(path.read_text())
        rope = c.pop("rope_parameters")
        c.pop("mlp_layer_types")
        c.pop("qk_head_dim", None)
        c.update(rope_theta=rope["rope_theta"], rope_scaling=None, first_k_dense_replace=1, topk_method="noaux_tc",
                 num_nextn_predict_layers=1, partial_rotary_factor=1.0, torch_dtype=c.pop("dtype", "bfloat16"))
        path.write_text(json.dumps(dict(sorted(c.items())), indent=2))
        _add_mtp_layer(dir)
    return dir


def spelled(src: Path, dst: Path) -> Path:
    """``src`` with what llama.cpp's converter reads in one spelling only written out: ``scoring_func`` and
    ``first_k_dense_replace`` (the weights linked)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve()) if f.name != "config.json" else None
    c = json.loads((src / "config.json").read_text())
    c.update(scoring_func="sigmoid", first_k_dense_replace=1)
    (dst / "config.json").write_text(json.dumps(c, indent=2))
    return dst


def llama_cpp_convert(model: Path, out: Path, *flags: str) -> Path:
    import os
    import subprocess
    import sys

    from llama_cpp_sources import llama_cpp_dir

    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", "f32", *flags], check=True, capture_output=True, env=env)
    return out


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = make_glm_lite(tmp_path_factory.mktemp(f"glmlite-{request.param}") / "m", request.param)
    return {"layout": request.param, "dir": d, "ours": convert(d, d.parent / "ours.gguf", outtype="f32").outputs[0]}


def test_file_equals_llama_cpps_converter(case: dict[str, Any], tmp_path: Path) -> None:
    """Every tensor and key as llama.cpp's converter writes them (release: the NextN layer kept as blk.3 with
    nextn_predict_layers 1), GLM's tokenizer roles, sigmoid gating, the dense lead layer from either spelling."""
    theirs = llama_cpp_convert(spelled(case["dir"], tmp_path / "spelled"), tmp_path / "theirs.gguf")
    assert_same_file(theirs, case["ours"])
    n = 50257
    with open_gguf(case["ours"]) as f:
        assert f.architecture == "deepseek2" and f.get("deepseek2.expert_gating_func") == 2
        assert f.get("deepseek2.leading_dense_block_count") == 1
        assert f.get("tokenizer.ggml.eot_token_id") == n + GLM_ADDED.index("<|user|>")
        assert f.get("tokenizer.ggml.eom_token_id") == n + GLM_ADDED.index("<|observation|>")
        release = case["layout"] == "release"
        assert f.get("deepseek2.block_count") == (4 if release else 3)
        assert ("blk.3.nextn.eh_proj.weight" in f) == release and ("blk.3.attn_k_b.weight" in f) == release


def test_no_mtp_equals_llama_cpps_no_mtp(tmp_path: Path) -> None:
    """``--no-mtp`` leaves the NextN layer out (block_count 3, no nextn key), as llama.cpp's converter does."""
    d = make_glm_lite(tmp_path / "m", "release")
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32", mtp=False).outputs[0]
    assert_same_file(llama_cpp_convert(spelled(d, tmp_path / "spelled"), tmp_path / "theirs.gguf", "--no-mtp"), ours)
    with open_gguf(ours) as f:
        assert f.get("deepseek2.block_count") == 3 and "deepseek2.nextn_predict_layers" not in f.kv


def test_llama_cpp_logits_match_transformers(case: dict[str, Any]) -> None:
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_evaluator_ppl_and_imatrix_equal_llama_cpps(case: dict[str, Any], tmp_path: Path) -> None:
    """The evaluator runs the trunk (the NextN block not, as llama.cpp's main graph): ppl within 0.1 % of
    llama-perplexity, the importance matrix llama-imatrix's (no blk.3 entries: llama-imatrix never runs it)."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import F32_TOLERANCE

    from ggufkit.eval.perplexity import perplexity, sample_text

    text = sample_text()[:6000]
    path = tmp_path / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    got = perplexity(case["ours"], text=text, ctx=CTX, chunks=CHUNKS, device="cpu", kv_cache="f32")
    theirs, n_chunks = llama_perplexity(case["ours"], path, CTX, CHUNKS, *F32_PATH)
    assert got.chunks == n_chunks == CHUNKS and abs(got.ppl / theirs - 1) < 1e-3, (got.ppl, theirs)
    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", path, "-c", CTX, "--chunks", CHUNKS]
    llama_imatrix("-m", case["ours"], "-o", ref, *common, *F32_ATTENTION)
    ours(case["ours"], "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert "blk.1.attn_k_b.weight" in rel and not any(n.startswith("blk.3.") for n in rel)
    assert max(rel.values()) <= F32_TOLERANCE, rel


def test_mtp_writes_the_draft_as_llama_cpp(tmp_path: Path) -> None:
    """``--mtp``: the NextN block alone with the embeddings, output norm and head, as llama.cpp's --mtp writes it."""
    d = make_glm_lite(tmp_path / "m", "release")
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32", mtp=True).outputs[0]
    theirs = llama_cpp_convert(spelled(d, tmp_path / "spelled"), tmp_path / "theirs.gguf", "--mtp")
    assert_same_file(theirs, ours)
    shutil.rmtree(tmp_path / "spelled")
