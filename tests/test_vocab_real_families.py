"""The released tokenizers of issue 32's families, through ggufkit's converter and tokenizer, against llama.cpp.

Tokenizers (tests/real_tokenizers.py: which package each comes from, licence, hashes): DeepSeek V3/R1's
``tokenizer.json`` (class ``DeepseekV3ForCausalLM``), gpt-oss's o200k_harmony (``GptOssForCausalLM``),
Llama 4's (``Llama4ForCausalLM``), GLM-4.5's (``Glm4MoeForCausalLM``) and GLM-4.7-Flash's
(``Glm4MoeLiteForCausalLM``), each beside a tiny random checkpoint of its class with the release's vocabulary
size (DeepSeek V3: 129 280, gpt-oss: 201 088, Llama 4: 202 048, GLM-4.5: 151 552, GLM-4.7-Flash: 154 880). Kimi
K2's ``tiktoken.model`` is on no package (tests/test_vocab_kimi.py builds a Kimi-style one). For each:

- every ``tokenizer.*`` key of ggufkit's vocabulary equals llama.cpp's converter's on the same checkpoint
  (tokens, types, merges, the pre-tokenizer its check hash picks, special ids, chat template);
- ggufkit's tokenizer encodes as llama.cpp's (llama-cpp-python on the converted file) and as HF's
  ``tokenizers`` on varied text (numbers, CJK, code, whitespace runs, contractions, emoji, added tokens),
  decodes as llama.cpp does, and tokenizes a text for ``ggufkit ppl`` as llama-perplexity does
  (``common_tokenize(ctx, text, add_special=true)``, parse_special false).

Where llama.cpp itself splits otherwise than HF, ggufkit follows llama.cpp (the runtime that evaluates the file):
llama.cpp's GPT4O pre-tokenizer (gpt-oss's and Llama 4's) (llama-vocab.cpp, ``LLAMA_VOCAB_PRE_TYPE_GPT4O``) replaces o200k's regex by an
approximation in which a letter is upper case when it is not ``a-z`` and lower case when it is not ``A-Z``, and
combining marks (``\\p{M}``) are not letters; texts with marks or non-ASCII upper/title-case letters can split
otherwise (pinned in :func:`test_o200k_splits_as_llama_cpps_approximation_where_it_departs_from_hf`).
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from fixtures_tokenizers import VARIED_TEXT
from llama_cpp_sources import llama_cpp_dir
from real_tokenizers import tokenizer_dir

from ggufkit.converters import convert
from ggufkit.converters.pretokenizer import CHKHSH_TABLE, chkhsh
from ggufkit.format import open_gguf

FAMILIES = ("deepseek-r1", "gpt-oss", "llama4", "glm-4.5", "glm-4.7-flash")
#: families whose pre-tokenizer is llama.cpp's GPT4O approximation of o200k's regex (module docstring)
O200K = ("gpt-oss", "llama4")
#: the check hash of each tokenizer under the installed transformers and the name llama.cpp's table gives it.
#: DeepSeek V3's row (877081d1..., "deepseek-v3") was hashed with a BOS that transformers 4's
#: LlamaTokenizerFast prepended; transformers 5 loads tokenizer.json as it is (no BOS), which hashes to the
#: row of JoyAI-LLM-Flash (DeepSeek V3's tokenizer): "joyai-llm", the same pre-tokenizer type in llama.cpp
#: (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_JOYAI_LLM shares DEEPSEEK3_LLM's regexes).
CHKHSH = {"deepseek-r1": ("b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d", "joyai-llm"),
          "gpt-oss": ("ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e", "gpt-4o"),
          "llama4": ("d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406", "llama4"),
          "glm-4.5": ("a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2", "glm4"),
          "glm-4.7-flash": ("cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267", "glm4")}
#: the release's vocabulary size (config.json) and its special ids
VOCAB = {"deepseek-r1": dict(vocab_size=129280, bos_token_id=0, eos_token_id=1),
         "gpt-oss": dict(vocab_size=201088, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
         "llama4": dict(vocab_size=202048, bos_token_id=200000, eos_token_id=200008, pad_token_id=200018),
         "glm-4.5": dict(vocab_size=151552, eos_token_id=[151329, 151336, 151338], pad_token_id=151329),
         "glm-4.7-flash": dict(vocab_size=154880, bos_token_id=None, eos_token_id=[154820, 154827, 154829],
                               pad_token_id=154820)}
#: tokenizer.ggml.bos_token_id and eos_token_id as llama.cpp's converter writes them: the config's, but GLM's
#: BOS is ``[gMASK]`` (conversion/base.py ``_set_vocab_glm``; its configs name no BOS) and its EOS the first of
#: the config's list
BOS_EOS = {"deepseek-r1": (0, 1), "gpt-oss": (199998, 200002), "llama4": (200000, 200008),
           "glm-4.5": (151331, 151329), "glm-4.7-flash": (154822, 154820)}
#: GLM's 36 added tokens start here (``<|endoftext|>``), after the BPE tokens
GLM_ADDED = {"glm-4.5": 151329, "glm-4.7-flash": 154820}
#: whether llama-perplexity adds a BOS (tokenizer.ggml.add_bos_token: Llama 4's post-processor adds one)
ADD_BOS = {"deepseek-r1": False, "gpt-oss": False, "llama4": True, "glm-4.5": False, "glm-4.7-flash": False}
TEXTS = [VARIED_TEXT, "Hello world's THE'LL 12345 6789\n\n\t  x  !!?\r\n", "我想在apple工作1314151天～ カタカナ ひらがな",
         "path/to/file.py\n// comment /* x */\nfor (int i = 0; i < n; ++i) {\n\tx[i] += 1;\n}\n",
         "I've been 'told he's there, 'RE you sure? We'Ve a'lL", " \n \n\n leading", "", "3.14159 1,000,000 007"]


def _write_checkpoint(name: str, d: Path) -> None:
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    if name == "deepseek-r1":
        config = transformers.DeepseekV3Config(
            hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8,
            q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=256,
            tie_word_embeddings=False, **VOCAB[name])
        transformers.DeepseekV3ForCausalLM(config).save_pretrained(d)
    elif name == "glm-4.5":
        config = transformers.Glm4MoeConfig(
            hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256, tie_word_embeddings=False,
            **VOCAB[name])
        transformers.Glm4MoeForCausalLM(config).save_pretrained(d)
    elif name == "glm-4.7-flash":
        config = transformers.Glm4MoeLiteConfig(
            hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
            mlp_layer_types=["dense", "sparse"], max_position_embeddings=256, tie_word_embeddings=False,
            **VOCAB[name])
        transformers.Glm4MoeLiteForCausalLM(config).save_pretrained(d)
    elif name == "llama4":
        config = transformers.Llama4TextConfig(
            hidden_size=16, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
            max_position_embeddings=256, **VOCAB[name])
        transformers.Llama4ForCausalLM(config).save_pretrained(d)
    else:
        config = transformers.GptOssConfig(
            hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
            **VOCAB[name])
        transformers.GptOssForCausalLM(config).save_pretrained(d)
    for f in tokenizer_dir(name).iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, d / f.name)


def _start_llama_cpp_vocab(d: Path, out: Path) -> subprocess.Popen:
    """llama.cpp's converter (vocabulary only) started in the background: it runs beside ggufkit's conversion."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    return subprocess.Popen([sys.executable, str(root / "convert_hf_to_gguf.py"), str(d), "--outfile", str(out),
                             "--outtype", "f32", "--vocab-only"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)


