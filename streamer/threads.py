"""Host work off the event loop, on a thread that ends with it.

asyncio.to_thread would do, but for torch. PyTorch's CPU ops run on OpenMP (libgomp), and every thread that runs a
parallel op keeps a team of OpenMP workers for as long as the thread lives. Once a process holds more OpenMP
threads than it has cores, libgomp lets idle workers spin for 1,000 rounds instead of 300,000 before they sleep,
so every parallel op of a model step then waits for its workers to wake. asyncio's pool threads live on: after a
server had turned audio into features there (a torch STFT), a Whisper decode step of 8 requests on the 2-core
sandbox took 54-58 ms instead of 29 ms, every op slower (a layer norm 186 us instead of 48 us). A thread that ends
takes its team with it (bench/RESULTS.md, session 26).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def to_own_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread, awaited from the event loop (for work that may run torch ops:
    image and audio preprocessing, adapter loading)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.cancelled():
            done.set_result(value) if ok else done.set_exception(value)

    def run() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # (handed to the awaiting coroutine, as to_thread does)
            loop.call_soon_threadsafe(settle, False, e)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=run, name=f"streamer-host-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return await done
