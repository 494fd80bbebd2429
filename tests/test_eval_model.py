"""The evaluator's forward pass against transformers' own model classes, per architecture and quant type.

Oracle: the tiny random transformers model the GGUF was written from, scored on the same chunks and the
same positions (llama-perplexity's method, implemented here independently in a few lines).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from fixtures_models import SUPPORTED, make_checkpoint, make_predictor, reference_model
from gguf import GGMLQuantizationType as Q

from ggufkit.converters import convert
from ggufkit.errors import DeviceUnavailableError, EvaluationError, MetadataKeyNotFoundError
from ggufkit.eval import load_model, perplexity
from ggufkit.eval.model import load_model as load_model_with
from ggufkit.eval.perplexity import sample_text
from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

CTX = 64


def reference_ppl(model: torch.nn.Module, tokens: list[int], ctx: int, bos: int | None) -> tuple[float, int]:
    """llama-perplexity's PPL from transformers' logits: BOS overwrite, second half scored, tail dropped."""
    first, nll = ctx // 2, []
    for k in range(len(tokens) // ctx):
        window = list(tokens[k * ctx:(k + 1) * ctx])
        if bos is not None:
            window[0] = bos
        with torch.no_grad():
            logits = model(torch.tensor([window])).logits[0].double()
        for j in range(first, ctx - 1):
            nll.append(float(torch.logsumexp(logits[j], 0) - logits[j, tokens[k * ctx + j + 1]]))
    return math.exp(sum(nll) / len(nll)), len(nll)


def stream(n: int = 3 * CTX + 17, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, N_VOCAB, n).tolist()


ARCHS = ["llama", "qwen2", "qwen3", "qwen", "gptneox", "gptneox_seq", "opt", "powerinfer_llama"]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_scores_like_transformers_own_model(arch: str, tmp_path: Path) -> None:
    hf = make_hf_model(arch)
    path = write_model_gguf(hf, arch, tmp_path / f"{arch}.gguf")
    tokens = stream()
    result = perplexity(path, tokens=tokens, ctx=CTX, device="cpu")
    want, n = reference_ppl(hf, tokens, CTX, bos=1)
    assert (result.chunks, result.tokens_scored) == (3, n)
    assert abs(result.ppl / want - 1) < 1e-4, (result.ppl, want)


#: Llama 3's long-context RoPE: the converter writes rope_freqs.weight, the evaluator divides by it.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
#: What a class needs beyond its fixture to convert: Nemotron-H's embedding rows a multiple of 8 over gpt-2's 50257.
_CONVERT_OVERRIDES: dict[str, dict] = {"NemotronHForCausalLM": {"extra_vocab": 7}}
CONVERTED = [(c, _CONVERT_OVERRIDES.get(c, {}), False) for c in SUPPORTED] + [
    ("LlamaForCausalLM", {"hidden_act": "relu"}, True), ("OPTForCausalLM", {}, True),
    ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}, False)]


@pytest.mark.parametrize(("hf_class", "overrides", "powerinfer"), CONVERTED,
                         ids=[c + ("-powerinfer" if p else "-llama3-rope" if "rope_parameters" in o else "")
                              for c, o, p in CONVERTED])
def test_converted_checkpoint_scores_real_text_like_transformers(hf_class: str, overrides: dict,
                                                                  powerinfer: bool, tmp_path: Path) -> None:
    """End to end: ggufkit convert (F32) -> ggufkit ppl on text, tokenized with the GGUF's own vocabulary."""
    ckpt = make_checkpoint(tmp_path / "hf", hf_class, **overrides)
    predictor = None
    if powerinfer:
        config = json.loads((ckpt / "config.json").read_text())
        predictor = make_predictor(tmp_path / "pred", n_layer=config["num_hidden_layers"],
                                   n_embd=config["hidden_size"],
                                   n_ff=config.get("intermediate_size", config.get("ffn_dim")))
    out = tmp_path / "model.gguf"
    convert(ckpt, out, outtype="f32", predictor=predictor)
    text = sample_text()[:12000]
    result = perplexity(out, text=text, ctx=CTX, chunks=3, device="cpu")
    with open_gguf(out) as f:
        assert f.is_powerinfer == powerinfer
        tok = load_tokenizer(f)
        ids = tok.encode(text)
    want, n = reference_ppl(reference_model(ckpt), ids[: 3 * CTX], CTX, tok.bos_id if tok.add_bos else None)
    assert (result.tokens_scored, result.n_tokens) == (n, len(ids))
    assert abs(result.ppl / want - 1) < 1e-4, (result.ppl, want)


