"""Gaps of `ggufkit release` found in issue #32: `--matrix` without an OUTDIR, and fan-out jobs that take the
checkpoint's hashes from the shared job instead of reading the whole checkpoint again. (MIX@ entries on a master
with MXFP4 experts, once refused here, are released: tests/test_release_mix_mxfp4.py.)"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
from cli_helpers import invoke

ARGS = ["--types", "q8_0", "--no-imatrix", "--ctx", "32", "--chunks", "1", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fixtures_models as fm

    d = tmp_path_factory.mktemp("ck") / "tiny-llama"
    fm.make_checkpoint(d, "LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       max_position_embeddings=128)
    return d


def test_matrix_needs_no_outdir_and_prints_the_same_matrix(checkpoint: Path, tmp_path: Path) -> None:
    with_o = invoke("release", str(checkpoint), "-o", str(tmp_path / "out"), *ARGS, "--matrix")
    without = invoke("release", str(checkpoint), *ARGS, "--matrix")
    assert with_o.exit_code == 0 and without.exit_code == 0, (with_o.stderr, without.stderr)
    assert without.stdout == with_o.stdout == '{"include":[{"type":"Q8_0"}]}\n'
    assert not (tmp_path / "out").exists()
    # every other release writes: -o stays required there, refused in one line with exit 2
    r = invoke("release", str(checkpoint), *ARGS, "--dry-run")
    assert r.exit_code == 2 and "-o/--outdir" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _garble_tensor_bytes(ck: Path) -> None:
    """Overwrite every tensor byte of the shard, keeping its size and mtime: a job that hashed the checkpoint
    again would see another checkpoint; one that trusts the shared job's hashes does not read these bytes."""
    shard = ck / "model.safetensors"
    st = shard.stat()
    with shard.open("r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        data = f.read()
        f.seek(8 + n)
        f.write(bytes(b ^ 0x5A for b in data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy(src: Path, dst: Path, keep_times: bool) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copy2 if keep_times else shutil.copy)
    return dst


def test_only_jobs_take_the_checkpoint_hashes_from_the_shared_job(checkpoint: Path, tmp_path: Path) -> None:
    xchg = tmp_path / "x"
    shared = invoke("release", str(checkpoint), "-o", str(tmp_path / "shared"), *ARGS, "--shared-only",
                    "--exchange", str(xchg))
    assert shared.exit_code == 0, shared.stderr
    recorded = json.loads((xchg / "shared.json").read_text())["checkpoint"]
    assert recorded["model.safetensors"]["size"] == (checkpoint / "model.safetensors").stat().st_size

    # 1. another machine with the checkpoint's files as the shared job saw them (same names, sizes, mtimes:
    #    a shared disk, a cache restored with its times), whose tensor bytes are garbled: trusted, not reread
    same = _copy(checkpoint, tmp_path / "m1" / checkpoint.name, keep_times=True)
    _garble_tensor_bytes(same)
    one = invoke("release", str(same), "-o", str(tmp_path / "o1"), *ARGS, "--only", "q8_0", "--exchange", str(xchg))
    assert one.exit_code == 0, one.stderr
    part = (xchg / "part-Q8_0.json").read_bytes()

    # 2. a download of the same files from the hub (`hf download --local-dir`: new mtimes, and the hub's
    #    record of each file's sha256): trusted by the hub's sha256, the job's part is the same bytes
    hub = _copy(checkpoint, tmp_path / "m2" / checkpoint.name, keep_times=False)
    _garble_tensor_bytes(hub)
    sha = recorded["model.safetensors"]["sha256"]
    meta = hub / ".cache/huggingface/download/model.safetensors.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{'0' * 40}\n{sha}\n{time.time() + 5}\n")
    (xchg / "part-Q8_0.json").unlink()
    two = invoke("release", str(hub), "-o", str(tmp_path / "o2"), *ARGS, "--only", "q8_0", "--exchange", str(xchg))
    assert two.exit_code == 0, two.stderr
    assert (xchg / "part-Q8_0.json").read_bytes() == part
    (q8,) = (tmp_path / "o1").glob("*-Q8_0.gguf")
    assert (tmp_path / "o2" / q8.name).read_bytes() == q8.read_bytes()

    # 3. files whose mtimes changed with no hub record are hashed again: the garbled bytes are another checkpoint
    other = _copy(checkpoint, tmp_path / "m3" / checkpoint.name, keep_times=False)
    _garble_tensor_bytes(other)
    three = invoke("release", str(other), "-o", str(tmp_path / "o3"), *ARGS, "--only", "q8_0", "--exchange", str(xchg))
    assert three.exit_code == 2 and "another checkpoint" in three.stderr, three.stderr


def _bytes_read() -> int:
    """Bytes this process has read through read() system calls so far (Linux's /proc/self/io ``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="counts read() bytes through Linux's /proc/self/io")
def test_matrix_reads_no_tensor_bytes(tmp_path: Path) -> None:
    """`--matrix` needs the types alone: it lists the checkpoint's files and reads their headers, not the tensor
    bytes a release hashes (an hour for 700 GB; the shared job hashes them). Before, it hashed every file."""
    import fixtures_models as fm

    from ggufkit.release import release_matrix

    big = fm.make_checkpoint(tmp_path / "wide", "LlamaForCausalLM", hidden_size=512, intermediate_size=4096,
                             num_hidden_layers=2, max_position_embeddings=128)
    shard = (big / "model.safetensors").stat().st_size
    assert shard > 40 * 2**20
    # a first plan imports the converters and reads the tokenizer files (tens of MB): the second one is measured
    release_matrix(big, types=["q8_0"], no_imatrix=True, ctx=32, chunks=1)
    before = _bytes_read()
    assert release_matrix(big, types=["q8_0"], no_imatrix=True, ctx=32, chunks=1) == {"include": [{"type": "Q8_0"}]}
    assert _bytes_read() - before < shard // 4


def test_a_hub_cache_snapshot_is_known_by_its_blob_names(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint in huggingface_hub's cache (snapshots/REV/NAME -> blobs/SHA256 for LFS files), fetched on
    another machine (other mtimes): the shard is known by its blob's name; a file that is no LFS blob (a 40-digit
    git etag, or a plain copy) is hashed as before."""
    import hashlib

    from ggufkit.release.plan import file_hash
    from ggufkit.release.steps import SHARED, trust_shared_hashes

    recorded = {}
    snapshot, blobs = tmp_path / "hub/snapshots/abc123", tmp_path / "hub/blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for p in sorted(checkpoint.iterdir()):
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        recorded[p.name] = {"sha256": sha, "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns + 10**9}
        if p.name == "model.safetensors":
            shutil.copy(p, blobs / sha)
            (snapshot / p.name).symlink_to(Path("../../blobs") / sha)
        else:
            shutil.copy(p, snapshot / p.name)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / SHARED).write_text(json.dumps({"checkpoint": recorded}))
    cache: dict[str, dict[str, object]] = {}
    assert trust_shared_hashes(str(snapshot), cache, tmp_path / "x") == 1
    assert list(cache) == [str((snapshot / "model.safetensors").resolve())]
    # the blob's content is not what is trusted: its name is (the hub's address for it)
    (blobs / recorded["model.safetensors"]["sha256"]).write_bytes(b"\0" * recorded["model.safetensors"]["size"])
    os.utime(blobs / recorded["model.safetensors"]["sha256"], ns=(0, next(iter(cache.values()))["mtime_ns"]))
    assert file_hash(snapshot / "model.safetensors", cache)["sha256"] == recorded["model.safetensors"]["sha256"]
