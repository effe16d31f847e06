"""`serve --kv-events-config`: vLLM's KV cache events over ZMQ, byte for byte, seen by a subscriber written the way
vLLM's example subscriber is (msgspec types of its own, a SUB socket, a replay socket asked for a start sequence)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any, Optional, Union

import httpx
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from streamer.core import kv_events as core  # noqa: E402
from streamer.server.kv_events import KVEventsConfig, ZmqEventPublisher, is_bind_endpoint, offset_endpoint_port  # noqa: E402
from tests.server_utils import REPO  # noqa: E402
from tests.test_server_cli import ServeProcess  # noqa: E402


# ---------------------------------------------------------------------------- a subscriber's own types (as vLLM's
# examples/online_serving/kv_events_subscriber.py declares them: only what it reads; unknown fields are ignored)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    group_idx: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)

# vLLM 0.32's own ZmqEventPublisher payload (msgspec.msgpack.encode of its KVEventBatch) for the batch built in
# test_payload_is_vllms_bytes: ts 1700000000.25; BlockStored([h1, h2], None, tokens 10..41, 16, lora_id None,
# "GPU", group_idx 0); BlockStored([16 zero bytes], h2, [7]*16, 16, lora_id 3); BlockRemoved([h1]);
# AllBlocksCleared; data_parallel_rank 0 (h1 = bytes(range(16)), h2 = bytes(range(16, 32))).
VLLM_PAYLOAD = bytes.fromhex(
    "93cb41d954fc401000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c4100001020304050607"
    "08090a0b0c0d0e0fc410101112131415161718191a1b1c1d1e1fb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
    "6473dc00200a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20212223242526272829aa626c6f636b5f73697a6510a76c6f72"
    "615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780089a474797065ab426c6f636b53746f"
    "726564ac626c6f636b5f68617368657391c41000000000000000000000000000000000b1706172656e745f626c6f636b5f68617368"
    "c410101112131415161718191a1b1c1d1e1fa9746f6b656e5f696473dc001007070707070707070707070707070707aa626c6f636b"
    "5f73697a6510a76c6f72615f696403a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780084a4747970"
    "65ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c410000102030405060708090a0b0c0d0e0fa66d656469756d"
    "a3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair() -> int:
    """p such that p and p + 1 are both free (data-parallel replica r publishes on the port + r)."""
    for _ in range(50):
        p = _free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise AssertionError("no two consecutive free ports")


def test_payload_is_vllms_bytes():
    h1, h2 = bytes(range(16)), bytes(range(16, 32))
    events = [core.BlockStored([h1, h2], None, list(range(10, 42)), 16),
              core.BlockStored([bytes(16)], h2, [7] * 16, 16, lora_id=3),
              core.BlockRemoved([h1]), core.AllBlocksCleared()]
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-golden"))
    try:
        assert msgspec.msgpack.encode(pub.encode(1700000000.25, events)) == VLLM_PAYLOAD
    finally:
        pub.close()
    batch = DECODE.decode(VLLM_PAYLOAD)  # and a subscriber reads it back
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                        "AllBlocksCleared"]
    assert batch.events[1].parent_block_hash == h2 and batch.events[1].lora_id == 3


def test_config_reads_vllms_json():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert c.publishes
    assert KVEventsConfig.parse("{}").publisher == "null"
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    for bad, why in (("{", "not JSON"), ("[1]", "JSON object"), ('{"enable_kv_cache_events": true, "port": 1}',
                     "unknown field"), ('{"publisher": "kafka"}', "publisher must be"),
                     ('{"buffer_steps": -1}', "buffer_steps")):
        with pytest.raises(ValueError, match=why):
            KVEventsConfig.parse(bad)
    # vLLM's rules: wildcard hosts and ipc/inproc bind, a named host is connected to; DP rank r adds r to the port
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/x")
    assert not is_bind_endpoint("tcp://collector:5557")
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://x", 1) == "inproc://x_dp1"


def test_bad_config_is_one_line_and_exit_2():
    for flag, why in (("{", "not JSON"), ('{"enable_kv_cache_events": true, "nope": 1}', "unknown field")):
        r = subprocess.run([sys.executable, "-m", "streamer", "serve", "--kv-events-config", flag], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert why in r.stderr and "Traceback" not in r.stderr


class Subscriber:
    """vLLM's example subscriber: a SUB socket (bound on 127.0.0.1 here: the server's PUB connects to a named host,
    as vLLM's does) and a DEALER on the replay socket, asked for what the SUB missed (a PUB drops what it sends
    before the subscription reaches it, and a sequence gap means lost batches)."""

    def __init__(self, ctx: Any, topic: str, replay_port: int, port: Optional[int] = None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        if port is None:
            self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.sub.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.topic = topic.encode()
        self.batches: dict[int, tuple[str, KVEventBatch, bytes]] = {}  # seq: (how it came, batch, payload)

    def ask_replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch from `start` on, as the replay socket sends them."""
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert self.replay.poll(10_000), "no replay answer"
            frames = self.replay.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            topic, seq, payload = frames[1:]
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert topic == payload == b""
                return got
            assert topic == self.topic
            got.append((int.from_bytes(seq, "big"), payload))

    def _catch_up(self, upto: Optional[int] = None) -> None:
        start = len(self.batches)
        for seq, payload in self.ask_replay(start):
            if (upto is None or seq < upto) and seq not in self.batches:
                self.batches[seq] = ("replay", DECODE.decode(payload), payload)

    def poll(self, until, timeout: float = 60.0) -> None:
        deadline = last = time.monotonic()
        deadline += timeout
        while not until(self.events()):
            assert time.monotonic() < deadline, f"not seen in {timeout}s: {self.events()}"
            if self.sub.poll(100):
                topic, seq_bytes, payload = self.sub.recv_multipart()
                assert topic == self.topic
                seq = int.from_bytes(seq_bytes, "big")
                if seq > len(self.batches):  # a gap: what was missed comes from the replay socket
                    self._catch_up(upto=seq)
                self.batches[seq] = ("live", DECODE.decode(payload), payload)
                last = time.monotonic()
            elif time.monotonic() - last > 2.0:  # quiet: perhaps sent before we were connected
                self._catch_up()
                last = time.monotonic()

    def events(self) -> list:
        return [e for _, (_, b, _) in sorted(self.batches.items()) for e in b.events]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


