"""The writer: gguf-split shards, byte determinism, atomicity, the slack key, and loading in llama.cpp."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf_builders import write_model
from llama_cpp_sources import vocab_dir

from ggufkit.constants import DEFAULT_SLACK_BYTES, KEY_SLACK
from ggufkit.errors import GGUFFormatError, GGUFKitError, UsageError
from ggufkit.format import GGUFFile, Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.format.values import VT


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_inputs_give_identical_bytes(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf")
    b = write_model(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()


def test_tensor_data_is_packed_and_padded_as_llama_cpp_requires(tmp_path: Path) -> None:
    specs = [TensorSpec("x", GGMLQuantizationType.F32, (3,)), TensorSpec("y", GGMLQuantizationType.F16, (5,))]
    path = tmp_path / "p.gguf"
    write_gguf(path, Metadata(), specs, [np.ones(3, np.float32), np.ones(5, np.float16)], slack_bytes=0)
    with GGUFFile(path) as f:
        assert [t.offset for t in f.tensors] == [0, 32]
        assert f.data_offset % 32 == 0 and f.file_size == f.data_offset + 64


def test_slack_key_follows_the_general_keys_and_is_documented_size(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf")
    with GGUFFile(path) as f:
        keys = list(f.kv)
        assert keys[:3] == ["general.architecture", "general.name", KEY_SLACK]
        assert f.kv[KEY_SLACK].type == VT.STRING and f.kv[KEY_SLACK].value == " " * DEFAULT_SLACK_BYTES
    no_slack = write_model(tmp_path / "n.gguf", slack_bytes=0)
    with GGUFFile(no_slack) as f:
        assert KEY_SLACK not in f.kv


def _failing_data(n_good: int) -> Iterator[np.ndarray]:
    for _ in range(n_good):
        yield np.zeros((4, 64), np.float32)
    raise RuntimeError("producer failed")


def test_exception_mid_stream_leaves_the_target_untouched_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    target.write_bytes(b"previous contents")
    specs = [TensorSpec(f"t{i}", GGMLQuantizationType.F32, (4, 64)) for i in range(3)]
    with pytest.raises(RuntimeError, match="producer failed"):
        write_gguf(target, Metadata(), specs, _failing_data(2))
    assert target.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


_FSIZE_PROBE = """
import resource, signal, sys
import numpy as np
from gguf import GGMLQuantizationType
from ggufkit.format import Metadata, TensorSpec, write_gguf
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
specs = [TensorSpec(f"t{i}", GGMLQuantizationType.F32, (256, 256)) for i in range(8)]  # 256 KiB each
try:
    write_gguf(sys.argv[1], Metadata(), specs, (np.ones((256, 256), np.float32) for _ in range(8)))
except OSError as exc:
    print("OSError", exc.errno)
