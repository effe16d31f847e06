"""Hybrid (recurrent + attention) model step speed: decode at a few batch sizes and prefill of many short prompts
against one long one, offline `LLM.generate`, prefix caching off (the prompts repeat across rounds).

    python bench/hybrid_step.py --model DIR [--dummy] [--rounds 3] [--modes eager,compiled]

A Granite-4.0-H-shaped config to point it at: bench/RESULTS.md (2026-12-01). To compare two versions of the
engine side by side, run it from each checkout in turn (PYTHONPATH=<checkout>) on an otherwise idle machine.
Prints the best of --rounds for each row. With several --modes (eager: enforce_eager=True; compiled:
enforce_eager=False, a lone request's decode steps as one compiled graph) one engine of each runs in this process,
the rounds alternating between them, and the last column is the first mode's time over the last's.
"""
from __future__ import annotations

import argparse
import random
import time

PREFILLS = ((1, 512), (32, 16), (64, 8))  # (prompts, tokens each)
DECODES = ((1, 64), (32, 64))  # (batch, tokens each)


def best_of(rounds: int, fns: list) -> list[float]:
    """Each fn's best time of `rounds`, the fns taking turns within each round."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights (the folder needs only config.json)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="eager", help="comma-separated: eager, compiled")
    args = ap.parse_args()
    import streamer
    from streamer import LLM, SamplingParams
    modes = args.modes.split(",")
    llms = [LLM(args.model, load_format="dummy" if args.dummy else "auto", dtype=args.dtype, max_num_seqs=64,
                enable_prefix_caching=False, enforce_eager=mode != "compiled") for mode in modes]
    vocab = llms[0].engine.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]

    for llm in llms:  # warm-up
        llm.generate(prompts(2, 8), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print(f"engine {streamer.__file__}, model {args.model}, {args.dtype}, best of {args.rounds}")
    ratio = f"{modes[0]}/{modes[-1]}" if len(modes) > 1 else ""
    print(f"{'what':<28}" + "".join(f"{m + ' ms':>14}{'tok/s':>9}" for m in modes) + f"{ratio:>18}")

    def row(what: str, tokens: int, ps: list[dict], params) -> None:
        ts = best_of(args.rounds, [lambda llm=llm: llm.generate(ps, params) for llm in llms])
        cells = "".join(f"{t * 1000:>14.0f}{tokens / t:>9.1f}" for t in ts)
        print(f"{what:<28}{cells}" + (f"{ts[0] / ts[-1]:>17.2f}x" if len(ts) > 1 else ""))

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n, length in PREFILLS:
        row(f"prefill {n} x {length}", n * length, prompts(n, length), one)
    for batch, new in DECODES:
        row(f"decode batch {batch} x {new}", batch * new, prompts(batch, 16),
            SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))


if __name__ == "__main__":
    main()
