"""The vocabulary we write tokenizes in llama.cpp exactly as the source tokenizer does in Python.

A vocab-only GGUF (general.architecture = llama plus build_vocab's keys) is loaded with llama-cpp-python
(``Llama(vocab_only=True)``) and its token ids are compared with transformers' (SPM, BPE flavours) or with
the ``tiktoken`` library (Qwen 1) on a varied text: unicode, emoji, CJK, digits, whitespace runs, code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_tokenizers import (
    BPE_FLAVOR_REGEX,
    QWEN1_SPECIALS,
    VARIED_TEXT,
    make_bpe_tokenizer,
    make_spm_tokenizer,
    make_tiktoken_vocab,
)

from ggufkit.converters.vocab import build_vocab, read_tiktoken
from ggufkit.format.values import VT, Metadata
from ggufkit.format.writer import write_gguf

#: VARIED_TEXT without literal special-token text: llama.cpp prepends a space to an SPM fragment that
#: follows a special token and transformers does not, a runtime difference no vocabulary can remove.
PLAIN_TEXT = "\n".join(line for line in VARIED_TEXT.splitlines() if "<" not in line)


def write_vocab_gguf(model_dir: Path, kind: str, vocab_size: int, out: Path) -> Path:
    md = Metadata()
    md.set("general.architecture", VT.STRING, "llama")
    for key, value in build_vocab(model_dir, kind, vocab_size=vocab_size).items():
        md.put(key, value)
    write_gguf(out, md, [], [])
    return out


def llama_vocab(path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.parametrize("kind", ["spm", "llama-bpe", "qwen2", "gpt-2"])
def test_llama_cpp_tokenizes_like_transformers(tmp_path, kind):
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    if kind == "spm":
        make_spm_tokenizer(src)
        path = write_vocab_gguf(src, "spm", 330, tmp_path / "vocab.gguf")
    else:
        make_bpe_tokenizer(src, flavor=kind)
        path = write_vocab_gguf(src, "bpe", 404, tmp_path / "vocab.gguf")
    hf = AutoTokenizer.from_pretrained(str(src))
    llm = llama_vocab(path)
    for text in (PLAIN_TEXT, "", "\n\n", "Hello", "x  indented\n\tand tabbed  "):
        # add_bos follows the file's tokenizer.ggml.add_bos_token; llama.cpp adds BOS only when it is set
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf.encode(text), text
    if kind == "spm":
        import sentencepiece

        # Text that starts with a space: transformers' Metaspace then adds no "▁" while sentencepiece
        # (and llama.cpp) does, so the model's own library is the oracle there.
        sp = sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
        for text in (" ", "  two", " \n x", PLAIN_TEXT):
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == sp.encode(text), text
    if kind != "spm":
        # special-token text is matched as special tokens by both when asked to parse it
        assert llm.tokenize(VARIED_TEXT.encode(), add_bos=True, special=True) == hf.encode(VARIED_TEXT)


def test_llama_cpp_tokenizes_qwen1_like_tiktoken(tmp_path):
    import tiktoken

    make_tiktoken_vocab(tmp_path)
    ranks = read_tiktoken(tmp_path / "qwen.tiktoken")
    path = write_vocab_gguf(tmp_path, "tiktoken", len(ranks) + len(QWEN1_SPECIALS) + 8, tmp_path / "vocab.gguf")
    # Qwen 1's tokenization_qwen.py builds exactly this encoding (its PAT_STR is the Qwen2 regex)
    enc = tiktoken.Encoding("qwen1", pat_str=BPE_FLAVOR_REGEX["qwen2"], mergeable_ranks=ranks,
                            special_tokens={t: len(ranks) + i for i, t in enumerate(QWEN1_SPECIALS)})
    llm = llama_vocab(path)
    assert llm.tokenize(VARIED_TEXT.encode(), add_bos=False, special=False) == \
        enc.encode(VARIED_TEXT, disallowed_special=())
    assert llm.tokenize(VARIED_TEXT.encode(), add_bos=False, special=True) == \
        enc.encode(VARIED_TEXT, allowed_special="all")
