"""A long prompt on a BLOOM-shaped model (ALiBi, 16 heads as bloom-560m's; 4 layers, dummy weights, fp32) on the
torch backend: its prefill time and the process's peak memory with the relative-position mask made whole
([heads, q, L] once a step: the budget set past it) and made a block of query rows at a time (the default budget,
BIAS_MASK_ELEMENTS). Each variant runs in its own process (peak RSS is per process), one after the other.

    python bench/alibi_long_prompt.py [--prompt 4096] [--repeat 2]
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


def folder(prompt: int) -> Path:
    from streamer.demo_model import default_model_path
    out = Path(tempfile.mkdtemp(prefix="streamer-bloom-long-"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / f, out / f)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 1024, "n_layer": 4,
        "n_head": 16, "vocab_size": 8192, "seq_length": prompt + 64}))
    return out


def run(path: str, prompt: int, whole: bool, repeat: int) -> dict:
    import streamer.attention.torch_backend as tb
    from streamer import LLM, SamplingParams
    if whole:
        tb.BIAS_MASK_ELEMENTS = 1 << 40
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with LLM(path, dtype="float32", load_format="dummy", max_num_batched_tokens=prompt,
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--variant", choices=["whole", "rows"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is not None:
        print(json.dumps(run(args.path, args.prompt, args.variant == "whole", args.repeat)))
        return
    path = folder(args.prompt)
    rows = {}
    for variant in ("whole", "rows"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--path", str(path), "--prompt",
                              str(args.prompt), "--repeat", str(args.repeat)], capture_output=True, text=True,
                             check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(path, ignore_errors=True)
    print(f"BLOOM-shaped (16 heads, 4 layers, fp32, dummy weights), one prompt of {args.prompt} tokens in one step")
    print(f"{'mask':<8}{'prefill s':>11}{'peak RSS MiB':>14}{'over loaded MiB':>17}")
    for variant, r in rows.items():
        print(f"{variant:<8}{r['prefill_s']:>11.2f}{r['peak_mib']:>14.0f}{r['over_load_mib']:>17.0f}")
    w, b = rows["whole"], rows["rows"]
    print(f"rows / whole: prefill time {b['prefill_s'] / w['prefill_s']:.2f}x, memory over the loaded model "
          f"{b['over_load_mib'] / max(w['over_load_mib'], 1):.2f}x")


if __name__ == "__main__":
    main()
