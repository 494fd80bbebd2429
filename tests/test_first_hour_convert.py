"""First hour with ``ggufkit convert``, as a new publisher types it (issue 35): the provenance hash is right
every time, ``-o`` follows the shared output rules (a path ending in a separator is a folder; one
placeholder vocabulary), no output lands on a file the conversion reads, the model card's metadata reaches
``general.*``, a failed ``--check`` names the tokens, and a typo in ``--outtype`` gets a suggestion."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from cli_helpers import invoke
from fixtures_models import make_checkpoint

from ggufkit.constants import KEY_SOURCE_SHA256
from ggufkit.converters import convert
from ggufkit.format import open_gguf

README = """---
license: apache-2.0
base_model: meta-llama/Llama-3.2-1B
language:
- en
- fr
tags:
- text-generation
- llama
datasets:
- HuggingFaceFW/fineweb
---

# A tiny Llama
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("first-hour") / "tiny-llama", "LlamaForCausalLM")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}


# -- ggufkit.source.sha256 -------------------------------------------------------------------------------


class _AllWritten:
    """A progress sink that says when the writer has written every tensor byte."""

    def __init__(self) -> None:
        self.total = -1
        self.done = 0
        self.event = threading.Event()

    def begin(self, total: int, unit: str, desc: str) -> None:
        self.total, self.done = total, 0

    def advance(self, n: int) -> None:
        self.done += n
        if self.done >= self.total:
            self.event.set()

    def end(self) -> None:
        self.event.set()


def test_bf16_copy_records_the_real_sha256_even_when_the_hash_finishes_after_the_tensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The race of issue 35: a bf16 -> bf16 conversion copies bytes faster than the weight file hashes, and
    # the header kept the placeholder (64 zeros). Here the hash only starts once every tensor byte is written,
    # and takes a while more: the recorded hash must still be the file's.
    from ggufkit.converters import checkpoint

    d = make_checkpoint(tmp_path / "bf16", "LlamaForCausalLM", dtype="bfloat16")
    progress = _AllWritten()
    hash_file = checkpoint._hash_file

    def hash_after_the_tensors(file: Path, result: Future[str]) -> None:
        progress.event.wait()
        time.sleep(0.3)  # the writer's header rewrite would have run by now
        hash_file(file, result)

    monkeypatch.setattr(checkpoint, "_hash_file", hash_after_the_tensors)
    out = convert(d, tmp_path / "m.gguf", outtype="bf16", progress=progress).outputs[0]
    with open_gguf(out) as f:
        recorded = f.get(KEY_SOURCE_SHA256)
    assert recorded == f"{_sha256(d / 'model.safetensors')}  model.safetensors"


def test_sha256_of_every_shard_is_recorded_in_a_split_bf16_conversion(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "bf16", "LlamaForCausalLM", dtype="bfloat16")
    for run in range(3):  # the race showed in 2 of 5 runs: each run here must be right
        outs = convert(d, tmp_path / f"m{run}.gguf", outtype="bf16", split_max_size=40_000).outputs
        assert len(outs) > 1
        with open_gguf(outs[0]) as f:
            assert f.get(KEY_SOURCE_SHA256) == f"{_sha256(d / 'model.safetensors')}  model.safetensors"


# -- -o: folders, separators, templates -----------------------------------------------------------------


