"""Incremental detokenization per step: 256 sequences, one token each, through DecodeStream (the path of
sentencepiece tokenizers) and through the byte table + Python's incremental UTF-8 decoder (byte-level BPE
tokenizers), on the embedded model's tokenizer, alternated 7 times; medians.

    python bench/detokenizer.py [--seqs 256] [--steps 200]

Two token streams: random ids (as the host-overhead stub's, with many split characters) and slices of real text
(streamer/engine/llm_engine.py's source).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from streamer.demo_model import default_model_path
from streamer.engine.detokenizer import IncrementalDetokenizer
from streamer.sampling_params import SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    fast = Tokenizer.from_pretrained(default_model_path())
    slow = Tokenizer.from_pretrained(default_model_path())
    slow._token_bytes = None  # as a tokenizer without a byte table
    assert fast.token_bytes is not None
    rng = random.Random(0)
    real = fast.encode(Path(__file__).resolve().parents[1].joinpath("streamer/engine/llm_engine.py").read_text(),
                       add_special_tokens=False)
    workloads = {
        "random ids": [[rng.randrange(fast.vocab_size) for _ in range(args.steps)] for _ in range(args.seqs)],
        "real text": [real[s:s + args.steps] for s in (rng.randrange(len(real) - args.steps)
                                                        for _ in range(args.seqs))],
    }
    print(f"{'tokens':<12} {'DecodeStream ms/step':>21} {'byte table ms/step':>19} {'ratio':>6}")
    for name, seqs in workloads.items():
        times: dict[str, list[float]] = {"stream": [], "table": []}
        for _ in range(7):
            texts = {}
            for kind, tok in (("stream", slow), ("table", fast)):
                dets = [IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams()) for _ in seqs]
                t0 = time.perf_counter()
                for step in range(args.steps):
                    for d, s in zip(dets, seqs):
                        d.add_token(s[step])
                times[kind].append((time.perf_counter() - t0) / args.steps * 1000)
                texts[kind] = [d.text + d.flush() for d in dets]
            assert texts["stream"] == texts["table"], "the two paths disagree"
        a, b = statistics.median(times["stream"]), statistics.median(times["table"])
        print(f"{name:<12} {a:>21.3f} {b:>19.3f} {a / b:>5.1f}x")


if __name__ == "__main__":
    main()
