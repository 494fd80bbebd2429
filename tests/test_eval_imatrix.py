"""``ggufkit imatrix`` against llama.cpp's own ``llama-imatrix`` (built from the vendored sources).

Same model, text, ``--ctx`` and ``--chunks`` on both sides: the same tensor set, keys and counts, and
``in_sum2`` within float noise; combining and gguf <-> dat conversion give llama-imatrix's bytes; a run
resumed from a snapshot gives the uninterrupted run's bytes; bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from eval_models import make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT
from llama_cpp_sources import tool_path

from ggufkit.format import Metadata, TensorSpec, write_gguf
from ggufkit.quant.imatrix.collector import read_raw_imatrix

CTX = 64
CHUNKS = 4
#: llama.cpp computes attention with an F16 KV cache by default; these flags make it float32 throughout.
F32_ATTENTION = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("imatrix")
    rng = np.random.default_rng(0)
    # The synthetic vocabulary has the pieces "▁t0".."▁t60": each word is one token in both tokenizers.
    (d / "text.txt").write_text(" ".join(f"t{i}" for i in rng.integers(0, 61, 6 * CTX)) + "\n")
    (d / "short.txt").write_text("t1 t2 t3\n")
    model = make_hf_model("llama", seed=3)
    out = {"f32": write_model_gguf(model, "llama", d / "f32.gguf"),
           "f16": write_model_gguf(model, "llama", d / "f16.gguf", Q.F16),
           "q8": write_model_gguf(model, "llama", d / "q8.gguf", Q.Q8_0),
           "tied": write_model_gguf(make_hf_model("qwen2", seed=3), "qwen2", d / "tied.gguf"),
           "wide": write_model_gguf(make_hf_model("llama", seed=3, hidden_size=128, intermediate_size=256),
                                    "llama", d / "wide.gguf"),
           "text": d / "text.txt", "short": d / "short.txt", "dir": d}
    return out


def llama_imatrix(*args: str | Path) -> str:
    # --no-repack: llama.cpp's plain CPU kernels (its repacked AMX ones are other numerics, and die of SIGILL
    # on some CPUs that advertise AMX); float weights are never repacked.
    r = subprocess.run([str(tool_path("llama-imatrix")), "-t", "2", *map(str, args), "--no-repack"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr


def llama_imatrix_logged(*args: str | Path) -> str:
    """llama_imatrix until its log shows the final estimate: its asynchronous log thread sometimes loses the
    last lines when main returns (see test_show_statistics_follows_llama_imatrixs_definitions)."""
    for _ in range(10):  # the lost-lines case is more frequent under load
        log = llama_imatrix(*args)
        if "Final estimate: PPL = " in log:
            return log
    raise AssertionError(log[-2000:])


def ours(*args: str | Path) -> dict:
    r = invoke("imatrix", *map(str, args), "--device", "cpu", "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def relative_l2(a: Path, b: Path) -> dict[str, float]:
    """Per entry ||sums_a - sums_b|| / ||sums_b||, after checking names, counts and keys are equal."""
    x, y = read_raw_imatrix(a), read_raw_imatrix(b)
    assert sorted(x.entries) == sorted(y.entries)
    assert (x.chunk_count, x.chunk_size, x.datasets) == (y.chunk_count, y.chunk_size, y.datasets)
    out = {}
    for name, (sums, counts) in x.entries.items():
        ref_sums, ref_counts = y.entries[name]
        assert np.array_equal(counts, ref_counts), name
        assert sums.shape == ref_sums.shape, name
        out[name] = float(np.linalg.norm(sums.astype(np.float64) - ref_sums) / np.linalg.norm(ref_sums))
    return out


def run_both(files: dict[str, Path], model: str, name: str, *extra: str, llama_extra: tuple[str, ...] = (),
             ours_extra: tuple[str, ...] = ()) -> tuple[Path, Path, dict]:
    d = files["dir"]
    ref, mine = d / f"ref-{name}.gguf", d / f"ours-{name}.gguf"
    common = ["-f", files["text"], "-c", str(CTX), "--chunks", str(CHUNKS), *extra]
    llama_imatrix("-m", files[model], "-o", ref, *common, *llama_extra)
    result = ours(files[model], "-o", mine, *common, *ours_extra)
    return mine, ref, result


def test_f32_model_matches_llama_imatrix_to_float_accumulation_noise(files: dict[str, Path]) -> None:
    mine, ref, result = run_both(files, "f32", "f32", "--process-output", llama_extra=tuple(F32_ATTENTION))
    rel = relative_l2(mine, ref)
    # Every matmul of both blocks plus the untied head (--process-output); measured worst ~2e-6.
    assert len(rel) == 2 * 7 + 1 and "output.weight" in rel
    assert max(rel.values()) <= 1e-4, rel
    assert result["chunks"] == CHUNKS and result["chunk_count"] == CHUNKS and result["chunk_size"] == CTX
    assert read_raw_imatrix(mine).entries["blk.0.attn_q.weight"][1].tolist() == [CHUNKS * CTX]


def test_f16_and_q8_models_match_llama_imatrix_within_its_activation_rounding(files: dict[str, Path]) -> None:
    # F16 weights: llama.cpp's plain CPU kernels (llama_imatrix passes --no-repack) round each matmul's input
    # to F16 (vec_dot_type F16); --ggml-rounding does the same (measured 3.5e-5 with float32 attention),
    # float32 inputs differ by the rounding (measured 3.6e-4). (llama.cpp's AMX kernels, used by default on
    # CPUs with AMX, round nothing: there the default matched to 7e-7.)
    f32_attention = tuple(F32_ATTENTION)
    rel = relative_l2(*run_both(files, "f16", "f16-r", llama_extra=f32_attention,
                                ours_extra=("--ggml-rounding", "--kv-cache", "f32"))[:2])
    assert len(rel) == 14 and max(rel.values()) <= 1e-4, rel
    rel = relative_l2(*run_both(files, "f16", "f16-f32", llama_extra=f32_attention)[:2])
    assert len(rel) == 14 and 1e-4 < max(rel.values()) <= 5e-3, rel
    # llama.cpp's default F16 K/V cache (flash attention on): --ggml-rounding's default --kv-cache f16 rounds K
    # and V as it does (measured 5.5e-5); without the K/V rounding they differ by 4.7e-4.
    rel = relative_l2(*run_both(files, "f16", "f16", ours_extra=("--ggml-rounding",))[:2])
    rel32 = relative_l2(*run_both(files, "f16", "f16-kv32", ours_extra=("--ggml-rounding", "--kv-cache", "f32"))[:2])
    assert len(rel) == 14 and max(rel.values()) <= 1e-4 < max(rel32.values()), (rel, rel32)
    # Q8_0: llama.cpp quantizes the activations to 8-bit blocks (vec_dot_type Q8_0): ~1e-2.
    rel = relative_l2(*run_both(files, "q8", "q8")[:2])
    assert len(rel) == 14 and max(rel.values()) <= 5e-2, rel


def test_tied_head_is_never_collected_even_with_process_output(files: dict[str, Path]) -> None:
    mine, ref, _ = run_both(files, "tied", "tied", "--process-output", "--no-ppl", llama_extra=tuple(F32_ATTENTION))
    rel = relative_l2(mine, ref)
    assert "output.weight" not in rel and "token_embd.weight" not in rel and len(rel) == 14
    assert max(rel.values()) <= 1e-4, rel


def test_perplexity_per_chunk_is_printed_like_llama_imatrix(files: dict[str, Path]) -> None:
    r = invoke("imatrix", str(files["f32"]), "-f", str(files["text"]), "-c", str(CTX), "--chunks", "3", "-o",
               str(files["dir"] / "ppl.gguf"), "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("[1]") and "[3]" in first and second.startswith("Final estimate: PPL = ")
    log = llama_imatrix_logged("-m", files["f32"], "-f", files["text"], "-c", CTX, "--chunks", 3, "-o",
                               files["dir"] / "ppl-ref.gguf", *F32_ATTENTION)
    ref = float(log.split("Final estimate: PPL = ")[1].split()[0])
    assert float(second.split("= ")[1].split()[0]) == pytest.approx(ref, rel=1e-4)


def test_combining_and_converting_give_llama_imatrixs_bytes(files: dict[str, Path]) -> None:
    d = files["dir"]
    a, b = run_both(files, "f32", "comb")[:2]  # two files with different values: ours and llama's
    cases = {"copy": [a], "combined": [a, b], "three": [b, a, b]}
    for name, inputs in cases.items():
        for fmt in ("gguf", "dat"):
            args = [x for p in inputs for x in ("--in-file", p)] + ["--output-format", fmt]
            llama_imatrix("-m", files["f32"], *args, "-o", d / f"{name}-ref.{fmt}")
            ours(*args, "-o", d / f"{name}-ours.{fmt}")
            assert (d / f"{name}-ours.{fmt}").read_bytes() == (d / f"{name}-ref.{fmt}").read_bytes(), (name, fmt)
    # dat -> gguf, and a dat combined with a gguf (legacy entries are scaled by the chunk size)
    for name, inputs in {"fromdat": [d / "copy-ref.dat"], "mixed": [d / "copy-ref.dat", a]}.items():
        args = [x for p in inputs for x in ("--in-file", p)]
        llama_imatrix("-m", files["f32"], *args, "-o", d / f"{name}-ref.gguf")
        ours(*args, "-o", d / f"{name}-ours.gguf")
        assert (d / f"{name}-ours.gguf").read_bytes() == (d / f"{name}-ref.gguf").read_bytes(), name


def test_gguf_dat_round_trip_keeps_what_the_legacy_format_can_hold(files: dict[str, Path]) -> None:
    d = files["dir"]
    mine = d / "rt.gguf"
    ours(files["f32"], "-f", files["text"], "-c", CTX, "--chunks", CHUNKS, "-o", mine, "--no-ppl")
    ours("--in-file", mine, "--output-format", "dat", "-c", CTX, "-o", d / "rt.dat")
    ours("--in-file", d / "rt.dat", "-c", CTX, "-o", d / "rt2.gguf")
    # The counts are whole chunks, so mean * ncall * chunk_size gives back the sums up to float rounding.
    a, b = read_raw_imatrix(mine), read_raw_imatrix(d / "rt2.gguf")
    for name, (sums, counts) in a.entries.items():
        assert np.array_equal(counts, b.entries[name][1])
        np.testing.assert_allclose(b.entries[name][0], sums, rtol=1e-6)
    ours("--in-file", d / "rt.dat", "--output-format", "dat", "-c", CTX, "-o", d / "rt3.dat")
    assert (d / "rt3.dat").read_bytes() == (d / "rt.dat").read_bytes()


def test_resuming_from_a_snapshot_gives_the_uninterrupted_result(files: dict[str, Path]) -> None:
    d = files["dir"]
    full = d / "full.gguf"
    ours(files["f16"], "-f", files["text"], "-c", CTX, "--chunks", 5, "-o", full, "--save-frequency", 2,
         "--no-ppl")
    assert sorted(p.name for p in d.glob("full.gguf.at_*")) == ["full.gguf.at_2", "full.gguf.at_4"]
    resumed = d / "resumed.gguf"
    ours(files["f16"], "-f", files["text"], "-c", CTX, "--chunks", 3, "--from-chunk", 2, "--in-file",
         d / "full.gguf.at_2", "-o", resumed, "--no-ppl")
    a, b = read_raw_imatrix(full), read_raw_imatrix(resumed)
    assert a.chunk_count == b.chunk_count == 5
    for name, (sums, counts) in a.entries.items():
        assert np.array_equal(sums, b.entries[name][0]) and np.array_equal(counts, b.entries[name][1]), name


def test_show_statistics_follows_llama_imatrixs_definitions(files: dict[str, Path]) -> None:
    # llama-imatrix 0.3.36 --show-statistics prints nothing (its asynchronous log is not flushed before main
    # returns), so the oracle here is imatrix.cpp's compute_statistics/compute_cossim written out in float64.
    mine = files["dir"] / "stats.gguf"
    ours(files["f32"], "-f", files["text"], "-c", CTX, "--chunks", CHUNKS, "-o", mine, "--no-ppl")
    raw = read_raw_imatrix(mine).entries
    got = ours("--in-file", mine, "--show-statistics")
    assert len(got["tensors"]) == 14 and [r["layer"] for r in got["layers"]] == [0, 1]
    keys = [(t["tensor"], -t["sum"]) for t in got["tensors"]]
    assert keys == sorted(keys)  # by tensor kind, then by descending sum, as llama-imatrix sorts
    for t in got["tensors"]:
        sums, counts = raw[t["name"]]
        act = sums.astype(np.float64) / counts[0]
        p = act / act.sum()
        assert t["sum"] == pytest.approx(act.sum(), rel=1e-5) and t["elements"] == act.size
        assert (t["min"], t["max"]) == (pytest.approx(act.min(), rel=1e-6), pytest.approx(act.max(), rel=1e-6))
        assert t["stddev"] == pytest.approx(act.std(), rel=1e-3)
        assert t["entropy"] == pytest.approx(-(p * np.log2(p)).sum(), rel=1e-5)
        assert t["zd"] == pytest.approx(((act - act.mean()) / act.std() > 1).mean(), abs=1 / act.size)
        if t["layer"] == "1":
            prev = raw[t["name"].replace("blk.1.", "blk.0.")][0].astype(np.float64)
            cos = sums @ prev / np.linalg.norm(sums) / np.linalg.norm(prev)
            assert t["cossim"] == pytest.approx(cos, rel=1e-5)
        else:
            assert t["cossim"] == 0.0
    r = invoke("imatrix", "--in-file", str(mine), "--show-statistics")
    assert r.exit_code == 0 and "Computing weighted average statistics per layer (2 layers)" in r.stdout


@pytest.mark.parametrize("case", ["short", "unsupported", "mismatch", "corrupt"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(files: dict[str, Path], case: str) -> None:
    d = files["dir"]
    out = d / f"bad-{case}.gguf"
    args = [files["f32"], "-f", files["text"], "-c", CTX, "--chunks", 2]
    if case == "short":
        args = [files["f32"], "-f", files["short"], "-c", CTX]
    elif case == "unsupported":  # an architecture the evaluator does not run
        args[0] = d / "mamba.gguf"
        meta = Metadata()
        meta.set("general.architecture", VT.STRING, "mamba")
        write_gguf(args[0], meta, [TensorSpec("token_embd.weight", Q.F32, (8, 32))], [np.zeros((8, 32), np.float32)])
    elif case == "mismatch":
        wide = d / "wide-im.gguf"
        ours(files["wide"], "-f", files["text"], "-c", CTX, "--chunks", 2, "-o", wide, "--no-ppl")
        args += ["--in-file", wide]
    else:
        bad = d / "corrupt.gguf"
        bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 20)
        args += ["--in-file", bad]
    r = invoke("imatrix", *map(str, args), "-o", str(out), "--device", "cpu")
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("ggufkit: error:"), r.stderr
    assert not out.exists() and not list(d.glob(f".bad-{case}*"))


def test_quantize_with_our_imatrix_or_llama_imatrixs_is_interchangeable(files: dict[str, Path]) -> None:
    from ggufkit.format import open_gguf
    from ggufkit.quant.imatrix.reader import load_imatrix
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    d = files["dir"]
    mine, ref, _ = run_both(files, "wide", "wide", "--no-ppl", llama_extra=tuple(F32_ATTENTION))
    outs = {}
    for tag, im in (("mine", mine), ("ref", ref)):
        outs[tag] = d / f"wide-q4_0-{tag}.gguf"
        quantize_file(files["wide"], outs[tag], "q4_0", imatrix=im, threads=1, device="cpu")
    a_im, b_im = load_imatrix(mine).entries, load_imatrix(ref).entries
    same = differ = 0
    with open_gguf(outs["mine"]) as a, open_gguf(outs["ref"]) as b:
        for t in a.tensors:
            identical_input = t.name not in a_im or np.array_equal(a_im[t.name], b_im[t.name])
            if identical_input:
                assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
                same += 1
            else:
                differ += 1
    assert same >= 4 and differ > 0  # token_embd, norms (no imatrix) and any bit-equal entry
    # llama-quantize takes our file too, and llama.cpp loads the result.
    q = d / "wide-q4_0-llama.gguf"
    r = subprocess.run([str(tool_path("llama-quantize")), "--imatrix", str(mine), str(files["wide"]), str(q), "q4_0",
                        "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    llama_imatrix("-m", q, "-f", files["text"], "-c", CTX, "--chunks", 2, "-o", d / "wide-q-im.gguf")
    assert read_raw_imatrix(d / "wide-q-im.gguf").chunk_count == 2


def test_moe_experts_are_summed_and_counted_per_routed_token(files: dict[str, Path]) -> None:
    # The routed path against imatrix.cpp's GGML_OP_MUL_MAT_ID loop written out (per slot, per token:
    # counts[ex]++, acc[ex] += x*x); tests/test_eval_imatrix_moe.py runs whole MoE models against llama-imatrix.
    import torch

    from ggufkit.eval.imatrix import ImatrixCollector
    from ggufkit.quant.imatrix.collector import ImatrixAccumulator

    n_exp, k, n, t = 4, 2, 8, 32
    shapes = {"blk.0.ffn_up_exps.weight": (n_exp, 16, n), "blk.0.ffn_down_exps.weight": (n_exp, n, 16)}
    acc = ImatrixAccumulator(chunk_size=t)
    col = ImatrixCollector(shapes, torch.device("cpu"), acc, process_output=False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(n_exp - 1, generator=gen)[:k] for _ in range(2 * t)]).reshape(2, t, k)
    x_up = torch.randn(2, t, 1, n, generator=gen)  # one input shared by the k slots (src1 ne[1] = 1)
    x_down = torch.randn(2, t, k, 16, generator=gen)  # one input per slot
    col.routed("blk.0.ffn_up_exps.weight", x_up, ids)
    col.routed("blk.0.ffn_down_exps.weight", x_down, ids)
    col.store()
    for name, x in (("blk.0.ffn_up_exps.weight", x_up), ("blk.0.ffn_down_exps.weight", x_down)):
        want = np.zeros((n_exp, x.shape[-1]), np.float64)
        counts = np.zeros(n_exp, np.int64)
        for b in range(2):
            for slot in range(k):
                for row in range(t):
                    ex = int(ids[b, row, slot])
                    counts[ex] += 1
                    want[ex] += x[b, row, slot % x.shape[2]].double().numpy() ** 2
        assert acc.counts[name].tolist() == counts.tolist() and counts[n_exp - 1] == 0
        np.testing.assert_allclose(acc.sums[name], want, rtol=1e-6)
    assert acc.chunk_count == max(counts) // t
    # Per-expert entries (one expert never routed to) in llama-imatrix's files: combining and converting
    # them with llama-imatrix gives the bytes ggufkit writes.
    d = files["dir"]
    acc.write_gguf(d / "moe.gguf", "calib.txt")
    entries = read_raw_imatrix(d / "moe.gguf").entries
    assert entries["blk.0.ffn_up_exps.weight"][0].shape == (n_exp * n,)
    for fmt in ("gguf", "dat"):
        args = ["--in-file", d / "moe.gguf", "--in-file", d / "moe.gguf", "-c", t, "--output-format", fmt]
        llama_imatrix("-m", files["f32"], *args, "-o", d / f"moe-ref.{fmt}")
        ours(*args, "-o", d / f"moe-ours.{fmt}")
        assert (d / f"moe-ours.{fmt}").read_bytes() == (d / f"moe-ref.{fmt}").read_bytes(), fmt


def test_json_result_and_usage_errors(files: dict[str, Path]) -> None:
    d = files["dir"]
    res = ours(files["f32"], "-f", files["text"], "-c", CTX, "--chunks", 2, "-o", d / "j.gguf")
    for key in ("output", "output_format", "entries", "chunks", "chunk_count", "chunk_size", "ppl", "ppl_error",
                "chunk_ppl", "datasets", "model_sha256", "device", "seconds", "tokens_per_second"):
        assert key in res, key
    assert (res["entries"], res["chunks"], len(res["chunk_ppl"]), res["datasets"]) == (14, 2, 2, [str(files["text"])])
    assert ours(files["f32"], "-f", files["text"], "-c", CTX, "--chunks", 2, "--no-ppl", "-o",
                d / "j2.gguf")["ppl"] is None
    for args in (["--show-statistics"], ["--in-file", d / "j.gguf", "--in-file", d / "j.gguf", "--show-statistics"],
                 [files["f32"]], ["-f", files["text"]], [], [files["f32"], "-f", files["text"], "-c", "8"]):
        r = invoke("imatrix", *map(str, args), "-o", str(d / "never.gguf"))
        assert r.exit_code == 2 and r.stderr.startswith("ggufkit: error:"), (args, r.stderr)
    assert not (d / "never.gguf").exists()


def test_python_api_kv_cache_is_the_clis(files: dict[str, Path]) -> None:
    """collect_imatrix(kv_cache=...) is ``--kv-cache``: the same sums as the command, F16 K/V rounding only with
    ggml_rounding, and an unknown cache type is a UsageError."""
    from ggufkit.errors import UsageError
    from ggufkit.eval.imatrix import collect_imatrix

    d = files["dir"]
    text = files["text"].read_text(encoding="utf-8")
    common = {"text": text, "ctx": CTX, "chunks": 2, "compute_ppl": False, "device": "cpu"}
    sums = {}
    for kv in ("f16", "f32"):
        path = d / f"api-{kv}.gguf"
        collect_imatrix(files["f16"], output=path, ggml_rounding=True, kv_cache=kv, dataset=str(files["text"]),
                        **common)
        sums[kv] = read_raw_imatrix(path).entries
    cli = d / "cli-f16.gguf"
    ours(files["f16"], "-f", files["text"], "-c", CTX, "--chunks", 2, "--no-ppl", "--ggml-rounding", "-o", cli)
    got = read_raw_imatrix(cli).entries
    assert all(np.array_equal(got[n][0], sums["f16"][n][0]) for n in got)
    assert any(not np.array_equal(sums["f32"][n][0], sums["f16"][n][0]) for n in got)
    with pytest.raises(UsageError, match="--kv-cache"):
        collect_imatrix(files["f16"], output=None, ggml_rounding=True, kv_cache="q8_0", **common)
