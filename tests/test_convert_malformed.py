"""A sweep of malformed checkpoints through ``ggufkit convert``: each is refused with one line on stderr,
exit 2, no output file and no traceback (run_cli re-raises anything that is not a known error, so a bug
fails the test with its traceback).

Regression: a LLaMA checkpoint whose config.json says hidden_size 96 while its tensors are 64 wide was
converted into a file llama.cpp refuses to load; the plan now checks every tensor's shape against the
hyperparameters it writes, before anything is written.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_models import make_checkpoint

from ggufkit.cli import cli
from ggufkit.cli._errors import run_cli


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("base"), "LlamaForCausalLM")


def _config(d: Path, **changes: object) -> None:
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


def _header(d: Path) -> tuple[int, dict]:
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _drop_tensor(d: Path, name: str) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(d / "model.safetensors"))


def _garbage_header(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:8] + b"\x00\xff{not json" + data[18:])


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])


def _huge_header_length(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _empty(d: Path) -> None:
    for p in d.iterdir():
        p.unlink()


#: case -> (how to break a copy of the checkpoint, text the one-line error must contain)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing config.json": (lambda d: (d / "config.json").unlink(), "config.json not found"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{'hidden_size': 64,"),
                             "config.json is unreadable"),
    "config.json not an object": (lambda d: (d / "config.json").write_text("[1, 2]"), "not a JSON object"),
    "unknown architecture": (lambda d: _config(d, architectures=["BertModel"]), "'BertModel' is not supported"),
    "missing architectures": (lambda d: _config(d, architectures=None), "no 'architectures' list"),
    "empty architectures": (lambda d: _config(d, architectures=[]), "no 'architectures' list"),
    "hidden_size 96 vs 64-wide tensors": (lambda d: _config(d, hidden_size=96),
                                          "has shape [320, 64], llama.cpp expects [320, 96] from"),
    "intermediate_size disagrees": (lambda d: _config(d, intermediate_size=192),
                                    "feed_forward_length=192"),
    "head_dim disagrees": (lambda d: _config(d, head_dim=32), "has shape [32, 64], llama.cpp expects [64, 64]"),
    "num_key_value_heads disagrees": (lambda d: _config(d, num_key_value_heads=4),
                                      "head_count_kv*head_dim=4*16"),
    "safetensors header garbage": (_garbage_header, "safetensors header is not JSON"),
    "safetensors data truncated": (_truncate, "lies outside the file"),
    "safetensors header length impossible": (_huge_header_length, "safetensors header length"),
    "missing tensor": (lambda d: _drop_tensor(d, "model.layers.1.mlp.up_proj.weight"),
                       "missing source tensors for blk.1.ffn_up.weight"),
    "missing token embedding": (lambda d: _drop_tensor(d, "model.embed_tokens.weight"), "no token embedding"),
    "no weight files": (lambda d: (d / "model.safetensors").unlink(), "no weight files"),
    "empty directory": (_empty, "config.json not found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_is_one_line_exit_2_and_writes_nothing(case: str, base: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    breaker, message = CASES[case]
    d = tmp_path / "ckpt"
    shutil.copytree(base, d)
    breaker(d)
    out = tmp_path / "out"
    out.mkdir()
    code = run_cli(cli, ["convert", str(d), "-o", str(out / "m.gguf")])  # --check is on by default
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.startswith("ggufkit: error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert list(out.iterdir()) == [] and not list(d.glob("*.gguf"))


def test_nonexistent_path_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(cli, ["convert", str(tmp_path / "no" / "such" / "dir"), "-o", str(tmp_path / "m.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no such directory" in err
    assert not list(tmp_path.iterdir())


def test_shape_error_names_tensor_expected_and_found_shape(base: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(base, d)
    _config(d, intermediate_size=192)
    assert run_cli(cli, ["convert", str(d), "--no-check", "-o", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("ggufkit: error: config.json disagrees with the weights: model.layers.0.mlp.down_proj.weight "
                   "(blk.0.ffn_down.weight) has shape [64, 128], llama.cpp expects [64, 192] from "
                   "embedding_length=64, feed_forward_length=192")
