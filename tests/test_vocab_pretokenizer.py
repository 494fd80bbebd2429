"""Pre-tokenizer detection: llama.cpp's hash table, and behaviour when the hash is unknown.

Oracles: llama.cpp's own converter source (conversion/base.py: its chktxt and its chkhsh if-chain), and
real tokenizers rebuilt from llama.cpp's models/ggml-vocab-*.gguf files, whose hashes its table lists.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

import pytest
from fixtures_tokenizers import make_bpe_tokenizer, rebuild_bpe_tokenizer
from llama_cpp_sources import llama_cpp_dir, vocab_dir

from ggufkit.converters.pretokenizer import CHKHSH_TABLE, CHKTXT, CHKTXT_SHA256, chkhsh, known_pre_tokenizer
from ggufkit.converters.vocab import build_vocab
from ggufkit.errors import TokenizerError
from ggufkit.format.values import python_value


def pre_of(model_dir: Path, vocab_size: int, **kw) -> str:
    return python_value(build_vocab(model_dir, "bpe", vocab_size=vocab_size, **kw)["tokenizer.ggml.pre"])


def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_check_text_and_hash_table_equal_llama_cpps_converter():
    source = (llama_cpp_dir() / "conversion" / "base.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    chktxt = next(node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "chktxt" for t in node.targets))
    assert chktxt == CHKTXT
    assert hashlib.sha256(CHKTXT.encode()).hexdigest() == CHKTXT_SHA256
    # `if chkhsh == "...":` (comment) `res = "..."`, a chain of ifs: the later duplicate wins, as in dict()
    rows = re.findall(r'if chkhsh == "([0-9a-f]{64})":\s*(?:#[^\n]*\n\s*)*res = "([^"]+)"', source)
    assert len(rows) == 97
    assert dict(rows) == CHKHSH_TABLE
    assert CHKHSH_TABLE["b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166"] == "olmo"


def test_real_qwen2_tokenizer_gets_qwen2_by_hash_and_the_vocab_llama_cpp_wrote(tmp_path):
    from ggufkit.format.reader import GGUFFile

    src = vocab_dir() / "ggml-vocab-qwen2.gguf"
    rebuild_bpe_tokenizer(src, tmp_path, "qwen2")
    assert CHKHSH_TABLE[chkhsh(hf_tokenizer(tmp_path).encode)] == "qwen2"
    v = {k: python_value(x) for k, x in build_vocab(tmp_path, "bpe", vocab_size=151936).items()}
    assert v["tokenizer.ggml.pre"] == "qwen2"
    # llama.cpp's converter made that file from the real tokenizer: tokens ([PAD] fillers included), types
    # and merges must come out the same from ours
    with GGUFFile(src) as f:
        assert v["tokenizer.ggml.tokens"] == list(f.get("tokenizer.ggml.tokens"))
        # that file is older than the converter it came with: it typed the fillers USER_DEFINED (4), today's
        # llama.cpp converter writes UNUSED (5), as we do
        expected_types = [5 if t.startswith("[PAD") else int(ty)
                          for t, ty in zip(f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.token_type"))]
        assert list(v["tokenizer.ggml.token_type"]) == expected_types
        assert v["tokenizer.ggml.merges"] == list(f.get("tokenizer.ggml.merges"))
        assert v["tokenizer.ggml.eos_token_id"] == f.get("tokenizer.ggml.eos_token_id")


@pytest.mark.parametrize("flavor", ["qwen2", "llama-bpe", "gpt-2"])
def test_modified_copy_of_a_real_tokenizer_is_recognised_by_behaviour(tmp_path, flavor):
    src = vocab_dir() / f"ggml-vocab-{flavor}.gguf"
    if flavor != "qwen2":
        rebuild_bpe_tokenizer(src, tmp_path / "orig", flavor)
        assert CHKHSH_TABLE[chkhsh(hf_tokenizer(tmp_path / "orig").encode)] == flavor
    # a fine-tune's added token that occurs in the check text changes the ids, so the hash is unknown
    rebuild_bpe_tokenizer(src, tmp_path / "mod", flavor, extra_tokens=("apple\u5de5\u4f5c",))
    hf = hf_tokenizer(tmp_path / "mod")
    assert chkhsh(hf.encode) not in CHKHSH_TABLE
    # for llama-bpe: llama3 and dbrx share a regex; the tokenizer's ignore_merges flag picks llama3's name
    assert pre_of(tmp_path / "mod", max(hf.get_vocab().values()) + 1) == flavor


def test_llama_bpe_without_ignore_merges_flag_gets_the_canonical_name_and_says_so(tmp_path):
    from ggufkit.converters.vocab import build_vocab_and_pre

    # an unknown hash, and a tokenizer.json without Llama 3's ignore_merges flag (older exports, fine-tunes):
    # Llama 3's rules are also dbrx's and smaug-bpe's, which lack the flag; the canonical name must win
    src = vocab_dir() / "ggml-vocab-llama-bpe.gguf"
    rebuild_bpe_tokenizer(src, tmp_path, "llama-bpe", extra_tokens=("apple\u5de5\u4f5c",))
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    del tj["model"]["ignore_merges"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    hf = hf_tokenizer(tmp_path)
    assert chkhsh(hf.encode) not in CHKHSH_TABLE
    meta, match = build_vocab_and_pre(tmp_path, "bpe", vocab_size=max(hf.get_vocab().values()) + 1)
    assert python_value(meta["tokenizer.ggml.pre"]) == match.name == "llama-bpe"
    assert match.method == "behaviour" and {"dbrx", "smaug-bpe"} <= set(match.agreeing)
    assert "chose the canonical 'llama-bpe' over" in match.note and "smaug-bpe" in match.note


def test_known_hash_reports_the_hash_method(tmp_path):
    from ggufkit.converters.vocab import build_vocab_and_pre

    rebuild_bpe_tokenizer(vocab_dir() / "ggml-vocab-gpt-2.gguf", tmp_path, "gpt-2")
    hf = hf_tokenizer(tmp_path)
    _, match = build_vocab_and_pre(tmp_path, "bpe", vocab_size=max(hf.get_vocab().values()) + 1)
    assert (match.name, match.method, match.note) == ("gpt-2", "hash", "")


@pytest.fixture(scope="module")
def odd_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE whose pre-tokenizer no llama.cpp rule reproduces (it cuts words at 'm'/'n')."""
    d = tmp_path_factory.mktemp("odd")
    make_bpe_tokenizer(d, flavor="gpt-2")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "[a-m]+|[^a-m]+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ]}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    # transformers 5's GPT2Tokenizer class would rebuild GPT-2's own pre-tokenizer; the generic class keeps ours
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_unrecognised_tokenizer_error_names_closest_candidates_and_the_override(odd_tokenizer):
    with pytest.raises(TokenizerError) as err:
        pre_of(odd_tokenizer, 400)
    message = str(err.value)
    assert "not in llama.cpp's table" in message and "--pre-tokenizer NAME" in message
    closest = re.search(r"closest: (.*)\. If", message).group(1)
    assert len(re.findall(r"\w[\w.-]* \(first \d+ pre-tokenized words agree\)", closest)) == 3


