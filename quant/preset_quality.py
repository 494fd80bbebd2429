"""Each ``--type`` preset measured on a real small model (``quantize --help`` shows it).

Placeholder until benchmarks/bench_preset_quality.py --write has run: no preset measured yet.
"""

from __future__ import annotations

from typing import Any

MEASURED: dict[str, Any] = {"model": "-", "reference": "-", "text": "-", "imatrix": "-", "date": "-",
                            "presets": {}}
