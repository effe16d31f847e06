"""Fused mixture-of-experts: every (token, expert) pair of a batch in two grouped GEMM launches, no host sync.

The pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M (`moe_align`, torch ops that
stay on the device), so that each BLOCK_M tile of the sorted list belongs to one expert. A program multiplies one
tile's rows by a BLOCK_N slice of that expert's weight: the gate/up projection (x's row = pair // top_k), then,
after the activation, the down projection scaled by the pair's routing weight. The pairs' outputs are summed per
token at the end. The launch grid is sized for the worst case padding (a Python int from shapes) and programs past
the real padded length return at once, so a step's launch shape depends only on the number of tokens: the same
call serves eager steps and CUDA-graph replays.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from streamer_kernels import _utils
from streamer_kernels._utils import cdiv, check_interpreter_consistency, empty_output, interpret_mode, use_triton
from streamer_kernels.activation import silu_and_mul
from streamer_kernels.reference import expert_activation

check_interpreter_consistency()


@dataclass
class MoeAlignment:
    """A batch's (token, expert) pairs grouped by expert. A pair's id is token * top_k + j (its place in
    topk_ids.reshape(-1)); `sorted_ids` lists them expert by expert, each expert's run padded with `num_pairs`
    (no pair) to a multiple of block_m; `block_expert[b]` is the expert of tile b; `num_padded` [1] (on the device)
    is the padded length: tiles from num_padded // block_m on are empty."""
    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The padded length's bound: every expert that has pairs (at most min(E, pairs)) wastes < block_m slots."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


# Up to this many pairs (a decode step's: 512 tokens of top-8) the alignment is one kernel launch; beyond, its one
# program would loop too long and the torch ops (a device sort) take over.
ALIGN_KERNEL_MAX_PAIRS = 4096


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, size,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr):
    """moe_align in one program: count each expert's pairs, lay out the padded runs, then place every pair at its
    expert's next slot, CHUNK pairs at a time (a one-hot [CHUNK, BLOCK_E] running count keeps them stable)."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0).to(tl.int64))
    for s0 in range(0, size, CHUNK * TILES):  # padding everywhere first; the pairs overwrite their slots below
        s = s0 + tl.arange(0, CHUNK * TILES)
        tl.store(sorted_ids_ptr + s, tl.full([CHUNK * TILES], num_pairs, tl.int64), mask=s < size)
    real_expert = e < num_experts
    for t0 in range(0, size // BLOCK_M, CHUNK):  # a tile's expert: how many runs end at or before its start
        t = t0 + tl.arange(0, CHUNK)
        before = tl.sum(((end[None, :] <= t[:, None] * BLOCK_M) & real_expert[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + t, tl.minimum(before, num_experts - 1).to(tl.int64), mask=t < size // BLOCK_M)
    tl.debug_barrier()  # (the padding stores land before any thread overwrites a slot)
    slot = end - padded  # each expert's next free slot
    for c0 in range(0, num_pairs, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)
        before_in_chunk = tl.cumsum(hit, axis=0) - hit
        dest = tl.sum(hit * (before_in_chunk + slot[None, :]), axis=1)
        tl.store(sorted_ids_ptr + dest, i.to(tl.int64), mask=i < num_pairs)
        slot += tl.sum(hit, axis=0)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group topk_ids [T, k]'s pairs by expert (stable: within an expert, pairs keep their order). One kernel launch
    up to ALIGN_KERNEL_MAX_PAIRS pairs, where the torch path is 24 small ops, a device sort among them, which a
    decode step's CUDA graph would replay in every MoE layer."""
    n = topk_ids.numel()
    if 0 < n <= ALIGN_KERNEL_MAX_PAIRS and (use_triton(topk_ids) or _utils.COMPILE_TARGET is not None):
        return _moe_align_launch(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)


