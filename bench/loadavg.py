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
