"""Client disconnects abort their requests (streamed or not) and return every KV block; a full queue answers 429
at once; a failed engine answers 503 (and an error event mid-stream)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server_utils import LiveServer, metric, sse_events

# Long enough that no request finishes while a test holds it (the tiny model decodes a token in about a millisecond).
MAX = 60000
LONG = {"model": "long", "prompt": "The quick brown fox", "max_tokens": MAX, "ignore_eos": True,
        "temperature": 0.0}


@pytest.fixture(scope="module")
def long_dir(make_ckpt):
    return make_ckpt("server_disconnect_long", family="llama", max_position_embeddings=65536)


@pytest.fixture(scope="module")
def live(long_dir):
    with LiveServer(long_dir, served_model_name="long", num_kv_blocks=8192) as server:
        yield server


def _metrics(h: httpx.Client) -> str:
    return h.get("/metrics").text


def _aborts(text: str) -> float:
    return metric(text, "vllm:request_success_total", finished_reason="abort")


def _assert_serves(h: httpx.Client) -> None:
    r = h.post("/v1/completions", json={**LONG, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_stream_disconnect_aborts_and_frees_blocks(live):
    with httpx.Client(base_url=live.url, timeout=60) as h:
        before = _metrics(h)
        with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            # Keep the line iterator referenced: a `for ... break` would drop it, and closing it closes the
            # response, i.e. disconnects before the check below (which then raced the server's abort).
            lines = r.iter_lines()
            seen: list[str] = []
            while len(seen) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    seen.append(line)
            held = live.pool_state()
            assert held["streams"] == 1 and held["free"] < held["blocks"], (held, seen)
            lines.close()
        # leaving the block closed the connection mid-stream
        live.wait_idle(30)
        after = _metrics(h)
        assert _aborts(after) == _aborts(before) + 1
        generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
        assert generated < MAX
        assert metric(after, "vllm:kv_cache_usage_perc") == 0 and metric(after, "vllm:num_requests_running") == 0
        _assert_serves(h)


def test_non_streaming_disconnect_aborts(live):
    with httpx.Client(base_url=live.url, timeout=60) as h:
        before = _metrics(h)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            h.post("/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.5))
        live.wait_idle(30)
        after = _metrics(h)
        assert _aborts(after) == _aborts(before) + 1
        assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") < MAX
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/chat/completions", timeout=httpx.Timeout(60, read=1.5), json={
                "model": "long", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX,
                "ignore_eos": True, "n": 2})
        live.wait_idle(30)
        assert _aborts(_metrics(h)) == _aborts(after) + 2  # both sequences of n=2
        _assert_serves(h)


@pytest.mark.parametrize("chat", [False, True])
def test_beam_search_stops_when_its_client_leaves(live, chat):
    """A beam search runs as a request per beam per step: once its client has gone no step may follow."""
    body = {"model": "long", "max_tokens": MAX, "ignore_eos": True, "use_beam_search": True, "n": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "The quick brown fox"})
    with httpx.Client(base_url=live.url, timeout=60) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/chat/completions" if chat else "/v1/completions", json=body,
                   timeout=httpx.Timeout(60, read=1.5))
        live.wait_idle(30)
        before = metric(_metrics(h), "vllm:generation_tokens_total")
        time.sleep(1.0)  # (with the search still going, its next steps would have generated meanwhile)
        assert metric(_metrics(h), "vllm:generation_tokens_total") == before
        assert live.pool_state()["streams"] == 0
        _assert_serves(h)


def test_disconnect_leaves_other_requests_alone(live):
    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as h:
            async def steady() -> dict:
                r = await h.post("/v1/completions", json={**LONG, "max_tokens": 40, "prompt": ["a b", "c d"]})
                return r.json()

            async def quitter() -> None:
                async with h.stream("POST", "/v1/completions",
                                    json={**LONG, "prompt": ["x y", "z"], "n": 2, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
            out, _ = await asyncio.gather(steady(), quitter())
            return out
    out = asyncio.run(main())
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert out["usage"]["completion_tokens"] == 80
    live.wait_idle(30)


# ---------------------------------------------------------------------------------------------- overload
@pytest.fixture(scope="module")
def small(llama_dir):
    with LiveServer(llama_dir, max_num_seqs=1, max_waiting=2) as server:
        yield server


@pytest.mark.parametrize("stream", [False, True])
def test_flood_gets_429_at_once_and_accepted_finish(small, stream):
    body = {"model": "llama", "prompt": "Hello there", "max_tokens": 40, "ignore_eos": True, "stream": stream}

    async def one(h: httpx.AsyncClient) -> tuple[int, float, httpx.Response, str]:
        t = time.monotonic()
        r = await h.post("/v1/completions", json=body)
        return r.status_code, time.monotonic() - t, r, r.text

    async def main():
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=small.url, timeout=120, limits=limits) as h:
            return await asyncio.wait_for(asyncio.gather(*[one(h) for _ in range(16)]), 120)  # none may hang

    results = asyncio.run(main())
    codes = [c for c, *_ in results]
    assert set(codes) <= {200, 429}, codes
    rejected = [(dt, r) for c, dt, r, _ in results if c == 429]
    accepted = [(dt, text) for c, dt, _, text in results if c == 200]
    assert len(rejected) >= 1 and len(accepted) >= 2, codes
    for dt, r in rejected:
        assert r.headers["content-type"].startswith("application/json")  # before any SSE byte
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert dt < max(a for a, _ in accepted)  # refused at once, not after waiting its turn
    for _, text in accepted:
        if stream:
            events = sse_events(text)
            assert events[-1] == "[DONE]"
            assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 40
    small.wait_idle(30)


# ---------------------------------------------------------------------------------------------- engine failure
def test_engine_failure_mid_stream_and_after(llama_dir):
    with LiveServer(llama_dir) as live, httpx.Client(base_url=live.url, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json={
                "model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"

            def boom(*a, **k):
                raise RuntimeError("device lost")
            live.call(lambda: setattr(live.engine.engine.runner, "launch", boom))
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["type"] == "service_unavailable" and "device lost" in err["message"]
        assert h.get("/health").status_code == 503
        r = h.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