#: family -> (checkpoint folder, ggufkit's file, llama.cpp's file), built once per process. pytest sets the
#: module-scoped fixture up again when tests parametrized over a subset of FAMILIES (indirect) interleave with the
#: others (it groups them by parameter index, and index 0 of ("gpt-oss",) is not FAMILIES' index 0); the
#: conversions are then not redone, only the tokenizers reloaded.
_CONVERTED: dict[str, tuple[Path, Path, Path]] = {}


def _converted(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    if name not in _CONVERTED:
        d = tmp_path_factory.mktemp(name) / name
        _write_checkpoint(name, d)
        theirs = d.parent / "theirs.gguf"
        llama_cpp_run = _start_llama_cpp_vocab(d, theirs)
        ours = convert(d, d.parent / "ours.gguf", outtype="f32", vocab_only=True).outputs[0]
        _, stderr = llama_cpp_run.communicate()
        assert llama_cpp_run.returncode == 0, stderr[-3000:]
        _CONVERTED[name] = (d, ours, theirs)
    return _CONVERTED[name]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import llama_cpp
    from tokenizers import Tokenizer

    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    name = request.param
    d, ours, theirs = _converted(name, tmp_path_factory)
    with open_gguf(ours) as f:
        tok = load_tokenizer(f)
    llm = llama_cpp.Llama(model_path=str(ours), vocab_only=True, verbose=False)
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))
    return {"name": name, "dir": d, "ours": ours, "theirs": theirs, "tok": tok, "llm": llm, "hf": hf}


