"""Whole files quantized by ggufkit equal llama.cpp's, byte for byte.

Oracle: ``llama_cpp.llama_model_quantize`` (llama-cpp-python 0.3.36) on the same tiny llama GGUF inputs,
with the same options; the imatrix values handed to it are computed here from the raw sums and counts
written into the imatrix files, independently of ggufkit's loader.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_quantize import (
    arch_case,
    imatrix_values,
    llama_quantize,
    make_gguf,
    make_llama_gguf,
    write_imatrix_dat,
    write_imatrix_gguf,
)
from gguf import GGMLQuantizationType as QT

from ggufkit.errors import QuantizationError
from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.quant.imatrix.reader import load_imatrix
from ggufkit.quant.llama_quantize.pipeline import quantize_file


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qfile_models")
    return {
        "small": make_llama_gguf(d / "small.gguf", n_embd=256, n_ff=512, n_layer=2, n_vocab=512),
        "deep": make_llama_gguf(d / "deep.gguf", n_embd=256, n_ff=256, n_layer=8, n_vocab=256, seed=3),
        # tied embeddings, F32 input, rows of 288 and 600: Q5_0, Q8_0 and F16 fallbacks
        "odd": make_llama_gguf(d / "odd.gguf", n_embd=288, n_ff=600, n_layer=2, n_vocab=256, tied=True,
                               dtype=QT.F32, seed=5),
    }


def assert_same_file(ref: Path, ours: Path) -> None:
    """Same tensors (order, names, types, bytes), same general.file_type, same KV order except our keys."""
    with open_gguf(ref) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        assert a.get("general.file_type") == b.get("general.file_type")
        assert list(a.kv) == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in a.kv:
            if not key.startswith("tokenizer."):
                assert a.get(key) == b.get(key), key


@pytest.mark.parametrize("target", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_pure_file_equals_llama_model_quantize(models, tmp_path, target):
    llama_quantize(models["small"], tmp_path / "ref.gguf", target, pure=True)
    report = quantize_file(models["small"], tmp_path / "ours.gguf", target, pure=True, device="cpu")
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")
    assert report.output == tmp_path / "ours.gguf" and not report.plan.fallbacks


@pytest.mark.parametrize("target", ["q4_k_m", "q4_k_s"])
def test_preset_file_equals_llama_model_quantize(models, tmp_path, target):
    llama_quantize(models["deep"], tmp_path / "ref.gguf", target)
    quantize_file(models["deep"], tmp_path / "ours.gguf", target, threads=1)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_odd_rows_and_tied_embeddings_equal_llama_model_quantize(models, tmp_path):
    llama_quantize(models["odd"], tmp_path / "ref.gguf", "q4_k_m")
    report = quantize_file(models["odd"], tmp_path / "ours.gguf", "q4_k_m")
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")
    assert {e.dst_type for e in report.plan.fallbacks} == {QT.Q5_0, QT.Q8_0, QT.F16}


def _normalised(entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    # quantize.cpp load_imatrix: sums / (float) lround(count), per expert row, in f32 (counts here are
    # whole numbers, so lround is the identity; a zero count is patched by the caller)
    with np.errstate(divide="ignore", invalid="ignore"):
        return {k: (s / c.astype(np.float32)[:, None]).astype(np.float32).reshape(-1) for k, (s, c) in entries.items()}


@pytest.mark.parametrize("target", ["q4_k_m", "q4_0"])
def test_gguf_imatrix_run_equals_llama_model_quantize(models, tmp_path, target):
    entries = imatrix_values(models["deep"])
    entries.pop("output.weight")  # a missing entry: that tensor uses the reference quantizer
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", entries, datasets=("wiki.train.raw",), chunk_count=7)
    kv = {"quantize.imatrix.file": str(imat), "quantize.imatrix.dataset": "wiki.train.raw",
          "quantize.imatrix.entries_count": len(entries), "quantize.imatrix.chunks_count": 7}
    llama_quantize(models["deep"], tmp_path / "ref.gguf", target, imatrix=_normalised(entries), kv=kv)
    report = quantize_file(models["deep"], tmp_path / "ours.gguf", target, imatrix=imat)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")
    assert any("'output.weight'" in w for w in report.warnings)
    assert {e.imatrix for e in report.plan.entries if e.action != "copy"} == {"used", "missing"}


def test_expert_tensors_with_imatrix_equal_llama_model_quantize(tmp_path):
    """3-D expert tensors: each expert's rows use its own imatrix slice, and one expert has count 0."""
    arch, hp, tensors = arch_case("mixtral", n_layer=2, n_exp=4)
    src = make_gguf(tmp_path / "moe.gguf", arch, hp, tensors, seed=11)
    entries = imatrix_values(src)
    sums, counts = entries["blk.1.ffn_down_exps.weight"]
    counts[2] = 0.0  # an expert never routed to during calibration: its values become 1.0
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", entries, chunk_count=0)
    kv = {"quantize.imatrix.file": str(imat), "quantize.imatrix.dataset": "calibration.txt",
          "quantize.imatrix.entries_count": len(entries)}
    values = _normalised(entries)
    values["blk.1.ffn_down_exps.weight"][2 * sums.shape[1]:3 * sums.shape[1]] = 1.0
    llama_quantize(src, tmp_path / "ref.gguf", "q4_k_m", imatrix=values, kv=kv)
    quantize_file(src, tmp_path / "ours.gguf", "q4_k_m", imatrix=imat)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_legacy_imatrix_run_equals_llama_model_quantize(models, tmp_path):
    rng = np.random.default_rng(9)
    entries = {name: (int(rng.integers(1, 50)), rng.gamma(0.5, 2.0, size=s[0].shape[1]).astype(np.float32))
               for name, s in imatrix_values(models["small"]).items()}
    imat = write_imatrix_dat(tmp_path / "imatrix.dat", entries, chunk_count=3, dataset="calib.txt")
    values = {k: (v / np.float32(n)).astype(np.float32) for k, (n, v) in entries.items()}
    kv = {"quantize.imatrix.file": str(imat), "quantize.imatrix.dataset": "calib.txt",
          "quantize.imatrix.entries_count": len(entries), "quantize.imatrix.chunks_count": 3}
    llama_quantize(models["small"], tmp_path / "ref.gguf", "q4_k_s", imatrix=values, kv=kv)
    quantize_file(models["small"], tmp_path / "ours.gguf", "q4_k_s", imatrix=imat)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_requantize_equals_llama_model_quantize(models, tmp_path):
    q8 = tmp_path / "q8.gguf"
    llama_quantize(models["small"], q8, "q8_0")
    with pytest.raises(QuantizationError, match="already quantized as Q8_0"):
        quantize_file(q8, tmp_path / "ours.gguf", "q4_0")
    assert not (tmp_path / "ours.gguf").exists()
    llama_quantize(q8, tmp_path / "ref.gguf", "q4_0", allow_requantize=True)
    quantize_file(q8, tmp_path / "ours.gguf", "q4_0", allow_requantize=True)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_imatrix_entry_of_the_wrong_size_fails_naming_the_tensor(models, tmp_path):
    entries = imatrix_values(models["small"])
    sums, counts = entries["blk.1.attn_q.weight"]
    entries["blk.1.attn_q.weight"] = (sums[:, :128], counts)
    sums, counts = entries["token_embd.weight"]
    imat = write_imatrix_gguf(tmp_path / "bad.gguf", entries)
    with pytest.raises(QuantizationError, match=r"'blk\.1\.attn_q\.weight': imatrix entry has 128 values"):
        quantize_file(models["small"], tmp_path / "out.gguf", "q4_k_m", imatrix=imat)
    assert not (tmp_path / "out.gguf").exists()
    del entries["blk.1.attn_q.weight"]
    entries["token_embd.weight"] = (sums[:, :128], counts)  # token_embd alone is allowed to mismatch
    imat = write_imatrix_gguf(tmp_path / "ok.gguf", entries)
    report = quantize_file(models["small"], None, "q4_k_m", imatrix=imat, dry_run=True)
    assert {e.name: e.imatrix for e in report.plan.entries}["token_embd.weight"] == "ignored (size mismatch)"


