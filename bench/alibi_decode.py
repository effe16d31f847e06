"""What ALiBi costs in decode: a BLOOM-shaped model (its bias through the relative-bias table, gathered per key in
the decode kernels) against a GPT-NeoX-shaped one of the same size (rotary, no bias), dummy weights, fp32, side by
side in one process: single-stream and batch-32 decode tokens per second, eager and compiled.

    python bench/alibi_decode.py [--tokens 128] [--prompt 256] [--batch 32]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.demo_model import default_model_path  # noqa: E402

SHAPE = dict(hidden=768, layers=12, heads=12, vocab=8192)  # (pythia-160m's / bloom-560m's width and depth)


def folder(kind: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"streamer-{kind}-"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / f, out / f)
    h, n, v = SHAPE["hidden"], SHAPE["layers"], SHAPE["vocab"]
    if kind == "bloom":
        cfg = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": h, "n_layer": n,
               "n_head": SHAPE["heads"], "vocab_size": v, "seq_length": 2048}
    else:
        cfg = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": h,
               "num_hidden_layers": n, "num_attention_heads": SHAPE["heads"], "intermediate_size": 4 * h,
               "vocab_size": v, "max_position_embeddings": 2048, "rotary_pct": 0.25, "tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def rate(llm: LLM, batch: int, prompt: int, tokens: int) -> float:
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 8000 + 10 for j in range(prompt)]} for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    rows = {}
    for kind in ("gpt_neox", "bloom"):
        path = folder(kind)
        for compiled in (False, True):
            with LLM(str(path), load_format="dummy", dtype="float32", enforce_eager=not compiled) as llm:
                rows[(kind, compiled)] = [rate(llm, 1, args.prompt, args.tokens),
                                          rate(llm, args.batch, args.prompt, args.tokens)]
        shutil.rmtree(path)
    print(f"decode tok/s, prompt {args.prompt}, {args.tokens} new tokens; {SHAPE}")
    print(f"| model | mode | batch 1 | batch {args.batch} |\n|---|---|---:|---:|")
    for (kind, compiled), (one, many) in rows.items():
        base = rows[("gpt_neox", compiled)]
        ratio = "" if kind == "gpt_neox" else f" ({one / base[0]:.2f}x)"
        ratio_b = "" if kind == "gpt_neox" else f" ({many / base[1]:.2f}x)"
        print(f"| {kind} | {'compiled' if compiled else 'eager'} | {one:.1f}{ratio} | {many:.1f}{ratio_b} |")


if __name__ == "__main__":
    main()
