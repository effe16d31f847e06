"""Expert parallelism against tensor parallelism on a MoE model, side by side in one run: TP=N (every rank a slice
of every expert) and TP=N + enable_expert_parallel (every rank 1/N of the experts, whole), greedy, fp32, eager.

    python bench/expert_parallel.py [--tp 2] [--batches 1,4,16] [--new 32] [--rounds 3] [--out DIR]

Builds (once, under --out) a Qwen3-MoE-shaped checkpoint whose experts dominate its bytes (hidden 1024, 4 layers,
all sparse, 8 experts of 1536 a layer, 2 a token; random weights, fp32). For each mode it reports the expert bytes
each rank holds (each rank counts its own: `ModelRunner.ranks_parameter_bytes`) and the decode tokens/s at each
batch size: (batch x (new - 1)) / (time of `new` tokens - time of 1 token), the median of --rounds, so prefill is
left out. It also checks that both modes produce the same greedy tokens. On a CPU the ranks share its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPE = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             intermediate_size=1536, moe_intermediate_size=1536, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=1024,
             tie_word_embeddings=False)


def make_model(out: Path) -> Path:
    """The bench checkpoint (idempotent): the shape above, transformers' own initialiser, torch seed 0."""
    if (out / "config.json").exists() and (out / "BENCH_MODEL.json").exists():
        return out
    import torch
    import transformers as tf

    from tests.tokenizer_factory import make_bytelevel_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    make_bytelevel_tokenizer(out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])]) + 1
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(vocab_size=vocab, bos_token_id=0, eos_token_id=1, **SHAPE))
    model.save_pretrained(out)
    (out / "BENCH_MODEL.json").write_text(json.dumps({"made_by": "bench/expert_parallel.py", **SHAPE}))
    return out


def timed(llm, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from streamer import SamplingParams
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def measure(model: Path, tp: int, ep: bool, batches: list[int], new: int, rounds: int, scratch: Path):
    from streamer import LLM
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(16)] for _ in range(max(batches))]
    with LLM(str(model), dtype="float32", tensor_parallel_size=tp, enable_expert_parallel=ep, enforce_eager=True,
             enable_prefix_caching=False, max_num_seqs=max(batches)) as llm:
        ranks = llm.engine.runner.ranks_parameter_bytes(scratch)
        timed(llm, prompts[:2], 4)  # warm-up
        rates, tokens = {}, {}
        for b in batches:
            decode = []
            for _ in range(rounds):
                t1, _ = timed(llm, prompts[:b], 1)
                tn, toks = timed(llm, prompts[:b], new)
                decode.append(b * (new - 1) / max(tn - t1, 1e-9))
            rates[b], tokens[b] = statistics.median(decode), toks
    return [r["experts"] for r in ranks], rates, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "streamer-bench" / "qwen3-moe-ep")
    ap.add_argument("--max-load", type=float, default=None, help="wait (up to 10 min) for a 1-min load below this")
    args = ap.parse_args()
    from loadavg import wait_for_load
    batches = [int(b) for b in args.batches.split(",")]
    model = make_model(args.out)
    load = wait_for_load(args.max_load, 600)
    print(f"# {model} (fp32, eager), tp {args.tp}, {os.cpu_count()} CPUs, load {load:.2f}, {args.new} new tokens, "
          f"median of {args.rounds}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for ep in (False, True):
            results[ep] = measure(model, args.tp, ep, batches, args.new, args.rounds, Path(scratch))
    (tp_bytes, tp_rate, tp_tok), (ep_bytes, ep_rate, ep_tok) = results[False], results[True]
    mib = 1024 ** 2
    print("| mode | expert MiB per rank | " + " | ".join(f"decode tok/s @{b}" for b in batches) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in batches) + " |")
    for name, byts, rate in ((f"TP={args.tp}", tp_bytes, tp_rate), (f"TP={args.tp} + EP", ep_bytes, ep_rate)):
        print(f"| {name} | {' / '.join(f'{b / mib:.1f}' for b in byts)} | "
              + " | ".join(f"{rate[b]:.1f}" for b in batches) + " |")
    print(f"| EP / TP | {ep_bytes[0] / tp_bytes[0]:.2f} | " + " | ".join(f"{ep_rate[b] / tp_rate[b]:.2f}x"
                                                                          for b in batches) + " |")
    same = all(ep_tok[b] == tp_tok[b] for b in batches)
    print(f"same greedy tokens in both modes: {same}; load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