@pytest.mark.parametrize("arch", ["llama", "powerinfer_llama", "opt"])
def test_logits_match_transformers_at_every_position(arch: str, tmp_path: Path) -> None:
    hf = make_hf_model(arch, seed=3)
    path = write_model_gguf(hf, arch, tmp_path / "m.gguf")
    tokens = torch.tensor([stream(40, seed=1), stream(40, seed=2)])
    with torch.no_grad():
        want = hf(tokens).logits
    with load_model(path, device="cpu") as model:
        got = model.logits(tokens)
        tail = model.logits(tokens, start=30)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tail, got[:, 30:], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("arch", "qtype", "hidden"), [
    ("llama", Q.Q8_0, 64), ("qwen2", Q.Q4_0, 64), ("qwen3", Q.Q5_1, 64), ("llama", Q.Q4_1, 64),
    ("gptneox", Q.Q5_0, 64), ("llama", Q.Q4_K, 256), ("qwen2", Q.Q5_K, 256), ("llama", Q.Q6_K, 256),
    ("llama", Q.F16, 64), ("qwen2", Q.BF16, 64),
], ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_quantized_file_scores_like_transformers_with_its_exact_dequantization(arch: str, qtype: Q, hidden: int,
                                                                                 tmp_path: Path) -> None:
    sizes = {"hidden_size": hidden, "intermediate_size": 256 if hidden == 256 else 128}
    if arch == "qwen3":
        sizes["head_dim"] = 32
    hf = make_hf_model(arch, seed=5, **sizes)
    path = write_model_gguf(hf, arch, tmp_path / "q.gguf", qtype)
    with open_gguf(path) as f:
        assert f["blk.0.attn_v.weight" if arch != "gptneox" else "blk.0.attn_qkv.weight"].ggml_type == qtype
    tokens = stream(2 * CTX, seed=4)
    want, _ = reference_ppl(hf, tokens, CTX, bos=1)
    got = perplexity(path, tokens=tokens, ctx=CTX, device="cpu").ppl
    assert abs(got / want - 1) < 1e-4, (got, want)


