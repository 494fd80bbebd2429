"""Output metadata and naming: general.*, hyperparameters, vocabulary, provenance; hub file names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import GGML_QUANT_VERSION, Keys
from gguf.utility import model_weight_count_rounded_notation

from ggufkit.constants import (
    KEY_POWERINFER_SPARSE_THRESHOLD,
    KEY_SOURCE_REPO,
    KEY_SOURCE_REVISION,
    KEY_SOURCE_SHA256,
    KEY_TOOL_VERSION,
)
from ggufkit.converters.hparams import hparams_metadata
from ggufkit.converters.plan_types import PlanEntry, Source
from ggufkit.converters.powerinfer import predictor_threshold
from ggufkit.errors import CheckpointError, UsageError
from ggufkit.format.tensor_shape import n_elements
from ggufkit.format.values import VT, EncodableValue, Metadata
from ggufkit.outputs import resolve_output

if TYPE_CHECKING:
    from ggufkit.converters.pretokenizer import PreTokenizerMatch

G = Keys.General


def size_label(n_params: int) -> str:
    """``494M``, ``7.6B``: the hub's size label (gguf's own rounding)."""
    return model_weight_count_rounded_notation(n_params, min_digits=2)


def default_name(model_dir: Path, repo: str | None) -> str:
    return (repo.split("/")[-1] if repo else model_dir.resolve().name) or "model"


def model_file_name(basename: str, label: str | None, ftype_name: str, vocab_only: bool = False,
                    prefix: str = "") -> str:
    """The hub's file name: ``{basename}-{size_label}-{FTYPE}.gguf`` (``-vocab`` for a vocabulary-only
    file; ``prefix`` ``mmproj-`` for a projector), as llama.cpp's converter names its default output."""
    parts = [basename.replace(" ", "-").replace("/", "-")] + ([label] if label else []) + [ftype_name.upper()]
    return prefix + "-".join(parts) + ("-vocab" if vocab_only else "") + ".gguf"


def output_path(output: str | Path | None, model_dir: Path, repo: str | None, file_name: str,
                ftype_name: str) -> Path:
    """Where ``convert`` (and ``--mmproj``) writes: ``-o`` as :func:`ggufkit.outputs.resolve_output` reads it
    (a file; a folder, or a path ending in a separator, holding ``file_name``; a template whose ``{type}``,
    ``{ftype}``, ``{outtype}`` and upper-case forms become ``ftype_name``), or ``file_name`` in the model
    directory (the current one for hub ids).

    Raises:
        UsageError: a path ending in a separator whose folder does not exist, or an unknown placeholder.
    """
    return resolve_output(output, file_name, Path.cwd() if repo else model_dir, type_name=ftype_name)


