"""``--json`` has one shape everywhere: every command's document starts with ``"ok"`` (true exactly when it
exits 0), and every failure - a ggufkit error, a failed gate, an invalid file, or a click usage error such as
an unknown option or a missing argument - prints ``{"ok": false, "error": {"type", "message", "exit_code"}}``
(or the command's result with ``ok`` false) as the one JSON document on stdout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from fixtures_quantize import make_llama_gguf

#: Every command of the CLI (ggufkit.cli.COMMANDS), so a new one cannot be left out.
from ggufkit.cli import COMMANDS


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli_json")
    tokens = np.random.default_rng(0).integers(3, N_VOCAB, 2 * 32 + 3).tolist()
    (d / "tokens.txt").write_text(" ".join(map(str, tokens)))
    (d / "junk.gguf").write_bytes(b"not a gguf file at all")
    from ggufkit.eval import collect_imatrix

    model = write_model_gguf(make_hf_model("llama", seed=2), "llama", d / "e.gguf")
    collect_imatrix(model, tokens=tokens, output=d / "im.gguf", ctx=32, compute_ppl=False, device="cpu")
    return {"gguf": make_llama_gguf(d / "m.gguf", n_embd=64, n_ff=128, n_vocab=320), "eval": model,
            "tokens": d / "tokens.txt", "junk": d / "junk.gguf", "dir": d, "imatrix": d / "im.gguf"}


def one_document(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    doc = json.loads(lines[0])
    assert next(iter(doc)) == "ok", doc  # the key comes first
    return doc


def assert_error_document(stdout: str, exit_code: int, expected_code: int, words: str) -> None:
    doc = one_document(stdout)
    assert exit_code == expected_code
    assert doc["ok"] is False and set(doc) == {"ok", "error"}
    assert set(doc["error"]) == {"type", "message", "exit_code"} and doc["error"]["exit_code"] == expected_code
    assert doc["error"]["message"] and words in doc["error"]["message"] and "\n" not in doc["error"]["message"]


def _success_args(files: dict[str, Path]) -> dict[str, list[str]]:
    return {
        "info": ["info", str(files["gguf"])],
        "verify": ["verify", str(files["gguf"])],
        "set-meta": ["set-meta", str(files["gguf"]), "general.name=x", "--dry-run"],
        "quantize": ["quantize", str(files["gguf"]), "--type", "q8_0", "--dry-run"],
        "convert": ["convert", "--list"],
        "ppl": ["ppl", str(files["eval"]), "--tokens", str(files["tokens"]), "--ctx", "32", "--device", "cpu"],
        "imatrix": ["imatrix", "--in-file", str(files["imatrix"]), "-o", str(files["dir"] / "copy.gguf")],
        "demo": [],  # tests/test_demo.py runs it with --json and checks "ok"
        "release": [],  # tests/test_release.py runs it with --json and checks its document
    }


@pytest.mark.parametrize("command", list(COMMANDS))
def test_success_document_starts_with_ok_true(files, command):
    args = _success_args(files)[command]
    if not args:
        return
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.stderr
    assert one_document(r.stdout)["ok"] is True


#: A usage error per command that click itself detects before the command runs.
_MISSING = {"info": ["info"], "verify": ["verify"], "set-meta": ["set-meta"], "quantize": ["quantize"],
            "convert": ["convert"], "ppl": ["ppl"], "imatrix": ["imatrix"], "demo": ["demo", "--steps", "-1"],
            "release": ["release"]}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_unknown_option_prints_the_error_document(files, command):
    r = invoke(command, "--no-such-option", "--json")
    assert_error_document(r.stdout, r.exit_code, 2, "--no-such-option")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_missing_argument_or_bad_value_prints_the_error_document(files, command):
    r = invoke(*_MISSING[command], "--json")
    assert_error_document(r.stdout, r.exit_code, 2, "")
    assert r.stderr.strip()  # click's usage message stays on stderr


def test_usage_error_without_json_prints_nothing_on_stdout(files):
    r = invoke("info", "--no-such-option")
    assert r.exit_code == 2 and r.stdout == "" and "No such option" in r.stderr


def test_bad_input_prints_the_error_document(files):
    r = invoke("info", str(files["junk"]), "--json")
    assert_error_document(r.stdout, r.exit_code, 2, "magic")


def test_failed_gate_prints_the_result_with_ok_false(files):
    r = invoke("ppl", str(files["eval"]), "--tokens", str(files["tokens"]), "--ctx", "32", "--device", "cpu",
               "--max-ppl", "1", "--json")
    doc = one_document(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False and doc["gates"]["failures"]
    assert "passed" not in doc["gates"]  # one name for success: ok


def test_invalid_file_in_verify_prints_the_result_with_ok_false(files, tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray(files["gguf"].read_bytes())
    bad.write_bytes(bytes(data[: len(data) - 100]))  # tensor data cut short: the header still parses
    r = invoke("verify", str(bad), "--json")
    doc = one_document(r.stdout)
    assert r.exit_code == 2 and doc["ok"] is False
