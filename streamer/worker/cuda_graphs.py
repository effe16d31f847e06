"""CUDA graphs for decode-only steps: one captured graph per batch size of a ladder.

A decode step of a small model is dominated by kernel launches (hundreds per step); replaying a captured graph
launches them all at once. Graphs replay fixed device addresses and fixed launch sizes, so:
- every input lives in a persistent device buffer (token ids, positions, KV slots, context lengths, block table),
  and a step copies its values in (from pinned host buffers, asynchronously) before replaying;
- a batch of B requests runs the graph of the smallest captured size >= B; the padding rows are dummy requests
  of one token at position 0 that write their K/V into the runner's scratch block (never handed out) and
  attend over it, so the real rows are untouched; their outputs are dropped;
- the attention metadata is captured with the graph: only what the kernels read from device memory may change
  between replays (the Triton backend reads lengths and tables from memory; its launch grid depends only on the
  batch size, and the split-KV factor is fixed per graph, for the longest context the engine allows).
Batches larger than the largest size, and steps that prefill, run without a graph.

A hybrid model's recurrent layers read each row's state slot from a persistent buffer too (`MambaStep.decoding`:
every row one token, its conv window and state gathered by slot and written back); the padding rows use the
runner's scratch slot. The step's state copies and fresh slots are made before the replay (`ModelRunner.
_prepare_states`), since a captured graph cannot know them.

With `capture=False` nothing is captured and `run` calls the model on the same persistent buffers and the same
metadata object each time: on a CPU (Triton interpreter) that checks everything but the capture itself.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from streamer.attention.base import AttentionMetadata, MambaStep, forward_context
from streamer.models.lora import LoRAStep, lora_context
from streamer.worker.input_batch import StepInputs, to_device

logger = logging.getLogger("streamer")


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch` (and `max_batch` itself): padding wastes at most 15 rows."""
    if max_batch < 1:
        return []
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, forward: Callable, kv_caches: list[torch.Tensor], sizes: list[int], max_blocks_per_req: int,
                 block_size: int, scratch_block: int, max_model_len: int, device: torch.device,
                 capture: bool = True, lora: bool = False, state_scratch: Optional[int] = None) -> None:
        """lora: the model has adapter slots; each row's slot is a graph input too (the graphs gather each
        token's adapter weights, whatever the mix). state_scratch: a hybrid model's scratch state slot (None: a
        model without recurrent state); each row's state slot is a graph input."""
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.device = device
        self.capture_graphs = capture
        n, w = self.max_batch, max_blocks_per_req
        pin = device.type == "cuda"
        # Device buffers the graphs read; host twins to stage each step's values (pinned: copies are async). Two
        # sets of twins, used in turn: with async scheduling the next step is staged while this one's copies may
        # still be queued; a set is refilled only once the copies from its previous use are done (`_done`).
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per request
        self.lora_slots = torch.zeros(n, dtype=torch.int64, device=device) if lora else None
        self.state_scratch = state_scratch
        self.state_slots = None if state_scratch is None else torch.full((n,), state_scratch, dtype=torch.int64,
                                                                          device=device)
        # The block table crosses as a dense [b, w] block (w = this step's widest table, usually far below the
        # max_model_len-wide `block_table`), into a flat device buffer; one device-side copy then places it.
        self.table_stage = torch.zeros(n * w, dtype=torch.int32, device=device)
        self.block_table[:, 0] = scratch_block
        self.hosts = [{name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)
                       for name, t in (("ids", self.ids), ("positions", self.positions), ("slots", self.slots),
                                       ("seq_lens", self.seq_lens), ("table", self.table_stage))
                       + ((("lora", self.lora_slots),) if lora else ())
                       + ((("state", self.state_slots),) if self.state_slots is not None else ())}
                      for _ in range(2)]
        self._done: list[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0
        for host in self.hosts:
            self._pad(host, 0, n)
        for name in ("ids", "positions", "slots", "seq_lens"):
            getattr(self, name).copy_(self.hosts[0][name])
        self.graphs: dict[int, Optional[torch.cuda.CUDAGraph]] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    # ------------------------------------------------------------------ set-up
    def _pad(self, host: dict[str, torch.Tensor], lo: int, hi: int) -> None:
        """Rows [lo, hi) become dummy requests: token 0 at position 0, in the scratch block."""
        host["ids"][lo:hi] = 0
        host["positions"][lo:hi] = 0
        host["slots"][lo:hi] = self.scratch_block * self.block_size
        host["seq_lens"][lo:hi] = 1
        if "lora" in host:
            host["lora"][lo:hi] = 0
        if "state" in host:
            host["state"][lo:hi] = self.state_scratch

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=b, num_tokens=b, query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b], slot_mapping=self.slots[:b], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_cpu=np.arange(b + 1, dtype=np.int64),
            seq_lens_cpu=np.full(b, self.max_model_len, dtype=np.int64),
            mamba=None if self.state_slots is None else MambaStep.decoding(self.state_slots[:b]))

    def _call(self, b: int) -> torch.Tensor:
        adapters = None if self.lora_slots is None else LoRAStep(self.lora_slots[:b], gather=True)
        with forward_context(self.metas[b]), lora_context(adapters):
            return self.forward(self.ids[:b], self.positions[:b], self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, all graphs in one memory pool (a smaller graph reuses the larger one's memory)."""
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        for b in reversed(self.sizes):
            self.metas[b] = self._meta(b)
            out = self._call(b)  # compiles Triton kernels, picks cuBLAS algorithms: nothing of that may be captured
            graph = None
            if self.capture_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._call(b)
            self.graphs[b], self.outputs[b] = graph, out
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ one step
    def size_for(self, step: StepInputs) -> Optional[int]:
        """The captured size a decode-only step runs at, or None (prefill, or too many requests)."""
        n = step.num_reqs
        if step.num_tokens != n or n > self.max_batch:
            return None
        return self.sizes[int(np.searchsorted(self.sizes, n))]

    def run(self, step: StepInputs, last_tokens: torch.Tensor,
            positions: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
        """Hidden states of a decode-only step's tokens, or None if no graph fits it. `positions`: what the
        rotary embedding reads (LongRoPE shifts some), default the step's."""
        b = self.size_for(step)
        if b is None:
            return None
        n = step.num_reqs
        turn, self._turn = self._turn, self._turn ^ 1
        if self._done[turn] is not None:
            self._done[turn].synchronize()  # its last copies (two steps ago) have left the staging buffers
        host = self.hosts[turn]
        host["ids"][:n] = torch.from_numpy(step.input_ids)
        host["positions"][:n] = torch.from_numpy(step.positions if positions is None else positions)
        host["slots"][:n] = torch.from_numpy(step.slot_mapping)
        host["seq_lens"][:n] = torch.from_numpy(step.seq_lens)
        if self.lora_slots is not None:
            host["lora"][:n] = 0 if step.lora_slots is None else torch.from_numpy(step.lora_slots)
        if self.state_slots is not None:
            host["state"][:n] = self.state_scratch if step.state_slots is None else torch.from_numpy(step.state_slots)
        self._pad(host, n, b)
        w = step.block_table.shape[1]  # entries past w (and past a row's own blocks) are never read
        table = host["table"][:b * w].view(b, w)
        table[:n] = torch.from_numpy(step.block_table)
        table[n:, 0] = self.scratch_block
        for name in ("ids", "positions", "slots", "seq_lens"):
            getattr(self, name)[:b].copy_(host[name][:b], non_blocking=True)
        if self.lora_slots is not None:
            self.lora_slots[:b].copy_(host["lora"][:b], non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:b].copy_(host["state"][:b], non_blocking=True)
        self.table_stage[:b * w].copy_(host["table"][:b * w], non_blocking=True)
        self.block_table[:b, :w].copy_(self.table_stage[:b * w].view(b, w))
        if self.device.type == "cuda":
            self._done[turn] = torch.cuda.Event()
            self._done[turn].record()
        if len(step.pending_idx):  # tokens the previous step sampled, still only on the device
            self.ids[to_device(step.pending_idx, self.device)] = last_tokens[to_device(step.pending_rows, self.device)]
        graph = self.graphs[b]
        if graph is not None:
            graph.replay()
            out = self.outputs[b]
        else:
            out = self._call(b)
        self.num_replays += 1
        return out[:n]
