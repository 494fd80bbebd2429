"""First hour, the commands as a user types them: ``imatrix``, ``set-meta``, ``ppl``, ``demo`` (issue 35).

No command writes over one of its inputs (the same path, ``./x`` and ``x``, a symbolic link, a hard link,
relative and absolute): one line naming both files, exit 2, nothing changed. ``-o`` pointing at a missing
folder, an existing folder or a path ending in ``/`` is answered with the user's path, never a temporary
file's. ``ppl -q`` prints the final figure only; ``demo`` says what its first run costs and never prints a
nonzero KLD as zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q
from gguf_builders import write_model

CTX = 32


def _state(path: Path) -> tuple[bytes, int]:
    st = path.stat()
    return path.read_bytes(), st.st_mtime_ns


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("first-hour")
    rng = np.random.default_rng(0)
    # The synthetic vocabulary has the pieces "▁t0".."▁t60": each word is one token.
    (d / "text.txt").write_text(" ".join(f"t{i}" for i in rng.integers(0, 61, 4 * CTX)) + "\n")
    (d / "tokens.txt").write_text(" ".join(map(str, rng.integers(3, N_VOCAB, 3 * CTX + 3).tolist())))
    model = make_hf_model("llama", seed=3)
    return {"model": write_model_gguf(model, "llama", d / "model.gguf"),
            "q8": write_model_gguf(model, "llama", d / "q8.gguf", Q.Q8_0),
            "text": d / "text.txt", "tokens": d / "tokens.txt", "dir": d}


def _one_line_error(r: object) -> str:
    stderr = r.stderr  # type: ignore[attr-defined]
    assert r.exit_code == 2, (r.stdout, stderr)  # type: ignore[attr-defined]
    assert stderr.startswith("ggufkit: error:") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and ".ggufkit-part" not in stderr, stderr
    return stderr


# -- imatrix: never over its model, text or --in-file ---------------------------------------------------------
ALIASES = ["same", "dot-slash", "absolute", "symlink", "hardlink", "parent"]


def _alias(kind: str, name: str, d: Path) -> str:
    """How a user could spell the file ``d/name`` (run from ``d``)."""
    if kind == "symlink":
        (d / f"soft-{name}").unlink(missing_ok=True)
        os.symlink(name, d / f"soft-{name}")
        return f"soft-{name}"
    if kind == "hardlink":
        (d / f"hard-{name}").unlink(missing_ok=True)
        os.link(d / name, d / f"hard-{name}")
        return f"hard-{name}"
    (d / "sub").mkdir(exist_ok=True)
    return {"same": name, "dot-slash": f"./{name}", "absolute": str(d / name), "parent": f"sub/../{name}"}[kind]


@pytest.mark.parametrize("kind", ALIASES)
def test_imatrix_never_replaces_the_model_it_reads(files: dict[str, Path], kind: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    d = files["dir"]
    monkeypatch.chdir(d)
    before = _state(files["model"])
    out = _alias(kind, "model.gguf", d)
    r = invoke("imatrix", "model.gguf", "-f", "text.txt", "-c", str(CTX), "--chunks", "2", "-o", out,
               "--device", "cpu")
    err = _one_line_error(r)
    assert f"output {Path(out)} would overwrite the input model.gguf" in err
    assert _state(files["model"]) == before


@pytest.mark.parametrize("which", ["text", "in-file"])
def test_imatrix_never_replaces_its_text_or_an_in_file(files: dict[str, Path], which: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = files["dir"]
    monkeypatch.chdir(d)
    first = d / "first.gguf"
    if not first.exists():
        r = invoke("imatrix", "model.gguf", "-f", "text.txt", "-c", str(CTX), "--chunks", "2", "-o", "first.gguf",
                   "--device", "cpu", "--no-ppl")
        assert r.exit_code == 0, r.stderr
    victim = d / ("text.txt" if which == "text" else "first.gguf")
    before = _state(victim)
    if which == "text":
        args = ["model.gguf", "-f", "text.txt", "-c", str(CTX), "--chunks", "2", "-o", "./text.txt"]
    else:  # combining files into one of them
        args = ["--in-file", "first.gguf", "--in-file", "first.gguf", "-o", str(first)]
    err = _one_line_error(invoke("imatrix", *args, "--device", "cpu"))
    assert victim.name in err
    assert _state(victim) == before


# -- -o: a missing folder, a folder, a path ending in / --------------------------------------------------------
def test_imatrix_output_folders_are_named_as_the_user_typed_them(files: dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    d = files["dir"]
    monkeypatch.chdir(d)
    base = ["imatrix", "model.gguf", "-f", "text.txt", "-c", str(CTX), "--chunks", "2", "--device", "cpu",
            "--no-ppl", "--json"]
    err = _one_line_error(invoke(*base, "-o", "missing-folder/out.gguf"))
    assert "missing-folder/out.gguf" in err and "does not exist" in err
    err = _one_line_error(invoke(*base, "-o", "missing-folder/"))
    assert "missing-folder/" in err and not Path("missing-folder").exists()
    # An existing folder, with or without the separator: llama-imatrix's default name inside it.
    for i, typed in enumerate(["existing-folder", "existing-folder/"]):
        Path("existing-folder").mkdir(exist_ok=True)
        r = invoke(*base, "-o", typed, *(["--output-format", "dat"] if i else []))
        assert r.exit_code == 0, r.stderr
        name = "imatrix.dat" if i else "imatrix.gguf"
        assert json.loads(r.stdout)["output"] == str(Path("existing-folder") / name)
        assert (d / "existing-folder" / name).stat().st_size > 0
    # ... and when that name is itself a folder, the refusal names it.
    (d / "taken" / "imatrix.gguf").mkdir(parents=True)
    err = _one_line_error(invoke(*base, "-o", "taken/"))
    assert "taken/imatrix.gguf is a folder" in err
    assert not [p for p in d.rglob("*ggufkit-part*")]


# -- set-meta -------------------------------------------------------------------------------------------------
@pytest.fixture
def meta_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return write_model(tmp_path / "m.gguf")


def test_set_meta_never_writes_over_the_template_or_json_it_reads(meta_model: Path) -> None:
    chat = meta_model.with_name("chat.jinja")
    chat.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    edits = meta_model.with_name("edits.json")
    edits.write_text(json.dumps({"general.name": "x"}), encoding="utf-8")
    os.link(chat, meta_model.with_name("chat-hard.jinja"))
    states = {p: _state(p) for p in (meta_model, chat, edits)}
    for args, out in ((["--chat-template-file", "chat.jinja"], "./chat.jinja"),
                      (["--chat-template-file", "chat.jinja"], "chat-hard.jinja"),
                      (["--chat-template-file", str(chat)], "chat.jinja"),
                      (["--from-json", "edits.json"], "edits.json")):
        err = _one_line_error(invoke("set-meta", "m.gguf", *args, "-o", out))
        assert f"output {Path(out)} would overwrite the input {args[1]}" in err
    assert {p: _state(p) for p in states} == states


def test_set_meta_output_folders_are_named_as_the_user_typed_them(meta_model: Path) -> None:
    before = _state(meta_model)
    for typed in ("missing-folder/out.gguf", "missing-folder/"):
        err = _one_line_error(invoke("set-meta", "m.gguf", "general.name=x", "-o", typed))
        assert typed in err and "does not exist" in err
    Path("existing-folder").mkdir()
    for typed in ("existing-folder", "existing-folder/"):
        r = invoke("set-meta", "m.gguf", f"general.name={typed}", "-o", typed, "--json")
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["output"] == str(Path("existing-folder/m.gguf"))
    Path("taken/m.gguf").mkdir(parents=True)
    err = _one_line_error(invoke("set-meta", "m.gguf", "general.name=x", "-o", "taken"))
    assert "taken/m.gguf" in err and "director" in err
    assert _state(meta_model) == before
    assert not list(Path().rglob("*ggufkit-part*"))


# -- ppl -q: the final figure only ----------------------------------------------------------------------------
def test_ppl_quiet_prints_the_final_figure_only(files: dict[str, Path]) -> None:
    args = ["ppl", str(files["q8"]), "--tokens", str(files["tokens"]), "-c", str(CTX), "--device", "cpu"]
    full = json.loads(invoke(*args, "--json").stdout)
    r = invoke(*args, "-q")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"Final estimate: PPL = {full['ppl']:.4f} +/- {full['ppl_error']:.5f}\n"
    assert r.stderr == ""
    r = invoke(*args, "--baseline", str(files["model"]), "--kld-mode", "side-by-side", "--quiet")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Final estimate: PPL = ") and lines[1].startswith("Mean    KLD:")


# -- demo -----------------------------------------------------------------------------------------------------
def test_demo_never_prints_a_nonzero_kld_as_zero() -> None:
    from ggufkit.cli.demo import _render
    from ggufkit.demo import COLUMNS

    row = {"recipe": "", "path": "", "bytes": 1 << 20, "bits_per_weight": 4.5, "ppl": 10.0, "ppl_error": 0.1}
    report = {"workdir": "/tmp/x", "kept": False, "steps": ["a"], "columns": COLUMNS, "rows": [
        {**row, "type": "F16", "mean_kld": None, "same_top_p": None},
        {**row, "type": "Q8_0", "mean_kld": 3.2e-6, "same_top_p": 0.989},
        {**row, "type": "Q4_K_M", "mean_kld": 0.0123, "same_top_p": 0.9996}]}
    text = _render(report)
    table = {line.split()[0]: line.split() for line in text.splitlines() if line.split()
             and line.split()[0] in ("F16", "Q8_0", "Q4_K_M")}
    assert set(table) == {"F16", "Q8_0", "Q4_K_M"}
    assert "0.00000" not in text and float(table["Q8_0"][-2]) == pytest.approx(3.2e-6)
    assert table["Q8_0"][-1] == "98.9%" and table["Q4_K_M"][-2] == "0.0123"
    assert table["Q4_K_M"][-1] == "99.9%"  # not all: never rounded up to 100.0 %
    assert "--workdir" in text  # where the files went, and how to keep them


def test_demo_names_its_rows_as_quantize_type_does(tmp_path: Path) -> None:
    from ggufkit.demo import run_demo
    from ggufkit.quant.llama_quantize.presets import quant_option_name

    rows = run_demo(tmp_path, targets=[("q8_0", True), ("q4_k_m", False)], train_steps=0)
    assert [r.type for r in rows] == ["F16", "Q8_0", "Q4_K_M"]
    assert all(quant_option_name(r.type) == r.type for r in rows)  # as --type names (and accepts) them


def test_demo_says_what_the_first_run_costs_and_where_files_go() -> None:
    r = invoke("demo", "--help")
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert "first run compiles" in text and "minutes" in text and "--workdir" in text


def test_demo_never_overwrites_a_file_it_did_not_make(tmp_path: Path) -> None:
    mine = tmp_path / "tiny-llama-f16.gguf"
    mine.write_bytes(b"the user's own file")
    before = _state(mine)
    err = _one_line_error(invoke("demo", "--workdir", str(tmp_path), "--steps", "0"))
    assert str(mine) in err and "--workdir" in err
    assert _state(mine) == before and not (tmp_path / "tiny-llama").exists()
