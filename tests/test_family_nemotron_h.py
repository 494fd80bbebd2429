"""Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2 and 3: transformers' ``NemotronHForCausalLM``) end to end
(issue 33): GGUF ``nemotron_h`` (Mamba2, attention and squared-ReLU MLP layers) and ``nemotron_h_moe`` (MoE
layers instead of the MLPs).

* Config spellings. The release configs (nvidia/Nemotron-H-8B-Base-8K, NVIDIA-Nemotron-Nano-9B-v2,
  NVIDIA-Nemotron-3-Nano-30B-A3B) write the schedule as ``hybrid_override_pattern`` (``M``/``*``/``-``/``E``)
  with ``num_hidden_layers``; transformers 5's ``save_pretrained`` writes ``layers_block_type`` (a list) and no
  ``num_hidden_layers``, plus MoE defaults (``num_experts_per_tok``...) in every config. llama.cpp's converter
  (vendored in llama-cpp-python 0.3.36) reads the config through transformers' AutoConfig, which, with
  transformers 5 installed, turns EVERY spelling into the list and fills in ``num_experts_per_tok``: a dense
  checkpoint then comes out as ``nemotron_h_moe`` with every FFN width 0, a file llama.cpp's own loader refuses
  (the MLP layers read as Mamba2 layers without ``ssm_in``). The reference for dense checkpoints is therefore
  llama.cpp's converter reading the release config.json as written (its fallback when AutoConfig does not know
  the model: ``raw_llama_cpp_convert``), which is the file llama.cpp runs; for MoE checkpoints its normal run.
  ggufkit converts every spelling to that file.
* The evaluator (eval/family_nemotron_h.py) against llama-perplexity and llama-imatrix, ``--check``, whole
  quantized files against llama-quantize, ``release``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import llama_cpp_dir
from test_convert_archs import EXTRA_KEYS, _compared_key, llama_cpp_convert
from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2

from ggufkit.converters import convert
from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.eval.perplexity import perplexity, sample_text
from ggufkit.format import open_gguf

HF_CLASS = "NemotronHForCausalLM"
CTX = 64
CHUNKS = 4
#: GPT-2's BPE has 50257 tokens; llama.cpp pads the token list to a multiple of 8, so the embedding is too.
EXTRA_VOCAB = 7
#: The MoE variant (Nemotron 3 Nano's layer kinds): Mamba2, MoE (4 experts, top-2, shared expert, routed
#: scaling 2.5 from the fixture), attention.
MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe"])
_CHAR = {"linear_attention": "M", "mlp": "-", "full_attention": "*", "moe": "E"}
_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
             "n_shared_experts", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group")


def to_release_config(path: Path) -> None:
    """The released config.json's spelling of a transformers-5 save: ``hybrid_override_pattern`` and
    ``num_hidden_layers`` (no ``layers_block_type``), the Nemotron-H 8B keys (``attention_head_dim``,
    ``rms_norm_eps``, ``time_step_rank``, ``torch_dtype``, transformers 4.48's version); MoE keys only in
    MoE configs (Nemotron 3 Nano)."""
    config = json.loads(path.read_text())
    types = config.pop("layers_block_type")
    moe = "moe" in types
    for key in ("dtype", "mtp_layers_block_type", "moe_latent_size", "moe_shared_expert_overlap",
                "num_nextn_predict_layers", "output_router_logits", *(() if moe else _MOE_KEYS)):
        config.pop(key, None)
    config.update(hybrid_override_pattern="".join(_CHAR[t] for t in types), num_hidden_layers=len(types),
                  attention_head_dim=config["head_dim"], rms_norm_eps=config["layer_norm_epsilon"],
                  time_step_limit=[0.0, float("inf")], time_step_rank=256, torch_dtype="bfloat16",
                  transformers_version="4.48.0.dev0")
    path.write_text(json.dumps(config, indent=2))


def raw_llama_cpp_convert(model: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter reading config.json as written: its ModelBase.load_hparams falls back to the
    file when AutoConfig fails (as with a transformers that does not know nemotron_h); AutoConfig is made
    to fail."""
    root = llama_cpp_dir()
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "import conversion.base as base\n"
            "class NoAutoConfig:\n"
            "    @staticmethod\n"
            "    def from_pretrained(*a, **k):\n"
            "        raise ValueError('read config.json as written')\n"
            "base.AutoConfig = NoAutoConfig\n"
            f"sys.argv = [{str(root / 'convert_hf_to_gguf.py')!r}, {str(model)!r}, '--outfile', {str(out)!r}, "
            f"'--outtype', {outtype!r}]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
    return out


def _make(d: Path, release: bool = False, **overrides: Any) -> Path:
    make_checkpoint(d, HF_CLASS, extra_vocab=EXTRA_VOCAB, **overrides)
    if release:
        to_release_config(d / "config.json")
    return d


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights (seed 0) as transformers 5 saves them and in the release spelling, dense and MoE."""
    d = tmp_path_factory.mktemp("nemotron_h")
    return {"v5": _make(d / "v5"), "release": _make(d / "release", release=True),
            "moe-v5": _make(d / "moe-v5", **MOE), "moe-release": _make(d / "moe-release", release=True, **MOE)}


@pytest.fixture(scope="module")
def files(layouts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ggufkit's conversions (``<layout>-<outtype>``) and llama.cpp's converter's (``theirs-...``)."""
    d = tmp_path_factory.mktemp("nemotron_h-files")
    out = {f"theirs-release-{t}": raw_llama_cpp_convert(layouts["release"], d / f"theirs-release-{t}.gguf", t)
           for t in ("f32", "f16")}
    for name in ("moe-v5", "moe-release"):
        out[f"theirs-{name}-f32"] = llama_cpp_convert(layouts[name], d / f"theirs-{name}-f32.gguf", "f32")
    out["theirs-moe-v5-f16"] = llama_cpp_convert(layouts["moe-v5"], d / "theirs-moe-v5-f16.gguf", "f16")
    for name, outtype in (("v5", "f32"), ("release", "f32"), ("v5", "f16"), ("moe-v5", "f32"),
                          ("moe-release", "f32"), ("moe-v5", "f16")):
        out[f"{name}-{outtype}"] = convert(layouts[name], d / f"{name}-{outtype}.gguf", outtype=outtype).outputs[0]
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def assert_same_file(theirs: Path, ours: Path, missing: tuple[str, ...] = ()) -> None:
    """Every tensor byte-identical and in the same order, every key of llama.cpp's file equal in ggufkit's
    (naming aside; ``missing``: keys llama.cpp writes from a config field ggufkit's input does not have)."""
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = [k for k in a.kv if _compared_key(k) and k not in missing]
        extra = {k for k in b.kv if _compared_key(k)} - set(keys_a)
        assert extra <= set(EXTRA_KEYS), extra
        assert not {k for k in missing if k in b.kv}
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            assert (np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray))
                    else va == vb), key


