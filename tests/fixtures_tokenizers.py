"""Real tokenizer files, trained locally and deterministically, for converter and evaluator tests.

Every builder trains a real model (sentencepiece BPE, or a byte-level BPE with the ``tokenizers`` library)
on the same bundled corpus: the text of Python's own help topics (``pydoc_data.topics``, PSF licence, part
of every CPython install), so nothing is downloaded. Files are written the way the hub's repositories
ship them, with the special tokens, post-processors and chat templates real models have:

- :func:`make_spm_tokenizer`: ``tokenizer.model`` (Llama-2 style: BPE, byte fallback, ``<unk>``/``<s>``/
  ``</s>`` at 0/1/2), ``tokenizer_config.json`` (``LlamaTokenizer``), ``special_tokens_map.json``.
- :func:`make_bpe_tokenizer`: ``tokenizer.json`` + ``tokenizer_config.json`` for the ``llama-bpe``
  (Llama 3), ``qwen2`` (Qwen1.5..3) or ``gpt-2`` flavour: that flavour's pre-tokenizer regex, its special
  tokens appended after the trained vocabulary, its post-processor and a chat template.
- :func:`make_tiktoken_vocab`: ``qwen.tiktoken`` (Qwen 1: base64 token bytes and rank per line), built from
  a byte-level BPE trained with Qwen's regex; Qwen 1's special tokens are implied by its convention
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|extra_0..204|>`` right after the ranks).
- :func:`rebuild_bpe_tokenizer`: a real model's tokenizer (Qwen1.5, Llama 3, GPT-2) rebuilt as
  ``tokenizer.json`` from llama.cpp's ``models/ggml-vocab-*.gguf``; its check hash is the real one.
"""

from __future__ import annotations

import base64
import io
import json
from functools import lru_cache
from pathlib import Path

#: Text that exercises what tokenizers disagree on: whitespace runs, tabs and newlines, digit runs,
#: contractions in mixed case, accents, CJK, Cyrillic, emoji (with ZWJ), and literal special-token text.
VARIED_TEXT = (
    "Hello world! It's 2024-05-17, we've got 1234567 apples\tand  3.14159 pies.\n\n"
    "   leading spaces, trailing spaces   \n\t\ttabs\r\nCRLF line\n"
    "I'M SHOUTING, you'RE not. DON'T stop 'til the end.\n"
    "Ünïcödé: café, naïve, Äpfel, straße; Ελληνικά; русский текст; 日本語のテキスト; 中文字符。\n"
    "Emoji: 🦙🚀 👨‍👩‍👧 ❤️ 🇺🇸 and symbols ©®™ ½ ¼ → ⇒ ∑ ∞ <= >= != === ...\n"
    "Code: def f(x):\n    return x**2 + 0x1F  # comment\n"
    "Numbers: 0 00 000 0000 12 123 1234 12345 ٣٤٥ ١٢٣\n"
    "Special text: <|endoftext|> <s> </s> <|im_start|>user\n"
    "    \n  \n\n\n   end"
)

#: Regexes of each flavour's pre-tokenizer, as the hub's tokenizer.json files spell them (HF `Split`).
#: gpt-2 is GPT-2's own ByteLevel(use_regex=True), so it has no entry here.
BPE_FLAVOR_REGEX = {
    # Meta-Llama-3-8B tokenizer.json
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Qwen1.5/Qwen2 tokenizer.json (same as Llama 3 but one digit per piece); Qwen 1's tiktoken pat_str too
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
LLAMA2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)

#: Special tokens each flavour appends after its trained vocabulary (in this order), and their roles.
_BPE_SPECIALS = {
    "llama-bpe": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "gpt-2": ["<|endoftext|>"],
}

#: Qwen 1's special tokens (tokenization_qwen.py): these three, then <|extra_0|>..<|extra_204|>.
QWEN1_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]


