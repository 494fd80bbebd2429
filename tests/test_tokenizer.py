"""The GGUF tokenizer (ggufkit/tokenizer/gguf_tokenizer.py, its BPE driver bpe_session.py) and the pre-tokenizer
table (ggufkit/tokenizer/pretokenizers.py) against llama.cpp itself: its tokenizer test vectors
(models/ggml-vocab-*.gguf with .inp/.out, as tests/test-tokenizer-0.cpp reads them) and llama-cpp-python's
tokenizer/detokenizer on the same files."""

from __future__ import annotations

import ctypes
import itertools
import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType
from llama_cpp_sources import llama_cpp_dir, vocab_dir

from ggufkit.converters.pretokenizer import bpe_tokenize
from ggufkit.errors import TokenizerError
from ggufkit.format import Metadata, open_gguf, write_gguf
from ggufkit.tokenizer.bpe import merge_ranks
from ggufkit.tokenizer.gguf_tokenizer import GGUFTokenizer, _parse_merges, load_tokenizer
from ggufkit.tokenizer.pretokenizers import PRE_TOKENIZERS, WHITESPACE, get_pre_tokenizer, split
from ggufkit.tokenizer.unicode_ranges import _table, char_class

#: Every vocab file of the llama.cpp tree, by what we do with it. A new file upstream fails
#: test_every_vocab_file_is_classified until it is placed here.
SUPPORTED = ("aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
             "gpt-neox", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
UNSUPPORTED = {"bert-bge": "'bert'", "nomic-bert-moe": "'t5'"}
WITH_VECTORS = tuple(n for n in SUPPORTED if n not in ("aquila", "baichuan", "gpt-neox"))

SEPARATOR = "\n__ggml_vocab_test__\n"

#: Real text with the hard cases: digits, contractions in both cases, whitespace runs, CRLF, non-ASCII
#: whitespace, C0 controls that Python's \s counts as whitespace, emoji (byte fallback, ZWJ), CJK and other
#: scripts, combining marks, an unassigned code point, a Unicode 15.1 letter (CJK ext. I), code, and
#: special-token spellings that must stay plain text unless parse_special.
VARIED_TEXT = (
    "Hello world! It's 2024-05-17, I'VE got 1234567 apples & 3.14159 pies; they'll DON'T.\n\n"
    "  Leading spaces\tand\ttabs\r\nWindows line\u00a0nbsp\u3000ideographic\u2028sep \x1c\x1f ctrl\x07\n"
    "Emoji: 😀🤖👩‍👩‍👧 flags 🇩🇪 — em-dash … ellipsis «quotes» “curly” ‘single’ ~tilde~ `tick`\n"
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트. Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย\n"
    "Combining: e\u0301 a\u0308 n\u0303; unassigned \u0378 new \U0002EBF0 private \ue000 repl \ufffd\n"
    "def f(x):\n    return x**2  # comment\n\n\n\tif x != 0 { y += 1; }  \n"
    "Specials: <s> </s> <unk> <|endoftext|> <|im_start|>user<|im_end|> [INST] <|eot_id|> <pad> <mask>\n"
    "   multiple     spaces    here   \n\n\n\n end   ")
EDGE_TEXTS = ("", " ", "  ", "\n", "\n\n", "a", " a", "\t\t", "12345678901", "'s 'S 'll", "\u00a0\u00a0x")


@cache
def _path(name: str) -> Path:
    return vocab_dir() / f"ggml-vocab-{name}.gguf"


@cache
def _ours(name: str) -> GGUFTokenizer:
    return load_tokenizer(open_gguf(_path(name)))


_LLAMAS: dict[str, object] = {}


def _llama(path: str):
    import llama_cpp

    if path not in _LLAMAS:
        _LLAMAS[path] = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    return _LLAMAS[path]


@pytest.fixture(scope="module", autouse=True)
def _close_llamas():
    """Free llama.cpp's vocabularies while the library is still loaded (its finalizers fail at exit)."""
    yield
    while _LLAMAS:
        _LLAMAS.popitem()[1].close()


def _reference(path: str | Path, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    return list(_llama(str(path)).tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))


def _reference_decode(path: str | Path, ids: list[int], *, special: bool) -> str:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(_llama(str(path)).model)
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(1 << 17)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", errors="replace")


# --- llama.cpp's test vectors ----------------------------------------------------------------------------

def test_every_vocab_file_is_classified() -> None:
    names = {p.name[len("ggml-vocab-"):-len(".gguf")] for p in vocab_dir().glob("ggml-vocab-*.gguf")}
    assert names == set(SUPPORTED) | set(UNSUPPORTED)
    with_vectors = {n for n in names if _path(n).with_name(_path(n).name + ".inp").exists()}
    assert with_vectors - set(UNSUPPORTED) == set(WITH_VECTORS)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_tokenizer_model_is_a_clear_error(name: str) -> None:
    with pytest.raises(TokenizerError, match=f"tokenizer.ggml.model {re.escape(UNSUPPORTED[name])} is not supported"):
        load_tokenizer(open_gguf(_path(name)))


@pytest.mark.parametrize("engine", ["auto", "python"])
@pytest.mark.parametrize("name", WITH_VECTORS)
def test_llama_cpp_test_vectors_match_token_for_token(name: str, engine: str) -> None:
    path = _path(name)
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    if texts[-1] == "":  # the last string is followed by the separator too (test-tokenizer-0.cpp)
        texts.pop()
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    expected = [[int(x) for x in line.split()] for line in lines[:len(texts)]]
    assert len(texts) >= 46
    tok = _ours(name) if engine == "auto" else load_tokenizer(open_gguf(path), engine=engine)
    got = [tok.encode(t, add_special=False, parse_special=False) for t in texts]
    mismatches = [(t, g, e) for t, g, e in zip(texts, got, expected) if g != e]
    assert not mismatches, mismatches[:3]
    # every BPE vocabulary of the test set is merged by the tokenizers library unless told otherwise
    assert tok.merge_engine == ("spm" if tok.model == "llama" else "python" if engine == "python" or name == "gemma-4"
                                else "tokenizers")


# --- llama-cpp-python's tokenizer on real text ---------------------------------------------------------------

@pytest.mark.parametrize("name", SUPPORTED)
def test_encode_matches_llama_cpp_on_varied_text(name: str) -> None:
    tok, path = _ours(name), _path(name)
    for add_special in (True, False):
        for parse_special in (False, True):
            for text in (VARIED_TEXT, *EDGE_TEXTS):
                want = _reference(path, text, add_special=add_special, parse_special=parse_special)
                got = tok.encode(text, add_special=add_special, parse_special=parse_special)
                assert got == want, (text[:40], add_special, parse_special)


#: Building blocks of random strings: the characters and fragments where tokenizers tend to disagree.
_FUZZ_POOL = (
    [*" \t\n\r\v\f\x00\x01\x1c\x7f'sStTdDlLrReEvVmM0123456789~`!?.,;:$+<=>^|_-/\\\"()[]{}#@%&*",
     *"aAzZéÉßøΩπжЖ你好世界日本語한국ไทยअ\u0301\u0308\u00a0\u2028\u3000\u200b\u200d\u0378\U0002EBF0\ue000\ufffd😀¹½Ⅷ٣",
     "<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "Hello", " world", "  ", "'ll", "'VE", "123456"])


@pytest.mark.parametrize("name", SUPPORTED)
def test_encode_matches_llama_cpp_on_random_strings(name: str) -> None:
    rng = np.random.default_rng(1234)
    tok, path = _ours(name), _path(name)
    for _ in range(40):
        text = "".join(_FUZZ_POOL[i] for i in rng.integers(0, len(_FUZZ_POOL), int(rng.integers(0, 30))))
        for parse_special in (False, True):
            assert tok.encode(text, parse_special=parse_special) == _reference(
                path, text, add_special=True, parse_special=parse_special), text


@pytest.mark.parametrize("name", SUPPORTED)
def test_decode_matches_llama_detokenize(name: str) -> None:
    tok, path = _ours(name), _path(name)
    ids = _reference(path, VARIED_TEXT, add_special=True, parse_special=True)
    for special in (False, True):
        assert tok.decode(ids, special=special) == _reference_decode(path, ids, special=special)


def test_whole_sample_text_matches_llama_cpp() -> None:
    """The bundled perplexity text, tokenized as llama-perplexity does, on an SPM and a BPE vocabulary."""
    text = (Path(__file__).parents[1] / "eval" / "data" / "sample.txt").read_text(encoding="utf-8")[:120_000]
    for name in ("llama-spm", "llama-bpe"):
        assert _ours(name).encode(text) == _reference(_path(name), text, add_special=True, parse_special=False)


def _patched_copy(tmp_path: Path, source: str, changes: dict[str, tuple[GGUFValueType, object]]) -> Path:
    """A copy of a vocab file with some KV pairs replaced or added (written by ggufkit's own writer)."""
    out = tmp_path / f"{source}-patched.gguf"
    with open_gguf(_path(source)) as src:
        md = Metadata((k, f) for k, f in src.kv.items() if k not in changes)
        for key, (vtype, value) in changes.items():
            item = None
            if isinstance(value, (np.ndarray, list)):
                item, vtype = vtype, GGUFValueType.ARRAY
            md.set(key, vtype, value, item)
        write_gguf(out, md, [], [], slack_bytes=0)
    return out


def test_spm_flags_from_the_file_match_llama_cpp(tmp_path: Path) -> None:
    """add_space_prefix=false, add_bos=false, add_eos=true: each changes the ids as it does in llama.cpp."""
    path = _patched_copy(tmp_path, "llama-spm", {
        "tokenizer.ggml.add_space_prefix": (GGUFValueType.BOOL, False),
        "tokenizer.ggml.add_bos_token": (GGUFValueType.BOOL, False),
        "tokenizer.ggml.add_eos_token": (GGUFValueType.BOOL, True),
    })
    tok = load_tokenizer(open_gguf(path))
    assert (tok.add_space_prefix, tok.add_bos, tok.add_eos) == (False, False, True)
    for text in (VARIED_TEXT, "Hello", " Hello"):
        for add_special in (True, False):
            assert tok.encode(text, add_special=add_special) == _reference(
                path, text, add_special=add_special, parse_special=False)
    assert tok.encode("Hello")[-1] == tok.eos_id


def test_user_defined_tokens_are_split_out_and_control_tokens_only_with_parse_special(tmp_path: Path) -> None:
    """A USER_DEFINED token is matched inside plain text (longest first); CONTROL ones only with
    parse_special, as in llama.cpp's tokenizer_st_partition."""
    with open_gguf(_path("llama-bpe")) as f:
        types = np.array(f.get("tokenizer.ggml.token_type"), dtype=np.int32)
        tokens = f.get("tokenizer.ggml.tokens")
    user = [tokens.index(t) for t in ("ĠHello", "world", "wor")]
    types[user] = 4  # USER_DEFINED
    path = _patched_copy(tmp_path, "llama-bpe", {"tokenizer.ggml.token_type": (GGUFValueType.INT32, types)})
    tok = load_tokenizer(open_gguf(path))
    text = "xĠHelloworldy <|begin_of_text|>worx"
    for parse_special in (False, True):
        got = tok.encode(text, add_special=False, parse_special=parse_special)
        assert got == _reference(path, text, add_special=False, parse_special=parse_special)
        assert user[1] in got and (tok.bos_id in got) == parse_special


# --- loading errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("metadata, message", [
    ({}, "no vocabulary"),
    ({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "'rwkv' is not supported"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}, "needs tokenizer.ggml.merges"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": ["a"],
      "tokenizer.ggml.merges": []}, "unsupported pre-tokenizer 'no-such-pre'"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [],
      "tokenizer.ggml.add_bos_token": True}, "add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"],
      "tokenizer.ggml.scores": np.zeros(1, np.float32)}, "has 1 entries for 2 tokens"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []}, "not a non-empty array"),
])
def test_bad_vocabulary_metadata_raises_tokenizer_error(metadata: dict, message: str) -> None:
    with pytest.raises(TokenizerError, match=re.escape(message)):
        load_tokenizer(metadata)


