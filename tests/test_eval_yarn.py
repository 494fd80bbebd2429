"""YaRN rope scaling in the evaluator for every architecture (issue 32), against llama-perplexity.

llama.cpp applies YaRN wherever a file says ``rope.scaling.type = yarn``: llama_context derives ``freq_scale``,
``ext_factor``, ``attn_factor`` and the betas once (src/llama-context.cpp) and every graph passes them to
ggml_rope_ext. ggufkit's evaluator computes it once (eval/rope.py) for the shared rope of GGUFCausalLM (NEOX and
NORM files alike), gpt-oss and DeepSeek 2's MLA. Each model here is a tiny random checkpoint of transformers' class
with ``rope_scaling`` yarn factor 4 over an original context of 16 tokens, scored in chunks of 64, so every chunk
runs past the original context and the ramp mixes interpolated and extrapolated pairs:

* GLM-4.5 (``Glm4MoeForCausalLM``, ``glm4moe``): NEOX rope over half of each head, q/k norms, experts;
* Llama (NORM rope: the converter's Q/K permutation) and Qwen 3 (NEOX over the whole head), dense.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_models import make_checkpoint
from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
from test_family_glm4moe import make_glm

CTX, CHUNKS, N_CTX_ORIG = 64, 4, 16
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": N_CTX_ORIG}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("yarn-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def _assert_ppl_equals_llama_perplexity(checkpoint: Path, arch: str, sample: tuple[str, Path], tmp: Path) -> None:
    """ggufkit's F32 file of ``checkpoint`` carries yarn; ggufkit ppl equals llama-perplexity within 0.1 %."""
    from ggufkit.converters import convert
    from ggufkit.eval.perplexity import perplexity
    from ggufkit.format.shards import open_gguf

    model = Path(convert(checkpoint, tmp / "f32.gguf", outtype="f32").outputs[0])
    with open_gguf(model) as f:
        assert f.get(f"{arch}.rope.scaling.type") == "yarn"
        assert f.get(f"{arch}.rope.scaling.factor") == 4.0
        assert f.get(f"{arch}.rope.scaling.original_context_length") == N_CTX_ORIG
    text, path = sample
    ours = perplexity(model, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", kv_cache="f32")
    theirs, n_chunks = llama_perplexity(model, path, CTX, CHUNKS, *F32_PATH)
    assert ours.chunks == n_chunks == CHUNKS
    assert abs(ours.ppl / theirs - 1) < 1e-3, (ours.ppl, theirs)


def test_glm45_with_yarn_ppl_equals_llama_perplexity(sample: tuple[str, Path], tmp_path: Path) -> None:
    rope = {**YARN, "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}
    d = make_glm(tmp_path / "glm", "tf5", rope_parameters=rope)
    _assert_ppl_equals_llama_perplexity(d, "glm4moe", sample, tmp_path)


@pytest.mark.parametrize(("hf_class", "arch"), [("LlamaForCausalLM", "llama"), ("Qwen3ForCausalLM", "qwen3")])
def test_dense_with_yarn_ppl_equals_llama_perplexity(hf_class: str, arch: str, sample: tuple[str, Path],
                                                     tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", hf_class, rope_scaling={**YARN, "rope_theta": 10000.0})
    _assert_ppl_equals_llama_perplexity(d, arch, sample, tmp_path)


def test_yarn_on_an_m_rope_family_is_refused_in_one_line(tmp_path: Path) -> None:
    """Qwen3.5's M-RoPE (eval/family_qwen35.py) does not carry YaRN: ``ggufkit ppl`` exits 2 with one line."""
    import subprocess
    import sys

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as VT

    from ggufkit.format import Metadata, TensorSpec, write_gguf

    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "qwen35")
    for name, value in (("block_count", 1), ("embedding_length", 64), ("attention.head_count", 4),
                        ("rope.scaling.original_context_length", N_CTX_ORIG)):
        meta.set(f"qwen35.{name}", VT.UINT32, value)
    meta.set("qwen35.rope.scaling.type", VT.STRING, "yarn")
    meta.set("qwen35.rope.scaling.factor", VT.FLOAT32, 4.0)
    path = tmp_path / "m.gguf"
    write_gguf(path, meta, [TensorSpec("token_embd.weight", Q.F32, (32, 64))], [np.zeros((32, 64), np.float32)])
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(["1"] * 2 * CTX))
    run = subprocess.run([sys.executable, "-m", "ggufkit", "ppl", str(path), "--tokens", str(tokens), "-c", str(CTX),
                          "--device", "cpu"], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert "rope scaling 'yarn' is not supported by the evaluator for qwen35 (its M-RoPE)" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
