"""SmolLM3 (issue 33) against llama.cpp end to end, on tiny random checkpoints of transformers' own class.

llama.cpp's smollm3 is LLaMA's graph with RoPE skipped on every 4th layer (src/models/smollm3.cpp); the step
is no GGUF key (its loader fixes it at 4), so the checkpoint's schedule is checked at conversion. transformers
reads the schedule from ``no_rope_layers`` (one flag per layer, 1 = RoPE), else from ``no_rope_layer_interval``;
both the release configs (HuggingFaceTB/SmolLM3-3B: ``rope_theta`` at the root, ``rope_scaling: null``, both
schedule keys, ``layer_types``, ``use_sliding_window: false``, bf16 weights) and transformers 5's save_pretrained
(``rope_parameters``) write the list. The transformers 5 layout is a case of tests/test_convert_archs.py (bytes
and keys vs llama.cpp's converter, logits, ``convert --check``, ``ppl``) and its ``ppl`` is compared with
llama-perplexity in tests/test_eval_archs_vs_llama_perplexity.py; the imatrix with llama-imatrix in
tests/test_eval_imatrix_archs.py; every preset's plan with llama-quantize's in tests/test_quant_presets_oracle.py.
Here: the release layout and the interval-only spelling (bytes, keys, logits, ``--check``), the schedules
llama.cpp would not compute (refused), whole quantized files vs llama-quantize, and ``release``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import tool_path
from test_convert_archs import EXTRA_KEYS, _compared_key, llama_cpp_convert

from ggufkit.converters import convert
from ggufkit.eval.convert_check import check_conversion
from ggufkit.format import open_gguf

#: Keys of HuggingFaceTB/SmolLM3-3B's config.json that transformers 5 writes otherwise or not at all.
RELEASE_KEYS: dict[str, Any] = {"bos_token_id": None, "eos_token_id": 128012, "pad_token_id": 128004,
                                "rope_scaling": None, "max_window_layers": 28, "pretraining_tp": 2,
                                "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0",
                                "use_cache": False, "sliding_window": None, "use_sliding_window": False}


def to_release_layout(d: Path) -> Path:
    """Rewrite ``config.json`` as the release's is laid out: ``rope_theta`` at the root, no
    ``rope_parameters`` or ``dtype``, the release's extra keys (``no_rope_layers``, ``no_rope_layer_interval``
    and ``layer_types`` stay, as it writes them)."""
    path = d / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config.pop("dtype", None)
    config.update(RELEASE_KEYS)
    path.write_text(json.dumps(config, indent=2))
    return d


def interval_only(d: Path) -> Path:
    """The schedule spelled only by ``no_rope_layer_interval`` (4): transformers builds the list from it."""
    path = d / "config.json"
    config = json.loads(path.read_text())
    del config["no_rope_layers"], config["layer_types"]
    path.write_text(json.dumps(config, indent=2))
    return d


def assert_same_as_llama_cpp(theirs: Path, ours: Path) -> None:
    """Every tensor byte-identical, every key equal (naming and ggufkit's keys aside)."""
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = [k for k in a.kv if _compared_key(k)]
        keys_b = [k for k in b.kv if _compared_key(k)]
        extra = set(keys_b) - set(keys_a)
        assert set(keys_a) <= set(keys_b) and extra <= set(EXTRA_KEYS), extra
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            if isinstance(va, (list, np.ndarray)):
                assert np.array_equal(np.asarray(va), np.asarray(vb)), key
            else:
                assert va == vb, key


LAYOUTS = {"release-bf16": (to_release_layout, {"dtype": "bfloat16"}), "interval-only": (interval_only, {})}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rewrite, overrides = LAYOUTS[request.param]
    d = rewrite(make_checkpoint(tmp_path_factory.mktemp(request.param) / "SmolLM3-3B", "SmolLM3ForCausalLM",
                                **overrides))
    report = convert(d, d.parent / "ours.gguf", outtype="f32")
    return {"name": request.param, "dir": d, "ours": report.outputs[0], "plan": report.plan}


def test_each_config_layout_converts_as_llama_cpps_converter(layout: dict[str, Any]) -> None:
    d = layout["dir"]
    assert_same_as_llama_cpp(llama_cpp_convert(d, d.parent / "theirs.gguf"), layout["ours"])
    with open_gguf(layout["ours"]) as f:
        assert f.architecture == "smollm3" and f.get("smollm3.rope.freq_base") == 5e6
        assert "output.weight" not in {t.name for t in f.tensors}  # tied, as released
    if layout["name"] == "release-bf16":  # bf16 as released: the bf16 file too
        ours = convert(d, d.parent / "ours-bf16.gguf", outtype="bf16").outputs[0]
        assert_same_as_llama_cpp(llama_cpp_convert(d, d.parent / "theirs-bf16.gguf", "bf16"), ours)


def test_each_config_layout_runs_in_llama_cpp_as_in_transformers(layout: dict[str, Any]) -> None:
    """Layer 3 is a NoPE layer: llama.cpp's fixed schedule is the checkpoint's."""
    want = transformers_logits(layout["dir"])
    got = llama_cpp_logits(layout["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_each_config_layout_passes_convert_check(layout: dict[str, Any]) -> None:
    """The evaluator skips RoPE where llama.cpp does: --check agrees with transformers."""
    ok = check_conversion(layout["dir"], layout["ours"], layout["plan"], device="cpu")
    assert ok.status == "passed", ok.failures


@pytest.fixture(scope="module")
def f16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A SmolLM3 converted to F16 by ggufkit, wide enough for whole k-quant blocks (256 / 512 columns),
    and llama-imatrix's importance matrix of it."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix

    from ggufkit.eval.perplexity import sample_text

    d = tmp_path_factory.mktemp("smollm3-f16")
    ckpt = make_checkpoint(d / "SmolLM3-3B", "SmolLM3ForCausalLM", hidden_size=256, intermediate_size=512)
    model = convert(ckpt, d / "f16.gguf", outtype="f16").outputs[0]
    text = d / "text.txt"
    text.write_text(sample_text()[:4000] + "\n", encoding="utf-8")
    imatrix = d / "imatrix.gguf"
    llama_imatrix("-m", model, "-f", text, "-c", 64, "--chunks", 2, "-o", imatrix, *F32_ATTENTION)
    return {"model": Path(model), "imatrix": imatrix}


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q3_k_s", False), ("q2_k", True),
                                                      ("iq4_xs", True)])
def test_quantized_file_equals_llama_quantizes(f16: dict[str, Path], target: str, with_imatrix: bool,
                                               tmp_path: Path) -> None:
    """The whole file, byte for byte and key for key, as the llama-quantize binary writes it (which copies the
    converter's ``ggufkit.*`` provenance keys; ggufkit's quantizer writes its own)."""
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    flags = ["--imatrix", str(f16["imatrix"])] if with_imatrix else []
    r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(f16["model"]), str(tmp_path / "ref.gguf"),
                        target.upper(), "2"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    quantize_file(f16["model"], tmp_path / "ours.gguf", target, imatrix=f16["imatrix"] if with_imatrix else None,
                  threads=2, device="cpu")
    with open_gguf(tmp_path / "ref.gguf") as a, open_gguf(tmp_path / "ours.gguf") as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        keys = [k for k in a.kv if not k.startswith("ggufkit.")]
        assert keys == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray)) \
                else va == vb, key


