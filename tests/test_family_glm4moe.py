"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``Glm4MoeForCausalLM``, GGUF arch ``glm4moe``) end to end against llama.cpp
(issue 32).

Tiny random checkpoints of transformers' own class, every parameter random (the router's
``e_score_correction_bias`` buffer too): 3 layers (the first dense, ``first_k_dense_replace`` 1), 6 heads over 2 KV
heads of head_dim 32 (6 * 32 is not hidden 64, as GLM-4.5's 96 heads of 128 are not 5120), half of each head
rotated (``partial_rotary_factor`` 0.5, NEOX), q/k/v biases, q/k RMS norms (``use_qk_norm``), 4 routed experts in 2
groups of which 1 stays selectable (``n_group`` / ``topk_group``), top-2, one shared expert, sigmoid router with the
correction bias choosing the experts, top-k weights renormalised and scaled by ``routed_scaling_factor`` 2.5. Two
config layouts:

* ``release``: config.json as zai-org/GLM-4.5 spells it (``partial_rotary_factor`` and ``rope_theta`` at the root,
  ``torch_dtype``, an ``eos_token_id`` list, ``num_nextn_predict_layers`` 1) and its NextN layer stored as the
  releases store it: ``model.layers.{num_hidden_layers}.*``, a whole decoder layer plus ``eh_proj``, ``enorm``,
  ``hnorm``, ``embed_tokens``, ``shared_head.norm`` and ``shared_head.head`` (transformers' class drops it);
* ``tf5``: what transformers 5's ``save_pretrained`` writes (``rope_parameters``, ``dtype``; still
  ``num_nextn_predict_layers`` 1, without any NextN weights).

The tokenizer: GLM's 151k BPE (llama.cpp's check hash "glm4") has no llama.cpp vocab file; GPT-2's (check hash
"gpt-2") stands in, with GLM's added tokens ([gMASK], <|user|>, <|observation|>, ...) that llama.cpp's
``_set_vocab_glm`` names as bos / eot / eom.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, transformers_logits

HF_CLASS = "Glm4MoeForCausalLM"
LAYOUTS = ("release", "tf5")
N_LAYER = 3
#: GLM-4.5's added tokens after <|endoftext|> (zai-org/GLM-4.5 tokenizer.json, ids 151330...), here after GPT-2's.
GLM_ADDED = ("[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
             "<|observation|>")
_BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=N_LAYER,
             num_attention_heads=6, num_key_value_heads=2, head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, use_qk_norm=True, attention_bias=True, max_position_embeddings=128,
             rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})


