"""Available system memory from the standard library alone (no psutil at run time)."""

from __future__ import annotations

import os

#: Linux's estimate of memory available to a new process without swapping (page cache counted as reclaimable).
MEMINFO = "/proc/meminfo"


def available_memory_bytes() -> int:
    """Bytes of RAM a new allocation can use without swapping.

    Linux: ``MemAvailable`` from /proc/meminfo, which counts reclaimable page cache (free pages alone
    understate it badly on a machine with a warm cache). Elsewhere, or on kernels older than 3.14 that
    lack the field: free physical pages from ``os.sysconf`` (an underestimate, so callers stay safe).

    Returns:
        Available bytes; 0 when the platform reports neither.
    """
    try:
        with open(MEMINFO, encoding="ascii") as f:
            found = parse_meminfo_available(f.read())
    except OSError:
        found = None
    if found is not None:
        return found
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def parse_meminfo_available(text: str) -> int | None:
    """``MemAvailable`` of a /proc/meminfo text in bytes, or None when the field is absent."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            fields = value.split()
            if fields and fields[0].isdigit():
                scale = 1024 if fields[1:] == ["kB"] else 1
                return int(fields[0]) * scale
    return None
