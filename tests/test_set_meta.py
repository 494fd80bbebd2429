"""`ggufkit set-meta`: typing rules, in place vs rewrite, tensor bytes unchanged, kill safety, shard sets.

gguf-py's GGUFReader is the independent oracle for what ends up in the file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import invoke
from gguf_builders import write_model
from llama_cpp_sources import vocab_dir

from ggufkit.constants import DEFAULT_SLACK_BYTES, KEY_SLACK
from ggufkit.errors import MetadataKeyNotFoundError, MetadataValueError, UsageError
from ggufkit.format import GGUFFile
from ggufkit.format.values import VT
from ggufkit.metadata_edit import PATCH_PAGE, edit_metadata
from ggufkit.verify import verify

REPO = Path(__file__).resolve().parents[1]


def _set_meta(*args: str) -> tuple[int, dict, str]:
    result = invoke("set-meta", *args, "--json")
    return result.exit_code, json.loads(result.stdout), result.stderr


def _fields(path: Path) -> dict[str, tuple[list[int], object]]:
    reader = gguf.GGUFReader(path)
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _hashes(path: Path) -> dict[str, str]:
    report = verify(path, hash_tensors=True)
    assert report.ok, report.problems
    assert report.tensor_sha256 is not None
    return report.tensor_sha256


def _offsets(path: Path) -> tuple[int, list[int]]:
    with GGUFFile(path) as f:
        return f.data_offset, [t.offset for t in f.tensors]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "m.gguf")


def test_longer_general_name_on_a_ggufkit_file_is_edited_in_place(model: Path) -> None:
    before, size, layout, hashes = model.read_bytes(), model.stat().st_size, _offsets(model), _hashes(model)
    code, data, _ = _set_meta(str(model), "general.name=A considerably longer model name, v2")
    assert code == 0 and data["mode"] == "in_place"
    assert data["changes"] == [{"op": "set", "key": "general.name", "new_key": None, "old_type": "str",
                                "new_type": "str", "old": "tiny", "new": "A considerably longer model name, v2"}]
    assert model.stat().st_size == size and _offsets(model) == layout and _hashes(model) == hashes
    assert _fields(model)["general.name"] == ([VT.STRING], "A considerably longer model name, v2")
    # kill safety rests on the patch lying inside one page: check the bytes that changed
    after = model.read_bytes()
    changed = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8))
    assert changed[0] // PATCH_PAGE == changed[-1] // PATCH_PAGE
    assert data["slack_bytes"]["new"] == DEFAULT_SLACK_BYTES - (len("A considerably longer model name, v2") - 4)


@pytest.mark.parametrize("type_name, text, vtype, expected", [
    ("u8", "255", VT.UINT8, 255), ("i8", "-128", VT.INT8, -128), ("u16", "65535", VT.UINT16, 65535),
    ("i16", "-2", VT.INT16, -2), ("u32", "4294967295", VT.UINT32, 4294967295), ("i32", "-7", VT.INT32, -7),
    ("u64", "18446744073709551615", VT.UINT64, 2**64 - 1), ("i64", "-9223372036854775808", VT.INT64, -(2**63)),
    ("f32", "0.5", VT.FLOAT32, 0.5), ("f64", "1e300", VT.FLOAT64, 1e300), ("bool", "false", VT.BOOL, False),
    ("bool", "1", VT.BOOL, True), ("str", "42", VT.STRING, "42"),
])
def test_every_scalar_type_can_be_set_with_type(model: Path, type_name: str, text: str, vtype: VT,
                                                 expected: object) -> None:
    code, _, _ = _set_meta(str(model), f"x.key={text}", "--type", f"x.key={type_name}")
    assert code == 0
    assert _fields(model)["x.key"] == ([vtype], expected)


@pytest.mark.parametrize("item, text, expected", [
    ("u8", "[1, 2]", [1, 2]), ("i8", "[-1]", [-1]), ("u16", "[3]", [3]), ("i16", "[-3]", [-3]),
    ("u32", "[4, 5]", [4, 5]), ("i32", "[-4]", [-4]), ("u64", "[18446744073709551615]", [2**64 - 1]),
    ("i64", "[-5]", [-5]), ("f32", "[0.25, 1]", [0.25, 1.0]), ("f64", "[0.1]", [0.1]),
    ("bool", "[true, false]", [True, False]), ("str", '["a", "é"]', ["a", "é"]),
])
def test_every_array_type_can_be_set_with_type(model: Path, item: str, text: str, expected: list) -> None:
    code, _, _ = _set_meta(str(model), f"x.arr={text}", "--type", f"x.arr=array[{item}]")
    assert code == 0
    types, value = _fields(model)["x.arr"]
    assert types == [VT.ARRAY, VT.UINT8 if item == "u8" else gguf.GGUFValueType[_VT_NAMES[item]]]
    assert value == expected


_VT_NAMES = {"i8": "INT8", "u16": "UINT16", "i16": "INT16", "u32": "UINT32", "i32": "INT32", "u64": "UINT64",
             "i64": "INT64", "f32": "FLOAT32", "f64": "FLOAT64", "bool": "BOOL", "str": "STRING", "u8": "UINT8"}


@pytest.mark.parametrize("text, vtype, expected", [
    ("5", [VT.UINT32], 5), ("-5", [VT.INT32], -5), ("5000000000", [VT.UINT64], 5000000000),
    ("1.5", [VT.FLOAT32], 1.5), ("2e3", [VT.FLOAT32], 2000.0), ("true", [VT.BOOL], True),
    ("[1, -2]", [VT.ARRAY, VT.INT32], [1, -2]), ('["a", "b"]', [VT.ARRAY, VT.STRING], ["a", "b"]),
    ("[0.5, 1]", [VT.ARRAY, VT.FLOAT32], [0.5, 1.0]), ("hello world", [VT.STRING], "hello world"),
    ("[not json", [VT.STRING], "[not json"), ("nan", [VT.STRING], "nan"),
])
def test_new_key_types_are_inferred_by_the_documented_rules(model: Path, text: str, vtype: list, expected: object) -> None:
    code, data, _ = _set_meta(str(model), f"x.new={text}")
    assert code == 0 and data["changes"][0]["op"] == "add"
    assert _fields(model)["x.new"] == (vtype, expected)


def test_well_known_and_existing_keys_keep_llama_cpp_types(model: Path) -> None:
    code, _, _ = _set_meta(str(model), "tokenizer.ggml.eos_token_id=1", "llama.context_length=4096",
                           "llama.rope.freq_base=10000")
    assert code == 0
    fields = _fields(model)
    assert fields["tokenizer.ggml.eos_token_id"] == ([VT.UINT32], 1)
    assert fields["llama.context_length"] == ([VT.UINT32], 4096)
    assert fields["llama.rope.freq_base"] == ([VT.FLOAT32], 10000.0)


def test_type_option_changes_the_type_of_an_existing_key(model: Path) -> None:
    code, _, _ = _set_meta(str(model), "llama.context_length=4096", "--type", "llama.context_length=u64")
    assert code == 0 and _fields(model)["llama.context_length"] == ([VT.UINT64], 4096)


@pytest.mark.parametrize("args, message", [
    (["llama.context_length=-1"], "-1 is out of range for u32"),
    (["x.b=yes", "--type", "x.b=bool"], "'yes' is not a bool: use true, false, 1 or 0"),
    (["x.b=", "--type", "x.b=bool"], "is not a bool"),
    (["llama.context_length=12.5"], "'12.5' is not an integer for u32"),
    (["x.a=[1, \"a\"]"], "mixed array items"),
    (["x.a=1", "--type", "x.a=u128"], "unknown type 'u128'"),
    (["tokenizer.ggml.tokens=[1]"], "1 is not a valid str"),
    (["split.count=3"], "managed by the shard layout"),
    (["ggufkit.slack=x"], "reserved by ggufkit"),
    (["general.alignment=48"], "48 is not a power of two"),
    (["--delete", "no.such.key"], "metadata key 'no.such.key' not found"),
    (["--rename", "general.name=general.architecture"], "already exists"),
    (["general.name=x", "--delete", "general.name"], "given more than once"),
    (["x=1", "--type", "y=u32"], "--type given for 'y'"),
])
def test_bad_requests_exit_2_with_one_line_and_leave_the_file_alone(model: Path, args: list[str],
                                                                     message: str) -> None:
    before = model.read_bytes()
    result = invoke("set-meta", str(model), *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert model.read_bytes() == before


def test_bool_false_is_false_unlike_gguf_set_metadata(model: Path) -> None:
    for text, expected in (("false", False), ("0", False), ("TRUE", True), ("1", True)):
        assert _set_meta(str(model), f"x.flag={text}", "--type", "x.flag=bool")[0] == 0
        assert _fields(model)["x.flag"] == ([VT.BOOL], expected)


def test_dry_run_shows_the_diff_and_changes_nothing(model: Path) -> None:
    before = model.read_bytes()
    code, data, _ = _set_meta(str(model), "general.name=new", "--delete", "llama.context_length", "--dry-run")
    # the deleted key lies after the 4 KiB slack, so the change spans two pages: a rewrite would be needed
    assert code == 0 and data["dry_run"] is True and data["mode"] == "rewrite" and "page" in data["reason"]
    assert {(c["op"], c["key"], c["old"], c["new"]) for c in data["changes"]} == {
        ("set", "general.name", "tiny", "new"), ("delete", "llama.context_length", 128, None)}
    assert model.read_bytes() == before
    human = invoke("set-meta", str(model), "general.name=new", "--dry-run")
    assert '~ general.name: "tiny" (str) -> "new" (str)' in human.stdout and "dry run" in human.stdout


def test_unchanged_value_writes_nothing(model: Path) -> None:
    before = os.stat(model).st_mtime_ns
    code, data, _ = _set_meta(str(model), "general.name=tiny")
    assert code == 0 and data["mode"] == "unchanged" and data["changes"] == []
    assert os.stat(model).st_mtime_ns == before


def test_delete_and_rename_keep_other_keys_in_order(model: Path) -> None:
    hashes = _hashes(model)
    code, data, _ = _set_meta(str(model), "--delete", "llama.context_length", "--rename",
                              "tokenizer.ggml.bos_token_id=tokenizer.ggml.eos_token_id")
    assert code == 0
    keys = list(_fields(model))
    assert "llama.context_length" not in keys
    assert keys.index("tokenizer.ggml.eos_token_id") == keys.index("tokenizer.ggml.tokens") + 1
    assert _hashes(model) == hashes
    code, data, _ = _set_meta(str(model), "--delete", "general.name")  # before the slack: in place
    assert code == 0 and data["mode"] == "in_place" and "general.name" not in _fields(model)


def test_header_growth_beyond_the_slack_rewrites_with_identical_tensors(model: Path) -> None:
    hashes = _hashes(model)
    long_text = "x" * (3 * DEFAULT_SLACK_BYTES)
    code, data, _ = _set_meta(str(model), f"general.description={long_text}")
    assert code == 0 and data["mode"] == "rewrite"
    assert _hashes(model) == hashes
    assert _fields(model)["general.description"] == ([VT.STRING], long_text)
    with GGUFFile(model) as f:
        assert len(f.kv[KEY_SLACK].value) == DEFAULT_SLACK_BYTES  # refilled for the next edit
    assert not [p for p in model.parent.iterdir() if p.name != model.name]


def test_file_without_slack_is_rewritten_once_then_edited_in_place(tmp_path: Path) -> None:
    path = tmp_path / "gguf_py.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("from gguf-py")
    w.add_context_length(64)
    w.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hashes = _hashes(path)
    code, data, _ = _set_meta(str(path), "general.name=renamed by ggufkit")
    assert code == 0 and data["mode"] == "rewrite" and data["slack_bytes"]["new"] == DEFAULT_SLACK_BYTES
    assert _hashes(path) == hashes
    code, data, _ = _set_meta(str(path), "general.name=renamed again, and in place")
    assert code == 0 and data["mode"] == "in_place"
    assert _fields(path)["general.name"] == ([VT.STRING], "renamed again, and in place")
    np.testing.assert_array_equal(gguf.GGUFReader(path).tensors[0].data.reshape(-1), np.arange(64))


def test_output_option_leaves_the_input_untouched(model: Path) -> None:
    before = model.read_bytes()
    out = model.with_name("out.gguf")
    code, data, _ = _set_meta(str(model), "general.name=copy", "-o", str(out))
    assert code == 0 and data["mode"] == "rewrite" and data["output"] == str(out)
    assert model.read_bytes() == before
    assert _fields(out)["general.name"] == ([VT.STRING], "copy") and _hashes(out) == _hashes(model)


def test_output_equal_to_input_edits_in_place_and_never_destroys_the_file(model: Path) -> None:
    hashes = _hashes(model)
    same = model.parent / "." / model.name
    code, data, _ = _set_meta(str(model), "general.name=same path", "-o", str(same))
    assert code == 0 and data["mode"] == "in_place"
    assert _hashes(model) == hashes and _fields(model)["general.name"] == ([VT.STRING], "same path")
    code, data, _ = _set_meta(str(model), f"general.description={'d' * 9000}", "-o", str(model))
    assert code == 0 and data["mode"] == "rewrite"
    assert _hashes(model) == hashes


def test_alignment_change_relays_the_data_out(model: Path) -> None:
    hashes = _hashes(model)
    code, data, _ = _set_meta(str(model), "general.alignment=64")
    assert code == 0 and data["mode"] == "rewrite"
    assert _hashes(model) == hashes
    reader = gguf.GGUFReader(model)
    assert reader.alignment == 64 and all(t.data_offset % 64 == 0 for t in reader.tensors)


def test_chat_template_file_is_linted_in_a_sandbox_and_set(model: Path, tmp_path: Path) -> None:
    good = tmp_path / "chat.jinja"
    good.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% if loop.last %}{% break %}"
                    "{% endif %}{% endfor %}", encoding="utf-8")
    code, _, _ = _set_meta(str(model), "--chat-template-file", str(good))
    assert code == 0 and _fields(model)["tokenizer.chat_template"] == ([VT.STRING], good.read_text())
    # A template that would run a command if rendered unsandboxed: parsing it executes nothing.
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}", encoding="utf-8")
    assert _set_meta(str(model), "--chat-template-file", str(evil))[0] == 0
    assert not marker.exists()


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m }}", "chat template does not parse"),
    ("{% generation %}{{ x }}{% endgeneration %}", "Encountered unknown tag 'generation'"),
])
def test_chat_template_that_does_not_parse_is_refused(model: Path, tmp_path: Path, template: str, message: str) -> None:
    path = tmp_path / "bad.jinja"
    path.write_text(template, encoding="utf-8")
    result = invoke("set-meta", str(model), "--chat-template-file", str(path))
    assert result.exit_code == 2 and message in result.stderr


def test_from_json_sets_typed_and_inferred_values(model: Path, tmp_path: Path) -> None:
    edits = tmp_path / "edits.json"
    edits.write_text(json.dumps({"general.name": "from json", "x.count": 3, "x.big": {"type": "u64", "value": 7},
                                 "x.ratio": 0.25, "x.flags": [True, False], "x.names": ["a", "b"]}))
    code, _, _ = _set_meta(str(model), "--from-json", str(edits))
    assert code == 0
    fields = _fields(model)
    assert fields["general.name"] == ([VT.STRING], "from json")
    assert fields["x.count"] == ([VT.UINT32], 3) and fields["x.big"] == ([VT.UINT64], 7)
    assert fields["x.ratio"] == ([VT.FLOAT32], 0.25)
    assert fields["x.flags"] == ([VT.ARRAY, VT.BOOL], [True, False])
    assert fields["x.names"] == ([VT.ARRAY, VT.STRING], ["a", "b"])


def test_shard_set_metadata_is_edited_in_shard_1_only(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf", n_tensors=4, split_max_tensors=2)
    first, second = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    second_before = second.read_bytes()
    hashes = _hashes(first)
    code, data, _ = _set_meta(str(second), "general.name=sharded")
    assert code == 0 and data["path"] == str(first)
    assert second.read_bytes() == second_before
    assert _fields(first)["general.name"] == ([VT.STRING], "sharded")
    assert _hashes(second) == hashes  # opens the whole set from shard 2
    code, data, _ = _set_meta(str(first), f"general.description={'d' * 9000}")  # too big: rewrite of shard 1
    assert code == 0 and data["mode"] == "rewrite"
    assert second.read_bytes() == second_before and _hashes(second) == hashes
    assert _fields(first)["split.count"] == ([VT.UINT16], 2)
    with pytest.raises(UsageError, match="managed by the shard layout"):
        edit_metadata(first, delete=["split.no"])


def test_library_errors_are_typed(model: Path) -> None:
    with pytest.raises(MetadataKeyNotFoundError):
        edit_metadata(model, rename={"nope": "x"})
    with pytest.raises(MetadataValueError, match=r"general\.name"):
        edit_metadata(model, set_values={"general.name": 5})


def test_llama_cpp_loads_a_vocabulary_after_rewrite_and_in_place_edits(tmp_path: Path) -> None:
    import llama_cpp

    path = tmp_path / "vocab.gguf"
    shutil.copyfile(vocab_dir() / "ggml-vocab-llama-spm.gguf", path)
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    modes = []
    for args in (["general.name=edited vocab", f"tokenizer.chat_template={template}"],
                 ["general.name=edited in place"]):
        code, data, _ = _set_meta(str(path), *args)
        assert code == 0
        modes.append(data["mode"])
    assert modes == ["rewrite", "in_place"]
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert llm.metadata["general.name"] == "edited in place"
    assert llm.metadata["tokenizer.chat_template"] == template
    assert llm.tokenize(b"Hello world", add_bos=False) == [15043, 3186]


_KILL_SCRIPT = """
import os, signal, sys
from ggufkit.metadata_edit import edit_metadata

class KillAfterFirstChunk:
    # Stands in for a kill -9 arriving in the middle of the tensor copy.
    def begin(self, total, unit, desc): pass
    def advance(self, n): os.kill(os.getpid(), signal.SIGKILL)
    def end(self): pass

edit_metadata(sys.argv[1], set_text={"general.description": "d" * 20000}, progress=KillAfterFirstChunk())
"""


def test_sigkill_during_a_rewrite_leaves_the_original_and_the_next_run_removes_the_temporary(model: Path) -> None:
    before = model.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(model)], cwd=REPO, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert model.read_bytes() == before
    strays = [p for p in model.parent.iterdir() if p.name != model.name]
    assert len(strays) == 1 and strays[0].name.endswith(".ggufkit-part")
    code, data, _ = _set_meta(str(model), "general.name=after the crash")
    assert code == 0 and data["mode"] == "in_place"
    assert [p.name for p in model.parent.iterdir()] == [model.name]