def test_override_is_used_as_given_and_must_be_a_known_name(odd_tokenizer):
    assert pre_of(odd_tokenizer, 400, pre_tokenizer="gpt-2") == "gpt-2"
    # a name llama.cpp knows though ggufkit's evaluator cannot run it is still a valid override
    assert known_pre_tokenizer("kimi-k2") == "kimi-k2"
    with pytest.raises(TokenizerError, match="unknown pre-tokenizer 'gpt-3'"):
        pre_of(odd_tokenizer, 400, pre_tokenizer="gpt-3")


def test_pre_tokenizer_override_is_refused_for_sentencepiece(tmp_path):
    from fixtures_tokenizers import make_spm_tokenizer

    make_spm_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="BPE vocabularies only"):
        build_vocab(tmp_path, "spm", vocab_size=320, pre_tokenizer="gpt-2")


def test_user_defined_tokens_are_cut_out_before_pre_tokenizing(tmp_path):
    # llama.cpp matches USER_DEFINED tokens in raw text first; the behaviour check must do the same
    for flavor in ("qwen2", "llama-bpe"):
        d = tmp_path / flavor
        make_bpe_tokenizer(d, flavor=flavor)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        tj = json.loads((d / "tokenizer.json").read_text())
        tj["added_tokens"].append({"id": 400, "content": "apple", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": True, "special": False})
        cfg["added_tokens_decoder"]["400"] = {"content": "apple", "normalized": True, "special": False}
        (d / "tokenizer.json").write_text(json.dumps(tj))
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        assert pre_of(d, 401) == flavor