def _moe_align_launch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    n, device = topk_ids.numel(), topk_ids.device
    size = max_padded_pairs(n, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int64, device=device)
    block_expert = torch.empty(size // block_m, dtype=torch.int64, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    block_e = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, 4096 // block_e)  # a [chunk, block_e] one-hot: 4,096 entries, 16 a thread over 8 warps
    _moe_align_kernel[(1,)](topk_ids.reshape(-1).contiguous(), sorted_ids, block_expert, num_padded, n,
                            num_experts, size, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, TILES=4,
                            num_warps=8)
    return MoeAlignment(sorted_ids, block_expert, num_padded, n, block_m)


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """moe_align in torch ops (any number of pairs, any device)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert]  # place within its expert's run
    size = max_padded_pairs(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int64, device=device)
    sorted_ids[padded_end[expert] - padded[expert] + rank] = order
    tile_start = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1)
    return MoeAlignment(sorted_ids, block_expert, padded_end[-1:], n, block_m)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                     num_pairs, n_dim, k_dim, a_row_div, stride_am, stride_be, stride_bn, stride_bias, stride_cm,
                     HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """c[pair, n] = a[pair // a_row_div] . b[expert, n] (+ bias[expert, n]) (* weight[pair]) for one tile."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    rows = (pairs // a_row_div).to(tl.int64)
    expert = tl.load(block_expert_ptr + tile).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < n_dim
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + ns[None, :] * stride_bn + ks[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: the weight's rows as columns
        if UPCAST:  # (bf16 arithmetic is broken in the numpy interpreter)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + ns[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=real[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MoeConfig:
    """A grouped GEMM's launch shape: tiles of block_m sorted pairs by block_n outputs, block_k deep."""
    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles as tall as an expert's expected share of the pairs (16 at decode: a tile per busy expert). Untuned:
    the GPU check's sweep (bench/gpu_kernels.py) times alternatives."""
    share = num_pairs / max(1, num_experts)
    return MoeConfig(16 if share <= 16 else 32 if share <= 48 else 64)


def moe_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, align: MoeAlignment, a_row_div: int,
             bias: torch.Tensor | None = None, weights: torch.Tensor | None = None,
             config: MoeConfig | None = None) -> None:
    """out[pair] = a[pair // a_row_div] @ b[expert(pair)]^T (+ bias[expert]) (* weights[pair]) for every pair.
    a [R, K], b [E, N, K], out [num_pairs, N], bias [E, N], weights [num_pairs]; last dims contiguous.
    `config`'s block_m must be the alignment's."""
    n_dim, k_dim = b.shape[1], b.shape[2]
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and out.stride(-1) == 1, "moe_gemm needs contiguous last dims"
    cfg = config or MoeConfig(align.block_m)
    assert cfg.block_m == align.block_m, "the launch's block_m must be the alignment's"
    interpreted = interpret_mode()
    block_n = cfg.block_n if n_dim >= cfg.block_n else max(16, triton.next_power_of_2(n_dim))
    block_k = cfg.block_k if k_dim >= cfg.block_k else max(16, triton.next_power_of_2(k_dim))
    if a.dtype == torch.float32 and not interpreted:
        block_k = min(block_k, 32)  # fp32 tiles take twice the shared memory
    if align.num_pairs == 0 or n_dim == 0:
        return
    grid = (align.sorted_ids.numel() // align.block_m, cdiv(n_dim, block_n))
    _moe_gemm_kernel[grid](
        a, b, out if bias is None else bias, out, out if weights is None else weights,
        align.sorted_ids, align.block_expert, align.num_padded, align.num_pairs, n_dim, k_dim, a_row_div,
        a.stride(0), b.stride(0), b.stride(1), 0 if bias is None else bias.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        UPCAST=interpreted and a.dtype != torch.float32,
        PRECISION="ieee" if interpreted else ("tf32x3" if a.dtype == torch.float32 else "tf32"),
        BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **({} if interpreted else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}),
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, b13: torch.Tensor | None = None, activation: str = "silu",
              alpha: float = 1.0, limit: float = 0.0,
              configs: tuple[MoeConfig, MoeConfig] | None = None) -> torch.Tensor:
    """`configs`: the two GEMMs' launch shapes (same block_m; tuning sweeps), else `moe_config`'s."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.shape[0], x.shape[-1]
    pairs = tokens * top_k
    x = x if x.stride(-1) == 1 else x.contiguous()
    up_cfg, down_cfg = configs or (moe_config(pairs, num_experts),) * 2
    align = moe_align(topk_ids, num_experts, up_cfg.block_m)
    h = empty_output((pairs, w13.shape[1]), x.dtype, x.device)
    moe_gemm(x, w13, h, align, top_k, bias=b13, config=up_cfg)
    act = silu_and_mul(h) if activation == "silu" else expert_activation(h, activation, alpha, limit)
    y = empty_output((pairs, w2.shape[1]), x.dtype, x.device)
    moe_gemm(act, w2, y, align, 1, weights=topk_weights.reshape(-1), config=down_cfg)
    return y.view(tokens, top_k, hidden).sum(dim=1)