def test_out_of_range_special_id_is_ignored_as_in_llama_cpp() -> None:
    tok = load_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁a"],
                          "tokenizer.ggml.bos_token_id": 99})
    assert tok.bos_id == 1 and tok.encode("a") == [1, 3]


def test_merges_rank_by_first_occurrence_split_at_first_space_after_index_0() -> None:
    assert _parse_merges(["a b", "c d", "a b", " x y", "nospace"]) == {
        ("a", "b"): 0, ("c", "d"): 1, (" x", "y"): 3, ("", ""): 4}


def test_merge_into_a_non_token_falls_back_to_bytes_in_the_python_engine() -> None:
    """llama.cpp applies a merge whose result is not a token and then spells the symbol byte by byte;
    tokenizers cannot express that merge, so auto uses ggufkit's loop and "tokenizers" refuses."""
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "c"],
          "tokenizer.ggml.merges": ["a b"]}
    tok = load_tokenizer(md)
    assert tok.encode("abc") == [0, 1, 2] and tok.merge_engine == "python"
    with pytest.raises(TokenizerError, match="cannot be expressed with the tokenizers library"):
        load_tokenizer(md, engine="tokenizers").encode("abc")


def test_a_symbol_missing_from_the_vocabulary_is_spelt_as_llama_cpp_spells_it_for_both_users(tmp_path: Path) -> None:
    """The one BPE driver (ggufkit/tokenizer/bpe_session.py) of the evaluator and of the converter's pre-tokenizer
    check. With "Ġthe" renamed away, the merges still build it; llama.cpp (llm_tokenizer_bpe_session::tokenize)
    then looks the symbol up byte by byte, so 't', 'h', 'e' survive and 'Ġ' (two UTF-8 bytes) is dropped.
    The converter used to look it up character by character and kept 'Ġ'."""
    with open_gguf(_path("gpt-2")) as f:
        tokens = list(f.get("tokenizer.ggml.tokens"))
        merges = list(f.get("tokenizer.ggml.merges"))
    tokens[tokens.index("Ġthe")] = "[gone]"
    path = _patched_copy(tmp_path, "gpt-2", {"tokenizer.ggml.tokens": (GGUFValueType.STRING, tokens)})
    text = "Over the hill, the end."
    expected = _reference(path, text, add_special=False, parse_special=False)
    t2i = {t: i for i, t in enumerate(tokens)}
    assert [t2i["t"], t2i["h"], t2i["e"]] == expected[1:4] and t2i["Ġ"] not in expected
    for engine in ("auto", "python"):
        assert load_tokenizer(open_gguf(path), engine=engine).encode(text, add_special=False) == expected
    assert bpe_tokenize(text, "gpt-2", token_to_id=t2i, ranks=merge_ranks(merges)) == expected


