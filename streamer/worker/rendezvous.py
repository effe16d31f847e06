"""Where tensor-parallel ranks meet, on one machine or several (docs/multi-node.md), and how each side sees the
other go.

- **Layout.** `node_layout` places the ranks: node n runs ranks n*P .. n*P+P-1 (P = `nproc_per_node`: the GPUs a
  node has, or T/N on CPU); rank 0, on node 0 (the head), runs the engine. Under torchrun its own environment
  (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...) says the same.
- **Rendezvous.** The ranks meet at a torch.distributed TCPStore: on one machine one that rank 0 starts on
  127.0.0.1; across machines the one at --master-addr:--master-port (the head's), or torchrun's (env://). The head
  puts two things in it: the address of its step listener (bound to its routable --dist-host) and a random key for
  that listener, which only ranks that read the store can pass. The store itself has no authentication: the ranks'
  network must be private (docs/multi-node.md). The same store then starts the process group (gloo on CPU, bound to
  --dist-host's interface; NCCL on CUDA).
- **Faults.** Each rank also opens a *watch* connection to the head. Both ends send a heartbeat every second: the
  head's `Monitor` reports a rank whose connection closes, whose process exits or that stays silent for
  `heartbeat_timeout()` seconds (a dropped link sends no FIN); a rank's `Watchdog` exits its process when the head's
  does (or goes silent), even from inside a collective that would otherwise wait for its timeout.
- **Nodes.** `run_node` is a node without the engine (`streamer serve --headless`): it starts its ranks, which die
  with it, and exits when they do.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

# How long ranks wait for one another to start (a node whose model loads slowly) and a collective may take.
STORE_TIMEOUT = datetime.timedelta(minutes=10)
HEARTBEAT_S = 1.0
DEFAULT_MASTER_PORT = 29501  # vLLM's
_KEY = "streamer/tp/key"
_STEPS = "streamer/tp/steps"
_BEAT = b"\x01"


def heartbeat_timeout() -> float:
    """Seconds of silence after which a rank (or the head) is taken for lost: 5, or $STREAMER_TP_HEARTBEAT_TIMEOUT."""
    return float(os.environ.get("STREAMER_TP_HEARTBEAT_TIMEOUT", "5"))


# ---------------------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """How a tensor-parallel group of `world` ranks spreads over nodes, and where they meet."""

    world: int
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: one machine, a free port rank 0 picks
    dist_host: Optional[str] = None  # this node's routable address (None: 127.0.0.1 on one machine)
    torchrun: bool = False

    @property
    def multi_node(self) -> bool:
        """Whether the ranks meet through the master's store (several nodes, or torchrun) rather than rank 0's own
        on 127.0.0.1."""
        return self.nnodes > 1 or self.torchrun

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.nproc_per_node

    def host(self) -> str:
        """The address this node's listener and ranks bind to, that the other nodes reach it by."""
        if self.dist_host:
            return self.dist_host
        if not self.multi_node:
            return "127.0.0.1"
        return self.master_addr if self.node_rank == 0 else route_source(self.master_addr, self.master_port)


