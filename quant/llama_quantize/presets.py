"""llama-quantize's TYPE argument as data: every row of ``QUANT_OPTIONS`` and every ggml type name.

:data:`PRESETS` mirrors ``QUANT_OPTIONS`` of tools/quantize/quantize.cpp (llama.cpp vendored in
llama-cpp-python 0.3.36) row for row, with the default tensor type of ``llama_ftype_get_default_type``
(src/llama-quant.cpp). ``--type`` accepts every name (case-insensitive) and every numeric ftype id, as
``try_parse_ftype`` does. ``Q2_0`` is left out: gguf 0.19 does not know its type (42).

This module imports neither Numba nor the kernels: the CLI builds ``--help`` from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggufkit.errors import UsageError, did_you_mean
from ggufkit.quant.registry import FLOAT_TYPES, REQUIRES_IMATRIX, TYPES, bits_per_weight, type_name

QT = GGMLQuantizationType
F = LlamaFileType


@dataclass(frozen=True)
class Preset:
    """One row of llama-quantize's ``QUANT_OPTIONS``.

    Attributes:
        name: canonical lower-case name (``q4_k_m``; aliases keep their own name, ``q4_k``).
        file_type: the ``llama_ftype`` written as ``general.file_type``.
        default_type: ``llama_ftype_get_default_type(file_type)``: the type every tensor starts from.
        desc: llama-quantize's description of the row.
        only_copy: ``COPY``: every tensor is copied as is.
        outtype: where ``ggufkit convert --outtype`` accepts the name: :data:`ADAPTER` (models, ``--mmproj``
            projectors and LoRA adapters, as convert_hf_to_gguf.py's and convert_lora_to_gguf.py's
            ``--outtype``), :data:`MODEL` (models only: ggufkit's quantized outtypes) or "" (not an outtype).
    """

    name: str
    file_type: LlamaFileType
    default_type: GGMLQuantizationType
    desc: str
    only_copy: bool = False
    outtype: str = ""

    @property
    def is_quantized(self) -> bool:
        """The default type is a block type (``ggml_is_quantized``): the mixture rules apply."""
        return self.default_type not in FLOAT_TYPES

    @property
    def needs_imatrix(self) -> bool:
        """Its default type cannot be written without an importance matrix (Q2_K_S's Q2_K included)."""
        return self.requires_imatrix(self.default_type)

    def requires_imatrix(self, t: GGMLQuantizationType) -> bool:
        """llama-quant.cpp ``tensor_requires_imatrix`` for a tensor of type ``t`` in this preset's file (its
        exemption of the token embeddings and output aside): the very low-bit types of
        :data:`~ggufkit.quant.registry.REQUIRES_IMATRIX` always, Q2_K only inside a Q2_K_S file."""
        return t in REQUIRES_IMATRIX or (t == QT.Q2_K and self.file_type == F.MOSTLY_Q2_K_S)


#: Values of :attr:`Preset.outtype`.
ADAPTER = "adapter"
MODEL = "model"


def _p(name: str, ftype: LlamaFileType, default: GGMLQuantizationType, desc: str, *, copy: bool = False,
       outtype: str = "") -> Preset:
    return Preset(name, ftype, default, desc, copy, outtype)


#: QUANT_OPTIONS, in its order (the order of ``--help`` and of numeric-id lookup: "15" means Q4_K).
PRESETS: dict[str, Preset] = {p.name: p for p in (
    _p("q1_0", F.MOSTLY_Q1_0, QT.Q1_0, "1.125 bpw quantization"),
    _p("q4_0", F.MOSTLY_Q4_0, QT.Q4_0, "4.34G, +0.4685 ppl @ Llama-3-8B", outtype=MODEL),
    _p("q4_1", F.MOSTLY_Q4_1, QT.Q4_1, "4.78G, +0.4511 ppl @ Llama-3-8B", outtype=MODEL),
    _p("mxfp4_moe", F.MOSTLY_MXFP4_MOE, QT.MXFP4, "MXFP4 MoE"),
    _p("q5_0", F.MOSTLY_Q5_0, QT.Q5_0, "5.21G, +0.1316 ppl @ Llama-3-8B"),
    _p("q5_1", F.MOSTLY_Q5_1, QT.Q5_1, "5.65G, +0.1062 ppl @ Llama-3-8B"),
    _p("iq2_xxs", F.MOSTLY_IQ2_XXS, QT.IQ2_XXS, "2.06 bpw quantization"),
    _p("iq2_xs", F.MOSTLY_IQ2_XS, QT.IQ2_XS, "2.31 bpw quantization"),
    _p("iq2_s", F.MOSTLY_IQ2_S, QT.IQ2_XS, "2.5  bpw quantization"),
    _p("iq2_m", F.MOSTLY_IQ2_M, QT.IQ2_S, "2.7  bpw quantization"),
    _p("iq1_s", F.MOSTLY_IQ1_S, QT.IQ1_S, "1.56 bpw quantization"),
    _p("iq1_m", F.MOSTLY_IQ1_M, QT.IQ1_M, "1.75 bpw quantization"),
    _p("tq1_0", F.MOSTLY_TQ1_0, QT.TQ1_0, "1.69 bpw ternarization"),
    _p("tq2_0", F.MOSTLY_TQ2_0, QT.TQ2_0, "2.06 bpw ternarization"),
    _p("q2_k", F.MOSTLY_Q2_K, QT.Q2_K, "2.96G, +3.5199 ppl @ Llama-3-8B"),
    _p("q2_k_s", F.MOSTLY_Q2_K_S, QT.Q2_K, "2.96G, +3.1836 ppl @ Llama-3-8B"),
    _p("iq3_xxs", F.MOSTLY_IQ3_XXS, QT.IQ3_XXS, "3.06 bpw quantization"),
    _p("iq3_s", F.MOSTLY_IQ3_S, QT.IQ3_S, "3.44 bpw quantization"),
    _p("iq3_m", F.MOSTLY_IQ3_M, QT.IQ3_S, "3.66 bpw quantization mix"),
    _p("q3_k", F.MOSTLY_Q3_K_M, QT.Q3_K, "alias for Q3_K_M"),
    _p("iq3_xs", F.MOSTLY_IQ3_XS, QT.IQ3_S, "3.3 bpw quantization"),
    _p("q3_k_s", F.MOSTLY_Q3_K_S, QT.Q3_K, "3.41G, +1.6321 ppl @ Llama-3-8B"),
    _p("q3_k_m", F.MOSTLY_Q3_K_M, QT.Q3_K, "3.74G, +0.6569 ppl @ Llama-3-8B"),
    _p("q3_k_l", F.MOSTLY_Q3_K_L, QT.Q3_K, "4.03G, +0.5562 ppl @ Llama-3-8B"),
    _p("iq4_nl", F.MOSTLY_IQ4_NL, QT.IQ4_NL, "4.50 bpw non-linear quantization"),
    _p("iq4_xs", F.MOSTLY_IQ4_XS, QT.IQ4_XS, "4.25 bpw non-linear quantization"),
    _p("q4_k", F.MOSTLY_Q4_K_M, QT.Q4_K, "alias for Q4_K_M", outtype=MODEL),
    _p("q4_k_s", F.MOSTLY_Q4_K_S, QT.Q4_K, "4.37G, +0.2689 ppl @ Llama-3-8B"),
    _p("q4_k_m", F.MOSTLY_Q4_K_M, QT.Q4_K, "4.58G, +0.1754 ppl @ Llama-3-8B", outtype=MODEL),
    _p("q5_k", F.MOSTLY_Q5_K_M, QT.Q5_K, "alias for Q5_K_M"),
    _p("q5_k_s", F.MOSTLY_Q5_K_S, QT.Q5_K, "5.21G, +0.1049 ppl @ Llama-3-8B"),
    _p("q5_k_m", F.MOSTLY_Q5_K_M, QT.Q5_K, "5.33G, +0.0569 ppl @ Llama-3-8B"),
    _p("q6_k", F.MOSTLY_Q6_K, QT.Q6_K, "6.14G, +0.0217 ppl @ Llama-3-8B"),
    _p("q8_0", F.MOSTLY_Q8_0, QT.Q8_0, "7.96G, +0.0026 ppl @ Llama-3-8B", outtype=ADAPTER),
    _p("f16", F.MOSTLY_F16, QT.F16, "14.00G, +0.0020 ppl @ Mistral-7B", outtype=ADAPTER),
    _p("bf16", F.MOSTLY_BF16, QT.BF16, "14.00G, -0.0050 ppl @ Mistral-7B", outtype=ADAPTER),
    _p("f32", F.ALL_F32, QT.F32, "26.00G              @ 7B", outtype=ADAPTER),
    # COPY comes after F32 so that ftype 0 means F32 (quantize.cpp's note).
    _p("copy", F.ALL_F32, QT.F32, "only copy tensors, no quantizing", copy=True),
)}

#: llama-quantize's aliases (``Q4_K`` is Q4_K_M): rows described as "alias for X" resolve to row X.
ALIASES: dict[str, str] = {n: p.desc.split()[-1].lower() for n, p in PRESETS.items() if p.desc.startswith("alias for")}

#: Every name ``--type`` accepts (lower case), in ``--help`` order; numeric ftype ids are accepted too.
TYPE_CHOICES: tuple[str, ...] = tuple(PRESETS)

#: Tensor types llama-quantize can be asked for by name (``--tensor-type``, ``--output-tensor-type``,
#: ``--token-embedding-type``): every row of the trait table (:data:`~ggufkit.quant.registry.TYPES`), in
#: ggml type-id order. Q8_1, Q8_K and the integer types are ggml types too, but ggml_quantize_chunk cannot
#: write them.
TENSOR_TYPES: dict[str, GGMLQuantizationType] = {type_name(t).lower(): t for t in sorted(TYPES, key=int)}

#: ``ggufkit convert --outtype`` names for adapters (``--mmproj`` projectors, LoRA): widest type first, as
#: convert_hf_to_gguf.py lists its ``--outtype`` choices (f32, f16, bf16, q8_0).
ADAPTER_OUTTYPES: tuple[str, ...] = tuple(sorted(
    (n for n, p in PRESETS.items() if p.outtype == ADAPTER), key=lambda n: -bits_per_weight(PRESETS[n].default_type)))

#: ``ggufkit convert --outtype`` names for models: the adapter ones, then ggufkit's quantized outtypes in
#: ``QUANT_OPTIONS`` order.
CONVERT_OUTTYPES: tuple[str, ...] = ADAPTER_OUTTYPES + tuple(n for n, p in PRESETS.items() if p.outtype == MODEL)

# try_parse_ftype falls back to std::stoi, which reads a leading integer and ignores the rest.
_STOI = re.compile(r"\s*([+-]?\d+)")


@dataclass(frozen=True)
class PresetChoice:
    """A ``--type`` word parsed once, as quantize.cpp's ``try_parse_ftype`` parses it.

    Attributes:
        word: the word as given (``Q4_K``, ``15``).
        row: the ``QUANT_OPTIONS`` row it names: a name, case-insensitive, else the first row whose ftype id is
            the word's leading integer (an alias is its own row).
    """

    word: str
    row: Preset

    @property
    def name(self) -> str:
        """The ``QUANT_OPTIONS`` name llama-quantize gives the word (``Q4_K``; a numeric id names its first
        row); it also names llama-quantize's default output (:func:`default_output_name`)."""
        return self.row.name.upper()

    @property
    def preset(self) -> Preset:
        """The preset the row stands for (an alias gives the row it names)."""
        return PRESETS[ALIASES.get(self.row.name, self.row.name)]


def find_preset(word: str) -> PresetChoice | None:
    """The :class:`PresetChoice` of ``word``, or None when ``word`` is not a ``--type`` value."""
    key = word.strip().lower()
    if key in PRESETS:
        return PresetChoice(word, PRESETS[key])
    m = _STOI.match(word)
    if m:
        row = next((p for p in PRESETS.values() if int(p.file_type) == int(m.group(1))), None)
        return None if row is None else PresetChoice(word, row)
    return None


def parse_preset(word: str) -> PresetChoice:
    """The :class:`PresetChoice` of a ``--type`` value: a ``QUANT_OPTIONS`` name (case-insensitive) or a
    numeric ftype id.

    Raises:
        UsageError: unknown name or id.
    """
    choice = find_preset(word)
    if choice is None:
        raise UsageError(f"unknown quantization type {word!r}; "
                         f"{did_you_mean(word, [c.upper() for c in TYPE_CHOICES])}choose one of "
                         f"{', '.join(TYPE_CHOICES)} or a numeric file type id")
    return choice


def get_preset(target: str | PresetChoice) -> Preset:
    """The preset for a ``--type`` value (see :func:`parse_preset`) or an already parsed one; an alias gives
    the row it stands for.

    Raises:
        UsageError: unknown name or id.
    """
    return (target if isinstance(target, PresetChoice) else parse_preset(target)).preset


def quant_option_name(word: str) -> str | None:
    """The ``QUANT_OPTIONS`` name llama-quantize gives ``word`` (:attr:`PresetChoice.name`), or None when
    ``word`` is not a type."""
    choice = find_preset(word)
    return None if choice is None else choice.name


def default_output_name(name: str) -> str:
    """llama-quantize's output file name when none is given (quantize.cpp ``main``: ``ggml-model-`` + the type
    word's name + ``.gguf``, in IN's folder)."""
    return f"ggml-model-{name}.gguf"


def parse_type(name: str | GGMLQuantizationType, what: str = "tensor type") -> GGMLQuantizationType:
    """A ggml type from its name (``q8_0``, ``Q4_K``, ``iq2_xxs``), case-insensitive, as quantize.cpp's
    ``parse_ggml_type``; limited to :data:`TENSOR_TYPES`.

    Raises:
        UsageError: not a type llama-quantize can write.
    """
    if isinstance(name, GGMLQuantizationType):
        if name not in TENSOR_TYPES.values():
            raise UsageError(f"{what} {name.name} is not supported; choose one of {', '.join(TENSOR_TYPES)}")
        return name
    try:
        return TENSOR_TYPES[name.strip().lower()]
    except KeyError:
        raise UsageError(f"invalid {what} {name!r}; {did_you_mean(name, [t.upper() for t in TENSOR_TYPES])}"
                         f"choose one of {', '.join(TENSOR_TYPES)}") from None


def has_kernel(t: GGMLQuantizationType) -> bool:
    """ggufkit can write ``t`` (a row of :data:`ggufkit.quant.registry.TYPES`)."""
    return t in TYPES


def measured_quality() -> dict[str, object]:
    """Every preset measured on a real small model (:mod:`ggufkit.quant.llama_quantize.preset_quality`, made by
    benchmarks/bench_preset_quality.py): model, text, date and, per preset name, ``size`` (file bytes / the
    F16 file's), ``bpw`` (of the whole file), ``kld`` (mean KL divergence from F16) and ``ppl_change``."""
    from ggufkit.quant.llama_quantize.preset_quality import MEASURED

    return MEASURED


def preset_help_header() -> str:
    """What the measured columns of :func:`preset_help_lines` are, and where they come from."""
    m = measured_quality()
    return (f"size: the file as a share of the F16 file; KLD and PPL: mean KL divergence from the F16 model and "
            f"perplexity change; measured on {m['model']} ({m['reference']}), {m['text']}, imatrix for every "
            f"preset, {m['date']} (benchmarks/bench_preset_quality.py); llama-quantize's table measures Llama-3-8B")


def preset_help_lines() -> list[str]:
    """A header, then one line per ``--type`` value for ``--help``: ftype id, name, bits per weight of the default type,
    measured size relative to F16 and quality (KLD, PPL change; :func:`measured_quality`), imatrix
    requirement, kernel availability (``plan only`` until its kernel exists)."""
    measured: dict[str, dict[str, float | None]] = measured_quality()["presets"]  # type: ignore[assignment]
    lines = [f"id  {'name':<10}{'default type':<21}{'size':>7}  {'KLD':>8}  {'PPL':>8}  notes"]
    for p in PRESETS.values():
        ident = "    " if p.only_copy else f"{int(p.file_type):>2}  "
        bpw = "copy" if p.only_copy else f"{bits_per_weight(p.default_type):6.3f} bpw {type_name(p.default_type)}"
        row = measured.get(p.name, {})
        size = f"{row['size']:7.1%}" if row.get("size") is not None else ""
        kld = row.get("kld")
        ppl = row.get("ppl_change")
        ppl_text = "" if ppl is None else f"{ppl:+8.2%}" if ppl < 9.99 else f"{ppl + 1:7.0f}x"  # x: PPL ratio
        quality = (f"{kld:8.4f}  {ppl_text}" if kld is not None and ppl is not None
                   else f"{'n/a on that model' if row.get('error') else 'not measured':<18}")
        notes = [str(row["note"])] if row.get("note") else []
        if p.needs_imatrix:
            notes.append("needs imatrix")
        if not has_kernel(p.default_type):
            notes.append("plan only")
        elif not p.only_copy and not TYPES[p.default_type].has_cuda and not TYPES[p.default_type].is_float:
            notes.append("CPU only")
        lines.append(f"{ident}{p.name.upper():<10}{bpw:<21}{size:>7}  {quality}  {', '.join(notes)}".rstrip())
    return lines


def type_help_lines() -> list[str]:
    """One line per tensor type (``--tensor-type`` and friends): name, bits per weight, imatrix, kernel."""
    out = []
    for name, t in TENSOR_TYPES.items():
        block, size = GGML_QUANT_SIZES[t]
        notes = ["needs imatrix" if t in REQUIRES_IMATRIX else "", "" if has_kernel(t) else "plan only"]
        out.append(f"{name:<8}{8 * size / block:6.3f} bpw  {', '.join(n for n in notes if n)}".rstrip())
    return out
