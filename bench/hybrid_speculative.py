"""Speculative decoding on a hybrid (recurrent + attention) model: what verifying drafts and rolling the recurrent
state back cost and save, at a chosen acceptance, next to an attention-only model run the same way.

    python bench/hybrid_speculative.py --model DIR [--dummy] [--dense DIR] [--tokens 128] [--batch 1] [--k 4]

No trained hybrid model (nor a drafter for one) can be downloaded here, and a random model's output hardly repeats,
so n-gram lookup would propose little. The drafts therefore come from an oracle: the plain run's own continuation,
each draft spoilt (replaced by another token) with probability `spoil`; a spoilt draft is rejected and the ones after
it with it. This measures the engine's side of speculative decoding (verify steps, snapshots, rollbacks and the
recomputed tokens after them) at a known acceptance, not any drafter. A row with the real n-gram lookup shows what
its misses cost. Every row checks that the output is identical to plain greedy decoding. On a hybrid, the rows
with many misses run again without the engine's draft backoff (EngineCore._settle_backoff).

Prints per model: tok/s, the ratio to plain decoding, drafts accepted / proposed, rollbacks and steps, best of
--rounds. Prefix caching is off unless --prefix-caching (the prompts repeat across rows and rounds: on, they hit).
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Optional

import numpy as np

SPOILS = (0.0, 0.1, 0.3, 1.0)


class Oracle:
    """streamer.engine.engine_core.propose_ngram's stand-in: the next k tokens of the reference continuation that `tokens`
    starts, each spoilt with probability `spoil`."""

    def __init__(self, sequences: list[list[int]], spoil: float, vocab: int) -> None:
        self.sequences, self.spoil, self.vocab = sequences, spoil, vocab
        self.rng = random.Random(0)

    def __call__(self, tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
        known = tokens.tolist()
        for seq in self.sequences:
            if seq[:len(known)] == known:
                return [t if self.rng.random() >= self.spoil else (t + 1) % self.vocab
                        for t in seq[len(known):len(known) + k]]
        return []


def run_model(path: str, dummy: bool, dtype: str, tokens: int, batch: int, k: int, rounds: int,
              caching: bool) -> list[tuple]:
    import streamer.engine.engine_core
    from streamer import LLM, SamplingParams
    load = "dummy" if dummy else "auto"
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def timed(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        best, outs = float("inf"), []
        for _ in range(rounds):
            t = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            best = min(best, time.perf_counter() - t)
            outs = [o.outputs[0].token_ids for o in res]
        return best, outs

    plain = LLM(path, load_format=load, dtype=dtype, enable_prefix_caching=caching)
    vocab = plain.engine.model_config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(10, vocab) for _ in range(32)] for _ in range(batch)]
    plain.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4))  # warm-up
    steps = plain.engine.num_steps
    base_s, ref = timed(plain, prompts)
    rows = [("plain", base_s, 1.0, "", "", (plain.engine.num_steps - steps) // rounds, True)]
    plain.close()
    sequences = [p + r for p, r in zip(prompts, ref)]
    spec = LLM(path, load_format=load, dtype=dtype, enable_prefix_caching=caching, num_speculative_tokens=k,
               prompt_lookup_min=2)
    spec.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4))
    real, backoff = streamer.engine.engine_core.propose_ngram, streamer.engine.engine_core._MAX_DRAFT_BACKOFF
    hybrid = spec.engine.kv.snapshots is not None
    # (spoil, backoff on): None = the real n-gram lookup; a hybrid's misses also run without the backoff
    runs = [(None, True)] + [(x, True) for x in SPOILS] + ([(x, False) for x in SPOILS if x >= 0.3] if hybrid else [])
    for spoil, on in runs:
        streamer.engine.engine_core.propose_ngram = real if spoil is None else Oracle(sequences, spoil, vocab)
        streamer.engine.engine_core._MAX_DRAFT_BACKOFF = backoff if on else 0
        e = spec.engine
        before = (e.num_draft_tokens, e.num_accepted_tokens, e.num_steps,
                  e.kv.snapshots.num_rollbacks if e.kv.snapshots is not None else 0)
        s, outs = timed(spec, prompts)
        after = (e.num_draft_tokens, e.num_accepted_tokens, e.num_steps,
                 e.kv.snapshots.num_rollbacks if e.kv.snapshots is not None else 0)
        drafts, accepted, steps, rollbacks = ((a - b) // rounds for a, b in zip(after, before))
        name = ("n-gram lookup" if spoil is None else f"oracle, spoil {spoil:.1f}") + ("" if on else ", no backoff")
        rows.append((name, s, base_s / s, f"{accepted}/{drafts}", rollbacks if e.kv.snapshots is not None else "-",
                     steps, outs == ref))
    streamer.engine.engine_core.propose_ngram, streamer.engine.engine_core._MAX_DRAFT_BACKOFF = real, backoff
    spec.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a hybrid model's folder")
    ap.add_argument("--dense", default=None, help="an attention-only model's folder, run the same way beside it")
    ap.add_argument("--dummy", action="store_true", help="random weights (the folders need only config.json)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="on (a hybrid's verify chunks then end at block boundaries, for its state checkpoints)")
    args = ap.parse_args()
    models: list[Optional[str]] = [args.model] + ([args.dense] if args.dense else [])
    print(f"{args.batch} x {args.tokens} tokens, greedy, K={args.k}, {args.dtype}, best of {args.rounds}, prefix "
          f"caching {'on' if args.prefix_caching else 'off'}")
    print(f"{'model':<26} {'drafts':<32} {'s':>7} {'tok/s':>8} {'vs plain':>9} {'accepted':>11} {'rollbacks':>10}"
          f" {'steps':>6} {'same':>5}")
    for path in models:
        rows = run_model(path, args.dummy, args.dtype, args.tokens, args.batch, args.k, args.rounds,  # type: ignore
                         args.prefix_caching)
        for name, s, ratio, acc, rb, steps, same in rows:
            print(f"{str(path)[-26:]:<26} {name:<32} {s:>7.2f} {args.batch * args.tokens / s:>8.1f} {ratio:>8.2f}x"
                  f" {acc:>11} {rb!s:>10} {steps:>6} {'yes' if same else 'NO':>5}")


if __name__ == "__main__":
    main()
