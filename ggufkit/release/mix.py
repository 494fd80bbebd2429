"""Size-budget entries of a release's ``--types``: ``MIX@TARGET``, the best per-tensor mix at a size (issue 16).

Syntax (case-insensitive; the canonical spelling is what file names, records and the card use):

- ``MIX@Q3_K_M``: the size of the file llama-quantize's ``Q3_K_M`` would write for this model with the release's
  importance matrix (any quantized preset name or alias, ``MIX@q4_k`` = ``MIX@Q4_K_M``);
- ``MIX@2.5G``, ``MIX@90MiB``, ``MIX@95000000B``: a whole-file size (K/M/G/T decimal, KiB/MiB/GiB/TiB
  binary, B bytes; the unit is required);
- ``MIX@4.5bpw``: bits per weight over all tensors (tensor data, as ``ggufkit info`` reports it).

A bare number (``MIX@3``) is refused: bytes, bits per weight and llama-quantize's numeric type ids would all
read it differently. Each entry is one resumable step (:func:`ggufkit.release.steps.mix_step`) that calls
:func:`ggufkit.quant.target.search.quantize_to_target` on the release's master with its importance matrix, writes
``{basename}-MIX-{TARGET}.gguf`` and its llama-quantize ``--tensor-type-file`` recipe
``{basename}-MIX-{TARGET}.tensor-types.txt`` beside it, and measures into one cache inside the release's state
directory, so the second entry measures nothing again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ggufkit.errors import UsageError

PREFIX = "MIX@"
RECIPE_SUFFIX = ".tensor-types.txt"
#: The release's measurement cache, inside its state directory (never uploaded).
CACHE_DIR = "target-cache"
#: A generous bound on how much a quantized file's header can exceed its tensor data (metadata, vocabulary,
#: tensor infos): a size budget above every tensor's largest candidate plus this is refused before any work.
HEADER_SLACK = 64 * 2**20
#: How the release's search measures (quantize_to_target's defaults, recorded so a change reruns the step).
PROXY = "relative"
_NUMBER = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+)([A-Za-z]*)")
_UNITS = {"B": "B", "K": "K", "M": "M", "G": "G", "T": "T", "KB": "KB", "MB": "MB", "GB": "GB", "TB": "TB",
          "KIB": "KiB", "MIB": "MiB", "GIB": "GiB", "TIB": "TiB"}


@dataclass(frozen=True)
class MixTarget:
    """One ``MIX@TARGET`` entry.

    Attributes:
        name: canonical entry (``MIX@Q3_K_M``, ``MIX@2.5G``, ``MIX@4.5bpw``).
        kind: ``like`` (a preset's size), ``size`` (file bytes) or ``bpw`` (bits per weight).
        preset: the preset's lower-case name (``like``).
        size: the budget in bytes (``size``).
        bpw: bits per weight (``bpw``).
    """

    name: str
    kind: str
    preset: str | None = None
    size: int | None = None
    bpw: float | None = None

    @property
    def label(self) -> str:
        """The file-name part: ``MIX-Q3_K_M``."""
        return self.name.replace("@", "-")

    def describe(self) -> str:
        """``the size of Q3_K_M``, ``2.5G (2500000000 bytes)``, ``4.5 bits per weight``."""
        spec = self.name.removeprefix(PREFIX)
        if self.kind == "like":
            return f"the size of {spec}"
        if self.kind == "size":
            return f"{spec} ({self.size} bytes)"
        return f"{self.bpw:g} bits per weight"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "preset": self.preset.upper() if self.preset else None, "size": self.size,
                "bpw": self.bpw}


def is_mix(name: str) -> bool:
    """``name`` is a ``MIX@...`` entry (any case)."""
    return name.strip().upper().startswith(PREFIX)


def _number(text: str) -> str:
    """``090.50`` -> ``90.5`` (one spelling per value, for file names)."""
    return format(Decimal(text).normalize(), "f")


def parse_mix(text: str) -> MixTarget:
    """Parse a ``MIX@TARGET`` entry (see the module docstring).

    Raises:
        UsageError: not one of the three forms, an unknown or unquantized preset, a size of zero.
    """
    from ggufkit.quant.llama_quantize.presets import get_preset
    from ggufkit.quant.target.search import parse_target_size

    spec = text.strip()[len(PREFIX):].strip()
    where = f"--types {text.strip()}"
    if not spec:
        raise UsageError(f"{where}: expected MIX@PRESET (e.g. MIX@Q3_K_M), MIX@SIZE (MIX@2.5G, MIX@90MiB) or "
                         "MIX@BPW (MIX@4.5bpw)")
    m = _NUMBER.fullmatch(spec)
    if m is None:
        if not spec[0].isalpha():
            raise UsageError(f"{where}: {spec!r} is neither a preset name, a size such as 2.5G or 90MiB, nor "
                             "bits per weight such as 4.5bpw")
        try:
            preset = get_preset(spec)
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None
        if preset.only_copy or not preset.is_quantized:
            raise UsageError(f"{where}: {preset.name.upper()} is not a quantized preset (its size is no budget)")
        return MixTarget(f"{PREFIX}{preset.name.upper()}", "like", preset=preset.name)
    number, unit = _number(m.group(1)), m.group(2)
    if not unit:
        raise UsageError(f"{where}: give a unit: MIX@{spec}G (a file size), MIX@{spec}bpw (bits per weight), "
                         "or a preset name such as MIX@Q4_K_M")
    if unit.lower() == "bpw":
        value = float(number)
        if not value > 0:
            raise UsageError(f"{where}: bits per weight must be positive")
        return MixTarget(f"{PREFIX}{number}bpw", "bpw", bpw=value)
    canon = _UNITS.get(unit.upper())
    if canon is None:
        raise UsageError(f"{where}: unknown unit {unit!r} (B, K, M, G, T, KiB, MiB, GiB, TiB, or bpw)")
    try:
        size = parse_target_size(f"{number}{canon}")
    except UsageError:
        raise UsageError(f"{where}: a size must be positive") from None
    return MixTarget(f"{PREFIX}{number}{canon}", "size", size=size)


def check_feasible(mixes: list[MixTarget], entries: list[Any], use_imatrix: bool) -> None:
    """Refuse the size and bpw budgets that no mix of these tensors can meet, before any work.

    The exact reachable range needs the master (its header) and the measurements (each tensor's convex
    hull); these bounds are certain without them: no tensor can be smaller than the cheapest candidate nor
    larger than F16 (or its own type), a tensor the master holds quantized (a gpt-oss master's MXFP4 experts)
    is copied as it is (:func:`ggufkit.quant.target.search.kept_quantized`), and the header adds at most
    :data:`HEADER_SLACK`.

    Args:
        mixes: the release's MIX entries.
        entries: the planned master's tensors (``shape`` and ``ggml_type``).
        use_imatrix: the release has an importance matrix (the IQ2/IQ3 candidates then count).

    Raises:
        UsageError: a budget below the least or above the most any mix can reach.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ggufkit.quant.registry import bits_per_weight
    from ggufkit.quant.target.search import DEFAULT_TYPES, IMATRIX_TYPES, kept_quantized

    cands = DEFAULT_TYPES + (IMATRIX_TYPES if use_imatrix else ())
    cheapest = min(cands, key=bits_per_weight)
    keep = kept_quantized(entries)
    lo = hi = 0.0
    kept = n_params = 0
    for e in entries:
        n = int(np.prod(e.shape, dtype=np.int64))
        n_params += n
        block, size = GGML_QUANT_SIZES[e.ggml_type]
        own = n // block * size
        if e.name in keep:
            kept += own
        if len(e.shape) < 2 or e.name in keep:
            lo += own
            hi += own
        else:
            lo += min(own, n * bits_per_weight(cheapest) / 8)
            hi += max(own, n * 2)
    kept_text = f" but the {kept} bytes of {', '.join(sorted({t.name for t in keep.values()}))} tensors kept as " \
        "they are" if kept else ""
    f16 = GGMLQuantizationType.F16.name + kept_text
    cheapest_text = cheapest.name + kept_text
    for mix in mixes:
        if mix.kind == "like":
            continue
        if mix.kind == "bpw":
            assert mix.bpw is not None
            lo_bpw, hi_bpw = 8 * lo / n_params, 8 * hi / n_params
            if not lo_bpw <= mix.bpw <= hi_bpw:
                raise UsageError(f"--types {mix.name}: outside what a mix of this model can reach (at least "
                                 f"{lo_bpw:.3f} bpw: every matrix in {cheapest_text}; at most {hi_bpw:.3f}: {f16})")
            continue
        assert mix.size is not None
        if mix.size < lo:
            raise UsageError(f"--types {mix.name}: {mix.size} bytes is below the smallest mix of this model (its "
                             f"tensor data alone is at least {int(lo)} bytes: every matrix in {cheapest_text})")
        if mix.size > hi + HEADER_SLACK:
            raise UsageError(f"--types {mix.name}: {mix.size} bytes is above the largest mix of this model (about "
                             f"{int(hi)} bytes of tensor data: every matrix in {f16})")


def recipe_file(plan: Any, qtype: str) -> str:
    """``{basename}-MIX-Q3_K_M.tensor-types.txt``: the recipe beside ``{basename}-MIX-Q3_K_M.gguf``."""
    return plan.type_file(qtype).removesuffix(".gguf") + RECIPE_SUFFIX


def candidates(use_imatrix: bool) -> list[str]:
    """The candidate types of a release's search (quantize_to_target's defaults)."""
    from ggufkit.quant.target.search import DEFAULT_TYPES, IMATRIX_TYPES

    return [t.name for t in DEFAULT_TYPES + (IMATRIX_TYPES if use_imatrix else ())]


def manifest_entry(rec: dict[str, Any]) -> dict[str, Any]:
    """``manifest.json``'s ``mixes`` entry of one MIX step: target, budget, base preset, candidates, estimate."""
    p, r = rec["params"], rec["results"]
    model = next(n for n in sorted(rec["outputs"]) if n.endswith(".gguf"))
    return {"file": model, "recipe": r["recipe"], "target": {**p["target"], "text": r["target"]},
            "budget": r["budget"], "budget_kind": r["budget_kind"], "base_preset": r["base_preset"],
            "candidates": p["candidates"], "proxy": p["proxy"], "sample_rows": p["sample_rows"],
            "predicted_size": r["predicted_size"], "estimated_error": r["estimated_error"],
            "reference": r["reference"], "types": r["types"]}


def card_lines(plan: Any, rows: list[dict[str, Any]], files: dict[str, list[str]]) -> list[str]:
    """The card's section on how each mix was chosen and how llama-quantize reproduces it (none: no mixes)."""
    mixes = [r for r in rows if r.get("mix")]
    if not mixes:
        return []
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    master = files["master"][0]
    weighted = "imatrix-weighted squared error" if plan.use_imatrix else "squared error"
    lines = ["## How the mixes were chosen", ""]
    for r in mixes:
        m = r["mix"]
        ref = m["reference"]
        kind = m["target"]["kind"]
        budget = (f"the size of the file llama-quantize's {m['target']['preset']} writes for this model"
                  + (" with this importance matrix" if plan.use_imatrix else "") if kind == "like" else
                  "the whole file, header included" if kind == "size" else
                  f"tensor data: {m['target']['bpw']:g} bits per weight")
        types = ", ".join(f"{k} ×{n}" for k, n in sorted(m["types"].items()))
        ratio = f"{m['estimated_error'] / ref['estimated_error']:.2f}×" if ref["estimated_error"] else "–"
        imatrix = f"--imatrix {plan.imatrix_file} " if plan.use_imatrix else ""
        # tensors the master holds quantized (gpt-oss's MXFP4 experts) are copied, never searched
        copied = sorted(t for t in m["types"] if t not in m["candidates"] and GGML_QUANT_SIZES[
            GGMLQuantizationType[t]][0] > 1)
        copied_text = (f" The master's {', '.join(copied)} tensors are copied as they are (their bytes count in "
                       "the budget; only the others are searched).") if copied else ""
        lines += [f"### {r['type']}", "",
                  f"`{files[r['type']][0]}`: best mix at {m['target']['text']}: per-tensor types chosen by measured "
                  f"error ({weighted} of ggufkit's byte-exact quantizers on up to {m['sample_rows']} sampled rows "
                  f"per tensor and expert, relative to the tensor's weighted energy) under a budget of "
                  f"{m['budget']} bytes ({budget}), the least total error that fits; candidates "
                  f"{', '.join(m['candidates'])}. Tensor types in the file: {types}. Estimated error {m['estimated_error']:.4g}"
                  f" against {ref['preset']}'s {ref['estimated_error']:.4g} ({ratio} the preset's; the search's "
                  f"estimate, the table's KLD is measured).{copied_text}", "",
                  f"Recipe: `{m['recipe']}` (a llama-quantize `--tensor-type-file`). In this repository, llama.cpp's "
                  "llama-quantize writes the same tensors byte for byte (ggufkit's file adds only its provenance keys):", "", "```sh",
                  f"llama-quantize {imatrix}--tensor-type-file {m['recipe']} {master} {files[r['type']][0]} "
                  f"{m['base_preset']}", "```", "",
                  f"Run it by its file name (`llama-cli -m {files[r['type']][0]}`): the hub's `-hf REPO:TYPE` tags name "
                  "llama-quantize's presets.", ""]
    return lines
