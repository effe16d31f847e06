"""Data parallelism end to end (streamer/engine/data_parallel.py): replicas are real processes, each a real AsyncEngine.

DP=2 answers as DP=1 does (fp32, greedy and seeded sampling) through the offline LLM and the HTTP server (the
`openai` client); /health lists the replicas, /metrics labels each one's samples with `engine`; a replica killed
with SIGKILL mid-stream fails its requests at once, with a message naming it, while the other replica goes on.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from streamer import LLM, SamplingParams
from streamer.engine.dp_router import rendezvous_pick
from tests.server_utils import LiveServer, metric, sse_events

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "x = [1, 2, 3]\nprint(", "while True:\n    line ="]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]
ENGINE = dict(dtype="float32", num_kv_blocks=256, enforce_eager=True)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """DP=1's outputs (token ids), greedy and seeded."""
    with LLM(str(llama_dir), **ENGINE) as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)]
    return greedy, seeded


def test_offline_dp2_equals_dp1(llama_dir, reference):
    greedy, seeded = reference
    llm = LLM(str(llama_dir), data_parallel_size=2, **ENGINE)
    try:
        pids = [r.proc.pid for r in llm.engine.engine.replicas]
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == greedy
        assert [o.prompt for o in outs] == PROMPTS  # (in the prompts' order)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)] == seeded
        assert all(n > 0 for n in llm.engine.engine.router.routed)  # (both replicas worked)
        with pytest.raises(ValueError, match="data_parallel_size"):
            llm.engine.runner  # noqa: B018  (what only one engine in process has)
    finally:
        llm.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_offline_pooling_and_beam_search_dp2_equal_dp1(llama_dir, ckpt_root):
    """embed, beam_search (each search on one replica), classify and score (a one-label cross-encoder) with DP=2:
    DP=1's results."""
    import numpy as np

    from streamer import BeamSearchParams
    from tests.checkpoints import make_classifier_checkpoint
    texts = PROMPTS[:4]
    beam = BeamSearchParams(beam_width=2, max_tokens=6)

    def generative(dp: int) -> tuple:
        with LLM(str(llama_dir), data_parallel_size=dp, **ENGINE) as llm:
            return ([o.embedding for o in llm.embed(texts)],
                    [[s.token_ids for s in o.sequences] for o in llm.beam_search(texts, beam)])

    def classifiers(dp: int, labels: Path, cross: Path) -> tuple:
        with LLM(str(labels), data_parallel_size=dp, **ENGINE) as llm:
            probs = [o.probs for o in llm.classify(texts)]
        with LLM(str(cross), data_parallel_size=dp, **ENGINE) as llm:
            return probs, [o.score for o in llm.score(texts[0], texts[1:])]

    want_vecs, want_beams = generative(1)
    got_vecs, got_beams = generative(2)
    assert got_beams == want_beams and all(len(b) == 2 for b in got_beams)
    assert all(np.allclose(g, w, atol=1e-5) for g, w in zip(got_vecs, want_vecs))
    labels, cross = ckpt_root / "dp_classifier", ckpt_root / "dp_cross_encoder"
    if not (labels / "config.json").exists():
        make_classifier_checkpoint(labels)
    if not (cross / "config.json").exists():
        make_classifier_checkpoint(cross, labels=("relevant",))
    want_probs, want_scores = classifiers(1, labels, cross)
    got_probs, got_scores = classifiers(2, labels, cross)
    assert all(np.allclose(g, w, atol=1e-5) for g, w in zip(got_probs, want_probs))
    assert np.allclose(got_scores, want_scores, atol=1e-5) and len(got_scores) == 3


@pytest.fixture(scope="module")
def server(llama_dir):
    # (dp_max_restarts=0: the kill test checks a lost replica's state; test_a_killed_replica_is_started_again the
    # restart)
    with LiveServer(llama_dir, data_parallel_size=2, enforce_eager=True, dp_routing="round_robin",
                    dp_max_restarts=0) as s:
        pids = [r.proc.pid for r in s.engine.replicas]
        yield s
    # no orphans: every replica process is gone once the server stopped
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def _completions(client: openai.OpenAI, model: str, params: list[dict]) -> list[list[int]]:
    from concurrent.futures import ThreadPoolExecutor

    def one(args):
        prompt, extra = args
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, logprobs=0, **extra)
        return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]
    with ThreadPoolExecutor(len(params)) as pool:
        return list(pool.map(one, zip(PROMPTS, params)))


def test_server_dp2_equals_dp1(server, reference):
    greedy, seeded = reference
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    ids_extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    got = _completions(client, server.model_name, [{"temperature": 0.0, "extra_body": ids_extra}] * len(PROMPTS))
    assert got == greedy
    got = _completions(client, server.model_name, [{"temperature": 1.0, "top_p": 0.9, "seed": 100 + i,
                                                    "extra_body": ids_extra} for i in range(len(PROMPTS))])
    assert got == seeded
    routed = server.call(lambda: list(server.engine.router.routed))
    assert routed[0] > 0 and routed[1] > 0


