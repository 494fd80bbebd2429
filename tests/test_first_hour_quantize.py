"""First hour with ``ggufkit quantize``, as a user types it (issue 35): a folder as output, templates, no
output over an input, one refusal for an IQ type without imatrix data, presets told apart in ``--help``,
typos, and quiet output."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import invoke
from fixtures_quantize import imatrix_values, make_llama_gguf, write_imatrix_gguf

from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.outputs import TEMPLATE_HELP
from ggufkit.quant.llama_quantize.presets import PRESETS, has_kernel, measured_quality


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("first_hour_quantize")
    return make_llama_gguf(d / "model.gguf", n_embd=256, n_ff=256, n_layer=2, n_vocab=256, seed=7)


@pytest.fixture
def here(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder holding ``in.gguf``, made the current directory (the user's relative paths)."""
    shutil.copyfile(model, tmp_path / "in.gguf")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_line_error(result, *needles: str) -> str:  # type: ignore[no-untyped-def]
    """The one error line (click's own usage errors add their "Usage:" and "Try" lines before it)."""
    err = result.stderr.strip()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout)
    assert "Traceback" not in err, err
    if err.startswith("Usage:"):
        err = err.splitlines()[-1]
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# --- 1. an output that is a folder ----------------------------------------------------------------------
@pytest.mark.parametrize("words", [[".", "--type", "q4_0"], [".", "q4_0"], ["./", "--type", "q4_0"]],
                         ids=["dot-option", "dot-positional", "dot-slash"])
def test_an_output_folder_gets_llama_quantizes_default_name_inside_it(here: Path, words: list[str]) -> None:
    got = invoke("quantize", "in.gguf", *words)
    assert got.exit_code == 0, got.stderr
    assert _files(here) == ["ggml-model-Q4_0.gguf", "in.gguf"]


def test_an_existing_folder_and_a_trailing_separator_name_a_folder(here: Path) -> None:
    (here / "out").mkdir()
    assert invoke("quantize", "in.gguf", "out", "--type", "q8_0").exit_code == 0
    assert invoke("quantize", "in.gguf", "out/", "--type", "q4_0").exit_code == 0
    assert _files(here / "out") == ["ggml-model-Q4_0.gguf", "ggml-model-Q8_0.gguf"]
    _one_line_error(invoke("quantize", "in.gguf", "missing/", "--type", "q4_0"), "missing/", "does not exist")
    assert not (here / "missing").exists() and _files(here) == sorted(["in.gguf", "out/ggml-model-Q4_0.gguf",
                                                                       "out/ggml-model-Q8_0.gguf"])


# --- 2. one template vocabulary ------------------------------------------------------------------------
@pytest.mark.parametrize(("out", "types", "names"), [
    ("x-{type}.gguf", "q4_0", ["x-q4_0.gguf"]),
    ("x-{TYPE}.gguf", "q4_0", ["x-Q4_0.gguf"]),
    ("x-{ftype}-{OUTTYPE}.gguf", "q8_0", ["x-q8_0-Q8_0.gguf"]),
    ("m-{type}.gguf", "q4_0,Q8_0", ["m-q4_0.gguf", "m-q8_0.gguf"]),
    ("m-{TYPE}.gguf", "q4_0,q8_0", ["m-Q4_0.gguf", "m-Q8_0.gguf"]),
])
def test_templates_name_single_and_several_types_alike(here: Path, out: str, types: str, names: list[str]) -> None:
    got = invoke("quantize", "in.gguf", out, "--type", types)
    assert got.exit_code == 0, got.stderr
    assert _files(here) == sorted(["in.gguf", *names])


def test_an_unknown_placeholder_is_a_one_line_error_and_the_vocabulary_is_in_help(here: Path) -> None:
    _one_line_error(invoke("quantize", "in.gguf", "x-{typ}.gguf", "--type", "q4_0"), "unknown placeholder {typ}")
    _one_line_error(invoke("quantize", "in.gguf", "x-{typ}.gguf", "--type", "q4_0,q8_0"), "unknown placeholder")
    assert _files(here) == ["in.gguf"]
    help_text = " ".join(invoke("quantize", "--help").stdout.split())
    assert " ".join(TEMPLATE_HELP.split()) in help_text


# --- 3. no output over an input ------------------------------------------------------------------------
def test_no_output_is_the_model_by_any_name(here: Path) -> None:
    os.link(here / "in.gguf", here / "hard.gguf")
    before = (here / "in.gguf").read_bytes()
    for out in ("in.gguf", "./in.gguf", "hard.gguf"):
        _one_line_error(invoke("quantize", "in.gguf", out, "--type", "q4_0"), "would overwrite the input")
    assert (here / "in.gguf").read_bytes() == before


def test_no_output_is_the_imatrix_or_the_tensor_type_file(here: Path) -> None:
    im = write_imatrix_gguf(here / "im.gguf", imatrix_values(here / "in.gguf"))
    (here / "rules.txt").write_text("ffn_down=q8_0\n")
    im_bytes = im.read_bytes()
    _one_line_error(invoke("quantize", "in.gguf", "im.gguf", "--type", "q4_0", "--imatrix", "im.gguf"),
                    "would overwrite the input im.gguf")
    _one_line_error(invoke("quantize", "in.gguf", "rules.txt", "--type", "q4_0", "--tensor-type-file", "rules.txt"),
                    "would overwrite the input rules.txt")
    assert im.read_bytes() == im_bytes and (here / "rules.txt").read_text() == "ffn_down=q8_0\n"


