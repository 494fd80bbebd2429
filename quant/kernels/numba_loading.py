"""Loading the kernels from Numba's on-disk cache without Numba's whole-compiler set-up.

Every command that quantizes or dequantizes runs kernels that an earlier run compiled and cached
(``@numba.njit(cache=True)``). Numba's cache lookup (``numba/core/caching.py``, ``Cache.load_overload``)
first calls ``target_context.refresh()``: it imports every lowering module Numba has (``numba.np.*``,
``numba.cpython.*``, ``numba.typed``, ...), installs their thousands of implementations and refreshes the
typing context -- about 0.3-0.4 s on a 2-core Xeon, a fifth of a whole ``ggufkit quantize`` of a 135M
model. Rebuilding a cached function needs none of that: only the runtime (``rtsys.initialize``, which
links NRT's allocation functions into LLVM) and the code generator. The lowering tables are needed only
to *compile*, and Numba's compiler refreshes the context itself before it compiles
(``numba/core/compiler.py``, ``compile_extra``; ``BaseContext.get_function`` also refreshes on a miss).

:func:`install_lazy_cache_loads` therefore gives the CPU cache class (``FunctionCache``, the one
``Dispatcher.enable_caching`` uses; CUDA's ``CUDACache`` is a sibling class and keeps Numba's method) a
``load_overload`` that initializes the runtime and loads, and leaves the refresh to a compile that
follows a miss. What a cached kernel computes does not change (the same object code is loaded); if this
Numba lacks the methods relied on, nothing is replaced.

:func:`load_numba_lowering_without_scipy` is the other half of a cheap first compile: see its docstring.
"""

from __future__ import annotations

import sys
from typing import Any

import numba.core.caching
from numba.core.cpu import CPUContext
from numba.core.runtime import rtsys

_numba_load_overload = numba.core.caching.FunctionCache.load_overload


def load_numba_lowering_without_scipy() -> None:
    """Import Numba's NumPy lowering (``numba.np.arraymath``) without the SciPy it probes for BLAS.

    Before compiling anything Numba imports ``numba.np.arraymath``, whose module-level ``_check_blas()``
    imports ``scipy.linalg`` only to learn whether ``np.dot`` may call BLAS from ``np.correlate``/
    ``np.convolve`` (numba/np/arraymath.py ``_HAVE_BLAS``). No kernel here uses them, and that import is
    about half a second. So the lowering module is imported with ``scipy.linalg`` masked (BLAS then reads
    as absent, and those two functions use Numba's own loop); the mask is lifted at once, so a later
    ``import scipy.linalg`` (``np.dot`` or ``np.linalg`` in jitted code calls Numba's ``ensure_blas``,
    which imports it) works as usual.
    """
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    sys.modules["scipy.linalg"] = None  # type: ignore[assignment]  # makes `import scipy.linalg` fail fast
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        del sys.modules["scipy.linalg"]


def _load_overload_lazily(self: Any, sig: Any, target_context: Any) -> Any:
    """``FunctionCache.load_overload`` without the eager ``target_context.refresh()``."""
    if not isinstance(target_context, CPUContext):
        return _numba_load_overload(self, sig, target_context)
    rtsys.initialize(target_context)
    result = None
    with self._guard_against_spurious_io_errors():
        result = self._load_overload(sig, target_context)
    if result is None:  # not cached: Numba compiles next, and refreshes the context for it
        load_numba_lowering_without_scipy()
    return result


def install_lazy_cache_loads() -> None:
    """Make CPU cache loads skip Numba's full context refresh (idempotent; see the module docstring)."""
    cache_class = numba.core.caching.FunctionCache
    usable = all(hasattr(cache_class, name) for name in ("_load_overload", "_guard_against_spurious_io_errors"))
    if not usable or not hasattr(rtsys, "initialize"):
        load_numba_lowering_without_scipy()  # Numba's own load refreshes: keep its SciPy probe cheap
        return
    cache_class.load_overload = _load_overload_lazily