def test_model_hash_covers_the_tensor_data(tmp_path: Path) -> None:
    a = write_model_gguf(make_hf_model("llama", seed=1), "llama", tmp_path / "a.gguf")
    b = write_model_gguf(make_hf_model("llama", seed=2), "llama", tmp_path / "b.gguf")
    with load_model(a, device="cpu") as ma, load_model(a, device="cpu") as ma2, load_model(b, device="cpu") as mb:
        assert ma.model_sha256 == ma2.model_sha256 != mb.model_sha256


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, arch: str | None = None,
             drop_key: str | None = None, reshape: str | None = None) -> Path:
    with open_gguf(src) as f:
        meta = Metadata((k, v) for k, v in f.kv.items() if k != drop_key and not k.startswith("ggufkit."))
        if arch is not None:
            meta.set("general.architecture", meta["general.architecture"].type, arch)
        specs, data = [], []
        for t in f.tensors:
            if t.name == drop:
                continue
            arr = np.array(f.data(t))
            shape = t.shape
            if t.name == reshape:
                shape = (shape[0] // 2, shape[1] * 2)
            specs.append(TensorSpec(t.name, t.ggml_type, shape))
            data.append(arr)
        write_gguf(dst, meta, specs, data)
    return dst


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_gguf(make_hf_model("llama"), "llama", tmp_path_factory.mktemp("m") / "llama.gguf")


def test_unsupported_architecture_is_a_clear_error(llama_file: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_file, tmp_path / "x.gguf", arch="mamba")
    with pytest.raises(EvaluationError, match="cannot evaluate 'mamba': the evaluator has no traits"):
        load_model(path, device="cpu")


def test_missing_tensor_is_named(llama_file: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_file, tmp_path / "x.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(EvaluationError, match=re.escape("missing tensor 'blk.1.ffn_up.weight'")):
        load_model(path, device="cpu")


def test_wrong_tensor_shape_is_named(llama_file: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_file, tmp_path / "x.gguf", reshape="blk.0.attn_q.weight")
    with pytest.raises(EvaluationError, match=re.escape("tensor 'blk.0.attn_q.weight' has shape")):
        load_model(path, device="cpu")


def test_missing_hyperparameter_is_named(llama_file: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_file, tmp_path / "x.gguf", drop_key="llama.attention.head_count")
    with pytest.raises(MetadataKeyNotFoundError, match=re.escape("llama.attention.head_count")):
        load_model(path, device="cpu")


def test_token_ids_outside_the_vocabulary_are_refused(llama_file: Path) -> None:
    with load_model(llama_file, device="cpu") as model, pytest.raises(EvaluationError, match="token ids must be"):
        model.logits(torch.tensor([[1, N_VOCAB]]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when no GPU is present")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(llama_file: Path) -> None:
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        load_model(llama_file, device="cuda")


def test_a_split_model_scores_like_the_single_file(llama_file: Path, tmp_path: Path) -> None:
    with open_gguf(llama_file) as f:
        meta = Metadata((k, v) for k, v in f.kv.items() if not k.startswith("ggufkit."))
        specs = [TensorSpec(t.name, t.ggml_type, t.shape) for t in f.tensors]
        shards = write_gguf(tmp_path / "split.gguf", meta, specs, (np.array(f.data(t)) for t in f.tensors),
                            split_max_tensors=7)
    assert len(shards) > 1
    tokens = stream(2 * CTX, seed=8)
    whole = perplexity(llama_file, tokens=tokens, ctx=CTX, device="cpu")
    split = perplexity(shards[1], tokens=tokens, ctx=CTX, device="cpu")
    assert split.ppl == whole.ppl and split.model_sha256 == whole.model_sha256


@pytest.mark.parametrize(("qtype", "rounding"), [(Q.F16, False), (Q.Q4_1, True)], ids=["F16", "Q4_1-ggml-rounding"])
def test_kept_float_weights_give_the_same_logits_as_dequantizing_every_pass(qtype: Q, rounding: bool, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_model_gguf(make_hf_model("llama", seed=7), "llama", tmp_path / "m.gguf", qtype)
    tokens = torch.tensor([stream(48, seed=3), stream(48, seed=4)])
    runs = {}
    for mib in ("0", "0.05", "1024"):  # nothing kept, some layers kept, everything kept
        monkeypatch.setenv("GGUFKIT_EVAL_FLOAT_CACHE_MB", mib)
        with load_model_with(path, device="cpu", ggml_rounding=rounding) as model:
            runs[mib] = [model.logits(tokens, start=8) for _ in range(2)]  # the second pass reads kept weights
            assert model._float_cached <= model.float_cache_bytes == int(float(mib) * 2**20)
            assert (model._float_cached > 0) == (mib != "0")
    for mib, (first, second) in runs.items():
        assert torch.equal(first, runs["0"][0]) and torch.equal(second, runs["0"][0]), mib


def test_a_bad_float_cache_setting_is_a_clear_error(llama_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFKIT_EVAL_FLOAT_CACHE_MB", "lots")
    with pytest.raises(EvaluationError, match="GGUFKIT_EVAL_FLOAT_CACHE_MB='lots' is not a number of MiB"):
        load_model(llama_file, device="cpu")


def test_a_swapped_tensor_is_not_served_from_the_float_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept dequantizations belong to the tensor they were made from: replacing ``tensors[name]`` (as the
    target search's sensitivity probes do) changes the logits, and restoring it gives the first logits back."""
    monkeypatch.setenv("GGUFKIT_EVAL_FLOAT_CACHE_MB", "1024")
    a = write_model_gguf(make_hf_model("llama", seed=7), "llama", tmp_path / "a.gguf", Q.Q8_0)
    b = write_model_gguf(make_hf_model("llama", seed=8), "llama", tmp_path / "b.gguf", Q.Q8_0)
    tokens = torch.tensor([stream(48, seed=3)])
    with load_model_with(a, device="cpu") as model, load_model_with(b, device="cpu") as other:
        first = model.logits(tokens)
        name = "blk.0.ffn_down.weight"
        saved = model.tensors[name]
        model.tensors[name] = other.tensors[name]
        swapped = model.logits(tokens)
        model.tensors[name] = saved
        again = model.logits(tokens)
        assert model._float_cached > 0
    assert not torch.equal(first, swapped)
    assert torch.equal(first, again)