def _write_glm_tokenizer(dir: Path, kind: str = "real:gpt-2") -> int:
    """GPT-2's BPE rebuilt from llama.cpp's vocab file (``kind`` "gpt-2": a 400-token one of its flavour, which
    llama.cpp's converter does not know but ggufkit identifies by behaviour), with GLM's added tokens appended;
    returns the number of tokens."""
    from fixtures_models import _write_tokenizer
    from tokenizers import AddedToken, Tokenizer

    n = _write_tokenizer(dir, kind)
    tok = Tokenizer.from_file(str(dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_ADDED])
    tok.save(str(dir / "tokenizer.json"))
    config = json.loads((dir / "tokenizer_config.json").read_text())
    config.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config.pop("bos_token", None)
    (dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return n + len(GLM_ADDED)


def _random_like(name: str, shape: tuple[int, ...], g: Any) -> Any:
    import torch

    if len(shape) >= 2:
        return torch.randn(shape, generator=g) * 0.15
    if "norm" in name:
        return 1.0 + torch.randn(shape, generator=g) * 0.1
    return torch.randn(shape, generator=g) * 0.05


def _add_nextn_layer(dir: Path, n_layer: int, n_vocab: int, seed: int) -> None:
    """The NextN layer as GLM's releases store it: ``model.layers.{n_layer}.*`` (a MoE decoder layer and
    ``eh_proj``, ``enorm``, ``hnorm``, ``embed_tokens``, ``shared_head.norm``, ``shared_head.head``), random."""
    import torch
    from safetensors.torch import load_file, save_file

    path = dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 100)
    last, mtp = f"model.layers.{n_layer - 1}.", f"model.layers.{n_layer}."
    for name in sorted(tensors):
        if name.startswith(last):
            tensors[mtp + name[len(last):]] = _random_like(name, tuple(tensors[name].shape), g)
    n_embd = tensors["model.norm.weight"].shape[0]
    for name, shape in (("eh_proj.weight", (n_embd, 2 * n_embd)), ("enorm.weight", (n_embd,)),
                        ("hnorm.weight", (n_embd,)), ("embed_tokens.weight", (n_vocab, n_embd)),
                        ("shared_head.norm.weight", (n_embd,)), ("shared_head.head.weight", (n_vocab, n_embd))):
        tensors[mtp + name] = _random_like(name, shape, g)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def to_release_config(path: Path, n_vocab: int) -> None:
    """Rewrite a transformers 5 config.json in zai-org/GLM-4.5's spelling."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.pop("dtype", None)
    eot = n_vocab - len(GLM_ADDED)
    config.update(partial_rotary_factor=rope["partial_rotary_factor"], rope_theta=rope["rope_theta"],
                  rope_scaling=None, torch_dtype="bfloat16", transformers_version="4.54.0",
                  eos_token_id=[eot - 1, eot + GLM_ADDED.index("<|user|>"), eot + GLM_ADDED.index("<|observation|>")],
                  pad_token_id=eot - 1, num_nextn_predict_layers=1)
    for key in ("bos_token_id", "output_router_logits"):
        config.pop(key, None)
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def build_model(n_vocab: int, seed: int = 0, **overrides: Any) -> Any:
    """A randomized transformers Glm4MoeForCausalLM (float32): every parameter, and the routers'
    ``e_score_correction_bias`` buffers (zeros at init) N(0, 0.1), so that the bias changes which experts run."""
    import torch
    import transformers
    from fixtures_models import randomize

    config = transformers.Glm4MoeConfig(**{**_BASE, "vocab_size": n_vocab, **overrides})
    config.architectures = [HF_CLASS]
    model = transformers.Glm4MoeForCausalLM(config)
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return model.eval()


def make_glm(dir: Path, layout: str = "tf5", *, seed: int = 0, config_edit: Any = None, vocab: str = "real:gpt-2",
             **overrides: Any) -> Path:
    """A tiny checkpoint in ``layout``; ``config_edit(config)`` edits its config.json last."""
    dir.mkdir(parents=True, exist_ok=True)
    n_vocab = _write_glm_tokenizer(dir, vocab)
    build_model(n_vocab, seed, **overrides).save_pretrained(dir)
    if layout == "release":
        to_release_config(dir / "config.json", n_vocab)
        _add_nextn_layer(dir, int(overrides.get("num_hidden_layers", N_LAYER)), n_vocab, seed)
    if config_edit is not None:
        config = json.loads((dir / "config.json").read_text())
        config_edit(config)
        (dir / "config.json").write_text(json.dumps(config, indent=2))
    return dir


def llama_cpp_convert(model: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (its default: NextN layers kept)."""
    from test_family_qwen3next import llama_cpp_convert as convert

    return convert(model, out, outtype, *(flags or ("--outtype", outtype)))


def tiny_f32(d: Path) -> Path:
    """A tiny GLM-4.5 in the released layout, converted to F32 by ggufkit without its NextN layer
    (tests/test_eval_imatrix_archs.py counts every block's matrices; test_imatrix_equals_llama_imatrix here
    runs the file with the NextN block)."""
    from ggufkit.converters import convert

    return Path(convert(make_glm(d / "ckpt", "release"), d / "f32.gguf", outtype="f32", mtp=False).outputs[0])


