"""bench/compare_servers.py with the fake server standing in for streamer's and vLLM's servers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamer.bench.testing import make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FAKE = "{python} -m streamer.bench.fake_server --port {port}"


def compare(*args: str) -> subprocess.CompletedProcess[str]:
    # (--settle 0: the test machine is busy with other tests; the settle wait itself is tested below)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "compare_servers.py"), "--settle", "0", *args],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tokenizer(tmp_path_factory.mktemp("tok")))


def bench_args(tokdir: str) -> list[str]:
    return ["--", "--tokenizer", tokdir, "--num-prompts", "10", "--input-len", "8", "--output-len", "4",
            "--max-concurrency", "2", "--progress", "off"]


def test_streamer_only(tmp_path: Path, tokdir: str) -> None:
    p = compare("--model", "fake", "--streamer-cmd", FAKE, "--out-dir", str(tmp_path), *bench_args(tokdir))
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "streamer.json").read_text())
    assert doc["summary"]["completed"] == 10 and doc["config"]["model"] == "fake"
    assert "Serving Benchmark Result" in p.stdout


def test_side_by_side_with_a_stand_in_vllm(tmp_path: Path, tokdir: str) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    slow = "{venv}/bin/python -m streamer.bench.fake_server --port {port} --itl-ms 5"
    p = compare("--model", "fake", "--streamer-cmd", FAKE, "--vllm-venv", str(venv), "--vllm-cmd", slow,
                "--out-dir", str(tmp_path), *bench_args(tokdir))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "vllm.json").is_file() and (tmp_path / "streamer.json").is_file()
    table = p.stdout[p.stdout.index("B/A") - 80:]
    assert "vllm" in table and "streamer" in table and "Request throughput" in table
    vllm_itl = json.loads((tmp_path / "vllm.json").read_text())["summary"]["stats"]["itl"]["mean"]
    assert vllm_itl >= 5.0  # the stand-in's scripted 5 ms gaps (a causal lower bound)


def test_server_that_dies_is_reported(tmp_path: Path, tokdir: str) -> None:
    p = compare("--model", "fake", "--streamer-cmd", "{python} -c 'import sys; print(\"boom\"); sys.exit(3)'",
                "--out-dir", str(tmp_path), *bench_args(tokdir))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "exited with code 3 before it was ready" in p.stderr and "boom" in p.stderr


def test_bad_venv_is_a_usage_error(tmp_path: Path) -> None:
    p = compare("--model", "fake", "--vllm-venv", str(tmp_path / "none"))
    assert p.returncode == 2 and "has no bin/python" in p.stderr


@pytest.mark.slow
def test_real_streamer_server(tmp_path: Path) -> None:
    """The default path: `python -m streamer serve MODEL` on a tiny random-weight checkpoint."""
    pytest.importorskip("streamer.server")
    ckpt = pytest.importorskip("tests.checkpoints").make_checkpoint(tmp_path / "model")
    p = compare("--model", str(ckpt), "--out-dir", str(tmp_path / "out"), "--startup-timeout", "240", "--",
                "--num-prompts", "6", "--input-len", "24", "--output-len", "6", "--ignore-eos",
                "--max-concurrency", "3", "--endpoint", "chat", "--progress", "off")
    assert p.returncode == 0, p.stderr + (tmp_path / "out" / "streamer.log").read_text()[-3000:]
    s = json.loads((tmp_path / "out" / "streamer.json").read_text())["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == 36  # ignore_eos: exactly max tokens each, counted by the server


@pytest.mark.slow
def test_real_streamer_embedding_server(tmp_path: Path) -> None:
    """An embedding workload (`--endpoint embeddings`) on `python -m streamer serve` with a tiny BERT encoder: the
    warm-ups embed too, and the last table gives input tok/s and end-to-end latency."""
    pytest.importorskip("transformers")
    ckpt = pytest.importorskip("tests.encoder_checkpoints").make_encoder_checkpoint(tmp_path / "bert")
    p = compare("--model", str(ckpt), "--out-dir", str(tmp_path / "out"), "--startup-timeout", "240",
                "--server-warmup", "2", "--", "--num-prompts", "6", "--input-len", "12", "--max-concurrency", "3",
                "--endpoint", "embeddings", "--progress", "off")
    assert p.returncode == 0, p.stderr + (tmp_path / "out" / "streamer.log").read_text()[-3000:]
    assert "warm-up request failed" not in p.stdout
    s = json.loads((tmp_path / "out" / "streamer.json").read_text())["summary"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["total_input_tokens"] == 6 * 14
    table = p.stdout[p.stdout.rindex("in tok/s") - 60:]
    assert "E2E med" in table and "streamer" in table


def test_settle_waits_for_an_idle_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """wait_for_idle_cpu: no wait for None; returns at once when the bar cannot be missed (busy share < 1.01); keeps
    measuring until its deadline and says so when the bar cannot be met (busy share < 0)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from loadavg import cpu_busy, wait_for_idle_cpu
    assert 0.0 <= cpu_busy(0.1) <= 1.0
    assert wait_for_idle_cpu(None) == 0.0
    assert wait_for_idle_cpu(1.01, max_wait=5.0) < 1.01 and "still busy" not in capsys.readouterr().out
    assert wait_for_idle_cpu(0.0, max_wait=0.2) >= 0.0
    assert "still busy after 0.2 s: running anyway" in capsys.readouterr().out
