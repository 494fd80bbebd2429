"""Kimi K2's tokenizer: ``tiktoken.model`` + ``tokenizer_config.json`` (class ``DeepseekV3ForCausalLM``), rebuilt into
BPE merges as llama.cpp's converter does (conversion/deepseek.py DeepseekV2Model.set_vocab, tokpre ``kimi-k2``)
without running the checkpoint's own Python code (tokenization_kimi.py).

A tiny DeepseekV3ForCausalLM checkpoint with a Kimi-style tokenizer built here (mergeable ranks of a byte-level
BPE trained on real text; reserved special tokens after them, some named in ``added_tokens_decoder``) and a
tokenization_kimi.py that builds tiktoken's encoding as Kimi's does. llama.cpp's converter runs that code
(trust_remote_code) and is the oracle for every ``tokenizer.*`` key; ggufkit never imports it (the module leaves
a mark when it is imported). The tiny tokenizer's pre-tokenizer hash is not Kimi-K2-Base's, so the oracle is
told ``kimi-k2`` where its hash table would say it for the real file. ggufkit's tokenizer (and llama.cpp's, on
the same file) then encodes text as tiktoken does with Kimi's pat_str.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures_tokenizers import VARIED_TEXT, tiktoken_ranks
from llama_cpp_sources import llama_cpp_dir

from ggufkit.converters import convert
from ggufkit.format import open_gguf

#: tokenization_kimi.py TikTokenTokenizer.pat_str (moonshotai/Kimi-K2-Instruct)
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
N_RANKS = 600
MARK = "ran-tokenization_kimi.txt"
RESERVED = 256
#: reserved ids (offset from the first) named in tokenizer_config.json, as Kimi K2 names them
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
         7: "<|end_header_id|>", 10: "<|im_system|>", 15: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}

#: The checkpoint's own code, as Kimi's builds its encoding (tiktoken over the ranks, the reserved specials);
#: importing it (transformers runs a copy in its modules cache) leaves MARK, so the test can tell who ran it.
TOKENIZATION_KIMI = '''
from pathlib import Path
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

Path(MARK).write_text("imported")


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256
    pat_str = PAT_STR

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        mapping = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        self.special_tokens = {mapping.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(n, n + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        self.decoder = {i: self.model.decode_single_token_bytes(i).decode("latin-1") for i in range(self.n_words)}
        self.encoder = {v: k for k, v in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, **kwargs)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        return self.model.encode(text, allowed_special="all")

    @property
    def vocab_size(self):
        return self.n_words

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, 0)

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)
'''.replace("PAT_STR", repr(PAT_STR))

#: Runs llama.cpp's converter, telling it "kimi-k2" where the tiny tokenizer's hash is unknown to its table
#: (conversion/base.py TextModel.get_vocab_base_pre; the real Kimi-K2-Base tokenizer's hash is in it).
ORACLE = '''
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if type(tokenizer).__name__ != "TikTokenTokenizer":
            raise
        return "kimi-k2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _write_checkpoint(d: Path) -> dict[bytes, int]:
    import torch
    import transformers

    ranks = tiktoken_ranks(N_RANKS)
    n = len(ranks)
    d.mkdir(parents=True)
    config = transformers.DeepseekV3Config(
        vocab_size=n + RESERVED, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, bos_token_id=n, eos_token_id=n + 2,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(d)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(n + k): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True} for k, text in NAMED.items()}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "chat_template": "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}",
        "clean_up_tokenization_spaces": False, "model_max_length": 1000000, "tokenizer_class": "TikTokenTokenizer",
    }, indent=2))
    (d / "tokenization_kimi.py").write_text(TOKENIZATION_KIMI.replace("MARK", repr(str(d / MARK))))
    return ranks


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("kimi") / "Kimi-K2-tiny"
    ranks = _write_checkpoint(d)
    ours = convert(d, d.parent / "ours.gguf", outtype="f32", vocab_only=True).outputs[0]
    ran_by_us = (d / MARK).exists()
    theirs = d.parent / "theirs.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_cpp_dir() / "gguf-py")}
    r = subprocess.run([sys.executable, "-c", ORACLE, str(llama_cpp_dir()), str(d), "--outfile", str(theirs),
                        "--outtype", "f32", "--vocab-only"], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (d / MARK).exists()  # llama.cpp's converter ran the checkpoint's code
    return {"dir": d, "ranks": ranks, "ours": ours, "theirs": theirs, "ran_by_us": ran_by_us}


def _tokenizer_keys(path: Path) -> dict[str, Any]:
    with open_gguf(path) as f:
        return {k: (v.type, v.value.tolist() if hasattr(v.value, "tolist") else list(v.value)
                    if isinstance(v.value, (list, tuple)) else v.value)
                for k, v in f.kv.items() if k.startswith("tokenizer.")}


def test_vocabulary_keys_equal_llama_cpps_converter_without_running_the_checkpoints_code(kimi: dict) -> None:
    assert not kimi["ran_by_us"]
    ours, theirs = _tokenizer_keys(kimi["ours"]), _tokenizer_keys(kimi["theirs"])
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key] == theirs[key], key
    n = len(kimi["ranks"])
    assert ours["tokenizer.ggml.pre"][1] == "kimi-k2" and ours["tokenizer.ggml.model"][1] == "gpt2"
    tokens, types = ours["tokenizer.ggml.tokens"][1], ours["tokenizer.ggml.token_type"][1]
    assert len(tokens) == n + RESERVED and tokens[n + 254] == "[UNK]" and tokens[n + 5] == f"<|reserved_token_{n + 5}|>"
    assert set(types[n:]) == {3} and set(types[:n]) == {1}  # CONTROL specials, NORMAL ranks
    assert len(ours["tokenizer.ggml.merges"][1]) == n - 256
    # the ids are config.json's (the eos there is <|im_end|>, not tokenizer_config's [EOS]), as llama.cpp's
    assert ours["tokenizer.ggml.eos_token_id"][1] == n + 2 and ours["tokenizer.ggml.bos_token_id"][1] == n


def test_ggufkit_and_llama_cpp_tokenize_like_tiktoken_with_kimis_pat_str(kimi: dict) -> None:
    import llama_cpp
    import tiktoken

    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    n = len(kimi["ranks"])
    specials = {**{f"<|reserved_token_{i}|>": i for i in range(n, n + RESERVED)},
                **{text: n + k for k, text in NAMED.items()}}
    enc = tiktoken.Encoding("kimi", pat_str=PAT_STR, mergeable_ranks=kimi["ranks"], special_tokens=specials)
    texts = [VARIED_TEXT, "Hello world's THE'LL 12345 6789\n\n\t  x  !!?\r\n", "我想在apple工作1314151天～ Ünïcödé",
             "I've been 'told he's there, 'RE you sure? We'Ve a'lL", " \n \n\n leading", ""]
    with open_gguf(kimi["ours"]) as f:
        tok = load_tokenizer(f)
    llm = llama_cpp.Llama(model_path=str(kimi["ours"]), vocab_only=True, verbose=False)
    for text in texts:
        want = enc.encode(text, disallowed_special=())
        assert tok.encode(text, add_special=False) == want, text
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == want, text
    # random mixes of what the splitter tells apart: cased letters and contractions, marks, Han (and its
    # compatibility and extension-B ideographs), kana, other digits, Unicode whitespace, emoji, punctuation
    pool = [*"aZé'sStTmMdDlLrRvVeE ", "e\u0301", "\u0928\u093f", "٣", "½", "Ⅻ", "\u00a0", "\u3000", "\t", "\n",
            "\r", "\r\n", "我", "想", "\U00020001", "\uf900", "が", "カ", "ا", "ß", "İ", "Σ", "ǅ", "ʰ", "123", "🦙",
            "!", "?", "-", "’", "``", '"', ".", "\x0b", "\x1c", "\u2028", "𝔘", "ﬁ"]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 14)))
        want = enc.encode(text, disallowed_special=())
        assert tok.encode(text, add_special=False) == want, text
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == want, text
    with_specials = "<|im_user|>user<|im_middle|>Hi [EOS] there<|im_end|>"
    assert tok.encode(with_specials, add_special=False, parse_special=True) == \
        enc.encode(with_specials, allowed_special="all")