def test_imatrix_loader_rules(tmp_path):
    sums = np.arange(8, dtype=np.float32).reshape(2, 4)
    im = load_imatrix(write_imatrix_gguf(tmp_path / "a.gguf", {"w": (sums, np.array([2.4, 0.0]))}))
    assert np.array_equal(im.entries["w"], np.array([0, 0.5, 1, 1.5, 1, 1, 1, 1], np.float32))  # lround(2.4)=2
    assert im.datasets == ("calibration.txt",) and im.chunk_count == 10 and im.chunk_size == 512
    meta = Metadata()
    write_gguf(tmp_path / "b.gguf", meta, [TensorSpec("w.in_sum2", QT.F32, (1, 4))], [sums[:1]])
    with pytest.raises(QuantizationError, match="missing imatrix metadata"):
        load_imatrix(tmp_path / "b.gguf")
    (tmp_path / "c.dat").write_bytes(b"\x02\x00\x00\x00\x01\x00")
    with pytest.raises(QuantizationError, match="legacy imatrix truncated"):
        load_imatrix(tmp_path / "c.dat")
    dat = load_imatrix(write_imatrix_dat(tmp_path / "d.dat", {"w": (4, np.array([2, 6], np.float32))}))
    assert np.array_equal(dat.entries["w"], np.array([0.5, 1.5], np.float32)) and dat.is_legacy


