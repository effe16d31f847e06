"""What structured outputs cost: the per-step token masks, and end-to-end decode with and without a grammar.

    python bench/structured_output.py [--model DIR] [--rows 1,16,64,256] [--requests 32] [--tokens 64]

Part 1 times, per step, llguidance's masks for R rows (`fill_bitmasks`, rows at five different points of a JSON object)
and the sampler's `apply_bitmask` on [R, V] logits, for the bench model's 8,192-id tokenizer and for a generated
byte-level BPE with Llama-3's 128,256 ids (mask cost grows with the vocabulary).
Part 2 runs the same batch four ways in one process, alternating: unconstrained; constrained by a regex that
admits any text (every step pays for masks and the sync step, the tokens are the same count); and constrained to a
JSON schema (the realistic case, reported for its own tokens/s), with every token sampled and with jump-forward
(tokens the grammar forces appended without a step of their own).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.engine.structured_output import GrammarCompiler, apply_bitmask, fill_bitmasks  # noqa: E402
from streamer.engine.structured_output import StructuredOutputsParams as SO  # noqa: E402
from streamer.tokenizer.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}
# Rows stand at different points of the object: inside a string, before a key, in a number, in an enum, in a list.
PREFIXES = ['{"name":"Ada Lovel', '{"name":"Ada Lovelace",', '{"name":"Ada","age":3', '{"name":"A","age":36,"city":"',
            '{"name":"Ada","age":36,"city":"Lima","tags":["math",']


def big_tokenizer(folder: Path, vocab_size: int = 128256) -> Tokenizer:
    """Byte-level BPE with `vocab_size` ids: bytes, printable-ASCII pairs, then pair + character triples."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (ord(c) > 0x7E, ord(c)))
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1}
    for c in alphabet:
        vocab[c] = len(vocab)
    printable = [c for c in alphabet if 0x21 <= ord(c) <= 0x7E] + ["\u0120"]
    merges = []
    for a in printable:
        for b in printable:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    for a in printable:
        for b in printable:
            for c in printable:
                if len(vocab) >= vocab_size:
                    break
                vocab[a + b + c] = len(vocab)
                merges.append((a + b, c))
    tok = HF(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    return Tokenizer.from_pretrained(folder)


def mask_costs(tok: Tokenizer, rows: list[int], reps: int = 20) -> list[tuple[int, float, float]]:
    vocab = tok.vocab_size
    grammars = GrammarCompiler(tok.to_json(), vocab, sorted(tok.eos_token_ids))
    grammar = grammars.compile(SO(json=SCHEMA))
    prefixes = [tok.encode(p, add_special_tokens=False) for p in PREFIXES]
    out = []
    for r in rows:
        matchers = [grammar.matcher() for _ in range(r)]
        for i, m in enumerate(matchers):
            assert m.consume_tokens(prefixes[i % len(prefixes)]), m.get_error()
        logits = torch.randn(r, vocab)
        idx = torch.arange(r)
        fill, apply = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            mask = fill_bitmasks(matchers, vocab)
            t1 = time.perf_counter()
            apply_bitmask(logits, idx, torch.from_numpy(mask))
            t2 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
        out.append((r, statistics.median(fill) * 1e3, statistics.median(apply) * 1e3))
    return out


def e2e(model: str, requests: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    llm = LLM(model)
    prompts = [[0] + list(range(10 + i, 74 + i)) for i in range(requests)]
    kinds = {
        "unconstrained": SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True),
        "any-text regex": SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True,
                                         structured_outputs=SO(regex=r"(.|\n){0,100000}")),
        "JSON schema, every token sampled": SamplingParams(max_tokens=4 * tokens, temperature=1.0, seed=0,
                                                           structured_outputs=SO(json=SCHEMA)),
    }
    kinds["JSON schema, jump-forward"] = kinds["JSON schema, every token sampled"]
    llm.generate(prompts, kinds["unconstrained"])  # warm up every batch shape once
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    steps: dict[str, float] = {}
    for _ in range(rounds):
        for name, params in kinds.items():
            llm.engine.config.jump_forward = "jump-forward" in name
            n0 = llm.engine.num_steps
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            tokens_out = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(tokens_out / dt)
            # Steps over the mean output: a batch runs as long as its longest output, so this reads best at 1.
            steps[name] = (llm.engine.num_steps - n0) / (tokens_out / len(prompts))
    return rates, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "streamer-bench" / "llama-90m"))
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print("| tokenizer | rows | masks (fill_bitmasks) ms/step | apply_bitmask ms/step | masks us/row |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        toks = [("bench model, 8,192 ids", Tokenizer.from_pretrained(args.model)),
                ("generated BPE, 128,256 ids", big_tokenizer(Path(tmp)))]
        for name, tok in toks:
            for r, fill, apply in mask_costs(tok, rows):
                print(f"| {name} | {r} | {fill:.3f} | {apply:.3f} | {fill / r * 1e3:.0f} |")
    for requests in (1, args.requests):
        rates, steps = e2e(args.model, requests, args.tokens, args.rounds)
        base = statistics.median(rates["unconstrained"])
        print(f"\n{requests} request(s) x {args.tokens} tokens, {args.rounds} alternating rounds (eager, bf16):\n")
        print("| run | output tok/s (median) | per round | vs unconstrained | steps per output token |")
        print("|---|---:|---|---:|---:|")
        for name, r in rates.items():
            med = statistics.median(r)
            print(f"| {name} | {med:.0f} | {', '.join(f'{x:.0f}' for x in r)} | {med / base:.2f}x | "
                  f"{steps[name]:.2f} |")


if __name__ == "__main__":
    main()
