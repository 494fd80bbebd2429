"""PowerInfer (PWRI) files through ``ggufkit quantize``, checked against PowerInfer's own tools (commit d3ebd7c,
built by ``python tests/powerinfer_build.py``; missing binaries fail these tests, they never skip).

Oracles:

* PowerInfer's ``quantize`` binary, for every type and preset its ``quantize`` offers, on two tiny ReLU-LLaMA
  PWRI files converted by ggufkit: rows of 256 (the K-quants apply) and rows of 64 (they fall back). The
  output must have the same tensors in the same order, **exactly the same type for every tensor**, the same
  ``general.file_type`` and the same KV pairs in the same order (ggufkit's own ``ggufkit.*`` keys aside).
* Bytes: PowerInfer's binary is built with ``-march=native``, and GCC then fuses ``a*b+c`` into FMA
  instructions inside ggml's quantizers, which moves rounding ties: a small fraction of bytes differ (measured
  here: 0 for most Q5_0/Q8_0 tensors, up to ~1 % of a small Q4_K tensor, ~0.4 % of a Q4_K_M file). So the
  test counts the differing bytes and asserts they stay a small fraction (< 2 % per tensor, < 1 % per file).
  The exact oracle is the same PowerInfer ggml C compiled with ``-ffp-contract=off``
  (``tests/powerinfer_build.py: reference_lib``): ggufkit's bytes equal it exactly, for every quantized tensor.
  (Compiled with GCC's default ``-ffp-contract=fast`` instead, that library reproduced the binary's bytes
  exactly - checked by hand when this test was written - so the differences are the FMA ties and nothing else.)
* PowerInfer's ``main``: ggufkit's quantized and converted (F16) PWRI files load, report sparse inference, and
  generate tokens (exit 0). The predictor is inside the PWRI file (``blk.N.fc1``/``fc2``), so ``main`` takes
  the model alone. ``n_ff`` is 1024 because PowerInfer's sparse FFN takes a different, off-by-one path at
  ``n_ff <= 1000`` (ggml.c ``ggml_compute_forward_mul_mat_sparse_head``).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_models import make_checkpoint, make_predictor
from gguf import GGMLQuantizationType as QT
from powerinfer_build import reference_lib, tool_path

from ggufkit.converters import convert
from ggufkit.errors import QuantizationError
from ggufkit.format import open_gguf
from ggufkit.quant.llama_quantize.pipeline import quantize_file
from ggufkit.quant.llama_quantize.plan_powerinfer import POWERINFER_PRESETS
from ggufkit.quant.registry import SUPPORTED_TYPES

#: Every name PowerInfer's quantize.cpp QUANT_OPTIONS offers (COPY aside), aliases included.
ALL_PRESETS = [*POWERINFER_PRESETS, "q3_k", "q4_k", "q5_k"]
#: The presets whose choices depend on the row length (fallbacks, output rule), for the 64-wide model.
NARROW_PRESETS = ["q4_0", "q4_k_m", "q4_k_s", "q6_k", "f16"]
OPT_PRESETS = ["q4_0", "q4_k_m", "q8_0"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PWRI files (F16, 2 layers): ReLU-LLaMA ``wide`` (n_embd 256, n_ff 1024, rank 64) and ``narrow`` (n_embd
    64, n_ff 128, rank 32: the file of issue 10, where ffn_down_t gets Q5_0 from PowerInfer), and ``opt``
    (n_embd 256, n_ff 1024: biases, a position table that PowerInfer quantizes, no output.weight)."""
    d = tmp_path_factory.mktemp("pwri")
    out = {}
    for name, n_embd, n_ff, rank in (("wide", 256, 1024, 64), ("narrow", 64, 128, 32), ("opt", 256, 1024, 64)):
        if name == "opt":
            ckpt = make_checkpoint(d / f"{name}-ckpt", "OPTForCausalLM", hidden_size=n_embd, ffn_dim=n_ff,
                                   word_embed_proj_dim=n_embd)
        else:
            ckpt = make_checkpoint(d / f"{name}-ckpt", "LlamaForCausalLM", hidden_act="relu", hidden_size=n_embd,
                                   intermediate_size=n_ff)
        pred = make_predictor(d / f"{name}-pred", n_layer=2, n_embd=n_embd, n_ff=n_ff, rank=rank, threshold=0.0)
        out[name] = convert(ckpt, d / f"{name}.f16.gguf", outtype="f16", predictor=pred).outputs[0]
    return out


