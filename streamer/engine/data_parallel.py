"""Data parallelism: N engine replicas behind one router, with AsyncEngine's interface (docs/data-parallel.md).

`DataParallelEngine` lives in the API server's process (or the offline `LLM`'s background loop). Each replica is a
fresh interpreter (`python -m streamer.engine.data_parallel`, not a multiprocessing child, for the reason
worker/parallel.py gives) running a real `AsyncEngine` with its own device thread, device and KV cache: on CUDA its own
GPUs (CUDA_VISIBLE_DEVICES: GPU i, or the i-th group of tensor_parallel_size GPUs, whose TP group it starts itself),
on CPU its own share of the cores (sched_setaffinity + torch.set_num_threads). It connects back to a listener on
127.0.0.1 and proves it knows the random key of this start (an HMAC of a nonce). Messages are pickled, length-framed;
a replica sends each step's outputs, its load (running, KV usage) and its prefix cache's events (core/kv_events.py)
as one message. The router (dp_router.py) picks a replica per request from the request's block-hash chain (computed
with `Request`'s own hashing) and the replicas' loads.

A replica whose connection ends or whose process exits is down: its in-flight requests fail at once with
EngineDeadError naming it, the router skips it, the others go on; `is_alive` stays true while one is up.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import hmac
import logging
import os
import pickle
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Optional

from streamer.config import EngineConfig
from streamer.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from streamer.engine.dp_router import NoReplicaError, Router
from streamer.engine.input_processor import LoRAType, PromptType, place_media
from streamer.engine.pooling import PoolingParams
from streamer.sampling_params import SamplingParams

logger = logging.getLogger("streamer")

# The session key of the request being served (the server sets it from the affinity header), read by add_request.
SESSION_KEY: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("streamer_dp_session", default=None)

START_TIMEOUT_S = float(os.environ.get("STREAMER_DP_START_TIMEOUT", "600"))
_HEADER = struct.Struct("!I")
_DEFAULT_PARAMS = SamplingParams(max_tokens=1)


# ---------------------------------------------------------------------------------------------------- framing
async def _read(reader: asyncio.StreamReader) -> Any:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(n))


def _write(writer: asyncio.StreamWriter, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_HEADER.pack(len(data)) + data)


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling (ValueError, QueueFullError ...), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _nodelay(writer: asyncio.StreamWriter) -> None:
    """Small messages (a step's outputs) go out at once, not after Nagle's wait for an ACK. And a link that drops
    without a FIN (a node or its network gone) ends within ~10 s: TCP keepalive probes an idle link, and unacked
    data times out (Linux)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 10_000)


def _proof(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"streamer-dp" + nonce, hashlib.sha256).digest()


# ---------------------------------------------------------------------------------------------------- placement
def cpu_shares(num_replicas: int, cpus: Optional[list[int]] = None) -> list[list[int]]:
    """Each replica's cores: the usable ones split into equal consecutive runs (all of them each when there are
    fewer cores than replicas)."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = len(cpus) // num_replicas
    if per == 0:
        return [list(cpus) for _ in range(num_replicas)]
    return [cpus[i * per:(i + 1) * per] for i in range(num_replicas)]


def gpu_shares(num_replicas: int, tp: int) -> Optional[list[str]]:
    """Each replica's CUDA_VISIBLE_DEVICES (None: no CUDA here). ValueError when there are too few GPUs."""
    try:
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        count = 0
    if count == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(count)]
    need = num_replicas * tp
    if len(ids) < need:
        raise ValueError(f"data_parallel_size {num_replicas} x tensor_parallel_size {tp} needs {need} GPUs; "
                         f"{len(ids)} visible")
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(num_replicas)]


