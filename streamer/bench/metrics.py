"""Per-request results and the run summary, with vLLM bench's definitions.

TTFT: request sent -> first token chunk. ITL: every gap between consecutive token chunks (pooled over requests).
TPOT: (E2E latency - TTFT) / (output tokens - 1), only for requests with more than one output token (for goodput
such requests count as TPOT 0). ITL stalls: the gaps over 3x the run's median gap (the server counts its own
the same way, in streamer:inter_token_stalls_total). E2E latency: request sent -> end of the stream
(`data: [DONE]`).
Throughputs divide by the run's duration (first request sent -> last one finished); only successful requests
count (audio throughput too: the seconds of audio transcribed per second of the run, the real-time factor's
inverse). Peak output throughput and peak concurrency use 1 s buckets from the first successful request's start;
a chunk carries output_tokens / chunks tokens (1 each when the server streams one token per chunk, as vLLM
assumes), and a request is concurrent in every bucket it overlaps.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

STALL_FACTOR = 3.0  # an inter-token gap over this many times the median is a stall

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass(slots=True)
class RequestResult:
    """One request's outcome; times in seconds, `start` relative to the run's start."""

    prompt_len: int = 0  # tokens: the server's usage when reported, else the dataset's count
    output_len: int = 0  # tokens: usage, else tokenized text, else token chunks (see output_len_source)
    asked_output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2E latency
    success: bool = False
    error: str = ""
    output_len_source: str = ""  # "usage" | "tokenizer" | "chunks"
    audio_seconds: float = 0.0  # length of the audio clip the request sent (transcriptions)

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestResult":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Summary:
    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    max_in_flight: int
    request_goodput: Optional[float]
    stats: dict[str, dict[str, float]]  # metric -> {mean, median, std, p50, ...} in milliseconds
    errors: list[tuple[str, int]]  # distinct errors, most frequent first, with counts
    # Inter-token gaps over STALL_FACTOR x the run's median gap: the freezes a reader notices
    itl_stalls: int = 0
    total_audio_seconds: float = 0.0  # clip seconds of the successful requests (transcriptions)
    audio_throughput: Optional[float] = None  # audio seconds transcribed per second; None: no request sent audio

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def describe(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std (population, as numpy) and percentiles (linear interpolation), in milliseconds."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if a.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{percentile_key(p): 0.0 for p in percentiles}}
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({percentile_key(p): float(np.percentile(a, p)) for p in percentiles})
    return out


def token_times(r: RequestResult) -> list[float]:
    """Arrival times (relative to the run's start) of a request's token chunks."""
    t = r.start + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def timeline(ok: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(output tokens, concurrent requests) in each 1 s bucket from the first successful request's start."""
    if not ok:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    t0 = min(r.start for r in ok)
    n = int(math.ceil(max(r.start + r.latency for r in ok) - t0)) + 1
    tokens = np.zeros(n)
    conc = np.zeros(n, dtype=np.int64)
    for r in ok:
        times = token_times(r)
        weight = r.output_len / len(times)
        for t in times:
            tokens[min(int(t - t0), n - 1)] += weight
        conc[int(r.start - t0): int(r.start + r.latency - t0) + 1] += 1
    return tokens, conc


def peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """(peak output tokens/s, peak concurrent requests) over 1 s buckets."""
    tokens, conc = timeline(ok)
    return (float(tokens.max()), int(conc.max())) if len(tokens) else (0.0, 0)


def max_in_flight(ok: Sequence[RequestResult]) -> int:
    """Most requests in flight at one instant (the 1 s-bucket peak counts every request a second overlaps)."""
    edges = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])  # ends sort first
    best = cur = 0
    for _, step in edges:
        cur += step
        best = max(best, cur)
    return best


def goodput_count(ok: Sequence[RequestResult], slo_ms: dict[str, float]) -> int:
    """Successful requests meeting every SLO (ms) in slo_ms (keys: ttft, tpot, e2el)."""
    def value(r: RequestResult, k: str) -> float:
        return {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}[k] * 1000.0

    return sum(all(value(r, k) <= v for k, v in slo_ms.items()) for r in ok)


def summarize(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float] = (50, 90, 99),
              goodput_slo_ms: Optional[dict[str, float]] = None) -> Summary:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    total_audio = float(sum(r.audio_seconds for r in ok))
    dur = duration if duration > 0 else float("nan")
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_len > 1],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.latency for r in ok]}
    peak_tps, peak_conc = peaks(ok)
    goodput = goodput_count(ok, goodput_slo_ms) / dur if goodput_slo_ms else None
    errors = Counter(r.error for r in results if not r.success).most_common()
    itl = np.asarray(values["itl"])
    stalls = int((itl > STALL_FACTOR * np.median(itl)).sum()) if len(itl) else 0
    return Summary(duration=duration, completed=len(ok), failed=len(results) - len(ok),
                   total_input_tokens=total_in, total_output_tokens=total_out,
                   request_throughput=len(ok) / dur, input_throughput=total_in / dur,
                   output_throughput=total_out / dur,
                   total_token_throughput=(total_in + total_out) / dur,
                   max_output_tokens_per_s=peak_tps, max_concurrent_requests=peak_conc,
                   max_in_flight=max_in_flight(ok),
                   request_goodput=goodput,
                   stats={k: describe(v, percentiles) for k, v in values.items()},
                   errors=[(e, c) for e, c in errors],
                   itl_stalls=stalls,
                   total_audio_seconds=total_audio,
                   audio_throughput=total_audio / dur if any(r.audio_seconds for r in results) else None)
