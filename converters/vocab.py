"""Vocabulary conversion: the ``tokenizer.*`` metadata of a GGUF file, from a Hugging Face checkpoint.

Three sources, as llama.cpp's converter reads them (convert_hf_to_gguf.py: TextModel._set_vocab_sentencepiece, _set_vocab_gpt2, _set_vocab_qwen):

- ``spm``: ``tokenizer.model`` through sentencepiece: pieces, scores and token types (byte pieces included),
  then ``added_tokens.json`` and ``tokenizer_config.json`` ``added_tokens_decoder`` on top.
- ``bpe``: a GPT-2-style byte-level BPE loaded with transformers' ``AutoTokenizer`` (never with
  ``trust_remote_code``), merges from ``tokenizer.json`` (or ``merges.txt``), pre-tokenizer from
  :mod:`ggufkit.converters.pretokenizer`.
- ``tiktoken``: Qwen 1's ``qwen.tiktoken`` or Kimi K2's ``tiktoken.model`` read directly (llama.cpp runs the
  repository's Python code for them: conversion/qwen.py QwenModel._set_vocab_qwen, conversion/deepseek.py
  DeepseekV2Model.set_vocab); merges are rebuilt from the ranks. A ``bpe`` checkpoint without
  ``tokenizer.json`` whose tokenizer is Kimi's ``tiktoken.model`` is read so too, as DeepseekV2Model.set_vocab
  falls back to it.

Then the special tokens (bos/eos/unk/sep/pad/mask/eot), ``add_bos_token``/``add_eos_token`` and the chat
template(s), and padding to the model's ``vocab_size`` with unique ``[PAD{i}]`` fillers. Keys come out in
llama.cpp's order.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as VT
from gguf import Keys, TokenType

from ggufkit.converters.pretokenizer import PreTokenizerMatch
from ggufkit.errors import TokenizerError
from ggufkit.format.values import Metadata
from ggufkit.tokenizer.bpe import SPM_SPACE, bytes_to_unicode, merge_symbols

K = Keys.Tokenizer

__all__ = ["QWEN1_SPECIALS", "VOCAB_KINDS", "build_vocab", "bytes_to_unicode", "looks_special", "read_tiktoken"]

VOCAB_KINDS = ("spm", "llama_hf", "bpe", "tiktoken")

#: The special-token roles SpecialVocab knows, in its order (gguf-py vocab.py). ``cls`` has no GGUF key.
_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_ID_KEYS = {"bos": K.BOS_ID, "eos": K.EOS_ID, "unk": K.UNK_ID, "sep": K.SEP_ID, "pad": K.PAD_ID,
            "mask": K.MASK_ID, "eot": K.EOT_ID, "eom": K.EOM_ID}
_ADD_KEYS = {"bos": K.ADD_BOS, "eos": K.ADD_EOS, "sep": K.ADD_SEP}

#: Score llama.cpp gives filler and added tokens in an SPM vocabulary.
_PAD_SCORE = -10000.0
_ADDED_SCORE = -1000.0

#: Qwen 1's special tokens (tokenization_qwen.py): they follow the mergeable ranks in this order.
QWEN1_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205)))

# Token texts llama.cpp's converter treats as control tokens even when not flagged special
# (TextModel.does_token_look_special).
_SPECIAL_LOOK = re.compile(r"^(<\|.*\|>|<｜.*｜>|<pad>|<mask>|<2mass>|\[@BOS@\]|<unused.*>)$", re.S)


def looks_special(token: str) -> bool:
    """True for ``<|...|>``, ``<｜...｜>``, ``<pad>``, ``<mask>``, ``<2mass>``, ``[@BOS@]``, ``<unused...>``."""
    return bool(_SPECIAL_LOOK.match(token))


@dataclass
class _Vocab:
    """The token table being built: one entry per id, ``vocab_size`` long."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    pre: str = "default"
    add_space_prefix: bool | None = None
    #: ids the model file itself declares, used for roles no tokenizer or config file names
    fallback_ids: dict[str, int] = field(default_factory=dict)
    #: whether the source tokenizer itself adds bos/eos (checked by encoding), for roles no file decides
    fallback_add: dict[str, bool] = field(default_factory=dict)
    #: how ``pre`` was chosen (BPE and tiktoken; None for sentencepiece, which has no pre-tokenizer)
    pre_match: PreTokenizerMatch | None = None


