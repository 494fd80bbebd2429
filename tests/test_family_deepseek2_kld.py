"""KL divergence of a Q8_0 ``deepseek2`` file (DeepSeek V3, GLM-4.7-Flash) from its F32 file, ggufkit's against
``llama-perplexity --kl-divergence`` on the same baseline (issue 32), within the 3 % the other families meet
(tests/test_family_lfm2.py, test_family_llama4.py, test_family_glm4moe.py).

Why the weights here are N(0, 0.08) and not the N(0, 0.15) of tests/test_family_deepseek2.py: at 0.15 the tiny
models are chaotic. Measured (4 chunks of 64 tokens, the GPT-2 sample): ggufkit's KLD 5.7 % above
llama-perplexity's on V3, 10.8 % on GLM-4.7-Flash (16 chunks: 1.4 % and 3.9 %). The cause, traced tensor by
tensor against llama.cpp's graph (eval callbacks): no operation computes something else. The F32 paths agree to
float32 order (~1e-7 relative), and llama-perplexity's KLD equals the exact KLD of llama.cpp's own logits
(0.0142365 vs 0.014236). But the float32 order of a sum differs (oneDNN's vs ggml's tinyBLAS and its double-sum
RMSNorm), so one value of V3's chunk 0 lands 1 ulp on the other side of an F16 rounding midpoint
(``q_nope`` -0.7609864 vs -0.7609863, the input of the F16 ``attn_k_b``, rounded to -0.761 by llama.cpp and
-0.7607 here; ``attn_q_b``/``attn_k_b`` stay F16 in a Q8_0 file, their rows of 48/16 not being Q8_0 blocks).
Attention carries that F16 step to every later token, two layers amplify it to ~1 % of the router's logits,
and at position 61 layer 2's sigmoid router picks expert 1 where llama.cpp picks expert 7 (biased scores 0.6899
vs 0.6936 in llama.cpp): that one token makes chunk 0's KLD 22 % larger; the other chunks agree within 0.5 %.
The same float32-order noise exists for every family; only a model this sensitive turns it into a different
expert. At N(0, 0.08) the models are not chaotic and the comparison measures the evaluator again.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

CTX = 64
CHUNKS = 4
STD = 0.08


def _checkpoint(kind: str, dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny checkpoint: DeepSeek V3 in the released layout (8 experts in 4 groups, 2 kept, biased sigmoid
    router, routed scaling 2.5), or GLM-4.7-Flash in its released layout (its NextN layer included)."""
    import fixtures_models
    from test_family_deepseek2 import make_deepseek
    from test_family_glm4moelite import make_glm_lite

    if kind == "v3":
        return make_deepseek(dir, "v3", "release", std=STD)
    monkeypatch.setattr(fixtures_models, "randomize", functools.partial(fixtures_models.randomize, std=STD))
    return make_glm_lite(dir, "release")


def _llama_perplexity(text: Path, *args: str | Path) -> str:
    from llama_cpp_sources import tool_path
    from test_eval_archs_vs_llama_perplexity import F32_PATH

    cmd = [str(tool_path("llama-perplexity")), "-f", str(text), "-c", str(CTX), "-b", str(CTX), "--chunks",
           str(CHUNKS), "-t", "2", "-nr", *F32_PATH, *map(str, args)]
    for _ in range(10):  # its asynchronous log sometimes loses the last lines
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        if "Minimum KLD" in r.stdout + r.stderr or "Final estimate" in r.stdout + r.stderr:
            return r.stdout + r.stderr
    raise AssertionError(r.stderr[-2000:])


@pytest.mark.parametrize("kind", ["v3", "glm_lite"])
def test_kld_equals_llama_perplexitys(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 from the F32 file, llama-perplexity's 8-bit activation rounding reproduced (``ggml_rounding``, F32
    K/V cache as ``-fa off -ctk f32 -ctv f32``): the mean KLD within 3 % of llama-perplexity's, and the Q8_0
    file's perplexity (same run) within 0.1 %."""
    from ggufkit.converters import convert
    from ggufkit.eval import kl_divergence
    from ggufkit.eval.perplexity import sample_text
    from ggufkit.quant import quantize_file

    text = sample_text()[:6000]
    path = tmp_path / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    ckpt = _checkpoint(kind, tmp_path / "ckpt", monkeypatch)
    f32 = convert(ckpt, tmp_path / "f32.gguf", outtype="f32").outputs[0]
    q8, base = tmp_path / "q8.gguf", tmp_path / "base.kld"
    quantize_file(f32, q8, "q8_0")
    _llama_perplexity(path, "-m", f32, "--kl-divergence-base", base)
    out = _llama_perplexity(path, "-m", q8, "--kl-divergence-base", base, "--kl-divergence")
    kld = re.search(r"Mean\s+KLD:\s+([0-9.]+)", out)
    ppl = re.search(r"Mean\s+PPL\(Q\)\s*:\s*([0-9.]+)", out)
    assert kld is not None and ppl is not None, out[-2000:]
    ours = kl_divergence(q8, f32, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True,
                         kv_cache="f32")
    got: dict[str, Any] | None = ours.kld
    assert got is not None
    theirs = float(kld.group(1))
    assert theirs > 5e-4  # a KLD printed with enough digits for a 3 % comparison
    assert abs(got["mean_kld"] / theirs - 1) < 3e-2, (got["mean_kld"], theirs)
    assert abs(ours.ppl / float(ppl.group(1)) - 1) < 1e-3, (ours.ppl, ppl.group(1))
