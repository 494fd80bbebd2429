"""LLaMA/Mistral vocabularies saved as ``tokenizer.json`` only (byte-fallback BPE, no ``tokenizer.model``), as
llama.cpp's converter writes them (gguf-py vocab.py ``LlamaHfVocab``, conversion/base.py
``_set_vocab_llama_hf``): a ``llama`` (SPM-type) vocabulary of the tokenizer's pieces, every score -1000,
``<0xNN>`` pieces BYTE, the tokenizer's special tokens CONTROL, added tokens after the base vocabulary
USER_DEFINED (CONTROL when special).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ggufkit.errors import TokenizerError

#: LlamaHfVocab's score for every token.
SCORE = -1000.0
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
#: gguf TokenType values.
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE_TYPE = 1, 3, 4, 5, 6


def is_llama_hf(tokenizer_json: Any) -> bool:
    """A byte-fallback BPE ``tokenizer.json`` with a Sequence decoder that is not Llama 3's: LlamaHfVocab's
    condition for taking it."""
    if not isinstance(tokenizer_json, dict) or not isinstance(tokenizer_json.get("model"), dict):
        return False
    model = tokenizer_json["model"]
    llama3 = model.get("type") == "BPE" and model.get("ignore_merges", False) and not model.get("byte_fallback", True)
    decoder = tokenizer_json.get("decoder") or {}
    return (not llama3 and model.get("type") == "BPE" and bool(model.get("byte_fallback", False))
            and isinstance(decoder, dict) and decoder.get("type") == "Sequence")


def llama_hf_tokens(model_dir: Path, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) padded to ``vocab_size`` with ``[PAD{i}]`` (UNUSED) rows.

    Raises:
        TokenizerError: transformers cannot load the tokenizer, or it has more tokens than ``vocab_size``.
    """
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot load tokenizer.json with transformers: {exc}", path=model_dir) from None
    vocab = tok.get_vocab()
    base = int(tok.vocab_size)
    added = sorted(((t, i) for t, i in tok.get_added_vocab().items() if i >= base), key=lambda x: x[1])
    special_ids = set(tok.all_special_ids)
    specials = {t: vocab[t] for t in tok.all_special_tokens}
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    added_ids = {i for _, i in added}
    for i in range(base):
        if i in added_ids:
            continue
        text = reverse[i]
        tokens.append(text)
        types.append(_BYTE_TYPE if _BYTE.fullmatch(text) else _CONTROL if i in special_ids else _NORMAL)
    for text, _ in added:
        tokens.append(text)
        types.append(_CONTROL if text in specials and specials[text] in special_ids else _USER_DEFINED)
    if len(tokens) > vocab_size:
        raise TokenizerError(f"the tokenizer has {len(tokens)} tokens but the model's vocab_size is {vocab_size}",
                             path=model_dir)
    scores = [SCORE] * len(tokens)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(SCORE)
        types.append(_UNUSED)
    return tokens, scores, types
