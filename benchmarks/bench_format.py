"""Format benchmarks, each side by side with what a user would otherwise run, reported as ratios.

- open + list a 150k-token vocabulary file (llama.cpp's ggml-vocab-qwen2.gguf): ggufkit vs gguf.GGUFReader;
- set-meta on a 1 GB file: in place vs streaming rewrite vs ``cp`` of the file.

Run: python -m pytest benchmarks/bench_format.py --benchmark-enable -s
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_cpp_sources import vocab_dir

from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.format.values import VT
from ggufkit.metadata_edit import edit_metadata

RESULTS: dict[str, float] = {}
VOCAB = "ggml-vocab-qwen2.gguf"
GB_TENSORS = 16  # 16 x 64 MiB of f32


def _open_and_list_ours(path: Path) -> int:
    with open_gguf(path) as model:
        f = model.files[0]
        tokens = f.kv["tokenizer.ggml.tokens"]
        listing = [(kv.key, kv.type_label) for kv in f.iter_kv()]
        return len(listing) + (tokens.count or 0) + len(tokens.head(8)) + len(model.tensors)


def _open_and_list_gguf_py(path: Path) -> int:
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return len(reader.fields) + len(tokens.data) + len(tokens.contents(slice(0, 8))) + len(reader.tensors)


def _record(name: str, benchmark: pytest.FixtureRequest) -> None:
    RESULTS[name] = benchmark.stats.stats.mean  # type: ignore[attr-defined]


@pytest.mark.benchmark(group="open-150k-vocab")
def test_open_and_list_vocab_ggufkit(benchmark: pytest.FixtureRequest) -> None:
    path = vocab_dir() / VOCAB
    benchmark.pedantic(_open_and_list_ours, args=(path,), rounds=10, warmup_rounds=1)  # type: ignore[attr-defined]
    _record("open_ours", benchmark)


@pytest.mark.benchmark(group="open-150k-vocab")
def test_open_and_list_vocab_gguf_py(benchmark: pytest.FixtureRequest) -> None:
    path = vocab_dir() / VOCAB
    benchmark.pedantic(_open_and_list_gguf_py, args=(path,), rounds=1)  # type: ignore[attr-defined]
    _record("open_gguf_py", benchmark)


@pytest.fixture(scope="module")
def gigabyte(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gb") / "model.gguf"
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.set("general.name", VT.STRING, "gigabyte")
    rows = (64 << 20) // (4 * 4096)
    block = np.random.default_rng(0).standard_normal((rows, 4096)).astype(np.float32)
    specs = [TensorSpec(f"blk.{i}.w", gguf.GGMLQuantizationType.F32, (rows, 4096)) for i in range(GB_TENSORS)]
    write_gguf(path, meta, specs, itertools.repeat(block, GB_TENSORS))
    return path


@pytest.mark.benchmark(group="set-meta-1GB")
def test_set_meta_in_place_1gb(benchmark: pytest.FixtureRequest, gigabyte: Path) -> None:
    names = itertools.cycle(["a longer name for the benchmark", "short"])

    def run() -> str:
        return edit_metadata(gigabyte, set_text={"general.name": next(names)}).mode

    assert benchmark.pedantic(run, rounds=10) == "in_place"  # type: ignore[attr-defined]
    _record("in_place", benchmark)


@pytest.mark.benchmark(group="set-meta-1GB")
def test_set_meta_rewrite_1gb(benchmark: pytest.FixtureRequest, gigabyte: Path) -> None:
    out = gigabyte.with_name("rewritten.gguf")
    names = itertools.cycle(["rewrite one", "rewrite two"])

    def run() -> str:
        return edit_metadata(gigabyte, set_text={"general.name": next(names)}, output=out).mode

    assert benchmark.pedantic(run, rounds=3) == "rewrite"  # type: ignore[attr-defined]
    out.unlink()
    _record("rewrite", benchmark)


@pytest.mark.benchmark(group="set-meta-1GB")
def test_cp_1gb(benchmark: pytest.FixtureRequest, gigabyte: Path) -> None:
    out = gigabyte.with_name("copy.gguf")
    cp = shutil.which("cp") or "cp"
    benchmark.pedantic(subprocess.run, args=([cp, str(gigabyte), str(out)],),  # type: ignore[attr-defined]
                       kwargs={"check": True}, rounds=3)
    out.unlink()
    _record("cp", benchmark)


def test_print_ratios() -> None:
    if not RESULTS:
        return  # benchmarks disabled (run with --benchmark-enable)
    lines = []
    if {"open_ours", "open_gguf_py"} <= RESULTS.keys():
        lines.append(f"open+list {VOCAB}: ggufkit {RESULTS['open_ours'] * 1e3:.1f} ms, gguf.GGUFReader "
                     f"{RESULTS['open_gguf_py']:.2f} s: ggufkit is {RESULTS['open_gguf_py'] / RESULTS['open_ours']:.0f}x faster")
    if {"in_place", "rewrite", "cp"} <= RESULTS.keys():
        lines.append(f"set-meta 1 GB: in place {RESULTS['in_place'] * 1e3:.2f} ms, rewrite {RESULTS['rewrite']:.2f} s, "
                     f"cp {RESULTS['cp']:.2f} s; rewrite/cp = {RESULTS['rewrite'] / RESULTS['cp']:.2f}, "
                     f"cp/in-place = {RESULTS['cp'] / RESULTS['in_place']:.0f}x")
    print("\n" + "\n".join(lines))
