"""Pipeline parallelism: the decoder layers in contiguous stages, each a tensor-parallel group of its own ranks.

Rank r is place r % T of stage r // T (T = tensor_parallel_size; vLLM's order). Every rank gets every step from rank
0 (worker/parallel.py); stage 0 embeds and runs its layers, each later stage receives the residual stream from the
rank at its place in the stage before, runs its layers and passes it on; the last stage's final hidden states go
back to rank 0, which holds the LM head and samples (the sampling state, requests and their generators, never
leaves the engine's process). Each stage handles the steps in the order rank 0 sent them, so rank 0 may launch a
step's first stage while earlier steps are still in later stages: the engine keeps up to P steps of different
requests in flight (engine/async_engine.py `_run_pipelined`, core/scheduler.py `pipeline_depth`).

Three kinds of process groups, made alike on every rank (torch.distributed.new_group is collective): each stage's
ranks (its layers' all-reduces: models/layers.py `ParallelContext.group`), and two over all ranks for the hidden
states, one forward (stage to stage) and one back (last stage to rank 0): rank 0 receives on the step-waiting
thread while its device thread sends the next step forward, and a gloo group is not to be used from two threads.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from streamer.models.layers import ParallelContext
from streamer.worker.rendezvous import gloo_bound


@dataclasses.dataclass
class PipelineLinks:
    rank: int
    tp: int  # ranks per stage
    pp: int  # stages
    stage_group: Any
    forward_group: Any
    back_group: Any

    @classmethod
    def build(cls, rank: int, tp: int, pp: int) -> "PipelineLinks":
        """On every rank alike, after the process group started; sets ParallelContext for the build that follows."""
        with gloo_bound():  # (bound where the first group is: a node's routable address)
            groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
            forward, back = dist.new_group(list(range(tp * pp))), dist.new_group(list(range(tp * pp)))
        links = cls(rank, tp, pp, groups[rank // tp], forward, back)
        links.enter()
        return links

    def enter(self) -> None:
        ParallelContext.group = self.stage_group if self.tp > 1 else None
        ParallelContext.stage, ParallelContext.num_stages = self.stage, self.pp

    @staticmethod
    def leave() -> None:
        ParallelContext.group, ParallelContext.stage, ParallelContext.num_stages = None, 0, 1

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def send_next(self, hidden: torch.Tensor) -> None:
        """This stage's residual stream to the rank at the same place in the next stage."""
        dist.send(hidden.contiguous(), dst=self.rank + self.tp, group=self.forward_group)

    def recv_prev(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = torch.empty(rows, width, dtype=dtype, device=device)
        dist.recv(out, src=self.rank - self.tp, group=self.forward_group)
        return out

    def send_back(self, hidden: torch.Tensor) -> None:
        """The last stage's final hidden states to rank 0 (from its first rank: the others hold the same)."""
        if self.rank % self.tp == 0:
            dist.send(hidden.contiguous(), dst=0, group=self.back_group)

    def recv_back(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Rank 0: a step's final hidden states, in the order the steps were sent."""
        out = torch.empty(rows, width, dtype=dtype, device=device)
        dist.recv(out, src=(self.pp - 1) * self.tp, group=self.back_group)
        return out
