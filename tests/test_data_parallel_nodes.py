"""Data-parallel replicas on two "nodes" (docs/data-parallel.md, vLLM's flags): a head (`serve -dp 2
--data-parallel-size-local 1 --data-parallel-address A --data-parallel-rpc-port P`: replica 0, the router, the HTTP
server) and a headless node (`... --data-parallel-start-rank 1 --headless`: replica 1), which joins the head through
its rendezvous store. On loopback and in two network namespaces joined by a veth pair (nothing can fall back to
127.0.0.1 there): greedy outputs through the openai client equal DP=1's, both replicas serve; kill -9 of the headless
node marks its replica down, the head serves on with its own, and nothing is left of the node."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from tests.test_multi_node import (  # noqa: E402
    BOUND_S,
    MAX_NEW,
    PROMPTS,
    REPO,
    Proc,
    _assert_all_gone,
    _free_port,
    _in_netns,
    _namespaces,
    _on,
    _reference,
)


def _serve(model: Path, *args: str, prefix: tuple[str, ...] = ()) -> Proc:
    return Proc([*prefix, sys.executable, "-m", "streamer", "serve", str(model), "--dtype", "float32",
                 "--enforce-eager", "--num-kv-blocks", "64", *args])


@contextlib.contextmanager
def dp_nodes(model: Path, address: str = "127.0.0.1", head_prefix: tuple[str, ...] = (),
             node_prefix: tuple[str, ...] = ()) -> Iterator[tuple[Proc, Proc, str]]:
    meet = ("-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", address,
            "--data-parallel-rpc-port", str(_free_port()), "--dp-routing", "round_robin")
    head = _serve(model, *meet, "--port", "0", prefix=head_prefix)
    node = _serve(model, *meet, "--data-parallel-start-rank", "1", "--headless", prefix=node_prefix)
    try:
        yield head, node, head.wait_url(others=(node,))
    finally:
        head.kill()
        node.kill()


def _greedy(url: str) -> list[list[int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = []
    for p in PROMPTS + PROMPTS:  # (round robin: each prompt on both replicas)
        r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0.0, logprobs=0,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        out.append([int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens])
    return out


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def _node_killed_then_head_serves_on(head: Proc, node: Proc, url: str, pool=None) -> None:
    call = (lambda fn, *a: _on(pool, fn, *a)) if pool is not None else (lambda fn, *a: fn(*a))
    node_tree = node.tree()
    assert len(node_tree) == 2, node_tree  # the node and its replica
    node.proc.send_signal(signal.SIGKILL)
    _assert_all_gone(node_tree, "after the node was killed")  # (its replica dies with it)
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        reps = call(_health, url)["replicas"]
        if not reps[1]["up"]:
            break
        time.sleep(0.1)
    assert [r["up"] for r in reps] == [True, False], reps
    assert "was lost" in head.stderr or "connection ended" in reps[1]["error"], (reps, head.stderr)
    got = call(_greedy, url)  # (every request now on replica 0)
    assert len(got) == 2 * len(PROMPTS)
    assert head.proc.poll() is None


def test_headless_node_on_loopback(llama_dir) -> None:
    want, _ = _reference(llama_dir)
    with dp_nodes(llama_dir) as (head, node, url):
        assert _greedy(url) == want + want
        reps = _health(url)["replicas"]
        assert [r["up"] for r in reps] == [True, True]
        assert reps[1]["pid"] in [p.pid for p in node.tree()]  # (replica 1 runs under the headless node)
        _node_killed_then_head_serves_on(head, node, url)
        everyone = head.tree()
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(60) == 0, head.stderr
        _assert_all_gone(everyone, "after the head stopped")


def test_a_headless_node_started_again_rejoins(llama_dir) -> None:
    """kill -9 of the headless node, then the same command again: its replica joins the head again (through the
    same rendezvous store) and serves as before."""
    want, _ = _reference(llama_dir)
    meet = ("-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(_free_port()), "--dp-routing", "round_robin")
    node_args = (*meet, "--data-parallel-start-rank", "1", "--headless")
    head = _serve(llama_dir, *meet, "--port", "0")
    node = _serve(llama_dir, *node_args)
    again = None
    try:
        url = head.wait_url(others=(node,))
        _node_killed_then_head_serves_on(head, node, url)
        again = _serve(llama_dir, *node_args)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not _health(url)["replicas"][1]["up"]:
            assert again.proc.poll() is None, again.stderr
            time.sleep(0.2)
        reps = _health(url)["replicas"]
        assert [r["up"] for r in reps] == [True, True], reps
        assert reps[1]["pid"] in [p.pid for p in again.tree()]
        assert _greedy(url) == want + want  # (round robin: both replicas again)
        everyone = head.tree() + again.tree()
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(60) == 0, head.stderr
        assert again.proc.wait(BOUND_S) == 0, again.stderr
        _assert_all_gone(everyone, "after the head stopped")
    finally:
        for p in (head, node, again):
            if p is not None:
                p.kill()


def test_head_stops_the_headless_node(llama_dir) -> None:
    """SIGTERM on the head stops the node's replicas too; the node then exits 0."""
    with dp_nodes(llama_dir) as (head, node, url):
        everyone = head.tree() + node.tree()
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(60) == 0, head.stderr
        assert node.proc.wait(BOUND_S) == 0, node.stderr
        _assert_all_gone(everyone, "after the head stopped")


def test_headless_node_in_network_namespaces(llama_dir) -> None:
    want, _ = _reference(llama_dir)
    with _namespaces() as (a, b, addr_a, _addr_b, _link_b):
        pool = _in_netns(a)
        try:
            with dp_nodes(llama_dir, address=addr_a, head_prefix=("ip", "netns", "exec", a),
                          node_prefix=("ip", "netns", "exec", b)) as (head, node, url):
                assert _on(pool, _greedy, url) == want + want
                reps = _on(pool, _health, url)["replicas"]
                assert [r["up"] for r in reps] == [True, True]
                _node_killed_then_head_serves_on(head, node, url, pool)
        finally:
            pool.shutdown(wait=False)


@pytest.mark.parametrize("args,message", [
    (["-dp", "2", "--data-parallel-size-local", "1"], "need --data-parallel-address"),
    (["-dp", "2", "--data-parallel-size-local", "3", "--data-parallel-address", "127.0.0.1"],
     "data_parallel_size_local must be in 0..data_parallel_size"),
    (["-dp", "2", "--data-parallel-start-rank", "1", "--data-parallel-size-local", "1", "--data-parallel-address",
      "127.0.0.1"], "--data-parallel-start-rank is for the other nodes"),
    (["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1", "--headless"],
     "--data-parallel-start-rank S"),
    (["-dp", "2", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "1", "--data-parallel-address",
      "127.0.0.1", "--headless"], "does not fit in data_parallel_size 2"),
    (["-dp", "2", "--nnodes", "2", "-tp", "2", "--master-addr", "127.0.0.1"], "--data-parallel-size-local"),
])
def test_bad_flags_are_one_line_and_exit_2(llama_dir, args, message) -> None:
    r = subprocess.run([sys.executable, "-m", "streamer", "serve", str(llama_dir), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
