"""build_vocab: the tokenizer.* keys of SPM, BPE and tiktoken vocabularies, checked against the libraries
that own those formats (sentencepiece, tokenizers/transformers, the .tiktoken file itself)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
from fixtures_tokenizers import (
    CHATML_TEMPLATE,
    LLAMA2_CHAT_TEMPLATE,
    LLAMA3_CHAT_TEMPLATE,
    QWEN1_SPECIALS,
    make_bpe_tokenizer,
    make_spm_tokenizer,
    make_tiktoken_vocab,
)

from ggufkit.converters.vocab import build_vocab, bytes_to_unicode, read_tiktoken
from ggufkit.errors import TokenizerError
from ggufkit.format.values import VT, python_value

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def values(md) -> dict:
    return {k: python_value(v) for k, v in md.items()}


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("spm")
    make_spm_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def bpe_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for flavor in ("llama-bpe", "qwen2", "gpt-2"):
        out[flavor] = tmp_path_factory.mktemp(flavor)
        make_bpe_tokenizer(out[flavor], flavor=flavor)
    return out


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen1")
    make_tiktoken_vocab(d)
    return d


def test_spm_tokens_scores_and_types_come_from_sentencepiece(spm_dir):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    md = build_vocab(spm_dir, "spm", vocab_size=sp.vocab_size() + 4)
    v = values(md)
    assert list(v)[:5] == ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                           "tokenizer.ggml.scores", "tokenizer.ggml.token_type"]
    assert v["tokenizer.ggml.model"] == "llama" and v["tokenizer.ggml.pre"] == "default"
    n = sp.vocab_size()
    tokens, scores, types = v["tokenizer.ggml.tokens"], v["tokenizer.ggml.scores"], list(v["tokenizer.ggml.token_type"])
    assert tokens[:n] == [sp.id_to_piece(i) for i in range(n)]
    # the padding rows: unique fillers, llama.cpp's score and type
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 4)]
    assert list(scores[n:]) == [-10000.0] * 4 and types[n:] == [UNUSED] * 4
    for i in range(3, n):
        assert scores[i] == pytest.approx(sp.get_score(i))
        assert types[i] == (BYTE if sp.is_byte(i) else NORMAL)
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    # <unk>, <s>, </s> are flagged special in added_tokens_decoder: CONTROL with score -1000, as llama.cpp
    assert types[:3] == [CONTROL] * 3 and list(scores[:3]) == [-1000.0] * 3
    assert md["tokenizer.ggml.scores"].item_type == VT.FLOAT32
    assert md["tokenizer.ggml.token_type"].item_type == VT.INT32
    assert (v["tokenizer.ggml.bos_token_id"], v["tokenizer.ggml.eos_token_id"], v["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    assert v["tokenizer.ggml.add_bos_token"] is True and v["tokenizer.ggml.add_eos_token"] is False
    assert v["tokenizer.chat_template"] == LLAMA2_CHAT_TEMPLATE
    assert "tokenizer.ggml.merges" not in v and "tokenizer.ggml.add_space_prefix" not in v


def test_spm_added_tokens_json_and_user_defined_tokens(spm_dir, tmp_path):
    d = tmp_path / "spm"
    shutil.copytree(spm_dir, d)
    # 400 is past the embedding: left out, as llama.cpp does
    (d / "added_tokens.json").write_text(json.dumps({"<extra>": 320, "<tool>": 321, "<pad>": 400}))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["321"] = {"content": "<tool>", "special": True}
    cfg["added_tokens_decoder"]["322"] = {"content": "\u2581hello", "special": False}
    cfg["added_tokens_decoder"]["323"] = {"content": "<|im_end|>", "special": False}  # looks special
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    v = values(build_vocab(d, "spm", vocab_size=330))
    tokens, types, scores = v["tokenizer.ggml.tokens"], list(v["tokenizer.ggml.token_type"]), v["tokenizer.ggml.scores"]
    assert tokens[320:325] == ["<extra>", "<tool>", " hello", "<|im_end|>", "[PAD324]"]
    assert types[320:325] == [USER_DEFINED, CONTROL, USER_DEFINED, CONTROL, UNUSED]
    assert list(scores[320:324]) == [-1000.0] * 4
    assert len(tokens) == 330 and "<pad>" not in tokens


def test_spm_without_dummy_prefix_says_so(tmp_path):
    import io

    import sentencepiece as spm
    from fixtures_tokenizers import corpus_lines

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line.lower() for line in corpus_lines()[:2000]]), model_writer=model,
        vocab_size=320, model_type="bpe", byte_fallback=True, character_coverage=0.98, add_dummy_prefix=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    v = values(build_vocab(tmp_path, "spm", vocab_size=320))
    assert v["tokenizer.ggml.add_space_prefix"] is False
    assert (v["tokenizer.ggml.bos_token_id"], v["tokenizer.ggml.eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("flavor", ["llama-bpe", "qwen2", "gpt-2"])
def test_bpe_tokens_merges_and_specials_come_from_tokenizer_json(bpe_dirs, flavor):
    d = bpe_dirs[flavor]
    tj = json.loads((d / "tokenizer.json").read_text())
    n = 400
    v = values(build_vocab(d, "bpe", vocab_size=n + 3))
    assert list(v)[:5] == ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                           "tokenizer.ggml.token_type", "tokenizer.ggml.merges"]
    assert v["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.scores" not in v
    assert v["tokenizer.ggml.pre"] == flavor  # by behaviour: a freshly trained vocabulary has no known hash
    tokens, types = v["tokenizer.ggml.tokens"], list(v["tokenizer.ggml.token_type"])
    by_id = {i: t for t, i in tj["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tj["added_tokens"]}
    assert tokens[:n] == [by_id[i] for i in range(n)]
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 3)]
    specials = {a["id"] for a in tj["added_tokens"]}
    assert types == [CONTROL if i in specials else UNUSED if i >= n else NORMAL for i in range(n + 3)]
    assert v["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    if flavor == "llama-bpe":
        assert v["tokenizer.ggml.bos_token_id"] == ids["<|begin_of_text|>"]
        assert v["tokenizer.ggml.eos_token_id"] == ids["<|end_of_text|>"]
        assert v["tokenizer.ggml.add_bos_token"] is True  # from the TemplateProcessing post-processor
        assert v["tokenizer.chat_template"] == LLAMA3_CHAT_TEMPLATE
    elif flavor == "qwen2":
        # no bos in the files: the end-of-text token, rather than llama.cpp's BPE default id 11
        assert v["tokenizer.ggml.bos_token_id"] == v["tokenizer.ggml.eos_token_id"] == ids["<|endoftext|>"]
        assert v["tokenizer.ggml.padding_token_id"] == ids["<|endoftext|>"]
        assert v["tokenizer.ggml.add_bos_token"] is False
        assert v["tokenizer.chat_template"] == CHATML_TEMPLATE
    else:
        eot = ids["<|endoftext|>"]
        assert (v["tokenizer.ggml.bos_token_id"], v["tokenizer.ggml.eos_token_id"]) == (eot, eot)
        assert "tokenizer.chat_template" not in v
    assert v["tokenizer.ggml.add_eos_token"] is False


def test_bpe_template_ending_in_another_token_makes_it_eos_and_the_old_one_eot(bpe_dirs, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(bpe_dirs["llama-bpe"], d)
    tj = json.loads((d / "tokenizer.json").read_text())
    eot_id = next(a["id"] for a in tj["added_tokens"] if a["content"] == "<|eot_id|>")
    proc = tj["post_processor"]["processors"][1]
    proc["single"].append({"SpecialToken": {"id": "<|eot_id|>", "type_id": 0}})
    proc["special_tokens"]["<|eot_id|>"] = {"id": "<|eot_id|>", "ids": [eot_id], "tokens": ["<|eot_id|>"]}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    v = values(build_vocab(d, "bpe", vocab_size=400, pre_tokenizer="llama-bpe"))
    end_of_text = v["tokenizer.ggml.tokens"].index("<|end_of_text|>")
    assert v["tokenizer.ggml.eos_token_id"] == eot_id
    assert v["tokenizer.ggml.eot_token_id"] == end_of_text
    assert v["tokenizer.ggml.add_eos_token"] is True


def test_chat_templates_from_jinja_files_and_json(bpe_dirs, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(bpe_dirs["qwen2"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert values(build_vocab(d, "bpe", vocab_size=400))["tokenizer.chat_template"] == "from json"
    (d / "chat_template.jinja").write_text("default {{ x }}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool-use.jinja").write_text("tools")
    (d / "additional_chat_templates" / "rag.jinja").write_text("rag")
    v = values(build_vocab(d, "bpe", vocab_size=400))
    keys = [k for k in v if k.startswith("tokenizer.chat_template")]
    assert keys == ["tokenizer.chat_template.rag", "tokenizer.chat_template.tool_use", "tokenizer.chat_templates",
                    "tokenizer.chat_template"]
    assert v["tokenizer.chat_template"] == "default {{ x }}"
    assert v["tokenizer.chat_template.tool_use"] == "tools"
    assert v["tokenizer.chat_templates"] == ["rag", "tool_use"]


def test_special_ids_fall_back_to_config_json(bpe_dirs, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(bpe_dirs["qwen2"], d)
    (d / "config.json").write_text(json.dumps({"bos_token_id": 398, "eos_token_id": 5, "pad_token_id": 4000}))
    v = values(build_vocab(d, "bpe", vocab_size=400))
    assert v["tokenizer.ggml.bos_token_id"] == 398  # not set by the tokenizer files
    assert v["tokenizer.ggml.eos_token_id"] == 397  # tokenizer_config.json wins over config.json
    assert v["tokenizer.ggml.padding_token_id"] == 397


def test_tiktoken_vocab_is_read_directly(tiktoken_dir):
    ranks = read_tiktoken(tiktoken_dir / "qwen.tiktoken")
    n = len(ranks)
    v = values(build_vocab(tiktoken_dir, "tiktoken", vocab_size=n + len(QWEN1_SPECIALS) + 2))
    assert v["tokenizer.ggml.model"] == "gpt2" and v["tokenizer.ggml.pre"] == "qwen2"
    chars = bytes_to_unicode()
    tokens, types = v["tokenizer.ggml.tokens"], list(v["tokenizer.ggml.token_type"])
    for tok, rank in ranks.items():
        assert tokens[rank] == "".join(chars[b] for b in tok)
    assert tokens[n:n + len(QWEN1_SPECIALS)] == list(QWEN1_SPECIALS)
    assert types == [NORMAL] * n + [CONTROL] * len(QWEN1_SPECIALS) + [UNUSED] * 2
    # one merge per multi-byte token, in rank order, whose parts concatenate to it
    multi = [t for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1]
    merges = v["tokenizer.ggml.merges"]
    assert len(merges) == len(multi)
    assert [m.replace(" ", "") for m in merges] == ["".join(chars[b] for b in t) for t in multi]
    eot = n
    assert (v["tokenizer.ggml.bos_token_id"], v["tokenizer.ggml.eos_token_id"], v["tokenizer.ggml.unknown_token_id"]) == (eot, eot, eot)


def test_tiktoken_specials_past_a_small_embedding_are_left_out(tiktoken_dir):
    n = len(read_tiktoken(tiktoken_dir / "qwen.tiktoken"))
    v = values(build_vocab(tiktoken_dir, "tiktoken", vocab_size=n + 3))
    assert v["tokenizer.ggml.tokens"][n:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    with pytest.raises(TokenizerError, match="3 special ones"):
        build_vocab(tiktoken_dir, "tiktoken", vocab_size=n + 2)


@pytest.mark.parametrize(("content", "message"), [
    ("IQ== 0\nIQ== 1\n", "listed twice"),
    ("IQ== 0\nIg== 2\n", "ranks must be 0..n-1"),
    ("IQ==\n", "expected 'base64 rank'"),
    ("!!!! 0\n", "line 1"),
])
def test_malformed_tiktoken_file_is_a_clear_error(tmp_path, content, message):
    (tmp_path / "qwen.tiktoken").write_text(content)
    with pytest.raises(TokenizerError, match=message):
        build_vocab(tmp_path, "tiktoken", vocab_size=1000)


def test_tiktoken_token_that_is_not_a_merge_is_refused(tmp_path):
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines.append(f"{base64.b64encode(b'abc').decode()} 256")  # no 'ab' or 'bc' below it
    (tmp_path / "qwen.tiktoken").write_text("\n".join(lines))
    with pytest.raises(TokenizerError, match="not the merge of two lower-ranked tokens"):
        build_vocab(tmp_path, "tiktoken", vocab_size=600)


def test_sentencepiece_style_tokenizer_json_without_tokenizer_model_is_refused(bpe_dirs, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(bpe_dirs["gpt-2"], d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = True
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(TokenizerError, match=r"sentencepiece-style BPE .* add the checkpoint's tokenizer\.model"):
        build_vocab(d, "bpe", vocab_size=400)


def test_vocab_larger_than_the_embedding_is_refused(spm_dir, bpe_dirs):
    with pytest.raises(TokenizerError, match="vocab_size is 300"):
        build_vocab(spm_dir, "spm", vocab_size=300)
    with pytest.raises(TokenizerError, match="vocab_size is 399"):
        build_vocab(bpe_dirs["gpt-2"], "bpe", vocab_size=399)


def test_duplicate_token_texts_are_refused(spm_dir, tmp_path):
    d = tmp_path / "spm"
    shutil.copytree(spm_dir, d)
    (d / "added_tokens.json").write_text(json.dumps({"<s>": 320}))
    with pytest.raises(TokenizerError, match=r"'<s>' appears twice \(ids 1 and 320\)"):
        build_vocab(d, "spm", vocab_size=321)


def test_missing_or_broken_files_are_clear_errors(tmp_path, bpe_dirs):
    with pytest.raises(TokenizerError, match=r"tokenizer\.model not found"):
        build_vocab(tmp_path, "spm", vocab_size=10)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found"):
        build_vocab(tmp_path, "bpe", vocab_size=10)
    with pytest.raises(TokenizerError, match=r"qwen\.tiktoken not found"):
        build_vocab(tmp_path, "tiktoken", vocab_size=10)
    with pytest.raises(TokenizerError, match="unknown vocabulary kind 'wpm'"):
        build_vocab(tmp_path, "wpm", vocab_size=10)
    (tmp_path / "tokenizer.model").write_bytes(b"not a protobuf")
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        build_vocab(tmp_path, "spm", vocab_size=10)
    d = tmp_path / "bpe"
    shutil.copytree(bpe_dirs["gpt-2"], d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        build_vocab(d, "bpe", vocab_size=400)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json must hold a JSON object"):
        build_vocab(d, "bpe", vocab_size=400)