def test_nan_weights_fail_naming_the_tensor_and_write_nothing(tmp_path):
    meta = Metadata()
    meta.set("general.architecture", 8, "llama")
    meta.set("llama.block_count", 4, 1)
    bad = np.zeros((4, 256), np.float32)
    bad[2, 7] = np.nan
    write_gguf(tmp_path / "nan.gguf", meta, [TensorSpec("blk.0.attn_q.weight", QT.F32, (4, 256))], [bad])
    with pytest.raises(QuantizationError, match=r"'blk\.0\.attn_q\.weight'.*non-finite"):
        quantize_file(tmp_path / "nan.gguf", tmp_path / "out.gguf", "q8_0")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("bad_value", [np.nan, -np.nan, np.inf, -np.inf], ids=["nan", "-nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_non_finite_copied_float_tensor_is_refused_as_in_llama_model_quantize(tmp_path, dtype, bad_value):
    # A tensor copied as it is (target = its own type) is checked on its bits, as llama's loader checks it.
    meta = Metadata()
    meta.set("general.architecture", 8, "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("attention.head_count", 4)):
        meta.set(f"llama.{key}", 4, value)
    meta.set("llama.attention.layer_norm_rms_epsilon", 6, 1e-5)
    x = np.full((4, 256), 0.5, np.float32)
    x[3, 255] = bad_value
    data = {QT.F32: x, QT.F16: x.astype(np.float16), QT.BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}[dtype]
    write_gguf(tmp_path / "bad.gguf", meta, [TensorSpec("blk.0.attn_q.weight", dtype, (4, 256))], [data])
    target = dtype.name.lower()
    with pytest.raises(RuntimeError, match="llama_model_quantize failed"):
        llama_quantize(tmp_path / "bad.gguf", tmp_path / "ref.gguf", target)
    with pytest.raises(QuantizationError, match=r"'blk\.0\.attn_q\.weight'.*invalid data"):
        quantize_file(tmp_path / "bad.gguf", tmp_path / "out.gguf", target)
    assert not (tmp_path / "out.gguf").exists()
    x[3, 255] = 0.25  # the same file with finite values is copied byte for byte, as llama.cpp copies it
    data = {QT.F32: x, QT.F16: x.astype(np.float16), QT.BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}[dtype]
    write_gguf(tmp_path / "good.gguf", meta, [TensorSpec("blk.0.attn_q.weight", dtype, (4, 256))], [data])
    quantize_file(tmp_path / "good.gguf", tmp_path / "out.gguf", target)
    out = open_gguf(tmp_path / "out.gguf")
    copied = np.frombuffer(out.raw(out["blk.0.attn_q.weight"]), np.uint8)
    assert np.array_equal(copied, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    out.close()


@pytest.mark.parametrize(("target", "value"), [("q4_0", 1e6), ("q4_0", -1e6), ("q6_k", 1e9)])
def test_scale_overflowing_f16_fails_as_in_llama_model_quantize(tmp_path, target, value):
    # Q4_0: d = 1e6 / -8 does not fit in f16 (either sign); Q6_K: its f16 super-block scale sits at byte 208
    meta = Metadata()
    meta.set("general.architecture", 8, "llama")
    meta.set("llama.block_count", 4, 1)
    big = np.full((4, 256), value, np.float32)
    big[:, ::7] = value / 3
    write_gguf(tmp_path / "big.gguf", meta, [TensorSpec("blk.0.attn_q.weight", QT.F32, (4, 256))], [big])
    with pytest.raises(RuntimeError, match="llama_model_quantize failed"):
        llama_quantize(tmp_path / "big.gguf", tmp_path / "ref.gguf", target)
    with pytest.raises(QuantizationError, match=r"'blk\.0\.attn_q\.weight': quantized data validation failed"):
        quantize_file(tmp_path / "big.gguf", tmp_path / "out.gguf", target)
    assert not (tmp_path / "out.gguf").exists()


def test_cli_dry_run_prints_the_plan_and_writes_nothing(models, tmp_path):
    out = tmp_path / "out.gguf"
    res = invoke("quantize", str(models["odd"]), str(out), "--type", "Q4_K_M", "--dry-run",
                 "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert not out.exists() and d["dry_run"] and d["output"] is None and d["file_type"] == 15
    assert d["totals"]["fallbacks"] == len([t for t in d["tensors"] if t["fallback"]]) > 0
    assert d["fallback_summary"].startswith("fallback: ")
    text = invoke("quantize", str(models["odd"]), "--type", "q4_k_m", "--dry-run")
    assert text.exit_code == 0 and "row length 288 not a multiple of 256" in text.stdout
    assert "dry run: nothing written" in text.stdout and not out.exists()


def test_cli_writes_and_summarises_fallbacks(models, tmp_path):
    out = tmp_path / "out.gguf"
    res = invoke("quantize", str(models["odd"]), str(out), "--type", "q4_k_m", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert out.exists() and "fallback: " in res.stdout and "% of weights" in res.stdout
    with open_gguf(out) as m:
        assert m.get("ggufkit.quantize.recipe") == "q4_k_m"


def test_cli_errors_are_one_line_exit_2(models, tmp_path):
    out = tmp_path / "out.gguf"
    res = invoke("quantize", str(models["odd"]), str(out), "--type", "q4_k", "--no-fallback")
    assert res.exit_code == 2 and "--no-fallback forbids it" in res.stderr and "Traceback" not in res.output
    res = invoke("quantize", str(models["small"]), str(out), "--type", "q4_0",
                 "--tensor-type", "attn_v=q8_k")
    assert res.exit_code == 2 and "invalid --tensor-type type 'q8_k'" in res.stderr
    # llama-quantize bails out mid-file here; ggufkit refuses in the plan, naming tensor and type
    res = invoke("quantize", str(models["small"]), str(out), "--type", "q4_0", "--tensor-type", "attn_v=iq2_xs")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
    assert "'blk.0.attn_v.weight'" in res.stderr and "IQ2_XS" in res.stderr and "importance matrix" in res.stderr
    for bad in (["--override-kv", "general.name=text:x"], ["--override-kv", "llama.block_count=int:x"],
                ["--prune-layers", "0,7"], ["--prune-layers", "a"], ["--type", "q9_9"],
                ["--include-weights", "attn", "--exclude-weights", "ffn"]):
        args = ["--type", "q4_0", *bad] if bad[0] != "--type" else bad
        res = invoke("quantize", str(models["small"]), str(out), *args)
        errors = [line for line in res.stderr.splitlines() if "rror" in line]
        assert res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output, (bad, res.output)
    res = invoke("quantize", str(models["small"]), "--type", "q4_0")
    assert res.exit_code == 2 and "OUT.gguf is required" in res.output
    assert not out.exists()


def test_second_run_of_a_tiny_file_uses_cached_kernels(models, tmp_path):
    """Measured, not asserted: the time of a second quantization of a tiny file (cached Numba kernels)."""
    quantize_file(models["small"], tmp_path / "a.gguf", "q4_k_m")
    start = time.perf_counter()
    quantize_file(models["small"], tmp_path / "b.gguf", "q4_k_m")
    print(f"second q4_k_m run of a {models['small'].stat().st_size >> 20} MiB file: "
          f"{time.perf_counter() - start:.2f} s")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
