"""Tensor parallelism over two "nodes" (docs/multi-node.md): separate `streamer serve` processes, a head (rank 0: the
engine and the HTTP server) and a --headless node (rank 1), meeting at the head's rendezvous store. On loopback, in
two network namespaces joined by a veth pair (addresses this test assigns: nothing can fall back to 127.0.0.1), and
under torchrun; greedy outputs through the openai client equal the single-process engine's. Faults: kill -9 of the
node mid-stream or of the head, and a dropped link, end every process within a bounded wait, with clear errors and
no orphans."""
from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

pytest.importorskip("transformers")  # the checkpoints
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from streamer import LLM, SamplingParams  # noqa: E402
from tests.server_utils import PipedProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, list(range(60, 100))]
MAX_NEW = 12
BOUND_S = 10  # the bound: the other side exits within it
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc(PipedProcess):
    """A process whose output is collected; `url` once it prints where it serves."""

    def __init__(self, cmd: list[str]) -> None:
        super().__init__(cmd, {"OMP_NUM_THREADS": "1"})

    def wait_url(self, others: tuple["Proc", ...] = (), timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=0.2)
            except queue.Empty:
                for p in (self, *others):
                    if p.proc.poll() is not None:
                        raise AssertionError(f"{p.proc.args[:6]} exited with {p.proc.returncode}:\n{p.stderr}"
                                             ) from None
                continue
            m = re.search(r"at (http://\S+)/v1", line)
            if m:
                return m.group(1)
        raise AssertionError(f"no URL in {timeout}s:\n{self.stderr}")

    def tree(self) -> list:
        """This process and every process under it."""
        try:
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        for p in reversed(self.tree()):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def _serve(model: Path, *args: str, prefix: tuple[str, ...] = ()) -> Proc:
    return Proc([*prefix, sys.executable, "-m", "streamer", "serve", str(model), "--dtype", "float32",
                 "--enforce-eager", *args])


@contextlib.contextmanager
def two_nodes(model: Path, master: str = "127.0.0.1", head_prefix: tuple[str, ...] = (),
              node_prefix: tuple[str, ...] = (), split: tuple[str, ...] = ("-tp", "2")
              ) -> Iterator[tuple[Proc, Proc, str]]:
    """A head (node 0: rank 0, the engine, the server on 127.0.0.1 of its network) and a headless node 1; `split`:
    how the two ranks share the model (two tensor-parallel shards, or `-pp 2`: two pipeline stages)."""
    meet = (*split, "--nnodes", "2", "--master-addr", master, "--master-port", str(_free_port()))
    head = _serve(model, *meet, "--node-rank", "0", "--port", "0", "--num-kv-blocks", "64", prefix=head_prefix)
    node = _serve(model, *meet, "--node-rank", "1", "--headless", prefix=node_prefix)
    try:
        yield head, node, head.wait_url(others=(node,))
    finally:
        head.kill()
        node.kill()


