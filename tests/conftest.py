"""Shared pytest configuration. Fixtures specific to one area live in that area's helper modules."""

from __future__ import annotations

import sys
from pathlib import Path

# Helper modules (tiny checkpoints, tokenizer files, llama.cpp sources) sit beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
