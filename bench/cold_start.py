"""Time to first answer of `streamer serve` on a cold machine (an empty Inductor cache): serving at once while the
model compiles in the background (the default on CPU) against `--wait-for-compile`, side by side in one run.

    python bench/cold_start.py [--model DIR] [--tokens 32]

For each mode, a fresh cache directory: the seconds until /health answers, until the first 2-token completion
returns, and until the log says the model runs compiled; then one greedy completion of --tokens tokens timed while
still compiling (background mode only, if it is) and after. Same greedy text in both modes is checked.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, n: int) -> tuple[float, str]:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "prompt": PROMPT, "max_tokens": n,
        "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["choices"][0]["text"]


def run(args, wait: bool) -> dict:
    port, url = free_port(), None
    cache = tempfile.mkdtemp(prefix="cold-inductor-")
    log = Path(cache) / "server.log"
    argv = [sys.executable, "-m", "streamer", "serve", "--port", str(port), "--dtype", args.dtype]
    argv += ["--model", args.model] if args.model else []
    argv += ["--wait-for-compile"] if wait else []
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    row: dict = {"mode": "--wait-for-compile" if wait else "background compile (default)"}
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        row["health_s"] = time.perf_counter() - t0
        complete(url, 2)
        row["first_answer_s"] = time.perf_counter() - t0
        compiled = re.compile(r"compiled (and warmed up|in the background) in")
        if not compiled.search(log.read_text()):
            took, row["text_early"] = complete(url, args.tokens)
            row["tok_s_while_compiling"] = args.tokens / took
        while not compiled.search(log.read_text()):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        row["compiled_s"] = time.perf_counter() - t0
        complete(url, args.tokens)  # (a first compiled request may meet a new shape's kernels)
        took, row["text"] = complete(url, args.tokens)
        row["tok_s_compiled"] = args.tokens / took
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    rows = [run(args, wait=False), run(args, wait=True)]
    print(f"\nmodel: {args.model or 'demo'}   dtype: {args.dtype}   each run with an empty Inductor cache\n")
    print("| mode | /health, s | first answer, s | compiled, s | tok/s while compiling | tok/s compiled |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        early = f"{r['tok_s_while_compiling']:.1f}" if "tok_s_while_compiling" in r else "-"
        print(f"| {r['mode']} | {r['health_s']:.1f} | {r['first_answer_s']:.1f} | {r['compiled_s']:.1f} | {early} | "
              f"{r['tok_s_compiled']:.1f} |")
    texts = {r["text"] for r in rows} | {r["text_early"] for r in rows if "text_early" in r}
    print(f"\nsame greedy text in every run: {len(texts) == 1}")


if __name__ == "__main__":
    main()
