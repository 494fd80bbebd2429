"""Whole files and option semantics equal llama.cpp's own ``llama-quantize`` binary, byte for byte.

Oracle: ``llama-quantize`` built from the llama.cpp vendored in llama-cpp-python 0.3.36 (it takes an
imatrix file, which ``llama_model_quantize`` through ctypes cannot). Same input, same flags, same imatrix
file; compared: tensor order, names, types and bytes, ``general.file_type``, KV order and values (ggufkit's
own ``ggufkit.*`` provenance keys aside). Presets are those with kernels on this build; the planner of the
others is checked against ``--dry-run`` in test_quant_presets_oracle.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from cli_helpers import invoke
from fixtures_quantize import arch_case, imatrix_values, make_gguf, make_llama_gguf, write_imatrix_gguf
from llama_cpp_sources import tool_path

from ggufkit.errors import GGUFKitError, QuantizationError, UsageError
from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.quant.llama_quantize.pipeline import quantize_file
from ggufkit.quant.llama_quantize.presets import ALIASES, PRESETS
from ggufkit.quant.registry import TYPES


def llama_quantize_bin(inp: Path, out: Path, target: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool_path("llama-quantize")), *flags, str(inp), str(out), target.upper(), "2"],
                          capture_output=True, text=True, check=False)


def assert_same_file(ref: Path, ours: Path) -> None:
    """Same tensors (order, names, types, bytes), same KV pairs in the same order (our ggufkit.* keys aside)."""
    with open_gguf(ref) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        assert list(a.kv) == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in a.kv:
            assert a.kv[key].type == b.kv[key].type, key
            if not key.startswith("tokenizer."):
                assert a.get(key) == b.get(key), key


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("opt_models")
    return {
        "gqa4": make_llama_gguf(d / "gqa4.gguf", n_embd=256, n_ff=256, n_layer=8, n_head=4, n_head_kv=1,
                                n_vocab=256),
        "odd": make_llama_gguf(d / "odd.gguf", n_embd=288, n_ff=600, n_layer=4, n_head=4, n_head_kv=4,
                               n_vocab=256, tied=True, seed=2),
        "moe": make_gguf(d / "moe.gguf", *arch_case("mixtral", n_layer=2, n_exp=8), seed=6),
    }


#: Presets whose default type has a kernel on this build (the others are planned only); grows with TYPES.
KERNEL_PRESETS = [n for n, p in PRESETS.items() if p.default_type in TYPES and n not in ALIASES]


def compare_with_llama_quantize(src: Path, tmp_path: Path, target: str, flags: list[str], **kw: object) -> None:
    """Same input and flags to both; llama-quantize failing means ggufkit must refuse and write nothing."""
    ref, ours = tmp_path / f"ref-{target}.gguf", tmp_path / f"ours-{target}.gguf"
    res = llama_quantize_bin(src, ref, target, *flags)
    if res.returncode != 0:  # e.g. Q1_0 (128-blocks, no fallback) on 288-wide rows
        with pytest.raises(GGUFKitError):
            quantize_file(src, ours, target, **kw)
        assert not ours.exists()
        return
    quantize_file(src, ours, target, threads=2, **kw)
    assert_same_file(ref, ours)


@pytest.mark.parametrize("model", ["gqa4", "odd", "moe"])
def test_presets_with_kernels_equal_llama_quantize(models, tmp_path, model):
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", imatrix_values(models[model]))
    for target in KERNEL_PRESETS:  # the same imatrix file to both where the preset needs one
        im = PRESETS[target].needs_imatrix
        compare_with_llama_quantize(models[model], tmp_path, target, ["--imatrix", str(imat)] if im else [],
                                    imatrix=imat if im else None)


@pytest.mark.parametrize("model", ["odd", "moe"])
def test_every_pure_type_with_kernels_equals_llama_quantize(models, tmp_path, model):
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", imatrix_values(models[model]))
    for qtype, row in TYPES.items():
        im = row.needs_imatrix
        compare_with_llama_quantize(models[model], tmp_path, qtype.name.lower(),
                                    ["--pure", *(["--imatrix", str(imat)] if im else [])], pure=True,
                                    imatrix=imat if im else None)


@pytest.mark.parametrize("target", ["q4_k_m", "q5_0"])
def test_include_exclude_weights_and_imatrix_keys_equal_llama_quantize(models, tmp_path, target):
    src = models["gqa4"]
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", imatrix_values(src), datasets=("wiki.txt",), chunk_count=5)
    for flags, kw in ((["--include-weights", "ffn_", "--include-weights", "attn_v"],
                       dict(include_weights=("ffn_", "attn_v"))),
                      (["--exclude-weights", "blk.1.", "--exclude-weights", "output"],
                       dict(exclude_weights=("blk.1.", "output")))):
        ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
        res = llama_quantize_bin(src, ref, target, "--imatrix", str(imat), *flags)
        assert res.returncode == 0, res.stderr[-1500:]
        quantize_file(src, ours, target, imatrix=imat, **kw)
        assert_same_file(ref, ours)


def test_tensor_type_rules_and_file_equal_llama_quantize(models, tmp_path):
    src = models["odd"]
    rules = tmp_path / "types.txt"
    rules.write_text("ffn_down=q8_0\n  blk\\.[02]\\.attn_q=Q4_1 \nattn_output=bf16\n")
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q4_k_s", "--tensor-type", "ATTN_K=q6_k",
                             "--tensor-type-file", str(rules))
    assert res.returncode == 0, res.stderr[-1500:]
    quantize_file(src, tmp_path / "ours.gguf", "q4_k_s", tensor_types=("ATTN_K=q6_k",), tensor_type_file=rules)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


@pytest.mark.parametrize("prune", ["0", "2,5", "7", "1,2,3"])
def test_prune_layers_equal_llama_quantize(models, tmp_path, prune):
    src = models["gqa4"]
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", imatrix_values(src))
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q4_k_m", "--prune-layers", prune, "--imatrix", str(imat))
    assert res.returncode == 0, res.stderr[-1500:]
    quantize_file(src, tmp_path / "ours.gguf", "q4_k_m", prune_layers=prune, imatrix=imat)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_override_kv_equals_llama_quantize(models, tmp_path):
    src = models["gqa4"]
    overrides = ["general.name=str:renamed model", "llama.context_length=int:-4096", "custom.flag=bool:true",
                 "custom.scale=float:0.125", "general.name=str:twice", "llama.rope.freq_base=float:10000.5"]
    flags = [x for o in overrides for x in ("--override-kv", o)]
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q8_0", *flags)
    assert res.returncode == 0, res.stderr[-1500:]
    quantize_file(src, tmp_path / "ours.gguf", "q8_0", override_kv=overrides)
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


def test_keep_split_equals_llama_quantize(models, tmp_path):
    with open_gguf(models["gqa4"]) as m:
        meta = Metadata(m.kv.items())
        specs = [TensorSpec(t.name, t.ggml_type, t.shape) for t in m.tensors]
        shards = write_gguf(tmp_path / "in.gguf", meta, specs, [bytes(m.raw(t)) for t in m.tensors],
                            split_max_tensors=30, slack_bytes=0)
    assert len(shards) == 3
    (tmp_path / "ref").mkdir()
    (tmp_path / "ours").mkdir()
    res = llama_quantize_bin(shards[0], tmp_path / "ref" / "out.gguf", "q4_k_m", "--keep-split")
    assert res.returncode == 0, res.stderr[-1500:]
    report = quantize_file(shards[0], tmp_path / "ours" / "out.gguf", "q4_k_m", keep_split=True)
    refs = sorted((tmp_path / "ref").iterdir())
    assert [p.name for p in refs] == [p.name for p in report.outputs] == [
        f"out-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for ref, ours in zip(refs, report.outputs):
        assert_same_file(ref, ours)
    # one input file: llama-quantize still writes "out-00001-of-00001.gguf"
    res = llama_quantize_bin(models["odd"], tmp_path / "ref" / "one.gguf", "q8_0", "--keep-split")
    assert res.returncode == 0
    report = quantize_file(models["odd"], tmp_path / "ours" / "one.gguf", "q8_0", keep_split=True)
    assert report.outputs == (tmp_path / "ours" / "one-00001-of-00001.gguf",)
    assert_same_file(tmp_path / "ref" / "one-00001-of-00001.gguf", report.outputs[0])


def _refused_tensor(stderr: str) -> str:
    m = re.search(r"offending tensor: (\S+)|Missing importance matrix for tensor (\S+)", stderr)
    assert m, stderr[-1500:]
    return m.group(1) or m.group(2)


def test_missing_imatrix_is_refused_in_the_plan_like_llama_quantize(models, tmp_path):
    """llama-quantize bails out (mid-file with an imatrix that lacks the entry); ggufkit refuses before
    writing anything, naming the same tensor."""
    src = models["gqa4"]
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q4_0", "--tensor-type", "ffn_up=iq2_xxs")
    assert res.returncode != 0
    with pytest.raises(QuantizationError, match=re.escape(f"'{_refused_tensor(res.stderr)}'") + ".*IQ2_XXS"):
        quantize_file(src, tmp_path / "ours.gguf", "q4_0", tensor_types=("ffn_up=iq2_xxs",))
    entries = imatrix_values(src)
    del entries["blk.3.ffn_up.weight"]
    imat = write_imatrix_gguf(tmp_path / "imatrix.gguf", entries)
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q4_0", "--tensor-type", "ffn_up=iq2_xxs",
                             "--imatrix", str(imat))
    assert res.returncode != 0 and _refused_tensor(res.stderr) == "blk.3.ffn_up.weight"
    with pytest.raises(QuantizationError, match=r"'blk\.3\.ffn_up\.weight'.*IQ2_XXS"):
        quantize_file(src, tmp_path / "ours.gguf", "q4_0", tensor_types=("ffn_up=iq2_xxs",), imatrix=imat)
    # Q2_K needs one only inside a Q2_K_S file; token_embd and output never do
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q2_k_s")
    assert res.returncode != 0
    with pytest.raises(QuantizationError, match=re.escape(f"'{_refused_tensor(res.stderr)}'") + ".*Q2_K"):
        quantize_file(src, tmp_path / "ours.gguf", "q2_k_s")
    assert not any(p.name.startswith("ours") for p in tmp_path.iterdir())
    # a dry run shows the plan and says what a real run would refuse
    report = quantize_file(src, None, "iq2_xxs", dry_run=True)
    assert report.plan.imatrix_required() and any("need an importance matrix" in w for w in report.warnings)


def test_a_type_without_kernel_plans_but_does_not_quantize(models, tmp_path):
    missing = [p for p in PRESETS.values() if p.default_type not in TYPES and not p.needs_imatrix]
    if not missing:  # every type has its kernel: no plan may report one missing
        assert not any(quantize_file(models["gqa4"], None, n, dry_run=True).plan.missing_kernels() for n in PRESETS)
        return
    report = quantize_file(models["gqa4"], None, missing[0].name, dry_run=True)
    assert report.plan.missing_kernels()
    with pytest.raises(UsageError, match="no kernel for"):
        quantize_file(models["gqa4"], tmp_path / "out.gguf", missing[0].name)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("words", [["q8_0"], ["15", "1"], ["Q4_K", "0"], ["7"]], ids="-".join)
def test_positional_form_without_output_names_the_file_as_llama_quantize(models, tmp_path, words):
    """``IN TYPE [NTHREADS]``: both tools write ggml-model-NAME.gguf beside IN (NAME: the QUANT_OPTIONS row the
    word parses to, an alias or a numeric id's first row included), with the same bytes."""
    for side in ("ref", "ours"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "in.gguf").write_bytes(models["odd"].read_bytes())
    res = subprocess.run([str(tool_path("llama-quantize")), str(tmp_path / "ref" / "in.gguf"), *words],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-1500:]
    got = invoke("quantize", str(tmp_path / "ours" / "in.gguf"), *words)
    assert got.exit_code == 0, got.stderr
    refs = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == refs and len(refs) == 2
    name = next(n for n in refs if n != "in.gguf")
    assert name.startswith("ggml-model-")
    assert_same_file(tmp_path / "ref" / name, tmp_path / "ours" / name)


def test_positional_form_with_output_type_and_threads_equals_the_option_form(models, tmp_path):
    src = models["gqa4"]
    res = llama_quantize_bin(src, tmp_path / "ref.gguf", "q4_k_m")  # IN OUT TYPE NTHREADS
    assert res.returncode == 0, res.stderr[-1500:]
    got = invoke("quantize", str(src), str(tmp_path / "ours.gguf"), "q4_k_m", "2", "--json")
    assert got.exit_code == 0, got.stderr
    assert_same_file(tmp_path / "ref.gguf", tmp_path / "ours.gguf")


@pytest.mark.parametrize(("words", "message"), [
    (["out.gguf", "q9_9"], "invalid type 'q9_9'"),
    (["out.gguf", "q8_0", "two"], "invalid thread count 'two'"),
    (["out.gguf", "q8_0", "2", "extra"], "unexpected extra argument 'extra'"),
    (["out.gguf", "q8_0", "--type", "q4_0"], "the type is given twice"),
    (["out.gguf", "q8_0", "2", "--threads", "1"], "the thread count is given twice"),
])
def test_bad_positional_words_are_one_line_errors(models, tmp_path, words, message):
    got = invoke("quantize", str(models["gqa4"]), *[str(tmp_path / w) if w == "out.gguf" else w for w in words])
    assert got.exit_code == 2 and message in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert not (tmp_path / "out.gguf").exists()


def test_several_types_in_one_run_equal_llama_quantize_file_by_file(models, tmp_path):
    """``--type a,b,c``: one file per type (OUT's {type} is the QUANT_OPTIONS name in lower case, {TYPE} in
    upper case), each equal to the file llama-quantize writes for that type alone; without OUT,
    ggml-model-NAME.gguf beside IN."""
    src = models["odd"]
    targets = ["q4_0", "Q8_0", "q4_k", "q6_k"]
    got = invoke("quantize", str(src), str(tmp_path / "ours-{type}.gguf"), "--type", ",".join(targets), "--json")
    assert got.exit_code == 0, got.stderr
    results = json.loads(got.stdout)["results"]
    names = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]
    assert [r["output"] for r in results] == [str(tmp_path / f"ours-{n.lower()}.gguf") for n in names]
    for target, name in zip(targets, names):
        res = llama_quantize_bin(src, tmp_path / f"ref-{name}.gguf", target)
        assert res.returncode == 0, res.stderr[-1500:]
        assert_same_file(tmp_path / f"ref-{name}.gguf", tmp_path / f"ours-{name.lower()}.gguf")
    upper = invoke("quantize", str(src), str(tmp_path / "up-{TYPE}.gguf"), "--type", "q8_0,q4_k", "--json")
    assert upper.exit_code == 0, upper.stderr
    assert [r["output"] for r in json.loads(upper.stdout)["results"]] == [
        str(tmp_path / "up-Q8_0.gguf"), str(tmp_path / "up-Q4_K.gguf")]
    (tmp_path / "beside").mkdir()
    (tmp_path / "beside" / "in.gguf").write_bytes(src.read_bytes())
    assert invoke("quantize", str(tmp_path / "beside" / "in.gguf"), "--type", "q8_0,q4_0").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "beside").iterdir()) == [
        "ggml-model-Q4_0.gguf", "ggml-model-Q8_0.gguf", "in.gguf"]
    assert_same_file(tmp_path / "ref-Q8_0.gguf", tmp_path / "beside" / "ggml-model-Q8_0.gguf")


@pytest.mark.parametrize(("out", "types", "message"), [
    ("ours-{type}.gguf", "q8_0,iq2_xxs", "missing importance matrix for IQ2_XXS"),  # refused in the plan: nothing written
    ("ours.gguf", "q8_0,q4_0", "several types need an output name with {type}"),
    ("ours-{type}.gguf", "q8_0,Q8_0", "a type is named twice"),
    ("ours-{type}.gguf", "q8_0,q9_9", "unknown quantization type 'q9_9'"),
])
def test_a_bad_list_of_types_writes_nothing(models, tmp_path, out, types, message):
    got = invoke("quantize", str(models["gqa4"]), str(tmp_path / out), "--type", types)
    assert got.exit_code == 2 and message in got.stderr, got.stderr
    assert list(tmp_path.iterdir()) == []