def test_spm_without_byte_tokens_reports_the_missing_byte() -> None:
    tok = load_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁"]})
    with pytest.raises(TokenizerError, match=r"no byte token <0xC3>"):
        tok.encode("é")


# --- the pre-tokenizer table -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, text, pieces", [
    ("smollm", " 12345", [" ", "1", "2", "3", "4", "5"]),             # digits isolated first (reference §4.5)
    ("default", "12345 x", ["123", "45", " x"]),                      # ASCII digits re-cut in threes
    ("llama-bpe", "1234567 it'S", ["123", "456", "7", " it", "'S"]),  # \p{N}{1,3}, case-insensitive 's
    ("gpt-2", "it'S", ["it", "'", "S"]),                              # GPT-2's contractions are case-sensitive
    ("qwen2", "a  12", ["a", " ", " ", "1", "2"]),
    ("gpt-2", "a\x1cb", ["a", "\x1c", "b"]),                          # 0x1C is not whitespace in llama.cpp
    ("gpt-2", "a\u00a0 b", ["a", "\u00a0", " b"]),                    # but U+00A0 is
    ("gpt-2", "a\U0002EBF0", ["a\U0002EBF0"]),                       # a Unicode 15.1 letter is a letter
    ("llama-bpe", "x  \n\n y", ["x", "  \n\n", " y"]),
])
def test_split_follows_llama_cpp_rules(name: str, text: str, pieces: list[str]) -> None:
    assert split(text, name) == pieces


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_cuts_text_into_nonempty_covering_pieces(name: str) -> None:
    pieces = split(VARIED_TEXT, name)
    assert "".join(pieces) == VARIED_TEXT and all(pieces)