def test_output_ending_in_a_separator_for_a_missing_folder_is_refused(llama: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", str(llama), "-o", "missing-dir/", "--no-check")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "missing-dir/ does not exist" in result.stderr
    assert not os.path.exists("missing-dir")


def test_output_ending_in_a_separator_for_an_existing_folder_gets_the_default_name(
        llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    result = invoke("convert", str(llama), "-o", "out/", "--outtype", "f16", "--no-check", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outputs"] == [os.path.join("out", "tiny-llama-115K-F16.gguf")]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["tiny-llama-115K-F16.gguf"]


def test_templates_take_the_shared_placeholders_and_refuse_unknown_ones(llama: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", str(llama), "-o", "m-{type}-{TYPE}.gguf", "--outtype", "q8_0", "--no-check")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m-q8_0-Q8_0.gguf").is_file()
    result = invoke("convert", str(llama), "-o", "m-{typo}.gguf", "--no-check")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "unknown placeholder {typo}" in result.stderr and "{type}" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-q8_0-Q8_0.gguf"]


def test_convert_help_documents_the_placeholders() -> None:
    from ggufkit.outputs import TEMPLATE_HELP

    result = invoke("convert", "--help")
    assert " ".join(TEMPLATE_HELP.split()) in " ".join(result.stdout.split())


def test_mmproj_output_follows_the_same_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ggufkit.converters.mmproj import mmproj_output_path
    from ggufkit.errors import UsageError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert mmproj_output_path("out/", tmp_path, None, "g", "F16") == Path("out/mmproj-g-F16.gguf")
    assert mmproj_output_path("p-{TYPE}.gguf", tmp_path, None, "g", "F16") == Path("p-F16.gguf")
    with pytest.raises(UsageError, match="missing/ does not exist"):
        mmproj_output_path("missing/", tmp_path, None, "g", "F16")
    with pytest.raises(UsageError, match="unknown placeholder"):
        mmproj_output_path("p-{}.gguf", tmp_path, None, "g", "F16")


# -- no output over an input ------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "tokenizer.model", "README.md"])
def test_an_output_over_a_checkpoint_file_is_refused_before_any_work(target: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    (d / "README.md").write_text(README, encoding="utf-8")
    before = _snapshot(d)
    monkeypatch.chdir(d)
    result = invoke("convert", ".", "-o", f"./{target}", "--no-check")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "would overwrite the input" in result.stderr and target in result.stderr
    assert _snapshot(d) == before


def test_an_output_hard_linked_to_a_weight_file_or_over_the_metadata_file_is_refused(
        llama: Path, tmp_path: Path) -> None:
    link = tmp_path / "weights.gguf"
    os.link(llama / "model.safetensors", link)
    result = invoke("convert", str(llama), "-o", str(link), "--no-check")
    assert result.exit_code == 2 and "would overwrite the input" in result.stderr
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"general.author": "me"}))
    result = invoke("convert", str(llama), "--metadata", str(meta), "-o", str(meta), "--no-check")
    assert result.exit_code == 2 and "would overwrite the input" in result.stderr
    assert json.loads(meta.read_text()) == {"general.author": "me"}
    assert _sha256(link) == _sha256(llama / "model.safetensors")


def test_with_mmproj_refuses_a_projector_over_an_input_before_writing_the_text_model(tmp_path: Path) -> None:
    from fixtures_mmproj import make_vlm

    d = make_vlm(tmp_path / "g", "Gemma3ForConditionalGeneration")
    out = tmp_path / "out"
    out.mkdir()
    os.link(d / "model.safetensors", out / "mmproj-g-F16.gguf")  # where the projector would go
    result = invoke("convert", str(d), "--with-mmproj", "--outtype", "f16", "-o", f"{out}{os.sep}", "--no-check")
    assert result.exit_code == 2, result.output
    assert "mmproj-g-F16.gguf would overwrite the input" in result.stderr and "model.safetensors" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mmproj-g-F16.gguf"]  # the text model was not written


def test_converting_again_over_the_previous_output_in_the_model_folder_is_allowed(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    first = convert(d, outtype="f16").outputs[0]
    assert first.parent == d
    assert convert(d, outtype="f16").outputs == [first]


# -- general.* from the model card ------------------------------------------------------------------------


def test_model_card_metadata_is_written_to_general_keys(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    (d / "README.md").write_text(README, encoding="utf-8")
    out = convert(d, tmp_path / "m.gguf", outtype="f16").outputs[0]
    with open_gguf(out) as f:
        assert f.get("general.license") == "apache-2.0"
        assert f.get("general.base_model.count") == 1
        assert f.get("general.base_model.0.name") == "Llama 3.2 1B"
        assert f.get("general.base_model.0.organization") == "Meta Llama"
        assert f.get("general.base_model.0.repo_url") == "https://huggingface.co/meta-llama/Llama-3.2-1B"
        assert list(f.get("general.languages")) == ["en", "fr"]
        assert list(f.get("general.tags")) == ["text-generation", "llama"]
        assert f.get("general.dataset.count") == 1
        assert f.get("general.dataset.0.repo_url") == "https://huggingface.co/HuggingFaceFW/fineweb"
        # ggufkit's own naming is unchanged
        assert f.get("general.name") == "m" and f.get("general.basename") == "m"


def test_projector_carries_the_model_card_metadata_too(tmp_path: Path) -> None:
    from fixtures_mmproj import make_vlm

    from ggufkit.converters import convert_mmproj

    d = make_vlm(tmp_path / "g", "Gemma3ForConditionalGeneration")
    (d / "README.md").write_text(README, encoding="utf-8")
    out = convert_mmproj(d, tmp_path / "p.gguf", outtype="f16").outputs[0]
    with open_gguf(out) as f:
        assert f.get("general.license") == "apache-2.0" and list(f.get("general.languages")) == ["en", "fr"]
        assert f.get("general.type") == "mmproj"


def test_metadata_file_wins_over_the_model_card(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    (d / "README.md").write_text(README, encoding="utf-8")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"general.license": "mit"}))
    out = convert(d, tmp_path / "m.gguf", outtype="f16", metadata_file=meta).outputs[0]
    with open_gguf(out) as f:
        assert f.get("general.license") == "mit"


# -- --check failures name the tokens ---------------------------------------------------------------------


def test_check_failure_names_the_differing_token_ids_and_strings_and_what_to_try(tmp_path: Path) -> None:
    # llama.cpp's LlamaHfVocab merges whitespace runs in another order than the checkpoint's BPE: a real
    # tokenizer disagreement (tests/test_convert_archs.py, llama-hf-vocab)
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", vocab="llama-hf")
    result = invoke("convert", str(d), "-o", str(tmp_path / "m.gguf"), "--outtype", "f32", "--json")
    assert result.exit_code == 1, result.output
    failures = json.loads(result.stdout)["check_details"]["failures"]
    token_lines = [f for f in failures if f.startswith("tokens differ")]
    assert token_lines
    for line in token_lines:
        assert "transformers [" in line and "GGUF [" in line and "try " in line.split("; ", 1)[1]
        theirs = line.split("transformers [", 1)[1].split("]", 1)[0]
        first = theirs.split(", ")[0]
        tid, text = first.split(" ", 1)
        assert tid.isdigit() and text.startswith(("'", '"'))
    assert "check failed (output kept)" in result.stderr and result.stderr.count("\n") == 1


def test_token_difference_shows_both_sides() -> None:
    from ggufkit.eval.convert_check import token_difference

    pieces = ["<unk>", "▁a", "b", "▁ab", "c"]
    line = token_difference("abc", [1, 2, 4], [3, 4], pieces)
    assert line == ("tokens differ for 'abc' at token 0 (3 vs 2 tokens): transformers [1 '▁a', 2 'b', 4 'c'], "
                    "GGUF [3 '▁ab', 4 'c']")


# -- --outtype typo ---------------------------------------------------------------------------------------


def test_outtype_typo_suggests_the_type_before_listing_the_choices(llama: Path) -> None:
    result = invoke("convert", str(llama), "--outtype", "q4km")
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "did you mean Q4_K_M?" in err
    assert err.index("did you mean Q4_K_M?") < err.index("choose one of")
