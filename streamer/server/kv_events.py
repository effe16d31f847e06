"""`--kv-events-config`: the prefix cache's KV events (core/kv_events.py) published the way vLLM publishes them, so
that KV-aware routers (llm-d, Dynamo, vllm-router's kv_aware policy) can route by what each replica has cached.

The wire format is vLLM's (vllm/distributed/kv_events.py): ZMQ PUB multipart messages [topic, seq (8-byte
big-endian), payload], the payload a msgspec-msgpack `KVEventBatch(ts, events, data_parallel_rank)`
(server/kv_events_wire.py), and an optional ROUTER replay socket: a client sends an 8-byte big-endian start
sequence and gets every buffered batch from it on, as [topic, seq, payload] frames, then an end marker
[b"", seq -1, b""].

The engine calls the sink on its event loop after each step; the sink only stamps the time and queues the events
(never blocks: a full queue drops the batch, logged). A daemon thread converts, encodes and sends them, and
serves replay requests. pyzmq and msgspec are imported only when a publisher is made.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any, Optional

from streamer.core import kv_events as core_events

logger = logging.getLogger("streamer.server")

PUBLISHERS = ("null", "zmq")


@dataclasses.dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig (its fields, defaults and meaning), read from `--kv-events-config '<JSON>'`."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # "zmq" when events are enabled, else "null" (as vLLM's)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher must be one of {list(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_queue_size == 0:
            raise ValueError("max_queue_size must be >= 1")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"endpoint must be a ZMQ address such as tcp://*:5557, got {self.endpoint!r}")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise ValueError(f"replay_endpoint must be a ZMQ address such as tcp://*:5558, got "
                             f"{self.replay_endpoint!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Whether events leave the process (enabled, and a publisher other than "null")."""
        return bool(self.enable_kv_cache_events) and self.publisher != "null"

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """The flag's JSON object (ValueError naming what is wrong)."""
        try:
            fields = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError("--kv-events-config must be a JSON object, e.g. "
                             "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown} (known: {sorted(known)})")
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"--kv-events-config: {e}") from None


def offset_endpoint_port(endpoint: Optional[str], data_parallel_rank: int) -> Optional[str]:
    """vLLM's rule for data-parallel ranks: rank r publishes on the configured port + r (port 0 stays 0), or on
    `<inproc address>_dp<r>`."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must be tcp:// or inproc://")


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (`*`, `::`) or an ipc/inproc address is bound; any other is connected to (a
    collector that binds its own SUB socket)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """vLLM's ZmqEventPublisher, fed by `AsyncEngine.kv_event_sinks` (`sink`)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    POLL_S = 0.1

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0, medium: str = "GPU") -> None:
        """medium: the tier reported for the engine's cache. vLLM reports "GPU" for its primary KV cache on every
        platform (its CPU build too); KV-aware routers read "CPU" as a host-memory offload tier and discount it."""
        import zmq

        from streamer.server import kv_events_wire as wire
        self._zmq, self._wire = zmq, wire
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.medium = medium
        self.topic = config.topic.encode("utf-8")
        self.dropped = 0  # batches dropped because the queue was full
        self.sent = 0
        self._queue: "queue.Queue[Optional[tuple[float, list]]]" = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: "deque[tuple[int, bytes]]" = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            if is_bind_endpoint(self.endpoint):  # type: ignore[arg-type]
                self._pub.bind(self.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"KV events: cannot open {self.endpoint!r} / {self.replay_endpoint!r}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="streamer-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s%s", self.endpoint,
                    f" (replay: {self.replay_endpoint})" if self.replay_endpoint else "")

    # ------------------------------------------------------------------ the engine's side (event loop)
    def sink(self, events: list) -> None:
        """Called on the event loop with a step's events: stamps and queues them, never blocks."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: the publisher is behind; %d batch(es) dropped", self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    # ------------------------------------------------------------------ the publisher thread
    def encode(self, ts: float, events: list) -> Any:
        """Our events as vLLM's KVEventBatch."""
        wire = self._wire
        out: list = []
        for e in events:
            if isinstance(e, core_events.BlockStored):
                out.append(wire.BlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                                            token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id,
                                            medium=self.medium, lora_name=e.lora_name, group_idx=0))
            elif isinstance(e, core_events.BlockRemoved):
                out.append(wire.BlockRemoved(block_hashes=list(e.block_hashes), medium=self.medium, group_idx=0))
            elif isinstance(e, core_events.AllBlocksCleared):
                out.append(wire.AllBlocksCleared())
        return wire.KVEventBatch(ts=ts, events=out, data_parallel_rank=self.data_parallel_rank)

    def _run(self) -> None:
        import msgspec
        pack = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    logger.exception("KV events: replay request failed")
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            try:
                payload = pack.encode(self.encode(*item))
                seq = next(self._seq)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
                self._buffer.append((seq, payload))
                self.sent += 1
            except Exception:
                logger.exception("KV events: publishing a batch failed")
                time.sleep(self.POLL_S)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:
            logger.warning("KV events: invalid replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))  # type: ignore[union-attr]

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=500)  # (ms: what was just sent still leaves)
        self._ctx.term()


def make_publisher(config: KVEventsConfig, *, data_parallel_rank: int = 0) -> Optional[ZmqEventPublisher]:
    """The publisher `config` asks for (None: "null" or disabled)."""
    if not config.publishes:
        return None
    return ZmqEventPublisher(config, data_parallel_rank=data_parallel_rank)


def check_available() -> None:
    """ImportError (with what to install) unless pyzmq and msgspec are there."""
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--kv-events-config needs pyzmq and msgspec ({e}); pip install pyzmq msgspec") from None