def powerinfer_quantize(src: Path, dst: Path, preset: str, *flags: str) -> Path:
    """``quantize [flags] SRC DST TYPE 1`` (PowerInfer's binary; one thread: bytes do not depend on it)."""
    r = subprocess.run([str(tool_path("quantize")), *flags, str(src), str(dst), preset.upper(), "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return dst


def powerinfer_main(model: Path) -> str:
    """Generate 8 tokens greedily with PowerInfer's ``main``; returns its log (stderr). It runs in the model's
    directory because it also writes a ``main.log`` into its working directory."""
    r = subprocess.run([str(tool_path("main")), "-m", str(model), "-p", "Hello world", "-n", "8", "-t", "1",
                        "-c", "64", "--temp", "0", "-s", "1", "--ignore-eos"], capture_output=True, text=True,
                       errors="replace", timeout=300, cwd=model.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@cache
def _reference() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(reference_lib()))

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    # ggml_init fills the fp16 tables the quantizers use; this context is never freed (one per process).
    lib.ggml_init.restype = ctypes.c_void_p
    lib.ggml_init.argtypes = [InitParams]
    lib.ggml_init(InitParams(1 << 16, None, False))
    # PowerInfer's ggml.h: size_t ggml_quantize_chunk(type, const float * src, void * dst, int start, int n,
    # int64_t * hist)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_void_p]
    return lib


def reference_bytes(x: np.ndarray, qtype: QT, nbytes: int) -> np.ndarray:
    """PowerInfer's ``ggml_quantize_chunk`` (compiled without FMA contraction) on float32 ``x``."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    out = np.zeros(nbytes + 256, dtype=np.uint8)
    hist = np.zeros(16, dtype=np.int64)
    n = _reference().ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.size, hist.ctypes.data)
    assert n == nbytes
    return out[:nbytes]


def assert_matches_powerinfer(src: Path, ref: Path, ours: Path, *, check_reference: bool = True) -> None:
    """Same tensors, order, types, file type and KV order as PowerInfer's file; bytes equal to PowerInfer's C
    without FMA contraction, and to PowerInfer's binary up to a small fraction of rounding ties."""
    with open_gguf(src) as s, open_gguf(ref) as a, open_gguf(ours) as b:
        assert a.magic == b.magic == b"PWRI"
        assert [(t.name, t.ggml_type.name, t.ne) for t in b.tensors] == \
               [(t.name, t.ggml_type.name, t.ne) for t in a.tensors]
        assert b.get("general.file_type") == a.get("general.file_type")
        assert b.get("general.quantization_version") == a.get("general.quantization_version")
        ours_keys = [k for k in b.kv if not k.startswith("ggufkit.")]
        assert ours_keys == [k for k in a.kv if not k.startswith("ggufkit.")]
        for key in ours_keys:
            assert np.array_equal(np.asarray(b.get(key)), np.asarray(a.get(key))), key
        total = differ = 0
        for ta in a.tensors:
            tb, ts = b[ta.name], s[ta.name]
            ra, rb = np.frombuffer(bytes(a.raw(ta)), np.uint8), np.frombuffer(bytes(b.raw(tb)), np.uint8)
            if check_reference and ts.ggml_type != tb.ggml_type:
                x = np.asarray(s.data(ts), dtype=np.float32)
                want = reference_bytes(x, tb.ggml_type, rb.size)
                assert (want == rb).all(), f"{ta.name} ({tb.ggml_type.name}) differs from PowerInfer's C"
            n = int((ra != rb).sum())
            # FMA ties only (the bytes equal PowerInfer's C without contraction, asserted above): measured up to
            # 3.7 % for Q5_K and 5.5 % for Q2_K, whose many small sums tie more often.
            assert n <= 0.08 * ra.size, f"{ta.name} ({ta.ggml_type.name}): {n} of {ra.size} bytes differ"
            total, differ = total + ra.size, differ + n
        assert differ <= 0.06 * total, f"{differ} of {total} bytes differ"


def _needs_missing_kernel(src: Path, ref: Path) -> set[str]:
    with open_gguf(src) as s, open_gguf(ref) as a:
        return {t.ggml_type.name for t in a.tensors
                if t.ggml_type != s[t.name].ggml_type and t.ggml_type not in SUPPORTED_TYPES}


@pytest.mark.parametrize(("model", "preset"), [("wide", p) for p in ALL_PRESETS]
                         + [("narrow", p) for p in NARROW_PRESETS] + [("opt", p) for p in OPT_PRESETS])
def test_every_powerinfer_preset_gives_powerinfer_types_and_ggml_reference_bytes(models, tmp_path, model, preset):
    src = models[model]
    ref = powerinfer_quantize(src, tmp_path / "powerinfer.gguf", preset)
    out = tmp_path / "ggufkit.gguf"
    missing = _needs_missing_kernel(src, ref)
    if missing:
        # A type without a ggufkit kernel (Q2_K/Q3_K today): refused before anything is written.
        with pytest.raises(QuantizationError, match="which ggufkit has no kernel for"):
            quantize_file(src, out, preset)
        assert not out.exists()
        return
    quantize_file(src, out, preset, threads=1)
    assert_matches_powerinfer(src, ref, out)


def test_issue_10_ffn_down_t_falls_back_to_q5_0_as_in_powerinfer(models):
    """ffn_down_t is not ffn_down: PowerInfer gives it the preset's Q4_K, which falls back to Q5_0 on rows
    of 64; today's llama.cpp rules (ffn_down, use_more_bits) made it Q8_0."""
    plan = quantize_file(models["narrow"], None, "q4_k_m", dry_run=True).plan
    types = {e.name: e.dst_type for e in plan.entries}
    assert types["blk.1.ffn_down_t.weight"] == QT.Q5_0
    assert types["blk.0.fc1.weight"] == types["blk.1.fc2.weight"] == QT.Q5_0
    assert types["output.weight"] == QT.Q8_0  # rows of 64 are not a multiple of 256
    assert types["blk.0.attn_norm.weight"] == QT.F32


@pytest.mark.parametrize(("preset", "flags"), [("q5_1", ("--pure",)), ("q6_k", ("--leave-output-tensor",)),
                                               ("q4_0", ("--pure", "--leave-output-tensor"))])
def test_pure_and_leave_output_tensor_match_powerinfer(models, tmp_path, preset, flags):
    src = models["wide"]
    ref = powerinfer_quantize(src, tmp_path / "powerinfer.gguf", preset, *flags)
    out = tmp_path / "ggufkit.gguf"
    quantize_file(src, out, preset, pure="--pure" in flags, leave_output_tensor="--leave-output-tensor" in flags)
    assert_matches_powerinfer(src, ref, out)


def test_pure_k_quant_on_rows_that_are_not_whole_blocks_is_refused(models, tmp_path):
    """With --pure PowerInfer skips its fallback and quantizes the 64-wide fc2 rows as Q4_K across row ends;
    its own main then aborts on that file (GGML_ASSERT). ggufkit refuses in one line and writes nothing."""
    ref = powerinfer_quantize(models["wide"], tmp_path / "powerinfer.gguf", "q4_k_m", "--pure")
    r = subprocess.run([str(tool_path("main")), "-m", str(ref), "-p", "Hi", "-n", "1", "-t", "1", "-c", "64"],
                       capture_output=True, text=True, errors="replace", timeout=300, cwd=tmp_path)
    assert r.returncode != 0
    out = tmp_path / "ggufkit.gguf"
    r2 = invoke("quantize", str(models["wide"]), str(out), "--type", "q4_k_m", "--pure")
    assert r2.exit_code == 2 and len(r2.stderr.strip().splitlines()) == 1
    assert "blk.0.fc2.weight" in r2.stderr and "row length 64 is not a multiple of 256" in r2.stderr
    assert not out.exists()


def test_requantize_matches_powerinfer_and_needs_allow_requantize(models, tmp_path):
    q8 = powerinfer_quantize(models["wide"], tmp_path / "q8.gguf", "q8_0")
    ref = powerinfer_quantize(q8, tmp_path / "powerinfer.gguf", "q4_0", "--allow-requantize")
    out = tmp_path / "ggufkit.gguf"
    r = invoke("quantize", str(q8), str(out), "--type", "q4_0")
    assert r.exit_code == 2 and "--allow-requantize" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()
    quantize_file(q8, out, "q4_0", allow_requantize=True)
    assert_matches_powerinfer(q8, ref, out, check_reference=False)


@pytest.mark.parametrize("args", [("--type", "bf16"), ("--type", "15"), ("--type", "q4_k_m", "--tensor-type", "attn_v=q8_0"),
                                  ("--type", "q4_0", "--output-tensor-type", "q8_0"),
                                  ("--type", "q4_0", "--token-embedding-type", "q8_0")])
def test_what_powerinfers_quantize_does_not_offer_is_refused_for_pwri_files(models, tmp_path, args):
    out = tmp_path / "out.gguf"
    r = invoke("quantize", str(models["narrow"]), str(out), *args)
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "PowerInfer" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_imatrix_is_refused_for_pwri_files(models, tmp_path):
    from fixtures_quantize import write_imatrix_gguf

    with open_gguf(models["narrow"]) as m:
        entries = {t.name: (np.ones((1, t.ne[0]), np.float32), np.ones(1, np.float32)) for t in m.tensors
                   if len(t.ne) == 2}
    im = write_imatrix_gguf(tmp_path / "imatrix.gguf", entries)
    out = tmp_path / "out.gguf"
    r = invoke("quantize", str(models["narrow"]), str(out), "--type", "q4_0", "--imatrix", str(im))
    assert r.exit_code == 2 and "--imatrix" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_ffn_down_t_type_powerinfers_cpu_kernel_misreads_is_warned_about(models, tmp_path):
    r = invoke("quantize", str(models["wide"]), str(tmp_path / "k.gguf"), "--type", "q4_k_m", "--json")
    assert r.exit_code == 0, r.output
    assert "ffn_down_t becomes Q4_K" in r.stderr
    r = invoke("quantize", str(models["wide"]), str(tmp_path / "q.gguf"), "--type", "q4_0")
    assert r.exit_code == 0 and "ffn_down_t" not in r.stderr


def _assert_generated_sparse(log: str) -> None:
    assert "PowerInfer model loaded. Sparse inference will be used." in log
    m = re.search(r"sample time =\s*[\d.]+ ms /\s*(\d+) runs", log)
    assert m and int(m.group(1)) == 8, log[-2000:]


@pytest.mark.parametrize(("model", "preset"), [("wide", "q4_0"), ("wide", "q4_k_m"), ("opt", "q4_0")])
def test_ggufkit_quantized_pwri_file_runs_sparse_in_powerinfers_main(models, tmp_path, model, preset):
    out = tmp_path / f"{preset}.gguf"
    quantize_file(models[model], out, preset)
    _assert_generated_sparse(powerinfer_main(out))


@pytest.mark.parametrize("model", ["wide", "opt"])
def test_ggufkit_converted_f16_pwri_file_runs_sparse_in_powerinfers_main(models, model):
    _assert_generated_sparse(powerinfer_main(models[model]))


def _synthetic_pwri(path: Path, arch: str, n_layer: int, n_head: int, n_head_kv: int) -> Path:
    """A PWRI file with just what PowerInfer's quantize reads (its hparams, no vocabulary but the token list)
    and tensors that reach the mixture rules the ReLU models above cannot: Falcon's attn_qkv and ffn_down,
    an 80-layer grouped-query llama (MODEL_70B). Rows of 256, so the K-quants apply without fallback."""
    from ggufkit.format import Metadata, TensorSpec, write_gguf
    from ggufkit.format.values import VT

    n_embd, rng = 256, np.random.default_rng(7)
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, arch)
    for key, value in (("context_length", 64), ("embedding_length", n_embd), ("feed_forward_length", 64),
                       ("attention.head_count", n_head), ("attention.head_count_kv", n_head_kv),
                       ("block_count", n_layer)):
        meta.set(f"{arch}.{key}", VT.UINT32, value)
    eps_key = "layer_norm_epsilon" if arch == "falcon" else "layer_norm_rms_epsilon"
    meta.set(f"{arch}.attention.{eps_key}", VT.FLOAT32, 1e-5)
    meta.set("tokenizer.ggml.tokens", VT.ARRAY, ["a", "b"], VT.STRING)
    names = ["token_embd.weight", "output.weight"]
    for b in range(n_layer):
        names += [f"blk.{b}.attn_norm.weight", f"blk.{b}.attn_output.weight", f"blk.{b}.ffn_up.weight",
                  f"blk.{b}.ffn_down.weight", f"blk.{b}.fc1.weight"]
        names += [f"blk.{b}.attn_qkv.weight"] if arch == "falcon" else [f"blk.{b}.attn_v.weight"]
    specs = [TensorSpec(n, QT.F32 if "norm" in n else QT.F16, (n_embd,) if "norm" in n else (32, n_embd))
             for n in names]
    arrays = [rng.standard_normal(s.shape).astype(np.float32 if s.ggml_type == QT.F32 else np.float16)
              for s in specs]
    write_gguf(path, meta, specs, arrays, magic=b"PWRI", slack_bytes=0)
    return path


@pytest.mark.parametrize("preset", ["q4_0", "q4_k_s", "q4_k_m", "q5_k_m", "q6_k", "f16"])
@pytest.mark.parametrize(("arch", "n_layer", "n_head", "n_head_kv"), [("falcon", 9, 8, 1), ("llama", 80, 8, 1),
                                                                     ("llama", 80, 8, 8)])
def test_falcon_and_70b_mixture_rules_match_powerinfer(tmp_path, preset, arch, n_layer, n_head, n_head_kv):
    src = _synthetic_pwri(tmp_path / "in.gguf", arch, n_layer, n_head, n_head_kv)
    ref = powerinfer_quantize(src, tmp_path / "powerinfer.gguf", preset)
    plan = quantize_file(src, None, preset, dry_run=True).plan
    with open_gguf(ref) as a:
        assert [(e.name, e.dst_type.name) for e in plan.entries] == [(t.name, t.ggml_type.name) for t in a.tensors]
