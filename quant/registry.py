"""The table of type traits: one row per GGML type ggufkit can write.

:data:`TYPES` is the single source of truth for which tensor types ggufkit produces, where their kernels
live, whether they have a CUDA kernel and whether llama-quantize insists on an importance matrix for them.
The dispatch layer (:mod:`ggufkit.quant.dispatch`), the planner (:mod:`ggufkit.quant.llama_quantize.plan`),
the CLI's ``--help`` and the tests (parametrised over :data:`KERNELS`) all read it. Block size and bytes per
block come from ``gguf.GGML_QUANT_SIZES`` and are never restated. Kernel modules are named, not imported,
so reading the table costs nothing (``ggufkit --help`` must not import Numba); :meth:`TypeTraits.cpu` and
:meth:`TypeTraits.cuda` import on first use.

Adding a type is one row of :data:`TYPES` plus its kernel module. Row format::

    _row(T.IQ4_NL, "lowbit.iq4", scales=(0,))   # CPU ggufkit.quant.kernels.lowbit.iq4, CUDA ...lowbit.cuda
    _row(T.Q2_K, "kquants.cpu_low", cuda_family="lowbit")  # CUDA kernel in ggufkit.quant.kernels.lowbit.cuda
    _row(T.IQ2_XXS, "iq.iq2", cuda=False, scales=(0,))     # grid type: CPU only (CPU under --device cuda)

``scales``: byte offsets in one block of the f16 scales that ``ggml_validate_row_data`` (ggml-quants.c)
checks for inf/NaN; ``chunksize``: prange chunk size for the CPU kernel (0: Numba's static split);
``cuda_family``: the family package holding the CUDA kernel when it is not the row's own.

Kernel naming convention (every row, both backends): kernels live in ``ggufkit.quant.kernels``, one
sub-package per family (``legacy``, ``kquants``, ``iq``, ``lowbit``). A row names its CPU module as
``"<family>.<module>"`` and the kernels are

* CPU: ``ggufkit.quant.kernels.<family>.<module>``, functions ``quantize_rows_<t>`` / ``dequantize_rows_<t>``;
* CUDA: the family's one CUDA module ``ggufkit.quant.kernels.<family>.cuda`` (``<cuda_family>`` in place of
  ``<family>`` where the row says so), functions ``quantize_rows_<t>_cuda`` / ``dequantize_rows_<t>_cuda``;
* fused F16 input, optional, CPU only: ``ggufkit.quant.kernels.<family>.<module>_f16``, function
  ``quantize_f16_rows_<t>``;

where ``<t>`` is ggml's lower-case type name with K types keeping ``_K`` (``q4_0``, ``q2_K``, ``iq4_nl``,
``tq1_0``, ``mxfp4``, ``iq2_xxs``). Signatures:

* ``quantize_rows_<t>(x: float32[n_rows, n_per_row], qw: float32[k], out: uint8[n_rows, row_bytes])``;
  ``k == 0`` means no imatrix (ggml's reference quantizer), ``k == n_per_row`` the weighted variant.
* ``dequantize_rows_<t>(blocks: uint8[n_rows, row_bytes], out: float32[n_rows, n_per_row])``.
* ``quantize_f16_rows_<t>(h: uint16[n_rows, n_per_row], qw, out, bad_rows: uint8[n_rows])`` widens F16 bits
  row by row inside the kernel (same bytes as ``quantize`` on the widened values) and flags rows holding
  inf/NaN.

The float targets F32/F16/BF16 are element-wise conversions, not block kernels: their rows have no kernel
module and :mod:`ggufkit.quant.dispatch` converts them directly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

#: Types llama-quantize refuses to produce without importance-matrix data (src/llama-quant.cpp:
#: tensor_requires_imatrix; Q2_K is added there only inside a Q2_K_S file, see
#: ggufkit.quant.llama_quantize.presets.Preset.requires_imatrix).
#: Kept for every type, kernel or not, so the planner can refuse a plan before any kernel exists.
REQUIRES_IMATRIX: frozenset[GGMLQuantizationType] = frozenset(
    {T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S})


def type_name(t: GGMLQuantizationType) -> str:
    """ggml's name of a type as kernel function names spell it: ``q4_0``, ``q4_K``, ``iq2_xxs``, ``f16``."""
    name = t.name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name


def bits_per_weight(t: GGMLQuantizationType) -> float:
    """Storage bits per weight of ``t`` (``8 * bytes per block / block size``)."""
    block, size = GGML_QUANT_SIZES[t]
    return 8.0 * size / block


