"""The tokenizer of a GGUF file, rebuilt from ``tokenizer.ggml.*`` to give llama.cpp's token ids exactly.

llama-perplexity scores the ids that llama.cpp's own tokenizer produces, so ours must agree token for token,
including llama.cpp's departures from Hugging Face (src/llama-vocab.cpp). The rules mirrored here are
those of ``src/llama-vocab.cpp`` in the llama.cpp tree vendored by llama-cpp-python 0.3.36:

* Vocabulary loading (``llama_vocab::impl::load``): defaults per ``tokenizer.ggml.model`` and
  ``tokenizer.ggml.pre``, the GGUF overrides, special ids, and the name-based attribute fix-ups (EOG and
  FIM tokens forced to CONTROL, phi-3's RSTRIP, ...), which decide what is split out as a special token.
* Special-token partition (``tokenizer_st_partition``): CONTROL/USER_DEFINED/UNKNOWN tokens, longest first;
  without ``parse_special`` only USER_DEFINED ones are matched in the text.
* SPM (``llm_tokenizer_spm_session``): one space prefixed, spaces -> U+2581, greedy merging of the adjacent
  pair whose concatenation is the highest-scoring token, ``<0xNN>`` byte fallback.
* BPE (``llm_tokenizer_bpe_session``): :class:`ggufkit.tokenizer.bpe_session.BpeSession`, the driver the
  converter's pre-tokenizer check shares. Gemma 4 (``tokenizer.ggml.model = gemma4``) is BPE over raw UTF-8
  with spaces escaped as U+2581 and ``<0xNN>`` byte tokens for unknown symbols.

What the ``tokenizers`` library (which merges BPE words where it can) cannot express is custom code: the
pre-tokenizer (llama.cpp's character classes and hand-written matchers differ from any regex engine's), the
special-token partition, and SPM (llama.cpp merges any adjacent pair that forms a token, by score, ties to
the left; HF's BPE needs an explicit merge list and breaks ties by rank). Each distinct word (BPE) or
space-delimited piece (SPM) is merged once and cached: 1 MB of text takes about a second.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ggufkit.errors import TokenizerError, UsageError
from ggufkit.tokenizer.bpe import SPM_SPACE, merge_ranks, merge_symbols, unicode_to_bytes
from ggufkit.tokenizer.bpe_session import BpeSession
from ggufkit.tokenizer.pretokenizers import PreTokenizer, get_pre_tokenizer

# llama_token_attr bits (include/llama.h).
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
#: tokenizer.ggml.token_type value (gguf TokenType) -> attribute; anything else is "undefined" (0).
_TYPE_TO_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED,
                 6: ATTR_BYTE}

#: C isspace() in the C locale: what LSTRIP/RSTRIP trim next to a special token.
_C_SPACE = " \t\n\v\f\r"

# Special tokens llama.cpp recognises by their text when the GGUF does not name them
# (llama_vocab::impl::load, "auto-detect special tokens by text"). A token found this way becomes CONTROL.
_EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_FIM_NAMES = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_NAMES = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["))
#: gpt-oss: always rendered, so llama.cpp makes them USER_DEFINED (which also makes them split out).
_GPT_OSS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

#: Special-id keys in the order llama.cpp reads them; the deprecated FIM keys come last and win.
_SPECIAL_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
                 ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
                 ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
                 ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"),
                 ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
                 ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))


_BYTE_DEC = unicode_to_bytes()


class _MetadataSource(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...


@dataclass
class _Vocab:
    """The vocabulary as llama.cpp holds it after ``load``."""

    tokens: list[str]
    scores: list[float]
    attrs: list[int]
    token_to_id: dict[str, int]
    special: dict[str, int | None] = field(default_factory=dict)


class GGUFTokenizer:
    """llama.cpp's tokenizer for one GGUF vocabulary (``tokenizer.ggml.model`` ``llama``, ``gpt2``, ``gemma4``).

    Build it with :func:`load_tokenizer`. Attributes:
        model: ``llama`` (SPM), ``gpt2`` or ``gemma4`` (BPE).
        pre: the ``tokenizer.ggml.pre`` value in effect (BPE), ``None`` for SPM.
        n_vocab: number of tokens.
        bos_id / eos_id: special ids (None when the vocabulary has none).
        add_bos / add_eos: whether ``encode(..., add_special=True)`` adds them.
        add_space_prefix: SPM's leading space (``tokenizer.ggml.add_space_prefix``).
    """

    def __init__(self, metadata: _MetadataSource, *, engine: str = "auto") -> None:
        if engine not in ("auto", "tokenizers", "python"):
            raise UsageError(f"engine must be 'auto', 'tokenizers' or 'python', not {engine!r}")
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the file has no vocabulary (tokenizer.ggml.model is missing)")
        if model not in ("llama", "gpt2", "gemma4"):
            raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported (supported: 'llama' SPM, "
                                 "'gpt2' and 'gemma4' BPE)")
        self.model: str = model
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("tokenizer.ggml.tokens is missing or not a non-empty array of strings")
        n = len(tokens)
        self.n_vocab: int = n

        self.pre: str | None = None
        self.pre_kind: str | None = None
        self.ignore_merges = False
        self.add_space_prefix = model == "llama"
        self.add_bos = model == "llama"
        self.add_eos = False
        self.clean_spaces = model != "llama"
        self.byte_level = True
        self.escape_whitespaces = False
        rule: PreTokenizer | None = None
        ranks: dict[tuple[str, str], int] = {}
        special: dict[str, int | None] = dict.fromkeys(k for k, _ in _SPECIAL_KEYS)
        if model == "llama":  # llama.cpp's default ids before the file's
            special.update(bos=1, eos=2, unk=0)
        elif model == "gpt2":
            special.update(bos=11, eos=11)
        if model != "llama":
            # a "gemma4" tokenizer model always uses the gemma4 pre-tokenizer, whatever the file says
            pre = "gemma4" if model == "gemma4" else metadata.get("tokenizer.ggml.pre") or "default"
            rule = get_pre_tokenizer(pre)
            self.pre = pre
            self.pre_kind = rule.kind
            self.byte_level = rule.byte_level
            self.escape_whitespaces = not rule.byte_level
            self.ignore_merges = rule.ignore_merges
            self.add_bos = rule.add_bos
            self.clean_spaces = pre not in _NO_CLEAN_SPACES
            if rule.no_bos:
                special["bos"] = None
            ranks = _parse_merges(metadata.get("tokenizer.ggml.merges"))
        flag = metadata.get("tokenizer.ggml.add_space_prefix")
        if flag is not None:
            self.add_space_prefix = bool(flag)

        scores = _int_or_float_array(metadata.get("tokenizer.ggml.scores"), n, "tokenizer.ggml.scores")
        types = _int_or_float_array(metadata.get("tokenizer.ggml.token_type"), n, "tokenizer.ggml.token_type")
        token_to_id: dict[str, int] = {}
        words = list(tokens)
        for i, word in enumerate(words):
            if word == "":  # llama.cpp renames empty tokens so that they can never match
                words[i] = word = f"[EMPTY_{i}]"
            token_to_id[word] = i  # a later duplicate wins, as in llama.cpp's token_to_id[word] = i
        attrs = [ATTR_NORMAL] * n if types is None else [_TYPE_TO_ATTR.get(int(t), 0) for t in types]
        self._vocab = _Vocab(words, [0.0] * n if scores is None else [float(s) for s in scores], attrs,
                             token_to_id, special)
        self._load_special_ids(metadata)
        self._fix_attributes(metadata)
        self._special_tokens = sorted(
            (i for i in range(n) if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)),
            key=lambda i: -len(words[i].encode("utf-8")))  # stable: equal lengths stay in id order
        self._cache: dict[str, tuple[int, ...]] = {}
        # SPM has no merges; every other model is BPE, run by the driver the converter shares
        self._bpe = None if rule is None else BpeSession(token_to_id, ranks, rule, engine=engine)
        self._spm_splittable = model == "llama" and not any(
            SPM_SPACE in w.lstrip(SPM_SPACE) for w in words)

    # -- loading ---------------------------------------------------------------------------------------
    def _load_special_ids(self, metadata: _MetadataSource) -> None:
        special, n = self._vocab.special, self.n_vocab
        for name, value in list(special.items()):
            if value is not None and value >= n:  # a default outside the vocabulary is disabled
                special[name] = None
        for name, key in _SPECIAL_KEYS:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TokenizerError(f"tokenizer.ggml.{key} = {value!r} is not a token id")
            if value < n:  # llama.cpp ignores an out-of-range id and keeps the default
                special[name] = value
        for key, attr_name in (("tokenizer.ggml.add_bos_token", "add_bos"),
                               ("tokenizer.ggml.add_eos_token", "add_eos")):
            value = metadata.get(key)
            if value is not None:
                setattr(self, attr_name, bool(value))
        if self.pre_kind == "gemma4":
            self.add_bos = True  # llama.cpp forces BOS for Gemma 4 (PR 21500)
        if self.add_bos and special["bos"] is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if self.add_eos and special["eos"] is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    def _fix_attributes(self, metadata: _MetadataSource) -> None:
        v = self._vocab
        attrs, special, t2i = v.attrs, v.special, v.token_to_id
        # EOT, EOM and FIM tokens found by name (when no id was given) are forced to CONTROL. llama.cpp walks
        # an unordered_map, so with several candidates its pick is unspecified; we take the lowest id.
        for name, candidates in (("eot", _EOT_NAMES), ("eom", ("<|eom_id|>",)), *_FIM_NAMES.items()):
            if special[name] is None:
                found = sorted(t2i[c] for c in candidates if c in t2i)
                if found:
                    special[name] = found[0]
                    attrs[found[0]] |= ATTR_CONTROL
        eog: set[int] = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}  # type: ignore[misc]
        for text, i in t2i.items():
            if text in _EOG_NAMES:
                eog.add(i)
                attrs[i] |= ATTR_CONTROL
        for text in _GPT_OSS_USER_DEFINED:
            if text in t2i:
                attrs[t2i[text]] = ATTR_USER_DEFINED
        for k in ("eos", "eot", "eom"):
            if special[k] is not None:
                eog.add(special[k])  # type: ignore[arg-type]
        texts = {v.tokens[i] for i in eog if 0 <= i < self.n_vocab}
        if {"<|return|>", "<|call|>", "<|end|>"} <= texts or {"<|calls|>", "<|flush|>", "<|end|>"} <= texts:
            end = next(i for i in eog if v.tokens[i] == "<|end|>")
            attrs[end] = ATTR_USER_DEFINED  # o200k_harmony / solar-open: <|end|> is not EOG
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            attrs[next(i for i in eog if v.tokens[i] == "</s>")] = ATTR_NORMAL  # gemma4, plamo: </s> is normal
        self.eog_ids = frozenset(eog)
        # Per-model strip attributes, set after the special-token cache is built (so they only add flags).
        pre = str(metadata.get("tokenizer.ggml.pre") or "")
        arch = str(metadata.get("general.architecture") or "")
        model_name = str(metadata.get("general.name") or "").lower()
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in t2i:
                attrs[t2i["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in model_name or "phi3" in model_name:
            for i in range(self.n_vocab):
                if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                    attrs[i] |= ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text not in t2i:
                    raise TokenizerError(f"phi-3 vocabulary without the token {text!r} (llama.cpp rejects it)")
                attrs[t2i[text]] = attrs[t2i[text]] | ATTR_RSTRIP if on else attrs[t2i[text]] & ~ATTR_RSTRIP
        elif "modern-bert" in model_name and "[MASK]" in t2i:
            attrs[t2i["[MASK]"]] |= ATTR_LSTRIP

    # -- public API --------------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int | None:
        """BOS id (``tokenizer.ggml.bos_token_id`` or llama.cpp's default), None when there is none."""
        return self._vocab.special["bos"]

    @property
    def eos_id(self) -> int | None:
        """EOS id (``tokenizer.ggml.eos_token_id`` or llama.cpp's default), None when there is none."""
        return self._vocab.special["eos"]

    @property
    def merge_engine(self) -> str:
        """What merges words: ``tokenizers`` or ``python`` (BPE), ``spm`` (SentencePiece, always ggufkit's)."""
        if self._bpe is None:
            return "spm"
        return self._bpe.merge_engine

    @property
    def tokens(self) -> Sequence[str]:
        """Token texts by id (empty ones renamed ``[EMPTY_i]`` as llama.cpp does)."""
        return self._vocab.tokens

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as ``llama_tokenize(vocab, text, add_special, parse_special)`` returns them.

        Args:
            text: the text.
            add_special: add BOS/EOS when the vocabulary says so (``add_bos``/``add_eos``).
            parse_special: also match CONTROL tokens written in the text (llama-perplexity does not).

        Returns:
            The token ids.

        Raises:
            TokenizerError: an SPM vocabulary lacks the byte token a character needs.

        Example:
            >>> tok = load_tokenizer(open_gguf("model.gguf"))    # doctest: +SKIP
            >>> tok.encode("Hello world")                        # doctest: +SKIP
            [1, 15043, 3186]
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]  # checked at load
        fragments = self._partition(text, parse_special) if text else []
        bpe = self._bpe
        if bpe is not None:
            for frag in fragments:
                out.extend([frag] if isinstance(frag, int) else bpe.encode(frag))
        else:  # SPM
            prev_special = True  # the first fragment gets the space prefix too
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm(frag.replace(" ", SPM_SPACE)))
                prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of ``ids``, as ``llama_detokenize(..., remove_special=False, unparse_special=special)``.

        Bytes that do not form valid UTF-8 (a character cut between tokens) become U+FFFD.

        Raises:
            TokenizerError: an id outside the vocabulary.
        """
        v = self._vocab
        buf = bytearray()
        remove_space = self.add_space_prefix
        for i in ids:
            if not 0 <= i < self.n_vocab:
                raise TokenizerError(f"token id {i} is outside the vocabulary (0..{self.n_vocab - 1})")
            attr, text = v.attrs[i], v.tokens[i]
            piece = b""
            if attr & (ATTR_UNKNOWN | ATTR_CONTROL) and not special:
                piece = b""
            elif attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                piece = text.encode("utf-8")
            elif attr & ATTR_NORMAL:
                piece = (text.replace(SPM_SPACE, " ").encode("utf-8") if self.model == "llama" or self.escape_whitespaces
                         else _byte_decode(text))
            elif attr & ATTR_BYTE:
                piece = bytes([int(text[3:5], 16)])
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            buf += piece
        if self.clean_spaces:
            buf = _clean_spaces(bytes(buf))
        return bytes(buf).decode("utf-8", errors="replace")

    # -- special-token partition (tokenizer_st_partition) --------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        v = self._vocab
        skip = 0 if parse_special else ATTR_CONTROL | ATTR_UNKNOWN
        return partition(text, ((tid, v.tokens[tid], v.attrs[tid]) for tid in self._special_tokens
                                if not v.attrs[tid] & skip))

    # -- SPM (llm_tokenizer_spm_session) -------------------------------------------------------------------
    def _spm(self, text: str) -> list[int]:
        if not self._spm_splittable:
            return list(self._spm_merge(text))
        # No token has U+2581 after another character, so no merge can cross the start of a "▁..." run
        # that follows a non-space character: cut there and merge (and cache) each piece on its own.
        out: list[int] = []
        start = 0
        for i in range(1, len(text)):
            if text[i] == SPM_SPACE and text[i - 1] != SPM_SPACE:
                out.extend(self._spm_cached(text[start:i]))
                start = i
        out.extend(self._spm_cached(text[start:]))
        return out

    def _spm_cached(self, piece: str) -> tuple[int, ...]:
        ids = self._cache.get(piece)
        if ids is None:
            ids = self._cache[piece] = self._spm_merge(piece)
        return ids

    def _spm_merge(self, text: str) -> tuple[int, ...]:
        v = self._vocab
        t2i, scores = v.token_to_id, v.scores

        def priority(left: str, right: str) -> float | None:
            tid = t2i.get(left + right)
            # highest score first, then the leftmost pair (llm_bigram_spm::comparator)
            return None if tid is None else -scores[tid]

        out: list[int] = []
        for sym in merge_symbols(list(text), priority):
            tid = t2i.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._spm_byte(b) for b in sym.encode("utf-8"))
        return tuple(out)

    def _spm_byte(self, b: int) -> int:
        t2i = self._vocab.token_to_id
        tid = t2i.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = t2i.get(chr(b))
        if tid is None:
            raise TokenizerError(f"the vocabulary has no byte token <0x{b:02X}> for a character it cannot spell")
        return tid


def partition(text: str, specials: Iterable[tuple[int, str, int]]) -> list[str | int]:
    """Cut special tokens out of raw text, as llama.cpp's tokenizer_st_partition does (src/llama-vocab.cpp).

    Shared by the evaluator's tokenizer and the converter's pre-tokenizer check.

    Args:
        text: raw text.
        specials: ``(id, text, attributes)`` of each token to cut out, in the order to try them (llama.cpp's:
            longest first); ``ATTR_LSTRIP``/``ATTR_RSTRIP`` trim C whitespace before/after the token.

    Returns:
        The fragments in order: texts (empty only when ``text`` is) and token ids.

    Example:
        >>> partition("a<s>b<s>", [(1, "<s>", 0)])
        ['a', 1, 'b', 1]
    """
    fragments: list[str | int] = [text]
    for tid, word, attr in specials:
        if not word or not any(isinstance(f, str) and word in f for f in fragments):
            continue  # an empty token never matches (llama.cpp renames it [EMPTY_i])
        new: list[str | int] = []
        for frag in fragments:
            if isinstance(frag, int) or word not in frag:
                new.append(frag)
                continue
            rest = frag
            while True:
                pos = rest.find(word)
                if pos < 0:
                    new.append(rest)
                    break
                left = rest[:pos]
                if attr & ATTR_LSTRIP:
                    left = left.rstrip(_C_SPACE)
                if left:
                    new.append(left)
                new.append(tid)
                rest = rest[pos + len(word):]
                if attr & ATTR_RSTRIP:
                    rest = rest.lstrip(_C_SPACE)
                if not rest:
                    break
        fragments = new
    return fragments


#: ``tokenizer.ggml.pre`` names llama.cpp loads with clean_spaces = false (every other BPE name: true).
_NO_CLEAN_SPACES = frozenset((
    "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu", "sarvam-moe", "command-r", "qwen2",
    "deepseek-r1-qwen", "kormo", "f2llmv2", "qwen35", "poro-chat", "viking", "tekken", "smollm", "chameleon",
    "gpt-4o", "llama4", "kanana2", "talkie", "granite-embed-multi-97m", "tiny_aya", "cohere2moe", "superbpe",
    "trillion", "granite-docling", "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "hunyuan",
    "hunyuan-dense", "hy_v4", "joyai-llm", "kimi-k2", "ufakzeka", "grok-2", "afmoe", "laguna", "minimax-m2",
    "solar-open"))


def _parse_merges(value: Any) -> dict[tuple[str, str], int]:
    """BPE ranks: the first occurrence of a pair wins; a merge is split at its first space after index 0
    (none: the pair of empty strings, which matches nothing), as llama.cpp's loader does."""
    if value is None:
        raise TokenizerError("a BPE vocabulary needs tokenizer.ggml.merges, which is missing")
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise TokenizerError("tokenizer.ggml.merges is not an array of strings")
    return merge_ranks(value)


