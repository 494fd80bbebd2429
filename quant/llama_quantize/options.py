"""llama-quantize's remaining options, parsed with its semantics (tools/quantize/quantize.cpp).

``--tensor-type PATTERN=TYPE`` (``parse_tensor_type``), ``--prune-layers`` (``parse_layer_prune``),
``--override-kv KEY=TYPE:VALUE`` (common/common.cpp ``string_parse_kv_override``), ``--tensor-type-file``
(``parse_tensor_type_file``: rules separated by white space) and ``--include-weights`` /
``--exclude-weights`` (``prepare_imatrix``: substring filters over the imatrix entries). Every bad value
is a :class:`~ggufkit.errors.UsageError` raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from ggufkit.errors import UsageError
from ggufkit.format.values import VT
from ggufkit.quant.imatrix.reader import Imatrix
from ggufkit.quant.llama_quantize.presets import parse_type

#: llama_model_kv_override::key is char[128]; val_str holds 127 characters.
_MAX_KEY = 127
_MAX_STR = 127


@dataclass(frozen=True)
class KVOverride:
    """One ``--override-kv``: the key, the GGUF type llama-quantize writes it as, and the value.

    ``int`` overrides are written as UINT32 of the absolute value (llama_model_quantize_impl), ``float``
    as FLOAT32, ``bool`` as BOOL, ``str`` as STRING.
    """

    key: str
    vtype: VT
    value: int | float | bool | str


def parse_kv_override(option: str) -> KVOverride:
    """``KEY=TYPE:VALUE`` with TYPE ``int``, ``float``, ``bool`` (``true``/``false``) or ``str`` (<= 127 chars).

    Raises:
        UsageError: no ``=``, a key of 128+ characters, an unknown TYPE or a VALUE that is not of TYPE.
    """
    key, sep, rest = option.partition("=")
    if not sep or not key or len(key.encode()) > _MAX_KEY:
        raise UsageError(f"malformed --override-kv {option!r}: expected KEY=TYPE:VALUE, e.g. general.name=str:x")
    kind, colon, raw = rest.partition(":")
    if not colon or kind not in ("int", "float", "bool", "str"):
        raise UsageError(f"--override-kv {option!r}: TYPE must be int, float, bool or str")
    if kind == "int":
        try:
            value = int(raw.strip())
        except ValueError:
            raise UsageError(f"--override-kv {option!r}: {raw!r} is not an integer") from None
        if not -(1 << 63) <= value < (1 << 63):
            raise UsageError(f"--override-kv {option!r}: {raw!r} does not fit in 64 bits")
        return KVOverride(key, VT.UINT32, abs(value) & 0xFFFFFFFF)
    if kind == "float":
        try:
            f = float(raw.strip())
        except ValueError:
            raise UsageError(f"--override-kv {option!r}: {raw!r} is not a number") from None
        if not math.isfinite(f):
            raise UsageError(f"--override-kv {option!r}: {raw!r} is not a finite number")
        return KVOverride(key, VT.FLOAT32, f)
    if kind == "bool":
        if raw not in ("true", "false"):
            raise UsageError(f"--override-kv {option!r}: a bool is true or false")
        return KVOverride(key, VT.BOOL, raw == "true")
    if len(raw.encode()) > _MAX_STR:
        raise UsageError(f"--override-kv {option!r}: a str value cannot exceed {_MAX_STR} bytes")
    return KVOverride(key, VT.STRING, raw)


def read_tensor_type_file(path: str | Path) -> list[str]:
    """The ``PATTERN=TYPE`` rules of a ``--tensor-type-file`` (separated by spaces or newlines).

    Raises:
        UsageError: the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--tensor-type-file {str(path)!r}: cannot read it ({exc})") from None
    return text.split()


def filter_imatrix(im: Imatrix, include: Sequence[str], exclude: Sequence[str]) -> Imatrix:
    """prepare_imatrix: drop entries whose name contains an ``exclude`` string, or keep only those whose
    name contains an ``include`` string.

    Raises:
        UsageError: both lists given (llama-quantize refuses that too).
    """
    if include and exclude:
        raise UsageError("--include-weights and --exclude-weights cannot be used together")
    entries = dict(im.entries)
    if exclude:
        entries = {k: v for k, v in entries.items() if not any(s in k for s in exclude)}
    if include:
        entries = {k: v for k, v in entries.items() if any(s in k for s in include)}
    return dataclasses.replace(im, entries=entries)


def parse_tensor_type_option(option: str | tuple[str, str | GGMLQuantizationType]) -> tuple[str, GGMLQuantizationType]:
    """``PATTERN=TYPE`` (or a ``(pattern, type)`` pair) as llama-quantize's ``--tensor-type`` parses it.

    The pattern is lower-cased (quantize.cpp ``parse_tensor_type``) and must compile as a regular expression.

    Raises:
        UsageError: malformed option, bad regular expression or unknown type.
    """
    type_name: str | GGMLQuantizationType
    if isinstance(option, str):
        pattern, sep, type_name = option.partition("=")
        if not sep:
            raise UsageError(f"malformed --tensor-type {option!r}: expected PATTERN=TYPE, e.g. attn_v=q8_0")
    else:
        pattern, type_name = option
    if not pattern:
        raise UsageError(f"--tensor-type {option!r}: missing tensor name pattern")
    if isinstance(type_name, str) and not type_name:
        raise UsageError(f"--tensor-type {option!r}: missing quantization type")
    pattern = pattern.lower()
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"--tensor-type {option!r}: bad regular expression ({exc})") from None
    return pattern, parse_type(type_name, "--tensor-type type")


def parse_prune_layers(spec: str | Sequence[int], n_layer: int | None = None) -> tuple[int, ...]:
    """``--prune-layers L0,L1,...`` as quantize.cpp's ``parse_layer_prune``: sorted, unique, non-negative;
    with ``n_layer``, every id must name an existing layer.

    Raises:
        UsageError: an id that is not a non-negative integer, or not below ``n_layer``.
    """
    items = spec.split(",") if isinstance(spec, str) else [str(i) for i in spec]
    ids = []
    for item in items:
        m = re.match(r"\s*\+?(\d+)", item)
        if m is None:
            raise UsageError(f"--prune-layers: invalid layer id {item!r} (expected L0,L1,... with L >= 0)")
        ids.append(int(m.group(1)))
    out = tuple(sorted(set(ids)))
    if n_layer is not None and out and out[-1] >= n_layer:
        raise UsageError(f"--prune-layers: layer {out[-1]} is out of range (the model has {n_layer} layers)")
    return out
