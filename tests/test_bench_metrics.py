"""streamer bench metrics against values computed by hand (vLLM bench definitions)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from streamer.bench.metrics import RequestResult, describe, goodput_count, peaks, summarize, timeline
from streamer.bench.runner import arrival_times

# Three successes and three failures over a 2 s run. R2's server sent 2 tokens per chunk.
R1 = RequestResult(prompt_len=10, output_len=4, start=0.0, ttft=0.1, itl=[0.05, 0.05, 0.1], latency=0.35, success=True)
R2 = RequestResult(prompt_len=20, output_len=4, start=0.5, ttft=0.2, itl=[0.3], latency=0.6, success=True)
R3 = RequestResult(prompt_len=30, output_len=1, start=1.2, ttft=0.4, itl=[], latency=0.5, success=True)
FAILED = [RequestResult(error="HTTP 500: x"), RequestResult(error="HTTP 429: y"), RequestResult(error="HTTP 500: x")]
ALL = [R1, R2, R3, *FAILED]


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_counts_and_throughputs() -> None:
    s = summarize(ALL, duration=2.0)
    assert (s.completed, s.failed) == (3, 3)
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 9)
    assert s.request_throughput == approx(1.5)
    assert s.output_throughput == approx(4.5)
    assert s.total_token_throughput == approx(34.5)
    assert s.request_goodput is None
    assert s.errors == [("HTTP 500: x", 2), ("HTTP 429: y", 1)]


def test_ttft_stats() -> None:
    st = summarize(ALL, 2.0, percentiles=[50, 90, 99]).stats["ttft"]  # 100, 200, 400 ms
    assert st["mean"] == approx(700 / 3)
    assert st["median"] == approx(200) and st["p50"] == approx(200)
    assert st["std"] == approx(math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3))
    assert st["p90"] == approx(360)  # rank 1.8 between 200 and 400
    assert st["p99"] == approx(396)


def test_tpot_excludes_first_token_and_single_token_requests() -> None:
    # R1: (350-100)/3 = 83.33 ms; R2: (600-200)/3 = 133.33 ms; R3 has one token: left out.
    st = summarize(ALL, 2.0, percentiles=[90, 99]).stats["tpot"]
    assert st["mean"] == approx(325 / 3)
    assert st["median"] == approx(325 / 3)
    assert st["std"] == approx(25)
    assert st["p90"] == approx(250 / 3 + 45)
    assert st["p99"] == approx(250 / 3 + 49.5)
    assert R3.tpot == 0.0 and R1.tpot == approx(0.25 / 3)


def test_itl_pools_every_gap() -> None:
    st = summarize(ALL, 2.0, percentiles=[90, 99, 99.9]).stats["itl"]  # 50, 50, 100, 300 ms
    assert st["mean"] == approx(125)
    assert st["median"] == approx(75)
    assert st["std"] == approx(math.sqrt(42500 / 4))
    assert st["p90"] == approx(240)
    assert st["p99"] == approx(294)
    assert st["p99.9"] == approx(100 + 0.997 * 200)


def test_itl_stalls_are_gaps_over_three_times_the_median() -> None:
    assert summarize(ALL, 2.0).itl_stalls == 1  # median 75 ms: only the 300 ms gap is over 225
    slow = RequestResult(prompt_len=5, output_len=3, ttft=0.1, itl=[0.05, 0.226], latency=0.4, success=True)
    assert summarize([R1, R2, slow], 2.0).itl_stalls == 2  # median 50 ms: 226 and 300 ms
    assert summarize([R3], 1.0).itl_stalls == 0  # (no gaps)


def test_e2el_stats() -> None:
    st = summarize(ALL, 2.0, percentiles=[90]).stats["e2el"]  # 350, 600, 500 ms
    assert st["mean"] == approx(1450 / 3)
    assert st["median"] == approx(500)
    assert st["p90"] == approx(580)


def test_peaks_use_one_second_buckets_and_chunk_weights() -> None:
    # Tokens: R1 at .1 .15 .2 .3; R2 (2 per chunk) at .7 and 1.0; R3 at 1.6. Active: R1 [0], R2 [0,1], R3 [1].
    tokens, conc = timeline([R1, R2, R3])
    assert tokens.tolist() == [6.0, 3.0, 0.0]
    assert conc.tolist() == [2, 2, 0]
    assert peaks([R1, R2, R3]) == (6.0, 2)
    s = summarize(ALL, 2.0)
    assert (s.max_output_tokens_per_s, s.max_concurrent_requests) == (6.0, 2)
    assert peaks([]) == (0.0, 0)
    assert s.max_in_flight == 1  # R1 ends at .35 before R2 starts; R2 ends at 1.1 before R3 starts
    overlapping = [R1, RequestResult(start=0.2, latency=1.0, success=True), RequestResult(start=0.35, latency=0.1)]
    assert summarize(overlapping, 2.0).max_in_flight == 2


@pytest.mark.parametrize("slo,good", [({"ttft": 250, "tpot": 100}, 1), ({"e2el": 500}, 2), ({"tpot": 100}, 2),
                                      ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3), ({"ttft": 50}, 0)])
def test_goodput(slo: dict[str, float], good: int) -> None:
    assert goodput_count([R1, R2, R3], slo) == good
    assert summarize(ALL, 2.0, goodput_slo_ms=slo).request_goodput == approx(good / 2.0)


def test_empty_run_is_all_zeros() -> None:
    s = summarize(FAILED, 1.0, percentiles=[99])
    assert s.completed == 0 and s.failed == 3
    assert s.stats["ttft"] == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    assert describe([], [50]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p50": 0.0}


def test_result_json_round_trip() -> None:
    assert RequestResult.from_json(R1.to_json()) == R1


def test_arrivals_infinite_rate_all_at_once() -> None:
    assert arrival_times(5, math.inf, 1.0, 0).tolist() == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_gamma_process(burstiness: float) -> None:
    t = arrival_times(40_000, 100.0, burstiness, seed=7)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.01, rel=0.03)  # mean gap 1/rate
    cv2 = gaps.var() / gaps.mean() ** 2  # gamma(k): squared coefficient of variation 1/k
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)
    assert np.array_equal(t, arrival_times(40_000, 100.0, burstiness, seed=7))
    assert not np.array_equal(t, arrival_times(40_000, 100.0, burstiness, seed=8))