def test_missing_pre_means_default_and_unknown_pre_is_an_error() -> None:
    assert get_pre_tokenizer(None) is PRE_TOKENIZERS["default"]
    assert get_pre_tokenizer("") is PRE_TOKENIZERS["default"]
    with pytest.raises(TokenizerError, match="unsupported pre-tokenizer 'afmoe'"):
        get_pre_tokenizer("afmoe")


def test_pre_tokenizer_names_and_regexes_are_llama_cpp_s() -> None:
    """Every name we accept is one llama.cpp accepts, and every regex list appears verbatim in its source."""
    src = (llama_cpp_dir() / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    literals = {bytes(m, "utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")
                for m in re.findall(r'^\s*"((?:[^"\\]|\\.)*)",?\s*(?://.*)?$', src, flags=re.M)}
    for name, rule in PRE_TOKENIZERS.items():
        assert f'tokenizer_pre == "{name}"' in src, name
        for regex in rule.regexes:
            assert regex in literals, (name, regex)


def test_unicode_classes_equal_llama_cpp_s_table() -> None:
    """ggufkit/tokenizer/unicode_ranges.py holds exactly the classes of llama.cpp's unicode-data.cpp (from U+0080)."""
    src = (llama_cpp_dir() / "src" / "unicode-data.cpp").read_text(encoding="utf-8")
    flags_src = src[src.index("unicode_ranges_flags"):]
    ranges = [(int(a, 16), int(b, 16))
              for a, b in re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}", flags_src[:flags_src.index("};")])]
    names = {0x02: "N", 0x04: "L", 0x10: "M", 0x20: "P", 0x40: "S"}
    want: list[tuple[int, str]] = []
    for (start, flags), (end, _) in itertools.pairwise(ranges):
        cls = names.get(flags, "O")
        if end > 0x80 and (not want or want[-1][1] != cls):
            want.append((max(start, 0x80), cls))
    starts, classes = _table()
    assert list(zip(starts, classes)) == want
    assert char_class(0x2EBF0) == "L" and char_class(0x0378) == "O"
    ws_src = src[src.index("unicode_set_whitespace"):]
    ws = {int(h, 16) for h in re.findall(r"0x([0-9A-F]+)", ws_src[:ws_src.index("};")])}
    assert ws == set(WHITESPACE)
