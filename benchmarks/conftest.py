"""Benchmarks run in one process: pytest-benchmark measures nothing under pytest-xdist workers, and a ratio
measured beside other work is not a ratio (pyproject's addopts ask for ``-n auto``; this answers 0)."""

from __future__ import annotations


def pytest_xdist_auto_num_workers(config: object) -> int:
    return 0
