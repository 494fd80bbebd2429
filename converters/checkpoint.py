"""Hugging Face checkpoints: find the weight files, list their tensors from headers only, read one at a time.

Safetensors headers (``u64`` length + JSON) are parsed by hand and every range is checked against the file
size before anything is mapped; tensors are then ``np.memmap`` views, so reading one costs only its own
pages. ``.bin``/``.pt`` pickles go through ``torch.load(weights_only=True, mmap=True)``; a pickle that needs
more than tensors and plain containers is refused with :class:`~ggufkit.errors.CheckpointError`.
BF16 tensors are returned as their raw ``uint16`` bit patterns (numpy has no bfloat16).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufkit.errors import CheckpointError
from ggufkit.format.tensor_shape import n_elements
from ggufkit.format.values import PendingString

#: safetensors dtype -> numpy dtype of the bytes as stored (BF16 as raw bits).
SAFETENSORS_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
    # FP8 as raw bytes: read only through a dequantizing loader (converters/quantized_source.py)
    "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}
#: A safetensors header larger than this is refused before it is read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


#: sha256 of weight files hashed (or being hashed) by this process, by (real path, inode, size, mtime_ns).
_SHA256_SEEN: dict[tuple[str, int, int, int], Future[str]] = {}
_SHA256_LOCK = threading.Lock()


def _hash_file(file: Path, result: Future[str]) -> None:
    try:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)  # releases the GIL: conversion goes on beside it
        result.set_result(h.hexdigest())
    except BaseException as exc:  # handed to whoever reads the result
        result.set_exception(exc)


def _file_sha256(file: Path) -> Future[str]:
    """The file's sha256, hashed once per process in a daemon thread (a failed run does not wait for it)."""
    st = os.stat(file)
    key = (os.path.realpath(file), st.st_ino, st.st_size, st.st_mtime_ns)
    with _SHA256_LOCK:
        result = _SHA256_SEEN.get(key)
        if result is None:
            result = _SHA256_SEEN[key] = Future()
            threading.Thread(target=_hash_file, args=(file, result), daemon=True, name="sha256").start()
    return result


def checkpoint_inputs(model_dir: Path, weight_files: list[Path] | None = None) -> list[Path]:
    """Every file of a checkpoint directory a conversion may read: its weight files and the files the hub
    keeps beside them (:data:`_HUB_PATTERNS`: config, tokenizer, chat templates, model card, indexes), for
    :func:`ggufkit.outputs.refuse_overwriting_inputs`. A GGUF left in the folder is not one of them, so
    converting again over the previous output stays allowed."""
    d = Path(model_dir)
    found = {p for pattern in _HUB_PATTERNS for p in d.glob(pattern) if p.is_file()}
    found |= {p for p in d.glob("additional_chat_templates/*.jinja") if p.is_file()}
    found |= set(weight_files or [])
    return sorted(found)