def node_layout(world: int, device: str, nnodes: int = 1, node_rank: int = 0, nproc_per_node: Optional[int] = None,
                master_addr: Optional[str] = None, master_port: Optional[int] = None,
                dist_host: Optional[str] = None, torchrun: bool = False) -> Layout:
    """The layout from the engine's flags (ValueError naming the flag). Under torchrun its environment decides."""
    if torchrun:
        env = os.environ
        world_env = int(env["WORLD_SIZE"])
        if world_env != world:
            raise ValueError(f"torchrun started {world_env} processes (WORLD_SIZE) for {world} ranks "
                             "(tensor_parallel_size x pipeline_parallel_size)")
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        return Layout(world, nnodes=world // local, node_rank=int(env["RANK"]) // local, nproc_per_node=local,
                      master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]), dist_host=dist_host,
                      torchrun=True)
    if not isinstance(nnodes, int) or nnodes < 1 or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not one of --nnodes {nnodes}'s 0..{nnodes - 1}")
    if nproc_per_node is None:  # every rank on this machine; across machines, the GPUs a node has (T/N on CPU)
        nproc_per_node = world if nnodes == 1 else (_gpus(device) or world // nnodes)
    if nproc_per_node < 1 or nproc_per_node * nnodes != world:
        raise ValueError(f"{world} ranks (tensor x pipeline parallel size) does not split into {nnodes} node(s) of "
                         f"{nproc_per_node} rank(s) (--nproc-per-node x --nnodes must equal it)")
    if nnodes > 1 and not master_addr:
        raise ValueError("several nodes need --master-addr: the head's address, routable from every node")
    if dist_host is not None and dist_host in ("0.0.0.0", "::", ""):
        raise ValueError(f"--dist-host {dist_host!r}: give this node's own address, which other nodes connect to")
    return Layout(world, nnodes, node_rank, nproc_per_node, master_addr or "127.0.0.1",
                  (master_port or DEFAULT_MASTER_PORT) if nnodes > 1 else 0, dist_host)


def _gpus(device: str) -> int:
    if device.startswith("cpu") or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def torchrun_env() -> Optional[dict[str, int]]:
    """torchrun's placement of this process ({rank, world, local_rank}) when it started it, else None."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not all(n in os.environ for n in names):
        return None
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ["LOCAL_RANK"])}


# ---------------------------------------------------------------------------------------------------- addresses
def route_source(host: str, port: int) -> str:
    """This machine's address on the route to `host`: what a peer there reaches us by. (A UDP socket's connect sends
    nothing; it only picks the route.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port or DEFAULT_MASTER_PORT))
        return s.getsockname()[0]


def interface_of(host: str) -> Optional[str]:
    """The network interface (Linux) whose IPv4 address `host` is, for gloo's GLOO_SOCKET_IFNAME: left to itself,
    gloo binds to what the machine's hostname resolves to, often 127.0.0.1, which another node cannot reach."""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None
    if addr.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's (first) IPv4 address, which gloo also takes
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


