"""Predicted Outputs (chat's `prediction`) on the embedded demo model: one greedy stream per prompt, with n-gram
speculative decoding off, on without a prediction, and on with the output itself (or an edited copy) predicted.
Prints engine steps and output tokens/s per case, medians over the prompts and rounds; every case must produce the
same tokens (checked).

    python bench/predicted_outputs.py --tokens 160 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from streamer import LLM, SamplingParams
from streamer.demo_model import default_model_path

PROMPTS = ["import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
           "def parse_args():\n", "import json\n\n\ndef load_config(path):\n"]


def edit(text: str) -> str:
    """The prediction a code edit gives: the file with a line added a third of the way in."""
    cut = text.find("\n", len(text) // 3) + 1
    return text[:cut] + "    value = compute(path)\n" + text[cut:]


def run(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], int, float]:
    steps = llm.engine.num_steps
    t = time.perf_counter()
    out = llm.generate([prompt], params)[0].outputs[0]
    return out.token_ids, llm.engine.num_steps - steps, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()
    path = str(default_model_path())
    plain = LLM(path, num_kv_blocks=512)
    spec = LLM(path, num_kv_blocks=512, num_speculative_tokens=args.k)
    p = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rows: dict[str, list[tuple[int, float]]] = {}
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            want, steps, secs = run(plain, prompt, p)
            text = plain.get_tokenizer().decode(want)
            cases = {"no speculative decoding": (plain, p), "n-gram, no prediction": (spec, p),
                     "n-gram + the output predicted": (spec, p.clone(prediction=text)),
                     "n-gram + an edited copy predicted": (spec, p.clone(prediction=edit(text)))}
            for name, (llm, params) in cases.items():
                ids, steps, secs = run(llm, prompt, params)
                assert ids == want, name
                rows.setdefault(name, []).append((steps, len(ids) / secs))
    base = statistics.median(t for _, t in rows["no speculative decoding"])
    print(f"{'case':36} {'steps':>6} {'tok/s':>7} {'vs no spec':>10}")
    for name, vals in rows.items():
        steps, tps = statistics.median(s for s, _ in vals), statistics.median(t for _, t in vals)
        print(f"{name:36} {steps:6.0f} {tps:7.1f} {tps / base:9.2f}x")


if __name__ == "__main__":
    main()
