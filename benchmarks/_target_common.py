"""Shared pieces of the ``--target-size`` benchmarks (``bench_quantize_target_gemma3.py``,
``bench_quantize_target_scale.py``): the machine they ran on, its load, and a child process's wall time and
peak resident memory."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    """``lscpu``'s model name, the AVX2/AVX-512/AMX flags of /proc/cpuinfo, the cores and the memory."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_int8")
            if f in flags]
    mem = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), "0") if Path("/proc/meminfo").exists() else "0"
    held = ""
    if "-avx512f" in os.environ.get("NUMBA_CPU_FEATURES", ""):  # benchmarks/avx2_only.py's environment
        held = f"; ggufkit's Numba held to AVX2 (NUMBA_CPU_NAME={os.environ.get('NUMBA_CPU_NAME', '?')}, AVX-512 off)"
    # "AMD EPYC" names no generation: the family says it (23 Zen 1/2, 25 Zen 3/4, 26 Zen 5)
    field = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in text.split("\n\n")[0].splitlines()
             if ":" in ln}
    family = f" (family {field.get('cpu family', '?')} model {field.get('model', '?')})" if "AMD" in model else ""
    amx = " (llama.cpp tools run with -nr / no repack: AMX is reported but unusable here)" if "amx_int8" in flags else ""
    return (f"{model}{family}, {os.cpu_count()} cores, {int(mem) >> 20} GiB, flags: {' '.join(simd) or 'none'}"
            f"{amx}{held}")


def load() -> float:
    """The 1-minute load average (the box is shared: every number is printed with it)."""
    return round(os.getloadavg()[0], 2)


@dataclass(frozen=True)
class Timed:
    """One child process: wall and CPU (user + system) seconds, peak RSS (MiB, its VmHWM), the load average
    before it, its output. On a shared box the CPU seconds are the steadier number."""

    seconds: float
    cpu_seconds: float
    peak_rss_mib: float
    load_before: float
    output: str

    def row(self) -> dict[str, float]:
        return {"seconds": round(self.seconds, 2), "cpu_seconds": round(self.cpu_seconds, 2),
                "peak_rss_mib": round(self.peak_rss_mib, 1), "load": self.load_before}


def _hwm_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("VmHWM:")), 0)


def timed(cmd: list[str], env: dict[str, str] | None = None, poll_s: float = 0.05) -> Timed:
    """Run ``cmd``, polling its VmHWM (/proc/PID/status) until it exits; CPU time from ``wait4``.

    Not ``wait4``'s ``ru_maxrss``: Linux carries the RSS a forked child had before ``execve`` (a copy of this
    Python process, hundreds of MB) into it, so a small tool would report this process's size.
    """
    before = load()
    peak = 0
    with tempfile.TemporaryFile() as out:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            peak = max(peak, _hwm_kib(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} failed ({proc.returncode}):\n{text[-3000:]}")
    return Timed(wall, usage.ru_utime + usage.ru_stime, peak / 1024, before, text)
