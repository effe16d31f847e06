"""Inductor's on-disk cache, kept usable: a compiled module there that cannot be loaded (an empty or truncated .so,
left by a process killed while writing it, or by two processes building it at once) fails every later compile of
that graph, in every process, until it is gone. The compile paths (the model runner's, the CPU decode attention's)
remove the file a failure names and compile again rather than run eagerly for good."""
from __future__ import annotations

import logging
import os
import re
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
