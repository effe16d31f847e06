"""Prompt embeddings vs token prompts on the embedded demo model, offline: the same prompts given as token ids and
as their embedding rows (what `model.get_input_embeddings()(ids)` makes), greedy, cold prefix cache each time
(`reset_prefix_cache`), then the embedded prompts again with the cache warm. Prints the wall time per case (median
over rounds) and its ratio to the token prompts; every case must produce the same tokens (checked).

    python bench/prompt_embeds.py --prompts 32 --len 256 --tokens 16 --rounds 3
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from streamer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--len", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--tokens", type=int, default=16, help="generated per prompt")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(enable_prompt_embeds=True)
    table = llm.engine.runner.model.embed_tokens.weight
    rng = random.Random(0)
    ids = [[rng.randrange(3, table.shape[0]) for _ in range(args.len)] for _ in range(args.prompts)]
    with torch.no_grad():
        rows = [table[torch.tensor(p)].float().clone() for p in ids]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    cases = {"token ids": [{"prompt_token_ids": p} for p in ids],
             "prompt_embeds": [{"prompt_embeds": r} for r in rows]}
    llm.generate(cases["token ids"][:2], params, use_tqdm=False)  # (warm-up)
    times: dict[str, list[float]] = {name: [] for name in [*cases, "prompt_embeds, cache warm"]}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, prompts in cases.items():
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
        t = time.perf_counter()
        outs = llm.generate(cases["prompt_embeds"], params, use_tqdm=False)
        times["prompt_embeds, cache warm"].append(time.perf_counter() - t)
        outputs["prompt_embeds, cache warm"] = [o.outputs[0].token_ids for o in outs]
        assert all(o.num_cached_tokens > 0 for o in outs)
    assert all(v == outputs["token ids"] for v in outputs.values()), "the cases wrote different tokens"
    base = statistics.median(times["token ids"])
    print(f"{args.prompts} prompts x {args.len} tokens, {args.tokens} generated, median of {args.rounds} rounds; "
          "same tokens in every case")
    print("| case | wall s | vs token ids |\n|---|---:|---:|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} | {base / m:.2f}x |")


if __name__ == "__main__":
    main()
