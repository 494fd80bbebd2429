"""llama.cpp's BPE pre-tokenizers: the regex list per ``tokenizer.ggml.pre`` and a splitter that applies it.

This module is THE table of pre-tokenizers in ggufkit. The regex lists, the name -> rule mapping and the
per-name flags (``ignore_merges``, ``add_bos``) are the ones in llama.cpp's ``src/llama-vocab.cpp``
(``llm_tokenizer_bpe`` constructor and ``llama_vocab::impl::load``, the tree vendored by llama-cpp-python
0.3.36); the regexes are kept verbatim, in llama.cpp's own spelling, so they can be compared by eye.

:func:`split` cuts text into the "words" BPE merges within, exactly as llama.cpp's ``unicode_regex_split``
(``src/unicode.cpp``) does, which is not what a Unicode regex engine would do with the same pattern:

* The regexes are applied in sequence; each re-splits every piece the previous ones produced, and both the
  matches and the unmatched gaps become pieces (HF ``Split(behavior="isolated")``).
* The GPT-2 and Llama-3 patterns run through hand-written matchers. Everything else runs through
  ``std::regex`` on a *collapsed* text in which every non-ASCII code point is one placeholder byte per
  Unicode category (and non-ASCII whitespace is ``\\v``); ``\\p{L}`` etc. are rewritten into classes over
  those placeholders plus fixed ASCII sets. So ``\\p{Lu}`` matches any letter, ``~`` is not ``\\p{S}``, and a
  regex with neither ``\\p{..}`` nor custom matcher sees code points with non-ASCII whitespace as ``\\v``.
* "Whitespace" is llama.cpp's set of 25 code points, not Python's ``\\s`` (which adds 0x1C-0x1F), and
  categories come from llama.cpp's Unicode 15.1 table (:mod:`ggufkit.tokenizer.unicode_ranges`), not ``unicodedata``.

We reproduce this by building the same collapsed text and running Python's ``re`` (ASCII mode, whose ``\\s``
equals the C locale's) on it; the two hand-written matchers are expressed as equivalent regexes over the
collapsed text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from ggufkit.errors import TokenizerError
from ggufkit.tokenizer.unicode_ranges import char_class

# --- the regexes (verbatim from src/llama-vocab.cpp, llm_tokenizer_bpe::llm_tokenizer_bpe) -------------
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
#: Llama 3's tokenizer.json regex with ``(?i:...)`` spelled out (llama.cpp PR 6920).
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_HF = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Qwen2: Llama 3's regex with single digits.
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Kimi K2's one "regex": the trigger of unicode.cpp's hand-written unicode_regex_split_custom_kimi_k2, which
#: runs all of tokenization_kimi.py's pat_str (Han runs, letter words without Han, 1-3 digits, ...).
KIMI_K2 = r"\p{Han}+"
NEWLINES = r"[^\n]+|[\n]+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", GPT2)
# Non-ASCII characters are escaped so that no editor can re-normalise them (the C++ source is not NFC).
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    _CJK,
    "\\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}")
_DEEPSEEK3_WORDS = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_KANA_HAN = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3 = ("\\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3_WORDS)
_SPARK2_5 = ("\\p{N}{1,3}", _KANA_HAN,
             "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
             "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", "\\p{N}")
_BLOOM_WORDS = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_JAIS2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)"
          r"|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
    r"((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))*((?=[\p{{L}}])([^A-Z]))+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))+((?=[\p{{L}}])([^A-Z]))*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_GRANITE_EMB = (
    rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))*((?=[\p{{L}}\p{{M}}])([^A-Z]))+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))+((?=[\p{{L}}\p{{M}}])([^A-Z]))*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHAMELEON = (
    "<sentinel:[0-9]+>",
    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    "([\\t\\n]|    |  )",
    "\\p{N}",
    "[\\p{P}!-/:-@\\[-`{-~]",
    GPT2,
)
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)
_SEED_CODER = (rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1}}"
               r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)
_UFAKZEKA = (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_EXAONE_MOE = (rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?(?:\p{{L}}\p{{M}}*(?: \p{{L}}\p{{M}}*)*)+|\p{{N}}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)
_MINICPM5 = ("\\p{N}{1,3}", rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}+"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-tokenizes (and partly configures) a BPE vocabulary with this ``tokenizer.ggml.pre``.

    Attributes:
        name: the ``tokenizer.ggml.pre`` value.
        kind: llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_*`` (lower case) that the name selects.
        regexes: the regexes, applied in sequence (see :func:`split`).
        ignore_merges: a word that is itself a vocabulary token is emitted without merging (Llama 3, Tekken).
        add_bos: llama.cpp's default for adding BOS, before ``tokenizer.ggml.add_bos_token`` overrides it.
        no_bos: llama.cpp unsets the BOS id for this name (ChatGLM), whatever the file says.
        byte_level: words are GPT-2 byte-level encoded before merging; False for the SentencePiece-style
            BPE of Gemma 4, which merges raw UTF-8 with spaces escaped as U+2581 and ``<0xNN>`` byte tokens.
    """

    name: str
    kind: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False
    byte_level: bool = True


