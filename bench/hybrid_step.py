"""Hybrid (recurrent + attention) model step speed: decode at a few batch sizes and prefill of many short prompts
against one long one, offline `LLM.generate`, prefix caching off (the prompts repeat across rounds).

    python bench/hybrid_step.py --model DIR [--dummy] [--rounds 3]

A Granite-4.0-H-shaped config to point it at: bench/RESULTS.md (2026-12-01). To compare two versions of the
engine side by side, run it from each checkout in turn (PYTHONPATH=<checkout>) on an otherwise idle machine.
Prints the best of --rounds for each row.
"""
from __future__ import annotations

import argparse
import random
import time

PREFILLS = ((1, 512), (32, 16), (64, 8))  # (prompts, tokens each)
DECODES = ((1, 64), (32, 64))  # (batch, tokens each)


def best_of(rounds: int, fn) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights (the folder needs only config.json)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import streamer
    from streamer import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy" if args.dummy else "auto", dtype=args.dtype, max_num_seqs=64,
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]

    llm.generate(prompts(2, 8), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    print(f"engine {streamer.__file__}, model {args.model}, {args.dtype}, best of {args.rounds}")
    print(f"{'what':<28} {'ms':>9} {'tok/s':>9}")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n, length in PREFILLS:
        ps = prompts(n, length)
        t = best_of(args.rounds, lambda: llm.generate(ps, one))
        print(f"{f'prefill {n} x {length}':<28} {t * 1000:>9.0f} {n * length / t:>9.1f}")
    for batch, new in DECODES:
        ps = prompts(batch, 16)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        t = best_of(args.rounds, lambda: llm.generate(ps, params))
        print(f"{f'decode batch {batch} x {new}':<28} {t * 1000:>9.0f} {batch * new / t:>9.1f}")


if __name__ == "__main__":
    main()
