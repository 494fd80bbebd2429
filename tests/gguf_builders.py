"""Test helpers: small GGUF files written by ggufkit, and a byte-level builder for crafted (malformed) files.

The byte-level builder deliberately does not use ggufkit's writer, so a test can put any count, length,
type id or offset into a file, including ones the writer refuses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.format import Metadata, TensorSpec, write_gguf
from ggufkit.format.values import VT


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv_str(key: str | bytes, value: str | bytes) -> bytes:
    return gstr(key) + u32(int(VT.STRING)) + gstr(value)


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key) + u32(int(VT.UINT32)) + u32(value)


def tensor_info(name: str, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(u64(d) for d in ne) + u32(ggml_type) + u64(offset)


@dataclass
class RawGGUF:
    """Parts of a GGUF file as bytes; ``build`` joins them with the counts given (or the real ones)."""

    kvs: list[bytes] = field(default_factory=list)
    infos: list[bytes] = field(default_factory=list)
    data: bytes = b""
    magic: bytes = b"GGUF"
    version: int = 3
    n_kv: int | None = None
    n_tensors: int | None = None
    alignment: int = 32

    def header(self) -> bytes:
        n_t = len(self.infos) if self.n_tensors is None else self.n_tensors
        n_kv = len(self.kvs) if self.n_kv is None else self.n_kv
        return self.magic + u32(self.version) + u64(n_t) + u64(n_kv) + b"".join(self.kvs) + b"".join(self.infos)

    def build(self) -> bytes:
        head = self.header()
        pad = (-len(head)) % self.alignment
        return head + b"\0" * pad + self.data


def valid_raw() -> RawGGUF:
    """A small valid file: two KVs and two F32 tensors packed as llama.cpp expects."""
    return RawGGUF(
        kvs=[kv_str("general.architecture", "llama"), kv_u32("llama.context_length", 64)],
        infos=[tensor_info("a", [8, 2], int(GGMLQuantizationType.F32), 0),
               tensor_info("b", [4], int(GGMLQuantizationType.F32), 64)],
        data=np.arange(16, dtype="<f4").tobytes() + np.arange(4, dtype="<f4").tobytes() + b"\0" * 16,
    )


def random_tensor_bytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> bytes:
    """Random bytes of the right size for ``ggml_type`` and numpy ``shape`` (row length in elements)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    nbytes = n_rows * (shape[-1] // block) * type_size
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def write_model(path: Path, *, name: str = "tiny", n_tensors: int = 4, rows: int = 4, cols: int = 64,
                slack_bytes: int = 4096, **kw: object) -> Path:
    """A small llama-like GGUF written by ggufkit: F32 tensors with seeded random data."""
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.set("general.name", VT.STRING, name)
    meta.set("llama.context_length", VT.UINT32, 128)
    meta.set("tokenizer.ggml.tokens", VT.ARRAY, ["<s>", "</s>", "a", "b"], VT.STRING)
    meta.set("tokenizer.ggml.bos_token_id", VT.UINT32, 0)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(n_tensors)]
    specs = [TensorSpec(f"blk.{i}.w", GGMLQuantizationType.F32, (rows, cols)) for i in range(n_tensors)]
    write_gguf(path, meta, specs, arrays, slack_bytes=slack_bytes, **kw)  # type: ignore[arg-type]
    return path
