"""Torch dequantization of GGUF tensor bytes, on whatever device the bytes live on.

Each kernel takes ``blocks: uint8[n_blocks, type_size]`` (the raw GGUF bytes of whole blocks, kept on the
device) and returns ``float32[n_blocks, block_size]``. The arithmetic follows gguf-py's
``gguf.quants.<TYPE>.dequantize_blocks`` operation for operation, in float32, so the values are equal to
``gguf.quants.dequantize`` bit for bit (the tests check every type on random blocks). No fused
multiply-add is used: ``d * q - m`` is two rounded float32 operations, as in numpy.

Block layouts (ggml-common.h; little-endian):

* Q4_0 (32 values, 18 bytes): f16 ``d``, 16 bytes of nibbles (low nibbles are values 0..15, high 16..31).
* Q4_1 (32, 20): f16 ``d``, f16 ``m``, 16 bytes of nibbles; ``x = d*q + m``.
* Q5_0 (32, 22): f16 ``d``, u32 ``qh`` (bit j is the fifth bit of value j), 16 bytes of nibbles.
* Q5_1 (32, 24): f16 ``d``, f16 ``m``, u32 ``qh``, 16 bytes of nibbles.
* Q8_0 (32, 34): f16 ``d``, 32 int8.
* Q4_K (256, 144): f16 ``d``, f16 ``dmin``, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles.
* Q5_K (256, 176): as Q4_K plus 32 bytes ``qh`` (bit j of byte l is the fifth bit of sub-block j, value l).
* Q6_K (256, 210): 128 bytes low nibbles ``ql``, 64 bytes 2-bit highs ``qh``, 16 int8 scales, f16 ``d``.
* Q2_K (256, 84): 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit quants, f16 ``d``, f16 ``dmin``.
* Q3_K (256, 110): 32 bytes ``hmask`` (third bit), 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, f16 ``d``.
* IQ4_NL (32, 18): f16 ``d``, 16 bytes of nibbles indexing ``kvalues_iq4nl``.
* IQ4_XS (256, 136): f16 ``d``, u16 ``scales_h``, 4 bytes ``scales_l`` (6-bit scales), 128 bytes of nibbles.
* TQ1_0 (256, 54): 48 + 4 bytes of base-3 digits (5 and 4 per byte), f16 ``d``; TQ2_0 (256, 66): 64 bytes of
  2-bit trits, f16 ``d``.
* MXFP4 (32, 17): E8M0 exponent byte, 16 bytes of nibbles indexing the doubled E2M1 values.
* Q1_0 (128, 18): f16 ``d``, 16 bytes of sign bits (``+d`` / ``-d``).

Types gguf-py cannot dequantize (Q1_0) follow ggml's ``dequantize_row_*`` instead, also bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.errors import EvaluationError

Q = GGMLQuantizationType


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """f16 at byte ``start`` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _u32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """u32 at byte ``start`` of each block, as int64 [n_blocks, 1] (torch has no uint32 shifts)."""
    b = blocks[:, start:start + 4].to(torch.int64)
    return b[:, 0:1] | (b[:, 1:2] << 8) | (b[:, 2:3] << 16) | (b[:, 3:4] << 24)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: all low nibbles, then all high nibbles (ggml's order within a 32-block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).to(torch.float32)
    return d * q + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """u32 [n, 1] -> bit j of it for j = 0..31, as uint8 [n, 32]."""
    shifts = torch.arange(32, device=qh.device, dtype=torch.int64)
    return ((qh >> shifts) & 1).to(torch.uint8)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:22]) | (_fifth_bits(_u32(blocks, 2)) << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = (_nibbles(blocks[:, 8:24]) | (_fifth_bits(_u32(blocks, 4)) << 4)).to(torch.float32)
    return d * q + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return d * blocks[:, 2:34].contiguous().view(torch.int8).to(torch.float32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4), each [n, 8]."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [n, 8, 32]: sub-block 2i is the low nibbles of bytes 32i.., 2i+1 their high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(-1, 4, 2, 1)
    shift = (dmin * mn.to(torch.float32)).reshape(-1, 4, 2, 1)
    # Sub-block 2i is the low nibbles of bytes 32i.., 2i+1 their high nibbles (:func:`_k_low_nibbles`), written
    # straight into the output and scaled there: the same two rounded operations, no intermediate copies
    # (the evaluator dequantizes every expert it runs this way: its time is the MoE forward's).
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    out = torch.empty((blocks.shape[0], 4, 2, 32), dtype=torch.float32, device=blocks.device)
    out[:, :, 0] = qs & 0x0F
    out[:, :, 1] = qs >> 4
    return out.mul_(scale).sub_(shift).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).unsqueeze(-1)
    shift = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    qh = blocks[:, 16:48].reshape(-1, 1, 32)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 8, 1)
    high = (qh >> shifts) & 1
    q = (_k_low_nibbles(blocks[:, 48:176]) | (high << 4)).to(torch.float32)
    return (scale * q - shift).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    qh = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(-1, 8, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(blocks, 208)
    scale = (d * scales).reshape(-1, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(-1, 16, 16)
    # widened into the output and scaled in place (one float32 array, not two: an output head is 100s of MB)
    return torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q).mul_(scale).reshape(-1, 256)


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """64 bytes -> [n, 16, 16]: Q2_K/Q3_K/TQ2_0's 2-bit order (byte 32h + l holds value 128h + 32s + l at bits 2s)."""
    shifts = torch.arange(0, 8, 2, device=qs.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    sc = blocks[:, 0:16]
    scale = (d * (sc & 0x0F).to(torch.float32)).unsqueeze(-1)
    shift = (dmin * (sc >> 4).to(torch.float32)).unsqueeze(-1)
    return (scale * _two_bit(blocks[:, 16:80]).to(torch.float32) - shift).reshape(-1, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 108)
    s = blocks[:, 96:108].to(torch.int32)
    j = torch.arange(16, device=blocks.device)
    low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=-1)
    high = (s[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    scale = (d * ((low | (high << 4)) - 32).to(torch.float32)).unsqueeze(-1)
    bit = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 8, 1)
    hbit = ((blocks[:, 0:32].reshape(-1, 1, 32) >> bit) & 1).reshape(-1, 16, 16)  # bit 4h+s of byte l
    q = _two_bit(blocks[:, 32:96]).to(torch.int32) - 4 * (1 - hbit.to(torch.int32))
    return (scale * q.to(torch.float32)).reshape(-1, 256)


_KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h
_KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # ggml-common.h, doubled E2M1


def _lookup(table: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.float32, device=idx.device)[idx.to(torch.int64)]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _lookup(_KVALUES_IQ4NL, _nibbles(blocks[:, 2:18]))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    sh = blocks[:, 2:3].to(torch.int32) | (blocks[:, 3:4].to(torch.int32) << 8)
    ib = torch.arange(8, device=blocks.device)
    ls = ((blocks[:, 4 + ib // 2].to(torch.int32) >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)
    scale = (d * (ls - 32).to(torch.float32)).unsqueeze(-1)
    return (scale * _lookup(_KVALUES_IQ4NL, _nibbles(blocks[:, 8:136].reshape(-1, 8, 16)))).reshape(-1, 256)


def _trits(q: torch.Tensor, n: int) -> torch.Tensor:
    """TQ1_0 bytes [b, k] -> their first n base-3 digits [b, n, k]: ``((q * 3^i mod 256) * 3) >> 8``."""
    pow3 = torch.tensor([1, 3, 9, 27, 81][:n], dtype=torch.int32, device=q.device).reshape(1, n, 1)
    return (((q.to(torch.int32).unsqueeze(1) * pow3) & 0xFF) * 3) >> 8


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 52)
    q = torch.cat([_trits(blocks[:, 0:32], 5).flatten(1), _trits(blocks[:, 32:48], 5).flatten(1),
                   _trits(blocks[:, 48:52], 4).flatten(1)], dim=-1)
    return (q - 1).to(torch.float32) * d


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _two_bit(blocks[:, 0:64]).reshape(-1, 256).to(torch.int32)
    return (q - 1).to(torch.float32) * _f16(blocks, 64)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e = blocks[:, 0:1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128), built from its bits (subnormal below e = 2).
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return _lookup(_KVALUES_MXFP4, _nibbles(blocks[:, 1:17])) * bits.view(torch.float32)


def _q1_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 1, 8)
    bits = ((blocks[:, 2:18].unsqueeze(-1) >> shifts) & 1).reshape(-1, 128)
    return torch.where(bits.bool(), d, -d)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_blocks(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # A bf16 value is the top half of a float32: widening it is exact (gguf-py shifts the bits the same way).
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


#: Kernel per supported tensor type; F32/F16/BF16 are "blocks" of one value.
DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_blocks,
    Q.BF16: _bf16,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
    Q.MXFP4: _mxfp4,
    Q.Q1_0: _q1_0,
}


def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether :func:`dequantize` decodes ``qtype`` (torch kernels, or the quantizer's for the grid types)."""
    from ggufkit.quant.registry import KERNELS

    return qtype in DEQUANTIZERS or qtype in KERNELS


def _dequantize_on_cpu(raw: torch.Tensor, qtype: GGMLQuantizationType, n_per_row: int) -> torch.Tensor:
    """Types without a torch kernel here (the grid types IQ1/IQ2/IQ3, whose decoding is table lookups):
    the quantizer's own Numba dequantizer, bit-identical to ggml's ``dequantize_row_*``, on the CPU, then
    copied to ``raw``'s device."""
    from ggufkit.quant import dequantize as quant_dequantize
    from ggufkit.quant.registry import KERNELS

    if qtype not in KERNELS:
        supported = ", ".join(t.name for t in sorted({*DEQUANTIZERS, *KERNELS}, key=int))
        raise EvaluationError(f"tensor type {qtype.name} is not supported by the evaluator (supported: {supported})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_rows = raw.shape[0] if raw.dim() > 1 else 1
    if n_per_row % block_size or raw.numel() != n_rows * (n_per_row // block_size) * type_size:
        raise EvaluationError(f"{raw.numel()} bytes do not hold {n_rows} rows of {n_per_row} {qtype.name} values")
    host = raw.detach().to("cpu").contiguous().numpy()
    out = quant_dequantize(host, qtype, (n_rows, n_per_row))
    return torch.from_numpy(out).to(raw.device)


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, n_per_row: int) -> torch.Tensor:
    """Dequantize rows of raw GGUF bytes.

    Args:
        raw: ``uint8[n_rows, row_bytes]``, the tensor's bytes (on any device), rows of ``n_per_row`` values.
        qtype: the tensor's GGML type (one of :data:`DEQUANTIZERS`).
        n_per_row: values per row (``ne[0]``), a multiple of the type's block size.

    Returns:
        ``float32[n_rows, n_per_row]`` on ``raw``'s device, equal to ``gguf.quants.dequantize``.

    Raises:
        EvaluationError: the type has no kernel, or the byte count does not fit the row length.
    """
    kernel = DEQUANTIZERS.get(qtype)
    if kernel is None:
        return _dequantize_on_cpu(raw, qtype, n_per_row)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        type_size, block_size = type_size, 1
    n_rows = raw.shape[0] if raw.dim() > 1 else 1
    if n_per_row % block_size or raw.numel() != n_rows * (n_per_row // block_size) * type_size:
        raise EvaluationError(f"{raw.numel()} bytes do not hold {n_rows} rows of {n_per_row} {qtype.name} values")
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return kernel(raw.reshape(-1)).reshape(n_rows, n_per_row)
    blocks = raw.reshape(-1, type_size)
    return kernel(blocks).reshape(n_rows, n_per_row)
