"""Shared pytest configuration. Fixtures specific to one area live in that area's helper modules."""

from __future__ import annotations

import sys
from pathlib import Path

# Helper modules (tiny checkpoints, tokenizer files, llama.cpp sources) sit beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


def _load_llama_cpp_models_without_repacking() -> None:
    """Every model llama-cpp-python loads in the tests keeps its weights in the plain CPU buffer, as the tools
    run with ``--no-repack`` (``-nr``) do. ggml's "extra" buffer types repack quantized weights for AMX or
    other CPU-specific kernels (ggml-cpu/amx/amx.cpp, ggml-cpu/repack.cpp): on a CPU that reports AMX inside a
    sandbox that grants ARCH_REQ_XCOMP_PERM without enabling the tile state, the AMX matmul dies with SIGILL
    and takes pytest with it; elsewhere the repacked kernels only change which machine's numerics the oracle
    has. llama-cpp-python's ``Llama`` has no argument for ``use_extra_bufts``, so its default is set here."""
    try:
        import llama_cpp.llama_cpp as low_level
    except ImportError:  # the demo/first-command environments have no llama-cpp-python; no test needs it there
        return
    default_params = low_level.llama_model_default_params
    if getattr(default_params, "_ggufkit_no_repack", False):
        return

    def no_repack_default_params() -> object:
        params = default_params()
        params.use_extra_bufts = False
        return params

    no_repack_default_params._ggufkit_no_repack = True  # type: ignore[attr-defined]
    low_level.llama_model_default_params = no_repack_default_params


_load_llama_cpp_models_without_repacking()


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist each worker gets its share of the cores for torch's (OpenMP) thread pool, in this
    process and in the ``ggufkit`` subprocesses it starts: two workers of two threads each on two cores spend
    their time waiting for each other's spinning threads. A test that asks for a thread count still gets it."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, cores // workers))


_share_the_cores_between_workers()


def pytest_xdist_auto_num_workers(config: object) -> int:
    """``-n auto`` (pyproject's addopts): one pytest-xdist worker per core, as many as memory allows at ~8 GiB
    each (the largest tests hold a real 270M model, llama.cpp's and ours at once), and none when benchmarks are
    asked for (pytest-benchmark measures nothing under xdist)."""
    import os

    import psutil

    if getattr(config, "option", None) is not None and getattr(config.option, "benchmark_enable", False):  # type: ignore[attr-defined]
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    by_memory = psutil.virtual_memory().total // (8 * 2**30)
    return max(1, min(cores, by_memory))
