"""streamer bench against a live scripted server on 127.0.0.1: timings, token counts, failures, load shape.

No wall-clock expectations: timings are checked against causal lower bounds (a chunk cannot arrive before the
server's scripted delays have passed) and every summary number against a hand computation from the recorded
per-request timestamps.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
from tokenizers import Tokenizer

from streamer.bench.cli import run_loop
from streamer.bench.datasets import SampleRequest, count_tokens, load_tokenizer, synthetic_requests
from streamer.bench.fake_server import FakeServer, Plan, Script
from streamer.bench.metrics import RequestResult, summarize, token_times
from streamer.bench.runner import RunConfig, RunOutput, arrival_times, run
from streamer.bench.testing import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))


def reqs(n: int, out: int = 4) -> list[SampleRequest]:
    return [SampleRequest(f"prompt number {i}", 3, out) for i in range(n)]


def bench(script: Script, requests: Sequence[SampleRequest], tok: Optional[Tokenizer] = None,
          server_kw: Optional[dict[str, Any]] = None, **cfg: Any) -> tuple[RunOutput, FakeServer]:
    with FakeServer(script, **(server_kw or {})) as srv:
        out = run_loop(run(RunConfig(base_url=srv.base_url, **cfg), requests, tok))
    return out, srv


def pct(values: list[float], p: float) -> float:
    """Linear-interpolation percentile, written out by hand."""
    s = sorted(values)
    rank = p / 100 * (len(s) - 1)
    lo = math.floor(rank)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (rank - lo)


DELAYS = [[0.06, 0.02, 0.04, 0.01], [0.03, 0.05, 0.0, 0.03], [0.01, 0.01, 0.08, 0.02]]
DONE_DELAY = 0.02


def scripted(i: int, body: dict[str, Any]) -> Plan:
    k = int(body["prompt"].split()[-1])  # the request's own script, whatever order requests arrive in
    return Plan(delays=DELAYS[k % 3], done_delay=DONE_DELAY, pieces=["a", "b", "c", "d"][: body["max_tokens"]])


def test_timings_obey_the_script_and_metrics_match_hand_computation() -> None:
    out, srv = bench(scripted, reqs(6), model="m", max_concurrency=3)
    assert srv.count == 6 and len(out.results) == 6
    for i, r in enumerate(out.results):
        d = DELAYS[i % 3]
        assert r.success, r.error
        assert (r.output_len, r.output_len_source, r.prompt_len) == (4, "usage", 3)  # server-counted words
        assert len(r.itl) == 3
        assert r.ttft >= d[0]  # causal lower bounds
        assert r.ttft + sum(r.itl) >= sum(d) - 1e-9
        assert r.latency >= sum(d) + DONE_DELAY
        assert r.latency >= r.ttft + sum(r.itl) - 1e-9
        assert r.tpot == pytest.approx((r.latency - r.ttft) / 3)
    ok = out.results
    s = summarize(ok, out.duration, [50, 90, 99], {"ttft": 1e3 * statistics.median(r.ttft for r in ok)})
    ms = lambda xs: [1000 * x for x in xs]  # noqa: E731
    by_hand = {"ttft": ms([r.ttft for r in ok]), "tpot": ms([(r.latency - r.ttft) / 3 for r in ok]),
               "itl": ms([g for r in ok for g in r.itl]), "e2el": ms([r.latency for r in ok])}
    for metric, vals in by_hand.items():
        st = s.stats[metric]
        assert st["mean"] == pytest.approx(statistics.fmean(vals))
        assert st["median"] == pytest.approx(statistics.median(vals))
        assert st["std"] == pytest.approx(statistics.pstdev(vals), abs=1e-9)
        for p in (50, 90, 99):
            assert st[f"p{p}"] == pytest.approx(pct(vals, p))
    assert s.request_throughput == pytest.approx(6 / out.duration)
    assert s.output_throughput == pytest.approx(24 / out.duration)
    assert s.total_token_throughput == pytest.approx((24 + 18) / out.duration)
    assert s.request_goodput == pytest.approx(sum(r.ttft <= statistics.median(x.ttft for x in ok) for r in ok)
                                              / out.duration)
    t0 = min(r.start for r in ok)
    buckets: dict[int, float] = {}
    for r in ok:
        for t in token_times(r):
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    assert s.max_output_tokens_per_s == max(buckets.values())
    assert s.max_concurrent_requests == max(
        sum(int(r.start - t0) <= b <= int(r.start + r.latency - t0) for r in ok) for b in buckets)
    assert out.duration >= max(r.start + r.latency for r in ok) - 1e-9
    assert 1 <= srv.max_in_flight <= 3 and 1 <= s.max_in_flight <= 3


def test_chat_endpoint_and_request_bodies(tok: Tokenizer) -> None:
    out, srv = bench(lambda i, b: Plan(pieces=["Hel", "lo", "!"]), reqs(3, out=5), endpoint="chat", model="m",
                     ignore_eos=True, temperature=0.5, extra_body={"top_p": 0.9})
    assert all(r.success and r.output_len == 3 and len(r.itl) == 2 for r in out.results)
    body = srv.received[0]
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith("prompt number")
    assert body["max_completion_tokens"] == 5 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.5 and body["top_p"] == 0.9 and body["model"] == "m"
    out, srv = bench(lambda i, b: Plan(), reqs(1, out=2), model="m")
    body = srv.received[0]
    assert body["prompt"] == "prompt number 0" and body["max_tokens"] == 2 and "ignore_eos" not in body


def test_model_discovered_from_v1_models() -> None:
    out, srv = bench(lambda i, b: Plan(), reqs(2), server_kw={"model": "served-name"})
    assert out.model == "served-name" and srv.received[0]["model"] == "served-name"


def test_tokens_counted_from_text_without_usage(tok: Tokenizer) -> None:
    pieces = ["hello", " wor", "ld", " é中"]
    out, _ = bench(lambda i, b: Plan(pieces=pieces, usage=False), reqs(2), tok, model="m")
    for r in out.results:
        assert r.success and r.output_len_source == "tokenizer"
        assert r.output_len == count_tokens(tok, "".join(pieces))
        assert r.prompt_len == 3  # the dataset's count when the server reports none
    out, _ = bench(lambda i, b: Plan(pieces=pieces, usage=False), reqs(2), None, model="m")
    assert [(r.output_len, r.output_len_source) for r in out.results] == [(4, "chunks")] * 2


def test_usage_overrides_counts() -> None:
    out, _ = bench(lambda i, b: Plan(pieces=["ab", "cd"], prompt_tokens=77, completion_tokens=5), reqs(1), model="m")
    assert (out.results[0].prompt_len, out.results[0].output_len) == (77, 5)


def failing(i: int, body: dict[str, Any]) -> Plan:
    k = int(body["prompt"].split()[-1]) % 6
    return [Plan(status=500), Plan(status=429, error_body='{"error": {"message": "queue full"}}'),
            Plan(disconnect_after=2, delays=[0.01]), Plan(error_after=1, delays=[0.01]),
            Plan(disconnect_after=4), Plan()][k]


def test_failures_are_counted_and_the_run_completes() -> None:
    out, srv = bench(failing, reqs(12), model="m", max_concurrency=4)
    s = summarize(out.results, out.duration)
    assert (s.completed, s.failed) == (2, 10) and srv.count == 12
    errors = dict(s.errors)
    assert errors["HTTP 429: queue full"] == 2
    assert errors["HTTP 500: scripted failure"] == 2
    assert errors["error in stream: scripted failure"] == 2
    assert errors["server closed the connection after the headers"] == 4
    assert all(r.success == (int(i) % 6 == 5) for i, r in enumerate(out.results))


def test_unreachable_server_fails_every_request() -> None:
    with FakeServer() as srv:
        url = srv.base_url
    out = run_loop(run(RunConfig(base_url=url, model="m"), reqs(3)))
    assert [r.success for r in out.results] == [False] * 3
    assert all(r.error.startswith("connect failed") for r in out.results)


def test_timeout_counts_as_failure() -> None:
    out, _ = bench(lambda i, b: Plan(delays=[0.0, 30.0]) if i == 0 else Plan(), reqs(2), model="m", timeout=0.5,
                   max_concurrency=1)
    assert [r.success for r in out.results] == [False, True]
    assert out.results[0].error == "timed out after 0.5 s"


def test_api_key() -> None:
    out, _ = bench(lambda i, b: Plan(), reqs(2), model="m", api_key="s3cret", server_kw={"api_key": "s3cret"})
    assert all(r.success for r in out.results)
    out, _ = bench(lambda i, b: Plan(), reqs(2), model="m", api_key="wrong", server_kw={"api_key": "s3cret"})
    assert all(r.error == "HTTP 401: bad api key" for r in out.results)


def test_warmups_are_sent_but_not_counted() -> None:
    out, srv = bench(lambda i, b: Plan(), reqs(4), model="m", num_warmups=3)
    assert srv.count == 7 and len(out.results) == 4


def test_request_rate_schedule_is_respected() -> None:
    n, rate = 8, 40.0
    out, _ = bench(lambda i, b: Plan(), reqs(n), model="m", request_rate=rate, burstiness=0.5, seed=3)
    offsets = arrival_times(n, rate, 0.5, 3)
    assert all(r.start >= offsets[i] - 1e-6 for i, r in enumerate(out.results))  # never sent early
    assert out.duration >= offsets[-1]


def test_seed_makes_runs_repeatable(tok: Tokenizer) -> None:
    def sent(seed: int) -> list[tuple[str, int]]:
        data = synthetic_requests(tok, 8, input_len=12, output_len=6, range_ratio=0.5, seed=seed)
        _, srv = bench(lambda i, b: Plan(), data, model="m")
        return sorted((b["prompt"], b["max_tokens"]) for b in srv.received)

    assert sent(5) == sent(5)
    assert sent(5) != sent(6)


def test_keep_alive_reuses_connections() -> None:
    conns: set[int] = set()

    def script(i: int, body: dict[str, Any]) -> Plan:
        return Plan()

    with FakeServer(script) as srv:
        orig = srv.route

        def route(proto: Any, *a: Any) -> None:
            conns.add(id(proto))
            orig(proto, *a)

        srv.route = route  # type: ignore[method-assign]
        out = run_loop(run(RunConfig(base_url=srv.base_url, model="m", max_concurrency=2), reqs(20)))
    assert all(r.success for r in out.results)
    assert len(conns) <= 2


def test_result_start_times_are_relative(tmp_path: Path) -> None:
    out, _ = bench(lambda i, b: Plan(), reqs(3), model="m")
    assert all(0 <= r.start <= out.duration for r in out.results)
    assert all(isinstance(r, RequestResult) for r in out.results)


def test_remote_tokenizer_agrees_with_the_local_one(llama_dir: Path) -> None:
    """RemoteTokenizer (the served model's tokenizer through a live streamer server's POST /tokenize and
    /detokenize, for a server whose folder is not on the bench's machine) encodes and decodes as the folder's own
    tokenizer does, finds the vocabulary's size and the BOS, builds random prompts of exact lengths, counts the
    output of streams without usage, and says what went wrong when the server refuses or is gone."""
    from streamer.bench.remote_tokenizer import RemoteTokenizer, RemoteTokenizerError
    from streamer.bench.runner import count_output_tokens
    from tests.server_utils import LiveServer

    local = load_tokenizer(llama_dir)
    texts = ["Hello, world", "  two  spaces", "é中 unicode", ""]
    with LiveServer(llama_dir, api_key="k") as server:
        remote = RemoteTokenizer(server.base_url, api_key="k")  # (.../v1: /tokenize is beside it)
        for text in texts:
            for special in (True, False):
                assert remote.encode(text, special).ids == local.encode(text, add_special_tokens=special).ids
        ids = local.encode("Hello, world").ids
        assert remote.decode(ids) == local.decode(ids, skip_special_tokens=False)
        assert remote.vocab_size == local.get_vocab_size(with_added_tokens=True)
        assert remote.special_ids() == set(local.encode("").ids)  # the BOS
        assert list(remote.token_ids()) == list(range(remote.vocab_size))
        sent = remote.requests
        reqs = synthetic_requests(remote, 6, input_len=30, output_len=4, prefix_len=5, num_prefixes=2, seed=3)
        assert remote.requests > sent  # (a prompt costs a few: decode, re-encode, adjust)
        for r in reqs:
            assert r.prompt_len == 35 == count_tokens(local, r.prompt)
        assert len({r.prompt for r in reqs}) == 6
        results = [RequestResult() for _ in texts]
        count_output_tokens(list(zip(results, texts)), remote)
        assert [(r.output_len, r.output_len_source) for r in results] == [
            (count_tokens(local, t), "tokenizer") for t in texts]
        with pytest.raises(RemoteTokenizerError, match="HTTP 401"):
            RemoteTokenizer(server.url).encode("hi")
        with pytest.raises(RemoteTokenizerError, match="HTTP 404.*does not exist"):
            RemoteTokenizer(server.url, model="another", api_key="k").encode("hi")
        with pytest.raises(RemoteTokenizerError, match="HTTP 400"):
            remote.decode([remote.vocab_size])
    with pytest.raises(RemoteTokenizerError, match="POST /tokenize failed"):
        remote.encode("the server has gone")
    results = [RequestResult(output_len=2, output_len_source="chunks")]
    count_output_tokens([(results[0], "ab")], remote)  # (counts by chunks stand, with a warning)
    assert (results[0].output_len, results[0].output_len_source) == (2, "chunks")
