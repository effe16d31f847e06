"""Waiting for a quiet machine before a timed run (shared by the side-by-side benchmark drivers; stdlib only, so
it also imports under vLLM's venv)."""
from __future__ import annotations

import os
import time
from typing import Optional


def wait_for_load(max_load: Optional[float], max_wait: float, poll: float = 20.0) -> float:
    """Waits (polling every `poll` s, at most `max_wait` s) until the 1-minute load average is below max_load;
    returns the load average it starts with. max_load None: do not wait."""
    load = os.getloadavg()[0]
    if max_load is None:
        return load
    deadline = time.monotonic() + max_wait
    while load >= max_load and time.monotonic() < deadline:
        print(f"   load average {load:.2f} >= {max_load:g}: waiting", flush=True)
        time.sleep(poll)
        load = os.getloadavg()[0]
    if load >= max_load:
        print(f"   load average still {load:.2f} after {max_wait:g} s: running anyway", flush=True)
    return load


def cpu_busy(window: float = 0.5) -> float:
    """The share of all cores busy over the next `window` seconds (from /proc/stat; 0.0 where it is missing)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle
    try:
        total0, idle0 = read()
        time.sleep(window)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_idle_cpu(max_busy: Optional[float], max_wait: float = 20.0) -> float:
    """Waits (at most `max_wait` s) until less than `max_busy` of the cores were busy over half a second: a server
    that just finished a run may keep a core busy for a while (vLLM-CPU's worker spins about a second after its
    last request), and the next run would pay for it. Returns the last busy share measured; None: do not wait."""
    if max_busy is None:
        return 0.0
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy >= max_busy and time.monotonic() < deadline:
        busy = cpu_busy()
    if busy >= max_busy:
        print(f"   {busy:.0%} of the CPU still busy after {max_wait:g} s: running anyway", flush=True)
    return busy
