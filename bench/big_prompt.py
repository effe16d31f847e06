"""Does one user's over-long prompt stall everyone else? A live `streamer serve`; a 2-token completion (the innocent
request) is timed alone, then while 1 / 4 / 8 clients each send a ~8 MB prompt (refused: far longer than the
model takes), side by side in one run; then the server's RSS after 10 and after 100 such prompts.

    python bench/big_prompt.py [--model DIR] [--tree DIR] [--prompt-mb 8] [--rounds 5] [--max-body-bytes N]

Without --model the embedded demo model serves. --tree: run the server from another checkout (an older commit,
to compare: `git worktree add /tmp/old <commit>`). Prints a table: the innocent request's median time per load and
its ratio to the time alone, and the RSS ratio (issue 49's acceptance: <= 2x beside 8 prompts; RSS within 10%).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    tree = Path(args.tree).resolve() if args.tree else ROOT
    argv = [sys.executable, "-m", "streamer", "serve", "--port", str(port), "--dtype", "float32", "--wait-for-compile",
            "--disable-log-stats", "--log-level", "warning"]
    if args.model:
        argv += ["--model", args.model]
    if args.max_body_bytes:
        argv += ["--max-body-bytes", str(args.max_body_bytes)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def innocent(client: httpx.Client, model: str) -> float:
    t = time.perf_counter()
    r = client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2,
                                             "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t


def big(url: str, body: bytes, statuses: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=600) as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        statuses.append(r.status_code)


def _sender(url: str, body: bytes, go, out) -> None:
    """One client process: connects (a /health request opens the kept-alive connection), waits for the signal, then
    sends its big prompt. Processes, not threads, so that the senders' own GIL does not hold up the innocent
    request's client; the client is made and connected before the signal because making an httpx client (its TLS
    context) costs ~15 ms of CPU, which 8 senders starting at once would take from the 2 cores under test."""
    with httpx.Client(base_url=url, timeout=600) as c:
        c.get("/health").raise_for_status()
        go.wait()
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    out.put(r.status_code)


def beside(url: str, model: str, body: bytes, n: int) -> tuple[float, list[int]]:
    """The innocent request's time while n big prompts are in flight (sent, then it starts 50 ms later)."""
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(url, body, go, out)) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # (all started and waiting)
    go.set()
    time.sleep(0.05)
    with httpx.Client(base_url=url, timeout=600) as c:
        took = innocent(c, model)
    statuses = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return took, statuses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tree", default=None, help="run the server from this checkout")
    ap.add_argument("--prompt-mb", type=float, default=8.0)
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="the server's limit (default: its own, which refuses 8 MB by Content-Length for a small "
                         "model; a larger one makes it read and parse each prompt before refusing it)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rss-prompts", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=30, help="innocent requests sent first, untimed")
    args = ap.parse_args()
    proc, url = start(args)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        text = ("lorem ipsum dolor sit amet " * (int(args.prompt_mb * 1e6) // 27 + 1))[:int(args.prompt_mb * 1e6)]
        body = ('{"model": "%s", "max_tokens": 2, "prompt": "%s"}' % (model, text)).encode()
        statuses: list[int] = []
        for sent in range(args.rss_prompts):
            big(url, body, statuses)
            if sent + 1 == 10:
                rss10 = rss_mb(proc.pid)
        rss100 = rss_mb(proc.pid)
        with httpx.Client(base_url=url, timeout=600) as c:
            for _ in range(args.warmup):  # (first requests compile their shapes)
                innocent(c, model)
            rows = []
            for n in (1, 4, 8):  # each load beside the time alone measured just before it
                alone, loaded, codes = [], [], set()
                for _ in range(args.rounds):
                    alone.append(innocent(c, model))
                    took, st = beside(url, model, body, n)
                    loaded.append(took)
                    codes.update(st)
                a, t = statistics.median(alone), statistics.median(loaded)
                rows.append((f"beside {n} x {args.prompt_mb:g} MB", a, t, t / a, ",".join(map(str, sorted(codes)))))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\nserver tree: {args.tree or ROOT}   model: {args.model or 'demo'}   prompt: {args.prompt_mb:g} MB   "
          f"--max-body-bytes: {args.max_body_bytes or 'default'}\n")
    print("| load | innocent 2-token request alone, median s | beside the load, median s | ratio | "
          "big prompts' statuses |")
    print("|---|---:|---:|---:|---|")
    for name, alone, took, ratio, codes in rows:
        print(f"| {name} | {alone:.3f} | {took:.3f} | {ratio:.2f} | {codes} |")
    print(f"\nRSS after 10 big prompts: {rss10:.0f} MB; after {args.rss_prompts}: {rss100:.0f} MB "
          f"(ratio {rss100 / rss10:.3f}); their statuses: {sorted(set(statuses))}")


if __name__ == "__main__":
    main()
