"""Multi-token-prediction (MTP / NextN) layers, as llama.cpp's converter writes them.

Some checkpoints carry one or more extra decoder blocks that predict the token after next (Qwen3-Next and
Qwen3.5 under ``mtp.*``; GLM-4.5 and DeepSeek V3 as ``model.layers.{N}`` at and beyond ``num_hidden_layers``).
llama.cpp's converter (conversion/base.py ``supports_mtp_export`` / ``no_mtp`` / ``mtp_only``;
conversion/qwen.py ``_QwenMtpMixin``; conversion/glm.py ``Glm4MoeModel``; conversion/deepseek.py) writes them,
by default, as extra blocks ``blk.{block_count + i}`` after the trunk, raises ``{arch}.block_count`` by their
number and writes ``{arch}.nextn_predict_layers``; ``--no-mtp`` leaves them out; ``--mtp`` writes only them
plus the shared tensors (embeddings, output norm, head) as a separate draft GGUF named ``mtp-{name}``.

A registry entry declares its MTP layers with the ``mtp`` field (:class:`MtpSpec`, validated by
:func:`parse_mtp`)::

    mtp:
      blocks: {mtp.layers.{mid}: model.layers.{bid}}   # checkpoint prefix -> the trunk's block prefix
      head: {mtp.fc: model.layers.{bid}.eh_proj}       # head tensors -> names in the first MTP block
      count: [mtp_num_hidden_layers]                   # config fields saying how many (else counted)
      draft: [model.embed_tokens, model.norm, lm_head] # trunk tensors --mtp keeps
      keep: true                                       # false: always dropped, --mtp / --no-mtp refused
      declared: 1                                      # optional: blocks announced even without tensors

A ``blocks`` source with ``{mid}`` is a separate MTP namespace renumbered after the trunk (``bid = n_layer +
mid``); a source with ``{bid}`` names the trunk's own prefix, whose blocks at and beyond ``num_hidden_layers``
are the MTP layers (GLM, DeepSeek). The renamed names then go through the entry's ``tensors`` rules (the
NEXTN_* tensors among them) like any other. A checkpoint without MTP tensors converts as ``--no-mtp`` does
(no flag needed; llama.cpp's converter asserts on such a Qwen3-Next checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ggufkit.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from ggufkit.format.values import VT

_SUFFIX = re.compile(r"\.(weight|bias)$")
_SPEC_FIELDS = {"blocks", "head", "count", "draft", "keep", "declared"}


@dataclass(frozen=True)
class MtpSpec:
    """How an HF class stores its MTP layers (registry.yaml ``mtp``; module docstring)."""

    #: checkpoint prefix template (``{mid}``: MTP index; ``{bid}``: trunk block index) and the trunk's block prefix
    #: template (``{bid}``) the blocks are renamed into
    source: str
    target: str
    #: head tensors (checkpoint name without .weight/.bias) -> their name in the first MTP block (``{bid}``)
    head: tuple[tuple[str, str], ...] = ()
    #: config fields giving the number of MTP layers (the first present wins; absent or 0: counted)
    count: tuple[str, ...] = ()
    #: trunk tensors (the name the rules see, without .weight/.bias) the ``--mtp`` draft keeps
    draft: tuple[str, ...] = ()
    #: llama.cpp keeps the layers by default and accepts --mtp / --no-mtp; false: always dropped, both refused
    keep: bool = True
    #: where llama.cpp's converter announces the config's count (``count``, else this default: AutoConfig's)
    #: even when the checkpoint holds none of the layers (GLM: block_count + n, nextn_predict_layers, no
    #: tensors); None: a checkpoint without MTP tensors converts as --no-mtp
    declared: int | None = None

    @property
    def trailing(self) -> bool:
        """The MTP blocks continue the trunk's numbering under its own prefix (GLM, DeepSeek)."""
        return "{bid}" in self.source

    def pattern(self) -> re.Pattern[str]:
        index = "bid" if self.trailing else "mid"
        body = re.escape(self.source).replace(re.escape("{" + index + "}"), r"(?P<i>\d+)")
        return re.compile(rf"^{body}\.(?P<rest>.+)$")


def parse_mtp(parser: Any, value: Any) -> MtpSpec | None:
    """Validate registry.yaml's ``mtp`` field (``parser``: registry.py's entry parser, for its errors)."""
    if value is None:
        return None
    parser.typed("mtp", value, dict, "a mapping (blocks, head, count, draft, keep)")
    unknown = sorted(set(value) - _SPEC_FIELDS)
    if unknown:
        raise parser.fail("mtp", f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(_SPEC_FIELDS))})")
    blocks = parser.typed("mtp", value.get("blocks"), dict, "blocks: a mapping of one checkpoint prefix -> "
                          "block prefix")
    if len(blocks) != 1:
        raise parser.fail("mtp", "blocks: exactly one checkpoint prefix -> block prefix")
    (source, target), = blocks.items()
    for name in (source, target):
        parser.typed("mtp", name, str, "block prefixes as strings")
    if ("{mid}" in source) == ("{bid}" in source) or "{bid}" not in target:
        raise parser.fail("mtp", f"blocks: {source!r} needs {{mid}} or {{bid}}, {target!r} needs {{bid}}")
    head = parser.typed("mtp", value.get("head", {}), dict, "head: a mapping of checkpoint name -> block name")
    for name, renamed in head.items():
        parser.typed("mtp", name, str, "head names as strings")
        parser.typed("mtp", renamed, str, "head names as strings")
        if "{bid}" not in renamed:
            raise parser.fail("mtp", f"head: {renamed!r} needs {{bid}}")
    declared = value.get("declared")
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int) or declared < 0):
        raise parser.fail("mtp", f"declared: expected a non-negative integer, got {declared!r}")
    return MtpSpec(source, target, tuple(head.items()), parser.str_list("mtp", value.get("count", [])),
                   parser.str_list("mtp", value.get("draft", [])),
                   parser.typed("mtp", value.get("keep", True), bool, "keep: true or false"), declared)


