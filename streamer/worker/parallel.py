"""Tensor parallelism: one process per rank, each holding a Megatron shard of every layer (models/layers.py).

The engine's process is rank 0: it schedules, prepares each step, runs its shard and samples. Ranks 1..N-1 are
worker processes: on one machine rank 0 starts them here; across machines (docs/multi-node.md) each node starts its
own (`streamer serve --headless`, or torchrun) and they meet rank 0 through the rendezvous store (rendezvous.py).
Each step's host inputs go to them over a connection to rank 0's step listener (pickled numpy arrays; the sampling
parameters stay behind, since only rank 0 samples) and every rank runs the same forward, whose row layers all-reduce
their partial sums over torch.distributed (gloo on CPU, NCCL on CUDA). A connection, not a collective, carries the
steps: an idle server leaves its workers blocked on it for hours, which a collective's timeout would not allow. A
second connection per rank carries heartbeats both ways, so that each side sees the other go (rendezvous.Monitor,
rendezvous.Watchdog).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from streamer.worker.rendezvous import (
    STORE_TIMEOUT,
    Layout,
    Monitor,
    RankGroup,
    Watchdog,
    die_with_parent,
    head_store,
    init_process_group,
    lookup,
    no_delay,
    node_layout,
    pin,
    publish,
    rank_command,
    rank_store,
)

if TYPE_CHECKING:
    from streamer.config import EngineConfig
    from streamer.models.config import ModelConfig
    from streamer.worker.input_batch import StepInputs
    from streamer.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_STOP = b""
# What each rank says first on each of its two connections: ("steps" | "watch", rank, world, where it runs)
_KINDS = ("steps", "watch")


def layout_of(config: "EngineConfig") -> Layout:
    """Where the engine's tensor-parallel ranks run (one machine, or several: the multi-node fields)."""
    return node_layout(config.world_size, config.device, config.nnodes, config.node_rank,
                       config.nproc_per_node, config.master_addr, config.master_port, config.dist_host,
                       config.distributed_launcher == "torchrun")


def entry_of(run_rank: Callable[..., Any]) -> str:
    """A module-level function's name for another process to import ("module:function")."""
    entry = f"{run_rank.__module__}:{run_rank.__qualname__}"
    if getattr(sys.modules.get(run_rank.__module__), run_rank.__qualname__, None) is not run_rank:
        raise TypeError(f"run_rank must be a module-level function, not {run_rank!r}")
    return entry


