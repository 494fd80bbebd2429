"""Byte-level BPE pieces that llama.cpp's loader and tokenizer sessions use (src/llama-vocab.cpp, unicode.cpp).

One implementation each of GPT-2's byte alphabet, merge-rank parsing and the bigram merge loop, for the
converters (which check and write vocabularies) and the evaluator (which tokenizes with them).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import TypeVar

#: SentencePiece's escaped space (U+2581), which SPM vocabularies and llama.cpp's SPM/BPE sessions spell " " as.
SPM_SPACE = "\u2581"

#: A symbol: text (BPE, SPM) or raw bytes (tiktoken ranks).
Sym = TypeVar("Sym", str, bytes)


@lru_cache(maxsize=1)
def _byte_table() -> tuple[tuple[int, str], ...]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(sorted(table.items()))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, byte-level BPE's alphabet (unicode.cpp:
    unicode_byte_to_utf8_map). A fresh dict, in byte order."""
    return dict(_byte_table())


def unicode_to_bytes() -> dict[str, int]:
    """The inverse of :func:`bytes_to_unicode` (unicode.cpp: unicode_utf8_to_byte)."""
    return {c: b for b, c in _byte_table()}


@lru_cache(maxsize=1)
def _translate_table() -> dict[int, str]:
    return dict(_byte_table())


def byte_level(word: str) -> str:
    """``word``'s UTF-8 bytes spelled in GPT-2's byte-level alphabet, as llama.cpp's BPE session spells each
    word before merging (unicode.cpp: unicode_byte_to_utf8)."""
    return word.encode("utf-8").decode("latin-1").translate(_translate_table())


def merge_ranks(merges: Iterable[str]) -> dict[tuple[str, str], int]:
    """Merge pair -> rank as llama.cpp's loader builds it (llama_vocab::impl::load): each merge is split at
    its first space after index 0 (none: the pair of empty strings, which matches nothing), and a repeated
    pair keeps its first rank (std::unordered_map::emplace)."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        ranks.setdefault((merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", ""), rank)
    return ranks


def merge_symbols(syms: list[Sym], priority: Callable[[Sym, Sym], float | None]) -> list[Sym]:
    """llama.cpp's bigram merge loop, shared by its SPM and BPE sessions (llm_tokenizer_spm_session,
    llm_tokenizer_bpe_session).

    Repeatedly merges the adjacent pair with the lowest ``priority`` (ties: the leftmost pair) until no
    pair has one; ``priority(left, right)`` is None for a pair that cannot merge.

    Args:
        syms: the initial symbols (characters, or single bytes); modified in place.
        priority: ranks a pair of adjacent symbols.

    Returns:
        The final symbols, in order.
    """
    n: int = len(syms)
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[float, int, int, Sym]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        rank = priority(syms[left], syms[right])
        if rank is not None:
            heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

    for i in range(1, n):
        push(i - 1, i)
    empty: Sym | None = syms[0][:0] if n else None
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
            continue  # stale: one side was merged since this pair was queued
        syms[left] = merged
        syms[right] = empty  # type: ignore[assignment]
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    out: list[Sym] = []
    i = 0 if n else -1
    while i != -1:
        out.append(syms[i])
        i = nxt[i]
    return out