def test_release_end_to_end(tmp_path: Path) -> None:
    """``ggufkit release`` of a SmolLM3 checkpoint: master, imatrix, a quantized file, each loaded by
    llama.cpp; the master's perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.release import release
    from ggufkit.release.plan import TextInput

    ckpt = make_checkpoint(tmp_path / "SmolLM3-3B", "SmolLM3ForCausalLM", hidden_size=256, intermediate_size=512)
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q4_k_m"], master="f16", ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    quantized = next(out / f for f in result.files if f.endswith("-Q4_K_M.gguf"))
    assert any(".imatrix" in f for f in result.files), result.files
    with open_gguf(quantized) as f:
        assert f.architecture == "smollm3" and f.get("quantize.imatrix.chunks_count") == 2
    for path in (master, quantized):
        assert np.isfinite(llama_cpp_logits(path)).all()
    text = tmp_path / "eval.txt"
    text.write_text(TextInput.bundled("evaluation").text, encoding="utf-8")
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    assert result.master is not None and abs(result.master["ppl"] / theirs - 1) < 1e-3, (result.master, theirs)


def _config(**fields: Any) -> dict[str, Any]:
    return {"num_hidden_layers": 8, "no_rope_layer_interval": 4, **fields}


@pytest.mark.parametrize(("config", "message"), [
    (_config(no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0]), None),
    (_config(), None),  # interval only: transformers builds [1, 1, 1, 0, ...] from it
    (_config(no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0, 1, 1]), None),  # longer than the layers, as allowed
    (_config(no_rope_layer_interval=2), "NoPE layers [1, 3, 5, 7]"),
    (_config(no_rope_layers=[1, 1, 1, 1, 1, 1, 1, 1]), "NoPE layers []"),
    (_config(no_rope_layers=[1, 1, 1, 0]), "NoPE layers [3]"),  # too short for 8 layers
    (_config(use_sliding_window=True, sliding_window=8), "sliding-window layers [3, 7]"),
    (_config(use_sliding_window=True, sliding_window=None), None),
    (_config(layer_types=["full_attention"] * 7 + ["sliding_attention"]), "sliding-window layers [7]"),
    (_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "llama3 rope scaling"),
])
def test_check_config_reads_every_schedule_spelling(config: dict[str, Any], message: str | None) -> None:
    from ggufkit.converters import smollm3
    from ggufkit.errors import UnsupportedArchitectureError

    if message is None:
        smollm3.check_config(config)
    else:
        with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
            smollm3.check_config(config)


@pytest.mark.parametrize(("overrides", "drop", "message"), [
    ({"no_rope_layers": [1, 0, 1, 1]}, (), "NoPE layers [1]"),
    # the interval alone (no list): transformers builds [1, 0, 1, 0] from it
    ({"no_rope_layer_interval": 2}, ("no_rope_layers", "layer_types"), "NoPE layers [1, 3]"),
    # transformers 5 writes the sliding NoPE layer into layer_types; without layer_types it derives it
    ({"use_sliding_window": True, "sliding_window": 8}, (), "sliding-window layers [3]"),
    ({"use_sliding_window": True, "sliding_window": 8}, ("layer_types",), "sliding-window layers [3]"),
])
def test_schedules_llama_cpp_would_compute_differently_are_refused(
        overrides: dict[str, Any], drop: tuple[str, ...], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's converter writes these checkpoints as the fixed schedule's model (another model): refused,
    exit 2, one line, nothing written."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    # a small BPE (the refusal comes before the vocabulary): no special ids beyond it
    d = make_checkpoint(tmp_path / "m", "SmolLM3ForCausalLM", vocab="llama-bpe", pad_token_id=None,
                        bos_token_id=None, eos_token_id=None, **overrides)
    config = json.loads((d / "config.json").read_text())
    for key in drop:
        del config[key]
    (d / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and f"smollm3: llama.cpp would compute another model: {message}" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()
