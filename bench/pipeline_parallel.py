"""Pipeline parallelism: PP=2 with two steps in flight against PP=2 with one at a time, side by side in one run
(issue 46: ">= 1.5x"), and the single process for reference; greedy, fp32, eager (stages run eagerly).

    python bench/pipeline_parallel.py [--model DIR] [--requests 32] [--prompt-len 64] [--new 64] [--rounds 2]
        [--compiled]

--compiled adds the single process and PP=2 with two steps in flight compiled (torch.compile, each stage its own
graphs), beside the eager rows.

The model is the 90M bench Llama (bench/make_bench_model.py) unless --model says otherwise. Each stage is a process
with one thread (on this 2-core box: a core each); the single process runs with --threads (default 1: one core's
work, for reference). Reports output tok/s
(all tokens of the run: prompts of --prompt-len, --new tokens each, --requests at once), the median of --rounds,
and checks that every mode produces the same greedy tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_mode(model: str, pp: int, depth: int | None, compiled: bool,
             args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    import torch

    from streamer import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    prompts = [[(31 * r + 7 * i) % 20000 + 100 for i in range(args.prompt_len)] for r in range(args.requests)]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", enforce_eager=not compiled, max_num_seqs=max(args.requests, 8), num_kv_blocks=2048)
    if pp > 1:
        kw.update(pipeline_parallel_size=pp, pipeline_depth=depth)
    times = []
    with LLM(model, **kw) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4))  # warm
        for _ in range(args.rounds):
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            times.append(time.perf_counter() - t)
    tokens = [o.outputs[0].token_ids for o in outs]
    return args.requests * args.new / statistics.median(times), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path.home() / ".cache/streamer-bench/llama-90m"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the single process")
    p.add_argument("--compiled", action="store_true", help="also the compiled single process and PP=2")
    p.add_argument("--mode", help=argparse.SUPPRESS)  # (one mode, in a fresh process: "pp,depth,compiled")
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "bench/make_bench_model.py")], check=True)
    if args.mode:
        pp, depth, compiled = (int(x) for x in args.mode.split(","))
        tok_s, tokens = run_mode(args.model, pp, depth or None, bool(compiled), args)
        print(f"RESULT {tok_s:.3f} {hashlib.sha1(str(tokens).encode()).hexdigest()[:12]}")
        return
    modes = [("one process", "1,0,0"), ("PP=2, one step in flight", "2,1,0"), ("PP=2, two steps in flight", "2,2,0")]
    if args.compiled:
        modes += [("one process, compiled", "1,0,1"), ("PP=2, two steps in flight, compiled", "2,2,1")]
    rows = []
    for name, mode in modes:  # each in its own process: a fresh engine and process group
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--model", args.model,
                              "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
                              "--new", str(args.new), "--rounds", str(args.rounds), "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True).stdout
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
        _, tok_s, digest = line.split()
        rows.append((name, float(tok_s), digest))
    same = len({d for _, _, d in rows}) == 1
    print(f"{args.requests} requests x {args.prompt_len} prompt + {args.new} new tokens, fp32; "
          f"median of {args.rounds}; greedy tokens equal across modes: {same}")
    print("| mode | output tok/s | vs PP=2 one in flight |")
    print("|---|---|---|")
    base = rows[1][1]
    for name, tok_s, _ in rows:
        print(f"| {name} | {tok_s:.1f} | {tok_s / base:.2f}x |")


if __name__ == "__main__":
    main()