@dataclasses.dataclass
class _Links:
    """What outlives a TensorParallelWorkers object until it is closed (its finalizer's state)."""

    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)  # the ranks this process started
    conns: list[Connection] = dataclasses.field(default_factory=list)  # rank 1, 2, ...: steps
    watches: dict[int, Connection] = dataclasses.field(default_factory=dict)
    monitor: Optional[Monitor] = None


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts this node's, meets the others', sends them every step, watches them
    (`lost`, `watch`) and stops them.

    Workers are fresh interpreters (`python -m streamer.worker.parallel`), not multiprocessing children: those would
    re-import the user's main module, which a script without an `if __name__ == "__main__"` guard cannot
    survive. Each one connects back to a listener with a random key: on one machine on 127.0.0.1 with the key in its
    environment; across machines on this node's routable address (--dist-host), the address and key published in
    the rendezvous store."""

    def __init__(self, config: "EngineConfig", model_dir: Path, model_cfg: "ModelConfig", max_model_len: int,
                 device: torch.device, run_rank: Callable[..., Any],
                 cpus: Optional[list[list[int]]] = None) -> None:
        """cpus: each local rank's cores (rendezvous.rank_cpu_shares), or None (unpinned). run_rank: what each worker runs once connected, a module-level function (named to the worker by its
        module and name), called as run_rank(conn, group, config, model_dir, model_cfg, max_model_len) with its
        `RankGroup`; it returns False when rank 0 went away rather than stopping it."""
        entry = entry_of(run_rank)
        self.layout = layout = layout_of(config)
        if layout.node_rank != 0:
            raise ValueError(f"node_rank {layout.node_rank} runs no engine: start that node with `streamer serve "
                             "--headless`")
        world = layout.world
        host = layout.host()
        self._links = links = _Links()
        self.procs, self.conns = links.procs, links.conns
        self._finalizer = weakref.finalize(self, _shutdown, links)
        store = head_store(layout)
        self._store = store  # (the process group holds it too)
        key = secrets.token_bytes(32)
        with Listener((host, 0), authkey=key) as listener:
            address = "%s:%d" % listener.address
            if layout.multi_node:
                publish(store, address, key)
            master = [layout.master_addr, layout.master_port or store.port]
            spec = {"world": world, "local_world": layout.nproc_per_node, "master": master, "steps": address,
                    "host": host if layout.multi_node else None}
            env = dict(os.environ, STREAMER_TP_KEY=key.hex())
            if not layout.torchrun:  # (torchrun started every rank itself)
                for local in range(1, layout.nproc_per_node):
                    links.procs.append(subprocess.Popen(rank_command(entry, dict(
                        spec, rank=local, local_rank=local, cpus=cpus[local] if cpus else None)), env=env))
            joined = _accept(listener, links.procs, layout)
        where = {rank: w for rank, (_, _, w) in joined.items()}
        links.conns.extend(joined[r][0] for r in sorted(joined))
        links.watches.update((r, joined[r][1]) for r in sorted(joined))
        links.monitor = Monitor(links.watches, where, dict(enumerate(links.procs, start=1)))
        for conn in links.conns:
            conn.send((config, model_dir, model_cfg, max_model_len))
        init_process_group(RankGroup(0, world, 0, layout.nproc_per_node, store,
                                     host if layout.multi_node else None, cpus[0] if cpus else None), device)

    def wait_ready(self) -> None:
        """Block until every worker has built its shard (and report a worker that failed to)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(self.lost(2.0) or f"tensor-parallel rank {rank} exited while loading its shard"
                                   ) from None
            if msg != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {msg}")

    def failure(self) -> Optional[str]:
        """The first error a worker reported while starting, if any (after rank 0's own start failed)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(2.0):
                    msg = conn.recv()
                    if isinstance(msg, str) and msg != "ready":
                        return f"tensor-parallel rank {rank} failed: {msg}"
            except (EOFError, OSError):
                return self.lost(1.0) or f"tensor-parallel rank {rank} exited while starting"
        return None

    def lost(self, wait: float = 0.0) -> Optional[str]:
        """Which rank was lost and how, if one was (waiting up to `wait` seconds for the monitor to tell): a step
        that failed in a collective says more with it."""
        monitor = self._links.monitor
        if monitor is None:
            return None
        monitor.faulted.wait(wait)
        return monitor.fault

    def watch(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)`, from another thread, when a rank is lost (at once if one already is)."""
        if self._links.monitor is not None:
            self._links.monitor.watch(callback)

    def send(self, step: "StepInputs") -> None:
        self._check_alive()
        # Sampling rows hold requests (and their generators): workers only run the forward.
        payload = pickle.dumps(dataclasses.replace(step, sampling=None), pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def command(self, method: str, *args: object) -> None:
        """Have every worker call its runner's `method(*args)` between two steps (new weights in place); collect
        their answers with `replies`."""
        self._check_alive()
        payload = pickle.dumps((method, *args), pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def replies(self) -> list[Optional[str]]:
        """Each worker's answer to the last `command`, by rank from 1: None, or its error."""
        answers: list[Optional[str]] = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                answers.append(conn.recv())
            except (EOFError, OSError):
                answers.append(f"tensor-parallel rank {rank} exited")
        return answers

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):  # say which rank is gone, not "connection closed"
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} has exited (code {proc.returncode})")
        why = self.lost()
        if why is not None:
            raise RuntimeError(why)

    def close(self) -> None:
        self._finalizer()
        if not torch.distributed.is_initialized():
            return
        if self.lost() is None:
            torch.distributed.destroy_process_group()
            return
        # After a lost rank a collective may still wait for it (until its timeout) on another thread, and tearing
        # the group down waits for that: give it a moment, then leave it to the process's exit.
        ending = threading.Thread(target=torch.distributed.destroy_process_group, daemon=True)
        ending.start()
        ending.join(2.0)