def _rules() -> dict[str, PreTokenizer]:
    # (names, kind, regexes, flags) in the order of llama_vocab::impl::load's if-chain.
    i, b, n, r = "ignore_merges", "add_bos", "no_bos", "raw_utf8"
    table: list[tuple[tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]] = [
        (("default",), "default", _DEFAULT, ()),
        (("minicpm5",), "minicpm5", _MINICPM5, (i,)),
        (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
          "jina-v5-nano"), "llama3", (LLAMA3,), (i, b)),
        (("deepseek-llm",), "deepseek_llm", _DEEPSEEK_LLM, ()),
        (("deepseek-coder",), "deepseek_coder", _DEEPSEEK_CODER, ()),
        (("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"), "deepseek3_llm", _DEEPSEEK3, ()),
        (("spark2_5",), "spark2_5", _SPARK2_5, ()),
        (("falcon",), "falcon", _FALCON, ()),
        (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
          "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais",
          "trillion", "granite-docling"), "gpt2", (GPT2,), ()),
        (("jais-2",), "jais2", _JAIS2, ()),
        (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
         "starcoder", _STARCODER, ()),
        (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
          "grok-2"), "qwen2", (QWEN2,), ()),
        (("qwen35",), "qwen35", (QWEN35,), ()),
        (("dbrx", "smaug-bpe"), "dbrx", (LLAMA3,), ()),
        (("poro-chat", "bloom", "gpt3-finnish"), "bloom", (_BLOOM_WORDS,), ()),
        (("chatglm-bpe",), "chatglm4", (LLAMA3,), (n,)),
        (("glm4", "glm5"), "chatglm4", (LLAMA3,), (n, i)),
        (("viking",), "viking", (_BLOOM_WORDS, "\\p{N}"), ()),
        (("tekken",), "tekken", _TEKKEN, (i, b)),
        (("chameleon",), "chameleon", _CHAMELEON, (b,)),
        (("exaone-moe",), "exaone_moe", _EXAONE_MOE, ()),
        (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o", _GPT4O, ()),
        (("granite-embed-multi-97m",), "granite_emb_multi", _GRANITE_EMB, (i,)),
        (("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe", _BAILINGMOE, ()),
        (("seed-coder",), "seed_coder", _SEED_CODER, ()),
        (("ufakzeka",), "ufakzeka", _UFAKZEKA, ()),
        (("laguna",), "laguna", (NEWLINES, QWEN2), ()),
        (("gemma4", "granite-embed-multi-311m"), "gemma4", (NEWLINES,), (r,)),
        (("sarvam-moe",), "sarvam_moe", (NEWLINES,), (r,)),
    ]
    out: dict[str, PreTokenizer] = {}
    for names, kind, regexes, flags in table:
        for name in names:
            if name in out:
                raise AssertionError(f"duplicate pre-tokenizer name {name!r}")  # a bug in this table
            out[name] = PreTokenizer(name, kind, regexes, ignore_merges=i in flags, add_bos=b in flags,
                                     no_bos=n in flags, byte_level=r not in flags)
    return out


#: ``tokenizer.ggml.pre`` value -> rule: the names a BPE tokenizer's behaviour is matched against
#: (converters/pretokenizer.py). Names llama.cpp knows but ggufkit cannot run (custom C++ matchers such as
#: ``afmoe``) are deliberately absent.
PRE_TOKENIZERS: dict[str, PreTokenizer] = _rules()
#: Rules ggufkit runs that a vocabulary gets only from its own format, never by matching behaviour: Kimi K2's
#: tiktoken tokenizer (converters/vocab.py), whose splitter is unicode.cpp's hand-written Kimi matcher.
FORMAT_PRE_TOKENIZERS: dict[str, PreTokenizer] = {"kimi-k2": PreTokenizer("kimi-k2", "kimi_k2", (KIMI_K2,))}


def get_pre_tokenizer(name: str | None) -> PreTokenizer:
    """The rule for a ``tokenizer.ggml.pre`` value; a missing value means ``default``, as in llama.cpp.

    Raises:
        TokenizerError: the name is unknown or not supported by ggufkit.
    """
    if name is None or name == "":
        name = "default"
    rule = PRE_TOKENIZERS.get(name) or FORMAT_PRE_TOKENIZERS.get(name)
    if rule is None:
        raise TokenizerError(f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: "
                             + ", ".join(sorted([*PRE_TOKENIZERS, *FORMAT_PRE_TOKENIZERS])))
    return rule


# --- llama.cpp's character classes ----------------------------------------------------------------------
#: llama.cpp's whitespace set (unicode-data.cpp unicode_set_whitespace; PropList White_Space minus 1C-1F).
WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                        0x202F, 0x205F, 0x3000])

