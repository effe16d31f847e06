"""Inductor's on-disk cache, kept usable: a compiled module there that cannot be loaded (an empty or truncated .so,
left by a process killed while writing it, or by two processes building it at once) fails every later compile of
that graph, in every process, until it is gone. The compile paths (the model runner's, the CPU decode attention's)
remove the file a failure names and compile again rather than run eagerly for good."""
from __future__ import annotations

import logging
import os
import re
import threading
from typing import Callable, Optional, TypeVar

logger = logging.getLogger("streamer")
T = TypeVar("T")

_SHARED_OBJECT = re.compile(r"(/[^\s:'\"]+\.so)\b")


def drop_unloadable_artifact(error: BaseException) -> Optional[str]:
    """Remove the cached .so that `error` names, if it lies in Inductor's cache; its path if one was removed (each
    call removes a file, so retrying while this returns one ends)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = os.path.realpath(cache_dir())
    for path in _SHARED_OBJECT.findall(str(error)):
        real = os.path.realpath(path)
        if real.startswith(root + os.sep) and os.path.isfile(real):
            os.remove(real)
            return real
    return None


def healing(fn: Callable[[], T], what: str) -> T:
    """fn(), called again each time it fails on an unloadable module in Inductor's cache (removed first); any other
    failure propagates."""
    while True:
        try:
            return fn()
        except Exception as e:
            broken = drop_unloadable_artifact(e)
            if broken is None:
                raise
            logger.warning("%s: removed an unloadable file from Inductor's cache (%s); compiling again", what, broken)


# While the model compiles in a background thread (ModelRunner, CPU serving), kernels that compile on their first
# call (the CPU decode attention) run eagerly in every other thread instead of stalling the device thread: only
# the compiling thread compiles. None: no background compile; -1: one is starting (no thread may compile yet).
_compiler: Optional[int] = None


def may_compile() -> bool:
    return _compiler is None or _compiler == threading.get_ident()


def hold_compiles() -> None:
    """No thread compiles until `claim_compiles` (called by the background thread) or `release_compiles`."""
    global _compiler
    _compiler = -1


def claim_compiles() -> None:
    global _compiler
    _compiler = threading.get_ident()


def release_compiles() -> None:
    global _compiler
    _compiler = None
