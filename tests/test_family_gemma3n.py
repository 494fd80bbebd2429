"""Gemma 3n text (transformers' ``Gemma3nForCausalLM``, GGUF ``gemma3n``): conversion (issue 33).

* The release layout (google/gemma-3n-E2B / E4B text_config: ``rope_theta`` / ``rope_local_base_freq`` /
  ``rope_scaling`` null, ``query_pre_attn_scalar``, K/V weights in every layer, KV-sharing ones included) converts
  to the bytes and keys llama.cpp's converter writes: AltUp projections stacked, per-layer embeddings padded with
  zero rows to ``vocab_size``, the per-layer arrays (feed_forward_length, sliding_window_pattern,
  activation_sparsity_scale as torch's float32 icdf).
* transformers 5's ``save_pretrained`` writes ``rope_parameters`` and no K/V weights in the KV-sharing layers;
  llama.cpp's converter writes a file llama.cpp's loader refuses (``blk.20.attn_k.weight`` not found); ggufkit
  writes the unused K/V as zeros, a file that runs exactly as the release layout's.
* What llama.cpp's loader and graph fix (4 AltUp streams, per-layer width 256, LAuReL rank 64, sparsity on layers
  0-9, K/V from layers 0-19, soft-cap 30) is refused otherwise, in one line.

The tiny model has 22 layers so that layers 20-21 share K/V (llama.cpp's ``n_layer_kv_from_start`` is 20), and
the widths llama.cpp fixes (256, 64).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import fixtures_tokenizers as ft
import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, randomize, transformers_logits
from test_convert_archs import llama_cpp_convert
from test_family_cohere2 import _assert_same_file

from ggufkit.converters import convert
from ggufkit.converters.gemma3n import _std_multiplier, check_config
from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.format import open_gguf

N_TOKENS = 320


def _config(n_layer: int = 22, shared: int = 2, **overrides: Any) -> dict[str, Any]:
    return {**dict(vocab_size=N_TOKENS + 16, vocab_size_per_layer_input=N_TOKENS, hidden_size=96,
                   intermediate_size=128, num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, sliding_window=8, hidden_size_per_layer_input=256, laurel_rank=64,
                   num_kv_shared_layers=shared, max_position_embeddings=128,
                   layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                for i in range(n_layer)],
                   activation_sparsity_pattern=[0.95] * min(n_layer, 10) + [0.0] * max(n_layer - 10, 0),
                   bos_token_id=1, eos_token_id=2, pad_token_id=0), **overrides}


def make_gemma3n(dir: Path, **config: Any) -> Path:
    """A randomized Gemma3nForCausalLM saved by transformers 5 (float32) with an SPM tokenizer (no dummy prefix,
    as Gemma's), 16 embedding rows beyond it (vocab_size > vocab_size_per_layer_input, as released)."""
    import transformers

    dir.mkdir(parents=True, exist_ok=True)
    ft.make_spm_tokenizer(dir, N_TOKENS, dummy_prefix=False)
    cfg = transformers.Gemma3nTextConfig(**_config(**config))
    cfg.architectures = ["Gemma3nForCausalLM"]
    model = transformers.Gemma3nForCausalLM(cfg)
    randomize(model, 0)
    model.tie_weights()
    model.eval().save_pretrained(dir)
    return dir


def to_release(src: Path, dst: Path) -> Path:
    """The released layout of the same model: transformers 4's config spelling, and K/V weights (random, unused)
    in the KV-sharing layers as the released safetensors carry them."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    cfg.update(rope_theta=rope["full_attention"]["rope_theta"],
               rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None,
               query_pre_attn_scalar=cfg["head_dim"], altup_lr_multiplier=1.0, torch_dtype="bfloat16",
               transformers_version="4.53.0.dev0")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    n, kv = cfg["num_hidden_layers"], cfg["num_key_value_heads"] * cfg["head_dim"]
    for il in range(n - cfg["num_kv_shared_layers"], n):
        p = f"model.layers.{il}.self_attn."
        sd[p + "k_proj.weight"] = torch.randn(kv, cfg["hidden_size"], generator=g) * 0.15
        sd[p + "v_proj.weight"] = torch.randn(kv, cfg["hidden_size"], generator=g) * 0.15
        sd[p + "k_norm.weight"] = 1 + torch.randn(cfg["head_dim"], generator=g) * 0.1
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gemma3n")
    v5 = make_gemma3n(d / "v5")
    return {"v5": v5, "release": to_release(v5, d / "release")}


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_release_layout_converts_to_llama_cpps_file(layouts: dict[str, Path], tmp_path: Path, outtype: str) -> None:
    theirs = llama_cpp_convert(layouts["release"], tmp_path / "theirs.gguf", outtype)
    ours = convert(layouts["release"], tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    _assert_same_file(theirs, ours)
    with open_gguf(ours) as g:
        assert g["per_layer_token_embd.weight"].ne == (22 * 256, N_TOKENS + 16)
        assert g["altup_proj.weight"].ne == (96, 96, 3)
        assert list(g.get("gemma3n.attention.sliding_window_pattern"))[18:20] == [True, False]


def test_transformers5_save_runs_as_the_release_layout(layouts: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp's converter's file of the transformers-5 save does not load (no K/V in layers 20-21);
    ggufkit's does, and its logits equal the release layout's file's exactly (the K/V there are never read)."""
    import llama_cpp

    theirs = llama_cpp_convert(layouts["v5"], tmp_path / "theirs-v5.gguf")
    with pytest.raises(ValueError):
        llama_cpp.Llama(str(theirs), n_ctx=64, verbose=False)
    ours = convert(layouts["v5"], tmp_path / "v5.gguf", outtype="f32").outputs[0]
    release = convert(layouts["release"], tmp_path / "release.gguf", outtype="f32").outputs[0]
    with open_gguf(ours) as a, open_gguf(release) as b:
        assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
        for t in a.tensors:
            if t.name.startswith(("blk.20.attn_k", "blk.20.attn_v", "blk.21.attn_k", "blk.21.attn_v")):
                assert not np.asarray(a.raw(t)).any(), t.name
            else:
                assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
    assert np.array_equal(llama_cpp_logits(ours), llama_cpp_logits(release))


def _llama_cpp_reference(dir: Path) -> Any:
    """transformers' model with the two places where llama.cpp computes otherwise made llama.cpp's:

    * the gaussian top-k's standard deviation: transformers (and Google's reference, ``jnp.std``) take the
      population one (``unbiased=False``); llama.cpp's gaussian_topk divides by n - 1
      (src/models/gemma3n.cpp). transformers is right; the difference is sqrt(n / (n - 1)) in the cut-off,
      6e-5 relative at the released widths (8192, 16384) but 4e-3 at this model's 128. The evaluator follows
      llama.cpp (eval/family_gemma3n.py).
    * GELU: llama.cpp's CPU GELU is a lookup in an F16 table (ggml-cpu/vec.h GGML_GELU_FP16).
    """
    import torch
    import transformers.models.gemma3n.modeling_gemma3n as modeling
    from fixtures_models import reference_model

    from ggufkit.eval.ggml_cpu import gelu_f16_table

    class Mlp(modeling.Gemma3nTextMLP):  # type: ignore[misc, name-defined]
        def _gaussian_topk(self, inputs: torch.Tensor) -> torch.Tensor:
            p = torch.tensor(self.activation_sparsity, dtype=torch.float32)
            mul = torch.distributions.normal.Normal(0, 1).icdf(p).type(inputs.dtype)
            cutoff = inputs.mean(-1, keepdim=True) + inputs.std(-1, keepdim=True, unbiased=True) * mul
            return torch.relu(inputs - cutoff)

    class Gelu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return gelu_f16_table(x)

    model = reference_model(dir)
    for module in model.modules():
        if isinstance(module, modeling.Gemma3nTextMLP):
            module.__class__ = Mlp
        if hasattr(module, "act_fn"):
            module.act_fn = Gelu()
    return model


def test_llama_cpp_runs_transformers_model(layouts: dict[str, Path], tmp_path: Path) -> None:
    """The 22-layer model (sparse layers, sliding and global layers, KV sharing) in llama.cpp gives
    transformers' logits with llama.cpp's gaussian top-k and F16 GELU table (:func:`_llama_cpp_reference`):
    top-1 identical, within 1e-3 of the logit range (measured 9e-4: F16 attention rounding compounds over 22
    layers); with transformers' own top-k the logits differ by 1.7 of a 10-wide range at this width."""
    import torch
    from fixtures_models import TOKENS

    ours = convert(layouts["v5"], tmp_path / "v5.gguf", outtype="f32").outputs[0]
    with torch.no_grad():
        want = _llama_cpp_reference(layouts["v5"])(torch.tensor([TOKENS])).logits[0].float().numpy()
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())
    plain = transformers_logits(layouts["v5"])
    assert np.abs(got - plain).max() > 0.05 * (plain.max() - plain.min())