# ---------------------------------------------------------------------------------------------------- store
@dataclasses.dataclass
class RankGroup:
    """One rank's place in the group, and the store the group meets at (not picklable: each process has its own)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    store: torch.distributed.Store
    host: Optional[str] = None  # this node's routable address (multi-node): gloo binds to its interface
    cpus: Optional[list[int]] = None  # the cores this rank is pinned to (rank_cpu_shares), if it is


# ---------------------------------------------------------------------------------------------------- cores
def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity: a data-parallel replica's share, taskset, a cpuset), not
    every core of the machine (os.cpu_count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return list(range(os.cpu_count() or 1))


def rank_cpu_shares(local_world: int) -> Optional[list[list[int]]]:
    """Each of this node's ranks' cores (local rank i: the i-th equal run of this process's cores) when its ranks
    are pinned apart: inside a data-parallel replica (STREAMER_DP_CPUS: the replica's own share, which its ranks
    split further) with at least one core per rank. None otherwise: every rank then runs usable_cpus() // local_world
    threads, unpinned."""
    if not os.environ.get("STREAMER_DP_CPUS"):
        return None
    cpus = usable_cpus()
    per = len(cpus) // local_world
    if per == 0:
        return None
    return [cpus[i * per:(i + 1) * per] for i in range(local_world)]


def rank_threads(local_world: int, cpus: Optional[list[int]] = None) -> int:
    """A CPU rank's torch threads: its own cores when pinned, else its share of this process's usable cores."""
    return len(cpus) if cpus else max(1, len(usable_cpus()) // local_world)


def pin(cpus: Optional[list[int]]) -> None:
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as e:
            logger.warning("cannot pin this rank to cores %s: %s", cpus, e)


def head_store(layout: Layout) -> torch.distributed.Store:
    """Rank 0's store: the master one at --master-addr:--master-port (or a free port on 127.0.0.1), or torchrun's."""
    if layout.torchrun:
        return _torchrun_store()
    return torch.distributed.TCPStore(layout.master_addr, layout.master_port, is_master=True,
                                      wait_for_workers=False, timeout=STORE_TIMEOUT)


def rank_store(master_addr: str, master_port: int, torchrun: bool = False) -> torch.distributed.Store:
    """Another rank's store: a client of the master's (it waits for the head to start, up to STORE_TIMEOUT)."""
    if torchrun:
        return _torchrun_store()
    return torch.distributed.TCPStore(master_addr, master_port, is_master=False, timeout=STORE_TIMEOUT)


def _torchrun_store() -> torch.distributed.Store:
    store, _, _ = next(torch.distributed.rendezvous("env://", timeout=STORE_TIMEOUT))
    return store


def publish(store: torch.distributed.Store, steps_address: str, key: bytes) -> None:
    """The head's step listener and its key, for the ranks that read the store."""
    store.set(_KEY, key.hex())
    store.set(_STEPS, steps_address)


def lookup(store: torch.distributed.Store) -> tuple[str, bytes]:
    """(the head's step listener address, its key), once the head has published them."""
    key = bytes.fromhex(store.get(_KEY).decode())
    return store.get(_STEPS).decode(), key


def no_delay(conn: Connection) -> Connection:
    """Turn Nagle's algorithm off on a connection's socket. multiprocessing writes a message over 16 KiB as its 4-byte
    header, then its payload: with Nagle on, the payload waits for the header's ACK, which the receiver delays up to
    40 ms (a 64-sequence decode step took 44 ms to reach the ranks, bench/step_fanout.py)."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        finally:
            sock.close()
    return conn


_gloo_host: Optional[str] = None  # this process's routable address, for the groups made after the first


def init_process_group(group: RankGroup, device: torch.device) -> None:
    global _gloo_host
    backend = "nccl" if device.type == "cuda" else "gloo"
    _gloo_host = group.host if backend == "gloo" else None
    with gloo_bound():
        # The timeout bounds the rendezvous (a rank that died while importing) and any one collective.
        torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("streamer/pg", group.store),
                                             rank=group.rank, world_size=group.world, timeout=STORE_TIMEOUT)


@contextlib.contextmanager
def gloo_bound() -> Iterator[None]:
    """While gloo groups are made (the first, and any `new_group` after it: pipeline stages): bind them to the
    interface holding this node's routable address (GLOO_SOCKET_IFNAME, read as a group is built, then put back),
    not where the hostname resolves (often 127.0.0.1)."""
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    host = _gloo_host
    if host and saved is None:
        iface = interface_of(host)
        if iface is None:
            logger.warning("no network interface holds %s: gloo binds where the hostname resolves (set "
                           "GLOO_SOCKET_IFNAME)", host)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


# ---------------------------------------------------------------------------------------------------- faults
class Monitor:
    """The head's watch over ranks 1..N-1: their watch connections (heartbeats both ways) and, for the ranks it
    started, their processes. The first loss is logged, kept in `fault`, and handed to the callbacks (`watch`)."""

    def __init__(self, watches: dict[int, Connection], where: dict[int, str],
                 procs: dict[int, subprocess.Popen]) -> None:
        self.watches, self.where, self.procs = watches, where, procs
        self.fault: Optional[str] = None
        self.faulted = threading.Event()
        self.closing = False  # set as rank 0 stops the ranks: those that go are no longer losses
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streamer-tp-monitor", daemon=True)
        self._thread.start()

    def watch(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` (from the monitor's thread) when a rank is lost; at once if one already is."""
        with self._lock:
            self._callbacks.append(callback)
            fault = self.fault
        if fault is not None:
            callback(fault)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        timeout = heartbeat_timeout()
        watches = dict(self.watches)
        procs = dict(self.procs)
        heard = {r: time.monotonic() for r in watches}
        sent = 0.0
        while not self._stop.is_set() and watches:
            by_conn = {id(c): r for r, c in watches.items()}
            try:
                ready = wait(list(watches.values()), timeout=HEARTBEAT_S / 2)
            except OSError:
                ready = []
            now = time.monotonic()
            lost: dict[int, str] = {}
            for conn in ready:
                rank = by_conn[id(conn)]
                try:
                    conn.recv_bytes()
                    heard[rank] = now
                except (EOFError, OSError):
                    lost[rank] = self._closed(rank)
            for rank, proc in procs.items():
                if proc.poll() is not None and rank not in lost:
                    lost[rank] = f"has exited (code {proc.returncode})"
            if now - sent >= HEARTBEAT_S:
                sent = now
                for rank, conn in watches.items():
                    try:
                        conn.send_bytes(_BEAT)
                    except OSError:
                        lost.setdefault(rank, self._closed(rank))
            for rank, t in heard.items():
                if now - t > timeout and rank not in lost:
                    lost[rank] = f"was silent for {timeout:g} s (its node or the link to it is down)"
            if lost and not self.closing:
                rank = min(lost)
                return self._lost(rank, lost[rank])
            for rank in lost:  # (closing: ranks leave; the others still get heartbeats until they do)
                watches.pop(rank, None)
                procs.pop(rank, None)
                heard.pop(rank, None)

    def _closed(self, rank: int) -> str:
        proc = self.procs.get(rank)
        if proc is not None:
            try:
                return f"has exited (code {proc.wait(1)})"
            except subprocess.TimeoutExpired:
                pass
        return "was lost: its connection closed (the process or its node is gone)"

    def _lost(self, rank: int, what: str) -> None:
        why = f"tensor-parallel rank {rank} {what} [{self.where.get(rank, '?')}]"
        logger.error("%s", why)
        with self._lock:
            self.fault = why
            callbacks = list(self._callbacks)
        self.faulted.set()
        for callback in callbacks:
            try:
                callback(why)
            except Exception:
                logger.exception("a tensor-parallel fault callback failed")


class Watchdog:
    """A rank's watch over the head: heartbeats both ways on its watch connection. When the head's process ends (or
    goes silent) this rank exits at once, wherever its main thread is (a collective would wait for its timeout)."""

    def __init__(self, conn: Connection, rank: int, head: str) -> None:
        self.conn, self.rank, self.head = conn, rank, head
        self.stopping = threading.Event()
        threading.Thread(target=self._run, name="streamer-tp-watchdog", daemon=True).start()

    def _run(self) -> None:
        timeout = heartbeat_timeout()
        heard = sent = time.monotonic()
        why = ""
        while True:
            try:
                if self.conn.poll(HEARTBEAT_S / 2):
                    self.conn.recv_bytes()
                    heard = time.monotonic()
                now = time.monotonic()
                if now - sent >= HEARTBEAT_S:
                    self.conn.send_bytes(_BEAT)
                    sent = now
                if now - heard > timeout:
                    why = f"was silent for {timeout:g} s (its node or the link to it is down)"
                    break
            except (EOFError, OSError):
                why = "is gone (its connection closed)"
                break
        if self.stopping.is_set():
            return
        # (stderr directly: logging may be held by the thread we are about to end)
        print(f"streamer: tensor-parallel rank {self.rank}: the head (rank 0, {self.head}) {why}; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)


def die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent (a headless node's `run_node`) ends, however it ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the call above
        os._exit(1)


# ---------------------------------------------------------------------------------------------------- nodes
def rank_command(entry: str, spec: dict) -> list[str]:
    """The command line of one rank's process (streamer/worker/parallel.py's main)."""
    return [sys.executable, "-m", "streamer.worker.parallel", entry, json.dumps(spec)]


def run_node(layout: Layout, entry: str, model_dir: Optional[str]) -> int:
    """A node without the engine (`streamer serve --headless`): start its ranks, which connect to the head, and wait.
    A rank that fails ends the others (the head sees the loss and exits); SIGTERM / SIGINT end them all. The ranks
    die with this process (SIGKILL on Linux), so killing it leaves no orphans. Returns the exit status: 0 when the
    head stopped the ranks, else the first failed rank's."""
    host = layout.host()
    spec = {"world": layout.world, "local_world": layout.nproc_per_node, "master": [layout.master_addr,
                                                                                   layout.master_port],
            "host": host, "model_dir": model_dir, "parent": os.getpid()}
    ranks = range(layout.first_rank, layout.first_rank + layout.nproc_per_node)
    logger.warning("node %d of %d (%s): ranks %d..%d of %d, meeting the head at %s:%d", layout.node_rank,
                   layout.nnodes, host, ranks[0], ranks[-1], layout.world, layout.master_addr, layout.master_port)
    procs = [subprocess.Popen(rank_command(entry, dict(spec, rank=r, local_rank=i))) for i, r in enumerate(ranks)]
    stopping: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        stopping.append(sig)
        for p in procs:
            if p.poll() is None:
                p.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    code: Optional[int] = None
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed and code is None and not stopping:
            code = failed[0].returncode if failed[0].returncode > 0 else 1
            logger.error("rank %d exited (code %d): stopping this node's other ranks", ranks[procs.index(failed[0])],
                         failed[0].returncode)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    if code is None:
        code = 0 if stopping or all(p.returncode == 0 for p in procs) else 1
    return code