def build_vocab(model_dir: Path, kind: str, *, vocab_size: int, pre_tokenizer: str | None = None,
                special_by_flag: bool = False) -> Metadata:
    """The ``tokenizer.*`` KV pairs of a checkpoint's vocabulary, in llama.cpp's order.

    As :func:`build_vocab_and_pre`, without saying how the pre-tokenizer was chosen.
    """
    return build_vocab_and_pre(model_dir, kind, vocab_size=vocab_size, pre_tokenizer=pre_tokenizer,
                               special_by_flag=special_by_flag)[0]


def build_vocab_and_pre(model_dir: Path, kind: str, *, vocab_size: int, pre_tokenizer: str | None = None,
                        special_by_flag: bool = False) -> tuple[Metadata, PreTokenizerMatch | None]:
    """The ``tokenizer.*`` KV pairs of a checkpoint's vocabulary, in llama.cpp's order, and how
    ``tokenizer.ggml.pre`` was chosen.

    Args:
        model_dir: Hugging Face checkpoint directory (tokenizer files, optionally ``config.json``).
        kind: ``"spm"`` (``tokenizer.model``), ``"llama_hf"`` (a LLaMA byte-fallback ``tokenizer.json``
            written as llama.cpp's LlamaHfVocab does), ``"bpe"`` (``tokenizer.json``) or ``"tiktoken"``
            (``qwen.tiktoken``, Qwen 1).
        vocab_size: rows of the model's token embedding; the token list is padded to it with
            ``[PAD{i}]`` fillers (type UNUSED).
        pre_tokenizer: ``tokenizer.ggml.pre`` to write instead of detecting it (BPE and tiktoken only);
            must be a name llama.cpp knows.
        special_by_flag: SPM added tokens are CONTROL only when marked ``special`` (llama.cpp's Phi-3
            vocabulary, conversion/phi.py), not also when their text merely looks special.

    Returns:
        (Metadata holding only ``tokenizer.*`` keys: ``ggml.model``, ``ggml.pre``, ``ggml.tokens``,
        ``ggml.scores`` (SPM), ``ggml.token_type``, ``ggml.merges`` (BPE), special token ids,
        ``ggml.add_*_token`` flags and the chat template(s); the pre-tokenizer choice, None for SPM).

    Raises:
        TokenizerError: missing or malformed tokenizer files, more tokens than ``vocab_size``, duplicate
            token texts, or a pre-tokenizer that cannot be identified.
    """
    model_dir = Path(model_dir)
    if kind not in VOCAB_KINDS:
        raise TokenizerError(f"unknown vocabulary kind {kind!r}; expected one of {', '.join(VOCAB_KINDS)}")
    if vocab_size <= 0:
        raise TokenizerError(f"vocab_size must be positive, got {vocab_size}")
    if pre_tokenizer is not None and kind == "spm":
        raise TokenizerError("--pre-tokenizer applies to BPE vocabularies only; this checkpoint uses sentencepiece",
                             path=model_dir)
    config = _read_json(model_dir / "config.json") or {}
    added_json: list[dict[str, Any]] = []
    if kind == "spm":
        vocab = _spm_vocab(model_dir, vocab_size, special_by_flag)
    elif kind == "llama_hf":
        from ggufkit.converters.vocab_llama_hf import llama_hf_tokens

        tokens, scores, types = llama_hf_tokens(model_dir, vocab_size)
        vocab = _Vocab("llama", tokens, types, scores, pre="default")
    elif kind == "bpe" and not is_kimi_tiktoken(model_dir):
        vocab, added_json = _bpe_vocab(model_dir, vocab_size, pre_tokenizer)
    else:
        vocab = _tiktoken_vocab(model_dir, vocab_size, pre_tokenizer)
    _check_unique(vocab.tokens, model_dir)

    token_to_id = {t: i for i, t in enumerate(vocab.tokens)}
    kimi = kind in ("bpe", "tiktoken") and is_kimi_tiktoken(model_dir)
    # gguf-py's SpecialVocab resolves special-token names only through tokenizer.json, which Kimi has not: its
    # ids come from config.json alone (llama.cpp's Kimi path), so names are not looked up in the vocabulary
    special = _special_tokens(model_dir, config, added_json, token_to_id, len(vocab.tokens), names_in_vocab=not kimi)
    if kind == "tiktoken" and not kimi:
        # Qwen 1 declares no special tokens in files; llama.cpp's _set_vocab_qwen falls back to <|endoftext|>.
        eot = token_to_id[QWEN1_SPECIALS[0]]
        if "bos" not in special.ids and "eos" not in special.ids:
            special.ids["bos"] = special.ids["eos"] = eot
        special.ids.setdefault("unk", eot)
    for role, tid in vocab.fallback_ids.items():
        if 0 <= tid < len(vocab.tokens):
            special.ids.setdefault(role, tid)
    if kind not in ("spm", "llama_hf") and "bos" not in special.ids and "eos" in special.ids:
        # with no bos id in the file llama.cpp's BPE falls back to id 11, an ordinary token; Qwen-style
        # vocabularies without a bos use their end-of-text token in both roles (as llama.cpp's qwen2 files do)
        special.ids["bos"] = special.ids["eos"]
    if kind == "bpe":
        # llama.cpp's default add_bos depends on the pre-tokenizer (true for llama3-like names); state what
        # the source tokenizer does whenever no file decided it, so the runtime cannot differ from it
        probe = vocab.fallback_add
        for role in ("bos", "eos"):
            if role not in special.add and role in special.ids and role in probe:
                special.add[role] = probe[role]

    md = Metadata()
    md.set(K.MODEL, VT.STRING, vocab.model)
    md.set(K.PRE, VT.STRING, vocab.pre)
    md.set(K.LIST, VT.ARRAY, vocab.tokens, VT.STRING)
    if vocab.scores is not None:
        md.set(K.SCORES, VT.ARRAY, vocab.scores, VT.FLOAT32)
    md.set(K.TOKEN_TYPE, VT.ARRAY, vocab.types, VT.INT32)
    if vocab.add_space_prefix is not None:
        md.set(K.ADD_PREFIX, VT.BOOL, vocab.add_space_prefix)
    if vocab.merges:
        md.set(K.MERGES, VT.ARRAY, vocab.merges, VT.STRING)
    for role, key in _ID_KEYS.items():  # a fixed role order, whichever file named the id
        if role in special.ids:
            md.set(key, VT.UINT32, special.ids[role])
    for role, flag in special.add.items():
        if role in _ADD_KEYS:
            md.set(_ADD_KEYS[role], VT.BOOL, flag)
    _add_chat_templates(md, special.chat_template, model_dir)
    return md, vocab.pre_match