# Placeholders of the collapsed text (unicode.cpp k_ucat_cpt); 0xD0 is "any other category".
_OTHER, _NUMBER, _LETTER, _PUNCT, _MARK, _SYMBOL = "\xd0", "\xd1", "\xd2", "\xd3", "\xd4", "\xd5"
_CATEGORY_PLACEHOLDER = {"N": _NUMBER, "L": _LETTER, "P": _PUNCT, "M": _MARK, "S": _SYMBOL}
#: ``\p{..}`` -> (placeholder, ASCII members) as unicode.cpp k_ucat_enum / k_ucat_map rewrite them.
_UCAT = {
    r"\p{N}": (_NUMBER, "0-9"),
    r"\p{L}": (_LETTER, "A-Za-z"),
    r"\p{P}": (_PUNCT, r"!-#%-*,-/:-;?-@\[-\]_\{\}"),
    r"\p{M}": (_MARK, ""),
    r"\p{S}": (_SYMBOL, r"\$\+<->\^`\|"),  # '~' is missing upstream, so it is not \p{S} there either
    r"\p{Lu}": (_LETTER, "A-Za-z"),
    r"\p{Ll}": (_LETTER, "A-Za-z"),
    r"\p{Lt}": (_LETTER, "A-Za-z"),
    r"\p{Lm}": (_LETTER, "A-Za-z"),
    r"\p{Lo}": (_LETTER, "A-Za-z"),
}

# The hand-written matchers of unicode.cpp, as regexes over the collapsed text. L = [A-Za-z\xd2],
# N = [0-9\xd1], whitespace = ASCII \s (non-ASCII whitespace is \v there); the trailing "." mirrors the
# matchers' "no match: emit one code point" step.
_L, _N = "A-Za-z\xd2", "0-9\xd1"
_GPT2_MATCHER = (rf"'[stmd]|'(?:re|ve|ll)| ?[{_L}]+| ?[{_N}]+| ?[^\s{_L}{_N}]+|\s+(?!\S)|\s+|.")
_LLAMA3_MATCHER = (rf"'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL])|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]{{1,3}}"
                   rf"| ?[^\s{_L}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|.")
_QWEN2_MATCHER = (rf"'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL])|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]"
                  rf"| ?[^\s{_L}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|.")
_LM = _L + "\xd4"  # letters and marks (\p{M} has no ASCII members)
_QWEN35_MATCHER = (rf"'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL])|[^\r\n{_L}{_N}]?[{_LM}]+|[{_N}]"
                   rf"| ?[^\s{_LM}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|.")
_CUSTOM = {GPT2: _GPT2_MATCHER, LLAMA3: _LLAMA3_MATCHER, LLAMA3_HF: _LLAMA3_MATCHER, QWEN2: _QWEN2_MATCHER,
           QWEN35: _QWEN35_MATCHER, NEWLINES: NEWLINES}


