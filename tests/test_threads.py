"""streamer/threads.py: host work on a thread of its own, which ends with the call (its OpenMP team with it)."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from streamer.threads import to_own_thread


def test_each_call_gets_a_thread_that_ends():
    seen: list[threading.Thread] = []

    def work(x: int, scale: int = 1) -> int:
        seen.append(threading.current_thread())
        torch.ones(100_000).add(1).sum()  # (a parallel op: its OpenMP team belongs to this thread)
        return x * scale

    async def main() -> list[int]:
        return list(await asyncio.gather(*(to_own_thread(work, i, scale=3) for i in range(4))))

    assert asyncio.run(main()) == [0, 3, 6, 9]
    assert len(set(seen)) == 4 and threading.main_thread() not in seen  # (idents may be reused: objects)
    for t in seen:
        t.join(5)
    assert not any(t.is_alive() for t in seen)


def test_errors_reach_the_caller():
    def fail() -> None:
        raise ValueError("bad input")

    async def main() -> None:
        await to_own_thread(fail)

    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(main())


def test_a_cancelled_caller_does_not_break_the_loop():
    started = threading.Event()
    release = threading.Event()

    def slow() -> int:
        started.set()
        release.wait(5)
        return 1

    async def main() -> int:
        task = asyncio.ensure_future(to_own_thread(slow))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # (the thread's result arrives after the cancel: dropped, no InvalidStateError)
        return await to_own_thread(lambda: 2)

    assert asyncio.run(main()) == 2