def test_a_subscriber_sees_what_requests_store_evict_and_clear():
    ctx = zmq.Context()
    replay_port = _free_port()
    sub = Subscriber(ctx, "kv", replay_port)
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
              f'"endpoint": "tcp://127.0.0.1:{sub.port}", "replay_endpoint": "tcp://127.0.0.1:{replay_port}"}}')
    srv = ServeProcess("--port", "0", "--enforce-eager", "--num-kv-blocks", "16", "--max-model-len", "128",
                       "--kv-events-config", config)
    try:
        url = srv.wait_url()
        with httpx.Client(base_url=url, timeout=120) as h:
            def complete(ids: list[int]) -> None:
                r = h.post("/v1/completions", json={"prompt": ids, "max_tokens": 1,
                                                     "temperature": 0})
                assert r.status_code == 200, r.text
            prompt = list(range(100, 148))  # three full blocks of 16
            complete(prompt)
            sub.poll(lambda ev: sum(len(e.block_hashes) for e in ev if isinstance(e, BlockStored)) >= 3)
            stored = [e for e in sub.events() if isinstance(e, BlockStored)]
            assert stored[0].parent_block_hash is None
            assert [t for e in stored for t in e.token_ids][:48] == prompt
            assert all(e.block_size == 16 and e.medium == "GPU" and e.lora_id is None for e in stored)
            for prev, e in zip(stored, stored[1:]):  # each event continues the chain
                assert e.parent_block_hash == prev.block_hashes[-1]
            first = [h for e in stored for h in e.block_hashes][:3]
            assert all(isinstance(x, bytes) and len(x) == 16 for x in first)

            for i in range(1, 8):  # other prompts need the pool's blocks: the first prompt's are evicted
                complete([200 + 300 * i + j for j in range(64)])
            sub.poll(lambda ev: {h for e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes} >= set(first))

            r = h.post("/reset_prefix_cache")
            assert r.status_code == 200, r.text
            sub.poll(lambda ev: isinstance(ev[-1], AllBlocksCleared))
        assert sorted(sub.batches) == list(range(len(sub.batches))), "batches lost"
        assert sub.batches[max(sub.batches)][0] == "live", "the subscriber saw nothing live"

        # the replay socket resends the buffered batches from a sequence number on, then an end marker
        assert sub.ask_replay(1) == [(seq, p) for seq, (_, _, p) in sorted(sub.batches.items()) if seq >= 1]
    finally:
        srv.kill()
        sub.close()
        ctx.term()


def test_each_data_parallel_replica_publishes_its_own_events():
    """With -dp 2 each replica publishes what its own prefix cache stores, as vLLM's engine cores do: replica r on
    the endpoint's port + r (the replay endpoint's too), data_parallel_rank r in its batches, its own sequence."""
    ctx = zmq.Context()
    port, replay = _free_port_pair(), _free_port_pair()
    subs = [Subscriber(ctx, "kv", replay + r, port=port + r) for r in range(2)]
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
              f'"endpoint": "tcp://127.0.0.1:{port}", "replay_endpoint": "tcp://127.0.0.1:{replay}"}}')
    srv = ServeProcess("--port", "0", "--enforce-eager", "-dp", "2", "--dp-routing", "round_robin",
                       "--max-model-len", "128", "--kv-events-config", config)
    prompts = [list(range(100, 148)), list(range(400, 448))]  # three full blocks of 16 each
    try:
        url = srv.wait_url(timeout=300)
        with httpx.Client(base_url=url, timeout=120) as h:
            for prompt in prompts:  # (round robin: one prompt per replica)
                r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
                assert r.status_code == 200, r.text
        seen = []
        for r, sub in enumerate(subs):
            sub.poll(lambda ev: sum(len(e.block_hashes) for e in ev if isinstance(e, BlockStored)) >= 3)
            assert {b.data_parallel_rank for _, b, _ in sub.batches.values()} == {r}
            assert sorted(sub.batches) == list(range(len(sub.batches))), "each replica counts from 0, none lost"
            seen.append([t for e in sub.events() if isinstance(e, BlockStored) for t in e.token_ids][:48])
        assert sorted(seen) == sorted(prompts), "each replica published the prompt it served"
        # each replay socket answers for its own replica
        assert [seq for seq, _ in subs[1].ask_replay(0)] == sorted(subs[1].batches)
    finally:
        srv.kill()
        for sub in subs:
            sub.close()
        ctx.term()
