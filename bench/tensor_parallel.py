"""Tensor parallelism side by side: the same model with tensor_parallel_size=1 and =N, one engine after the
other in this process, greedy, eager (or both compiled with --compile).

    python bench/tensor_parallel.py [--model DIR] [--tp 2] [--dtype bfloat16] [--rounds 2] [--compile]

Prints tokens/s for one stream (1 x 128 new tokens) and a batch (16 x 64 new tokens, 128-token prompts), the
ratio TP / single process, and whether both produced the same tokens. On a CPU the ranks share its cores
(each takes cores / N threads) and every layer adds two all-reduces over gloo, so expect no gain there: the
point of TP is a model that does not fit one GPU.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from streamer import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    dt = time.perf_counter() - t
    return len(prompts) * max_tokens / dt, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile both (default: eager)")
    args = ap.parse_args()
    from streamer import LLM
    rng = random.Random(0)
    stream = [[rng.randrange(3, 1000) for _ in range(128)]]
    batch = [[rng.randrange(3, 1000) for _ in range(128)] for _ in range(16)]
    print(f"# {args.model or 'demo model'}, dtype {args.dtype}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}")
    results = {}
    for tp in (1, args.tp):
        with LLM(args.model, dtype=args.dtype, tensor_parallel_size=tp, enforce_eager=not args.compile,
                 enable_prefix_caching=False) as llm:
            run(llm, stream, 4)  # warm-up
            s = [run(llm, stream, 128) for _ in range(args.rounds)]
            b = [run(llm, batch, 64) for _ in range(args.rounds)]
        results[tp] = (statistics.median(x for x, _ in s), statistics.median(x for x, _ in b), s[0][1], b[0][1])
    one, many = results[1], results[args.tp]
    print(f"{'tp':>3} {'stream tok/s':>13} {'batch tok/s':>12}")
    for tp, (st, bt, _, _) in results.items():
        print(f"{tp:>3} {st:>13.1f} {bt:>12.1f}")
    print(f"tp{args.tp}/tp1: stream {many[0] / one[0]:.2f}x, batch {many[1] / one[1]:.2f}x; leading tokens "
          f"that agree: stream {agree(many[2], one[2])}, batch {agree(many[3], one[3])} (in 16-bit the "
          f"all-reduce adds rounded partial sums: greedy paths may part after a near tie)")


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    """Per request, how many leading tokens match; as 'min / median / all' over the requests."""
    n = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return f"min {min(n)}, median {statistics.median(n):.0f} of {len(a[0])}"


if __name__ == "__main__":
    main()