def _int_or_float_array(value: Any, n: int, key: str) -> Sequence[float] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TokenizerError(f"{key} is not an array")
    if len(value) < n:
        raise TokenizerError(f"{key} has {len(value)} entries for {n} tokens")
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _byte_decode(text: str) -> bytes:
    """llama_decode_text: byte-level characters back to bytes; others are kept as a visible marker."""
    out = bytearray()
    for ch in text:
        b = _BYTE_DEC.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _clean_spaces(text: bytes) -> bytearray:
    """llama.cpp's clean_up_tokenization_spaces: drop the space in " ?", " !", " .", " ,", " ' " and before
    "'s", "'m", "'re", "'ve"."""
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1:i] == b" " and text[i:i + 1] in (b"?", b"!", b".", b","):
            out.pop()
        out.append(text[i])
    t2 = bytearray(out)  # mutable: llama.cpp blanks the space after " ' " in place, and reads it back
    out = bytearray(t2[:1])
    i = 1
    while i < len(t2):
        x = t2[i]
        if x == 0x27 and i + 1 < len(t2) and t2[i - 1] == 0x20 and t2[i + 1] == 0x20:
            out.pop()
            t2[i + 1] = 0
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    t3 = bytes(out)
    out = bytearray(t3[:1])
    for i in range(1, len(t3)):
        x = t3[i]
        if t3[i - 1] == 0x20 and x == 0x27 and i + 1 < len(t3):
            x1 = t3[i + 1]
            if x1 in b"sm" or (i + 2 < len(t3) and (t3[i + 1:i + 3] in (b"re", b"ve"))):
                out.pop()
        out.append(x)
    return out


