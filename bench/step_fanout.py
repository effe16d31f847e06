"""The cost of sending each step to the other ranks (issue 46: "step fan-out cost at TP=4: p50 < 1 ms per 64-sequence
decode step on loopback"): rank 0's `TensorParallelWorkers.send` (pickle the step once, write it to each rank's
connection) and the time until every rank has it unpickled, for a decode step of 64 sequences.

    python bench/step_fanout.py [--tp 4] [--seqs 64] [--context 1024] [--steps 500]

The ranks are real worker processes started and met exactly as a tensor-parallel engine's (same listener, key,
heartbeats, process group), running a bench entry function instead of a model: each unpickles every step and
answers one byte. Reported per step, p50 / p90 / p99 in ms: `send` alone (what the engine's device thread spends
before its own forward), and send-to-all-acknowledged (a round trip: the one-way fan-out is below it).
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))


def echo_rank(conn: Connection, group: Any, config: Any, model_dir: Any, model_cfg: Any, max_model_len: int) -> bool:
    """A worker rank without a model: join the process group, then unpickle each step and acknowledge it."""
    import torch

    from streamer.worker.parallel import _STOP
    from streamer.worker.rendezvous import init_process_group
    init_process_group(group, torch.device("cpu"))
    conn.send("ready")
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return False
        if msg == _STOP:
            return True
        pickle.loads(msg)
        conn.send_bytes(b"\x01")


def decode_step(seqs: int, context: int, block_size: int = 16) -> Any:
    """A decode step of `seqs` sequences with `context` tokens each, as the persistent batch prepares it."""
    from streamer.worker.input_batch import StepInputs
    rng = np.random.default_rng(0)
    width = -(-context // block_size)
    table = rng.integers(0, 100_000, size=(seqs, width)).astype(np.int32)
    positions = np.full(seqs, context - 1, dtype=np.int64)
    slots = table[:, -1].astype(np.int64) * block_size + (context - 1) % block_size
    ar = np.arange(seqs, dtype=np.int64)
    return StepInputs(req_ids=[f"req-{i:08d}" for i in range(seqs)], rows=ar, epochs=np.ones(seqs, dtype=np.int64),
                      input_ids=rng.integers(0, 128_000, size=seqs).astype(np.int64), positions=positions,
                      query_start_loc=np.arange(seqs + 1, dtype=np.int64), seq_lens=positions + 1,
                      block_table=table, slot_mapping=slots, sample_idx=ar, sampling=None,  # type: ignore[arg-type]
                      num_known=positions + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args()
    import torch

    from streamer.config import EngineConfig
    from streamer.worker.parallel import TensorParallelWorkers
    # the workers import this module by name: put bench/ on their path
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), str(BENCH.parent),
                                                             os.environ.get("PYTHONPATH")]))
    import step_fanout  # noqa: F401  (this file as a module, so that its entry function has an importable name)
    config = EngineConfig(tensor_parallel_size=args.tp, device="cpu")
    workers = TensorParallelWorkers(config, Path("."), None, 0, torch.device("cpu"),  # type: ignore[arg-type]
                                    sys.modules["step_fanout"].echo_rank)
    workers.wait_ready()
    step = decode_step(args.seqs, args.context)
    sends, rounds = [], []
    try:
        for i in range(args.steps + 20):
            t0 = time.perf_counter()
            workers.send(step)
            t1 = time.perf_counter()
            for conn in workers.conns:
                conn.recv_bytes()
            t2 = time.perf_counter()
            if i >= 20:  # (after warming up)
                sends.append((t1 - t0) * 1e3)
                rounds.append((t2 - t0) * 1e3)
    finally:
        workers.close()

    def q(xs: list[float], f: float) -> float:
        return sorted(xs)[min(int(f * len(xs)), len(xs) - 1)]
    size = len(pickle.dumps(step, pickle.HIGHEST_PROTOCOL))
    print(f"TP={args.tp} (rank 0 + {args.tp - 1} worker processes, loopback), decode step of {args.seqs} sequences "
          f"x {args.context} tokens of context ({size / 1024:.1f} KiB pickled), {args.steps} steps; "
          f"mean send {statistics.mean(sends):.3f} ms")
    print("| per step | p50 ms | p90 ms | p99 ms |")
    print("|---|---|---|---|")
    print(f"| rank 0's send (pickle once, write to {args.tp - 1} connections) | {q(sends, .5):.3f} | "
          f"{q(sends, .9):.3f} | {q(sends, .99):.3f} |")
    print(f"| send until every rank has unpickled it and answered | {q(rounds, .5):.3f} | {q(rounds, .9):.3f} | "
          f"{q(rounds, .99):.3f} |")


if __name__ == "__main__":
    main()