def spawn_replicas(ranks: range, addr: str, key: bytes, config: EngineConfig, parent: int,
                   model: Optional[str] = None, only: Optional[set[int]] = None) -> dict[int, subprocess.Popen]:
    """Start replicas `ranks` on this machine (`python -m streamer.engine.data_parallel`), each with its share of this
    machine's GPUs or cores, connecting to the front's listener at `addr` with `key`. model: this node's own path to
    the model (a headless node), sent in place of the head's. only: start just these of `ranks` (a restart: the
    same share as before)."""
    gpus = gpu_shares(len(ranks), config.tensor_parallel_size) \
        if config.device in ("auto",) or str(config.device).startswith("cuda") else None
    cpus = cpu_shares(len(ranks)) if gpus is None else None
    per = int(os.environ.get("STREAMER_DP_CORES_PER_REPLICA", "0"))  # (benches: fewer cores each)
    if cpus is not None and per > 0:
        cpus = [c[:per] for c in cpus]
    procs = {}
    for i, rank in enumerate(ranks):
        if only is not None and rank not in only:
            continue
        env = dict(os.environ, STREAMER_DP_ADDR=addr, STREAMER_DP_KEY=key.hex(), STREAMER_DP_RANK=str(rank),
                   STREAMER_DP_PARENT=str(parent))
        if model is not None:
            env["STREAMER_DP_MODEL"] = model
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        if cpus is not None:
            env["STREAMER_DP_CPUS"] = ",".join(map(str, cpus[i]))
            env["OMP_NUM_THREADS"] = str(max(1, len(cpus[i]) // config.tensor_parallel_size))
        procs[rank] = subprocess.Popen([sys.executable, "-m", "streamer.engine.data_parallel"], env=env,
                                       stdin=subprocess.DEVNULL)
    return procs


# Across machines the head's rendezvous store (a torch.distributed TCPStore at --data-parallel-address:
# --data-parallel-rpc-port) hands the other nodes its replica listener's address and this start's random key.
DEFAULT_RPC_PORT = 29550  # vLLM's
_STORE_LISTENER = "streamer/dp/listener"
_STORE_KEY = "streamer/dp/key"


def _secret_key() -> Optional[bytes]:
    """A key every node is given ($STREAMER_DP_SECRET, the same on each), in place of the head's random one (which
    then never goes through the store)."""
    secret = os.environ.get("STREAMER_DP_SECRET")
    return hashlib.sha256(b"streamer-dp-secret" + secret.encode()).digest() if secret else None


def _store(config: EngineConfig, is_master: bool) -> Any:
    import torch

    from streamer.worker.rendezvous import STORE_TIMEOUT
    return torch.distributed.TCPStore(config.data_parallel_address, config.data_parallel_rpc_port or DEFAULT_RPC_PORT,
                                      is_master=is_master, wait_for_workers=False, timeout=STORE_TIMEOUT)


def run_headless_node(config: EngineConfig, model: Optional[str]) -> int:
    """`streamer serve MODEL -dp N --data-parallel-size-local K --data-parallel-start-rank S --data-parallel-address
    HEAD --headless`: start this node's replicas S..S+K-1, which join the head's router, and wait for them. They die
    with this process (SIGKILL on Linux); SIGTERM / SIGINT stop them. A replica that fails leaves the others running
    (the head routes around it). Returns 0 when the head stopped every replica, else 1."""
    local = config.data_parallel_size_local or 0
    start = config.data_parallel_start_rank
    head = f"{config.data_parallel_address}:{config.data_parallel_rpc_port or DEFAULT_RPC_PORT}"
    logger.warning("data-parallel node: replicas %d..%d of %d, joining the head at %s", start, start + local - 1,
                   config.data_parallel_size, head)
    store = _store(config, is_master=False)  # (waits for the head, up to 10 minutes)
    addr = store.get(_STORE_LISTENER).decode()
    key = _secret_key() or bytes.fromhex(store.get(_STORE_KEY).decode())
    del store
    procs = spawn_replicas(range(start, start + local), addr, key, config, os.getpid(), model)
    stopping: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        stopping.append(sig)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    reported: set[int] = set()
    while any(p.poll() is None for p in procs.values()):
        for rank, p in procs.items():
            if p.returncode not in (None, 0) and rank not in reported and not stopping:
                reported.add(rank)
                logger.error("data-parallel replica %d exited (status %d); this node's others go on", rank,
                             p.returncode)
        time.sleep(0.2)
    return 0 if stopping or all(p.returncode == 0 for p in procs.values()) else 1


# ---------------------------------------------------------------------------------------------------- the front
class _Stream(RequestStream):
    """A request's outputs as the replica sends them (RequestStream's merging, counting and usage)."""


@dataclasses.dataclass
class _Replica:
    index: int
    proc: Optional[subprocess.Popen] = None
    writer: Optional[asyncio.StreamWriter] = None
    up: bool = False
    joining: bool = False  # (connected again after it was lost: being started, not yet routed to)
    why_down: Optional[str] = None
    info: dict = dataclasses.field(default_factory=dict)
    calls: dict = dataclasses.field(default_factory=dict)  # call id -> future
    streams: set = dataclasses.field(default_factory=set)  # request ids in flight here
    connected: Optional[asyncio.Future] = None
    reader_task: Optional[asyncio.Task] = None


class _FrontCore:
    """What the server reads off `engine.engine` (the model's config and folder), without a model."""

    def __init__(self, model_config: Any, model_dir: Any, vocab_size: int) -> None:
        self.model_config, self.model_dir, self.vocab_size = model_config, model_dir, vocab_size


class DataParallelMetrics:
    """/metrics: every replica's metrics, each sample labelled engine="i" (as vLLM's), and the router's."""

    def __init__(self, engine: "DataParallelEngine", model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def render(self) -> str:
        e = self.engine
        up = [r for r in e.replicas if r.up]
        texts = await asyncio.gather(*(e._call(r, "__metrics__", self.model_name, timeout=10.0) for r in up),
                                     return_exceptions=True)
        return merge_metrics([(str(r.index), t) for r, t in zip(up, texts) if isinstance(t, str)]) + \
            self._router_metrics()

    def _router_metrics(self) -> str:
        e = self.engine
        rows = ["# HELP streamer:dp_replica_up Whether the data-parallel replica is up (1) or down (0).",
                "# TYPE streamer:dp_replica_up gauge"]
        rows += [f'streamer:dp_replica_up{{model_name="{self.model_name}",engine="{r.index}"}} {int(r.up)}'
                 for r in e.replicas]
        rows += ["# HELP streamer:dp_replica_restarts_total Replicas of this machine started again after they died.",
                 "# TYPE streamer:dp_replica_restarts_total counter",
                 f'streamer:dp_replica_restarts_total{{model_name="{self.model_name}"}} {e.restarts}']
        rows += ["# HELP streamer:dp_routed_requests_total Requests the router sent to each replica.",
                 "# TYPE streamer:dp_routed_requests_total counter"]
        rows += [f'streamer:dp_routed_requests_total{{model_name="{self.model_name}",engine="{i}"}} {n}'
                 for i, n in enumerate(e.router.routed)]
        return "\n".join(rows) + "\n"


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus text of several engines as one: each family's HELP / TYPE once, then every engine's samples
    with an `engine` label."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for engine, text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in heads:
                        order.append(family)
                        heads[family], samples[family] = [], []
                    if line not in heads[family]:
                        heads[family].append(line)
                continue
            name, brace, rest = line.partition("{")
            if brace:
                line = f'{name}{{engine="{engine}",{rest}' if not rest.startswith("}") else \
                    f'{name}{{engine="{engine}"{rest}'
            else:
                name, _, value = line.partition(" ")
                line = f'{name}{{engine="{engine}"}} {value}'
            if family not in samples:
                order.append(family)
                heads[family], samples[family] = [], []
            samples[family].append(line)
    out: list[str] = []
    for family in order:
        out += heads[family] + samples[family]
    return "\n".join(out) + ("\n" if out else "")


class DataParallelEngine:
    """AsyncEngine's interface over `data_parallel_size` replicas (see the module's doc). Start with `await
    start()` or `async with`."""

    # (AsyncEngine's own code where it only needs add_request and the stream)
    generate = AsyncEngine.generate
    stream = AsyncEngine.stream
    embed = AsyncEngine.embed
    classify = AsyncEngine.classify
    _pool = AsyncEngine._pool
    encode_pair = AsyncEngine.encode_pair
    __aenter__ = AsyncEngine.__aenter__
    __aexit__ = AsyncEngine.__aexit__

    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.size = self.config.data_parallel_size
        local = self.config.data_parallel_size_local
        self.local = self.size if local is None else local  # replicas 0..local-1 run here, the rest on other nodes
        self._replica_args = dict(engine_args, data_parallel_size=1, kv_events=True, data_parallel_size_local=None,
                                  data_parallel_start_rank=0, data_parallel_address=None, data_parallel_rpc_port=None)
        self._model = model
        self.router = Router(self.size, self.config.dp_routing)
        self.replicas = [_Replica(i) for i in range(self.size)]
        self.session_header = (self.config.dp_session_header or "").lower() or None
        self._streams: dict[str, tuple[_Stream, asyncio.Queue, int]] = {}  # request id -> (stream, queue, replica)
        self._remaining: dict[str, int] = {}  # request id -> sequences not finished
        self._guesses: dict[int, int] = {}  # an add's call id -> the sequences counted in flight for it
        self._ids = 0
        self._key = _secret_key() or secrets.token_bytes(32)
        self._server: Optional[asyncio.AbstractServer] = None
        self._remote_server: Optional[asyncio.AbstractServer] = None
        self._store: Any = None  # (across machines: the rendezvous store the other nodes read)
        self._started = False
        self._stopped = False
        self._paused = False
        self._idle: Optional[asyncio.Event] = None
        self._loras: dict[str, Any] = {}
        self._tokenizer: Any = None
        self._image_prompts: Any = None
        self.engine: Optional[_FrontCore] = None
        self.metrics: Optional[DataParallelMetrics] = None
        self.rank_lost: Optional[str] = None  # (AsyncEngine's: a lost replica is not fatal here)
        self.on_replica_lost: list[Callable[[int, str], None]] = []
        # `serve --kv-events-config` (a server.kv_events.KVEventsConfig that publishes), set before start: each
        # replica publishes its own prefix cache's events, replica r on the endpoint's port + r and with
        # data_parallel_rank r in its batches, as vLLM's engine cores do (on another node: from that node).
        self.kv_events_config: Any = None
        self.restarts = 0  # replicas of this machine started again (dp_max_restarts)
        self._weights_updated = False  # (a replica started now would serve the checkpoint's weights)
        self._listener = ""
        self._rejoining: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> "DataParallelEngine":
        from streamer.engine.llm_engine import _load_tokenizer, _max_model_len, resolve_model_dir
        from streamer.models.config import ModelConfig
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        model_dir = resolve_model_dir(self.config.model)
        model_config = ModelConfig.from_dir(model_dir, self.config.hf_overrides)
        self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.config, model_dir)
        self._max_model_len = _max_model_len(self.config, model_config, model_dir)
        self.engine = _FrontCore(model_config, model_dir, model_config.vocab_size)
        self._server = await asyncio.start_server(functools.partial(self._accept, remote=False), "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        for r in self.replicas:
            r.connected = loop.create_future()
        try:
            if self.local < self.size:  # replicas on other nodes: a listener they reach, published in the store
                host = self.config.data_parallel_address
                self._remote_server = await asyncio.start_server(functools.partial(self._accept, remote=True),
                                                                 host, 0)
                remote_port = self._remote_server.sockets[0].getsockname()[1]
                self._store = await asyncio.to_thread(_store, self.config, True)
                self._store.set(_STORE_LISTENER, f"{host}:{remote_port}")
                self._store.set(_STORE_KEY, "" if _secret_key() else self._key.hex())
                logger.info("data parallelism: waiting for replicas %d..%d of other nodes (rendezvous at %s:%d)",
                            self.local, self.size - 1, host, self.config.data_parallel_rpc_port or DEFAULT_RPC_PORT)
            self._listener = f"127.0.0.1:{port}"
            procs = spawn_replicas(range(self.local), self._listener, self._key, self.config, os.getpid())
            for index, proc in procs.items():
                self._watch(loop, self.replicas[index], proc)
            await self._wait_connected()
            infos = await asyncio.gather(*(self._call(r, "__start__", self._model, self._replica_args,
                                                      self.kv_events_config, timeout=None)
                                           for r in self.replicas))
        except BaseException as e:
            await self._kill_all()
            for server in (self._server, self._remote_server):
                if server is not None:
                    server.close()
            self._store = None
            if isinstance(e, asyncio.TimeoutError):
                raise RuntimeError(f"the data-parallel replicas did not start within {START_TIMEOUT_S:g} s") from None
            raise
        for r, info in zip(self.replicas, infos):
            r.info = info
        info = infos[0]
        if info["speech"]:
            await self._kill_all()
            raise ValueError("data_parallel_size > 1 does not run with speech-to-text models (Whisper) yet")
        self._image_prompts = info["image_prompts"]  # (a replica's: what the server's chat templates read)
        self._max_model_len = info["max_model_len"]
        self.engine.vocab_size = info["vocab_size"]
        self.metrics = DataParallelMetrics(self, self.model_name)
        self._started = True
        logger.info("data parallelism: %d replicas up (routing: %s)", self.size, self.router.policy)
        return self

    async def _wait_connected(self) -> None:
        """Until every replica has connected (those of other nodes logged every 30 s while missing)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = asyncio.gather(*(r.connected for r in self.replicas))
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise asyncio.TimeoutError
                try:
                    await asyncio.wait_for(asyncio.shield(waiting), min(30.0, left))
                    return
                except asyncio.TimeoutError:
                    missing = [r.index for r in self.replicas if r.connected is not None and not r.connected.done()]
                    logger.warning("data parallelism: waiting for replicas %s to connect", missing)
        finally:
            if not waiting.done():
                waiting.cancel()
                waiting.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _watch(self, loop: asyncio.AbstractEventLoop, r: _Replica, proc: subprocess.Popen) -> None:
        r.proc = proc
        threading.Thread(target=self._watch_exit, args=(loop, r, proc), name=f"streamer-dp-watch-{r.index}",
                         daemon=True).start()

    def _watch_exit(self, loop: asyncio.AbstractEventLoop, r: _Replica, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(functools.partial(self._lost, r, f"its process exited (status {code})",
                                                            proc=proc))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, remote: bool = False) -> None:
        _nodelay(writer)
        nonce = secrets.token_bytes(32)
        writer.write(nonce)
        try:
            proof = await asyncio.wait_for(reader.readexactly(32 + 4), 30)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        index = struct.unpack("!I", proof[32:])[0]
        peer = writer.get_extra_info("peername")
        rejoin = remote and self._started and index < self.size and self.replicas[index].why_down is not None
        if not hmac.compare_digest(proof[:32], _proof(self._key, nonce)) or index >= self.size \
                or self.replicas[index].writer is not None \
                or (self.replicas[index].why_down is not None and not rejoin) or (index >= self.local) != remote:
            logger.warning("data parallelism: refused a connection from %s that is no replica of this engine (or "
                           "a replica %d that is here already, or belongs on another node)", peer, index)
            writer.close()
            return
        if remote:
            logger.info("data parallelism: replica %d %s from %s", index, "joined again" if rejoin else "joined",
                        peer)
        r = self.replicas[index]
        r.writer = writer
        if self._started:  # (a restarted or rejoining replica: routed to once it is started again)
            r.why_down, r.joining = None, True
        else:
            r.up = True
        if rejoin:
            self._keep(asyncio.ensure_future(self._rejoin(r)))
        if r.connected is not None and not r.connected.done():
            r.connected.set_result(None)
        r.reader_task = asyncio.current_task()
        try:
            while True:
                self._on_message(r, await _read(reader))
        except (asyncio.IncompleteReadError, ConnectionError, EOFError) as e:
            self._lost(r, f"its connection ended ({type(e).__name__})", writer=writer)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # (a message that does not unpickle: the link is unusable)
            logger.exception("data parallelism: replica %d sent a bad message", r.index)
            self._lost(r, f"it sent a bad message: {e!r}", writer=writer)

    def _lost(self, r: _Replica, why: str, proc: Optional[subprocess.Popen] = None,
              writer: Optional[asyncio.StreamWriter] = None) -> None:
        """Replica r is gone: fail its requests and calls, route around it; start it again (`_restart`). `proc` /
        `writer`: what was lost (news of an earlier process or connection of a restarted replica is stale)."""
        if r.why_down is not None or (proc is not None and proc is not r.proc) \
                or (writer is not None and writer is not r.writer):
            return
        r.why_down = why
        r.up = r.joining = False
        self.router.mark_down(r.index)
        if self._stopped:
            return
        msg = f"data-parallel replica {r.index} was lost: {why}"
        logger.error("%s; %d in-flight request(s) failed; %d of %d replicas up", msg, len(r.streams),
                     sum(x.up for x in self.replicas), self.size)
        err = EngineDeadError(f"the engine has failed: {msg}")
        for rid in list(r.streams):
            entry = self._streams.pop(rid, None)
            self._remaining.pop(rid, None)
            if entry is not None:
                entry[1].put_nowait(err)
        r.streams.clear()
        for fut in r.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"the engine has failed: {msg}"))
        r.calls.clear()
        if r.connected is not None and not r.connected.done():
            r.connected.set_exception(RuntimeError(f"data-parallel replica {r.index} failed to start: {why}"))
        if r.writer is not None:
            r.writer.close()
            r.writer = None
        self._maybe_idle()
        for cb in self.on_replica_lost:
            cb(r.index, why)
        self._maybe_restart(r)

    # ------------------------------------------------------------------ a lost replica back
    def _maybe_restart(self, r: _Replica) -> None:
        """A replica of this machine starts again (dp_max_restarts in all, after a growing pause); one of another
        node comes back when that node starts it again (`_accept`). (Not while starting: a replica that fails then
        fails the start.)"""
        if not self._started:
            return
        if r.index >= self.local:
            logger.warning("data parallelism: replica %d is served again once its node starts it again", r.index)
            return
        why_not = ("the weights were updated at runtime (it would load the checkpoint's)" if self._weights_updated
                   else f"{self.restarts} restart(s) used of dp_max_restarts={self.config.dp_max_restarts}"
                   if self.restarts >= self.config.dp_max_restarts else None)
        if why_not is not None:
            logger.error("data parallelism: replica %d stays down: %s", r.index, why_not)
            return
        self.restarts += 1
        self._keep(asyncio.ensure_future(self._restart(r, min(2.0 ** (self.restarts - 1), 30.0))))

    def _keep(self, task: asyncio.Task) -> None:
        self._rejoining.add(task)
        task.add_done_callback(self._rejoining.discard)

    async def _restart(self, r: _Replica, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopped or r.why_down is None:
            return
        old = r.proc
        if old is not None and old.poll() is None:  # (its connection ended first)
            old.kill()
            await asyncio.to_thread(old.wait)
        logger.warning("data parallelism: starting replica %d again (restart %d of at most %d)", r.index,
                       self.restarts, self.config.dp_max_restarts)
        loop = asyncio.get_running_loop()
        r.connected = loop.create_future()
        r.why_down, r.joining = None, True  # (from here its process's exit or its connection's end is news)
        procs = spawn_replicas(range(self.local), self._listener, self._key, self.config, os.getpid(),
                               only={r.index})
        self._watch(loop, r, procs[r.index])
        try:
            await asyncio.wait_for(asyncio.shield(r.connected), START_TIMEOUT_S)
        except Exception as e:  # (it died first: `_lost` has failed the future and decided what comes next)
            if r.why_down is None:
                self._lost(r, f"it did not connect again ({e!r})")
            return
        await self._rejoin(r)

    async def _rejoin(self, r: _Replica) -> None:
        """A replica connected again: start its engine as the others were (and the adapters added since, a pause in
        force), then route to it."""
        try:
            r.info = await self._call(r, "__start__", self._model, self._replica_args, self.kv_events_config)
            for lora in self._loras.values():
                await self._call(r, "add_lora", lora.name, lora.path)
            if self._paused:
                await self._call(r, "pause_generation", "keep")
        except Exception as e:
            if r.why_down is None:
                self._lost(r, f"it failed to start again: {e}")
            return
        if self._stopped or not r.joining:
            return
        r.up, r.joining = True, False
        self.router.mark_up(r.index)
        logger.warning("data parallelism: replica %d is up again; %d of %d replicas up", r.index,
                       sum(x.up for x in self.replicas), self.size)

    def _on_message(self, r: _Replica, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch":
            _, outputs, running, kv_usage, events = msg
            self.router.report(r.index, running, kv_usage)
            if events:
                self.router.apply_events(r.index, events)
            for rid, item, cached, predictions in outputs:
                entry = self._streams.get(rid)
                if entry is None:
                    continue
                stream, queue, _ = entry
                if isinstance(item, BaseException):
                    if isinstance(item, EngineDeadError) and "data-parallel replica" not in str(item):
                        item = EngineDeadError(f"data-parallel replica {r.index}: {item}")  # (which one failed)
                    queue.put_nowait(item)
                    self._end(rid, r)
                    continue
                stream.cached_tokens = cached
                if predictions:
                    stream.predictions.update(predictions)
                queue.put_nowait(item)
                if item.finished:
                    self.router.finished(r.index)
                    left = self._remaining[rid] = self._remaining.get(rid, 1) - 1
                    if left <= 0:
                        self._end(rid, r)
        elif kind == "added":  # (registered here, before any output of it is read)
            _, cid, rid, num_seqs, prompt_ids = msg
            queue: asyncio.Queue = asyncio.Queue()
            stream = _Stream(self, rid, num_seqs, prompt_ids, queue)  # type: ignore[arg-type]
            self._streams[rid] = (stream, queue, r.index)
            self._remaining[rid] = num_seqs
            r.streams.add(rid)
            self.router.started(r.index, num_seqs - self._guesses.pop(cid, 0))
            self._idle.clear()  # type: ignore[union-attr]
            fut = r.calls.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result(stream)
        elif kind in ("result", "error"):
            _, cid, value = msg
            fut = r.calls.pop(cid, None)
            if fut is not None and not fut.done():
                (fut.set_result if kind == "result" else fut.set_exception)(value)

    def _end(self, rid: str, r: _Replica) -> None:
        entry = self._streams.pop(rid, None)
        left = self._remaining.pop(rid, 0)
        if entry is not None and left > 0:
            self.router.finished(r.index, left)
        r.streams.discard(rid)
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self._streams and self._idle is not None:
            self._idle.set()

    def _send(self, r: _Replica, msg: tuple) -> None:
        if not (r.up or r.joining) or r.writer is None:
            raise EngineDeadError(f"the engine has failed: data-parallel replica {r.index} is down ({r.why_down})")
        _write(r.writer, msg)

    async def _call(self, r: _Replica, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """`await replica.engine.method(*args, **kwargs)` on replica r (or one of the replica's own verbs)."""
        self._ids += 1
        cid = self._ids
        fut = asyncio.get_running_loop().create_future()
        r.calls[cid] = fut
        try:
            self._send(r, ("call", cid, method, args, kwargs))
        except BaseException:
            r.calls.pop(cid, None)
            raise
        return await (asyncio.wait_for(fut, timeout) if timeout is not None else fut)

    async def _fan_out(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self._check_alive()
        up = [r for r in self.replicas if r.up]
        return list(await asyncio.gather(*(self._call(r, method, *args, **kwargs) for r in up)))

    async def stop(self, drain_timeout: float = 0.0) -> None:
        if self._stopped:
            return
        if drain_timeout > 0 and self._paused:
            await self.resume_generation()
        if drain_timeout > 0 and self._streams and self._idle is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
            except asyncio.TimeoutError:
                logger.warning("drain timeout: aborting %d request(s)", len(self._streams))
        self._stopped = True
        for task in list(self._rejoining):
            task.cancel()
        for rid in list(self._streams):
            self.abort_now(rid)
        stops = []
        for r in self.replicas:
            if r.up:
                stops.append(self._call(r, "__stop__", timeout=30.0))
        if stops:
            await asyncio.gather(*stops, return_exceptions=True)
        await self._kill_all(grace=10.0)
        for _, queue, _ in list(self._streams.values()):  # (what a replica left unanswered)
            queue.put_nowait(EngineDeadError("the engine has stopped"))
        self._streams.clear()
        self._maybe_idle()
        for server in (self._server, self._remote_server):
            if server is not None:
                server.close()
        self._server = self._remote_server = None
        self._store = None

    async def _kill_all(self, grace: float = 0.0) -> None:
        self._stopped = True
        deadline = time.monotonic() + grace
        for r in self.replicas:
            if r.proc is None:
                continue
            while r.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if r.proc.poll() is None:
                r.proc.kill()
                await asyncio.to_thread(r.proc.wait)
            if r.writer is not None:
                r.writer.close()
            r.up = False

    # ------------------------------------------------------------------ properties
    @property
    def is_alive(self) -> bool:
        return self._started and not self._stopped and any(r.up for r in self.replicas)

    def replica_health(self) -> list[dict]:
        """Each replica: up or down (and why), its process id and its in-flight requests."""
        return [{"engine": r.index, "up": r.up, **({"restarting": True} if r.joining else {}),
                 "pid": r.proc.pid if r.proc is not None else r.info.get("pid"),
                 **({"host": r.info.get("host")} if r.proc is None else {}),
                 "in_flight": len(r.streams), **({"error": r.why_down} if not r.up and r.why_down else {})}
                for r in self.replicas]

    @property
    def model_name(self) -> str:
        return str(self.config.model) if self.config.model else "streamer-demo"

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def image_prompts(self) -> Any:
        """How the model takes images, video or audio (a replica's ImagePrompts / AudioPrompts; None: a text
        model). Prompts with media go to a replica as they came: it loads and encodes them."""
        return self._image_prompts

    @property
    def takes_media(self) -> bool:
        return self._image_prompts is not None

    def place_images(self, token_ids: list[int], data: Any) -> tuple[list[int], tuple]:
        """LLMEngine.place_images, here (the server's /tokenize: the prompt the model would read)."""
        if self._image_prompts is None:
            if data:
                raise ValueError("multi_modal_data: this model takes no images, video or audio")
            return token_ids, ()
        return place_media(self._image_prompts, token_ids, data)

    @property
    def classifier(self):
        return self.replicas[0].info.get("classifier")

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.replicas[0].info.get("sampling_defaults", {})

    def get_default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].info["default_params"].clone()

    @property
    def num_overlapped_steps(self) -> int:
        return 0

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def loras(self) -> dict:
        return dict(self._loras)

    def stats(self) -> dict:
        """The router's view of each replica (the replicas' own stats are on /metrics)."""
        reps = [{"engine": v.index, "up": v.up, "in_flight": v.inflight, "running": v.running,
                 "waiting": v.waiting, "kv_cache_usage": v.kv_usage, "cached_blocks": len(v.blocks),
                 "routed": self.router.routed[v.index]} for v in self.router.replicas]
        return {"num_running": sum(x["running"] for x in reps), "num_waiting": sum(x["waiting"] for x in reps),
                "num_requests": len(self._streams), "replicas": reps}

    def _check_alive(self) -> None:
        if not self._started:
            raise RuntimeError("the engine is not started: use `async with` or `await start()`")
        if self._stopped:
            raise EngineDeadError("the engine is not running")
        if not any(r.up for r in self.replicas):
            why = "; ".join(f"replica {r.index}: {r.why_down or 'starting again'}" for r in self.replicas)
            raise EngineDeadError(f"the engine has failed: every data-parallel replica is down ({why})")

    # ------------------------------------------------------------------ requests
    async def encode(self, text: str, add_special_tokens: bool = True, keep_last: Optional[int] = None) -> list[int]:
        tok = self._tokenizer
        limit = self._max_model_len * tok.max_token_chars
        if len(text) > limit:
            if keep_last is None:
                raise ValueError(f"prompt is {len(text)} characters long, more than its tokens could fit in: "
                                 f"max_model_len is {self._max_model_len}; shorten it or set truncate_prompt_tokens")
            text = text[-(keep_last * tok.max_token_chars + 64):]
        if len(text) > 4096:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens)
        return tok.encode(text, add_special_tokens)

    async def _chain(self, prompt: PromptType, cache_salt: Optional[str]) -> tuple[PromptType, list[bytes]]:
        """The prompt's block-hash chain, as the replica's prefix cache hashes it (Request's own code), and the
        prompt to send (a text tokenized here goes with its ids, so the replica does not tokenize it again)."""
        from streamer.core.request import Request
        ids: Optional[list[int]] = None
        if isinstance(prompt, str):
            if len(prompt) > self._max_model_len * self._tokenizer.max_token_chars:
                return prompt, []  # (the replica refuses it)
            ids = await self.encode(prompt)
            prompt = {"prompt": prompt, "prompt_token_ids": ids}
        elif isinstance(prompt, dict) and prompt.get("multi_modal_data") is None and "prompt_embeds" not in prompt:
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                return await self._chain(prompt["prompt"], cache_salt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        if not ids or len(ids) > self._max_model_len:
            return prompt, []
        req = Request("route", ids, _DEFAULT_PARAMS, 1, cache_salt=cache_salt, block_size=self.config.block_size)
        return prompt, req.block_hashes

    async def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                          request_id: Optional[str] = None, priority: int = 0,
                          cache_salt: Optional[str] = None, lora_request: LoRAType = None,
                          pooling: Optional[PoolingParams] = None, stream: bool = True) -> RequestStream:
        """AsyncEngine.add_request, on the replica the router picks."""
        self._check_alive()
        if request_id is not None and request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        rid = request_id if request_id is not None else f"dp-{uuid.uuid4().hex}"
        chain: list[bytes] = []
        if self.router.policy == "cache_aware" and self.config.enable_prefix_caching and pooling is None \
                and getattr(params, "truncate_prompt_tokens", None) is None:
            prompt, chain = await self._chain(prompt, cache_salt)
        session = SESSION_KEY.get()
        while True:
            try:
                index = self.router.choose(chain, session)
            except NoReplicaError:
                self._check_alive()
                raise EngineDeadError("the engine has failed: no data-parallel replica is up") from None
            r = self.replicas[index]
            self._ids += 1
            cid = self._ids
            fut = asyncio.get_running_loop().create_future()
            r.calls[cid] = fut
            # (counted in flight now, so that requests right behind it see the load it adds)
            guess = self._guesses[cid] = params.n if params is not None else 1
            self.router.started(index, guess)
            try:
                self._send(r, ("add", cid, rid, prompt, params, priority, cache_salt, lora_request, pooling, stream))
            except EngineDeadError:
                r.calls.pop(cid, None)
                self._guesses.pop(cid, None)
                continue  # (it went down just now: another one)
            try:
                return await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    fut.result().close()
                raise
            except BaseException:
                if self._guesses.pop(cid, None) is not None and r.up:
                    self.router.finished(index, guess)
                raise

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    def abort_now(self, request_id: str) -> None:
        """Abort on the request's replica: its last outputs (finish_reason "abort") follow from there."""
        entry = self._streams.get(request_id)
        if entry is None:
            return
        r = self.replicas[entry[2]]
        try:
            self._send(r, ("abort", request_id))
        except (EngineDeadError, ConnectionError, RuntimeError):
            pass

    async def beam_search(self, prompt: PromptType, params: Any, lora_request: LoRAType = None) -> Any:
        """On one replica (the least loaded): each step's beams run there as a batch."""
        self._check_alive()
        r = self.replicas[self.router.choose()]
        return await self._call(r, "beam_search", prompt, params, lora_request)

    # ------------------------------------------------------------------ every replica at once
    async def pause_generation(self, mode: str = "keep") -> int:
        if mode not in ("keep", "abort", "retract"):
            raise ValueError(f"mode must be 'keep', 'abort' or 'retract', got {mode!r}")
        self._paused = True
        return sum(await self._fan_out("pause_generation", mode))

    async def resume_generation(self) -> None:
        self._paused = False
        if any(r.up for r in self.replicas):
            await self._fan_out("resume_generation")

    async def reset_prefix_cache(self) -> int:
        return sum(await self._fan_out("reset_prefix_cache"))

    async def update_weights(self, weights: Any, partial: bool = False) -> None:
        """Every replica loads the same weights (a checkpoint folder, or tensors, which are pickled to each)."""
        self._weights_updated = True
        await self._fan_out("update_weights", weights, partial)

    async def add_lora(self, name: str, path: str) -> None:
        if name in self._loras:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        await self._fan_out("add_lora", name, path)
        self._loras[name] = _LoraInfo(name, path)

    def remove_lora(self, name: str) -> None:
        if name not in self._loras:
            raise KeyError(name)
        del self._loras[name]
        for r in self.replicas:
            if r.up:
                self._ids += 1
                r.calls[self._ids] = asyncio.get_running_loop().create_future()
                r.calls[self._ids].add_done_callback(lambda f: f.cancelled() or f.exception())
                self._send(r, ("call", self._ids, "remove_lora", (name,), {}))

    async def on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise ValueError("data_parallel_size > 1 runs no work on a device outside the replicas' steps")

    async def wait_rank_lost(self) -> str:
        await asyncio.Event().wait()  # (never: a lost replica does not end the server)
        return ""


@dataclasses.dataclass
class _LoraInfo:
    name: str
    path: str


def make_async_engine(model: Optional[str] = None, **engine_args) -> "AsyncEngine | DataParallelEngine":
    """AsyncEngine, or DataParallelEngine with data_parallel_size > 1."""
    if engine_args.get("data_parallel_size", 1) not in (None, 1):
        return DataParallelEngine(model, **engine_args)
    return AsyncEngine(model, **engine_args)


# ---------------------------------------------------------------------------------------------------- a replica
class _ReplicaServer:
    """One replica's side: a real AsyncEngine, driven by the front's messages."""

    def __init__(self, writer: asyncio.StreamWriter, rank: int) -> None:
        self.writer = writer
        self.rank = rank
        self.engine: Optional[AsyncEngine] = None
        self.publisher: Any = None  # (--kv-events-config: server/kv_events.py's ZmqEventPublisher)
        self.outbox: list[tuple] = []
        self.events: list = []
        self._flush_scheduled = False
        self.streams: dict[str, RequestStream] = {}
        self.done = asyncio.Event()
        self.stopping = False

    def send(self, msg: tuple) -> None:
        _write(self.writer, msg)

    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Everything since the last flush, in one message: outputs, load, the prefix cache's events."""
        self._flush_scheduled = False
        e = self.engine
        if e is None or e.engine is None:
            return
        sched = e.engine.scheduler
        out, self.outbox = self.outbox, []
        events, self.events = self.events, []
        self.send(("batch", out, sched.num_running, e.engine.kv.usage, events))

    def on_events(self, events: list) -> None:
        self.events.extend(events)
        self.schedule_flush()

    async def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, cid, rid, prompt, params, priority, salt, lora, pooling, stream = msg
            try:
                assert self.engine is not None
                s = await self.engine.add_request(prompt, params, rid, priority, salt, lora, pooling, stream)
            except Exception as e:
                self.send(("error", cid, _portable(e)))
                return
            self.send(("added", cid, s.request_id, s.num_seqs, list(s.prompt_token_ids)))
            self.streams[s.request_id] = s
            asyncio.ensure_future(self.pump(s))
        elif kind == "abort":
            if self.engine is not None:
                self.engine.abort_now(msg[1])
        elif kind == "call":
            _, cid, method, args, kwargs = msg
            try:
                result = await self.call(method, args, kwargs)
            except Exception as e:
                self.send(("error", cid, _portable(e)))
            else:
                try:
                    self.send(("result", cid, result))
                except Exception as e:  # (a result that does not pickle)
                    self.send(("error", cid, _portable(RuntimeError(f"{method}: {e!r}"))))
            if method == "__stop__":
                self.done.set()

    async def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        if method == "__start__":
            model, engine_args, events_config = args
            model = os.environ.get("STREAMER_DP_MODEL") or model  # (a headless node's own path to it)
            if events_config is not None:  # (a port in use fails before the model loads)
                from streamer.server.kv_events import make_publisher
                self.publisher = make_publisher(events_config, data_parallel_rank=self.rank)
            self.engine = AsyncEngine(model, **engine_args)
            await self.engine.start()
            self.engine.kv_event_sinks.append(self.on_events)
            if self.publisher is not None:
                self.engine.kv_event_sinks.append(self.publisher.sink)
            asyncio.ensure_future(self.watch_engine())
            core = self.engine.engine
            assert core is not None
            return {"max_model_len": core.max_model_len, "takes_media": self.engine.takes_media,
                    "image_prompts": self.engine.image_prompts, "speech": core.speech is not None,
                    "classifier": core.classifier, "sampling_defaults": core.sampling_defaults,
                    "default_params": core.default_sampling_params(), "vocab_size": core.vocab_size,
                    "pid": os.getpid(), "host": socket.gethostname()}
        assert self.engine is not None
        if method == "__metrics__":
            if self.engine.metrics is None:
                return ""
            self.engine.metrics.model_name = args[0]
            return self.engine.metrics.render()
        if method == "__stop__":
            self.stopping = True
            await self.engine.stop()
            self.close_publisher()
            return None
        result = getattr(self.engine, method)(*args, **kwargs)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    def close_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    async def watch_engine(self) -> None:
        """The engine died (its device thread failed, a tensor-parallel rank was lost): its requests have failed
        with the reason; this process then exits, so the front marks the replica down."""
        assert self.engine is not None and self.engine._task is not None
        await asyncio.wait([self.engine._task])  # (not `await task`: a lost rank ends it cancelled)
        if self.done.is_set() or self.stopping:
            return
        await asyncio.sleep(0.2)  # (the failed requests' errors go out first)
        self.flush()
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        logging.getLogger("streamer").error("data-parallel replica: the engine has failed (%s); exiting",
                                            self.engine._dead or self.engine.rank_lost)
        os._exit(1)

    async def pump(self, s: RequestStream) -> None:
        rid = s.request_id
        try:
            async for item in s:
                self.outbox.append((rid, item, s.cached_tokens, dict(s.predictions) or None))
                self.schedule_flush()
        except Exception as e:
            self.outbox.append((rid, _portable(e), 0, None))
            self.schedule_flush()
        finally:
            self.streams.pop(rid, None)


async def _replica_main(addr: str, key: bytes, rank: int) -> int:
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    _nodelay(writer)
    nonce = await reader.readexactly(32)
    writer.write(_proof(key, nonce) + struct.pack("!I", rank))
    srv = _ReplicaServer(writer, rank)
    tasks: set[asyncio.Task] = set()

    async def read_loop() -> None:
        while True:
            msg = await _read(reader)
            t = asyncio.ensure_future(srv.handle(msg)) if msg[0] in ("add", "call") else None
            if t is None:
                await srv.handle(msg)
            else:
                tasks.add(t)
                t.add_done_callback(tasks.discard)

    reading = asyncio.ensure_future(read_loop())
    stopping = asyncio.ensure_future(srv.done.wait())
    await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not srv.done.is_set():  # the front is gone: stop, and no orphan is left
        srv.stopping = True
        if srv.engine is not None:
            await srv.engine.stop()
        srv.close_publisher()
        return 1
    try:
        await writer.drain()
    except ConnectionError:
        pass
    reading.cancel()
    return 0


def main() -> int:
    rank = int(os.environ["STREAMER_DP_RANK"])
    parent = int(os.environ.get("STREAMER_DP_PARENT", "0"))
    if parent:
        from streamer.worker.rendezvous import die_with_parent
        die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C on the terminal: the front stops the replicas)
    cpus = os.environ.get("STREAMER_DP_CPUS")
    if cpus:
        mine = [int(c) for c in cpus.split(",")]
        try:
            os.sched_setaffinity(0, mine)
        except (AttributeError, OSError):
            pass
        import torch
        torch.set_num_threads(max(1, len(mine)))
    logging.basicConfig(level=os.environ.get("STREAMER_DP_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s [dp{rank}] %(name)s: %(message)s")
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(_replica_main(os.environ["STREAMER_DP_ADDR"], bytes.fromhex(os.environ["STREAMER_DP_KEY"]),
                                        rank))


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------------------------------- offline
class OfflineDataParallel:
    """`LLM(..., data_parallel_size=N)`: a DataParallelEngine on a background event loop; `generate` spreads the
    prompts over the replicas and returns the outputs in the prompts' order."""

    def __init__(self, model: Optional[str], engine_args: dict) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamer-dp-loop", daemon=True)
        self._thread.start()
        self.engine = DataParallelEngine(model, **engine_args)
        try:
            self._run(self.engine.start())
        except BaseException:
            self.close()
            raise
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.image_prompts = self.engine.image_prompts
        self.classifier = self.engine.classifier

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    def generate(self, prompts: list, params: list, priorities: list[int], loras: list) -> list:
        return self._run(self._all(self.engine.generate(p, sp, priority=prio, lora_request=lo)
                                   for p, sp, prio, lo in zip(prompts, params, priorities, loras)))

    def pool(self, prompts: list, pooling: PoolingParams, loras: list) -> list[tuple[str, Any, list[int], int]]:
        """Pooling requests (embed, classify, score) spread over the replicas: each one's (request id, result,
        prompt token ids, cached tokens), in the prompts' order."""
        return self._run(self._all(self.engine._pool(p, pooling, None, 0, lo) for p, lo in zip(prompts, loras)))

    def beam_search(self, prompts: list, params: Any) -> list:
        """Each prompt's search on one replica (the least loaded when it starts)."""
        return self._run(self._all(self.engine.beam_search(p, params) for p in prompts))

    @staticmethod
    async def _all(coros: Any) -> list:
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    def reset_prefix_cache(self) -> int:
        return self._run(self.engine.reset_prefix_cache())

    def update_weights(self, weights: Any, partial: bool = False) -> None:
        self._run(self.engine.update_weights(weights, partial))

    def add_lora(self, name: str, path: str) -> None:
        self._run(self.engine.add_lora(name, path))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if getattr(self, "engine", None) is not None and self.engine._started:
            try:
                self._run(self.engine.stop())
            except Exception:
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"LLM(data_parallel_size > 1) runs generate(), chat(), beam_search(), embed(), classify(), "
                         f"score(), reset_prefix_cache(), update_weights() and add_lora(); not this ({name}): use "
                         f"data_parallel_size=1")