"""


def test_a_failing_tensor_write_is_raised_and_leaves_the_target_untouched(tmp_path: Path) -> None:
    # Tensor bytes are written by a helper thread (writer.py, _write_tensor): its error must reach the caller
    # and undo the write like any other. A real failure: the file size limit (RLIMIT_FSIZE) is hit mid-file.
    import errno
    import subprocess
    import sys

    target = tmp_path / "m.gguf"
    target.write_bytes(b"previous contents")
    run = subprocess.run([sys.executable, "-c", _FSIZE_PROBE, str(target)], capture_output=True, text=True,
                         check=True)
    assert run.stdout.split() == ["OSError", str(errno.EFBIG)], run.stdout + run.stderr
    assert target.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_wrong_data_size_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    specs = [TensorSpec("t", GGMLQuantizationType.F32, (4, 64))]
    with pytest.raises(GGUFKitError, match="got 4 bytes of data, expected 1024"):
        write_gguf(tmp_path / "m.gguf", Metadata(), specs, [b"abcd"])
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_what_readers_would_reject(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="ggml allows at most 63"):
        TensorSpec("n" * 64, GGMLQuantizationType.F32, (4,))
    with pytest.raises(UsageError, match="not a multiple of the Q4_0 block size 32"):
        TensorSpec("q", GGMLQuantizationType.Q4_0, (4, 48))
    meta = Metadata()
    meta.set("general.alignment", VT.UINT32, 48)
    with pytest.raises(UsageError, match="not a power of two"):
        write_gguf(tmp_path / "m.gguf", meta, [], [])


def test_shards_follow_gguf_split_layout_and_open_as_one_model(tmp_path: Path) -> None:
    written = write_model(tmp_path / "model.gguf", n_tensors=5, split_max_tensors=2)
    paths = sorted(tmp_path.iterdir())
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert not written.exists()
    (tmp_path / "single").mkdir()
    whole = write_model(tmp_path / "single" / "model.gguf", n_tensors=5)
    for i, p in enumerate(paths):
        r = gguf.GGUFReader(p)
        assert r.fields["split.no"].contents() == i and r.fields["split.no"].types == [VT.UINT16]
        assert r.fields["split.count"].contents() == 3 and r.fields["split.count"].types == [VT.UINT16]
        assert r.fields["split.tensors.count"].contents() == 5
        assert r.fields["split.tensors.count"].types == [VT.INT32]
        assert ("general.architecture" in r.fields) == (i == 0)
    for start in (paths[0], paths[2]):  # any shard opens the whole set
        with open_gguf(start) as model, open_gguf(whole) as ref:
            assert model.path == paths[0] and len(model.files) == 3
            assert [t.name for t in model.tensors] == [t.name for t in ref.tensors]
            assert [t.shard for t in model.tensors] == [0, 0, 1, 1, 2]
            for t in model.tensors:
                assert bytes(model.raw(t)) == bytes(ref.raw(ref[t.name]))
            assert model.get("general.name") == "tiny"


def test_split_max_size_starts_a_new_shard_before_the_limit(tmp_path: Path) -> None:
    # each tensor is 4*64*4 = 1024 bytes: a 2500-byte limit holds two per shard
    write_model(tmp_path / "m.gguf", n_tensors=5, split_max_size=2500)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]


def test_incomplete_shard_set_is_a_format_error(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf", n_tensors=4, split_max_tensors=2)
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GGUFFormatError, match="shard 2 of 2 is missing"):
        open_gguf(tmp_path / "m-00001-of-00002.gguf")


def _vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    base = vocab_dir() / name
    texts = (base.parent / (name + ".inp")).read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    outs = (base.parent / (name + ".out")).read_text(encoding="utf-8").split("\n")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def test_vocab_only_file_written_by_ggufkit_loads_and_tokenizes_in_llama_cpp(tmp_path: Path) -> None:
    import llama_cpp

    name = "ggml-vocab-llama-spm.gguf"
    out = tmp_path / "vocab.gguf"
    with GGUFFile(vocab_dir() / name) as src:
        write_gguf(out, Metadata((kv.key, kv) for kv in src.iter_kv()), [], [])
    with GGUFFile(out) as f:
        assert KEY_SLACK in f.kv  # llama.cpp must tolerate ggufkit's reserved key
    llm = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    cases = _vocab_tests(name)
    assert len(cases) > 30
    for text, expected in cases:
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) == expected, text
    del llm


def _pending_model(tmp_path: Path, name: str, final: str, placeholder: str) -> Path:
    """A two-tensor file whose string KV is computed while the data is written (finished after the last tensor)."""
    from concurrent.futures import Future

    from ggufkit.format.values import PendingString

    result: Future[str] = Future()
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.put("ggufkit.source.sha256", PendingString(placeholder, result))
    meta.set("general.name", VT.STRING, "after")
    specs = [TensorSpec("x", GGMLQuantizationType.F32, (300,)), TensorSpec("y", GGMLQuantizationType.F16, (7,))]

    def data() -> Iterator[np.ndarray]:
        yield np.arange(300, dtype=np.float32)
        yield np.ones(7, np.float16)
        result.set_result(final)  # known only once every tensor has been produced

    path = tmp_path / name
    write_gguf(path, meta, specs, data())
    return path


def test_a_pending_value_is_written_into_the_header_once_known(tmp_path: Path) -> None:
    final = "ab" * 32 + "  model.safetensors"
    late = _pending_model(tmp_path, "late.gguf", final, "0" * 64 + "  model.safetensors")
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.set("ggufkit.source.sha256", VT.STRING, final)
    meta.set("general.name", VT.STRING, "after")
    specs = [TensorSpec("x", GGMLQuantizationType.F32, (300,)), TensorSpec("y", GGMLQuantizationType.F16, (7,))]
    known = tmp_path / "known.gguf"
    write_gguf(known, meta, specs, [np.arange(300, dtype=np.float32), np.ones(7, np.float16)])
    assert late.read_bytes() == known.read_bytes()  # as if the value had been known from the start
    with open_gguf(late) as m:
        assert m.get("ggufkit.source.sha256") == final and m.get("general.name") == "after"


def test_a_pending_value_of_another_length_fails_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(GGUFKitError, match="placeholder's length"):
        _pending_model(tmp_path, "bad.gguf", "short", "0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_a_pending_value_finished_after_the_last_tensor_is_waited_for(tmp_path: Path) -> None:
    """The race of issue 35: a hash still running when the last tensor is written must not leave its
    placeholder in the file (the writer waits for it before rewriting the header)."""
    import threading
    from concurrent.futures import Future

    from ggufkit.format.values import PendingString

    final = "cd" * 32 + "  model.safetensors"
    result: Future[str] = Future()
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.put("ggufkit.source.sha256", PendingString("0" * 64 + "  model.safetensors", result))
    timer = threading.Timer(0.3, result.set_result, args=(final,))  # finishes well after the data is written
    timer.start()
    path = tmp_path / "slow.gguf"
    write_gguf(path, meta, [TensorSpec("x", GGMLQuantizationType.F32, (4,))], [np.zeros(4, np.float32)])
    timer.join()
    with open_gguf(path) as m:
        assert m.get("ggufkit.source.sha256") == final
