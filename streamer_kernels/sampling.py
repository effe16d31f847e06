"""Top-k / top-p / min-p sampling by the exponential race, without sorting the vocabulary.

One program per row. Each filter keeps every token at or above a threshold, so a row needs two thresholds, not a
sorted row. Both are found exactly by searching the fp32 values as order-preserving integer keys, NUM_PIVOTS
ways at a time: one pass over the row counts (top-k) or sums the probability mass (top-p) above all the pivots
at once and narrows the key range 16-fold, so 2^32 keys take 9 passes. With the pass for the row maximum and
the pass that runs the race, a row costs at most 20 reads of its logits and one of its noise, all from
registers-sized tiles; the torch path sorts the whole [B, V] batch, then masks, scatters and normalises it.
Every pass keeps per-lane partials (counts or masses per pivot, maxima, the race's best) in registers and
reduces them across threads once at its end: on sm_90 that halves a search pass's instructions per entry
(128 -> 70 counting, 140 -> 77 summing mass; `python bench/sampler_sass.py`). The max pass also records each
tile's largest key, so a later pass skips the tiles below its key range and the race reads only tiles that can
hold the winner: 2.3x fewer tiles read per row at top-k 50 / top-p 0.9 over Llama 3's vocabulary, 2x for greedy
rows (`python bench/sampler_tiles.py`).

Semantics are those of `reference.top_k_top_p_sample`: ties at a boundary are kept; top-p renormalises over the
top-k set; min-p keeps tokens with p >= min_p * p_max; rows with temperature <= 0 take the argmax.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import cdiv, check_interpreter_consistency, next_pow2

check_interpreter_consistency()

NUM_PIVOTS = 16
BLOCK_MAX = 1024
_KEY_MIN = tl.constexpr(-(2 ** 31))  # below every key


@triton.jit
def _scaled(row_ptr, cols, mask, temp):
    # Out-of-row lanes read -inf: no key reaches them, no mass, never the race's winner. Rounded division
    # (not a reciprocal multiply), so the values are bit for bit the reference's logits / temperature.
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * temp)


@triton.jit
def _keys(x):
    """fp32 -> int32 with the same order: negative floats have their magnitude bits flipped."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0: one key for both
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    """The inverse of _keys (the bit flip is its own inverse)."""
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _search(row_ptr, tile_max_ptr, vocab, temp, row_max, floor, target, BY_MASS: tl.constexpr,
            BLOCK: tl.constexpr, NP: tl.constexpr):
    """The largest key t in [floor, key(row_max)] with weight(keys >= t) >= need, where weight counts tokens
    (need = target) or sums exp(x - row_max) (need = target * the mass at or above floor). The weight falls
    as t rises, and weight(floor) >= need holds on entry, so the range narrows around the answer. Tiles whose
    largest key (`tile_max_ptr`, from the max pass) is below lo hold no key a pivot reaches: they are skipped,
    which after the first pass is most of a row for the usual small top-k / top-p sets."""
    j = tl.arange(0, NP)
    lo = floor.to(tl.int64)
    hi = _keys(row_max).to(tl.int64)
    if BY_MASS:
        need = tl.full((), -1.0, tl.float32)  # set from the first pass, where piv[0] = floor
    else:
        need = target.to(tl.float32)
    while lo < hi:
        # NP pivots from lo up: piv[0] = lo always qualifies (invariant), the rest split (lo, hi].
        piv = (lo + ((hi - lo) * j + NP - 1) // NP).to(tl.int32)
        # Each thread sums its own lanes over the whole row and the lanes are summed once per pass: a reduction
        # across threads per tile cost more than the comparisons (sm_90 SASS: bench/sampler_sass.py).
        part = tl.zeros([NP, BLOCK], dtype=tl.float32)  # (pivots leading: each thread's lanes meet every pivot)
        for start in range(0, vocab, BLOCK):
            if tl.load(tile_max_ptr + start // BLOCK) >= lo:
                cols = start + tl.arange(0, BLOCK)
                x = _scaled(row_ptr, cols, cols < vocab, temp)
                hit = _keys(x)[None, :] >= piv[:, None]
                if BY_MASS:
                    part += tl.where(hit, tl.exp(x - row_max)[None, :], 0.0)
                else:
                    part += hit.to(tl.float32)
        acc = tl.sum(part, axis=1)
        if BY_MASS:
            need = tl.where(need < 0.0, target * tl.sum(tl.where(j == 0, acc, 0.0), axis=0), need)
        best = tl.max(tl.where(acc >= need, j, 0), axis=0)  # acc falls with j: the last qualifying pivot
        nxt = tl.sum(tl.where(j == best + 1, piv, 0), axis=0).to(tl.int64)
        new_lo = tl.sum(tl.where(j == best, piv, 0), axis=0).to(tl.int64)
        hi = tl.where(best == NP - 1, hi, nxt - 1)
        lo = new_lo
    return lo.to(tl.int32)


@triton.jit
def _sample_kernel(logits_ptr, noise_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr,
                   threshold_ptr, tile_max_ptr, stride_l, stride_n, stride_t, vocab,
                   HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                   BLOCK: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    temp = tl.load(temperature_ptr + row).to(tl.float32)
    sample = temp > 0.0
    temp = tl.where(sample, temp, 1.0)  # greedy rows: argmax of the raw logits

    # Every loop keeps per-lane results and reduces across threads once, after it (see _search); this one also
    # records each tile's largest key, which lets the later passes skip tiles that cannot matter.
    tile_max_row = tile_max_ptr + row * stride_t
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _scaled(row_ptr, cols, cols < vocab, temp)
        tl.store(tile_max_row + start // BLOCK, _keys(tl.max(x, axis=0)))
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, axis=0)
    tl.debug_barrier()  # (the tile maxima are read back by every thread)

    floor = tl.full((), _KEY_MIN, tl.int32)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if sample & (k > 0) & (k < vocab):
            floor = _search(row_ptr, tile_max_row, vocab, temp, row_max, floor, k.to(tl.float32), False, BLOCK, NP)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if sample & (p < 1.0):
            floor = _search(row_ptr, tile_max_row, vocab, temp, row_max, floor, p, True, BLOCK, NP)
    # min-p keeps x >= row_max + log(min_p): p >= min_p * p_max with both sides over the same normaliser.
    cut = tl.full((), float("-inf"), tl.float32)
    if HAS_MIN_P:
        mp = tl.load(min_p_ptr + row).to(tl.float32)
        cut = tl.where(sample & (mp > 0.0), row_max + tl.log(tl.where(mp > 0.0, mp, 1.0)), cut)

    # The race: argmax of exp(x - max) / E over the kept tokens (first index on ties); greedy rows: argmax x.
    # A lane keeps its first best (its columns only grow); the row's winner is the first column among the lanes'.
    # Only tiles that can hold the winner are read: a kept token (sampled rows), the row's max (greedy rows).
    race_lo = tl.where(sample, tl.maximum(floor, _keys(cut)), _keys(row_max))
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        if tl.load(tile_max_row + start // BLOCK) >= race_lo:
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = _scaled(row_ptr, cols, mask, temp)
            kept = mask & (_keys(x) >= floor) & (x >= cut)
            reads_noise = mask & (tl.zeros([BLOCK], tl.int32) < sample.to(tl.int32))  # greedy rows read none
            e = tl.load(noise_ptr + row * stride_n + cols, mask=reads_noise, other=1.0)
            val = tl.where(sample, tl.where(kept, tl.exp(x - row_max) / e, -1.0), x)
            better = val > best_val
            best_idx = tl.where(better, cols, best_idx)
            best_val = tl.where(better, val, best_val)
    top = tl.max(best_val, axis=0)
    best_idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0).to(tl.int64)
    tl.store(out_ptr + row, best_idx)
    # The smallest value the filters keep (what a test compares with the reference's mask).
    kept_min = tl.where(floor == _KEY_MIN, float("-inf"), _unkey(floor))
    tl.store(threshold_ptr + row, tl.maximum(kept_min, cut))


def top_k_top_p_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor], exp_noise: torch.Tensor,
                       min_p: Optional[torch.Tensor] = None, *,
                       return_threshold: bool = False):
    """Tokens int64 [B] (and, with return_threshold, each row's smallest kept scaled logit, -inf = no cut)."""
    batch, vocab = logits.shape
    assert logits.stride(-1) == 1 and exp_noise.shape == logits.shape and exp_noise.stride(-1) == 1
    assert exp_noise.dtype == torch.float32
    device = logits.device
    out = torch.empty(batch, dtype=torch.int64, device=device)
    threshold = torch.empty(batch, dtype=torch.float32, device=device)
    if batch > 0:
        temperature = temperature.to(device=device, dtype=torch.float32).contiguous()
        block = min(BLOCK_MAX, next_pow2(vocab))
        tile_max = torch.empty(batch, cdiv(vocab, block), dtype=torch.int32, device=device)
        _sample_kernel[(batch,)](
            logits, exp_noise, temperature,
            *(t.contiguous() if t is not None else temperature for t in (top_k, top_p, min_p)),
            out, threshold, tile_max, logits.stride(0), exp_noise.stride(0), tile_max.stride(0), vocab,
            HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
            BLOCK=block, NP=NUM_PIVOTS, num_warps=8 if block >= 1024 else 4,
        )
    return (out, threshold) if return_threshold else out
