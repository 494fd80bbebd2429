"""First hour, the shared output rules: where ``-o`` points, templates, and no output over an input
(ggufkit/outputs.py), and atomic writes that name the user's path, never their temporary file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ggufkit.errors import OutputExistsError, UsageError, did_you_mean
from ggufkit.format.atomic import atomic_write
from ggufkit.outputs import expand_template, refuse_overwriting_inputs, resolve_output, same_file


def test_a_path_ending_in_a_separator_is_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert resolve_output("out/", "m-F16.gguf", Path("src")) == Path("out/m-F16.gguf")
    assert resolve_output("out", "m-F16.gguf", Path("src")) == Path("out/m-F16.gguf")
    with pytest.raises(UsageError, match=r"output folder missing-dir/ does not exist"):
        resolve_output("missing-dir/", "m-F16.gguf", Path("src"))
    assert resolve_output(None, "m-F16.gguf", Path("src")) == Path("src/m-F16.gguf")
    assert resolve_output("file.gguf", "m-F16.gguf", Path("src")) == Path("file.gguf")


def test_one_placeholder_vocabulary() -> None:
    assert expand_template("m-{type}.gguf", "Q4_K_M") == "m-q4_k_m.gguf"
    assert expand_template("m-{TYPE}.gguf", "q4_k_m") == "m-Q4_K_M.gguf"
    assert expand_template("m-{ftype}-{OUTTYPE}.gguf", "bf16") == "m-bf16-BF16.gguf"
    for bad in ("m-{typ}.gguf", "m-{}.gguf", "m-{type:>5}.gguf", "m-{type.gguf", "m-{0}.gguf"):
        with pytest.raises(UsageError, match="output template"):
            expand_template(bad, "q4_0")
    with pytest.raises(UsageError, match="no type to put in"):
        resolve_output("x-{type}.gguf", "d.gguf", Path("."), None)


def test_an_output_is_never_an_input_by_path_or_inode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    os.link(model, tmp_path / "hard.gguf")
    os.symlink(model, tmp_path / "soft.gguf")
    (tmp_path / "sub").mkdir()
    for alias in ("model.gguf", "./model.gguf", str(model), "sub/../model.gguf", "hard.gguf", "soft.gguf"):
        assert same_file(alias, "model.gguf"), alias
        with pytest.raises(OutputExistsError, match=r"would overwrite the input model\.gguf"):
            refuse_overwriting_inputs([alias], [None, "model.gguf"])
    refuse_overwriting_inputs(["other.gguf"], ["model.gguf"])  # a new file is fine
    with pytest.raises(OutputExistsError, match="two outputs are the same file"):
        refuse_overwriting_inputs(["a.gguf", "./a.gguf"], ["model.gguf"])


def test_atomic_write_names_the_users_path_never_its_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as missing, atomic_write(tmp_path / "nodir" / "out.gguf") as (f,):
        f.write(b"x")
    assert str(tmp_path / "nodir") == missing.value.filename
    (tmp_path / "imdir").mkdir()
    with pytest.raises(OutputExistsError, match="imdir is a folder") as folder, atomic_write(tmp_path / "imdir") as (f,):
        f.write(b"x")
    assert ".ggufkit-part" not in str(folder.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imdir"]


def test_did_you_mean_a_type() -> None:
    choices = ["Q4_0", "Q4_K_M", "Q4_K_S", "IQ2_XXS"]
    assert did_you_mean("q4km", choices) == "did you mean Q4_K_M? "
    assert did_you_mean("iq2-xxs", choices) == "did you mean IQ2_XXS? "
    assert did_you_mean("banana", choices) == ""