def _reference(model: Path) -> tuple[list[list[int]], str]:
    """The single-process engine's greedy tokens for PROMPTS, and its text for the first one."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(model), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs], outs[0].outputs[0].text


def _client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy_over_http(url: str) -> tuple[list[list[int]], str]:
    """Greedy tokens for PROMPTS through the openai client (token ids from the logprobs), and the first prompt's text
    streamed."""
    client = _client(url)
    model = client.models.list().data[0].id
    tokens = []
    for p in PROMPTS:
        r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0.0, logprobs=1,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        tokens.append([int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens])
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    return tokens, text


def _start_long_stream(url: str):
    """A streamed request that runs for hundreds of steps, once its first chunk arrived: (client, iterator)."""
    client = _client(url)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=480, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    return client, chunks


def _drain_expecting_rank_error(chunks) -> str:
    with pytest.raises(openai.APIError) as err:
        for c in chunks:
            assert c.choices[0].finish_reason is None, "the request finished before the fault"
    return str(err.value)


def _health(url: str) -> int:
    import httpx
    return httpx.get(url + "/health", timeout=30).status_code


def _assert_all_gone(procs: list, what: str) -> None:
    _, alive = psutil.wait_procs(procs, timeout=BOUND_S)
    assert not alive, f"{what}: still running after {BOUND_S} s: {[p.pid for p in alive]}"


# ---------------------------------------------------------------------------------------------------- loopback
# family -> its checkpoint (the names test_tensor_parallel.py and test_hybrid_tp.py build them under)
CHECKPOINTS = {"llama": ("llama_tp", {"family": "llama", "seed": 3}),
               "qwen3_moe": ("qwen3_moe_tp", {"family": "qwen3_moe", "seed": 3}),
               "bamba": ("bamba", {"family": "bamba"})}


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_two_nodes_on_loopback_match_one_process(make_ckpt, family) -> None:
    """Greedy tokens (and streamed text) through the openai client equal the single-process engine's: a dense
    Llama, a MoE (every expert split along its width) and a hybrid (Mamba2 heads split, attention layers between);
    SIGTERM on the head stops both nodes cleanly."""
    name, kw = CHECKPOINTS[family]
    model = make_ckpt(name, **kw)
    want_tokens, want_text = _reference(model)
    with two_nodes(model) as (head, node, url):
        if family == "llama":  # idle past the heartbeat timeout (5 s): heartbeats, not steps, keep the ranks in touch
            time.sleep(7)
        got_tokens, got_text = _greedy_over_http(url)
        assert _health(url) == 200
        everyone = head.tree() + node.tree()
        # SIGTERM on the head drains it and stops the node's rank: everyone exits 0
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(120) == 0, head.stderr
        assert node.proc.wait(BOUND_S) == 0, node.stderr
        _assert_all_gone(everyone, "after the head stopped")
    assert got_tokens == want_tokens
    assert got_text == want_text


@pytest.mark.parametrize("family,tp", [("llama", "1"), ("qwen3_moe", "1"), ("bamba", "1"), ("llama", "2")])
def test_two_pipeline_stages_on_two_nodes_match_one_process(make_ckpt, family, tp) -> None:
    """Pipeline parallelism across nodes: the head runs stage 0 (and samples), the headless node stage 1 (with
    -tp 2: each node a tensor-parallel group of two ranks); greedy tokens and streamed text through the openai
    client equal the single-process engine's, on a dense Llama, a MoE and a hybrid."""
    name, kw = CHECKPOINTS[family]
    model = make_ckpt(name, **kw)
    want_tokens, want_text = _reference(model)
    with two_nodes(model, split=("-pp", "2", "-tp", tp)) as (head, node, url):
        got_tokens, got_text = _greedy_over_http(url)
        assert _health(url) == 200
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(120) == 0, head.stderr
        assert node.proc.wait(BOUND_S) == 0, node.stderr
    assert got_tokens == want_tokens
    assert got_text == want_text


@pytest.mark.parametrize("split", [("-tp", "2"), ("-pp", "2")], ids=["tp", "pp"])
def test_worker_node_killed_mid_stream(llama_dir, split) -> None:
    """kill -9 of the headless node while a stream runs: the head names the rank, fails the request, answers 503
    on /health and exits 1 within the bound; the node's rank dies with it; no process is left. With pipeline
    stages the head is waiting for the lost stage's hidden states (not in a collective) when it goes."""
    with two_nodes(llama_dir, split=split) as (head, node, url):
        everyone = head.tree() + node.tree()
        assert len(everyone) == 3  # the head (rank 0), the node and its rank 1
        _, chunks = _start_long_stream(url)
        node.proc.send_signal(signal.SIGKILL)
        error = _drain_expecting_rank_error(chunks)
        assert "tensor-parallel rank 1" in error, error
        assert _health(url) == 503
        assert head.proc.wait(BOUND_S) == 1
        _assert_all_gone(everyone, "after the node was killed")
    assert "tensor-parallel rank 1 was lost" in head.stderr or "tensor-parallel rank 1 has exited" in head.stderr