# -- quantization --------------------------------------------------------------------------------------
def quant_gguf(path: Path, *, n_layer: int = 3, d: int = 256, ff: int = 512, n_exp: int = 8, seed: int = 4) -> Path:
    """A GGUF as llama.cpp's converter lays out glm4moe (its keys, its tensors in checkpoint order; F16
    matrices, F32 vectors and routers): ``n_layer`` trunk blocks (the first dense) and one NextN block, 6 heads
    of 64 over 2 KV heads (GLM-4.5's n_head * head_dim != n_embd), 8 experts with a shared one. Enough for
    llama_model_quantize, which reads only the hparams."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT

    from ggufkit.format import Metadata, TensorSpec, write_gguf

    n_head, n_kv, hd, e, vocab = 6, 2, 64, ff // 4, 256
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "glm4moe")
    u32 = {"block_count": n_layer + 1, "context_length": 256, "embedding_length": d, "feed_forward_length": ff,
           "attention.head_count": n_head, "attention.head_count_kv": n_kv, "expert_count": n_exp,
           "expert_used_count": 2, "expert_group_count": 2, "expert_group_used_count": 1,
           "attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": hd // 2,
           "expert_feed_forward_length": e, "expert_shared_count": 1, "leading_dense_block_count": 1,
           "expert_gating_func": 2, "nextn_predict_layers": 1}
    for key, value in u32.items():
        meta.set(f"glm4moe.{key}", VT.UINT32, value)
    meta.set("glm4moe.rope.freq_base", VT.FLOAT32, 1e6)
    meta.set("glm4moe.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-5)
    meta.set("glm4moe.expert_weights_scale", VT.FLOAT32, 2.5)
    meta.set("glm4moe.expert_weights_norm", VT.BOOL, True)
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, d))]
    for il in range(n_layer + 1):
        b = f"blk.{il}."
        if il == n_layer:
            tensors += [(b + "nextn.eh_proj.weight", (d, 2 * d)), (b + "nextn.embed_tokens.weight", (vocab, d)),
                        (b + "nextn.enorm.weight", (d,)), (b + "nextn.hnorm.weight", (d,))]
        tensors.append((b + "attn_norm.weight", (d,)))
        if il == 0:
            tensors += [(b + "ffn_down.weight", (d, ff)), (b + "ffn_gate.weight", (ff, d)), (b + "ffn_up.weight", (ff, d))]
        else:
            tensors += [(b + "ffn_down_exps.weight", (n_exp, d, e)), (b + "ffn_gate_exps.weight", (n_exp, e, d)),
                        (b + "ffn_up_exps.weight", (n_exp, e, d)), (b + "exp_probs_b.bias", (n_exp,)),
                        (b + "ffn_gate_inp.weight", (n_exp, d)), (b + "ffn_down_shexp.weight", (d, e)),
                        (b + "ffn_gate_shexp.weight", (e, d)), (b + "ffn_up_shexp.weight", (e, d))]
        tensors += [(b + "post_attention_norm.weight", (d,)), (b + "attn_k_norm.weight", (hd,)),
                    (b + "attn_k.bias", (n_kv * hd,)), (b + "attn_k.weight", (n_kv * hd, d)),
                    (b + "attn_output.weight", (d, n_head * hd)), (b + "attn_q_norm.weight", (hd,)),
                    (b + "attn_q.bias", (n_head * hd,)), (b + "attn_q.weight", (n_head * hd, d)),
                    (b + "attn_v.bias", (n_kv * hd,)), (b + "attn_v.weight", (n_kv * hd, d))]
        if il == n_layer:
            tensors += [(b + "nextn.shared_head_head.weight", (vocab, d)), (b + "nextn.shared_head_norm.weight", (d,))]
    tensors += [("output_norm.weight", (d,)), ("output.weight", (vocab, d))]
    rng = np.random.default_rng(seed)
    specs, arrays = [], []
    for name, shape in tensors:
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        f32 = len(shape) == 1 or "ffn_gate_inp" in name
        specs.append(TensorSpec(name, QT.F32 if f32 else QT.F16, shape))
        arrays.append(arr if f32 else arr.astype(np.float16))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


# -- conversion, logits, --check -----------------------------------------------------------------------
CTX = 64
CHUNKS = 4


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, dict[str, Any]]:
    """Each layout's case, built once for the module (``case`` and ``release`` share them)."""
    return {}