def _tokenizer_keys(path: Path) -> dict[str, Any]:
    with open_gguf(path) as f:
        return {k: (v.type, v.value.tolist() if hasattr(v.value, "tolist") else list(v.value)
                    if isinstance(v.value, (list, tuple)) else v.value)
                for k, v in f.kv.items() if k.startswith("tokenizer.")}


def test_vocabulary_keys_equal_llama_cpps_converter(family: dict) -> None:
    ours, theirs = _tokenizer_keys(family["ours"]), _tokenizer_keys(family["theirs"])
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key] == theirs[key], key
    digest, pre = CHKHSH[family["name"]]
    hf = family["hf"]
    assert chkhsh(lambda text: hf.encode(text).ids) == digest and CHKHSH_TABLE[digest] == pre
    assert ours["tokenizer.ggml.pre"][1] == pre and ours["tokenizer.ggml.model"][1] == "gpt2"
    tokens, types = ours["tokenizer.ggml.tokens"][1], ours["tokenizer.ggml.token_type"][1]
    assert len(tokens) == VOCAB[family["name"]]["vocab_size"]
    assert (ours["tokenizer.ggml.bos_token_id"][1], ours["tokenizer.ggml.eos_token_id"][1]) == BOS_EOS[family["name"]]
    assert ("tokenizer.chat_template" in ours) == (family["name"] != "llama4")  # no Llama 4 template: none written
    if family["name"] == "deepseek-r1":
        assert (tokens[0], types[0]) == ("<｜begin▁of▁sentence｜>", 3)
        assert (tokens[128798], types[128798]) == ("<think>", 4)  # an added, not special, token: USER_DEFINED
        assert len(ours["tokenizer.ggml.merges"][1]) == 127741
    elif family["name"] in GLM_ADDED:
        base = GLM_ADDED[family["name"]]
        assert tokens[base:base + 5] == ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>"]
        assert set(types[base:base + 21]) == {3} and set(types[base + 21:base + 31]) == {4}  # <think>..</arg_value>
        assert (tokens[base + 21], tokens[base + 35]) == ("<think>", "<|video|>")
        assert (ours["tokenizer.ggml.eot_token_id"][1], ours["tokenizer.ggml.eom_token_id"][1]) == (base + 7, base + 9)
        assert tokens[base + 36:] == [f"[PAD{i}]" for i in range(base + 36, len(tokens))] and types[-1] == 5
        assert len(ours["tokenizer.ggml.merges"][1]) == {"glm-4.5": 318088, "glm-4.7-flash": 321649}[family["name"]]
        if family["name"] == "glm-4.7-flash":  # the released template, as llama.cpp keeps a copy of it
            template = llama_cpp_dir() / "models" / "templates" / "GLM-4.7-Flash.jinja"
            assert ours["tokenizer.chat_template"][1] == template.read_text(encoding="utf-8")
    elif family["name"] == "llama4":
        assert tokens[200005:200009] == ["<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>"]
        assert set(types[200000:]) == {3} and tokens[201143] == "<|reasoning_thinking_end|>"
        assert ours["tokenizer.ggml.add_bos_token"][1] is True
    else:
        assert tokens[200005:200009] == ["<|channel|>", "<|start|>", "<|end|>", "<|message|>"]
        assert set(types[199998:200019]) == {3} and tokens[200018] == "<|endofprompt|>"
        assert len(ours["tokenizer.ggml.merges"][1]) == 446189


def _llama_cpp_splits_o200k_as_hf(text: str) -> bool:
    """False for a text where llama.cpp's GPT4O regex approximation (module docstring) may split otherwise."""
    return not any(unicodedata.category(c)[0] == "M" or (ord(c) > 127 and unicodedata.category(c) in ("Lu", "Lt"))
                   for c in text)


def _random_texts(hf: Any, n: int) -> list[str]:
    """Random mixes of what pre-tokenizers tell apart, and of the tokenizer's own added tokens."""
    rng = random.Random(0)
    added = sorted(t.content for t in hf.get_added_tokens_decoder().values())
    pool = [*"aZé'sStTmMdDlLrRvVeE /x", "e\u0301", "\u0928\u093f", "٣", "½", "\u00a0", "\u3000", "\t", "\n", "\r",
            "\r\n", "我", "想", "\U00020001", "が", "カ", "ー", "ß", "İ", "Σ", "ǅ", "123", "4567", "🦙", "❤️", "!", "?",
            "-", "’", "``", '"', ".", "  ", "    ", "def", " the", "𝔘", "ﬁ", *rng.sample(added, 12)]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 16))) for _ in range(n)]


