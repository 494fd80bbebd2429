"""Real-GPU check of the CUDA quantization kernels: bytes equal to the CPU kernels, and throughput.

Not a pytest file (CI has no GPU). Run on a machine with CUDA, with ggufkit importable::

    python benchmarks/gpu_quant_check.py [--weights 4000000] [--bench-weights 268435456]

For every type in ``ggufkit.quant.KERNELS`` that has CUDA kernels it quantizes a few million weights of
several distributions (normal, bf16-rounded, edge blocks: zeros, constants, one non-zero, subnormals,
huge magnitudes, negative maxima, .5 ties) with and without an imatrix, on the GPU and the CPU, and
compares bytes; then the same through the public API on F16 input (``quantize(f16, t, device="cuda")``
against ``device="cpu"``: the file pipeline's path, whose CPU side has its own fused F16 kernels), on a
row length that is a whole number of super-blocks and one that is not; then compares dequantization;
then times the GPU path on ``--bench-weights`` weights and reports GB/s of the equivalent F16 input (2
bytes per weight), end to end (host f32 in, host bytes out) and kernel only. Prints one JSON object per
line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _data(n_weights: int, n_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = max(8, n_weights // n_per_row)
    x = (rng.standard_normal((rows, n_per_row)) * 0.02).astype(np.float32)
    bf = x[rows // 4: rows // 2].view(np.uint32) & np.uint32(0xFFFF0000)
    x[rows // 4: rows // 2] = bf.view(np.float32)
    e = x[:8]
    e[0] = 0.0
    e[1] = np.float32(0.37)
    e[2] = 0.0
    e[2, ::37] = 1.5
    e[3] = (rng.standard_normal(n_per_row) * 1e-40).astype(np.float32)
    e[4] = (rng.standard_normal(n_per_row) * 1e37).astype(np.float32)
    e[5] = -np.abs(rng.standard_normal(n_per_row)).astype(np.float32)
    e[6] = (rng.integers(-64, 64, n_per_row) / 16).astype(np.float32)
    e[7] = (rng.standard_normal(n_per_row) * 1e-6).astype(np.float32)
    return x


def _f16_api_check(quantize, qtype, block_size: int, rows: int, qw: np.ndarray) -> dict:
    """F16 rows (normal, edge rows: zeros, a constant, sparse, subnormal halves, near 65504, negative, ties)
    quantized by the public API on both devices; returns ``f16_<n>_<path>_equal`` per row length."""
    rec: dict = {}
    for n in (4096, 4352 if block_size == 256 else 576 if 576 % block_size == 0 else 4096 + block_size):
        rng = np.random.default_rng(int(qtype) * 7 + n)
        x = (rng.standard_normal((rows, n)) * 0.02).astype(np.float16)
        x[0] = 0
        x[1] = np.float16(0.37)
        x[2, ::37] = 1.5
        x[3] = (rng.standard_normal(n) * 1e-6).astype(np.float16)
        x[4] = (rng.standard_normal(n) * 6e4).clip(-65504, 65504).astype(np.float16)
        x[5] = -np.abs(x[5])
        x[6] = (rng.integers(-64, 64, n) / 16).astype(np.float16)
        w = np.resize(qw, n)
        for label, im in (("ref", None), ("imatrix", w)):
            a = quantize(x, qtype, imatrix=im, device="cpu")
            b = quantize(x, qtype, imatrix=im, device="cuda")
            rec[f"f16_{n}_{label}_equal"] = bool(np.array_equal(a, b))
            if not rec[f"f16_{n}_{label}_equal"]:
                rec[f"f16_{n}_{label}_bad_rows"] = np.nonzero((a != b).any(axis=1))[0][:10].tolist()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", type=int, default=4_000_000)
    ap.add_argument("--bench-weights", type=int, default=1 << 28)
    ap.add_argument("--types", default="")
    ap.add_argument("--f16-rows", type=int, default=512, help="rows per F16 public-API check (0: skip)")
    args = ap.parse_args()
    if not hasattr(np, "row_stack"):
        # numba 0.68.0's parallel CPU backend still names np.row_stack, which NumPy 2.5 removed (seen on
        # the GPU image: numba 0.68.0 + numpy 2.5.2); an alias keeps the CPU reference kernels compiling.
        np.row_stack = np.vstack

    from numba import cuda

    from ggufkit.quant import KERNELS, quantize

    try:
        name = cuda.get_current_device().name
        print(json.dumps({"gpu": name.decode() if isinstance(name, bytes) else str(name)}), flush=True)
    except AttributeError:  # the simulator has no device object
        print(json.dumps({"gpu": "simulator"}), flush=True)
    bench_data: dict[int, np.ndarray] = {}
    wanted = {s.strip().upper() for s in args.types.split(",") if s.strip()}
    for qtype, k in KERNELS.items():
        if wanted and qtype.name not in wanted:
            continue
        rec: dict = {"type": qtype.name}
        try:
            gq, gdq = k.cuda()
        except (ImportError, AttributeError, LookupError) as exc:
            rec["cuda"] = f"missing: {exc}"
            print(json.dumps(rec), flush=True)
            continue
        cq, cdq = k.cpu()
        n_per_row = 4096 if k.block_size == 256 else 2048
        x = _data(args.weights, n_per_row, seed=int(qtype))
        qw = np.random.default_rng(1).uniform(0.0, 3.0, n_per_row).astype(np.float32)
        try:
            for label, w in (("ref", np.zeros(0, np.float32)), ("imatrix", qw)):
                a = np.empty((x.shape[0], k.row_bytes(n_per_row)), np.uint8)
                b = np.empty_like(a)
                t0 = time.perf_counter()
                cq(x, w, a)
                t1 = time.perf_counter()
                gq(x, w, b)
                t2 = time.perf_counter()
                bad = (a.reshape(-1, k.type_size) != b.reshape(-1, k.type_size)).any(axis=1)
                rec[f"{label}_bad_blocks"] = int(bad.sum())
                rec[f"{label}_blocks"] = int(bad.size)
                if bad.any():
                    per_row = bad.reshape(x.shape[0], -1).any(axis=1)
                    rec[f"{label}_bad_rows"] = np.nonzero(per_row)[0][:10].tolist()
                rec[f"{label}_cpu_s"] = round(t1 - t0, 3)
                rec[f"{label}_gpu_first_call_s"] = round(t2 - t1, 3)
            if args.f16_rows:
                rec.update(_f16_api_check(quantize, qtype, k.block_size, args.f16_rows, qw))
            ya = np.empty(x.shape, np.float32)
            yb = np.empty_like(ya)
            cdq(a, ya)
            gdq(a, yb)
            # NaN payloads differ between x86 and CUDA (0xFFC00000 vs 0x7FFFFFFF); compare NaN as NaN.
            diff = (ya.view(np.uint32) != yb.view(np.uint32)) & ~(np.isnan(ya) & np.isnan(yb))
            rec["dequant_bad"] = int(diff.sum())
            if diff.any():
                rec["dequant_bad_rows"] = np.nonzero(diff.any(axis=1))[0][:10].tolist()
            # Throughput: end to end through the host wrapper, F16-equivalent input bytes.
            if n_per_row not in bench_data:  # one array per row length, shared by the types
                n_rows = max(1, args.bench_weights // n_per_row)
                bench_data.clear()
                bench_data[n_per_row] = (np.random.default_rng(2).standard_normal((n_rows, n_per_row),
                                                                                  dtype=np.float32) * 0.02)
            big = bench_data[n_per_row]
            n_rows = big.shape[0]
            out = np.empty((n_rows, k.row_bytes(n_per_row)), np.uint8)
            gq(big[:8], np.zeros(0, np.float32), out[:8])
            cuda.synchronize()
            t0 = time.perf_counter()
            gq(big, np.zeros(0, np.float32), out)
            cuda.synchronize()
            dt = time.perf_counter() - t0
            rec["bench_weights"] = int(big.size)
            rec["gpu_end_to_end_GBps_f16"] = round(2 * big.size / dt / 1e9, 2)
            rec["gpu_end_to_end_Mweights_s"] = round(big.size / dt / 1e6, 1)
            # Kernel only, when the module exposes its device-array entry point.
            mod = __import__(k.cuda_module, fromlist=["_"])
            dev_fn = getattr(mod, "quantize_device", None)
            if dev_fn is not None:
                d_x = cuda.to_device(big)
                d_out = cuda.device_array(out.shape, np.uint8)
                dev_fn(qtype, d_x, None, d_out)
                cuda.synchronize()
                t0 = time.perf_counter()
                dev_fn(qtype, d_x, None, d_out)
                cuda.synchronize()
                dt = time.perf_counter() - t0
                rec["gpu_kernel_GBps_f16"] = round(2 * big.size / dt / 1e9, 2)
                del d_x, d_out
            del out
        except Exception as exc:  # report and go on to the next type
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
