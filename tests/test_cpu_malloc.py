"""streamer/worker/cpu_malloc.py: a CPU engine's freed temporaries are reused without page faults."""
from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# A fresh interpreter each time: the settings are process-wide and cannot be undone.
_FAULTS = """
import resource, sys, torch
from streamer.worker.cpu_malloc import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "keep" else None)
torch.set_num_threads(1)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # (small allocations land in a freed block, so the heap takes a few rounds to settle)
    x = torch.ones(16, 1 << 20)  # 64 MiB: past glibc's largest dynamic mmap threshold (32 MiB)
    del x
before = faults()
for _ in range(10):
    y = torch.ones(16, 1 << 20)
    del y
print(faults() - before)
"""


def _faults(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env}).stdout.split()
    return out[0], int(out[1])


@glibc
def test_freed_blocks_are_reused_without_page_faults():
    applied, kept = _faults("keep")
    default_applied, default = _faults("default")
    assert applied == "True" and default_applied == "None"
    pages = 10 * (64 << 20) // resource.getpagesize()
    assert default > pages // 2  # each 64 MiB block is a fresh mmap: every page faults in
    assert kept < pages // 20  # the freed block is reused


@glibc
def test_user_settings_win():
    assert _faults("keep", MALLOC_MMAP_THRESHOLD_="131072")[0] == "False"
    assert _faults("keep", STREAMER_CPU_MALLOC="0")[0] == "False"


def test_cpu_engine_applies_it(llama_dir):
    from streamer.config import EngineConfig
    from streamer.engine.llm_engine import LLMEngine
    from streamer.worker import cpu_malloc
    LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64))
    assert cpu_malloc._applied == (platform.libc_ver()[0] == "glibc" and cpu_malloc.keep_freed_memory())
