"""Tokenizer rules shared by the converters (writing vocabularies) and the evaluator (tokenizing text).

Format layer: pure Python, no model code.

* :mod:`ggufkit.tokenizer.gguf_tokenizer`: the tokenizer of a GGUF file (``load_tokenizer``), rebuilt from
  ``tokenizer.ggml.*`` to give llama.cpp's token ids: vocabulary loading, special tokens, SPM, decoding.
* :mod:`ggufkit.tokenizer.bpe_session`: THE BPE text-to-ids driver (llm_tokenizer_bpe_session), for the
  evaluator's tokenizer and the converter's pre-tokenizer check.
* :mod:`ggufkit.tokenizer.bpe`: GPT-2's byte-level alphabet, merge-rank parsing and llama.cpp's bigram
  merge loop (src/llama-vocab.cpp, unicode.cpp).
* :mod:`ggufkit.tokenizer.pretokenizers`: llama.cpp's pre-tokenizers by ``tokenizer.ggml.pre`` name.
* :mod:`ggufkit.tokenizer.unicode_ranges`: llama.cpp's Unicode character classes.
"""

from ggufkit.tokenizer.bpe import byte_level, bytes_to_unicode, merge_ranks, merge_symbols, unicode_to_bytes

__all__ = ["byte_level", "bytes_to_unicode", "merge_ranks", "merge_symbols", "unicode_to_bytes"]