def _case(checkpoints: dict[str, dict[str, Any]], factory: pytest.TempPathFactory, layout: str) -> dict[str, Any]:
    """A checkpoint in ``layout``, llama.cpp's --no-mtp file of it and ggufkit's F32 default file."""
    from ggufkit.converters import convert

    if layout not in checkpoints:
        d = make_glm(factory.mktemp(f"glm4moe-{layout}") / "m", layout)
        report = convert(d, d.parent / "ours.gguf", outtype="f32")
        checkpoints[layout] = {"layout": layout, "dir": d, "ours": report.outputs[0], "plan": report.plan,
                               "theirs_no_mtp": llama_cpp_convert(d, d.parent / "theirs-no-mtp.gguf", "f32",
                                                                  "--no-mtp")}
    return checkpoints[layout]


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, checkpoints: dict[str, dict[str, Any]],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _case(checkpoints, tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def release(checkpoints: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The release layout's case with llama.cpp's default file (its NextN layer kept)."""
    c = _case(checkpoints, tmp_path_factory, "release")
    if "theirs" not in c:
        c["theirs"] = llama_cpp_convert(c["dir"], c["dir"].parent / "theirs.gguf")
    return c


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("glm4moe-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def test_no_mtp_equals_llama_cpps_converter(case: dict[str, Any], tmp_path: Path) -> None:
    """``--no-mtp``: every tensor byte-identical and every key equal to llama.cpp's converter's --no-mtp file:
    the correction bias as exp_probs_b.bias, the groups, routed scaling and renormalisation, the rope dimension
    from head_dim and the root or rope_parameters spelling of partial_rotary_factor, the post-attention norm,
    GLM's bos ([gMASK]), eot (<|user|>), unk and eom (<|observation|>)."""
    from test_family_olmo2 import assert_same_file

    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    ours = convert(case["dir"], tmp_path / "ours.gguf", outtype="f32", mtp=False).outputs[0]
    assert_same_file(case["theirs_no_mtp"], ours)
    n = _n_vocab(case["dir"]) - len(GLM_ADDED)
    with open_gguf(ours) as f:
        assert f.get("glm4moe.block_count") == N_LAYER and "glm4moe.nextn_predict_layers" not in f.kv
        assert f.get("glm4moe.rope.dimension_count") == 16 and f.get("glm4moe.expert_group_count") == 2
        assert f.get("glm4moe.expert_weights_scale") == 2.5 and f.get("glm4moe.expert_gating_func") == 2
        assert f.get("tokenizer.ggml.bos_token_id") == n + GLM_ADDED.index("[gMASK]")
        assert f.get("tokenizer.ggml.eot_token_id") == n + GLM_ADDED.index("<|user|>")
        assert f.get("tokenizer.ggml.eom_token_id") == n + GLM_ADDED.index("<|observation|>")
        assert f["blk.1.exp_probs_b.bias"].ne == (4,) and "blk.0.ffn_gate_inp.weight" not in f


def _n_vocab(d: Path) -> int:
    return int(json.loads((d / "config.json").read_text())["vocab_size"])


def test_release_default_keeps_the_nextn_layer_as_llama_cpps_converter(release: dict[str, Any]) -> None:
    """No flag: the NextN layer as llama.cpp's converter writes it by default, blk.{num_hidden_layers} with its
    decoder tensors and nextn.* (eh_proj, embed_tokens, enorm, hnorm, shared_head_head, shared_head_norm),
    block_count 4 and nextn_predict_layers 1: the whole file equal."""
    from test_family_olmo2 import assert_same_file

    from ggufkit.format import open_gguf

    assert_same_file(release["theirs"], release["ours"])
    with open_gguf(release["ours"]) as f:
        assert f.get("glm4moe.block_count") == N_LAYER + 1 and f.get("glm4moe.nextn_predict_layers") == 1
        assert {t.name for t in f.tensors if t.name.startswith("blk.3.nextn.")} == {
            f"blk.3.nextn.{n}.weight" for n in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head",
                                                "shared_head_norm")}




def test_without_nextn_weights_no_flag_writes_llama_cpps_default(checkpoints: dict[str, dict[str, Any]],
                                                                tmp_path_factory: pytest.TempPathFactory,
                                                                tmp_path: Path) -> None:
    """A transformers-5 save has no NextN weights (Glm4MoeForCausalLM drops them) though its config says
    num_nextn_predict_layers 1: without a flag llama.cpp's converter writes block_count 4 and nextn_predict_layers
    1 but no blk.3 tensors (its loader then runs the trunk only: glm4-moe.cpp ``trunk_only``), and so does
    ggufkit (the registry's ``mtp.declared``); the evaluator runs the 3 trunk blocks."""
    from test_family_olmo2 import assert_same_file

    from ggufkit.format import open_gguf

    tf5 = _case(checkpoints, tmp_path_factory, "tf5")
    assert_same_file(llama_cpp_convert(tf5["dir"], tmp_path / "theirs.gguf"), tf5["ours"])
    with open_gguf(tf5["ours"]) as f:
        assert f.get("glm4moe.block_count") == N_LAYER + 1 and f.get("glm4moe.nextn_predict_layers") == 1
        assert not any(t.name.startswith("blk.3.") for t in f.tensors)

def test_mtp_alone_equals_llama_cpps_draft_file(release: dict[str, Any], tmp_path: Path) -> None:
    """``--mtp``: the NextN block alone with the embedding, output norm and head, as llama.cpp's converter
    writes its draft GGUF (Glm4MoeModel.filter_tensors with mtp_only): every tensor and key equal."""
    from test_family_olmo2 import assert_same_file

    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    theirs = llama_cpp_convert(release["dir"], tmp_path / "theirs-mtp.gguf", "f32", "--outtype", "f32", "--mtp")
    ours = convert(release["dir"], tmp_path / "ours-mtp.gguf", outtype="f32", mtp=True).outputs[0]
    assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        assert not any(t.name.startswith(("blk.0.", "blk.1.", "blk.2.")) for t in f.tensors)
        assert "blk.3.nextn.eh_proj.weight" in f and "output.weight" in f

def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    """ggufkit's default file in llama.cpp gives transformers' logits (the NextN block, where the file has one,
    is not run by llama.cpp's main graph, and transformers' class has none)."""
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_evaluator_logits_equal_llama_cpps(case: dict[str, Any]) -> None:
    import torch
    from fixtures_models import TOKENS

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(case["ours"])
    with load_model(case["ours"], device="cpu") as m:
        assert m.hparams.n_trunk == N_LAYER and m.hparams.extra["n_group"] == 2
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


def test_check_passes_and_fails_on_other_weights(release: dict[str, Any], tmp_path: Path) -> None:
    """``convert --check``: transformers' model against the evaluator's forward of the file (NextN block
    included in the file, not run)."""
    from ggufkit.converters import convert
    from ggufkit.eval.convert_check import check_conversion

    ok = check_conversion(release["dir"], release["ours"], release["plan"], device="cpu")
    assert ok.status == "passed", ok.failures
    other = make_glm(tmp_path / "other", "release", seed=7)
    bad = check_conversion(release["dir"], convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0],
                           release["plan"], device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


def test_ppl_equals_llama_perplexity(release: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """F32 and F16 files with the NextN block (which neither runs), 4 chunks of 64 tokens; F16 with llama.cpp's
    F16 rounding of each matmul's input."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.converters import convert
    from ggufkit.eval.perplexity import perplexity

    text, path = sample
    f16 = convert(release["dir"], tmp_path / "f16.gguf", outtype="f16").outputs[0]
    for model, rounding in ((release["ours"], False), (f16, True)):
        ours = perplexity(model, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=rounding,
                          kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, CTX, CHUNKS, *F32_PATH)
        assert ours.chunks == n_chunks == CHUNKS
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(release: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """The attention projections, the dense FFN, the router, the experts (counts per expert) and the shared
    expert, the head: llama-imatrix's entries and nothing of the NextN block, ``in_sum2`` within float32 noise."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import F32_TOLERANCE, _collectable

    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", sample[1], "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", release["ours"], "-o", ref, *common, *F32_ATTENTION)
    ours(release["ours"], "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert set(rel) == {n for n in _collectable(release["ours"]) if not n.startswith("blk.3.")}
    attn = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        *attn, "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.2.")} == {
        *attn, "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
        "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
    assert not any(n.startswith("blk.3.") for n in rel)
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- config spellings and refusals ------------------------------------------------------------------------
def _respelled(src: Path, dir: Path, edit: Any) -> Path:
    """``src``'s checkpoint with its config.json edited by ``edit`` (the weight and tokenizer files linked)."""
    dir.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dir / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dir / "config.json").write_text(json.dumps(config, indent=2))
    return dir


def _sparse_release(config: dict[str, Any]) -> None:
    """A release config that leaves Glm4MoeConfig's defaults out (n_shared_experts 1, norm_topk_prob, one
    group, first_k_dense_replace 1, no NextN count) and says partial_rotary_factor 0.25 only at the root."""
    for key in ("n_shared_experts", "norm_topk_prob", "n_group", "topk_group", "first_k_dense_replace",
                "num_nextn_predict_layers", "routed_scaling_factor"):
        config.pop(key)
    config["partial_rotary_factor"] = 0.25


def test_keys_a_config_leaves_out_are_glm4moeconfigs_defaults(checkpoints: dict[str, dict[str, Any]],
                                                              tmp_path_factory: pytest.TempPathFactory,
                                                              tmp_path: Path) -> None:
    """llama.cpp's converter reads the config through AutoConfig: a key config.json leaves out is
    Glm4MoeConfig's default, and partial_rotary_factor at the root is the rope_parameters one (n_rot 8 here).
    ggufkit writes the same keys, and the file computes what transformers loads from that config."""
    from test_family_olmo2 import assert_same_file

    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    release = _case(checkpoints, tmp_path_factory, "release")
    d = _respelled(release["dir"], tmp_path / "m", _sparse_release)
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32", mtp=False).outputs[0]
    assert_same_file(llama_cpp_convert(d, tmp_path / "theirs.gguf", "f32", "--no-mtp"), ours)
    with open_gguf(ours) as f:
        assert f.get("glm4moe.rope.dimension_count") == 8 and f.get("glm4moe.expert_shared_count") == 1
        assert f.get("glm4moe.expert_weights_norm") is True and f.get("glm4moe.expert_group_count") == 1
        assert f.get("glm4moe.expert_weights_scale") == 1.0 and f.get("glm4moe.leading_dense_block_count") == 1
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def _set(**values: Any) -> Any:
    def edit(config: dict[str, Any]) -> None:
        config.update(values)
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set(n_group=2, topk_group=2), "n_group 2 with topk_group 2 over 4 experts"),
    (_set(n_group=3), "n_group 3 with topk_group 1 over 4 experts"),
    (_set(hidden_act="gelu"), "hidden_act 'gelu'"),
    (_set(partial_rotary_factor=0.3, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
     "an odd rotary dimension 9"),
], ids=["all-groups", "uneven-groups", "gelu", "odd-rope"])
def test_convert_refuses_them_in_one_line_and_writes_nothing(checkpoints: dict[str, dict[str, Any]],
                                                             tmp_path_factory: pytest.TempPathFactory, edit: Any,
                                                             message: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """What llama.cpp's glm4moe loader or graph cannot represent (its loader asserts topk_group < n_group and
    experts split evenly over the groups; its FFNs are SiLU-gated)."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = _respelled(_case(checkpoints, tmp_path_factory, "tf5")["dir"], tmp_path / "m", edit)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "glm4moe: llama.cpp would compute another model" in err and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


def test_a_tokenizer_without_glms_added_tokens_is_refused(checkpoints: dict[str, dict[str, Any]],
                                                          tmp_path_factory: pytest.TempPathFactory,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's _set_vocab_glm looks [gMASK], <|user|>, <|endoftext|> and <|observation|> up among the
    added tokens (a KeyError there): one line, exit 2."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    src = _case(checkpoints, tmp_path_factory, "tf5")["dir"]
    d = _respelled(src, tmp_path / "m", lambda config: None)
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["added_tokens"] = [a for a in tok["added_tokens"] if a["content"] != "[gMASK]"]
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").write_text(json.dumps(tok))
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "--vocab-only", "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "no added token [gMASK]" in err and err.count("\n") == 1, err


# -- quantization ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("glm4moe-quant")
    model = quant_gguf(d / "model.gguf")
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run): 8 experts,
    the routers and correction biases F32, the NextN block's tensors, attn_v by the GQA ratio."""
    from test_family_qwen3next import assert_every_preset_plans_as_llama_quantize

    assert_every_preset_plans_as_llama_quantize(quant_model, with_imatrix)


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", False), ("q4_k_m", True),
                                                      ("iq4_xs", True)])
