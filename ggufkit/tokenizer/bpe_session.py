"""llama.cpp's BPE text-to-ids driver: ``llm_tokenizer_bpe_session::tokenize`` (src/llama-vocab.cpp).

THE one BPE driver of ggufkit. The evaluator's tokenizer (:mod:`ggufkit.tokenizer.gguf_tokenizer`) runs it on
every text fragment between special tokens; the converter's pre-tokenizer check
(``ggufkit.converters.pretokenizer.bpe_tokenize``) runs it to see whether llama.cpp, given a candidate
``tokenizer.ggml.pre``, reproduces the Hugging Face tokenizer's ids. Both want llama.cpp's ids, including for
a symbol missing from the vocabulary (:meth:`BpeSession._unknown`).

A fragment is split into words by the pre-tokenizer's regexes (:mod:`ggufkit.tokenizer.pretokenizers`),
each word is GPT-2 byte-level encoded (or, for Gemma 4's raw-UTF-8 BPE, has its spaces escaped as U+2581),
and merged by lowest merge rank, leftmost on ties; ``ignore_merges`` vocabularies emit a word that is itself
a token directly.

Engines: the merges of a word run in the ``tokenizers`` library (``tokenizers.models.BPE``: same
lowest-rank-then-leftmost order) whenever it can express llama.cpp's rules, which it can for every BPE
vocabulary in llama.cpp's test set; ggufkit's own loop (:func:`ggufkit.tokenizer.bpe.merge_symbols`)
covers the rest. Each distinct word is merged once and cached.
"""

from __future__ import annotations

import re
from typing import Any

from ggufkit.errors import TokenizerError
from ggufkit.tokenizer.bpe import SPM_SPACE, byte_level, bytes_to_unicode, merge_symbols
from ggufkit.tokenizer.pretokenizers import PreTokenizer, split_spans

__all__ = ["BpeSession"]