@dataclass(frozen=True)
class SourceTensor:
    """A tensor in a checkpoint, known from its file's header.

    Attributes:
        name: HF name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        shape: torch/numpy order.
        dtype: safetensors dtype name (``F32``, ``F16``, ``BF16``, ...).
        file: the file holding it.
        offset: absolute byte offset of its data in ``file`` (-1 for torch pickles).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path
    offset: int = -1

    @property
    def n_elements(self) -> int:
        return n_elements(self.shape)


#: What a conversion reads from a hub snapshot.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.model", "*.tiktoken", "*.jinja", "*.txt", "*.md"]


def resolve_model(model: str | Path) -> tuple[Path, str | None, str | None]:
    """A local checkpoint directory, or a hub repo id resolved through huggingface_hub's cache.

    A repo id found in the local cache (``HF_HOME`` / ``HF_HUB_CACHE``) is used without any network
    access. Otherwise it is downloaded with ``snapshot_download`` (huggingface_hub's own progress bars on
    stderr), unless ``HF_HUB_OFFLINE=1``.

    Returns:
        (directory, repo id or None, revision or None).

    Raises:
        CheckpointError: not a directory and not a repo id; a repo id neither cached nor downloadable
            (offline mode, no network, unknown repo), named in the message.
    """
    path = Path(model)
    if path.is_dir():
        return path, None, None
    if path.exists():
        raise CheckpointError("expected a checkpoint directory (config.json and weights), got a file", path=path)
    text = str(model)
    if not _REPO_ID.match(text):
        raise CheckpointError("no such directory, and not a hub repo id (org/name)", path=path)
    from huggingface_hub import constants, snapshot_download

    try:
        local = Path(snapshot_download(text, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        if (local / "config.json").is_file():
            return local, text, local.name
    except Exception:  # huggingface_hub: not in the cache (LocalEntryNotFoundError and relatives)
        pass
    if constants.is_offline_mode():
        raise CheckpointError(f"hub repo {text!r} is not in the local cache and HF_HUB_OFFLINE=1 forbids "
                              "downloading it; unset HF_HUB_OFFLINE or give a local checkpoint directory")
    try:
        local = Path(snapshot_download(text, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # network, authentication and not-found errors of huggingface_hub
        raise CheckpointError(f"hub repo {text!r} could not be downloaded: {' '.join(str(exc).split())[:300]}"
                              ) from None
    return local, text, local.name


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` as a dict (``text_config`` merged onto the root, as llama.cpp does)."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError("config.json not found; is this a Hugging Face checkpoint?", path=model_dir) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"config.json is unreadable: {exc}", path=path) from None
    if not isinstance(config, dict):
        raise CheckpointError("config.json is not a JSON object", path=path)
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    return config


def parse_safetensors_header(path: Path) -> list[SourceTensor]:
    """Tensors of one safetensors file, from its header alone, with every range checked."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError("file too short for a safetensors header", path=path)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"safetensors header length {n} is impossible for a {size}-byte file", path=path)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"safetensors header is not JSON: {exc}", path=path) from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object", path=path)
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            np_dtype = SAFETENSORS_DTYPES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"tensor {name!r}: malformed or unsupported header entry {info!r}"[:300],
                                  path=path) from None
        count = 1
        for d in shape:
            if d < 0:
                raise CheckpointError(f"tensor {name!r}: negative dimension", path=path)
            count *= d
        if end - begin != count * np_dtype.itemsize or begin < 0 or 8 + n + end > size:
            raise CheckpointError(f"tensor {name!r}: data range [{begin}, {end}) does not match its shape "
                                  f"{list(shape)} {dtype} or lies outside the file", path=path)
        out.append(SourceTensor(name, shape, dtype, path, 8 + n + begin))
    return sorted(out, key=lambda t: t.name)


def _torch_dtype_name(dtype: Any) -> str:
    import torch

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    if dtype not in names:
        raise CheckpointError(f"unsupported tensor dtype {dtype}")
    return names[dtype]