def load_tokenizer(model: Mapping[str, Any] | _MetadataSource, *, engine: str = "auto") -> GGUFTokenizer:
    """Rebuild the tokenizer of an opened GGUF file (anything with ``get(key, default)``, e.g. ``GGUFModel``).

    Args:
        model: the opened model (``ggufkit.format.open_gguf(path)``) or a plain metadata mapping.
        engine: what merges BPE words: ``auto`` (the ``tokenizers`` library where it can express llama.cpp's
            rules, else ggufkit's own loop), ``tokenizers`` (error if it cannot) or ``python``.

    Returns:
        A :class:`GGUFTokenizer` that produces llama.cpp's token ids.

    Raises:
        TokenizerError: no vocabulary, an unsupported ``tokenizer.ggml.model`` (``llama`` SPM and ``gpt2``/
            ``gemma4`` BPE are supported; not ``bert``, ``t5``, ``rwkv``, ``plamo2``) or ``tokenizer.ggml.pre``,
            or inconsistent vocabulary metadata.

    Example:
        >>> from ggufkit.format import open_gguf                  # doctest: +SKIP
        >>> tok = load_tokenizer(open_gguf("model.gguf"))         # doctest: +SKIP
        >>> tok.encode("Hello world"), tok.add_bos                # doctest: +SKIP
    """
    return GGUFTokenizer(model, engine=engine)  # type: ignore[arg-type]