@dataclass(frozen=True)
class TypeTraits:
    """One writable GGML type. Sizes are read from ``gguf.GGML_QUANT_SIZES``, never restated.

    Attributes:
        qtype: the GGML type (its ``int`` is the ggml type id).
        kernel: the CPU kernel module under ``ggufkit.quant.kernels`` as ``"<family>.<module>"``
            ("" for the element-wise float types).
        has_cuda: a CUDA kernel exists (``ggufkit.quant.kernels.<family>.cuda``); without one,
            ``--device cuda`` runs this type on the CPU and says so in the plan and summary.
        has_f16_kernel: a fused F16-input CPU kernel exists (``ggufkit.quant.kernels.<family>.<module>_f16``).
        scale_offsets: byte offsets of the f16 scales in one block, checked like ``ggml_validate_row_data``.
        chunksize: prange iterations handed out at a time by the CPU kernel (0: Numba's default).
        cuda_family: the family package holding the CUDA module when it is not the row's own family.
    """

    qtype: GGMLQuantizationType
    kernel: str = ""
    has_cuda: bool = True
    has_f16_kernel: bool = False
    scale_offsets: tuple[int, ...] = ()
    chunksize: int = 0
    cuda_family: str = ""

    @property
    def name(self) -> str:
        """ggml's type name (``q4_K``)."""
        return type_name(self.qtype)

    @property
    def type_id(self) -> int:
        """ggml's type id (``ggml_type``)."""
        return int(self.qtype)

    @property
    def block_size(self) -> int:
        """Elements per block (``GGML_QUANT_SIZES[qtype][0]``)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        """Bytes per block (``GGML_QUANT_SIZES[qtype][1]``)."""
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight."""
        return bits_per_weight(self.qtype)

    @property
    def needs_imatrix(self) -> bool:
        """llama-quantize refuses to write this type without an importance matrix (:data:`REQUIRES_IMATRIX`)."""
        return self.qtype in REQUIRES_IMATRIX

    @property
    def is_float(self) -> bool:
        """An element-wise float conversion rather than a block kernel."""
        return not self.kernel

    @property
    def is_grid(self) -> bool:
        """Its quantizer searches a lattice grid per block: the ``iq`` family (ggml-quants.c
        quantize_row_iq2_xxs_impl, quantize_row_iq2_xs_impl, quantize_row_iq2_s_impl, quantize_row_iq3_xxs_impl,
        quantize_row_iq3_s_impl, quantize_row_iq1_s_impl, quantize_row_iq1_m_impl): 3-15x the CPU time per row
        of the other types."""
        return self.family == "iq"

    def row_bytes(self, n_per_row: int) -> int:
        """Bytes of one row of ``n_per_row`` elements (a multiple of :attr:`block_size`)."""
        return n_per_row // self.block_size * self.type_size

    # Module and function names, derived from the naming convention (see the module docstring).
    @property
    def family(self) -> str:
        """The kernel family: the package under ``ggufkit.quant.kernels`` ("" for the float types)."""
        return self.kernel.partition(".")[0]

    @property
    def cpu_module(self) -> str:
        return f"ggufkit.quant.kernels.{self.kernel}"

    @property
    def cpu_f16_module(self) -> str:
        return f"{self.cpu_module}_f16" if self.has_f16_kernel else ""

    @property
    def cuda_module(self) -> str:
        if not self.has_cuda:
            return ""
        return f"ggufkit.quant.kernels.{self.cuda_family or self.family}.cuda"

    @property
    def cpu_quantize(self) -> str:
        return f"quantize_rows_{self.name}"

    @property
    def cpu_dequantize(self) -> str:
        return f"dequantize_rows_{self.name}"

    @property
    def cuda_quantize(self) -> str:
        return f"quantize_rows_{self.name}_cuda"

    @property
    def cuda_dequantize(self) -> str:
        return f"dequantize_rows_{self.name}_cuda"

    def cpu(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Import and return the CPU ``(quantize, dequantize)`` kernels."""
        module = importlib.import_module(self.cpu_module)
        return getattr(module, self.cpu_quantize), getattr(module, self.cpu_dequantize)

    def cpu_f16(self) -> Callable[..., Any] | None:
        """Import and return the fused F16-input CPU quantize kernel, or None where the type has none."""
        if not self.has_f16_kernel:
            return None
        return getattr(importlib.import_module(self.cpu_f16_module), f"quantize_f16_rows_{self.name}")

    def cuda(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Import and return the CUDA ``(quantize, dequantize)`` host wrappers (imports ``numba.cuda``).

        Raises:
            LookupError: the type has no CUDA kernel (check :attr:`has_cuda` first).
        """
        if not self.has_cuda:
            raise LookupError(f"{self.qtype.name} has no CUDA kernel")
        module = importlib.import_module(self.cuda_module)
        return getattr(module, self.cuda_quantize), getattr(module, self.cuda_dequantize)


def _row(qtype: GGMLQuantizationType, kernel: str = "", *, cuda: bool = True, f16_kernel: bool = False,
         scales: tuple[int, ...] = (), chunksize: int = 0, cuda_family: str = ""
         ) -> tuple[GGMLQuantizationType, TypeTraits]:
    return qtype, TypeTraits(qtype, kernel, has_cuda=cuda and bool(kernel), has_f16_kernel=f16_kernel,
                             scale_offsets=scales, chunksize=chunksize, cuda_family=cuda_family)


#: Every type ggufkit can write, one row each (in ggml type-id order within a family).
TYPES: dict[GGMLQuantizationType, TypeTraits] = dict((
    # element-wise: ggml_quantize_chunk copies F32 and converts with ggml_fp32_to_fp16_row /
    # ggml_fp32_to_bf16_row_ref
    _row(T.F32), _row(T.F16), _row(T.BF16),
    # ggml-quants.c quantize_row_q4_0_ref ... quantize_row_q8_0_ref and the quantize_q*_0 imatrix variants
    _row(T.Q4_0, "legacy.cpu", f16_kernel=True, scales=(0,)),
    _row(T.Q4_1, "legacy.cpu", f16_kernel=True, scales=(0, 2)),
    _row(T.Q5_0, "legacy.cpu", f16_kernel=True, scales=(0,)),
    _row(T.Q5_1, "legacy.cpu", f16_kernel=True, scales=(0, 2)),
    _row(T.Q8_0, "legacy.cpu", f16_kernel=True, scales=(0,)),
    # ggml-quants.c quantize_row_q4_K_ref ... quantize_row_q6_K_ref and quantize_q*_K. chunksize 8: Numba's
    # static split makes a call wait for its slowest thread, which on a shared machine is the one whose core
    # is busy elsewhere; dynamic chunks of 8 took a 2.9M-weight Q4_K call next to one busy core from 138 to
    # 106 ms (no change on an idle machine). The legacy kernels lose more to the scheduling than they gain.
    _row(T.Q4_K, "kquants.cpu", scales=(0, 2), chunksize=8),
    _row(T.Q5_K, "kquants.cpu", scales=(0, 2), chunksize=8),
    _row(T.Q6_K, "kquants.cpu", f16_kernel=True, scales=(208,), chunksize=8),
    # ggml-quants.c quantize_row_q2_K_ref / quantize_q2_K, quantize_row_q3_K_ref / quantize_q3_K
    _row(T.Q2_K, "kquants.cpu_low", scales=(80, 82), chunksize=8, cuda_family="lowbit"),
    _row(T.Q3_K, "kquants.cpu_low", scales=(108,), chunksize=8, cuda_family="lowbit"),
    # ggml-quants.c quantize_iq4_nl / quantize_iq4_xs (non-linear 4-bit grid, no search table)
    _row(T.IQ4_NL, "lowbit.iq4", scales=(0,)),
    _row(T.IQ4_XS, "lowbit.iq4", scales=(0,)),
    # ggml-quants.c quantize_row_tq1_0_ref / quantize_row_tq2_0_ref (ternary; no imatrix path)
    _row(T.TQ1_0, "lowbit.ternary", scales=(52,)),
    _row(T.TQ2_0, "lowbit.ternary", scales=(64,)),
    # ggml-quants.c quantize_row_mxfp4_ref (E8M0 shared exponent: no f16 scale to validate)
    _row(T.MXFP4, "lowbit.mxfp4", f16_kernel=True),
    # ggml-quants.c quantize_row_q1_0_ref
    _row(T.Q1_0, "lowbit.q1_0", scales=(0,)),
    # ggml-quants.c quantize_iq2_xxs ... quantize_iq1_m: searches over ggml's grids (tables built as
    # iq2xs_init_impl / iq3xs_init_impl do). CPU only: under --device cuda they run on the CPU, and the plan
    # says so. IQ1_M keeps its f16 scale spread over scales[] (ggml_validate_row_data reassembles it).
    _row(T.IQ2_XXS, "iq.iq2", cuda=False, scales=(0,)), _row(T.IQ2_XS, "iq.iq2", cuda=False, scales=(0,)),
    _row(T.IQ3_XXS, "iq.iq3", cuda=False, scales=(0,)), _row(T.IQ1_S, "iq.iq1", cuda=False, scales=(0,)),
    _row(T.IQ3_S, "iq.iq3", cuda=False, scales=(0,)), _row(T.IQ2_S, "iq.iq2", cuda=False, scales=(0,)),
    _row(T.IQ1_M, "iq.iq1", cuda=False),
))

#: Element-wise float targets (rows without a kernel module).
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset(t for t, r in TYPES.items() if r.is_float)

#: Block types with kernels, in ggml type-id order (the rows with a kernel module).
KERNELS: dict[GGMLQuantizationType, TypeTraits] = {
    t: r for t, r in sorted(TYPES.items(), key=lambda kv: int(kv[0])) if not r.is_float}

#: Every type :func:`ggufkit.quant.quantize` can produce.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(TYPES)

#: The grid-search types (:attr:`TypeTraits.is_grid`).
GRID_TYPES: frozenset[GGMLQuantizationType] = frozenset(t for t, r in TYPES.items() if r.is_grid)