@pytest.mark.parametrize("split", [("-tp", "2"), ("-pp", "2")], ids=["tp", "pp"])
def test_offline_llm_loses_its_node_mid_generate(llama_dir, split) -> None:
    """The offline LLM as the head of two nodes (rank 0 in this process): kill -9 of the headless node while
    generate runs raises at once, naming the rank, and close() returns without waiting on the lost rank."""
    port = _free_port()
    meet = (*split, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    node = _serve(llama_dir, *meet, "--node-rank", "1", "--headless")
    size = dict(tensor_parallel_size=2) if split[0] == "-tp" else dict(pipeline_parallel_size=2)
    try:
        llm = LLM(str(llama_dir), dtype="float32", enforce_eager=True, nnodes=2, node_rank=0,
                  master_addr="127.0.0.1", master_port=port, **size)
        everyone = node.tree()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        first = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], first)[0].outputs[0].token_ids) == 4
        with ThreadPoolExecutor(1) as pool:
            start = llm.engine.num_steps
            running = pool.submit(llm.generate, [{"prompt_token_ids": p} for p in PROMPTS * 16], params)
            deadline = time.monotonic() + 60
            while llm.engine.num_steps < start + 5 and time.monotonic() < deadline:  # (mid-generate)
                time.sleep(0.01)
            assert not running.done()
            node.proc.send_signal(signal.SIGKILL)
            with pytest.raises(RuntimeError, match="rank 1 was lost"):
                running.result(timeout=BOUND_S)
        t = time.monotonic()
        llm.close()
        assert time.monotonic() - t < BOUND_S
        _assert_all_gone(everyone, "after the node was killed")
    finally:
        node.kill()


def test_head_killed(llama_dir) -> None:
    """kill -9 of the head: the node's rank sees it go and exits, and so does the node, within the bound."""
    with two_nodes(llama_dir) as (head, node, url):
        everyone = head.tree() + node.tree()
        head.proc.send_signal(signal.SIGKILL)
        assert node.proc.wait(BOUND_S) == 1
        _assert_all_gone(everyone, "after the head was killed")
    assert "the head (rank 0" in node.stderr, node.stderr


# ---------------------------------------------------------------------------------------------------- torchrun
@pytest.mark.parametrize("split", [(), ("-pp", "2")], ids=["tp", "pp"])
def test_torchrun_two_ranks_match_one_process(llama_dir, split) -> None:
    """`torchrun --nproc-per-node 2 -m streamer serve MODEL` (-tp from WORLD_SIZE, or `-pp 2`: two stages): rank 0
    serves, rank 1 is its worker; SIGTERM to rank 0 drains and stops both, and torchrun exits 0."""
    want_tokens, want_text = _reference(llama_dir)
    run = Proc([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(_free_port()), "-m", "streamer", "serve", str(llama_dir), "--dtype", "float32",
                "--enforce-eager", "--port", "0", "--num-kv-blocks", "64", *split])
    try:
        url = run.wait_url()
        got_tokens, got_text = _greedy_over_http(url)
        ranks = [p for p in run.tree()[1:] if p.environ().get("RANK") in ("0", "1")]
        assert len(ranks) == 2
        next(p for p in ranks if p.environ()["RANK"] == "0").send_signal(signal.SIGTERM)
        assert run.proc.wait(60) == 0, run.stderr
    finally:
        run.kill()
    assert got_tokens == want_tokens
    assert got_text == want_text