# --- file helpers ---------------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    """The parsed JSON file, or None if absent. Callers must not modify the result (it is cached)."""
    if not path.is_file():
        return None
    st = path.stat()
    data = _parse_json(str(path), st.st_mtime_ns, st.st_size)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object", path=path)
    return data


@lru_cache(maxsize=4)
def _parse_json(path: str, mtime_ns: int, size: int) -> Any:
    # tokenizer.json of a 150k vocabulary takes ~0.5 s to parse and several readers need it
    del mtime_ns, size  # part of the cache key only
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {Path(path).name}: {exc}", path=path) from None


def _check_unique(tokens: Sequence[str], model_dir: Path) -> None:
    # llama.cpp asserts id_to_token.size() == token_to_id.size() at load: a duplicate text is a broken file.
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in seen:
            raise TokenizerError(f"token text {t!r} appears twice (ids {seen[t]} and {i}); llama.cpp "
                                 "requires unique token texts", path=model_dir)
        seen[t] = i


def _check_fits(n_tokens: int, vocab_size: int, source: Path) -> None:
    if n_tokens > vocab_size:
        raise TokenizerError(f"the tokenizer has {n_tokens} tokens but the model's vocab_size is {vocab_size}; "
                             "the embedding cannot represent them", path=source)


# --- SPM ----------------------------------------------------------------------------------------

