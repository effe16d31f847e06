"""Suffix decoding (speculative_method="suffix") on an agent-like stream: requests one after another, some of them
repeating an earlier request (an agent re-issuing a query, a tool call, a retried step), against plain decoding and
n-gram prompt lookup, side by side in one process. Greedy, so every engine must give the same tokens.

    python bench/suffix_decoding.py [--requests 32] [--distinct 12] [--tokens 128] [--k 8] [--bench-model PATH]

The stream draws each request from `--distinct` prompts with Zipf-like weights (a fixed seed), so the first
occurrence of each prompt is new to every engine and later ones repeat; the table splits the two: suffix decoding
can only win on what it saw before (and on what the request repeats of itself, as n-gram lookup does). Two models:
the embedded demo model (Python-like prompts) and the 90M bench model (random prompt tokens, random weights).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from streamer import LLM, SamplingParams  # noqa: E402

HEADS = ["def fibonacci(n):", "class Parser:\n    def __init__(self, text):", "import os\nimport sys\n\ndef main():",
         "def read_config(path):", "class Cache(dict):", "def parse_args(argv=None):", "def _escape(s):",
         "class Queue:\n    def put(self, item):", "def walk(top, topdown=True):", "def format_date(d):",
         "class Timer:\n    def __enter__(self):", "def merge(a, b):", "def load(fp, *, cls=None):",
         "def quote(string, safe='/'):", "class Error(Exception):", "def copyfile(src, dst):"]


def stream(distinct: int, n: int, seed: int = 0) -> list[int]:
    """Which of the distinct prompts each request is: Zipf-like weights, so a few repeat often."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, distinct + 1)
    return rng.choice(distinct, size=n, p=weights / weights.sum()).tolist()


def run(model: str | None, prompts: list, order: list[int], tokens: int, k: int) -> list[str]:
    engines = {"plain": {}, f"n-gram k={k}": {"num_speculative_tokens": k},
               f"suffix k={k}": {"num_speculative_tokens": k, "speculative_method": "suffix"}}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    seen: set[int] = set()
    first = [i not in seen and not seen.add(i) for i in order]  # (True at each prompt's first occurrence)
    results = {}
    for name, kw in engines.items():
        llm = LLM(model, dtype="float32", **kw)  # (fp32: a k+1-token forward rounds as a 1-token one does)
        llm.generate("x", SamplingParams(max_tokens=4))  # warm up (and one short request in the suffix cache)
        outs, times = [], []
        for i in order:
            t0 = time.perf_counter()
            outs.append(llm.generate(prompts[i], params, use_tqdm=False)[0].outputs[0].token_ids)
            times.append(time.perf_counter() - t0)
        e = llm.engine
        results[name] = (outs, np.array(times), e.num_accepted_tokens / max(e.num_draft_tokens, 1))
        llm.close()
    base_outs, base_t, _ = results["plain"]
    new, rep = np.array(first), ~np.array(first)
    label = "demo model" if model is None else Path(model).name
    rows = []
    for name, (outs, t, acc) in results.items():
        rate = lambda m: tokens * m.sum() / t[m].sum() if m.any() else float("nan")  # noqa: E731
        base_rate = lambda m: tokens * m.sum() / base_t[m].sum() if m.any() else float("nan")  # noqa: E731
        all_ = np.ones(len(order), dtype=bool)
        same = sum(a == b for a, b in zip(outs, base_outs))
        rows.append(f"| {label} | {name} | {rate(all_):.1f} | {rate(all_) / base_rate(all_):.2f}x | "
                    f"{rate(new) / base_rate(new):.2f}x | {rate(rep) / base_rate(rep):.2f}x | "
                    f"{'-' if name == 'plain' else f'{acc:.0%}'} | {same}/{len(order)} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--distinct", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--bench-model", default=str(Path.home() / ".cache" / "streamer-bench" / "llama-90m"))
    ap.add_argument("--demo-only", action="store_true")
    args = ap.parse_args()
    order = stream(args.distinct, args.requests)
    n_new = len(set(order))
    print(f"one stream of {args.requests} requests ({n_new} first occurrences, {args.requests - n_new} repeats), "
          f"{args.tokens} greedy tokens each\n")
    print("| model | decoding | tok/s | vs plain | on first occurrences | on repeats | drafts accepted "
          "| outputs equal to plain |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for row in run(None, HEADS[:args.distinct], order, args.tokens, args.k):
        print(row, flush=True)
    if not args.demo_only:
        rng = np.random.default_rng(1)
        prompts = [{"prompt_token_ids": rng.integers(100, 8000, size=64).tolist()} for _ in range(args.distinct)]
        for row in run(args.bench_model, prompts, order, args.tokens, args.k):
            print(row, flush=True)


if __name__ == "__main__":
    main()
