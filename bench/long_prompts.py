"""Long prompts on the torch backend, its two row-block paths against what they replaced, each variant in its own
process (peak RSS is per process), one after the other; dummy weights, fp32, the prompt in one step:

- alibi: a BLOOM-shaped model (16 heads as bloom-560m's, 4 layers): the relative-position mask made whole
  ([heads, q, L], once a step; BIAS_MASK_ELEMENTS set past it) vs a block of query rows at a time (the default);
- window: a Mistral-shaped model with a 512-token sliding window (Gemma 3's local layers' size; 16 heads, 4 KV
  heads, 4 layers): one masked SDPA over every pair (WINDOW_ROWS set past the prompt) vs 256 queries at a time
  over the keys their window reaches (the default);
- causal / causal-chunked: a Llama-shaped model (the same shape, no window), the prompt in one step or in steps
  of 1,024 (each over the keys cached before it): SDPA given [heads, tokens, dim] as before (PyTorch's CPU flash
  kernel takes only 4-D inputs: 3-D ones took the math path) vs given a batch dimension (now).

    python bench/long_prompts.py [--case alibi|window|causal|causal-chunked|all] [--prompt 4096] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


CONFIGS = {
    "alibi": {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 1024, "n_layer": 4,
              "n_head": 16, "vocab_size": 8192},
    "window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
               "intermediate_size": 2816, "vocab_size": 8192, "sliding_window": 512},
    "causal": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
               "intermediate_size": 2816, "vocab_size": 8192},
}
VARIANTS = {"alibi": ("whole", "rows"), "window": ("masked", "rows"), "causal": ("3d", "4d"),
            "causal-chunked": ("3d", "4d")}


def folder(case: str, prompt: int) -> Path:
    from streamer.demo_model import default_model_path
    out = Path(tempfile.mkdtemp(prefix=f"streamer-{case}-long-"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / f, out / f)
    length = {"seq_length": prompt + 64} if case == "alibi" else {"max_position_embeddings": prompt + 64}
    (out / "config.json").write_text(json.dumps({**CONFIGS[case.removesuffix("-chunked")], **length}))
    return out


def run(path: str, prompt: int, variant: str, repeat: int, chunk: int) -> dict:
    import torch.nn.functional as F

    import streamer.attention.torch_backend as tb
    from streamer import LLM, SamplingParams
    if variant == "whole":
        tb.BIAS_MASK_ELEMENTS = 1 << 40
    elif variant == "masked":
        tb.WINDOW_ROWS = 1 << 40
    elif variant == "3d":  # (before: [heads, tokens, dim] straight to SDPA, which takes its math path on CPU)
        tb._sdpa = lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, **kw)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with LLM(path, dtype="float32", load_format="dummy", max_num_batched_tokens=chunk,
             max_model_len=prompt + 64, enforce_eager=True) as llm:
        loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times = []
        for r in range(repeat):
            ids = [(7 * j + r) % 8000 + 10 for j in range(prompt)]
            t = time.perf_counter()
            llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
            times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"prefill_s": min(times), "peak_mib": peak / 1024, "over_load_mib": (peak - max(base, loaded)) / 1024}


def compare(case: str, prompt: int, repeat: int) -> None:
    path = folder(case, prompt)
    rows = {}
    chunk = 1024 if case.endswith("-chunked") else prompt
    for variant in VARIANTS[case]:
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--path", str(path), "--prompt",
                              str(prompt), "--repeat", str(repeat), "--chunk", str(chunk)], capture_output=True,
                             text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(path, ignore_errors=True)
    print(f"{case}: one prompt of {prompt} tokens in steps of {chunk}")
    print(f"{'variant':<8}{'prefill s':>11}{'peak RSS MiB':>14}{'over loaded MiB':>17}")
    for variant, r in rows.items():
        print(f"{variant:<8}{r['prefill_s']:>11.2f}{r['peak_mib']:>14.0f}{r['over_load_mib']:>17.0f}")
    old, new = (rows[v] for v in VARIANTS[case])
    print(f"{VARIANTS[case][1]} / {VARIANTS[case][0]}: prefill time {new['prefill_s'] / old['prefill_s']:.2f}x, memory over the "
          f"loaded model {new['over_load_mib'] / max(old['over_load_mib'], 1):.2f}x\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=[*VARIANTS, "all"], default="all")
    ap.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is not None:
        print(json.dumps(run(args.path, args.prompt, args.variant, args.repeat, args.chunk or args.prompt)))
        return
    for case in (tuple(VARIANTS) if args.case == "all" else (args.case,)):
        compare(case, args.prompt, args.repeat)


if __name__ == "__main__":
    main()