def read_metadata_file(path: Path | None) -> dict[str, Any]:
    """``--metadata FILE``: a JSON object of ``general.*`` keys (strings, numbers, booleans, string lists)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metadata {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--metadata {path}: expected a JSON object")
    for key, value in data.items():
        ok = isinstance(value, (str, int, float, bool)) or (isinstance(value, list)
                                                             and all(isinstance(v, str) for v in value))
        if not key.startswith("general.") or not ok or key in (G.ARCHITECTURE, G.FILE_TYPE):
            raise UsageError(f"--metadata {path}: key {key!r} must be a general.* key other than architecture "
                             "and file_type, with a string, number, boolean or string-list value")
    return data


def _set_general(meta: Metadata, key: str, value: Any) -> None:
    if isinstance(value, bool):
        meta.set(key, VT.BOOL, value)
    elif isinstance(value, int):
        meta.set(key, VT.UINT32 if value >= 0 else VT.INT32, value)
    elif isinstance(value, float):
        meta.set(key, VT.FLOAT32, value)
    elif isinstance(value, list):
        meta.set(key, VT.ARRAY, value, VT.STRING)
    else:
        meta.set(key, VT.STRING, value)



def model_card_metadata(model_dir: Path, own: Mapping[str, EncodableValue], n_params: int) -> Metadata:
    """The ``general.*`` keys llama.cpp's converter writes about the model, in its order:
    ``general.sampling.*`` (generation_config.json), author, version, organization, finetune, description,
    license, URLs, ``general.base_model.*``, ``general.dataset.*``, tags, languages (README.md front matter
    and config.json's ``_name_or_path``).

    Read and written by gguf-py itself, as convert_hf_to_gguf.py's ``prepare_metadata`` does
    (``gguf.Metadata.load``, then ``Metadata.set_gguf_meta_model`` into a ``GGUFWriter``), with two
    differences: the keys already in ``own`` (ggufkit's type, name, basename, size label and hub address)
    keep ggufkit's values, and nothing is guessed from the folder's name (llama.cpp splits it into basename,
    size label, finetune and version, where ggufkit's basename is the whole name). A front matter that is not
    YAML gives no keys, as a README without one.
    """
    import yaml
    from gguf import GGUFWriter
    from gguf.metadata import Metadata as CardMetadata

    writer = GGUFWriter(None, "")  # records the add_* calls in writer.kv_data; writes nothing
    try:
        card = CardMetadata.load(None, model_dir, None, n_params)
        # llama.cpp's reading without the folder-name guesses (apply_metadata_heuristic's last step)
        unguessed = CardMetadata.apply_metadata_heuristic(CardMetadata(), CardMetadata.load_model_card(model_dir),
                                                           CardMetadata.load_hf_parameters(model_dir), None,
                                                           n_params)
        card.organization, card.finetune, card.version = (unguessed.organization, unguessed.finetune,
                                                          unguessed.version)
        card.name, card.basename, card.size_label = "", None, None  # ggufkit's own, in ``own``
        card.set_gguf_meta_model(writer)
    except (yaml.YAMLError, OSError, ValueError, TypeError, AttributeError):
        return Metadata()
    out = Metadata()
    for key, gv in writer.kv_data[0].items():
        if key in own or key == G.ARCHITECTURE:
            continue
        if gv.type == VT.ARRAY:  # tags, languages: strings (a YAML number among them is written as text)
            out.set(key, VT.ARRAY, [v if isinstance(v, str) else str(v) for v in gv.value], VT.STRING)
        elif gv.type == VT.STRING:
            out.set(key, VT.STRING, gv.value if isinstance(gv.value, str) else str(gv.value))
        else:
            out.set(key, gv.type, gv.value)
    return out


def build_metadata(src: Source, hp: Mapping[str, tuple[VT, Any]], entries: list[PlanEntry], file_type: int,
              vocab_only: bool, metadata_file: Path | None, powerinfer: bool, predictor: Path | None,
              pre_tokenizer: str | None) -> tuple[Metadata, PreTokenizerMatch | None]:
    """Every key of the output except tensor layout, in llama.cpp\'s order, and how the pre-tokenizer was
    chosen (None without a vocabulary that has one)."""
    from ggufkit import __version__

    entry = src.entry
    meta = Metadata()
    meta.set(G.ARCHITECTURE, VT.STRING, entry.arch)
    meta.set(G.TYPE, VT.STRING, "model")
    overrides = read_metadata_file(metadata_file)
    name = overrides.get(G.NAME, default_name(src.model_dir, src.repo))
    meta.set(G.NAME, VT.STRING, str(name))
    meta.set(G.BASENAME, VT.STRING, str(overrides.get(G.BASENAME, name)).replace(" ", "-"))
    n_params = sum(n_elements(e.shape) for e in entries)
    if not vocab_only:
        meta.set(G.SIZE_LABEL, VT.STRING, str(overrides.get(G.SIZE_LABEL, size_label(n_params))))
    if src.repo:
        meta.set(G.SOURCE_REPO_URL, VT.STRING, f"https://huggingface.co/{src.repo}")
    own = set(meta)
    for key, value in model_card_metadata(src.model_dir, meta, 0 if vocab_only else n_params).items():
        meta.put(key, value)
    for key, value in overrides.items():
        if key not in own:  # --metadata wins over the model card
            _set_general(meta, key, value)
    for key, value in hparams_metadata(hp).items():
        meta.put(key, value)
    meta.set(G.FILE_TYPE, VT.UINT32, file_type)
    if powerinfer and predictor is not None:
        threshold = predictor_threshold(predictor)
        if threshold is not None:
            meta.set(KEY_POWERINFER_SPARSE_THRESHOLD, VT.FLOAT32, threshold)
    meta.set(G.QUANTIZATION_VERSION, VT.UINT32, GGML_QUANT_VERSION)
    vocab, pre_match = _vocab(src, pre_tokenizer, entries)
    for key, value in vocab.items():
        meta.put(key, value)
    meta.set(KEY_TOOL_VERSION, VT.STRING, __version__)
    if src.checkpoint is not None:
        meta.put(KEY_SOURCE_SHA256, src.checkpoint.sha256_value())
    if src.repo:
        meta.set(KEY_SOURCE_REPO, VT.STRING, src.repo)
    if src.revision:
        meta.set(KEY_SOURCE_REVISION, VT.STRING, src.revision)
    return meta, pre_match



def _llama_hf(d: Path) -> bool:
    """No tokenizer.model, and a tokenizer.json llama.cpp's LlamaHfVocab takes."""
    from ggufkit.converters.vocab_llama_hf import is_llama_hf

    path = d / "tokenizer.json"
    if (d / "tokenizer.model").is_file() or not path.is_file():
        return False
    try:
        return is_llama_hf(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def _vocab(src: Source, pre_tokenizer: str | None,
           entries: list[PlanEntry]) -> tuple[Metadata, PreTokenizerMatch | None]:
    from ggufkit.converters.vocab import build_vocab_and_pre

    entry, d = src.entry, src.model_dir
    kind = entry.vocab[-1]
    for candidate in entry.vocab:
        if (candidate == "spm" and (d / "tokenizer.model").is_file()) or \
           (candidate == "llama_hf" and _llama_hf(d)) or \
           (candidate == "bpe" and (d / "tokenizer.json").is_file()) or \
           (candidate == "tiktoken" and any(d.glob("*.tiktoken"))):
            kind = candidate
            break
    vocab_size = src.config.get("vocab_size")
    emb = next((e for e in entries if e.name == "token_embd.weight"), None)
    if emb is not None:
        vocab_size = emb.shape[0]
    if not isinstance(vocab_size, int):
        raise CheckpointError("config.json has no vocab_size", path=d)
    vocab, pre_match = build_vocab_and_pre(d, kind, vocab_size=vocab_size, pre_tokenizer=pre_tokenizer,
                                           special_by_flag=entry.special_by_flag)
    if entry.add_space_prefix is not None:  # the family's converter sets it whatever the tokenizer says
        vocab.set("tokenizer.ggml.add_space_prefix", VT.BOOL, entry.add_space_prefix)
    return vocab, pre_match
