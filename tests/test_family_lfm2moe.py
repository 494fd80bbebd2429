"""LFM2-MoE (``Lfm2MoeForCausalLM``, GGUF arch ``lfm2moe``): what only the MoE variant has (issue 33).

tests/test_family_lfm2.py runs LFM2-MoE beside LFM2 through every check (bytes/keys vs llama.cpp's converter in
both config layouts, llama.cpp logits vs transformers, ``--check``, ppl, imatrix, KLD, every preset's plan and
whole quantized files, release): 4 experts, top-2, one dense lead layer, the router's selection bias random.
Here: the router llama.cpp's lfm2moe graph computes (sigmoid gating, ``exp_probs_b`` added for the choice only,
top-k weights renormalised, no weight scale, the head tied) and the configs it would compute differently, which
the converter refuses in one line (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_family_lfm2 import make_lfm2

from ggufkit.converters import convert


def _set(**values: Any) -> Any:
    def edit(config: dict[str, Any]) -> None:
        config.update(values)
    return edit


def _drop_layer_types(config: dict[str, Any]) -> None:
    config.pop("layer_types")


@pytest.mark.parametrize(("edit", "message"), [
    (_drop_layer_types, "no layer_types"),
    (_set(tie_word_embeddings=False), "an untied lm_head"),
    (_set(norm_topk_prob=False), "norm_topk_prob false"),
    (_set(routed_scaling_factor=2.5), "routed_scaling_factor 2.5"),
    (_set(use_expert_bias=False), "use_expert_bias false"),
], ids=["no-layer-types", "untied", "no-renorm", "scaled", "no-bias"])
def test_convert_refuses_them_in_one_line_and_writes_nothing(edit: Any, message: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_lfm2(tmp_path / "m", "lfm2moe", config_edit=edit)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "lfm2moe: llama.cpp would compute another model" in err and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


def test_the_selection_bias_picks_the_experts_and_not_their_weights(tmp_path: Path) -> None:
    """The evaluator's router as build_moe_ffn's sigmoid path: ``exp_probs_b`` only chooses the experts (top-k
    of ``sigmoid + bias``), the weights are the unbiased sigmoids renormalised. Checked on a layer's router
    directly, and through the logits: zeroing the bias changes them (it changes the choice)."""
    from fixtures_models import TOKENS

    from ggufkit.eval.family_lfm2 import sigmoid_moe
    from ggufkit.eval.model import load_model
    from ggufkit.eval.moe import routed_experts
    from ggufkit.eval.qtensor import QTensor

    d = make_lfm2(tmp_path / "m", "lfm2moe")
    f32 = convert(d, tmp_path / "f32.gguf", outtype="f32").outputs[0]
    tokens = torch.tensor([TOKENS])
    with load_model(f32, device="cpu") as m:
        h = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(0))
        probs = torch.sigmoid(h.reshape(-1, 64) @ m.weight("blk.2.ffn_gate_inp.weight").T)
        bias = m.weight("blk.2.exp_probs_b.bias")
        selected = torch.topk(probs + bias, 2, dim=-1).indices
        assert not torch.equal(selected, torch.topk(probs, 2, dim=-1).indices)  # the bias changes the choice
        weights = probs.gather(-1, selected)
        want = routed_experts(m, h, "blk.2.", weights / weights.sum(-1, keepdim=True), selected)
        assert torch.allclose(sigmoid_moe(m, h, "blk.2."), want.reshape(h.shape), rtol=1e-5, atol=1e-6)
        with_bias = m.logits(tokens)
        for i in range(1, 5):
            t = m.tensors[f"blk.{i}.exp_probs_b.bias"]
            m.tensors[t.name] = QTensor(t.name, t.qtype, t.shape, torch.zeros_like(t.raw))
        assert not torch.allclose(m.logits(tokens), with_bias)
    assert np.isfinite(with_bias.numpy()).all()
