"""What LoRA adapters cost: the same offline batch and the same single stream, side by side in one process.

    python bench/lora.py [--model DIR] [--rank 16] [--requests 32] [--rounds 3] [--eager]

Engines: LoRA off; LoRA on but no request names an adapter; every request on one adapter; requests spread over
four adapters (the mixed batch runs one pair of small matmuls per adapter in each layer). The adapters target
every linear with random weights (PEFT's file layout, written here: no PEFT needed). Rounds alternate between
engines, so drift on a noisy machine hits them alike; the table gives medians and the ratio to LoRA off.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from streamer import LLM, SamplingParams  # noqa: E402

BENCH_MODEL = Path.home() / ".cache/streamer-bench/llama-90m"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for `model` with random A and B (scaled to a modest change of each layer's output)."""
    cfg = json.loads((model / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                         "target_modules": TARGETS}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(BENCH_MODEL))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="run the models eagerly (default: compiled, as serve)")
    args = ap.parse_args()
    model = Path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="streamer-lora-bench-"))
    folders = [write_adapter(model, tmp / f"a{i}", args.rank, i) for i in range(4)]
    kw = dict(enforce_eager=args.eager, max_num_seqs=max(args.requests, 8))
    lora_kw = dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    t = time.perf_counter()
    engines = {"LoRA off": (LLM(str(model), **kw), None),
               "LoRA on, no adapter": (LLM(str(model), **kw, **lora_kw), None)}
    on = engines["LoRA on, no adapter"][0]
    for i, f in enumerate(folders):
        on.add_lora(f"a{i}", str(f))
    engines["one adapter"] = (on, ["a0"])
    engines["4 adapters, mixed"] = (on, ["a0", "a1", "a2", "a3"])
    print(f"engines built in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    vocab = on.engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (args.input_len,), generator=g).tolist()}
               for _ in range(args.requests)]
    batch_params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True)
    batch: dict[str, list[float]] = {n: [] for n in engines}
    stream: dict[str, list[float]] = {n: [] for n in engines}
    for llm, names in engines.values():  # warm-up (and the adapters' first load into their slots)
        llm.generate(prompts[:4], SamplingParams(max_tokens=4), lora_request=names[0] if names else None)
    for r in range(args.rounds):
        for name, (llm, names) in engines.items():
            loras = [names[i % len(names)] for i in range(len(prompts))] if names else None
            # (each round's prompts differ a little, so that no round is served from the prefix cache)
            ps = [{"prompt_token_ids": [r + 1] + p["prompt_token_ids"][1:]} for p in prompts]
            t0 = time.perf_counter()
            outs = llm.generate(ps, batch_params, lora_request=loras)
            batch[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            out = llm.generate({"prompt_token_ids": [r + 2, 5, 6, 7]}, stream_params,
                               lora_request=names[0] if names else None)[0].outputs[0]
            stream[name].append(len(out.token_ids) / (time.perf_counter() - t0))
    base_b, base_s = statistics.median(batch["LoRA off"]), statistics.median(stream["LoRA off"])
    mode = "eager" if args.eager else "compiled"
    print(f"\n{model.name}, {mode}, rank {args.rank}, {args.requests} x {args.input_len} in / {args.output_len} out; "
          f"one stream of {args.stream_tokens}; median of {args.rounds} rounds\n")
    print("| engine | batch tok/s | vs LoRA off | stream tok/s | vs LoRA off |")
    print("|---|---:|---:|---:|---:|")
    for name in engines:
        b, s = statistics.median(batch[name]), statistics.median(stream[name])
        print(f"| {name} | {b:.0f} | {b / base_b:.2f}x | {s:.1f} | {s / base_s:.2f}x |")


if __name__ == "__main__":
    main()