def test_whole_file_equals_llama_quantize(quant_model: dict[str, Path], tmp_path: Path, target: str,
                                          with_imatrix: bool) -> None:
    from fixtures_quantize import assert_same_quantized
    from test_family_olmo2 import llama_quantize_binary

    from ggufkit.quant import quantize_file

    flags = ("--imatrix", str(quant_model["imatrix"])) if with_imatrix else ()
    llama_quantize_binary(quant_model["model"], tmp_path / "ref.gguf", target, *flags)
    quantize_file(quant_model["model"], tmp_path / "ours.gguf", target,
                  imatrix=quant_model["imatrix"] if with_imatrix else None, threads=2)
    assert_same_quantized(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


# -- KLD and release ---------------------------------------------------------------------------------------
def test_kld_equals_llama_perplexitys(release: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """KL divergence of a Q8_0 file from the F32 one (both with the NextN block) as ``llama-perplexity
    --kl-divergence`` reports it, with its 8-bit activation rounding reproduced: within 3 %
    (tests/test_family_lfm2.py)."""
    from test_family_lfm2 import CHUNKS as LFM2_CHUNKS
    from test_family_lfm2 import CTX as LFM2_CTX
    from test_family_lfm2 import test_kld_equals_llama_perplexitys as kld

    assert (LFM2_CTX, LFM2_CHUNKS) == (CTX, CHUNKS)
    kld({"ours": release["ours"]}, sample, tmp_path)


def test_release_end_to_end(tmp_path: Path) -> None:
    """``release`` of a tiny GLM-4.5 in the released layout (its NextN layer kept in the F16 master): importance
    matrix with llama-imatrix's entries on that master, Q8_0 and Q4_K_M that load in llama.cpp, the master's
    reported perplexity llama-perplexity's. A 400-token BPE of GPT-2's flavour with GLM's added tokens (CI time)."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix

    from ggufkit.eval.perplexity import sample_text
    from ggufkit.format import open_gguf
    from ggufkit.quant.imatrix.collector import read_raw_imatrix
    from ggufkit.release import release

    ckpt = make_glm(tmp_path / "tiny-glm", "release", vocab="gpt-2", hidden_size=256, intermediate_size=256,
                    moe_intermediate_size=256)
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
            assert f.architecture == "glm4moe" and f.get("glm4moe.nextn_predict_layers") == 1
        assert np.isfinite(llama_cpp_logits(path)).all()
    ref = tmp_path / "ref.gguf"
    llama_imatrix("-m", master, "-f", text, "-c", 64, "--chunks", 2, "-o", ref, *F32_ATTENTION)
    assert sorted(read_raw_imatrix(imatrix).entries) == sorted(read_raw_imatrix(ref).entries)
    manifest = json.loads((out / "manifest.json").read_text())
    reported = manifest["steps"]["eval-master"]["results"]["ppl"]
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    assert abs(reported / theirs - 1) < 1e-3, (reported, theirs)


def test_a_schedule_the_weights_do_not_have_is_refused(checkpoints: dict[str, dict[str, Any]],
                                                        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """first_k_dense_replace 2 over weights with one dense layer (block 1 has a router, no dense FFN): the
    per-block check the hybrid entry needs from the hooks, one line, exit 2."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = _respelled(_case(checkpoints, tmp_path_factory, "tf5")["dir"], tmp_path / "m",
                   _set(first_k_dense_replace=2))
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "glm4moe: no model.layers.1.mlp.gate_proj" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.gguf").exists()
