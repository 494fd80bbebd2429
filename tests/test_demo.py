"""`ggufkit demo` (the README's first command) runs the whole pipeline and reports sane numbers."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import invoke

from ggufkit.format import open_gguf


def test_demo_builds_converts_quantizes_edits_and_scores(tmp_path: Path) -> None:
    result = invoke("demo", "--workdir", str(tmp_path), "--steps", "20", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {r["type"]: r for r in report["rows"]}
    assert report["ok"] is True
    assert list(rows) == ["f16", "q8_0", "q4_0", "q4_1", "q4_k_s", "q4_k_m"]
    vocab_size = 512
    for row in rows.values():
        # Trained for a few steps: better than a uniform guess over the vocabulary, and a finite error bar.
        assert 1.0 < row["ppl"] < vocab_size
        assert row["ppl_error"] > 0
        with open_gguf(row["path"]) as model:
            assert model.get("general.name") == f"ggufkit demo tiny LLaMA {row['type'].upper()}"
    assert rows["f16"]["mean_kld"] is None
    # Fewer bits, more divergence from F16: Q8_0 is near-lossless, 4-bit types are not.
    assert 0 <= rows["q8_0"]["mean_kld"] < rows["q4_0"]["mean_kld"]
    assert rows["q8_0"]["bits_per_weight"] > rows["q4_k_m"]["bits_per_weight"] > 4.0
    assert rows["q8_0"]["same_top_p"] > 0.9
