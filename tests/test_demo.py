"""`ggufkit demo` (the README's first command) runs the whole pipeline over every type the quantizer has
and reports sane numbers, saying what it did and what each figure means."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import invoke
from gguf import GGMLQuantizationType

from ggufkit.cli.demo import _render
from ggufkit.demo import COLUMNS, UNCOVERED, demo_targets
from ggufkit.format import open_gguf
from ggufkit.quant.registry import KERNELS, SUPPORTED_TYPES


def test_demo_builds_converts_quantizes_every_type_edits_and_scores(tmp_path: Path) -> None:
    result = invoke("demo", "--workdir", str(tmp_path), "--steps", "20", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    rows = {r["type"]: r for r in report["rows"]}
    # Every type of the quantizer's registry (read from it, so new types are covered), plus Q4_K_M, each named
    # as quantize --type (or --tensor-type) names it.
    assert list(rows) == ["F16", *(target.upper() for target, _ in demo_targets())]
    assert {t.name for t in SUPPORTED_TYPES} <= set(rows) and "Q4_K_M" in rows
    vocab_size = 512
    for row in rows.values():
        # Trained for a few steps: better than a uniform guess over the vocabulary, and a finite error bar.
        assert 1.0 < row["ppl"] < vocab_size
        assert row["ppl_error"] > 0
        with open_gguf(row["path"]) as model:
            assert model.get("general.name") == f"ggufkit demo tiny LLaMA {row['type']}"
            types = {t.ggml_type for t in model.tensors}
        if row["type"] != "Q4_K_M":  # each pure file really holds its type
            assert GGMLQuantizationType[row["type"]] in types, row["type"]
    # pure files; the types that need an importance matrix keep token_embd and output (which none covers) in Q8_0
    recipes = {t: rows[t.name]["recipe"] for t in KERNELS}
    assert all("(--pure)" in r or "(--tensor-type)" in r for r in recipes.values())
    assert all(r.endswith(UNCOVERED) == KERNELS[t].needs_imatrix for t, r in recipes.items() if "(--pure)" in r)
    assert rows["F16"]["mean_kld"] is None
    # Fewer bits, more divergence from F16: Q8_0 is near-lossless, 4-bit types are not.
    assert 0 <= rows["Q8_0"]["mean_kld"] < rows["Q4_0"]["mean_kld"]
    assert rows["Q8_0"]["bits_per_weight"] > rows["Q4_K_M"]["bits_per_weight"] > 4.0
    assert rows["Q8_0"]["same_top_p"] > 0.9
    # The report says what was done (one line per stage) and what each printed figure means.
    assert len(report["steps"]) == 6 and "20 steps" in report["steps"][0]
    assert "importance matrix" in report["steps"][2]
    assert f"each of the {len(rows) - 2} other types" in report["steps"][3]
    assert report["columns"] == COLUMNS
    text = _render(report)
    # No nonzero KLD reads as zero beside its same-top share.
    for row in rows.values():
        if row["mean_kld"]:
            line = next(line for line in text.splitlines() if line.startswith(row["type"] + " "))
            assert float(line.split()[-2]) > 0, line
    # The first lines say what the first run costs and where the files go.
    assert "first run compiles" in result.stderr and "--workdir" in result.stderr.splitlines()[0]
    for step in report["steps"]:
        assert step in text and "{" not in step  # every placeholder filled
    for name, meaning in COLUMNS.items():
        assert name in text.splitlines()[len(report["steps"]) + 2]  # the table's header
        assert any(line.split() and line.split(meaning)[0].strip() == name for line in text.splitlines()
                   if meaning in line)
