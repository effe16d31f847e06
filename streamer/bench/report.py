"""Presenting runs: the terminal summary, the JSON result file, the optional plot, and two-run comparison."""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from streamer.bench.metrics import METRIC_NAMES, METRICS, RequestResult, Summary, timeline

RESULT_FORMAT = "streamer-bench/1"
_W = 60


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<44}{value!s:>16}"


def format_summary(s: Summary, *, max_concurrency: Optional[int] = None, client_cpu: Optional[float] = None,
                   max_errors: int = 5, embeddings: bool = False, transcriptions: bool = False) -> str:
    """vLLM's table. `embeddings`: nothing is generated, so the input side and end-to-end latency only.
    `transcriptions`: the input is audio, so its seconds and audio throughput (audio s/s) instead of input tokens."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_W, c="="),
             _row("Successful requests:", s.completed), _row("Failed requests:", s.failed),
             _row("Maximum request concurrency:", max_concurrency if max_concurrency else "unlimited"),
             _row("Benchmark duration (s):", s.duration)]
    if transcriptions:
        lines.append(_row("Total audio (s):", s.total_audio_seconds))
    else:
        lines.append(_row("Total input tokens:", s.total_input_tokens))
    if not embeddings:
        lines.append(_row("Total generated tokens:", s.total_output_tokens))
    lines.append(_row("Request throughput (req/s):", s.request_throughput))
    if s.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", s.request_goodput))
    if transcriptions:
        lines.append(_row("Audio throughput (audio s/s):", s.audio_throughput or 0.0))
    if embeddings:
        lines += [_row("Input token throughput (tok/s):", s.input_throughput),
                  _row("Peak in-flight requests (instant):", s.max_in_flight)]
    else:
        lines += [_row("Output token throughput (tok/s):", s.output_throughput),
                  _row("Peak output token throughput (tok/s):", s.max_output_tokens_per_s),
                  _row("Peak concurrent requests (1 s buckets):", s.max_concurrent_requests),
                  _row("Peak in-flight requests (instant):", s.max_in_flight)]
        if not transcriptions:
            lines.append(_row("Total token throughput (tok/s):", s.total_token_throughput))
    if client_cpu is not None and s.duration > 0:  # near 100% would mean the generator limits the numbers
        lines.append(_row("Load generator CPU (% of one core):", 100.0 * client_cpu / s.duration))
    for m in ("e2el",) if embeddings else METRICS:
        lines.append("{s:{c}^{n}}".format(s=METRIC_NAMES[m], n=_W, c="-"))
        for k, v in s.stats[m].items():
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(k, k.upper())
            lines.append(_row(f"{label} {m.upper()} (ms):", v))
        if m == "itl":
            lines.append(_row("ITL stalls (gaps > 3x median):", s.itl_stalls))
    if s.errors:
        lines.append("{s:{c}^{n}}".format(s="Errors (most frequent first)", n=_W, c="-"))
        lines += [f"{count:>6} x {err[:_W + 40]}" for err, count in s.errors[:max_errors]]
    lines.append("=" * _W)
    return "\n".join(lines)


# --- result files -----------------------------------------------------------------------------------
def save_result(path: str | Path, config: dict[str, Any], summary: Summary,
                results: Sequence[RequestResult], client_cpu: Optional[float] = None) -> None:
    doc = {"format": RESULT_FORMAT, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "config": config, "summary": summary.to_json(), "client_cpu_seconds": client_cpu,
           "requests": [r.to_json() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


def load_result(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != RESULT_FORMAT:
        raise ValueError(f"{path} is not a `streamer bench --save-result` file")
    return doc


# --- comparison -------------------------------------------------------------------------------------
_THROUGHPUT = [("completed", "Successful requests"), ("failed", "Failed requests"),
               ("duration", "Duration (s)"), ("request_throughput", "Request throughput (req/s)"),
               ("request_goodput", "Request goodput (req/s)"),
               ("audio_throughput", "Audio throughput (audio s/s)"),
               ("input_throughput", "Input throughput (tok/s)"),
               ("output_throughput", "Output throughput (tok/s)"),
               ("total_token_throughput", "Total token throughput (tok/s)"),
               ("max_output_tokens_per_s", "Peak output throughput (tok/s)"),
               ("max_concurrent_requests", "Peak concurrent requests (1 s)"),
               ("max_in_flight", "Peak in-flight requests"), ("itl_stalls", "ITL stalls (> 3x median)")]


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Optional[float], Optional[float]]]:
    """(label, value in A, value in B) for the headline numbers and each latency statistic."""
    sa, sb = a["summary"], b["summary"]
    endpoints = (a.get("config", {}).get("endpoint"), b.get("config", {}).get("endpoint"))
    embeddings = "embeddings" in endpoints
    skip = {"output_throughput", "total_token_throughput", "max_output_tokens_per_s"} if embeddings else set()
    if endpoints == ("transcriptions", "transcriptions"):  # (audio in: no input tokens)
        skip |= {"input_throughput", "total_token_throughput"}
    rows = [(label, sa.get(k), sb.get(k)) for k, label in _THROUGHPUT if (sa.get(k) is not None or sb.get(k))
            and k not in skip]
    for m in ("e2el",) if embeddings else METRICS:  # (an embedding's answer comes whole: no token timings)
        keys = [k for k in sa["stats"][m] if k != "std" and k in sb["stats"][m]]
        rows += [(f"{k} {m.upper()} (ms)", sa["stats"][m][k], sb["stats"][m][k]) for k in keys]
    return rows


def _num(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def format_compare(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    head = f"{'':<34}{name_a[:16]:>16}{name_b[:16]:>16}{'B/A':>9}"
    lines = [head, "-" * len(head)]
    for label, va, vb in compare_rows(a, b):
        ratio = f"{vb / va:.2f}x" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        lines.append(f"{label:<34}{_num(va):>16}{_num(vb):>16}{ratio:>9}")
    return "\n".join(lines)


# --- plot -------------------------------------------------------------------------------------------
def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: str | Path, results: Sequence[RequestResult], title: str = "") -> None:
    """TTFT and ITL histograms and output throughput / concurrency over time (1 s buckets) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    tokens, conc = timeline(ok)
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    ax[0].hist(np.array([r.ttft for r in ok]) * 1e3, bins=50)
    ax[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    ax[1].hist(np.array([g for r in ok for g in r.itl]) * 1e3, bins=50)
    ax[1].set(title="Inter-token latency", xlabel="ms", ylabel="gaps")
    ax[2].plot(np.arange(len(tokens)), tokens, label="output tok/s")
    ax[2].set(title="Output throughput", xlabel="s", ylabel="tokens/s")
    twin = ax[2].twinx()
    twin.plot(np.arange(len(conc)), conc, color="tab:orange", label="concurrent requests")
    twin.set_ylabel("concurrent requests")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