def load_torch_state_dict(path: Path) -> dict[str, Any]:
    """A ``.bin``/``.pt`` state dict, loaded with ``weights_only=True`` (never arbitrary unpickling).

    Raises:
        CheckpointError: the pickle needs more than tensors and plain containers (it could run code),
            or it is not a flat name -> tensor mapping.
    """
    import pickle

    import torch

    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise
            # Legacy (pre-zip) pickles cannot be memory-mapped; still weights_only.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"refused to load: the pickle needs more than tensors ({first[:200]}); only "
                              "weights_only pickles are loaded, convert it to safetensors", path=path) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"not a readable torch checkpoint: {' '.join(str(exc).split())[:200]}",
                              path=path) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError("expected a flat state dict of name -> tensor", path=path)
    return state


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A CPU tensor as numpy; bfloat16 as raw uint16 bits."""
    import torch

    t = tensor.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class Checkpoint:
    """The weights of a checkpoint directory, listed from headers and read one tensor at a time.

    Files: ``model.safetensors.index.json`` (its ``weight_map``), else ``model*.safetensors``, else
    ``pytorch_model.bin.index.json``, else ``pytorch_model*.bin`` / ``*.pt``.

    Args:
        model_dir: the checkpoint directory.

    Raises:
        CheckpointError: no weights, an index naming missing files, a tensor in two files, malformed headers.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = self._discover()
        self.tensors: dict[str, SourceTensor] = {}
        for file in self.files:
            for t in self._list(file):
                if t.name in self.tensors:
                    raise CheckpointError(f"tensor {t.name!r} appears in {self.tensors[t.name].file.name} and "
                                          f"{file.name}", path=self.model_dir)
                self.tensors[t.name] = t
        self._torch_cache: tuple[Path, dict[str, Any]] | None = None
        #: every tensor as stored; ``tensors`` is what a conversion sees (a quantized source's scales left out)
        self.stored: dict[str, SourceTensor] = dict(self.tensors)
        #: tensors computed from stored ones (a quantized source's dequantized weights), by name: ``read``
        #: calls these instead of reading bytes (converters/quantized_source.py installs them)
        self.derived: dict[str, Callable[[], np.ndarray]] = {}
        #: the weights dequantized from FP8 (llama.cpp's ``_fp8_dequantized``, for ``--fp8-as-q8``)
        self.fp8_sources: set[str] = set()

    def _discover(self) -> list[Path]:
        d = self.model_dir
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = d / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                    names = sorted(set(weight_map.values()))
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    raise CheckpointError("index file has no usable weight_map", path=index) from None
                missing = [n for n in names if not (d / n).is_file() or "/" in n or n.startswith(".")]
                if missing:
                    raise CheckpointError(f"index names missing or invalid files: {', '.join(missing[:5])}",
                                          path=index)
                return [d / n for n in names]
        for pattern in ("model*.safetensors", "*.safetensors", "pytorch_model*.bin", "*.bin", "*.pt", "*.pth"):
            found = sorted(p for p in d.glob(pattern) if p.is_file())
            if found:
                return found
        raise CheckpointError("no weight files (*.safetensors, pytorch_model*.bin, *.pt) found", path=d)

    def _list(self, file: Path) -> list[SourceTensor]:
        if file.suffix == ".safetensors":
            return parse_safetensors_header(file)
        state = load_torch_state_dict(file)
        out = [SourceTensor(k, tuple(v.shape), _torch_dtype_name(v.dtype), file) for k, v in state.items()]
        del state
        return sorted(out, key=lambda t: t.name)

    def __iter__(self) -> Iterator[SourceTensor]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def read(self, name: str) -> np.ndarray:
        """One tensor as numpy (a read-only memmap view for safetensors; BF16 as uint16 bits)."""
        derived = self.derived.get(name)
        if derived is not None:
            return derived()
        dtype = self.stored[name].dtype
        if dtype.startswith("F8_"):  # its bytes are not its values: never read as numbers
            raise CheckpointError(f"tensor {name!r} is stored as {dtype}; only the conversion of the text model "
                                  "dequantizes FP8 checkpoints", path=self.model_dir)
        return self.read_stored(name)

    def read_stored(self, name: str) -> np.ndarray:
        """One tensor's stored data, as :meth:`read` returns it for a tensor nothing derives."""
        t = self.stored[name]
        if t.offset >= 0:
            dtype = SAFETENSORS_DTYPES[t.dtype]
            if t.n_elements == 0:
                return np.zeros(t.shape, dtype)
            return np.memmap(t.file, dtype=dtype, mode="r", offset=t.offset, shape=t.shape)
        if self._torch_cache is None or self._torch_cache[0] != t.file:
            self._torch_cache = None
            self._torch_cache = (t.file, load_torch_state_dict(t.file))
        return torch_to_numpy(self._torch_cache[1][name])

    def close(self) -> None:
        self._torch_cache = None

    def sha256(self, only: set[Path] | None = None) -> list[tuple[str, str]]:
        """(file name, sha256 hex) of every weight file (or of those in ``only``), hashed in 4 MiB chunks.

        Remembered per file identity (path, inode, size, mtime) for the life of the process, so that
        ``convert --with-mmproj`` (text model, then projector) hashes each weight file once.
        """
        return [(name, result.result()) for name, result in self._hashing(only)]

    def sha256_value(self, only: set[Path] | None = None) -> PendingString:
        """The ``ggufkit.source.sha256`` value (``HASH  NAME`` lines), hashed in the background meanwhile.

        The files are hashed in threads started now; the writer rewrites its header once they finish, so
        hashing overlaps the conversion (0.7 s of a 0.66 GB projector's 3.6 s) instead of preceding it.
        """
        hashing = self._hashing(only)
        placeholder = "\n".join(f"{'0' * 64}  {name}" for name, _ in hashing)
        done: Future[str] = Future()
        lock = threading.Lock()  # callbacks run in the hashing threads: one of them completes ``done``

        def on_done(_: object) -> None:
            with lock:
                if done.done() or not all(r.done() for _, r in hashing):
                    return
                try:
                    done.set_result("\n".join(f"{r.result()}  {name}" for name, r in hashing))
                except BaseException as exc:  # read by the writer
                    done.set_exception(exc)

        for _, r in hashing:
            r.add_done_callback(on_done)
        on_done(None)
        return PendingString(placeholder, done)

    def _hashing(self, only: set[Path] | None) -> list[tuple[str, Future[str]]]:
        return [(os.path.relpath(file, self.model_dir), _file_sha256(file)) for file in self.files
                if only is None or file in only]
