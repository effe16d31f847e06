"""Self-benchmark of `streamer bench`'s load generator: short streamed requests against the instant fake server
(a separate process, so client and server each get a core), for a few load shapes. Prints requests/s achieved,
client CPU per request and the share of one core the client used; the target is >= 1,000 req/s.

    python bench/bench_loadgen.py [--num-prompts 5000] [--output-len 8] [--repeat 3]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from streamer.bench.cli import main as bench_main  # noqa: E402
from streamer.bench.testing import make_tokenizer  # noqa: E402

SHAPES = {"unlimited": [], "concurrency 256": ["--max-concurrency", "256"],
          "concurrency 64": ["--max-concurrency", "64"], "chat, concurrency 64": ["--max-concurrency", "64",
                                                                              "--endpoint", "chat"]}


@contextlib.contextmanager
def fake_server(port: int) -> Iterator[str]:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "streamer.bench.fake_server", "--port", str(port)], cwd=root,
                            stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(root)})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(base + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def one_run(base: str, tok: Path, n: int, out_len: int, shape: list[str], result: Path) -> tuple[float, float]:
    """(requests/s, client CPU seconds in the timed window) of one run; the bench's own table is swallowed."""
    argv = ["--base-url", base, "--tokenizer", str(tok), "--num-prompts", str(n), "--input-len", "16",
            "--output-len", str(out_len), "--progress", "off", "--save-result", str(result), *shape]
    with contextlib.redirect_stdout(io.StringIO()):
        code = bench_main(argv)
    doc = json.loads(result.read_text())
    summary = doc["summary"]
    if code != 0 or summary["failed"]:
        raise RuntimeError(f"run failed: {summary['errors'][:3]}")
    return summary["request_throughput"], doc["client_cpu_seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=5000)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs per shape; the best is reported")
    ap.add_argument("--port", type=int, default=18571)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-loadgen-"))
    tok = make_tokenizer(tmp / "tok")
    print(f"{args.num_prompts} requests x {args.output_len} streamed tokens, instant fake server, "
          f"{os.cpu_count()} CPUs")
    print(f"{'shape':<24}{'req/s (best)':>14}{'req/s (median)':>16}{'client CPU us/req':>19}{'client core %':>15}")
    with fake_server(args.port) as base:
        one_run(base, tok, 500, args.output_len, [], tmp / "r.json")  # warm both processes up
        for name, shape in SHAPES.items():
            runs = [one_run(base, tok, args.num_prompts, args.output_len, shape, tmp / "r.json")
                    for _ in range(args.repeat)]
            rates = sorted(r for r, _ in runs)
            best_rate, best_cpu = max(runs)
            cpu_us = best_cpu / args.num_prompts * 1e6
            share = best_cpu / (args.num_prompts / best_rate) * 100
            print(f"{name:<24}{best_rate:>14.0f}{rates[len(rates) // 2]:>16.0f}{cpu_us:>19.0f}{share:>14.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
