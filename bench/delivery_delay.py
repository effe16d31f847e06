"""How long a token waits on the event loop between the step that computed it and its reader: the time from the
engine loop handing a step's outputs to the request queues (`AsyncEngine._dispatch`) to each stream consumer
(`engine.stream`, what an SSE response iterates) receiving them, against the step's own period.

    python bench/delivery_delay.py [--model DIR] [--streams 16] [--tokens 64] [--dtype float32]

Without --model the embedded demo model runs. Prints the delay's median / p99 / max in ms and the median step
period, for N concurrent streams. A delay near the step period would mean tokens wait for the next step.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def run(args) -> None:
    from streamer import AsyncEngine, SamplingParams
    engine = AsyncEngine(args.model, dtype=args.dtype)
    await engine.start()
    core = engine.engine
    periods: list[float] = []
    dispatch = engine._dispatch

    def timed_dispatch(updates):  # stamp every output this step puts on a queue
        before = {id(q): q.qsize() for _, q in engine._streams.values()}
        queues = [q for _, q in engine._streams.values()]
        dispatch(updates)
        now = time.perf_counter()
        for q in queues:
            for item in list(q._queue)[before.get(id(q), 0):]:  # (the items this step added)
                if not isinstance(item, BaseException):
                    item.sent_at = now
        periods.append(core.last_step[1])

    engine._dispatch = timed_dispatch
    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    delays: list[float] = []

    async def consume() -> None:
        prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
        async for out in engine.stream(prompt, params):
            t = getattr(out, "sent_at", None)  # (outputs merged while the reader was busy: the first's)
            if t is not None:
                delays.append(time.perf_counter() - t)

    await asyncio.gather(*(consume() for _ in range(4)))  # warm-up
    delays.clear()
    periods.clear()
    await asyncio.gather(*(consume() for _ in range(args.streams)))
    await engine.stop()
    d = np.array(delays) * 1e3
    print(f"{'streams':>8}{'outputs':>9}{'delay med ms':>14}{'delay p99 ms':>14}{'delay max ms':>14}"
          f"{'step med ms':>13}{'p99 / step':>12}")
    step = float(np.median(periods)) * 1e3
    print(f"{args.streams:>8}{len(d):>9}{np.median(d):>14.3f}{np.percentile(d, 99):>14.3f}{d.max():>14.3f}"
          f"{step:>13.2f}{np.percentile(d, 99) / step:>12.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