def test_llama_cpp_logits_match_transformers_on_a_shallow_model(tmp_path: Path) -> None:
    """Two layers (both sparse, no KV sharing) against transformers as it is: top-1 identical and within
    5e-3 of the logit range (measured 3.3e-3: the top-k's n - 1 and the F16 GELU table above)."""
    d = make_gemma3n(tmp_path / "m", n_layer=2, shared=0)
    ours = convert(d, tmp_path / "m.gguf", outtype="f32").outputs[0]
    want, got = transformers_logits(d), llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 5e-3 * (want.max() - want.min())


def test_evaluator_logits_equal_llama_cpps(layouts: dict[str, Path], tmp_path: Path) -> None:
    """The evaluator's forward (eval/family_gemma3n.py, llama.cpp's top-k and F16 GELU table) on the F32 file:
    transformers' model made llama.cpp's (:func:`_llama_cpp_reference`) and llama.cpp's logits within 1e-3 of
    the logit range, top-1 identical (measured 8e-4: each F16 GELU lookup re-rounds float32-order differences,
    compounded over 22 layers; 1-layer models agree to 2e-7)."""
    import torch
    from fixtures_models import TOKENS

    from ggufkit.eval.model import load_model

    f32 = convert(layouts["v5"], tmp_path / "v5.gguf", outtype="f32").outputs[0]
    with load_model(f32, device="cpu") as model:
        ours = model.logits(torch.tensor([TOKENS])).numpy()[0]
    with torch.no_grad():
        want = _llama_cpp_reference(layouts["v5"])(torch.tensor([TOKENS])).logits[0].float().numpy()
    assert np.abs(ours - want).max() < 1e-3 * (want.max() - want.min())
    got = llama_cpp_logits(f32)
    assert (got.argmax(-1) == ours.argmax(-1)).all()
    assert np.abs(got - ours).max() < 1e-3 * (got.max() - got.min())


