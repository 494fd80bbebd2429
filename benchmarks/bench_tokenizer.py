"""Tokenizing the bundled perplexity text: ggufkit's GGUF tokenizer vs llama.cpp's (llama-cpp-python), one run.

Both tokenize ``eval/data/sample.txt`` as llama-perplexity does (``add_special=True, parse_special=False``)
with the vocab-only GGUFs of llama.cpp's test set (SPM ``llama-spm``; BPE ``llama-bpe``, ``qwen2``, ``gpt-2``).
ggufkit's time includes rebuilding the tokenizer from the file (a fresh tokenizer per round, so the word
cache starts empty), as ``ggufkit ppl`` pays it once per run; llama.cpp's vocabulary is loaded outside the
timed region, which favours llama.cpp. The ids are asserted equal before timing.

Run: ``python -m pytest benchmarks/bench_tokenizer.py --benchmark-enable -s`` (not part of CI). The ratio
(llama.cpp time / ggufkit time; above 1 means ggufkit is faster) is printed and stored in ``extra_info``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_cpp_sources import vocab_dir

TEXT = (Path(__file__).resolve().parents[1] / "eval" / "data" / "sample.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "qwen2", "gpt-2"])
def test_tokenize_sample_vs_llama_cpp(benchmark, name: str) -> None:
    import llama_cpp

    from ggufkit.format import open_gguf
    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    path = vocab_dir() / f"ggml-vocab-{name}.gguf"
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    data = TEXT.encode("utf-8")

    def ours() -> list[int]:
        with open_gguf(path) as f:
            return load_tokenizer(f).encode(TEXT)

    reference = llm.tokenize(data, add_bos=True, special=False)
    assert ours() == reference
    t = time.perf_counter()
    for _ in range(3):
        llm.tokenize(data, add_bos=True, special=False)
    llama_s = (time.perf_counter() - t) / 3
    ours_s = benchmark.pedantic(ours, rounds=3, iterations=1) and benchmark.stats.stats.mean
    ratio = llama_s / ours_s
    benchmark.extra_info.update(llama_cpp_s=llama_s, ggufkit_s=ours_s, ratio=ratio, tokens=len(reference))
    print(f"\n{name}: {len(reference)} tokens; llama.cpp {llama_s:.2f} s, ggufkit {ours_s:.2f} s "
          f"(load included), ratio {ratio:.2f}")
    llm.close()