# ---------------------------------------------------------------------------------------------------- namespaces
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def _namespaces() -> Iterator[tuple[str, str, str, str, str]]:
    """Two network namespaces joined by a veth pair, 10.233.X.1 and 10.233.X.2/24 (each with its own loopback):
    (namespace A, namespace B, A's address, B's address, B's end of the link). Skips where they cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"{os.getpid() % 100000}"
    a, b, va, vb = f"stmnA{tag}", f"stmnB{tag}", f"stva{tag}", f"stvb{tag}"
    subnet = f"10.233.{os.getpid() % 250 + 1}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, f"{subnet}.1"), (b, vb, f"{subnet}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {getattr(e, 'stderr', None) or e}")
    try:
        yield a, b, f"{subnet}.1", f"{subnet}.2", vb
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _in_netns(name: str) -> ThreadPoolExecutor:
    """A thread that lives in network namespace `name` (setns changes the calling thread's): the HTTP client's
    sockets are made there, so it reaches the head's server on that namespace's own loopback."""
    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)
    return ThreadPoolExecutor(1, initializer=enter)


def _on(pool: ThreadPoolExecutor, fn: Callable[..., T], *args) -> T:
    return pool.submit(fn, *args).result(300)


@pytest.mark.parametrize("split", [("-tp", "2"), ("-pp", "2")], ids=["tp", "pp"])
def test_two_nodes_in_network_namespaces_then_the_link_drops(llama_dir, split) -> None:
    """Each node in its own network namespace, reaching the other only over the veth pair (its 127.0.0.1 is its
    own): equal outputs, with two tensor-parallel shards or two pipeline stages. Then the link goes down
    mid-stream (no FIN, no RST): the head reports rank 1 silent, fails the request and exits; the node sees the head
    silent and exits; all within the bound after the heartbeat timeout."""
    want_tokens, want_text = _reference(llama_dir)
    with _namespaces() as (a, b, addr_a, _addr_b, link_b):
        pool = _in_netns(a)
        try:
            with two_nodes(llama_dir, master=addr_a, head_prefix=("ip", "netns", "exec", a),
                           node_prefix=("ip", "netns", "exec", b), split=split) as (head, node, url):
                got_tokens, got_text = _on(pool, _greedy_over_http, url)
                assert got_tokens == want_tokens
                assert got_text == want_text
                everyone = head.tree() + node.tree()
                _, chunks = _on(pool, _start_long_stream, url)
                _ip("-n", b, "link", "set", link_b, "down")
                error = _on(pool, _drain_expecting_rank_error, chunks)
                assert "tensor-parallel rank 1" in error, error
                # the heartbeat timeout (5 s) to notice the silence, then the bound to exit
                assert head.proc.wait(5 + BOUND_S) == 1
                assert node.proc.wait(5 + BOUND_S) == 1
                _assert_all_gone(everyone, "after the link dropped")
        finally:
            pool.shutdown(wait=False)
    assert "was silent" in head.stderr and "was silent" in node.stderr, (head.stderr, node.stderr)


# ---------------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("args,message", [
    (["--headless", "-tp", "2"], "--headless runs the ranks of another node"),
    (["--headless", "-tp", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
     "node 0 runs the engine"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"], "start that node with --headless"),
    (["--headless", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
      "--nproc-per-node", "2"], "does not split into 2 node(s) of 2 rank(s)"),
    (["--headless", "-tp", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"],
     "(3 ranks) does not split over nnodes 2"),
    (["--headless", "-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "node_rank"),
    (["--headless", "-tp", "2", "--nnodes", "2", "--node-rank", "1"], "need --master-addr"),
    (["--headless", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
      "--master-port", "70000"], "master_port"),
])
def test_bad_multi_node_flags_are_one_line_and_exit_2(llama_dir, args, message) -> None:
    r = subprocess.run([sys.executable, "-m", "streamer", "serve", str(llama_dir), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_layout_places_ranks_by_node() -> None:
    from streamer.worker.rendezvous import interface_of, node_layout, route_source
    one = node_layout(4, "cpu")
    assert (one.nproc_per_node, one.multi_node, one.host()) == (4, False, "127.0.0.1")
    second = node_layout(4, "cpu", nnodes=2, node_rank=1, master_addr="127.0.0.1")
    assert (second.nproc_per_node, second.first_rank, second.master_port) == (2, 2, 29501)
    assert second.host() == "127.0.0.1"  # its address on the route to the head
    head = node_layout(4, "cpu", nnodes=2, master_addr="127.0.0.1", master_port=1234, dist_host="127.0.0.2")
    assert (head.host(), head.master_port) == ("127.0.0.2", 1234)
    assert route_source("127.0.0.1", 1) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"


def test_step_listener_survives_stray_clients_and_refuses_bad_ranks() -> None:
    """A client without the key, one that hangs up at once, and a rank the group has no room for are turned away;
    the real ranks still join."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client, Listener

    from streamer.worker.parallel import _accept
    from streamer.worker.rendezvous import node_layout
    key = os.urandom(32)
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        pool = ThreadPoolExecutor(1)
        joined = pool.submit(_accept, listener, [], node_layout(2, "cpu"))
        with pytest.raises(AuthenticationError):
            Client(listener.address, authkey=b"not the key")
        with socket.create_connection(listener.address):
            pass
        wrong = Client(listener.address, authkey=key)
        wrong.send(("steps", 5, 2, "nowhere"))
        assert "there is no rank 5" in wrong.recv()
        steps = Client(listener.address, authkey=key)
        steps.send(("steps", 1, 2, "here"))
        watch = Client(listener.address, authkey=key)
        watch.send(("watch", 1, 2, "here"))
        got = joined.result(60)
        assert list(got) == [1] and got[1][2] == "here"
        for c in (wrong, steps, watch, got[1][0], got[1][1]):
            c.close()
        pool.shutdown()