def _accept(listener: Listener, procs: list[subprocess.Popen],
            layout: Layout) -> dict[int, tuple[Connection, Connection, str]]:
    """Each rank's two connections, by rank. A rank this process started that exits first (say, an import error)
    raises instead of hanging; ranks of other nodes are waited for up to STORE_TIMEOUT (logged every 30 s)."""
    world = layout.world
    joined: dict[int, dict[str, Connection]] = {}
    where: dict[int, str] = {}

    def complete() -> bool:
        return len(joined) == world - 1 and all(len(kinds) == 2 for kinds in joined.values())

    def accept_all() -> None:
        while not complete():
            try:
                conn = no_delay(listener.accept())
            except (AuthenticationError, EOFError, ConnectionError) as e:  # (a stray client without the key)
                logger.warning("a connection to the tensor-parallel step listener failed: %r", e)
                continue
            except OSError:  # the listener closed: rank 0 gave up
                return
            try:
                if not conn.poll(60):  # (one that has the key but says nothing holds up no one for long)
                    raise EOFError
                kind, rank, their_world, there = conn.recv()
            except (EOFError, OSError, ValueError, TypeError):
                conn.close()
                continue
            problem = (f"its world is {their_world} ranks, the head's {world}" if their_world != world else
                       f"there is no rank {rank} in 1..{world - 1}" if not (isinstance(rank, int) and
                                                                             0 < rank < world) else
                       f"rank {rank} has already joined (from {where.get(rank)})"
                       if kind in joined.get(rank, {}) or kind not in _KINDS else None)
            if problem is not None:
                logger.error("refused a tensor-parallel rank from %s: %s", there, problem)
                try:
                    conn.send(f"refused by the head: {problem}")
                finally:
                    conn.close()
                continue
            where[rank] = str(there)
            joined.setdefault(rank, {})[kind] = conn

    accepting = threading.Thread(target=accept_all, name="streamer-tp-accept", daemon=True)
    accepting.start()
    start = last_log = time.monotonic()
    while accepting.is_alive():
        accepting.join(0.2)
        dead = [p for p in procs if p.poll() is not None]
        if dead and accepting.is_alive():
            raise RuntimeError(f"a tensor-parallel worker exited (code {dead[0].returncode}) before connecting")
        now = time.monotonic()
        if accepting.is_alive() and now - last_log > 30:
            last_log = now
            missing = [r for r in range(1, world) if len(joined.get(r, ())) < 2]
            logger.warning("waiting for tensor-parallel ranks %s to connect (%s nodes; the head at %s:%s)",
                           missing, layout.nnodes, layout.master_addr, layout.master_port)
        if accepting.is_alive() and now - start > STORE_TIMEOUT.total_seconds():
            missing = [r for r in range(1, world) if len(joined.get(r, ())) < 2]
            raise RuntimeError(f"tensor-parallel ranks {missing} did not connect within "
                               f"{STORE_TIMEOUT.total_seconds():g} s")
    return {r: (kinds["steps"], kinds["watch"], where[r]) for r, kinds in joined.items()}


def _shutdown(links: _Links) -> None:
    """Stop the workers: each gets the stop message and up to 10 s to exit (none after a rank was lost: then the
    ranks this process started are killed at once, as a rank may be stuck in a collective with the lost one)."""
    monitor = links.monitor
    faulted = monitor is not None and monitor.fault is not None
    if monitor is not None:
        monitor.closing = True  # (ranks that go now are not losses; heartbeats go on until they are gone)
    for conn in links.conns:
        try:
            conn.send_bytes(_STOP)
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + 10
    for p in links.procs:
        try:
            if faulted:
                p.kill()
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if not faulted:  # other nodes' ranks: until their step connection ends (their process exited)
        for conn in links.conns:
            try:
                while conn.poll(max(0.0, deadline - time.monotonic())):
                    conn.recv_bytes()
            except (EOFError, OSError):
                continue
    if monitor is not None:
        monitor.stop()
    for conn in [*links.conns, *links.watches.values()]:
        conn.close()


