"""Helpers shared by the kernel tests and the GPU check: where to run, random paged batches, error metrics.

Import this module *after* deciding on TRITON_INTERPRET (see `configure_for_tests`), before any kernel module.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# Relative-norm error bounds: fp32 kernels differ from the reference only by summation order; 16-bit ones by
# rounding of the inputs to the last dot (P in fp16/bf16) and of the output. The interpreter rounds
# fp32 -> bf16 by truncation, which roughly doubles bf16 output error there.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def configure_for_tests() -> torch.device:
    """Kernels run compiled on CUDA when a GPU is present and TRITON_INTERPRET is not set; otherwise the
    interpreter is switched on and they run on CPU tensors. Call before importing the kernel modules."""
    os.environ["STREAMER_KERNELS_POISON"] = "1"  # kernel outputs start as NaN: unwritten elements fail
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("0", ""):
        return torch.device("cuda")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before the kernel tests could set TRITON_INTERPRET=1; run them with "
                           "TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def max_examples(on_cpu: int, on_cuda: int) -> int:
    """Hypothesis budget: CPU runs pay the interpreter, CUDA runs pay one compile per new specialisation.
    STREAMER_KERNEL_MAX_EXAMPLES caps both (smoke runs)."""
    n = on_cpu if os.environ.get("TRITON_INTERPRET") == "1" else on_cuda
    cap = os.environ.get("STREAMER_KERNEL_MAX_EXAMPLES")
    return min(n, int(cap)) if cap else n


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in fp64; NaN anywhere in `actual` (a poisoned, unwritten element) gives inf."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


@dataclass
class PagedBatch:
    """A varlen batch over a paged KV cache, laid out the engine's way, with everything outside the requests'
    contexts poisoned with NaN so that any read past a context shows up in the output."""

    q: torch.Tensor  # [T + pad, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T + pad], the new tokens' slots, -1 for padding
    new_k: torch.Tensor  # [T + pad, Hkv, D] this step's keys (already in kv_cache unless write_new=False)
    new_v: torch.Tensor
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]  # the host copy the engine passes unified_attention (`query_lens=`)

    @property
    def key_cache(self) -> torch.Tensor:
        return self.kv_cache[0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv_cache[1]


def make_paged_batch(q_lens: Sequence[int], ctx_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                     num_pad_tokens: int = 0, write_new: bool = True,
                     generator: Optional[torch.Generator] = None) -> PagedBatch:
    """Request b has ctx_lens[b] cached tokens and q_lens[b] new ones. Blocks are handed out in random order
    (non-contiguous tables); table entries past a request's blocks point at NaN-filled spare blocks."""
    g = generator
    num_reqs = len(q_lens)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_needed) + 1
    num_spare = 2
    num_blocks = sum(blocks_needed) + num_spare
    perm = torch.randperm(num_blocks, generator=g).tolist()
    spare = perm[:num_spare]
    table = torch.empty(num_reqs, max_blocks, dtype=torch.int32)
    cursor = num_spare
    for b in range(num_reqs):
        n = blocks_needed[b]
        table[b, :n] = torch.tensor(perm[cursor:cursor + n], dtype=torch.int32)
        table[b, n:] = spare[b % num_spare]
        cursor += n

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    num_tokens = sum(q_lens)
    total = num_tokens + num_pad_tokens
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    new_k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    new_v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.full((total,), -1, dtype=torch.int64)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    t = 0
    for b in range(num_reqs):
        pos = torch.arange(seq_lens[b])
        req_slots = table[b, pos // block_size].long() * block_size + pos % block_size
        ctx_slots, new_slots = req_slots[:ctx_lens[b]], req_slots[ctx_lens[b]:]
        flat[:, ctx_slots] = torch.randn(2, len(ctx_slots), num_kv_heads, head_dim, generator=g).to(dtype)
        slots[t:t + q_lens[b]] = new_slots
        if write_new:
            flat[0, new_slots] = new_k[t:t + q_lens[b]]
            flat[1, new_slots] = new_v[t:t + q_lens[b]]
        t += q_lens[b]
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(list(q_lens), dtype=torch.int32).cumsum(0)
    dev = torch.device(device)
    return PagedBatch(
        q=q.to(dev), kv_cache=kv_cache.to(dev), query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_table=table.to(dev),
        slot_mapping=slots.to(dev), new_k=new_k.to(dev), new_v=new_v.to(dev), num_tokens=num_tokens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens=list(q_lens))
