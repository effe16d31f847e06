"""Two `streamer serve` replicas behind vllm-router (pip package `vllm-router`, a Rust binary) on loopback: the real
openai client gets through the router what a replica gives directly (greedy), streaming included; round_robin
spreads requests over both replicas, cache_aware keeps a prompt on the replica that has its prefix, and kv_aware
routes by the KV cache events the replicas publish (--kv-events-config). Which replica served a request is read from
its /metrics (vllm:request_success_total)."""
from __future__ import annotations

import json
import shutil
import socket
import time
from typing import Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server_utils import PipedProcess, metric  # noqa: E402
from tests.test_server_cli import ServeProcess  # noqa: E402

ROUTER = shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")

MODEL = "streamer-demo-pycode"  # the demo model's served name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    procs = [ServeProcess("--port", "0", "--enforce-eager", "--num-kv-blocks", "128") for _ in range(2)]
    try:
        yield [p.wait_url() for p in procs]
    finally:
        for p in procs:
            p.kill()


class Router:
    def __init__(self, workers: list[str], policy: str, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = PipedProcess([ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                                  "--worker-urls", *workers, "--prometheus-host", "127.0.0.1",
                                  "--prometheus-port", str(_free_port()), "--worker-startup-check-interval", "1",
                                  "--log-level", "warning", *extra])

    def __enter__(self) -> "Router":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.proc.poll() is None, f"vllm-router exited: {self.proc.stderr}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"vllm-router did not come up: {self.proc.stderr}")

    def __exit__(self, *exc) -> None:
        self.proc.proc.terminate()
        try:
            self.proc.proc.wait(10)
        except Exception:
            self.proc.proc.kill()
            self.proc.proc.wait(10)


def _served(replicas: list[str]) -> list[float]:
    return [metric(httpx.get(u + "/metrics", timeout=10).text, "vllm:request_success_total") for u in replicas]


def _which(replicas: list[str], before: list[float]) -> int:
    """The replica whose finished-request count went up by one since `before` (the requests are sequential)."""
    deadline = time.monotonic() + 10
    while True:
        delta = [a - b for a, b in zip(_served(replicas), before)]
        if sorted(delta) == [0.0, 1.0]:
            return delta.index(1.0)
        assert time.monotonic() < deadline, f"not one request on one replica: {delta}"
        time.sleep(0.05)


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def __init__(self):"]


def _check_answers(router: Router, replicas: list[str]) -> None:
    """Greedy completions through the router equal a replica's own, and a stream through it adds up to the same."""
    direct = openai.OpenAI(base_url=replicas[0] + "/v1", api_key="none", max_retries=0)
    routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS[:2]:
        want = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        got = routed.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.choices[0].text and got.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens
        chunks = list(routed.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [m.id for m in routed.models.list()] == [MODEL]


def test_round_robin(replicas):
    with Router(replicas, "round_robin") as router:
        _check_answers(router, replicas)
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        hits = [0, 0]
        for i in range(6):
            before = _served(replicas)
            routed.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                      stream=i % 2 == 1)
            hits[_which(replicas, before)] += 1
        assert hits == [3, 3], f"round robin sent {hits} requests to the two replicas"


def test_cache_aware_sticks_by_prefix(replicas):
    """Each prompt, asked again with another ending, goes where its prefix went, and that replica finds the prefix
    in its cache. (vllm-router 0.1.17 with workers of an unnamed model keeps one worker in its prefix tree, so new
    prefixes may all land on the same replica: only stickiness is asserted.)"""
    long_prompts = [p + "\n" + "    x = compute(x, y, z)  # step\n" * 6 for p in PROMPTS]
    with Router(replicas, "cache_aware") as router:
        _check_answers(router, replicas)
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        where: dict[str, set[int]] = {p: set() for p in long_prompts}
        hits_before = [metric(httpx.get(u + "/metrics", timeout=10).text, "vllm:prefix_cache_hits_total")
                       for u in replicas]
        for round_ in range(3):
            for prompt in long_prompts:
                before = _served(replicas)
                routed.completions.create(model=MODEL, prompt=prompt + f"    return {round_}", max_tokens=2,
                                          temperature=0)
                where[prompt].add(_which(replicas, before))
        assert all(len(w) == 1 for w in where.values()), f"a prompt moved between replicas: {where}"
        hits = [metric(httpx.get(u + "/metrics", timeout=10).text, "vllm:prefix_cache_hits_total") - h
                for u, h in zip(replicas, hits_before)]
        for (i,) in where.values():  # the second and third asks found the prefix where it was cached
            assert hits[i] >= 2 * 16, (hits, where)


def test_kv_aware_routes_by_the_published_kv_events():
    """kv_aware learns what each replica caches only from the KV events it publishes (vLLM's wire format over ZMQ):
    a prompt cached on one replica (asked directly, not through the router) sends its follow-ups there, first on
    the second replica, then another on the first."""
    zmq = pytest.importorskip("zmq")
    events = [_free_port(), _free_port()]
    procs = [ServeProcess("--port", "0", "--enforce-eager", "--num-kv-blocks", "128", "--kv-events-config",
                          json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": f"tcp://*:{port}"}))
             for port in events]
    ctx = zmq.Context()
    subs = []  # (our own subscribers beside the router's: once they have a batch, the router's has it too)
    try:
        replicas = [p.wait_url() for p in procs]
        for port in events:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port}")
            subs.append(sub)
        sources = [a for url, port in zip(replicas, events)
                   for a in ("--kv-event-source", f"{url}=tcp://127.0.0.1:{port}")]
        with Router(replicas, "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", MODEL,
                    *sources) as router:
            routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
            shared = "def compute(x):\n" + "    x = x * 2 + 1  # a long shared prefix line\n" * 12
            time.sleep(1.0)  # (a SUB misses what is published before its subscription has arrived)
            for target in (1, 0):
                prompt = shared + f"# cached on replica {target}\n" * 3
                direct = openai.OpenAI(base_url=replicas[target] + "/v1", api_key="none", max_retries=0)
                direct.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
                assert subs[target].poll(30_000), "no KV events published"
                subs[target].recv_multipart()
                time.sleep(1.0)  # (the router's subscriber is as near as ours)
                for k in range(3):
                    before = _served(replicas)
                    routed.completions.create(model=MODEL, prompt=prompt + f"    return {k}", max_tokens=1,
                                              temperature=0)
                    assert _which(replicas, before) == target, f"follow-up {k} did not go to replica {target}"
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()
        for p in procs:
            p.kill()