@lru_cache(maxsize=1)
def corpus_lines() -> tuple[str, ...]:
    """The training corpus: non-blank lines of Python's help topics, in a fixed (sorted-key) order."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return tuple(line for line in text.splitlines() if line.strip())


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_spm_tokenizer(dir: Path, vocab_size: int = 320, *, dummy_prefix: bool = True) -> None:
    """Train a Llama-2-style sentencepiece model and write it as a Hugging Face tokenizer directory.

    The model is BPE with byte fallback (so every text is encodable), digits split, whitespace kept as is
    (identity normalization, whitespace-only pieces allowed), ``<unk>``=0, ``<s>``=1, ``</s>``=2, no pad.
    The corpus is lower-cased so that a 320-piece vocabulary still holds every required character beside
    the 256 byte pieces; upper-case letters then exercise the byte fallback.

    Args:
        dir: directory to write ``tokenizer.model``, ``tokenizer_config.json``, ``special_tokens_map.json``
            into (created if missing).
        vocab_size: sentencepiece vocabulary size (at least 320).
        dummy_prefix: sentencepiece's add_dummy_prefix (Gemma's tokenizers have it off).
    """
    import sentencepiece as spm

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    lines = [line.lower() for line in corpus_lines()[:3000]]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.98, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=dummy_prefix,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    (dir / "tokenizer.model").write_bytes(model.getvalue())
    _write_json(dir / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 2048,
        "sp_model_kwargs": {},
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(["<unk>", "<s>", "</s>"])
        },
        "chat_template": LLAMA2_CHAT_TEMPLATE,
    })
    _write_json(dir / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _bpe_pipeline(tok, flavor: str, bos_id: int | None) -> None:  # tok: tokenizers.Tokenizer
    """Normalizer, pre-tokenizer, decoder and post-processor of a flavour, as its tokenizer.json has them."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    if flavor == "qwen2":
        tok.normalizer = normalizers.NFC()
    if flavor == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(BPE_FLAVOR_REGEX[flavor]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    if flavor == "llama-bpe" and bos_id is not None:
        bos = _BPE_SPECIALS[flavor][0]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, bos_id)]),
        ])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)


def _train_byte_level_bpe(flavor: str, vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE over the corpus, trained with the flavour's own pre-tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=flavor == "llama-bpe"))
    _bpe_pipeline(tok, flavor, None)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(list(corpus_lines()[:3000]) + VARIED_TEXT.splitlines(), trainer=trainer)
    return tok


def make_bpe_tokenizer(dir: Path, vocab_size: int = 400, flavor: str = "llama-bpe") -> None:
    """Train a byte-level BPE of one model family's flavour and write ``tokenizer.json`` and its config.

    The trained vocabulary has ``vocab_size - n_special`` entries (the 256-byte alphabet plus merges); the
    flavour's special tokens follow it, as in the real models (Llama 3 at 128000+, Qwen2 at 151643+), so
    the tokenizer has exactly ``vocab_size`` tokens.

    Args:
        dir: output directory (created if missing).
        vocab_size: total number of tokens, special ones included (at least 300).
        flavor: ``"llama-bpe"`` (Llama 3: regex with 1-3 digit groups, ignore_merges, BOS added by a
            TemplateProcessing post-processor), ``"qwen2"`` (one digit per piece, NFC, no BOS, ChatML) or
            ``"gpt-2"`` (GPT-2's ByteLevel regex, ``<|endoftext|>`` only).

    Raises:
        ValueError: unknown flavour.
    """
    from tokenizers import AddedToken

    if flavor not in _BPE_SPECIALS:
        raise ValueError(f"unknown BPE flavour {flavor!r}; expected one of {sorted(_BPE_SPECIALS)}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    specials = _BPE_SPECIALS[flavor]
    tok = _train_byte_level_bpe(flavor, vocab_size - len(specials))
    n_trained = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    _bpe_pipeline(tok, flavor, n_trained)
    tok.save(str(dir / "tokenizer.json"))
    _write_bpe_config(dir, flavor, {t: n_trained + i for i, t in enumerate(specials)})


def _write_bpe_config(dir: Path, flavor: str, special_ids: dict[str, int],
                      user_defined: dict[str, int] | None = None) -> None:
    """tokenizer_config.json as the flavour's hub repositories have it (special tokens, chat template)."""
    specials = _BPE_SPECIALS[flavor]
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for t, i in special_ids.items()}
    added.update({str(i): {"content": t, "lstrip": False, "normalized": True, "rstrip": False,
                           "single_word": False, "special": False} for t, i in (user_defined or {}).items()})
    config: dict[str, object]
    if flavor == "llama-bpe":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0],
                  "eos_token": specials[1], "chat_template": LLAMA3_CHAT_TEMPLATE}
    elif flavor == "qwen2":
        config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
                  "pad_token": "<|endoftext|>", "errors": "replace", "split_special_tokens": False,
                  "chat_template": CHATML_TEMPLATE}
    else:
        config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                  "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_prefix_space": False}
    config.update({"added_tokens_decoder": added, "clean_up_tokenization_spaces": False,
                   "model_max_length": 2048})
    _write_json(dir / "tokenizer_config.json", config)