def test_perplexity_equals_llama_perplexity(layouts: dict[str, Path], tmp_path: Path) -> None:
    """F32 file, 4 chunks of 64 tokens, each from empty K/V: within 0.1 % of llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity, sample_text

    f32 = convert(layouts["v5"], tmp_path / "v5.gguf", outtype="f32").outputs[0]
    text = sample_text()[:6000]
    path = tmp_path / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    ours = perplexity(f32, text=text, ctx=64, chunks=4, device="cpu", kv_cache="f32")
    theirs, n_chunks = llama_perplexity(f32, path, 64, 4, *F32_PATH)
    assert ours.chunks == n_chunks == 4
    assert abs(ours.ppl / theirs - 1) < 1e-3, (ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(layouts: dict[str, Path], tmp_path: Path) -> None:
    """Every blk.* matmul llama-imatrix collects (altup router twice per layer, AltUp coefficients, LAuReL,
    attention with or without K/V, FFN, per-layer gate and projection): the same entries, ``in_sum2`` within
    the GELU architectures' tolerance (llama.cpp's F16 GELU table)."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import CHUNKS, CTX, GELU_TOLERANCE

    from ggufkit.eval.perplexity import sample_text

    f32 = convert(layouts["v5"], tmp_path / "v5.gguf", outtype="f32").outputs[0]
    text = tmp_path / "text.txt"
    text.write_text(sample_text()[:6000] + "\n", encoding="utf-8")
    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", text, "-c", CTX, "--chunks", CHUNKS]
    llama_imatrix("-m", f32, "-o", ref, *common, *F32_ATTENTION)
    ours(f32, "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight", "altup_router.weight", "altup_predict_coef.weight",
        "altup_correct_coef.weight", "laurel_l.weight", "laurel_r.weight", "inp_gate.weight", "proj.weight"}
    assert "blk.21.attn_k.weight" not in rel and "blk.21.attn_q.weight" in rel
    assert max(rel.values()) <= GELU_TOLERANCE, sorted(rel.items(), key=lambda kv: -kv[1])[:5]


def test_sparsity_scale_is_torchs_float32_icdf() -> None:
    import torch

    for p in (0.95, 0.9, 0.5, 0.99, 0.3):
        want = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(p, dtype=torch.float32)).item()
        assert np.float32(_std_multiplier(p)) == np.float32(want)
    assert _std_multiplier(0.0) == -np.inf


