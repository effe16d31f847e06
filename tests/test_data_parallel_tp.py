"""Data parallelism x tensor parallelism on CPU (streamer/engine/data_parallel.py, worker/parallel.py): each replica
is a tensor-parallel group of its own (its own rendezvous store on a free port, its ranks pinned to its share of the
cores, split further among them). DP=2 x TP=2 answers as DP=1 TP=1 does; kill -9 of one replica's TP worker fails
that replica's requests with a message naming the rank and the replica, and the other replica goes on."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from streamer import LLM, SamplingParams
from streamer.engine.dp_router import rendezvous_pick
from tests.server_utils import LiveServer, sse_events

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, list(range(60, 100)), [7, 8, 9, 10]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def model(make_ckpt):
    return make_ckpt("llama_tp", family="llama", seed=3)  # (test_tensor_parallel.py's: TP=2 keeps its greedy tokens)


@pytest.fixture(scope="module")
def reference(model):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(model), dtype="float32", enforce_eager=True) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model, data_parallel_size=2, tensor_parallel_size=2, enforce_eager=True,
                    dp_routing="round_robin", num_kv_blocks=64, dp_max_restarts=0) as s:  # (the kill test)
        tree = []
        for r in s.engine.replicas:
            top = psutil.Process(r.proc.pid)
            tree += [top, *top.children(recursive=True)]
        yield s
    _, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"left behind: {alive}"


def test_dp2_tp2_equals_dp1_tp1(server, reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    got = []
    for p in PROMPTS:
        r = client.completions.create(model=server.model_name, prompt=p, max_tokens=MAX_NEW, temperature=0.0,
                                      logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        got.append([int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens])
    assert got == reference
    assert all(n > 0 for n in server.call(lambda: list(server.engine.router.routed)))
    # each replica is a TP group of two: the replica (rank 0) and one worker process (rank 1) under it
    for rep in httpx.get(server.url + "/health", timeout=10).json()["replicas"]:
        workers = psutil.Process(rep["pid"]).children()
        assert len(workers) == 1 and "streamer.worker.parallel" in " ".join(workers[0].cmdline())


def _stream(url: str, model: str, key: str, out: dict) -> None:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Session-ID": key},
                          timeout=120) as r:
            raw = ""
            for chunk in r.iter_text():
                raw += chunk
                out.setdefault("first", time.monotonic())
            out["events"] = sse_events(raw)
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["end"] = time.monotonic()


def test_a_killed_tp_worker_fails_its_replica_and_the_other_goes_on(server):
    """(Last in this module: it leaves the server with one replica.)"""
    keys: dict[int, str] = {}
    for k in range(100):
        keys.setdefault(rendezvous_pick(f"s{k}", [0, 1]), f"s{k}")
    victim = 1
    reps = httpx.get(server.url + "/health", timeout=10).json()["replicas"]
    replica_pid = reps[victim]["pid"]
    worker = psutil.Process(replica_pid).children()[0]
    outs: list[dict] = [{}, {}]
    threads = [threading.Thread(target=_stream, args=(server.url, server.model_name, keys[i], outs[i]))
               for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all("first" in o for o in outs) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all("first" in o for o in outs), outs
    killed_at = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    dead, alive = outs[victim], outs[1 - victim]
    assert dead["end"] - killed_at < 10.0
    payloads = [json.loads(e) for e in dead.get("events", []) if e != "[DONE]"]
    errors = [p["error"]["message"] for p in payloads if "error" in p]
    assert errors, dead
    assert "tensor-parallel rank 1" in errors[0] and f"data-parallel replica {victim}" in errors[0], errors
    chunks = [json.loads(e) for e in alive["events"] if e != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the replica (rank 0) exits too, and is marked down; the other serves on, session keys included
    psutil.wait_procs([psutil.Process(replica_pid)] if psutil.pid_exists(replica_pid) else [], timeout=15)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        reps = httpx.get(server.url + "/health", timeout=10).json()["replicas"]
        if not reps[victim]["up"]:
            break
        time.sleep(0.1)
    assert reps[victim]["up"] is False and reps[1 - victim]["up"] is True
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=server.model_name, prompt="x =", max_tokens=3,
                                    extra_headers={"X-Session-ID": keys[victim]})
    assert out.choices[0].finish_reason in ("length", "stop")


def test_rank_cpu_shares(monkeypatch):
    """Inside a replica (STREAMER_DP_CPUS) the ranks split the replica's cores; elsewhere they are not pinned, and
    threads come from the process's usable cores, not the machine's."""
    from streamer.worker import rendezvous
    monkeypatch.setattr(rendezvous, "usable_cpus", lambda: [4, 5, 6, 7])
    monkeypatch.delenv("STREAMER_DP_CPUS", raising=False)
    assert rendezvous.rank_cpu_shares(2) is None
    assert rendezvous.rank_threads(2) == 2
    monkeypatch.setenv("STREAMER_DP_CPUS", "4,5,6,7")
    assert rendezvous.rank_cpu_shares(2) == [[4, 5], [6, 7]]
    assert rendezvous.rank_cpu_shares(8) is None  # (fewer cores than ranks: unpinned, one thread each)
    assert rendezvous.rank_threads(8) == 1
    assert rendezvous.rank_threads(2, [6, 7]) == 2