@dataclass
class MtpLayers:
    """One conversion's MTP layers: how many, what is written (``mode``) and the name each checkpoint tensor
    shows the registry's rules."""

    #: "keep" (extra blocks), "drop" (--no-mtp, or a class whose layers llama.cpp always drops), "only" (--mtp)
    mode: str
    n_trunk: int
    n_mtp: int = 0
    strip_prefix: str = ""
    #: checkpoint name -> the name the rules see (MTP tensors renamed into blocks n_trunk + i)
    renamed: dict[str, str] = field(default_factory=dict)
    draft: frozenset[str] = frozenset()

    def local_name(self, name: str) -> str:
        """The name the registry's rules and ignore patterns see."""
        renamed = self.renamed.get(name)
        if renamed is not None:
            return renamed
        return name.removeprefix(self.strip_prefix) if self.strip_prefix else name

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(names to map, names left out), in source order: MTP tensors go with --no-mtp, the trunk's (but
        the draft's shared tensors) with --mtp."""
        kept: list[str] = []
        dropped: list[str] = []
        for name in names:
            is_mtp = name in self.renamed
            drafted = _SUFFIX.sub("", self.local_name(name)) in self.draft
            if (self.mode == "drop" and is_mtp) or (self.mode == "only" and not is_mtp and not drafted):
                dropped.append(name)
            else:
                kept.append(name)
        return kept, dropped

    def is_trunk(self, gguf_name: str) -> bool:
        """A GGUF tensor outside the MTP blocks."""
        m = re.match(r"blk\.(\d+)\.", gguf_name)
        return m is None or int(m.group(1)) < self.n_trunk

    def hparams(self, values: dict[str, tuple[VT, Any]], arch: str) -> dict[str, tuple[VT, Any]]:
        """``block_count`` raised by the MTP layers and ``nextn_predict_layers`` where they are written
        (_QwenMtpMixin.set_gguf_parameters)."""
        if self.mode == "drop" or not self.n_mtp:
            return values
        from ggufkit.format.values import VT

        out = dict(values)
        out[f"{arch}.block_count"] = (VT.UINT32, self.n_trunk + self.n_mtp)
        out[f"{arch}.nextn_predict_layers"] = (VT.UINT32, self.n_mtp)
        return out

    def file_prefix(self) -> str:
        """``mtp-`` before the default file name of the draft (_QwenMtpMixin.prepare_metadata: no size label)."""
        return "mtp-" if self.mode == "only" else ""


def mtp_layers(spec: MtpSpec | None, hf_class: str, strip_prefix: str, config: Mapping[str, Any],
               names: Iterable[str], n_trunk: int, mtp: bool | None) -> MtpLayers:
    """The MTP layers of a checkpoint with tensors ``names``, for ``mtp`` (None: the class's default, True:
    ``--mtp``, False: ``--no-mtp``).

    Raises:
        UsageError: --mtp / --no-mtp on a class llama.cpp's converter refuses them for, or --mtp on a
            checkpoint without MTP layers.
        CheckpointError: the config's MTP layer count disagrees with the checkpoint's.
    """
    option = None if mtp is None else "--mtp" if mtp else "--no-mtp"
    if option is not None and (spec is None or not spec.keep):
        raise UsageError(f"{option}: {hf_class} has no multi-token-prediction layers to write or leave out "
                         "(llama.cpp's converter refuses the option for it too)")
    if spec is None:
        return MtpLayers("keep", n_trunk, strip_prefix=strip_prefix)
    pattern = spec.pattern()
    head = dict(spec.head)
    renamed: dict[str, str] = {}
    indices: set[int] = set()
    for name in names:
        local = name.removeprefix(strip_prefix) if strip_prefix else name
        m = pattern.match(local)
        if m is not None:
            i = int(m.group("i")) - (n_trunk if spec.trailing else 0)
            if i < 0:
                continue
            indices.add(i)
            renamed[name] = spec.target.format(bid=n_trunk + i) + "." + m.group("rest")
            continue
        stem = _SUFFIX.sub("", local)
        if stem in head:
            indices.add(0)
            renamed[name] = head[stem].format(bid=n_trunk) + local[len(stem):]
    n_mtp = max(indices) + 1 if indices else 0
    declared = next((config[k] for k in spec.count if config.get(k) is not None), None)
    if n_mtp and isinstance(declared, int) and not isinstance(declared, bool) and declared and declared != n_mtp:
        raise CheckpointError(f"config.json says {declared} multi-token-prediction layers ({spec.count[0]}), "
                              f"the checkpoint has {n_mtp}")
    if mtp and not n_mtp:
        raise UsageError(f"--mtp: the checkpoint has no multi-token-prediction layers ({spec.source.split('{')[0]}*)")
    if not n_mtp and spec.declared is not None and spec.keep and mtp is None:
        # announced without tensors, as llama.cpp's converter writes it (spec.declared)
        announced = declared if isinstance(declared, int) and not isinstance(declared, bool) else spec.declared
        return MtpLayers("keep" if announced > 0 else "drop", n_trunk, max(announced, 0), strip_prefix)
    mode = "drop" if not spec.keep or mtp is False or not n_mtp else "only" if mtp else "keep"
    return MtpLayers(mode, n_trunk, n_mtp, strip_prefix, renamed, frozenset(spec.draft))
