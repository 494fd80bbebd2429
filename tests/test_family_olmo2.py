"""OLMo 2 (``Olmo2ForCausalLM``, GGUF arch ``olmo2``) end to end against llama.cpp (issue 33).

OLMo 2 is a post-norm transformer: no norm before attention or the FFN, an RMSNorm after each (added to the
residual afterwards), and RMS q/k norms over the whole q and k projections (``[n_embd]`` and
``[n_head_kv * head_dim]``, not per head as Qwen 3). Tiny random checkpoints of transformers' own class, in
two layouts:

* ``release``: config.json as allenai's released OLMo 2 checkpoints spell it (OLMo-2-1124-7B, OLMo-2-0325-32B:
  transformers 4.4x, ``rope_theta`` an integer at the root, ``rope_scaling: null``, ``torch_dtype``, an
  embedding padded beyond the tokenizer: 100352 rows for 100278 tokens);
* ``tf5``: what transformers 5's ``save_pretrained`` writes (``rope_parameters``, ``dtype``).

The tokenizer is a byte-level BPE that llama.cpp's converter knows by its check hash (GPT-2's, rebuilt from
llama.cpp's vocab file): the released dolma2 tokenizer (cl100k-based, llama.cpp's "dbrx" hash) cannot be
built without its 100k-token vocabulary, which the tests do not download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from test_convert_archs import _compared_key, llama_cpp_convert

from ggufkit.converters import convert
from ggufkit.format import open_gguf

HF_CLASS = "Olmo2ForCausalLM"
LAYOUTS = ("release", "tf5")
#: Embedding rows beyond the tokenizer in the release layout (the released files pad 100278 tokens to 100352).
EXTRA_VOCAB = 7


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 config.json in the released OLMo 2 spelling (OLMo-2-1124-7B's keys)."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters", None) or {}
    config.pop("dtype", None)
    scaling = None
    if rope.get("rope_type", "default") != "default":  # transformers 4's spelling: "type"
        scaling = {"type": rope["rope_type"], "factor": rope["factor"]}
    config.update(rope_theta=int(rope.get("rope_theta", 10000)), rope_scaling=scaling, torch_dtype="float32",
                  transformers_version="4.47.0.dev0")
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def make_olmo2(dir: Path, layout: str, **overrides: Any) -> Path:
    """A tiny OLMo 2 checkpoint in ``layout`` (``release`` or ``tf5``)."""
    if layout == "release":
        theta = {} if "rope_parameters" in overrides else {"rope_theta": 500000.0}
        overrides = {"extra_vocab": EXTRA_VOCAB, **theta, **overrides}
    d = make_checkpoint(dir, HF_CLASS, **overrides)
    if layout == "release":
        to_release_config(d / "config.json")
    return d


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = request.param
    d = make_olmo2(tmp_path_factory.mktemp(f"olmo2-{layout}") / "m", layout)
    report = convert(d, d.parent / "ours.gguf", outtype="f32")
    return {"layout": layout, "dir": d, "ours": report.outputs[0], "plan": report.plan}


def assert_same_file(theirs: Path, ours: Path, *, ordered: bool = True) -> None:
    """Every tensor byte-identical, every key equal (naming and ggufkit's provenance keys aside); in the same
    order unless ``ordered`` is false."""
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        listed = [[(t.name, t.ggml_type, t.ne) for t in f.tensors] for f in (a, b)]
        assert listed[0] == listed[1] if ordered else sorted(listed[0]) == sorted(listed[1])
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = [k for k in a.kv if _compared_key(k)]
        keys_b = [k for k in b.kv if _compared_key(k)]
        assert set(keys_a) == set(keys_b), set(keys_a) ^ set(keys_b)
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            if isinstance(va, (list, np.ndarray)):
                assert np.array_equal(np.asarray(va), np.asarray(vb)), key
            else:
                assert va == vb, key


def test_file_equals_llama_cpps_converter(case: dict[str, Any]) -> None:
    theirs = llama_cpp_convert(case["dir"], case["dir"].parent / "theirs.gguf")
    assert_same_file(theirs, case["ours"])
    with open_gguf(case["ours"]) as f:
        assert f.architecture == "olmo2"
        assert f["blk.0.attn_q_norm.weight"].ne == (64,) and f["blk.0.attn_k_norm.weight"].ne == (32,)
        assert "blk.0.attn_norm.weight" not in f and "blk.0.ffn_norm.weight" not in f
        assert f.get("olmo2.rope.freq_base") == (500000.0 if case["layout"] == "release" else 10000.0)


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_other_outtypes_equal_llama_cpps_converter(outtype: str, tmp_path: Path) -> None:
    """Norms F32, matrices in the outtype, byte for byte; a quantized outtype in llama-quantize's tensor order
    (grouped by layer, as for every architecture), the converter's tensors and bytes."""
    d = make_olmo2(tmp_path / "m", "tf5", num_hidden_layers=1)
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", outtype)
    ours = convert(d, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert_same_file(theirs, ours, ordered=outtype != "q8_0")


def test_llama_cpp_logits_match_transformers(case: dict[str, Any]) -> None:
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_check_passes_in_the_release_layout_and_fails_on_other_weights(case: dict[str, Any], tmp_path: Path) -> None:
    """``convert --check`` runs OLMo 2 (transformers' model against the evaluator's) in both layouts."""
    from ggufkit.eval.convert_check import check_conversion

    ok = check_conversion(case["dir"], case["ours"], case["plan"], device="cpu")
    assert ok.status == "passed", ok.failures
    other = make_olmo2(tmp_path / "other", case["layout"], seed=7)
    bad = check_conversion(case["dir"], convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0],
                           case["plan"], device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


def test_ppl_equals_llama_perplexity_in_the_release_layout(case: dict[str, Any], tmp_path: Path) -> None:
    """F32 and F16 files (tests/test_eval_archs_vs_llama_perplexity.py runs the tf5 layout's F32 file too)."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity, sample_text

    text = sample_text()[:6000]
    path = tmp_path / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    f16 = convert(case["dir"], tmp_path / "f16.gguf", outtype="f16").outputs[0]
    for model, rounding in ((case["ours"], False), (f16, True)):
        ours = perplexity(model, text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=rounding, kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, 64, 4, *F32_PATH)
        assert ours.chunks == n_chunks == 4
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(case: dict[str, Any], tmp_path: Path) -> None:
    """Every matmul of the post-norm blocks (q/k/v read the raw residual stream, no pre-norm) and the untied
    head: the same entries and counts as llama-imatrix, ``in_sum2`` within float32 noise."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import CHUNKS, CTX, F32_TOLERANCE, _collectable

    from ggufkit.eval.perplexity import sample_text

    text = tmp_path / "text.txt"
    text.write_text(sample_text()[:6000] + "\n", encoding="utf-8")
    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", text, "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", case["ours"], "-o", ref, *common, *F32_ATTENTION)
    ours(case["ours"], "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert set(rel) == _collectable(case["ours"])
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight"}
    assert max(rel.values()) <= F32_TOLERANCE, rel


def test_kld_equals_llama_perplexitys(case: dict[str, Any], tmp_path: Path) -> None:
    """KL divergence of a Q8_0 file from the F32 one, as ``llama-perplexity --kl-divergence`` reports it. Its
    Q8_0 matmuls round the activations to 8 bits (Q8_0 blocks): with that rounding reproduced
    (``ggml_rounding``) the mean KLD agrees within 3 % (the rounding is discontinuous, so the per-token values
    scatter; measured 0.5 % on a 256-wide model); with float32 activations it does not."""
    import re
    import subprocess

    from llama_cpp_sources import tool_path
    from test_eval_archs_vs_llama_perplexity import F32_PATH

    from ggufkit.eval import kl_divergence
    from ggufkit.eval.perplexity import sample_text
    from ggufkit.quant import quantize_file

    text = sample_text()[:6000]
    path = tmp_path / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    q8 = tmp_path / "q8.gguf"
    quantize_file(case["ours"], q8, "q8_0")
    base = tmp_path / "base.kld"

    def llama_perplexity(*args: str | Path) -> str:
        cmd = [str(tool_path("llama-perplexity")), "-f", str(path), "-c", "64", "-b", "64", "--chunks", "4", "-t",
               "2", "-nr", *F32_PATH, *map(str, args)]
        for _ in range(10):  # its asynchronous log sometimes loses the last lines (see llama_perplexity_running)
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-2000:]
            if "Minimum KLD" in r.stdout + r.stderr or "Final estimate" in r.stdout + r.stderr:
                return r.stdout + r.stderr
        raise AssertionError(r.stderr[-2000:])

    llama_perplexity("-m", case["ours"], "--kl-divergence-base", base)
    m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", llama_perplexity("-m", q8, "--kl-divergence-base", base,
                                                              "--kl-divergence"))
    assert m is not None
    theirs = float(m.group(1))
    rounded, plain = (kl_divergence(q8, case["ours"], text=text, ctx=64, chunks=4, device="cpu",
                                    ggml_rounding=r, kv_cache="f32").kld for r in (True, False))
    assert rounded is not None and plain is not None
    assert abs(rounded["mean_kld"] / theirs - 1) < 3e-2, (rounded["mean_kld"], theirs)
    assert abs(plain["mean_kld"] / theirs - 1) > 3e-2, (plain["mean_kld"], theirs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_rope_scaling_in_either_spelling(layout: str, tmp_path: Path) -> None:
    """Linear RoPE scaling as transformers 4 spells it (``rope_scaling: {"type": "linear"}``, the release
    layout) and as transformers 5 does (``rope_parameters: {"rope_type": "linear"}``): llama.cpp's keys
    (rope.scaling.type, rope.scaling.factor), its logits equal transformers', and ``--check`` passes."""
    from ggufkit.eval.convert_check import check_conversion

    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    d = make_olmo2(tmp_path / "m", layout, rope_parameters=rope)
    config = json.loads((d / "config.json").read_text())
    assert ("rope_scaling" in config) == (layout == "release") and ("rope_parameters" in config) == (layout == "tf5")
    report = convert(d, tmp_path / "ours.gguf", outtype="f32")
    ours = report.outputs[0]
    assert_same_file(llama_cpp_convert(d, tmp_path / "theirs.gguf"), ours)
    with open_gguf(ours) as f:
        assert (f.get("olmo2.rope.scaling.type"), f.get("olmo2.rope.scaling.factor")) == ("linear", 2.0)
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())
    assert check_conversion(d, ours, report.plan, device="cpu").status == "passed"


