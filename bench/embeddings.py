"""Embedding throughput: streamer's `LLM.embed` against transformers' batched forward on the same model, side by
side in one process (prompt tokens per second; the outputs are compared too).

    python bench/embeddings.py [--model DIR] [--requests 128] [--min-len 32] [--max-len 256] [--rounds 3]

transformers runs the prompts in batches of `--hf-batch`, padded on the right to the longest in the batch, and
pools the last real token (what streamer's default "last" pooling takes), then normalises.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from streamer import LLM, PoolingParams  # noqa: E402

BENCH_MODEL = Path.home() / ".cache/streamer-bench/llama-90m"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(BENCH_MODEL))
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import transformers as tf
    g = torch.Generator().manual_seed(0)
    llm = LLM(args.model)
    vocab = llm.engine.vocab_size
    lens = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]
    hf = tf.AutoModel.from_pretrained(args.model, dtype=llm.engine.runner.dtype).eval()
    total = sum(lens)

    def run_streamer(r: int) -> list[list[float]]:
        # (a different first token each round: no round is served from the prefix cache)
        outs = llm.embed([{"prompt_token_ids": [r + 1] + p[1:]} for p in prompts], PoolingParams(pooling="last"))
        return [o.embedding for o in outs]

    def run_hf(r: int) -> list[list[float]]:
        vecs = []
        with torch.no_grad():
            for i in range(0, len(prompts), args.hf_batch):
                batch = [[r + 1] + p[1:] for p in prompts[i:i + args.hf_batch]]
                width = max(map(len, batch))
                ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
                mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
                h = hf(input_ids=ids, attention_mask=mask).last_hidden_state
                last = h[torch.arange(len(batch)), mask.sum(1) - 1].float()
                vecs += torch.nn.functional.normalize(last, dim=-1).tolist()
        return vecs

    rates: dict[str, list[float]] = {"streamer": [], "transformers": []}
    run_streamer(100), run_hf(100)  # warm-up
    agree = []
    for r in range(args.rounds):
        outs = {}
        for name, fn in (("streamer", run_streamer), ("transformers", run_hf)):
            t0 = time.perf_counter()
            outs[name] = fn(r)
            rates[name].append(total / (time.perf_counter() - t0))
        cos = [sum(a * b for a, b in zip(u, v)) for u, v in zip(outs["streamer"], outs["transformers"])]
        agree.append(min(cos))
    base = statistics.median(rates["transformers"])
    print(f"\n{Path(args.model).name}, {llm.engine.runner.dtype}, {args.requests} prompts of {args.min_len}-"
          f"{args.max_len} tokens ({total} tokens), median of {args.rounds} rounds; lowest cosine similarity "
          f"between the two engines' embeddings: {min(agree):.5f}\n")
    print("| engine | prompt tok/s | vs transformers |")
    print("|---|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.0f} | {statistics.median(r) / base:.2f}x |")


if __name__ == "__main__":
    main()