@pytest.mark.parametrize("change, word", [
    ({"laurel_rank": 32}, "laurel_rank"),
    ({"hidden_size_per_layer_input": 128}, "hidden_size_per_layer_input"),
    ({"altup_num_inputs": 2}, "altup_num_inputs"),
    ({"final_logit_softcapping": None}, "final_logit_softcapping"),
    ({"activation_sparsity_pattern": [0.95] * 5 + [0.0] * 17}, "activation_sparsity_pattern"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
    ({"layer_types": ["sliding_attention"] * 22}, "are not sliding and global"),
    ({"altup_correct_scale": False}, "altup_correct_scale"),
])
def test_what_llama_cpp_fixes_is_refused(change: dict[str, Any], word: str) -> None:
    config = {**_config(), "model_type": "gemma3n_text", **change}
    with pytest.raises(UnsupportedArchitectureError, match=word):
        check_config(config)


def test_release_and_default_spellings_pass() -> None:
    config = _config()
    check_config(config)
    # no layer_types / activation_sparsity_pattern: transformers' defaults (every 5th layer global, 0.95 on the
    # first 10 layers), which are llama.cpp's
    check_config({k: v for k, v in config.items() if k not in ("layer_types", "activation_sparsity_pattern")})


def test_cli_refuses_in_one_line(layouts: dict[str, Path], tmp_path: Path) -> None:
    import shutil
    import sys

    bad = tmp_path / "bad"
    shutil.copytree(layouts["release"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["laurel_rank"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "ggufkit", "convert", str(bad), "-o", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "laurel_rank" in r.stderr


# -- quantize ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 256-wide Gemma 3n converted to F16 (k-quant rows), and an importance matrix for it."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("gemma3n-quant")
    ckpt = make_gemma3n(d / "m", hidden_size=256, intermediate_size=512, head_dim=64)
    model = convert(ckpt, d / "m.gguf", outtype="f16").outputs[0]
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run): the
    per-layer token embedding as token_embd, altup / laurel / per_layer_model_proj kept as they are."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    flags: tuple[str, ...] = ()
    options = QuantOptions(dry_run=True)
    if with_imatrix:
        flags = ("--imatrix", str(quant_model["imatrix"]))
        with open_gguf(quant_model["imatrix"]) as m:
            sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
        options = QuantOptions(dry_run=True, imatrix_sizes=sizes)
    mismatches = [t for t in TYPE_CHOICES
                  if planned_types(quant_model["model"], t, options) != dry_run_types(quant_model["model"], t, *flags)]
    assert not mismatches


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", False), ("q8_0", False),
                                                      ("q4_k_m", True), ("iq3_xxs", True)])
def test_whole_file_equals_llama_quantize(quant_model: dict[str, Path], tmp_path: Path, target: str,
                                          with_imatrix: bool) -> None:
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.quant import quantize_file

    flags = ["--imatrix", str(quant_model["imatrix"])] if with_imatrix else []
    subprocess.run([str(tool_path("llama-quantize")), *flags, str(quant_model["model"]), str(tmp_path / "ref.gguf"),
                    target.upper(), "2"], check=True, capture_output=True)
    quantize_file(quant_model["model"], tmp_path / "ours.gguf", target,
                  imatrix=quant_model["imatrix"] if with_imatrix else None, threads=2)
    assert_same_quantized(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_release_of_a_tiny_gemma3n(layouts: dict[str, Path], tmp_path: Path) -> None:
    """``release`` end to end on the released layout: F16 master, importance matrix, a Q8_0 file whose
    perplexity and KLD the manifest reports; every GGUF loads in llama.cpp."""
    from ggufkit.eval.perplexity import sample_text
    from ggufkit.release import release

    text = tmp_path / "text.txt"
    text.write_text(sample_text()[:6000] + "\n", encoding="utf-8")
    out = tmp_path / "release"
    result = release(layouts["release"], out, types=["q8_0"], master="f16", imatrix_text=text, ctx=64, chunks=2,
                     imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    ggufs = [out / f for f in result.files if f.endswith(".gguf") and ".imatrix" not in f]
    assert len(ggufs) == 2 and any(p.name.endswith("-Q8_0.gguf") for p in ggufs), result.files
    for path in ggufs:
        with open_gguf(path) as f:
            assert f.architecture == "gemma3n"
        assert np.isfinite(llama_cpp_logits(path)).all()


def tiny_f32(d: Path) -> Path:
    """tests/test_eval_imatrix_archs.py's Gemma 3n case: 12 layers (10 sparse, sliding and global, no KV sharing:
    every block matrix is one llama-imatrix collects) saved by transformers 5, converted to F32 by ggufkit."""
    return convert(make_gemma3n(d / "ckpt", n_layer=12, shared=0), d / "f32.gguf", outtype="f32").outputs[0]