class _CollapseTable(dict[int, str]):
    """str.translate table: non-ASCII code point -> its placeholder, computed once per code point."""

    def __missing__(self, cp: int) -> str:
        if cp < 0x80:
            raise LookupError(cp)  # ASCII stays as it is
        if cp in WHITESPACE:
            ch = "\x0b"
        else:
            ch = _CATEGORY_PLACEHOLDER.get(char_class(cp), _OTHER)
        self[cp] = ch
        return ch


class _WhitespaceTable(dict[int, str]):
    """str.translate table for the std::wregex path: non-ASCII whitespace -> \\v, all else unchanged."""

    def __missing__(self, cp: int) -> str:
        if cp >= 0x80 and cp in WHITESPACE:
            self[cp] = "\x0b"
            return "\x0b"
        raise LookupError(cp)


_COLLAPSE = _CollapseTable()
_WS_ONLY = _WhitespaceTable()


def _collapse_regex(expr: str) -> str:
    """Rewrite ``\\p{..}`` classes the way unicode_regex_split does (inside or outside ``[...]``)."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
            out.append(c)
        elif inside and c == "]" and expr[i - 1] != "\\":
            inside = False
            out.append(c)
        elif expr.startswith("\\p{", i) and (close := expr.find("}", i + 3)) != -1 and close <= i + 10 \
                and expr[i:close + 1] in _UCAT:
            placeholder, ascii_set = _UCAT[expr[i:close + 1]]
            out.append(placeholder + ascii_set if inside else f"[{placeholder}{ascii_set}]")
            i = close
        else:
            out.append(c)
        i += 1
    return "".join(out)


@cache
def _compile(expr: str) -> tuple[re.Pattern[str], bool]:
    """(compiled pattern, runs on the collapsed text?) for one of llama.cpp's regexes."""
    if expr in _CUSTOM:
        return re.compile(_CUSTOM[expr], re.ASCII | re.DOTALL), True
    # ECMAScript's "$" (no multiline) is the end of the input only; Python's also matches before a final "\n".
    py = re.sub(r"(?<!\\)\$$", r"\\Z", expr)
    if any(k in expr for k in _UCAT):
        if any(ord(c) >= 0x80 for c in expr):
            raise TokenizerError(f"regex {expr!r} mixes Unicode categories and non-ASCII characters, which "
                                 "llama.cpp does not support")
        return re.compile(_collapse_regex(py), re.ASCII), True
    return re.compile(py, re.ASCII), False


def split_spans(text: str, regexes: Iterable[str]) -> list[tuple[int, int]]:
    """The ``(start, end)`` code-point spans llama.cpp's ``unicode_regex_split`` cuts ``text`` into.

    Args:
        text: the raw text of one fragment (special tokens already split out).
        regexes: llama.cpp regexes, applied in sequence.

    Returns:
        Non-empty, contiguous spans covering ``text``.

    Raises:
        TokenizerError: a regex llama.cpp itself rejects.
    """
    exprs = list(regexes)
    compiled = [_compile(e) for e in exprs if e != KIMI_K2]
    collapsed = text.translate(_COLLAPSE) if any(c for _, c in compiled) else text
    ws_only = text.translate(_WS_ONLY) if not all(c for _, c in compiled) else text
    spans = [(0, len(text))] if text else []
    for expr in exprs:
        if expr == KIMI_K2:
            spans = _kimi_k2_spans(text, spans)
            continue
        pattern, use_collapsed = _compile(expr)
        subject = collapsed if use_collapsed else ws_only
        new: list[tuple[int, int]] = []
        for a, b in spans:
            pos = a
            for m in pattern.finditer(subject, a, b):
                s, e = m.span()
                if s > pos:
                    new.append((pos, s))
                if e > s:  # llama.cpp keeps zero-length matches as empty words, which yield no tokens
                    new.append((s, e))
                pos = max(pos, e)
            if pos < b:
                new.append((pos, b))
        spans = new
    return spans