def test_several_types_refuse_an_input_among_their_outputs_before_writing_any(here: Path) -> None:
    shutil.copyfile(here / "in.gguf", here / "m-q8_0.gguf")
    _one_line_error(invoke("quantize", "m-q8_0.gguf", "m-{type}.gguf", "--type", "q4_0,q8_0"),
                    "would overwrite the input")
    assert _files(here) == ["in.gguf", "m-q8_0.gguf"]  # m-q4_0.gguf was not written first


def test_no_output_is_another_shard_of_the_input(here: Path) -> None:
    with open_gguf(here / "in.gguf") as m:
        md = Metadata()
        for key, kv in m.kv.items():
            md.put(key, kv)
        specs = [TensorSpec(t.name, t.ggml_type, t.shape) for t in m.tensors]
        shards = write_gguf(here / "sh.gguf", md, specs, [bytes(m.raw(t)) for t in m.tensors],
                            split_max_tensors=8)
    assert len(shards) >= 2
    second = shards[1].name
    before = shards[1].read_bytes()
    _one_line_error(invoke("quantize", shards[0].name, second, "--type", "q4_0"), "would overwrite the input")
    assert shards[1].read_bytes() == before


# --- 4. an IQ type whose imatrix has no token_embd entry ------------------------------------------------
def test_iq2_xxs_pure_without_token_embd_data_is_one_refusal_naming_tensor_and_type(here: Path) -> None:
    entries = imatrix_values(here / "in.gguf")
    del entries["token_embd.weight"]
    write_imatrix_gguf(here / "im.gguf", entries)
    got = invoke("quantize", "in.gguf", "out.gguf", "--type", "iq2_xxs", "--pure", "--imatrix", "im.gguf")
    err = _one_line_error(got, "token_embd.weight", "IQ2_XXS", "--token-embedding-type")
    assert "quantized without one" not in got.output and "warning" not in err.lower()
    assert not (here / "out.gguf").exists()
    # the dry run names it among the tensors a real run refuses
    dry = invoke("quantize", "in.gguf", "--type", "iq2_xxs", "--pure", "--imatrix", "im.gguf", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    assert "quantized without one" not in dry.stderr and "token_embd.weight" in dry.stdout


# --- 5. presets told apart ----------------------------------------------------------------------------
def test_help_tells_the_q3_k_presets_apart_by_measured_size_and_quality() -> None:
    lines = invoke("quantize", "--help").stdout.splitlines()
    rows = {}
    for name in ("Q3_K_S", "Q3_K_M", "Q3_K_L"):
        row = next(line for line in lines if line.split()[1:2] == [name])
        rows[name] = row.split()
    sizes = {name: next(w for w in words if w.endswith("%")) for name, words in rows.items()}
    assert len(set(sizes.values())) == 3, sizes
    for words in rows.values():  # then the measured KLD and PPL change
        at = next(i for i, w in enumerate(words) if w.endswith("%"))
        assert float(words[at + 1]) >= 0 and words[at + 2].endswith("%"), words


def test_measured_data_covers_every_preset_and_records_its_origin() -> None:
    data = measured_quality()
    assert data["model"] and data["text"] and data["date"] and data["imatrix"]
    presets = data["presets"]
    assert isinstance(presets, dict)
    assert set(presets) == set(PRESETS)
    for name, p in PRESETS.items():
        row = presets[name]
        if row.get("error"):  # the reference model cannot take this type (rows that are not whole blocks)
            assert row["size"] is None and row["kld"] is None, name
            continue
        assert row["size"] > 0, name
        if has_kernel(p.default_type):
            assert row["kld"] is not None and row["kld"] >= 0 and row["ppl_change"] is not None, name
    assert sum(1 for row in presets.values() if row.get("error")) <= 3
    ordered = [presets[n]["size"] for n in ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_m", "q6_k", "q8_0", "f16")]
    assert ordered == sorted(ordered)


# --- 6. typos ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("words", [["out.gguf", "--type", "q4km"], ["out.gguf", "q4km"], ["q4km"]],
                         ids=["option", "positional", "positional-alone"])
def test_a_typo_in_a_type_says_did_you_mean_before_the_choices(here: Path, words: list[str]) -> None:
    err = _one_line_error(invoke("quantize", "in.gguf", *words), "did you mean Q4_K_M?")
    assert err.index("did you mean") < err.index("choose one of")
    assert _files(here) == ["in.gguf"]


def test_a_typo_in_a_tensor_type_says_did_you_mean(here: Path) -> None:
    _one_line_error(invoke("quantize", "in.gguf", "out.gguf", "--type", "q4_0", "--output-tensor-type", "q8o"),
                    "did you mean Q8_0?")


# --- 7. quiet output -------------------------------------------------------------------------------
def test_cpu_only_is_said_only_where_cuda_was_asked_for(here: Path) -> None:
    plain = invoke("quantize", "in.gguf", "--type", "iq3_s", "--dry-run")
    assert plain.exit_code == 0, plain.stderr
    assert "CPU only" not in plain.output and "CUDA" not in plain.output
    cuda = invoke("quantize", "in.gguf", "--type", "iq3_s", "--dry-run", "--device", "cuda")
    assert cuda.exit_code == 0, cuda.stderr
    assert "CUDA kernel" in cuda.output


def test_a_missing_imatrix_entry_is_said_once_per_run_not_once_per_type(here: Path) -> None:
    entries = imatrix_values(here / "in.gguf")
    del entries["token_embd.weight"], entries["output.weight"]
    write_imatrix_gguf(here / "im.gguf", entries)
    got = invoke("quantize", "in.gguf", "m-{type}.gguf", "--type", "q4_0,q8_0", "--imatrix", "im.gguf")
    assert got.exit_code == 0, got.stderr
    assert got.stderr.count("no imatrix entry") == 1, got.stderr
    assert "token_embd.weight" in got.stderr and "output.weight" in got.stderr
