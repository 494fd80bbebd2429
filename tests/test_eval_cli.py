"""``ggufkit ppl``: output formats, JSON keys, quality gates and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q

CTX = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    tokens = np.random.default_rng(0).integers(3, N_VOCAB, 3 * CTX + 3).tolist()
    (d / "tokens.txt").write_text(" ".join(map(str, tokens)))
    (d / "short.txt").write_text(" ".join(map(str, tokens[: CTX])))
    return {"base": write_model_gguf(make_hf_model("llama", seed=2), "llama", d / "f32.gguf"),
            "quant": write_model_gguf(make_hf_model("llama", seed=2), "llama", d / "q8.gguf", Q.Q8_0),
            "tokens": d / "tokens.txt", "short": d / "short.txt", "dir": d}


def test_json_output_has_the_documented_keys(files: dict[str, Path]) -> None:
    r = invoke("ppl", str(files["quant"]), "--tokens", str(files["tokens"]), "--ctx", str(CTX), "--device", "cpu",
               "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("ppl", "ppl_error", "chunks", "ctx", "tokens_scored", "add_bos", "text_sha256", "model_sha256",
                "device", "dtype", "seconds", "tokens_per_second"):
        assert key in d, key
    assert (d["chunks"], d["ctx"], d["tokens_scored"], d["add_bos"], d["dtype"]) == (3, CTX, 93, True, "f32")
    assert d["ok"] is True and d["gates"] == {"failures": []} and d["kld"] is None


def test_human_output_prints_the_running_values_and_the_final_estimate(files: dict[str, Path]) -> None:
    r = invoke("ppl", str(files["base"]), "--tokens", str(files["tokens"]), "-c", str(CTX), "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    values = [float(v.split("]")[1]) for v in first.rstrip(",").split(",")]
    assert first.startswith("[1]") and "[3]" in first and first.endswith(",") and len(values) == 3
    assert second == f"Final estimate: PPL = {values[-1]:.4f} +/- " + second.split("+/- ")[1]


def test_baseline_adds_kl_statistics_and_the_per_chunk_table(files: dict[str, Path]) -> None:
    args = ["ppl", str(files["quant"]), "--baseline", str(files["base"]), "--tokens", str(files["tokens"]),
            "-c", str(CTX), "--device", "cpu"]
    r = invoke(*args)
    assert r.exit_code == 0, r.stderr
    assert "KL Divergence" in r.stdout and "Mean    KLD:" in r.stdout and "Same top p:" in r.stdout
    d = json.loads(invoke(*args, "--json").stdout)
    assert d["kld"]["mean_kld"] > 0 and "99.9" in d["kld"]["kld_percentiles"]


def test_an_exceeded_gate_exits_1_with_one_line_and_one_json_document(files: dict[str, Path]) -> None:
    args = ["ppl", str(files["quant"]), "--baseline", str(files["base"]), "--tokens", str(files["tokens"]),
            "-c", str(CTX), "--device", "cpu"]
    r = invoke(*args, "--max-kld", "1e-12", "--json")
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["ok"] is False and d["gates"]["failures"][0].startswith("mean KLD")
    assert r.stderr.count("\n") == 1 and "quality gate failed: mean KLD" in r.stderr
    r = invoke(*args, "--max-ppl", "1")
    assert r.exit_code == 1 and "Traceback" not in r.stderr and "--max-ppl 1" in r.stderr
    assert invoke(*args, "--max-ppl", "1e9", "--max-delta-ppl", "1", "--max-kld", "10").exit_code == 0


@pytest.mark.parametrize(("extra", "message"), [
    (["--max-kld", "1"], "--max-delta-ppl and --max-kld need --baseline"),
    (["--tokens", "SHORT"], "you need at least 128 tokens"),
    (["--tokens", "TOKENS", "-f", "TOKENS"], "either -f/--file or --tokens"),
    (["--tokens", "TOKENS", "--device", "cuda"], "CUDA"),
    (["--tokens", "TOKENS", "--dtype", "bf16", "--device", "cpu"], "needs a GPU"),
])
def test_bad_input_exits_2_with_one_line(files: dict[str, Path], extra: list[str], message: str) -> None:
    import torch

    if "cuda" in extra and torch.cuda.is_available():
        return
    extra = [str(files["short"]) if e == "SHORT" else str(files["tokens"]) if e == "TOKENS" else e for e in extra]
    r = invoke("ppl", str(files["base"]), "-c", str(CTX), *extra)
    assert r.exit_code == 2, r.stderr
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_malformed_model_file_exits_2(files: dict[str, Path]) -> None:
    bad = files["dir"] / "bad.gguf"
    bad.write_bytes(files["base"].read_bytes()[:200])
    r = invoke("ppl", str(bad), "--tokens", str(files["tokens"]), "-c", str(CTX))
    assert r.exit_code == 2 and "Traceback" not in r.stderr and r.stderr.startswith("ggufkit: error:")


def test_without_text_the_bundled_sample_is_scored(files: dict[str, Path]) -> None:
    r = invoke("ppl", str(files["base"]), "-c", str(CTX), "--chunks", "2", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["chunks"] == 2 and d["n_tokens"] > 100_000
