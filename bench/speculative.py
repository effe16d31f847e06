"""Speculative decoding, n-gram drafts, a draft model and an EAGLE head: one stream, with and without, side by side
in one process.

    python bench/speculative.py [--tokens 256] [--rounds 3] [--k 4] [--compiled] [--draft-layers 1] [--eagle PATH]

`--eagle PATH`: an EAGLE-3 head for the demo model, trained by tools/train_eagle_head.py (a row for the demo model).

The draft model is cut from the target itself (its first layers, embeddings and head: a self-speculative draft),
since no trained draft/target pair can be downloaded here; on random weights its acceptance means little.

Two models: the embedded demo model (trained: its code completions repeat themselves, as real outputs that echo
their context do) and the 90M bench model (random weights: its output hardly repeats, so this shows what drafts
cost when they miss). Greedy decoding; the last column counts outputs identical to plain decoding's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer import LLM, SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Parser:\n    def __init__(self, text):", "import os\nimport sys\n\ndef main():"]


def draft_of(model: str | None, keep: int) -> str:
    """A self-speculative draft: the model's embeddings, head and first `keep` layers (tests/test_draft_model.py)."""
    from streamer.engine.llm_engine import resolve_model_dir
    from tests.test_draft_model import first_layers
    out = Path(tempfile.mkdtemp(prefix="streamer-draft-")) / f"first-{keep}"
    return str(first_layers(resolve_model_dir(model), out, keep))


def run(model: str | None, tokens: int, rounds: int, k: int, compiled: bool, draft_layers: int,
        eagle: str | None = None) -> list[str]:
    kw = {} if not compiled else {"enforce_eager": False}
    engines = {"plain": LLM(model, **kw), f"n-gram k={k}": LLM(model, num_speculative_tokens=k, **kw)}
    if draft_layers:
        engines[f"draft: first {draft_layers} layer(s), k={k}"] = LLM(
            model, num_speculative_tokens=k, speculative_model=draft_of(model, draft_layers), **kw)
    if eagle and model is None:  # an EAGLE head trained for the demo model (tools/train_eagle_head.py)
        engines[f"EAGLE-3 head, k={k}"] = LLM(model, num_speculative_tokens=k, speculative_model=eagle, **kw)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for llm in engines.values():
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=8))  # warm up
    for _ in range(rounds):
        for name, llm in engines.items():
            outputs[name] = []
            for prompt in PROMPTS:
                t0 = time.perf_counter()
                out = llm.generate(prompt, params)[0].outputs[0]
                rates[name].append(len(out.token_ids) / (time.perf_counter() - t0))
                outputs[name].append(out.token_ids)
    # fp32 gives the same tokens; in bf16 a k+1-token forward rounds differently from a 1-token one, so a
    # near-tie can flip (as with any batch-shape change), and the outputs part from there.
    base = statistics.median(rates["plain"])
    label = ("demo model" if model is None else Path(model).name) + (", compiled" if compiled else ", eager")
    rows = []
    for name, r in rates.items():
        med = statistics.median(r)
        e = engines[name].engine
        same = sum(a == b for a, b in zip(outputs["plain"], outputs[name]))
        acc = e.num_accepted_tokens / max(e.num_draft_tokens, 1)
        extra = f"{acc:.0%} of {e.num_draft_tokens} | {same}/{len(PROMPTS)}" if name != "plain" else " | "
        rows.append(f"| {label} | {name} | {med:.1f} | {min(r):.1f}-{max(r):.1f} | {med / base:.2f}x | {extra} |")
    for llm in engines.values():
        llm.close()
    return rows

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--compiled", action="store_true", help="also the demo model compiled (about a minute more)")
    ap.add_argument("--draft-layers", type=int, default=1,
                    help="also a draft model cut from each model's first N layers (0: no draft row)")
    ap.add_argument("--bench-model", default=str(Path.home() / ".cache" / "streamer-bench" / "llama-90m"))
    ap.add_argument("--eagle", default=None, metavar="PATH",
                    help="also an EAGLE-3 head for the demo model (tools/train_eagle_head.py --out PATH)")
    ap.add_argument("--demo-only", action="store_true", help="skip the 90M bench model")
    args = ap.parse_args()
    print(f"one stream, {args.tokens} greedy tokens per prompt, {len(PROMPTS)} prompts x {args.rounds} rounds\n")
    print("| model | decoding | tok/s (median) | range | vs plain | drafts accepted | outputs equal to plain |")
    print("|---|---|---:|---|---:|---|---|")
    cases = [(None, False)] + ([] if args.demo_only else [(args.bench_model, False)]) \
        + ([(None, True)] if args.compiled else [])
    for model, compiled in cases:
        for row in run(model, args.tokens, args.rounds, args.k, compiled, args.draft_layers, args.eagle):
            print(row, flush=True)


if __name__ == "__main__":
    main()
