"""The size-budget search's KLD calibration on families whose block is their own (issue #32).

:class:`ggufkit.eval.target_calibration.Calibration` runs what :meth:`GGUFCausalLM.logits` runs: the family's
``embed`` / ``block`` / ``finish`` (eval/families.py FORWARDS) over the trunk's blocks, then the head. Checked
on gpt-oss (sinks, sliding window, YaRN, its own MoE block), Granite 4 (Mamba2 and attention layers, a
recurrent hybrid) and Gemma 3n (AltUp streams in a dict state, K/V shared between layers): the base logits equal
``model.logits`` on the window bit for bit, no replacement measures 0, a run restarted from a stored state
equals a whole run; and on gpt-oss ``quantize --target-like q4_k_m`` with the default sensitivity writes a file
llama.cpp loads (it failed in one line, "missing tensor 'blk.0.ffn_norm.weight'": the calibration ran the
transformer block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke
from gguf import GGMLQuantizationType as Q

FAMILIES = ("gpt-oss", "granitehybrid", "gemma3n")
CTX = 64  # one chunk of 64 tokens (the sensitivity's default is 256: the CLI test runs that)


def _build(family: str, d: Path) -> Path:
    """The family's tiny model (tests/test_family_*.py builders; gpt-oss and Granite 4 in two layers, Gemma 3n in
    the 22 its K/V sharing needs), with its tokenizer, saved by transformers 5 and converted to F32 by ggufkit."""
    from ggufkit.converters import convert

    if family == "gpt-oss":
        from fixtures_models import make_checkpoint
        from test_family_gpt_oss import HF_CLASS

        ckpt = make_checkpoint(d / "ckpt", HF_CLASS, num_hidden_layers=2)
    elif family == "granitehybrid":
        from test_family_granite4 import make_granite

        ckpt = make_granite(d / "ckpt", "moe", num_hidden_layers=2, layer_types=["mamba", "attention"])
    else:
        from test_family_gemma3n import make_gemma3n

        ckpt = make_gemma3n(d / "ckpt", n_layer=22, shared=2)  # layers 20 and 21 reuse layer 18's K/V
    return Path(convert(ckpt, d / "f32.gguf", outtype="f32").outputs[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: _build(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


def _calibration(path: Path) -> tuple[Any, Any]:
    from ggufkit.eval.model import load_model
    from ggufkit.eval.perplexity import sample_text, tokenize_text
    from ggufkit.eval.target_calibration import Calibration

    model = load_model(path, device="cpu")
    ids, add_bos, bos_id = tokenize_text(model.file, sample_text())
    assert ids is not None
    return model, Calibration(model, ids, add_bos, bos_id, CTX, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_runs_the_familys_forward(files: dict[str, Path], family: str) -> None:
    import torch

    model, cal = _calibration(files[family])
    with model:
        assert model.hparams.arch == family
        assert len(cal.xs) == model.hparams.n_trunk + 1
        want = model.logits(cal.window, start=CTX // 2)[:, :-1]
        assert torch.equal(cal.base, want)
        assert cal.kld({}, -1) == 0
        # a tensor of block il quantized: restarted from the state entering block il = the whole forward pass
        # (Gemma 3n: layer 18's K/V, which the sliding-window layers 20 and 21 reuse)
        il, name = (18, "attn_k") if family == "gemma3n" else (1, "ffn_down_exps")
        one = {f"blk.{il}.{name}.weight": (Q.Q4_0, None)}
        restarted = cal.kld(one, il)
        assert restarted > 0 and restarted == cal.kld(one, -1)
        assert cal.kld({}, il + 1) == 0 and cal.kld({}, il) == 0  # the stored states are untouched


def test_gemma3n_tensors_its_embedding_reads_restart_from_the_embedding(files: dict[str, Path]) -> None:
    """altup_proj makes streams 1-3 from the embeddings (family_gemma3n.embed): the sensitivity groups it after
    the last block (``n_layer``), the calibration runs it from the embedding."""
    model, cal = _calibration(files["gemma3n"])
    with model:
        one = {"altup_proj.weight": (Q.Q4_0, None)}
        whole = cal.kld(one, -1)
        assert whole > 0 and cal.kld(one, model.hparams.n_layer) == whole


def test_target_like_with_the_default_sensitivity(files: dict[str, Path], tmp_path: Path) -> None:
    """gpt-oss, where it was found (issue #32, "mixmx"); the other families measure through the same Calibration."""
    from fixtures_models import TOKENS, llama_cpp_logits

    out = tmp_path / "mix.gguf"
    res = invoke("quantize", str(files["gpt-oss"]), str(out), "--target-like", "q4_k_m", "--cache-dir",
                 str(tmp_path / "cache"))
    assert res.exit_code == 0, res.output
    assert "sensitivity measured on 256 tokens, used for the search" in res.stdout, res.stdout
    logits = llama_cpp_logits(out)
    assert logits.shape[0] == len(TOKENS) and np.isfinite(logits).all()
