"""FP8 KV cache vs the model-dtype cache: capacity, long-context decode speed and agreement, side by side.

    python bench/kv_cache_dtype.py [--model DIR] [--batch 16] [--context 1024] [--tokens 64] [--rounds 3]

Two engines over the same checkpoint (default: the 90M bf16 bench model, bench/make_bench_model.py) with the
same KV budget; rounds alternate between them. Decode tok/s is measured over `--tokens` greedy tokens after a
`--context`-token prompt per request (the time to first token subtracted), where attention reads the whole
context every step. Agreement: how many leading greedy tokens the FP8-cache engine shares with the other.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer import LLM, SamplingParams  # noqa: E402


def decode_rate(llm: LLM, prompts: list[dict], tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy tokens/s of the decode phase: a run of `tokens` minus a run of 1 (prefill and first token)."""
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    total = time.perf_counter() - t0
    return len(prompts) * (tokens - 1) / max(total - first, 1e-9), [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "streamer-bench" / "llama-90m"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    args = ap.parse_args()
    common = dict(kv_cache_memory=int(args.kv_gib * (1 << 30)), max_model_len=args.context + args.tokens + 16,
                  max_num_seqs=args.batch, enable_prefix_caching=False)  # every run prefills in full
    engines = {"auto": LLM(args.model, **common), "fp8": LLM(args.model, kv_cache_dtype="fp8", **common)}
    rng = random.Random(0)
    vocab = engines["auto"].engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.context)]}
               for _ in range(args.batch)]
    for llm in engines.values():  # warm up (and compile the decode kernel for this batch)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rate, outputs[name] = decode_rate(llm, prompts, args.tokens)
            rates[name].append(rate)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(outputs["fp8"], outputs["auto"])]
    print(f"{Path(args.model).name}: {args.batch} requests x {args.context}-token prompts, {args.tokens} greedy "
          f"tokens, {args.rounds} alternating rounds, KV budget {args.kv_gib} GiB\n")
    print("| KV cache | dtype | tokens per GiB of KV | decode tok/s (median) | range | vs auto | "
          "leading tokens equal to auto (min / median) |")
    print("|---|---|---:|---:|---|---:|---|")
    base = statistics.median(rates["auto"])
    for name, llm in engines.items():
        runner = llm.engine.runner
        med = statistics.median(rates[name])
        eq = "" if name == "auto" else f"{min(agree)} / {statistics.median(agree):.0f} of {args.tokens}"
        per_gib = (1 << 30) // runner.kv_bytes_per_block() * runner.block_size
        print(f"| {name} | {str(runner.kv_dtype).replace('torch.', '')} | {per_gib:,} | {med:.1f} | {min(rates[name]):.1f}-"
              f"{max(rates[name]):.1f} | {med / base:.2f}x | {eq} |", flush=True)


if __name__ == "__main__":
    main()