def _detokenize(llm: Any, ids: list[int], special: bool) -> str:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buf, len(buf),
                                   False, special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", errors="replace")


def test_ggufkit_encodes_and_decodes_as_llama_cpp_and_hf(family: dict) -> None:
    tok, llm, hf = family["tok"], family["llm"], family["hf"]
    compared_with_hf = 0
    for text in TEXTS + _random_texts(hf, 120):
        for parse_special in (False, True):
            ids = tok.encode(text, add_special=False, parse_special=parse_special)
            assert ids == llm.tokenize(text.encode(), add_bos=False, special=parse_special), (text, parse_special)
        # HF's tokenizer matches every added token in plain text: llama.cpp's parse_special
        if family["name"] not in O200K or _llama_cpp_splits_o200k_as_hf(text):
            assert ids == hf.encode(text, add_special_tokens=False).ids, text
            compared_with_hf += 1
        for special in (False, True):
            assert tok.decode(ids, special=special) == _detokenize(llm, ids, special), text
    assert compared_with_hf > 40


@pytest.mark.parametrize("family", ["gpt-oss"], indirect=True)
def test_rebuilt_gpt_oss_tokenizer_encodes_as_tiktokens_o200k_harmony(family: dict) -> None:
    """The tokenizer.json rebuilt from o200k_base's ranks (tests/real_tokenizers.py) encodes as tiktoken does with
    them, o200k's pattern and the harmony special tokens: the HF side of the comparisons above is gpt-oss's."""
    import tiktoken
    from real_tokenizers import HARMONY_SPECIALS, O200K_BASE_SHA256, O200K_PATTERN
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(tokenizer_dir("gpt-oss") / "o200k_base.tiktoken"), expected_hash=O200K_BASE_SHA256)
    specials = {HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>"): i for i in range(199998, 200019)}
    enc = tiktoken.Encoding("o200k_harmony", pat_str=O200K_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    for text in TEXTS + _random_texts(family["hf"], 120):
        assert family["hf"].encode(text, add_special_tokens=False).ids == enc.encode(text, allowed_special="all"), text


@pytest.mark.parametrize("family", O200K, indirect=True)
def test_o200k_splits_as_llama_cpps_approximation_where_it_departs_from_hf(family: dict) -> None:
    """A Devanagari letter and its vowel sign (a mark), a non-ASCII capital before an ASCII one: HF keeps one
    piece (one o200k token each), llama.cpp's GPT4O regex two, and ggufkit tokenizes as llama.cpp does."""
    tok, llm, hf = family["tok"], family["llm"], family["hf"]
    for text in ("\u0928\u093f", "\u0130R"):
        ids = tok.encode(text, add_special=False)
        assert ids == llm.tokenize(text.encode(), add_bos=False, special=False), text
        if family["name"] == "gpt-oss":  # both pairs are one token of o200k's
            assert len(hf.encode(text, add_special_tokens=False).ids) == 1 and len(ids) == 2, text


def test_ppl_tokenizes_as_llama_perplexity(family: dict) -> None:
    """``ggufkit ppl``'s tokens of a text (eval/perplexity.py tokenize_text) are llama-perplexity's:
    llama.cpp's tokenizer with add_special and without parse_special, on the file ggufkit wrote."""
    from ggufkit.eval.perplexity import tokenize_text

    sample = (Path(__file__).parents[1] / "eval" / "data" / "sample.txt").read_text(encoding="utf-8")[:6_000]
    text = "\n\n".join([sample, *TEXTS, "<|start|>user<|message|>Hi<|end|> <｜User｜>x<think>y</think><|header_start|>"])
    with open_gguf(family["ours"]) as f:
        ids, add_bos, bos_id = tokenize_text(f, text)
    llm = family["llm"]
    assert ids == llm.tokenize(text.encode(), add_bos=True, special=False)
    assert (add_bos, bos_id) == (ADD_BOS[family["name"]], BOS_EOS[family["name"]][0])
    assert ids[0] == bos_id if add_bos else ids[0] != bos_id