def _spm_vocab(model_dir: Path, vocab_size: int, special_by_flag: bool = False) -> _Vocab:
    import sentencepiece

    path = model_dir / "tokenizer.model"
    if not path.is_file():
        raise TokenizerError("tokenizer.model not found (a sentencepiece vocabulary needs it)", path=model_dir)
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(path.read_bytes())
    except (RuntimeError, OSError) as exc:
        raise TokenizerError(f"not a sentencepiece model: {exc}", path=path) from None
    n = sp.vocab_size()
    _check_fits(n, vocab_size, path)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [_PAD_SCORE] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    for i in range(n):
        tokens[i] = sp.IdToPiece(i)
        scores[i] = float(sp.GetScore(i))
        if sp.IsUnknown(i):
            types[i] = TokenType.UNKNOWN
        elif sp.IsControl(i):
            types[i] = TokenType.CONTROL
        elif sp.IsUnused(i):
            types[i] = TokenType.UNUSED
        elif sp.IsByte(i):
            types[i] = TokenType.BYTE
        else:
            types[i] = TokenType.NORMAL

    added = _read_json(model_dir / "added_tokens.json") or {}
    if not isinstance(added, dict):
        raise TokenizerError("added_tokens.json must map token text to id", path=model_dir / "added_tokens.json")
    # Added tokens past the embedding are left out, as llama.cpp does: the model cannot emit or embed them
    # (typically a pad token appended to the tokenizer but not to the model).
    for text, tid in added.items():
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            raise TokenizerError(f"token {text!r} has invalid id {tid!r}", path=model_dir / "added_tokens.json")
        if tid < vocab_size:
            tokens[tid], scores[tid], types[tid] = text, _ADDED_SCORE, TokenType.USER_DEFINED

    config = _read_json(model_dir / "tokenizer_config.json") or {}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError("added_tokens_decoder must map ids to tokens", path=model_dir / "tokenizer_config.json")
    for key, entry in decoder.items():
        text = entry.get("content") if isinstance(entry, dict) else None
        if not str(key).isdigit() or not isinstance(text, str):
            raise TokenizerError(f"added_tokens_decoder entry {key!r} is malformed",
                                 path=model_dir / "tokenizer_config.json")
        tid = int(key)
        if tid >= vocab_size:
            continue
        if entry.get("special") or (not special_by_flag and looks_special(text)):
            types[tid] = TokenType.CONTROL
        else:
            # a user-defined token is matched in raw text, where spaces are still spaces
            text = text.replace(SPM_SPACE, " ")
            types[tid] = TokenType.USER_DEFINED
        tokens[tid], scores[tid] = text, _ADDED_SCORE

    # llama.cpp's SPM tokenizer prepends a space unless told otherwise; sentencepiece models trained with
    # add_dummy_prefix=false would then tokenize differently, so say so explicitly (llama.cpp omits this).
    add_space_prefix: bool | None = None
    if isinstance(config.get("add_prefix_space"), bool):
        add_space_prefix = config["add_prefix_space"]
    elif n and not sp.EncodeAsPieces("a")[0].startswith(SPM_SPACE):
        add_space_prefix = False
    # sentencepiece's own bos/eos/unk/pad ids, so that the ids are always explicit in the file
    fallback = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    return _Vocab("llama", tokens, [int(t) for t in types], scores, pre="default",
                  add_space_prefix=add_space_prefix, fallback_ids=fallback)


# --- BPE ----------------------------------------------------------------------------------------

def _load_hf_tokenizer(model_dir: Path) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as exc:  # transformers raises many unrelated types for unreadable tokenizers
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        tokenizer = _load_named_fast_tokenizer(model_dir)
        if tokenizer is None:
            raise TokenizerError(f"transformers cannot load the tokenizer: {first}", path=model_dir) from None
        return tokenizer


def _load_named_fast_tokenizer(model_dir: Path) -> Any:
    """The fast tokenizer class tokenizer_config.json names (a transformers class, never the checkpoint's code),
    loaded without config.json; None if that fails too. AutoTokenizer also reads config.json, which
    transformers 5's strict configs refuse for some released spellings (Llama 4's ``"attn_temperature_tuning":
    4`` where Llama4TextConfig wants a bool), though the tokenizer files are fine."""
    import transformers

    name = (_read_json(model_dir / "tokenizer_config.json") or {}).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.endswith("Fast") else None
    if cls is None or not (model_dir / "tokenizer.json").is_file():
        return None
    try:
        return cls.from_pretrained(str(model_dir))
    except Exception:  # the first error is the one reported
        return None