def _assert_runs_transformers_model(checkpoint: Path, gguf: Path) -> None:
    """llama.cpp's logits of ``gguf`` are transformers' (f32: top-1 identical, within 1e-3 of the range)."""
    want, got = transformers_logits(checkpoint), llama_cpp_logits(gguf)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_fixture_spellings(layouts: dict[str, Path]) -> None:
    v5 = json.loads((layouts["v5"] / "config.json").read_text())
    release = json.loads((layouts["release"] / "config.json").read_text())
    moe = json.loads((layouts["moe-release"] / "config.json").read_text())
    assert "num_hidden_layers" not in v5 and "hybrid_override_pattern" not in v5 and v5["num_experts_per_tok"] == 2
    assert v5["layers_block_type"][:3] == ["linear_attention", "mlp", "full_attention"]
    assert release["hybrid_override_pattern"] == "M-*-M*" and release["num_hidden_layers"] == 6
    assert "layers_block_type" not in release and "num_experts_per_tok" not in release
    assert moe["hybrid_override_pattern"] == "ME*EME" and moe["n_routed_experts"] == 4


def test_dense_converts_to_the_file_llama_cpp_runs(layouts: dict[str, Path], files: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """Both spellings of a dense checkpoint convert to llama.cpp's converter's file of the release config
    (transformers 5's save has no rms_norm_eps: the loader then reads layer_norm_epsilon, the same value),
    and that file runs transformers' model in llama.cpp. llama.cpp's converter, run as it is with transformers 5,
    writes a nemotron_h_moe file with no FFN widths that llama.cpp cannot load."""
    for name in ("release", "v5"):
        missing = ("nemotron_h.attention.layer_norm_rms_epsilon",) if name == "v5" else ()
        assert_same_file(files["theirs-release-f32"], files[f"{name}-f32"], missing)
        _assert_runs_transformers_model(layouts[name], files[f"{name}-f32"])
    assert_same_file(files["theirs-release-f16"], files["v5-f16"], ("nemotron_h.attention.layer_norm_rms_epsilon",))
    broken = llama_cpp_convert(layouts["v5"], tmp_path / "broken.gguf")
    with open_gguf(broken) as m:
        assert m.architecture == "nemotron_h_moe"
        assert list(m.get("nemotron_h_moe.feed_forward_length")) == [0] * 6
    with pytest.raises(ValueError, match="Failed to load model"):
        llama_cpp_logits(broken)


def test_moe_converts_as_llama_cpp_does(layouts: dict[str, Path], files: dict[str, Path]) -> None:
    """The MoE variant, both spellings: llama.cpp's converter's file, byte for byte (f32 and f16), running
    transformers' model in llama.cpp (sigmoid router with its correction bias, routed scaling 2.5)."""
    for name in ("moe-v5", "moe-release"):
        assert_same_file(files[f"theirs-{name}-f32"], files[f"{name}-f32"])
        _assert_runs_transformers_model(layouts[name], files[f"{name}-f32"])
    assert_same_file(files["theirs-moe-v5-f16"], files["moe-v5-f16"])
    with open_gguf(files["moe-v5-f32"]) as m:
        assert m.architecture == "nemotron_h_moe"
        assert m.get("nemotron_h_moe.expert_weights_scale") == 2.5


def test_bf16_checkpoint_converts_as_llama_cpp_does(tmp_path: Path) -> None:
    """A bfloat16 checkpoint (as released): A = -exp(A_log) from the widened float32 values, F32 in the file, the
    other tensors' bf16 bits kept (bf16) or widened (f32)."""
    d = _make(tmp_path / "bf16", release=True, dtype="bfloat16")
    for outtype in ("f32", "bf16"):
        theirs = raw_llama_cpp_convert(d, tmp_path / f"theirs-{outtype}.gguf", outtype)
        assert_same_file(theirs, convert(d, tmp_path / f"ours-{outtype}.gguf", outtype=outtype).outputs[0])


def _edit(src: Path, d: Path, **changes: Any) -> Path:
    """A copy of checkpoint ``src`` with config fields changed (None removes one)."""
    import shutil

    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_every_schedule_spelling_gives_the_same_file(layouts: dict[str, Path], files: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """transformers' ``layer_types`` (NemotronHConfig's attribute_map name), the pattern string and the list,
    alone or together when they agree."""
    release = layouts["release"]
    pattern = json.loads((release / "config.json").read_text())["hybrid_override_pattern"]
    names = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "full_attention"]
    for i, changes in enumerate([dict(hybrid_override_pattern=None, layer_types=names),
                                 dict(hybrid_override_pattern=None, layers_block_type=["mamba", "mlp", "attention",
                                                                                       "mlp", "mamba", "attention"]),
                                 dict(layers_block_type=names, num_hidden_layers=None)]):
        d = _edit(release, tmp_path / f"s{i}", **changes)
        assert_same_file(files["theirs-release-f32"], convert(d, tmp_path / f"s{i}.gguf", outtype="f32").outputs[0])
    assert pattern == "M-*-M*"


@pytest.mark.parametrize(("changes", "message"), [
    (dict(layers_block_type=["linear_attention"] * 6), "schedules disagree"),
    (dict(num_hidden_layers=5), "num_hidden_layers 5 but a schedule of 6"),
    (dict(hybrid_override_pattern="M-*EM*"), "both dense MLP and MoE"),
    (dict(hybrid_override_pattern="M-*XM*"), "layer kinds ['X']"),
    (dict(hybrid_override_pattern=None), "no layer schedule"),
    (dict(vocab_size=50260), "not a multiple of 8"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    (dict(mamba_proj_bias=True), "mamba_proj_bias"),
    (dict(time_step_limit=[0.0, 10.0]), "time_step_limit"),
    (dict(num_nextn_predict_layers=1), "multi-token-prediction"),
])
def test_what_llama_cpp_cannot_represent_is_refused(layouts: dict[str, Path], tmp_path: Path,
                                                    changes: dict[str, Any], message: str) -> None:
    """One line, exit 2, before any work."""
    d = _edit(layouts["release"], tmp_path / "bad", **changes)
    with pytest.raises(UnsupportedArchitectureError, match=f"nemotron_h: .*{__import__('re').escape(message)}"):
        convert(d, tmp_path / "out.gguf", outtype="f32")
    r = invoke("convert", str(d), "-o", str(tmp_path / "cli.gguf"), "--outtype", "f32")
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "cli.gguf").exists()


@pytest.mark.parametrize("name", ["release", "moe-v5"])
def test_ppl_equals_llama_perplexity(name: str, files: dict[str, Path], text_file: tuple[str, Path]) -> None:
    """F32: within 0.1 % of llama-perplexity on its float32 path, each chunk from an empty recurrent state."""
    f32 = files[f"{name}-f32"]
    text, path = text_file
    mine = perplexity(f32, text=text, ctx=CTX, chunks=CHUNKS, device="cpu")
    theirs, n_chunks = llama_perplexity(f32, path, CTX, CHUNKS, *F32_PATH)
    assert mine.chunks == n_chunks == CHUNKS
    assert abs(mine.ppl / theirs - 1) < 1e-3, (mine.ppl, theirs)


@pytest.mark.parametrize("name", ["v5", "moe-v5"])
def test_f16_perplexity_equals_llama_perplexity(name: str, files: dict[str, Path],
                                                text_file: tuple[str, Path]) -> None:
    """F16 with llama.cpp's F16 rounding of each matmul's input reproduced (--ggml-rounding)."""
    f16 = files[f"{name}-f16"]
    text, path = text_file
    mine = perplexity(f16, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True, kv_cache="f32")
    theirs, n_chunks = llama_perplexity(f16, path, CTX, CHUNKS, *F32_PATH)
    assert mine.chunks == n_chunks == CHUNKS
    assert abs(mine.ppl / theirs - 1) < 1e-3, (mine.ppl, theirs)


@pytest.mark.parametrize("name", ["v5", "moe-v5"])
def test_kl_divergence_of_a_q8_0_file_equals_llama_perplexitys(name: str, layouts: dict[str, Path],
                                                               files: dict[str, Path], text_file: tuple[str, Path],
                                                               tmp_path: Path) -> None:
    """KLD of the Q8_0 conversion from the F32 one: ggufkit (llama.cpp's Q8_0 activations reproduced) against
    llama-perplexity's --kl-divergence, within 3 % of the value."""
    from test_family_cohere2 import _llama_kld

    from ggufkit.eval import kl_divergence

    f32 = files[f"{name}-f32"]
    q8 = convert(layouts[name], tmp_path / "q8_0.gguf", outtype="q8_0").outputs[0]
    text, path = text_file
    mine = kl_divergence(q8, f32, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True,
                         kv_cache="f32")
    theirs = _llama_kld(q8, f32, path, tmp_path)
    assert mine.kld is not None and theirs > 0
    assert abs(mine.kld["mean_kld"] / theirs - 1) < 3e-2, (mine.kld["mean_kld"], theirs)


@pytest.mark.parametrize("name", ["release", "moe-v5"])
def test_imatrix_equals_llama_imatrix(name: str, files: dict[str, Path], text_file: tuple[str, Path],
                                      tmp_path: Path) -> None:
    """The same entries as llama-imatrix (ssm_in, ssm_out, attention, FFN, router, experts, shared expert,
    head; not ssm_conv1d, which is no matmul), the same counts, in_sum2 within 1e-4 relative L2 (F32)."""
    model = files[f"{name}-f32"]
    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", text_file[1], "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", model, "-o", ref, *common, *F32_ATTENTION)
    ours(model, "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert any(n.endswith("ssm_in.weight") for n in rel) and any(n.endswith("ssm_out.weight") for n in rel)
    assert not any("ssm_conv1d" in n for n in rel)
    assert max(rel.values()) <= 1e-4, {n: v for n, v in rel.items() if v > 1e-4}


def test_convert_check(layouts: dict[str, Path], tmp_path: Path) -> None:
    """``convert --check``: the written file's logits against transformers' model, both architectures."""
    for name in ("v5", "moe-v5"):
        r = invoke("convert", str(layouts[name]), "-o", str(tmp_path / f"{name}.gguf"), "--outtype", "f32",
                   "--check")
        assert r.exit_code == 0, r.stderr
        assert "check passed" in r.stdout + r.stderr, r.stdout + r.stderr


#: A model wide enough for every k-quant (rows of 256): attention with 4 heads on 1 KV head (llama-quant's
#: n_gqa() reads layer 0, a Mamba2 layer: 0, not 4), Mamba2 inner size 256.
WIDE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
            mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=2, moe_intermediate_size=256,
            moe_shared_expert_intermediate_size=256,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"] * 2)
WIDE_MOE = ["linear_attention", "moe", "full_attention", "moe"] * 2


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Dense and MoE F16 files (ggufkit's conversion; a locally trained 400-token BPE) and an importance matrix
    file for each."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("nemotron_h-quant")
    out = {}
    for name, schedule in (("dense", WIDE["layers_block_type"]), ("moe", WIDE_MOE)):
        ckpt = make_checkpoint(d / name, HF_CLASS, vocab="gpt-2", **{**WIDE, "layers_block_type": schedule})
        src = convert(ckpt, d / f"{name}.gguf", outtype="f16", pre_tokenizer="gpt-2").outputs[0]
        out[name] = (src, write_imatrix_gguf(d / f"{name}.imatrix.gguf", imatrix_values(src)))
    return out


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_every_preset_plans_as_llama_quantize(quant_models: dict[str, tuple[Path, Path]], name: str) -> None:
    """Every preset's type for every tensor, with and without an importance matrix, as ``llama-quantize
    --dry-run`` chooses them (ssm_conv1d kept, ssm_a/ssm_d/norms F32, the attention layers counted for attn_v)."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    src, imat = quant_models[name]
    with open_gguf(imat) as m:
        sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
    mismatches = []
    for target in TYPE_CHOICES:
        for flags, options in (((), QuantOptions(dry_run=True)),
                               (("--imatrix", str(imat)), QuantOptions(dry_run=True, imatrix_sizes=sizes))):
            expected = dry_run_types(src, target, *flags)
            if planned_types(src, target, options) != expected:
                mismatches.append((target, bool(flags)))
    assert not mismatches


@pytest.mark.parametrize(("name", "target", "with_imatrix"), [
    ("dense", "q4_k_m", False), ("dense", "q3_k_s", False), ("dense", "q2_k", True), ("dense", "iq3_xs", True),
    ("moe", "q4_k_m", False), ("moe", "q5_k_s", True), ("moe", "iq2_xs", True)])
def test_quantized_file_equals_llama_quantize(quant_models: dict[str, tuple[Path, Path]], name: str, target: str,
                                              with_imatrix: bool, tmp_path: Path) -> None:
    """Whole files, byte for byte and key for key, as the llama-quantize binary writes them."""
    from llama_cpp_sources import tool_path

    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    src, imat = quant_models[name]
    flags = ["--imatrix", str(imat)] if with_imatrix else []
    r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(src), str(tmp_path / "ref.gguf"),
                        target.upper(), "2"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    quantize_file(src, tmp_path / "ours.gguf", target, imatrix=imat if with_imatrix else None, threads=2,
                  device="cpu")
    with open_gguf(tmp_path / "ref.gguf") as a, open_gguf(tmp_path / "ours.gguf") as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        keys = [k for k in a.kv if not k.startswith("ggufkit.")]
        assert keys == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray)) \
                else va == vb, key


def test_release_of_a_tiny_nemotron_h(layouts: dict[str, Path], text_file: tuple[str, Path],
                                      tmp_path: Path) -> None:
    """``release`` end to end on the MoE variant: F16 master, importance matrix, a Q8_0 file whose perplexity
    and KLD the manifest reports; every GGUF loads in llama.cpp."""
    from ggufkit.release import release

    out = tmp_path / "release"
    result = release(layouts["moe-release"], out, types=["q8_0"], master="f16", imatrix_text=text_file[1], ctx=CTX,
                     chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    ggufs = [out / f for f in result.files if f.endswith(".gguf") and ".imatrix" not in f]
    assert len(ggufs) == 2 and any(p.name.endswith("-Q8_0.gguf") for p in ggufs), result.files
    for path in ggufs:
        with open_gguf(path) as f:
            assert f.architecture == "nemotron_h_moe"
        assert np.isfinite(llama_cpp_logits(path)).all()
