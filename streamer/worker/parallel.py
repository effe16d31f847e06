"""Tensor parallelism: one process per rank, each holding a Megatron shard of every layer (models/layers.py).

The engine's process is rank 0: it schedules, prepares each step, runs its shard and samples. Ranks 1..N-1 are
worker processes started here. Each step's host inputs go to them over a local connection (pickled numpy
arrays; the sampling parameters stay behind, since only rank 0 samples) and every rank runs the same forward,
whose row layers all-reduce their partial sums over torch.distributed (gloo on CPU, NCCL on CUDA). A
connection, not a collective, carries the steps: an idle server leaves its workers blocked on it for hours,
which a collective's timeout would not allow, and a worker sees the engine die as the end of its connection.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from streamer.config import EngineConfig
    from streamer.models.config import ModelConfig
    from streamer.worker.input_batch import StepInputs
    from streamer.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_STOP = b""


def init_process_group(rank: int, world: int, port: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The timeout bounds the rendezvous (a worker that died while importing) and any one collective.
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(minutes=10))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them every step, stops them.

    Workers are fresh interpreters (`python -m streamer.worker.parallel`), not multiprocessing children: those would
    re-import the user's main module, which a script without an `if __name__ == "__main__"` guard cannot
    survive. Each one connects back to a listener on 127.0.0.1 with a random key."""

    def __init__(self, config: "EngineConfig", model_dir: Path, model_cfg: "ModelConfig", max_model_len: int,
                 device: torch.device, run_rank: Callable[..., None]) -> None:
        """run_rank: what each worker runs once connected, a module-level function (named to the worker by its
        module and name), called as run_rank(conn, rank, config, model_dir, model_cfg, max_model_len, port)."""
        entry = f"{run_rank.__module__}:{run_rank.__qualname__}"
        if getattr(sys.modules.get(run_rank.__module__), run_rank.__qualname__, None) is not run_rank:
            raise TypeError(f"run_rank must be a module-level function, not {run_rank!r}")
        world = config.tensor_parallel_size
        port = _free_port()
        key = secrets.token_bytes(32)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []  # rank 1, 2, ...
        self._finalizer = weakref.finalize(self, _shutdown, self.conns, self.procs)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            env = dict(os.environ, STREAMER_TP_KEY=key.hex())
            address = "%s:%d" % listener.address
            for rank in range(1, world):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "streamer.worker.parallel", entry, address,
                                                    str(rank)],
                                                   env=env))
            by_rank = {}
            for conn in _accept(listener, self.procs):
                by_rank[conn.recv()] = conn
                conn.send((config, model_dir, model_cfg, max_model_len, port))
        self.conns.extend(by_rank[r] for r in sorted(by_rank))
        init_process_group(0, world, port, device)

    def wait_ready(self) -> None:
        """Block until every worker has built its shard (and report a worker that failed to)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                msg = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while loading its shard") from None
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
                return f"tensor-parallel rank {rank} exited while starting"
        return None

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

    def close(self) -> None:
        self._finalizer()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _accept(listener: Listener, procs: list[subprocess.Popen]) -> list[Connection]:
    """One connection per worker; a worker that exits first (say, an import error) raises instead of hanging."""
    conns: list[Connection] = []
    accepting = threading.Thread(target=lambda: conns.extend(listener.accept() for _ in procs), daemon=True)
    accepting.start()
    while accepting.is_alive():
        accepting.join(0.2)
        dead = [p for p in procs if p.poll() is not None]
        if dead and accepting.is_alive():
            raise RuntimeError(f"a tensor-parallel worker exited (code {dead[0].returncode}) before connecting")
    return conns


def _shutdown(conns: list[Connection], procs: list[subprocess.Popen]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(_STOP)
        except (BrokenPipeError, OSError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for conn in conns:
        conn.close()


def _worker_main(entry: str, address: str, rank: int) -> None:
    """Rank `rank`: import the entry function rank 0 named, connect to rank 0, get the shard's arguments and hand
    over to the entry function (model_runner.py's `run_tensor_parallel_rank`: it builds the shard and serves steps
    with `serve_steps`)."""
    # The entry comes as "module:function" from the runner that started the workers, so this module need not
    # import the runner (which imports it); imported before connecting, as before, so that a worker whose imports
    # fail exits before connecting and rank 0 reports it (`_accept`).
    module, _, name = entry.partition(":")
    run_rank = getattr(importlib.import_module(module), name)

    logging.basicConfig(level=logging.WARNING)
    # Ctrl-C in a terminal reaches every process of the group: rank 0 decides when to stop, and a worker
    # also stops when rank 0 goes away (its connection ends).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host, port_str = address.rsplit(":", 1)
    conn = Client((host, int(port_str)), authkey=bytes.fromhex(os.environ.pop("STREAMER_TP_KEY")))
    conn.send(rank)
    config, model_dir, model_cfg, max_model_len, port = conn.recv()
    run_rank(conn, rank, config, model_dir, model_cfg, max_model_len, port)


def serve_steps(conn: Connection, runner: "ModelRunner") -> None:
    """A worker's loop once its shard is built: run every step rank 0 sends until it says stop (or goes away)."""
    conn.send("ready")
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # rank 0 is gone
            break
        if msg == _STOP:
            break
        work = pickle.loads(msg)
        if isinstance(work, tuple):  # a command between steps (`TensorParallelWorkers.command`): answer it
            conn.send(_call(runner, *work))
        else:
            runner.run_worker_step(work)
    torch.distributed.destroy_process_group()


def _call(runner: "ModelRunner", method: str, *args: object) -> Optional[str]:
    """A command's answer: None, or the error it raised (the worker goes on serving steps)."""
    try:
        getattr(runner, method)(*args)
        return None
    except Exception as e:
        logger.exception("tensor-parallel %s failed", method)
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