def test_tied_head_is_written_as_output_weight_which_the_olmo2_loader_needs(tmp_path: Path) -> None:
    """A checkpoint with ``tie_word_embeddings: true``: llama.cpp's converter writes no ``output.weight`` and the
    olmo2 loader then refuses the file (src/models/olmo2.cpp creates ``output`` without TENSOR_DUPLICATED); ggufkit
    writes the embedding again under that name (registry ``output: required``), and the file computes
    transformers' model."""
    d = make_olmo2(tmp_path / "m", "tf5", tie_word_embeddings=True)
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    with open_gguf(ours) as f:
        assert bytes(f.raw(f["output.weight"])) == bytes(f.raw(f["token_embd.weight"]))
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


# -- quantization --------------------------------------------------------------------------------------
def olmo2_gguf_tensors(n_layer: int = 8, d: int = 256, ff: int = 512) -> list[tuple[str, tuple[int, ...]]]:
    """An OLMo 2 file's tensors as llama.cpp's converter writes them (checkpoint order; GQA 4/2, untied head,
    no attn_norm/ffn_norm, whole-projection q/k norms)."""
    kv = d // 2
    per = [("attn_k.weight", (kv, d)), ("attn_k_norm.weight", (kv,)), ("attn_output.weight", (d, d)),
           ("attn_q.weight", (d, d)), ("attn_q_norm.weight", (d,)), ("attn_v.weight", (kv, d)),
           ("ffn_down.weight", (d, ff)), ("ffn_gate.weight", (ff, d)), ("ffn_up.weight", (ff, d)),
           ("post_attention_norm.weight", (d,)), ("post_ffw_norm.weight", (d,))]
    return ([("output.weight", (256, d)), ("token_embd.weight", (256, d))]
            + [(f"blk.{i}.{n}", s) for i in range(n_layer) for n, s in per] + [("output_norm.weight", (d,))])


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures_quantize import imatrix_values, make_gguf, write_imatrix_gguf

    d = tmp_path_factory.mktemp("olmo2-quant")
    hp = {"context_length": 256, "embedding_length": 256, "block_count": 8, "feed_forward_length": 512,
          "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6}
    model = make_gguf(d / "olmo2.gguf", "olmo2", hp, olmo2_gguf_tensors(), seed=4)
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run)."""
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


def llama_quantize_binary(inp: Path, out: Path, target: str, *flags: str) -> None:
    import subprocess

    from llama_cpp_sources import tool_path

    subprocess.run([str(tool_path("llama-quantize")), *flags, str(inp), str(out), target.upper(), "2"],
                   check=True, capture_output=True)


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", False), ("q4_k_m", True),
                                                      ("iq3_xxs", True)])
def test_whole_file_equals_llama_quantize(quant_model: dict[str, Path], tmp_path: Path, target: str,
                                          with_imatrix: bool) -> None:
    from fixtures_quantize import assert_same_quantized

    from ggufkit.quant import quantize_file

    flags = ("--imatrix", str(quant_model["imatrix"])) if with_imatrix else ()
    llama_quantize_binary(quant_model["model"], tmp_path / "ref.gguf", target, *flags)
    quantize_file(quant_model["model"], tmp_path / "ours.gguf", target,
                  imatrix=quant_model["imatrix"] if with_imatrix else None, threads=2)
    assert_same_quantized(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


# -- release -------------------------------------------------------------------------------------------
def test_release_end_to_end(tmp_path: Path) -> None:
    """``release`` of a tiny OLMo 2 in the released layout: F16 master, importance matrix (llama-imatrix's
    entries on that master), Q8_0 and Q4_K_M, card; every file loads in llama.cpp and the master's reported
    perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix

    from ggufkit.eval.perplexity import sample_text
    from ggufkit.quant.imatrix.collector import read_raw_imatrix
    from ggufkit.release import release

    ckpt = make_olmo2(tmp_path / "tiny-olmo2", "release", hidden_size=256, intermediate_size=256)
    text = tmp_path / "text.txt"
    text.write_text(sample_text()[:6000] + "\n", encoding="utf-8")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q8_0", "q4_k_m"], master="f16", imatrix_text=text, eval_text=text,
                     ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    imatrix = next(out / f for f in result.files if ".imatrix" in f)
    quants = [out / f for f in result.files if f.endswith(("-Q8_0.gguf", "-Q4_K_M.gguf"))]
    assert len(quants) == 2
    for path in (master, *quants):
        with open_gguf(path) as f:
            assert f.architecture == "olmo2"
        assert np.isfinite(llama_cpp_logits(path)).all()
    ref = tmp_path / "ref.gguf"
    llama_imatrix("-m", master, "-f", text, "-c", 64, "--chunks", 2, "-o", ref, *F32_ATTENTION)
    assert sorted(read_raw_imatrix(imatrix).entries) == sorted(read_raw_imatrix(ref).entries)
    manifest = json.loads((out / "manifest.json").read_text())
    reported = manifest["steps"]["eval-master"]["results"]["ppl"]
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    assert abs(reported / theirs - 1) < 1e-3, (reported, theirs)