class BpeSession:
    """llama.cpp's BPE tokenizer session for one vocabulary and one pre-tokenizer rule.

    Args:
        token_to_id: token text -> id (llama.cpp's ``token_to_id``: a later duplicate wins).
        ranks: merge pair -> rank (:func:`ggufkit.tokenizer.bpe.merge_ranks`), in rank order.
        rule: the pre-tokenizer (:func:`ggufkit.tokenizer.pretokenizers.get_pre_tokenizer`).
        engine: what merges words: ``auto`` (the ``tokenizers`` library where it can express llama.cpp's
            rules, else ggufkit's loop), ``tokenizers`` (error if it cannot) or ``python``.

    Example:
        >>> from ggufkit.tokenizer.bpe import merge_ranks
        >>> from ggufkit.tokenizer.pretokenizers import get_pre_tokenizer
        >>> s = BpeSession({"a": 0, "b": 1, "ab": 2}, merge_ranks(["a b"]), get_pre_tokenizer("gpt-2"))
        >>> s.encode("ab ba")
        [2, 1, 0]
    """

    def __init__(self, token_to_id: dict[str, int], ranks: dict[tuple[str, str], int], rule: PreTokenizer,
                 *, engine: str = "auto") -> None:
        self._t2i = token_to_id
        self._ranks = ranks
        self.rule = rule
        self._engine = engine
        self._cache: dict[str, tuple[int, ...]] = {}
        self._hf: Any = None  # tokenizers.models.BPE, built on first use (about 1 s for 128k tokens)
        self._unknown_chars: re.Pattern[str] | None = None

    @property
    def merge_engine(self) -> str:
        """What merges words: ``tokenizers`` or ``python``."""
        return "python" if self._hf_model() is None else "tokenizers"

    def words(self, text: str) -> list[str]:
        """The words llama.cpp merges within, as the merge loop sees them (byte-level, or spaces escaped).

        Args:
            text: one fragment of raw text (special tokens already cut out).
        """
        text = self._escape(text)
        return [self._spell(text[a:b]) for a, b in split_spans(text, self.rule.regexes)]

    def encode(self, text: str) -> list[int]:
        """Token ids of one fragment of raw text (special tokens already cut out), without BOS/EOS.

        Raises:
            TokenizerError: engine ``tokenizers`` and merges it cannot express.
        """
        text = self._escape(text)
        out: list[int] = []
        cache = self._cache
        for a, b in split_spans(text, self.rule.regexes):
            word = text[a:b]
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = self._word(self._spell(word))
            out.extend(ids)
        return out

    def _escape(self, text: str) -> str:
        return text if self.rule.byte_level else text.replace(" ", SPM_SPACE)

    def _spell(self, word: str) -> str:
        return byte_level(word) if self.rule.byte_level else word

    def _word(self, word: str) -> tuple[int, ...]:
        t2i = self._t2i
        if self.rule.ignore_merges and word in t2i:  # the whole word only, as in llama.cpp
            return (t2i[word],)
        if self.rule.kind == "gemma4" and word.strip("\n") == "" and word in t2i:
            return (t2i[word],)  # a run of newlines that is a token is taken whole (llama.cpp PR 21343)
        hf = self._hf_model()
        if hf is None:
            return self._merge(word)
        if self._unknown_chars is None:
            return tuple(t.id for t in hf.tokenize(word))
        # A character missing from the vocabulary takes part in no merge (every merge's parts are tokens), so
        # it separates the word into pieces that merge independently; llama.cpp then drops it (see _unknown).
        out: list[int] = []
        pos = 0
        for m in self._unknown_chars.finditer(word):
            if m.start() > pos:
                out.extend(t.id for t in hf.tokenize(word[pos:m.start()]))
            out.extend(self._unknown(m.group()))
            pos = m.end()
        if pos < len(word):
            out.extend(t.id for t in hf.tokenize(word[pos:]))
        return tuple(out)

    def _hf_model(self) -> Any:
        """The ``tokenizers`` BPE model that merges words when it can express llama.cpp's rules, else None.

        It can when every merge's two parts and result are tokens (a merge into a non-token would make
        llama.cpp fall back to bytes, and ``tokenizers`` refuses such merges). ``ignore_merges`` is handled
        by the caller, for the whole word only, because ``tokenizers`` would apply it per piece.
        """
        if self._engine == "python" or self._hf is False or not self.rule.byte_level:
            # raw-UTF-8 BPE (Gemma 4): any character may be missing, and tokenizers would drop it before
            # merging where llama.cpp keeps it in place, then spells it with <0xNN> tokens
            return None
        if self._hf is None:
            from tokenizers.models import BPE

            t2i = self._t2i
            merges = [p for p in self._ranks if p != ("", "")]  # the dict is in rank order
            # checked here: tokenizers refuses (or panics on) merges whose parts or result are not tokens
            if not all(a in t2i and b in t2i and a + b in t2i for a, b in merges):
                if self._engine == "tokenizers":
                    raise TokenizerError("the merges cannot be expressed with the tokenizers library: some "
                                         "merge has a part or result that is not a token")
                self._hf = False
                return None
            self._hf = BPE(vocab=t2i, merges=merges)
            unknown = sorted(c for c in bytes_to_unicode().values() if c not in t2i)
            if unknown:
                self._unknown_chars = re.compile("[" + "".join(re.escape(c) for c in unknown) + "]")
        return self._hf

    def _unknown(self, sym: str) -> list[int]:
        """llama.cpp's fallback for a final symbol that is not a token (llm_tokenizer_bpe_session::tokenize:
        ``text_to_token(std::string(1, byte))`` for each byte of the symbol's UTF-8 spelling): each byte is
        looked up as a one-byte token, so only ASCII bytes can ever be found and the rest of the symbol is
        silently dropped. Gemma 4's raw-UTF-8 BPE spells the symbol with ``<0xNN>`` byte tokens instead."""
        t2i = self._t2i
        if not self.rule.byte_level:
            return [t2i[f"<0x{b:02X}>"] for b in sym.encode("utf-8") if f"<0x{b:02X}>" in t2i]
        return [t2i[chr(b)] for b in sym.encode("utf-8") if b < 0x80 and chr(b) in t2i]

    def _merge(self, word: str) -> tuple[int, ...]:
        """llm_tokenizer_bpe_session's merge loop in Python (used when ``tokenizers`` cannot express it)."""
        t2i, ranks = self._t2i, self._ranks
        out: list[int] = []
        for sym in merge_symbols(list(word), lambda left, right: ranks.get((left, right))):
            tid = t2i.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._unknown(sym))
        return tuple(out)