def _bpe_merges(model_dir: Path) -> list[str]:
    tok_json = _read_json(model_dir / "tokenizer.json")
    merges = ((tok_json or {}).get("model") or {}).get("merges")
    if merges:
        if all(isinstance(m, str) for m in merges):
            return list(merges)
        if not all(isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and isinstance(m[1], str)
                   for m in merges):
            raise TokenizerError("unknown merges format in tokenizer.json (expected 'a b' strings or [a, b] pairs)",
                                 path=model_dir)
        # transformers >= 4.45 stores pairs so parts may hold spaces; llama.cpp splits a merge at its first
        # space, so a literal space is spelt as its byte-level character (U+0120), as gguf-py does.
        return [f"{a.replace(' ', chr(0x120))} {b.replace(' ', chr(0x120))}" for a, b in merges]
    merges_txt = model_dir / "merges.txt"
    if merges_txt.is_file():
        out = []
        for line in merges_txt.read_text(encoding="utf-8").splitlines():
            parts = line.strip().split()
            if line.startswith("#version") or len(parts) != 2:
                continue
            out.append(f"{parts[0]} {parts[1]}")
        return out
    raise TokenizerError("a BPE vocabulary needs merges (tokenizer.json model.merges or merges.txt); none found",
                         path=model_dir)


