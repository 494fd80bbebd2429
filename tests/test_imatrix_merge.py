"""The importance matrix of a big model split over CI jobs: `ggufkit imatrix` on shards of the text in separate
processes, merged with `--in-file` (tools/imatrix/imatrix.cpp IMatrixCollector::load_imatrix: GGUF sums and
counts added as they are). Each job takes its range of chunks of the one text (`--from-chunk K --chunks N`, so
the chunk boundaries are those of one run). The merge is the one run over the whole text, and the bytes
llama-imatrix writes merging the same shard files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from eval_models import make_hf_model, write_model_gguf
from llama_cpp_sources import tool_path

from ggufkit.quant.imatrix.collector import read_raw_imatrix

CTX = 32
SHARDS = ((0, 2), (2, 3))  # (first chunk, chunks) of each job: five chunks in all
N_CHUNKS = 5
ROOT = Path(__file__).resolve().parents[1]


def _ggufkit_imatrix(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """One job: `ggufkit imatrix` in its own process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ggufkit", "imatrix", *map(str, args), "--device", "cpu",
                           "--no-ppl", "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("merge")
    model = write_model_gguf(make_hf_model("llama", seed=5), "llama", d / "f32.gguf")
    words = [f"t{i}" for i in np.random.default_rng(1).integers(0, 61, 8 * CTX)]
    (d / "text.txt").write_text(" ".join(words) + "\n")
    files = [d / f"shard{i}.imatrix.gguf" for i in range(len(SHARDS))]
    for (first, n), f in zip(SHARDS, files):
        job = _ggufkit_imatrix(model, "-f", d / "text.txt", "-c", CTX, "--from-chunk", first, "--chunks", n,
                               "-o", f)
        assert job.returncode == 0, job.stderr
    return {"dir": d, "model": model, "files": files}


def test_merged_shards_equal_one_run_over_the_whole_text(shards: dict) -> None:
    d, model, files = shards["dir"], shards["model"], shards["files"]
    r = invoke("imatrix", str(model), "-f", str(d / "text.txt"), "-c", str(CTX), "--chunks", str(N_CHUNKS),
               "-o", str(d / "whole.gguf"), "--device", "cpu", "--no-ppl", "--quiet")
    assert r.exit_code == 0, r.stderr
    merged = invoke("imatrix", *[x for f in files for x in ("--in-file", str(f))], "-c", str(CTX),
                    "-o", str(d / "merged.gguf"), "--json")
    assert merged.exit_code == 0, merged.stderr
    assert json.loads(merged.stdout)["chunk_count"] == N_CHUNKS
    whole, mine = read_raw_imatrix(d / "whole.gguf"), read_raw_imatrix(d / "merged.gguf")
    assert (mine.chunk_count, mine.chunk_size) == (whole.chunk_count, whole.chunk_size) == (N_CHUNKS, CTX)
    assert mine.datasets == (str(d / "text.txt"),) * len(SHARDS)
    assert sorted(mine.entries) == sorted(whole.entries) and len(whole.entries) > 10
    for name, (sums, counts) in whole.entries.items():
        assert np.array_equal(mine.entries[name][1], counts), name  # the same tokens per entry
        # float32 sums added in another order (shard by shard, then the shards): rounding only
        np.testing.assert_allclose(mine.entries[name][0], sums, rtol=2e-6, atol=0, err_msg=name)
    # the merge quantizes like the whole run's matrix: the means llama-quantize reads differ by rounding only
    from ggufkit.quant.imatrix.reader import load_imatrix

    a, b = load_imatrix(d / "whole.gguf"), load_imatrix(d / "merged.gguf")
    for name, values in a.entries.items():
        np.testing.assert_allclose(b.entries[name], values, rtol=2e-6, err_msg=name)


def test_merge_is_llama_imatrixs_merge_of_the_same_shard_files(shards: dict) -> None:
    d, model, files = shards["dir"], shards["model"], shards["files"]
    args = [x for f in files for x in ("--in-file", str(f))]
    for fmt in ("gguf", "dat"):
        ref = subprocess.run([str(tool_path("llama-imatrix")), "-m", str(model), *args, "-c", str(CTX),
                              "--output-format", fmt, "-o", str(d / f"ref.{fmt}")], capture_output=True, text=True)
        assert ref.returncode == 0, ref.stderr[-2000:]
        r = invoke("imatrix", *args, "-c", str(CTX), "--output-format", fmt, "-o", str(d / f"ours.{fmt}"))
        assert r.exit_code == 0, r.stderr
        assert (d / f"ours.{fmt}").read_bytes() == (d / f"ref.{fmt}").read_bytes(), fmt
    # a shard in the legacy format under the .imatrix name publishers use, merged with a GGUF shard (its
    # entries are mean * ncall, scaled back by the chunk size on loading)
    r = invoke("imatrix", "--in-file", str(files[0]), "-c", str(CTX), "--output-format", "dat",
               "-o", str(d / "shard0.imatrix"))
    assert r.exit_code == 0, r.stderr
    args = ["--in-file", str(d / "shard0.imatrix"), "--in-file", str(files[1])]
    ref = subprocess.run([str(tool_path("llama-imatrix")), "-m", str(model), *args, "-c", str(CTX),
                          "-o", str(d / "mixed-ref.gguf")], capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    r = invoke("imatrix", *args, "-c", str(CTX), "-o", str(d / "mixed-ours.gguf"))
    assert r.exit_code == 0, r.stderr
    assert (d / "mixed-ours.gguf").read_bytes() == (d / "mixed-ref.gguf").read_bytes()