def test_health_metrics_and_affinity(server):
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    reps = health.json()["replicas"]
    assert [(r["engine"], r["up"]) for r in reps] == [(0, True), (1, True)]
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    before = server.call(lambda: list(server.engine.router.routed))
    key = "user-42"
    for _ in range(4):  # (round robin, but the session header wins)
        client.completions.create(model=server.model_name, prompt="def f():", max_tokens=2,
                                  extra_headers={"X-Session-ID": key})
    after = server.call(lambda: list(server.engine.router.routed))
    sticky = rendezvous_pick(key, [0, 1])
    assert after[sticky] - before[sticky] == 4 and after[1 - sticky] == before[1 - sticky]
    for _ in range(2):  # (round robin: one on each replica)
        client.completions.create(model=server.model_name, prompt="def g():", max_tokens=2)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "vllm:generation_tokens_total", engine="0") > 0
    assert metric(text, "vllm:generation_tokens_total", engine="1") > 0
    assert text.count("# TYPE vllm:generation_tokens_total") == 1
    assert metric(text, "streamer:dp_replica_up", engine="1") == 1


def _stream(url: str, model: str, key: str, out: dict) -> None:
    body = {"model": model, "prompt": "def main():", "max_tokens": 480, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Session-ID": key},
                          timeout=60) as r:
            raw = ""
            for chunk in r.iter_text():
                raw += chunk
                out.setdefault("first", time.monotonic())
            out["events"] = sse_events(raw)
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["end"] = time.monotonic()
    out["t0"] = t0


def test_a_killed_replica_fails_its_requests_and_the_other_goes_on(server):
    """(Last in this module: it leaves the server with one replica.)"""
    import threading
    keys = {}
    for k in range(100):
        keys.setdefault(rendezvous_pick(f"s{k}", [0, 1]), f"s{k}")
    victim = 0
    pids = [r["pid"] for r in httpx.get(server.url + "/health", timeout=10).json()["replicas"]]
    outs = [{}, {}]
    threads = [threading.Thread(target=_stream, args=(server.url, server.model_name, keys[i], outs[i]))
               for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all("first" in o for o in outs) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all("first" in o for o in outs), outs
    killed_at = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    for t in threads:
        t.join(60)
    dead, alive = outs[victim], outs[1 - victim]
    # the victim's stream ended promptly, with an error naming the replica
    assert dead["end"] - killed_at < 5.0
    payloads = [json.loads(e) for e in dead.get("events", []) if e != "[DONE]"]
    errors = [p["error"] for p in payloads if "error" in p]
    assert errors and "data-parallel replica 0 was lost" in errors[0]["message"], (dead, errors)
    # the other finished all its tokens
    chunks = [json.loads(e) for e in alive["events"] if e != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    reps = health.json()["replicas"]
    assert reps[victim]["up"] is False
    assert "exited" in reps[victim]["error"] or "connection" in reps[victim]["error"]
    assert reps[1 - victim]["up"] is True
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    for _ in range(3):  # (the router skips the dead one, session keys included)
        out = client.completions.create(model=server.model_name, prompt="x =", max_tokens=3,
                                        extra_headers={"X-Session-ID": keys[victim]})
        assert out.choices[0].finish_reason in ("length", "stop")
    assert not psutil.pid_exists(pids[victim]) or psutil.Process(pids[victim]).status() == psutil.STATUS_ZOMBIE
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "streamer:dp_replica_up", engine=str(victim)) == 0


def test_a_killed_replica_is_started_again(llama_dir, tmp_path):
    """kill -9 of an idle replica: it is started again (on its own cores) with the adapters added at runtime, and
    serves its sessions again; the restart budget (dp_max_restarts) is counted and, once spent, a lost replica
    stays down."""
    from tests.lora_adapters import ALL_LINEARS, make_adapter
    adapter = make_adapter(llama_dir, tmp_path / "lora", 1, r=4, alpha=8, targets=ALL_LINEARS)
    keys: dict[int, str] = {}
    for k in range(100):
        keys.setdefault(rendezvous_pick(f"s{k}", [0, 1]), f"s{k}")
    victim = 0

    def health(s: LiveServer) -> list[dict]:
        return httpx.get(s.url + "/health", timeout=10).json()["replicas"]

    def wait_for(s: LiveServer, up: bool, pid_not: int = -1) -> list[dict]:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            reps = health(s)
            if reps[victim]["up"] is up and reps[victim]["pid"] != pid_not:
                return reps
            time.sleep(0.1)
        raise AssertionError(f"replica {victim} not {'up' if up else 'down'}: {health(s)}")

    with LiveServer(llama_dir, data_parallel_size=2, enforce_eager=True, dp_routing="round_robin",
                    enable_lora=True, dp_max_restarts=1, loras={"mine": str(adapter)}) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)

        def ask(model: str) -> str:
            out = client.completions.create(model=model, prompt="x =", max_tokens=4, temperature=0.0,
                                            extra_headers={"X-Session-ID": keys[victim]})
            return out.choices[0].text
        want = ask("mine")
        first = health(s)[victim]["pid"]
        os.kill(first, signal.SIGKILL)
        wait_for(s, up=False)
        reps = wait_for(s, up=True, pid_not=first)  # (started again: a new process)
        assert reps[1 - victim]["up"] is True
        before = s.engine.router.routed[victim]
        assert ask("mine") == want  # (the adapter added at start-up is there again)
        assert s.engine.router.routed[victim] == before + 1
        assert metric(httpx.get(s.url + "/metrics", timeout=10).text, "streamer:dp_replica_restarts_total") == 1
        # the budget (1) is spent: killed again, it stays down
        os.kill(reps[victim]["pid"], signal.SIGKILL)
        wait_for(s, up=False)
        time.sleep(3.0)  # (longer than the next restart's pause would be)
        assert health(s)[victim]["up"] is False and s.engine.restarts == 1
        assert ask("mine") == want  # (the other replica serves the session now)