def _bpe_vocab(model_dir: Path, vocab_size: int, pre_tokenizer: str | None) -> tuple[_Vocab, list[dict[str, Any]]]:
    from ggufkit.converters.pretokenizer import detect_pre_tokenizer

    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "vocab.json").is_file():
        raise TokenizerError("tokenizer.json not found (a BPE vocabulary needs it)", path=model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _read_json(model_dir / name)  # a malformed file is named here rather than by transformers
    model = ((_read_json(model_dir / "tokenizer.json") or {}).get("model") or {})
    if model.get("byte_fallback"):
        # a Llama-2-style HF tokenizer (sentencepiece BPE in tokenizer.json): byte-level rules would be wrong
        raise TokenizerError("tokenizer.json holds a sentencepiece-style BPE (byte_fallback) and no tokenizer.model "
                             "is present; add the checkpoint's tokenizer.model to convert its vocabulary",
                             path=model_dir)
    hf = _load_hf_tokenizer(model_dir)
    vocab_map: dict[str, int] = hf.get_vocab()
    if vocab_map and max(vocab_map.values()) >= vocab_size:
        raise TokenizerError(f"the tokenizer has ids up to {max(vocab_map.values())} but the model's vocab_size "
                             f"is {vocab_size}; the embedding cannot represent them", path=model_dir)
    by_id = {i: t for t, i in vocab_map.items()}
    added_vocab = hf.get_added_vocab()
    added_decoder = hf.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        text = by_id[i]
        if text in added_vocab:
            info = added_decoder.get(i)
            if info is not None and not info.normalized:
                # what the runtime matches in raw text is the decoded form (llama.cpp get_vocab_base)
                text = hf.decode(hf.encode(text, add_special_tokens=False))
            if (info is not None and info.special) or looks_special(text):
                types.append(TokenType.CONTROL)
            else:
                text = text.replace(SPM_SPACE, " ")
                types.append(TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
        tokens.append(text)
    merges = _bpe_merges(model_dir)
    match = detect_pre_tokenizer(hf, tokens=tokens, token_types=types, merges=merges, override=pre_tokenizer,
                                 model_dir=model_dir)
    added_json = (_read_json(model_dir / "tokenizer.json") or {}).get("added_tokens") or []
    plain = list(hf.encode("a", add_special_tokens=False))
    full = list(hf.encode("a"))
    probe = {"bos": len(full) > len(plain) and full[:1] != plain[:1],
             "eos": len(full) > len(plain) and full[-1:] != plain[-1:]}
    return _Vocab("gpt2", tokens, [int(t) for t in types], merges=merges, pre=match.name,
                  fallback_add=probe, pre_match=match), added_json


# --- tiktoken (Qwen 1) ----------------------------------------------------------------------------

def read_tiktoken(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file: ``base64(token bytes) rank`` per line.

    Raises:
        TokenizerError: a malformed line, a duplicate token or rank, or ranks that are not 0..n-1.
    """
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"cannot read: {exc}", path=path) from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64 rank'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"line {lineno}: {exc}", path=path) from None
        if token in ranks:
            raise TokenizerError(f"line {lineno}: token {token!r} listed twice", path=path)
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError("ranks must be 0..n-1, each once", path=path)
    return ranks


def _bpe_split(ranks: Mapping[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE over ``token``'s bytes using only ranks below ``max_rank``."""
    def priority(left: bytes, right: bytes) -> int | None:
        r = ranks.get(left + right)
        return r if r is not None and r < max_rank else None

    return merge_symbols([token[i:i + 1] for i in range(len(token))], priority)


#: Kimi K2's tiktoken ranks file (tokenization_kimi.py TikTokenTokenizer's vocab_file) and pre-tokenizer name
#: (llama.cpp's hash table names Kimi-K2-Base's tokenizer ``kimi-k2``; src/unicode.cpp runs its regex).
KIMI_TIKTOKEN = "tiktoken.model"
KIMI_PRE = "kimi-k2"
#: tokenization_kimi.py: ``num_reserved_special_tokens`` ids follow the ranks, named by tokenizer_config.json's
#: ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``.
KIMI_RESERVED = 256


def is_kimi_tiktoken(model_dir: Path) -> bool:
    """A Kimi-style tiktoken tokenizer: ``tiktoken.model`` and no ``tokenizer.json`` / ``qwen.tiktoken``."""
    return (model_dir / KIMI_TIKTOKEN).is_file() and not (model_dir / "tokenizer.json").is_file() \
        and not (model_dir / "vocab.json").is_file() and not (model_dir / "qwen.tiktoken").is_file()


def _kimi_vocab(path: Path, vocab_size: int, pre_tokenizer: str | None) -> _Vocab:
    """Kimi K2's vocabulary as conversion/deepseek.py DeepseekV2Model.set_vocab (tokpre ``kimi-k2``) builds it
    from the tokenizer its tokenization_kimi.py makes, without running that code: every rank's token
    (GPT-2 byte-level spelling), a merge for each token whose BPE over lower ranks ends in two parts (others
    give none), the reserved special tokens after the ranks (names from ``added_tokens_decoder``) as
    CONTROL, ``[PAD{i}]`` fillers (UNUSED) up to ``vocab_size``."""
    from ggufkit.converters.pretokenizer import known_pre_tokenizer

    ranks = read_tiktoken(path)
    n = len(ranks)
    _check_fits(n, vocab_size, path)
    byte_chars = bytes_to_unicode()
    decoder = (_read_json(path.parent / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError("added_tokens_decoder must map ids to tokens", path=path.parent / "tokenizer_config.json")
    names: dict[int, str] = {}
    for key, entry in decoder.items():
        text = entry.get("content") if isinstance(entry, dict) else entry
        if not str(key).isdigit() or not isinstance(text, str):
            raise TokenizerError(f"added_tokens_decoder entry {key!r} is malformed",
                                 path=path.parent / "tokenizer_config.json")
        names[int(key)] = text
    special = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_RESERVED)}
    merges: list[str] = []
    vocab: dict[str, int] = {}
    for token, rank in ranks.items():  # the file's order, as tiktoken's load_tiktoken_bpe keeps it
        vocab["".join(byte_chars[b] for b in token)] = rank
        if len(token) == 1:
            continue
        parts = _bpe_split(ranks, token, rank)
        if len(parts) == 2:
            merges.append(" ".join("".join(byte_chars[b] for b in p) for p in parts))
    by_id = {i: text for text, i in {**vocab, **special}.items()}
    control = set(special.values())
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [int(TokenType.UNUSED if i not in by_id else TokenType.CONTROL if i in control else TokenType.NORMAL)
             for i in range(vocab_size)]
    if pre_tokenizer is not None:
        match = PreTokenizerMatch(known_pre_tokenizer(pre_tokenizer), "override", "")
    else:
        match = PreTokenizerMatch(KIMI_PRE, "architecture", "",
                                  note="Kimi K2's tiktoken tokenizer (tokenization_kimi.py's pat_str is kimi-k2's)")
    return _Vocab("gpt2", tokens, types, merges=merges, pre=match.name, pre_match=match)


def _tiktoken_vocab(model_dir: Path, vocab_size: int, pre_tokenizer: str | None) -> _Vocab:
    from ggufkit.converters.pretokenizer import known_pre_tokenizer

    if is_kimi_tiktoken(model_dir):
        return _kimi_vocab(model_dir / KIMI_TIKTOKEN, vocab_size, pre_tokenizer)
    path = model_dir / "qwen.tiktoken"
    if not path.is_file():
        others = sorted(model_dir.glob("*.tiktoken"))
        if len(others) != 1:
            raise TokenizerError("qwen.tiktoken not found (Qwen 1's vocabulary)", path=model_dir)
        path = others[0]
    ranks = read_tiktoken(path)
    n = len(ranks)
    if n + 3 > vocab_size:
        raise TokenizerError(f"qwen.tiktoken has {n} tokens plus 3 special ones, but the model's vocab_size is "
                             f"{vocab_size}", path=path)
    byte_chars = bytes_to_unicode()
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(TokenType.UNUSED)] * vocab_size
    merges: list[str] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        tokens[rank] = "".join(byte_chars[b] for b in token)
        types[rank] = int(TokenType.NORMAL)
        if len(token) == 1:
            continue
        parts = _bpe_split(ranks, token, rank)
        if len(parts) != 2:
            raise TokenizerError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens",
                                 path=path)
        merges.append(" ".join("".join(byte_chars[b] for b in p) for p in parts))
    # Qwen 1's specials follow the ranks; those past the embedding (tiny test models) are left out.
    for i, text in enumerate(QWEN1_SPECIALS[:vocab_size - n]):
        tokens[n + i], types[n + i] = text, int(TokenType.CONTROL)
    # Qwen 1's PAT_STR (tokenization_qwen.py) is the Qwen2 regex, and its ids match Qwen1.5's vocabulary,
    # which llama.cpp's table names qwen2 (convert_hf_to_gguf.py: get_vocab_base_pre).
    if pre_tokenizer is not None:
        match = PreTokenizerMatch(known_pre_tokenizer(pre_tokenizer), "override", "")
    else:
        match = PreTokenizerMatch("qwen2", "architecture", "", note="Qwen 1's tiktoken regex is qwen2's")
    return _Vocab("gpt2", tokens, types, merges=merges, pre=match.name, pre_match=match)


# --- special tokens, add_*_token, chat template (gguf-py SpecialVocab semantics) ------------------

@dataclass
class _Special:
    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list[dict[str, Any]] | None = None


def _token_name(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return str(entry["content"])
    return None


def _pair_adds_sep(pair: Any, first: str | None, last: str | None, sep: str | None,
                   eos: str | None) -> bool | None:
    """add_sep from a TemplateProcessing ``pair`` template ``[first] A <middle> B [last]``, as gguf-py's
    SpecialVocab._try_load_from_tokenizer_json reads it: None when the template says nothing."""
    if not isinstance(pair, list) or not pair or not all(isinstance(p, dict) for p in pair):
        return None

    def special(item: dict[str, Any]) -> Any:
        return (item.get("SpecialToken") or {}).get("id")

    start = 1 if first and special(pair[0]) == first else 0
    stop = -1 if last and special(pair[-1]) == last else None
    body = pair[start:stop]
    if not body or (body[0].get("Sequence") or {}).get("id") != "A" or \
            (body[-1].get("Sequence") or {}).get("id") != "B" or not body[1:-1]:
        return None
    middle = body[1:-1]
    add = special(middle[0]) in (sep, eos) and special(middle[0]) is not None and not last
    if len(middle) == 2 and special(middle[1]) is not None and special(middle[1]) in (sep, eos):
        add = True
    return add


def _special_tokens(model_dir: Path, config: Mapping[str, Any], added_json: list[dict[str, Any]],
                    token_to_id: Mapping[str, int], n_vocab: int, names_in_vocab: bool = True) -> _Special:
    """Special ids (first source wins), add_* flags and chat template, as gguf-py's SpecialVocab."""
    result = _Special()
    tok_cfg = _read_json(model_dir / "tokenizer_config.json") or {}
    tok_json = _read_json(model_dir / "tokenizer.json") or {}
    names = {t: _token_name(tok_cfg.get(f"{t}_token")) for t in _SPECIAL_TYPES}
    if not names["bos"] and names["cls"]:
        names["bos"] = names["cls"]
    if not names["eos"] and names["sep"]:
        names["eos"] = names["sep"]
    roles = list(_SPECIAL_TYPES)

    post = tok_json.get("post_processor") or {}
    procs = (post.get("processors", [post]) if isinstance(post, dict) else None) or []
    for proc in procs:
        if not isinstance(proc, dict):
            continue
        kind = proc.get("type")
        if kind == "ByteLevel":
            result.add.setdefault("bos", False)
            result.add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            result.add.update(bos=True, eos=True, sep=True)
        elif kind == "TemplateProcessing":
            single = [p for p in proc.get("single") or [] if isinstance(p, dict)]
            if len(single) > 1:
                first = (single[0].get("SpecialToken") or {}).get("id")
                last = (single[-1].get("SpecialToken") or {}).get("id")
                if first:
                    names["bos"] = names["bos"] or first
                    result.add["bos"] = first in (names["bos"], names["cls"])
                if last:
                    if names["eos"] and last != names["eos"]:
                        # a template that ends in another token: that one is the real eos, the configured
                        # eos becomes end-of-turn (Llama 3 instruct style)
                        roles.append("eot" if "eot" not in roles else "eom")
                        names[roles[-1]] = names["eos"]
                    names["eos"] = last
                    result.add["eos"] = True
            else:
                first = last = None
            sep = _pair_adds_sep(proc.get("pair"), first, last, names["sep"], names["eos"])
            if sep is not None:
                result.add["sep"] = sep

    for role in _SPECIAL_TYPES:
        flag = tok_cfg.get(f"add_{role}_token")
        if isinstance(flag, bool):
            result.add.setdefault(role, flag)

    added_ids = {a.get("content"): a.get("id") for a in reversed(added_json) if isinstance(a, dict)}

    def put(role: str, tid: Any) -> None:
        if isinstance(tid, bool) or not isinstance(tid, int) or role in result.ids:
            return
        if tid < 0:
            raise TokenizerError(f"invalid {role} token id {tid}", path=model_dir)
        if tid < n_vocab:
            result.ids[role] = tid

    for role in roles:
        name = names.get(role)
        if name is None:
            continue
        # llama.cpp resolves names only through tokenizer.json's added tokens; sentencepiece-only checkpoints
        # then rely on the runtime's defaults, so also look the name up in the vocabulary itself.
        put(role, added_ids.get(name, token_to_id.get(name) if names_in_vocab else None))
    text_config: Mapping[str, Any] = config.get("text_config") or {}
    if not isinstance(text_config, Mapping):
        text_config = {}
    for role in roles:
        tid = config.get(f"{role}_token_id")
        put(role, tid if tid is not None else text_config.get(f"{role}_token_id"))

    template = tok_cfg.get("chat_template")
    if template is None:
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
            extra = sorted((model_dir / "additional_chat_templates").glob("*.jinja"))
            if extra:
                template = [{"name": "default", "template": template}] + [
                    {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
        else:
            template = (_read_json(model_dir / "chat_template.json") or {}).get("chat_template")
    if template is not None and not isinstance(template, (str, list)):
        raise TokenizerError(f"chat_template must be a string or a list, got {type(template).__name__}",
                             path=model_dir / "tokenizer_config.json")
    result.chat_template = template
    return result


def _add_chat_templates(md: Metadata, template: str | list[dict[str, Any]] | None, model_dir: Path) -> None:
    """``tokenizer.chat_template`` (+ named ``tokenizer.chat_template.<name>`` and ``tokenizer.chat_templates``)."""
    if template is None:
        return
    if isinstance(template, str):
        md.set(K.CHAT_TEMPLATE, VT.STRING, template)
        return
    allowed = set(string.ascii_letters + string.digits)
    default: str | None = None
    named: dict[str, str] = {}
    for choice in template:
        if not isinstance(choice, dict) or not isinstance(choice.get("template"), str):
            raise TokenizerError("each chat template must be {name, template}", path=model_dir)
        name = "".join(c if c in allowed else "_" for c in str(choice.get("name", "")))
        if name == "default":
            default = choice["template"]
        elif name:
            named[name] = choice["template"]
    for name in sorted(named):
        md.set(K.CHAT_TEMPLATE_N.format(name=name), VT.STRING, named[name])
    if named:
        # gguf-py collects the names in a set (unordered); sorted keeps our output deterministic
        md.set(K.CHAT_TEMPLATES, VT.ARRAY, sorted(named), VT.STRING)
    if default is not None:
        md.set(K.CHAT_TEMPLATE, VT.STRING, default)