_watchdog: Optional[Watchdog] = None  # a worker process's watch over the head


def run_rank_process(entry: str, spec: dict[str, Any]) -> int:
    """A worker rank, in its own process: import the entry function rank 0 named, find rank 0 (the key and step
    address from the environment, or the rendezvous store), connect twice (steps, watch), get the shard's arguments
    and hand over to the entry function (model_runner.py's `run_tensor_parallel_rank`: it builds the shard and
    serves steps with `serve_steps`). Returns the process's exit status: 0 once rank 0 stopped it."""
    global _watchdog
    if spec.get("parent"):  # a headless node's rank: it dies with the node's process
        die_with_parent(spec["parent"])
    pin(spec.get("cpus"))  # (a data-parallel replica's rank: its part of the replica's cores)
    # The entry comes as "module:function" from the runner that started the workers, so this module need not
    # import the runner (which imports it); imported before connecting, as before, so that a worker whose imports
    # fail exits before connecting and rank 0 reports it (`_accept`).
    module, _, name = entry.partition(":")
    run_rank = getattr(importlib.import_module(module), name)

    logging.basicConfig(level=logging.WARNING)
    # Ctrl-C in a terminal reaches every process of the group: rank 0 decides when to stop, and a worker
    # also stops when rank 0 goes away (its connection ends).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, world = spec["rank"], spec["world"]
    store = rank_store(spec["master"][0], int(spec["master"][1]), spec.get("torchrun", False))
    key_hex = os.environ.pop("STREAMER_TP_KEY", None)
    if key_hex and spec.get("steps"):  # started by rank 0 itself
        address, key = spec["steps"], bytes.fromhex(key_hex)
    else:
        address, key = lookup(store)
    host, port_str = address.rsplit(":", 1)
    there = f"pid {os.getpid()} on {spec.get('host') or socket.gethostname()}"
    conn = no_delay(Client((host, int(port_str)), authkey=key))
    conn.send(("steps", rank, world, there))
    watch = Client((host, int(port_str)), authkey=key)
    watch.send(("watch", rank, world, there))
    try:
        reply = conn.recv()
    except (EOFError, OSError):
        print(f"streamer: tensor-parallel rank {rank}: the head ({address}) closed the connection", file=sys.stderr)
        return 1
    if isinstance(reply, str):  # refused
        print(f"streamer: tensor-parallel rank {rank}: {reply}", file=sys.stderr)
        return 1
    config, model_dir, model_cfg, max_model_len = reply
    if spec.get("model_dir"):  # this node's own copy of the model
        model_dir = Path(spec["model_dir"])
    _watchdog = Watchdog(watch, rank, address)
    group = RankGroup(rank, world, spec.get("local_rank", rank), spec.get("local_world", world), store,
                      spec.get("host"), spec.get("cpus"))
    stopped = run_rank(conn, group, config, model_dir, model_cfg, max_model_len)
    return 0 if stopped else 1


def serve_steps(conn: Connection, runner: "ModelRunner") -> bool:
    """A worker's loop once its shard is built: run every step rank 0 sends until it says stop (True) or goes away
    (False)."""
    conn.send("ready")
    stopped = False
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # rank 0 is gone
            break
        if msg == _STOP:
            stopped = True
            if _watchdog is not None:
                _watchdog.stopping.set()
            break
        work = pickle.loads(msg)
        if isinstance(work, tuple):  # a command between steps (`TensorParallelWorkers.command`): answer it
            conn.send(_call(runner, *work))
        else:
            runner.run_worker_step(work)
    torch.distributed.destroy_process_group()
    return stopped


def _call(runner: "ModelRunner", method: str, *args: object) -> Optional[str]:
    """A command's answer: None, or the error it raised (the worker goes on serving steps)."""
    try:
        getattr(runner, method)(*args)
        return None
    except Exception as e:
        logger.exception("tensor-parallel %s failed", method)
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    sys.exit(run_rank_process(sys.argv[1], json.loads(sys.argv[2])))
