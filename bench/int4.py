"""4-bit (or 8-bit) weights (quantization="int4" / "int8") vs the bf16 model, side by side: weight memory, prefill
and decode speed,
and how long greedy output stays the same.

    python bench/int4.py [--models 90m,1b] [--rounds 3] [--tokens 64] [--compile] [--quantization int8]

Models:
- "demo": the embedded demo model (4M parameters, trained: the only one here whose greedy agreement says much);
- "90m": the shared bf16 bench checkpoint (bench/make_bench_model.py);
- "1b": a Llama-3.2-1B-shaped decoder (hidden 2048, 16 layers, 32 heads / 8 kv heads, intermediate 8192) with the
  bench tokenizer's 8k vocabulary and random (dummy) weights: decode reads ~2 GB of bf16 weights a step;
- "8b": Llama-3-8B's decoder shapes, 8k vocabulary, dummy weights (~14 GiB in bf16: the int4 engine is built
  first, so that its float weights are gone before the bf16 one fills its own).
Per model, two engines with the same settings, rounds alternating between them:
- prefill: one 512-token prompt, 1 output token (time to first token);
- decode tok/s at batch 1 and `--batch` (16): `--tokens` greedy tokens after 128-token prompts, timed from the last
  first token to the last token by the engine's request metrics.
Agreement: the leading greedy tokens (of `--tokens`, the larger batch) the int4 engine shares with bf16. On random weights
it says little: a random model's logits are nearly flat, so the rounding flips near-ties at once.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.models.layers import PackableLinear  # noqa: E402

BENCH = Path.home() / ".cache" / "streamer-bench"
LLAMA_8B_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
LLAMA_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=8192,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)


def model_folder(name: str) -> tuple[Path, dict]:
    bench_90m = BENCH / "llama-90m"
    if not (bench_90m / "config.json").exists():
        raise SystemExit(f"run `python bench/make_bench_model.py` first ({bench_90m} is missing)")
    if name == "90m":
        return bench_90m, {}
    if name == "demo":  # trained weights: the one model here whose greedy agreement means something
        from streamer.demo_model import default_model_path
        return default_model_path(), {}
    folder = BENCH / f"llama-{name}-shape"
    folder.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bench_90m / f, folder / f)
    cfg = json.loads((bench_90m / "config.json").read_text())
    shape = dict(LLAMA_1B, **(LLAMA_8B_SHAPE if name == "8b" else {}))
    (folder / "config.json").write_text(json.dumps(dict(shape, bos_token_id=cfg.get("bos_token_id"),
                                                        eos_token_id=cfg.get("eos_token_id")), indent=1))
    return folder, {"load_format": "dummy"}


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 30)


def linear_bytes(llm: LLM) -> int:
    total = 0
    for m in llm.engine.runner.model.modules():
        if isinstance(m, PackableLinear):
            if m.qweight is not None:
                total += m.qweight.nbytes
                continue
            t = m.packed if m.packed is not None else m.weight
            total += t.numel() * t.element_size()
    return total


def decode_rate(llm: LLM, prompts: list[dict], tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy decode tokens/s: from the last request's first token to the last token (the engine's own clock)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.last_token_time for o in outs)
    return len(prompts) * (tokens - 1) / (end - start), [o.outputs[0].token_ids for o in outs]


def prefill_time(llm: LLM, prompt: dict) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - t0


def bench_model(name: str, rounds: int, compile_: bool, tokens: int, batch: int, quant: str = "int4") -> None:
    folder, extra = model_folder(name)
    common = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False,
                  kv_cache_memory=(1 << 30) if name != "8b" else (1 << 29), enforce_eager=False if compile_ else None,
                  **extra)
    engines = {}
    for q in (quant, "bf16"):  # quantized first: its float weights are gone before the bf16 engine fills its own
        t0, rss0 = time.perf_counter(), rss_gib()
        engines[q] = LLM(str(folder), quantization=None if q == "bf16" else q, **common)
        print(f"[{name}] {q} engine ready in {time.perf_counter() - t0:.1f} s, process memory "
              f"+{rss_gib() - rss0:.2f} GiB (KV cache {common['kv_cache_memory'] / (1 << 30):.2f} GiB of it)",
              flush=True)
    engines = {"bf16": engines["bf16"], quant: engines[quant]}
    rng = random.Random(0)
    vocab = engines["bf16"].engine.vocab_size
    long_prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(512)]}
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(128)]} for _ in range(batch)]
    for llm in engines.values():  # warm-up: every shape the rounds use (the CPU decode kernel compiles per kind)
        for warm in (prompts[:1], prompts, [long_prompt]):
            llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0))
    res: dict[str, dict[str, list[float]]] = {q: {"prefill": [], "b1": [], "bN": []} for q in engines}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for q, llm in engines.items():
            res[q]["prefill"].append(prefill_time(llm, long_prompt))
            res[q]["b1"].append(decode_rate(llm, prompts[:1], tokens)[0])
            rate, outs[q] = decode_rate(llm, prompts, tokens)
            res[q]["bN"].append(rate)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(outs[quant], outs["bf16"])]
    mode = "compiled" if compile_ else "LLM's default (model eager, kernels compiled)"
    print(f"\n{name} ({folder.name}), bf16 activations, {mode}, {rounds} alternating "
          "rounds, medians (range)\n")
    print(f"| weights | linear weight MiB | prefill 512 tok, s | decode tok/s, batch 1 | decode tok/s, batch {batch} |")
    print("|---|---:|---:|---:|---:|")
    med = {q: {k: statistics.median(v) for k, v in r.items()} for q, r in res.items()}
    for q, llm in engines.items():
        cells = []
        for k in ("prefill", "b1", "bN"):
            ratio = med[q][k] / med["bf16"][k]
            cells.append(f"{med[q][k]:.3f} ({min(res[q][k]):.3f}-{max(res[q][k]):.3f}) {ratio:.2f}x"
                         if k == "prefill" else
                         f"{med[q][k]:.1f} ({min(res[q][k]):.1f}-{max(res[q][k]):.1f}) {ratio:.2f}x")
        print(f"| {q} | {linear_bytes(llm) / (1 << 20):.0f} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nleading greedy tokens {quant} shares with bf16 (of {tokens}, batch {batch}): min {min(agree)}, median "
          f"{statistics.median(agree):.0f}, max {max(agree)}\n", flush=True)
    for llm in engines.values():
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="90m,1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="compile both engines (as `streamer serve` does)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode run")
    ap.add_argument("--batch", type=int, default=16, help="the larger decode batch")
    ap.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    args = ap.parse_args()
    for name in args.models.split(","):
        bench_model(name, args.rounds, args.compile, args.tokens, args.batch, args.quantization)


if __name__ == "__main__":
    main()