def rebuild_bpe_tokenizer(gguf_path: Path, dir: Path, flavor: str, *, extra_tokens: tuple[str, ...] = ()) -> None:
    """Rebuild a real HF tokenizer from one of llama.cpp's ``models/ggml-vocab-*.gguf`` vocabularies.

    Writes ``tokenizer.json`` (the file's tokens and merges in a byte-level BPE with the flavour's regex,
    normalizer and post-processor; CONTROL tokens as special added tokens; the UNUSED ``[PAD]`` fillers
    left out, as the hub's files do) and ``tokenizer_config.json``. That is the tokenizer the file was made
    from, so llama.cpp's check hash of it is the one its table lists for that model.

    Args:
        gguf_path: a vocab-only GGUF (``tokenizer.ggml.model == "gpt2"``).
        dir: output directory (created if missing).
        flavor: ``"llama-bpe"``, ``"qwen2"`` or ``"gpt-2"``.
        extra_tokens: user-defined (non-special) tokens added after the vocabulary, as a fine-tune does;
            they change the tokenizer's ids and therefore its check hash.
    """
    from tokenizers import AddedToken, Tokenizer, models

    from ggufkit.format.reader import GGUFFile

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    with GGUFFile(gguf_path) as f:
        tokens = list(f.get("tokenizer.ggml.tokens"))
        types = [int(t) for t in f.get("tokenizer.ggml.token_type")]
        merges = list(f.get("tokenizer.ggml.merges"))
    unused, control = 5, 3
    # the [PAD{i}] fillers exist only in the GGUF (these older files typed them USER_DEFINED, not UNUSED)
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types))
             if ty != unused and t != f"[PAD{i}]"}
    # llama.cpp splits a merge at its first space after position 0
    pairs = [(m[:m.index(" ", 1)], m[m.index(" ", 1) + 1:]) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=flavor == "llama-bpe"))
    specials = {t: i for t, i in vocab.items() if types[i] == control}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if extra_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in extra_tokens])
    _bpe_pipeline(tok, flavor, specials.get(_BPE_SPECIALS[flavor][0]))
    tok.save(str(dir / "tokenizer.json"))
    ids = {t: specials[t] for t in _BPE_SPECIALS[flavor] if t in specials}
    _write_bpe_config(dir, flavor, ids, user_defined={t: tok.token_to_id(t) for t in extra_tokens})


def tiktoken_ranks(vocab_size: int = 400) -> dict[bytes, int]:
    """Mergeable ranks of a byte-level BPE trained with Qwen's regex: the 256 bytes, then merges in order.

    Every merged token's rank is after both of its parts, as in tiktoken files, so a BPE over its bytes
    using only lower ranks ends in exactly two parts (which llama.cpp's Qwen 1 converter relies on).
    """
    tok = _train_byte_level_bpe("qwen2", vocab_size)
    byte_of = {ch: b for b, ch in enumerate(_byte_alphabet())}
    model = json.loads(tok.to_str())["model"]
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = bytes(byte_of[c] for c in left + right)
        if token not in ranks:
            ranks[token] = len(ranks)
    return ranks


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> printable character map, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


def make_tiktoken_vocab(dir: Path, vocab_size: int = 400) -> None:
    """Write a Qwen-1 style ``qwen.tiktoken`` (``base64(token_bytes) rank`` per line) and its config.

    Also writes ``tokenizer_config.json`` as Qwen-1 repositories ship it (``QWenTokenizer`` through
    ``auto_map``; loading it with transformers needs trust_remote_code, which ggufkit never uses).
    Qwen 1's special tokens are not in the file: by convention they follow the ranks
    (``QWEN1_SPECIALS``).

    Args:
        dir: output directory (created if missing).
        vocab_size: number of mergeable ranks (256 bytes plus merges).
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    ranks = tiktoken_ranks(vocab_size)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}" for tok, rank in
             sorted(ranks.items(), key=lambda kv: kv[1])]
    (dir / "qwen.tiktoken").write_text("\n".join(lines) + "\n", encoding="ascii")
    _write_json(dir / "tokenizer_config.json", {
        "model_max_length": 8192,
        "tokenizer_class": "QWenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
    })