def _is_han(cp: int) -> bool:
    """unicode.cpp unicode_cpt_is_han: CJK Unified Ideographs, extensions A-F, compatibility ideographs."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2EBEF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _kimi_k2_spans(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """unicode.cpp unicode_regex_split_custom_kimi_k2, step for step: each span cut into Kimi K2's words."""
    letter, number = bytearray(len(text)), bytearray(len(text))
    for i, ch in enumerate(text):
        cp = ord(ch)
        cls = ("L" if ch.isalpha() else "N" if ch.isdigit() else "") if cp < 0x80 else char_class(cp)
        letter[i], number[i] = cls == "L", cls == "N"
    out: list[tuple[int, int]] = []
    for ini, end in spans:
        _kimi_k2_span(text, letter, number, ini, end, out)
    return out


def _kimi_k2_span(text: str, letter: bytearray, number: bytearray, ini: int, end: int,
                  out: list[tuple[int, int]]) -> None:
    # positions only grow from ini, so "inside the span" (unicode.cpp's _get_cpt/_get_flags range) is p < end
    def word_letter(p: int) -> bool:  # a letter that is not Han
        return p < end and bool(letter[p]) and not _is_han(ord(text[p]))

    def plain(p: int) -> bool:  # in the span, not whitespace, letter or number
        return p < end and not (ord(text[p]) in WHITESPACE or letter[p] or number[p])

    def newline(p: int) -> bool:
        return p < end and text[p] in "\r\n"

    prev = pos = ini

    def add(e: int) -> None:
        nonlocal prev
        if e > prev:
            out.append((prev, e))
        prev = e

    while pos < end:
        ch = text[pos]
        if _is_han(ord(ch)):  # [\p{Han}]+
            while pos < end and _is_han(ord(text[pos])):
                pos += 1
            add(pos)
            continue
        lead = not (ch in "\r\n" or letter[pos] or number[pos])
        if word_letter(pos) or (lead and word_letter(pos + 1)):
            # [^\r\n\p{L}\p{N}]? then letters without Han, then an optional 's 't 're 've 'm 'll 'd
            pos += lead
            while word_letter(pos):
                pos += 1
            if pos + 1 < end and text[pos] == "'":
                nxt = text[pos + 1].lower() if text[pos + 1].isascii() else ""
                if nxt in ("s", "t", "m", "d"):
                    pos += 2
                elif pos + 2 < end and nxt + (text[pos + 2].lower() if text[pos + 2].isascii() else "") \
                        in ("re", "ve", "ll"):
                    pos += 3
            add(pos)
            continue
        if number[pos]:  # \p{N}{1,3}
            start = pos
            while pos < end and number[pos]:
                pos += 1
                if pos - start >= 3:
                    add(pos)
                    start = pos
            add(pos)
            continue
        if plain(pos + (ch == " ")):  # " ?[^\s\p{L}\p{N}]+[\r\n]*"
            pos += ch == " "
            while plain(pos):
                pos += 1
            while newline(pos):
                pos += 1
            add(pos)
            continue
        n_space, last_rn = 0, 0
        while pos + n_space < end and ord(text[pos + n_space]) in WHITESPACE:
            if text[pos + n_space] in "\r\n":
                last_rn = pos + n_space + 1
            n_space += 1
        if last_rn:  # \s*[\r\n]+
            pos = last_rn
        elif n_space > 1 and pos + n_space < end:  # \s+(?!\S)
            pos += n_space - 1
        else:  # \s+, or no match: one code point
            pos += max(n_space, 1)
        add(pos)


def split(text: str, name: str | None) -> list[str]:
    """Split ``text`` into BPE words as llama.cpp does for ``tokenizer.ggml.pre == name``.

    Args:
        text: raw text (no special tokens; they are split out before pre-tokenization).
        name: the ``tokenizer.ggml.pre`` value (None or "" means ``default``, as in llama.cpp).

    Returns:
        The words, in order; they concatenate back to ``text``.

    Raises:
        TokenizerError: unknown or unsupported pre-tokenizer name.

    Example:
        >>> split("Hello  world 12345", "llama-bpe")
        ['Hello', ' ', ' world', ' ', '123', '45']
    """
    rule = get_pre_tokenizer(name)
    return [text[a:b] for a, b in split_spans(text, rule.regexes)]
