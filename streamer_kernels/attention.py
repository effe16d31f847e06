"""unified_attention: one Triton kernel for a varlen batch mixing prefill chunks and decode tokens over the
paged KV cache, plus a split-KV ("flash-decoding") mode and its reduction kernel.

Work decomposition
------------------
A program owns one *q-block* (BLOCK_Q consecutive query tokens of one request) for one KV head, and all the
QPK = num_heads // num_kv_heads query heads that share that KV head. Its BLOCK_M = BLOCK_Q * QPK (padded to a
power of two) rows are (token, head) pairs, so every K/V tile is loaded once and used by the whole group
(GQA/MQA), and decode (BLOCK_Q small) still gives tl.dot at least 16 rows.

Programs are numbered without a host sync: request b's q-blocks start at query_start_loc[b] // BLOCK_Q + b,
an upper bound that leaves a few idle programs (which exit at once); a program finds its request by binary
search over query_start_loc. KV heads vary fastest in the program id and each prompt's q-blocks run last first,
so the longest causal programs start first (`bench/attention_schedule.py` models the grid's tail).

The key loop walks tiles of TILE_N positions, looking up each position's physical block in the block table, so
TILE_N and the cache block size are independent. Tiles that are entirely visible to every row of the q-block
(strictly below the causal diagonal, inside the window) run without any masking; only the boundary tiles pay
for it. Softmax is online, in fp32, in base 2 (the scale is folded with log2(e)). Attention logit soft-capping
(Gemma 2: s -> tanh(s / cap) * cap) is a constexpr switch: the scale is then folded with 1 / cap and log2(e) * cap
is applied after the tanh; without it the loop is unchanged. Attention sinks (gpt-oss: a learned logit per head
that joins the softmax's denominator, with no value) are another constexpr switch: the sink starts each row's
running max and sum (m = sink, l = 1) instead of (-inf, 0), so the loop itself is untouched. Chunked local
attention (Llama 4: the query at position p sees keys from (p // C) * C on) is a per-row lower key bound like the
window's: tiles below the q-block's first chunk are skipped, and only tiles inside its last one run unmasked.
A relative position bias (MPNet's T5-style buckets) is a table per head indexed by the key's distance from the
query, clamped to the table's radius; another constexpr switch adds it to every tile's scores (masked or not).

Unmasked tiles (without soft-cap or bias) take their row max before scaling, so scaling and subtracting the max is
one FMA per score. With `AttentionConfig.pipeline_qk` they are also software-pipelined by hand as in
FlashAttention-3: tile j+1's Q.K^T is issued before tile j's softmax, and on sm_90 the compiled SASS issues the
exponentials between the next tile's wgmma instructions instead of waiting for them (an option for the GPU
check's sweep until it has been timed).

Split-KV mode (grid axis 1 = NUM_SPLITS > 1) cuts each program's tile range into NUM_SPLITS segments that run
as separate programs and write unnormalised partials (acc, running max, running sum); `_reduce_kernel` merges
them. It pays when few requests with long contexts would otherwise occupy a handful of SMs. With sinks, only
segment 0 starts from the sink: its partial carries the sink's term, which the reduction then merges like any
other statistics.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import (
    cdiv,
    check_interpreter_consistency,
    device_sm_count,
    device_target,
    interpret_mode,
    next_pow2,
)

check_interpreter_consistency()

# Stands in for -inf as the initial running max: rows whose every key is masked in a tile (possible with a
# sliding window, or in an empty split segment) then give exp2(-inf - m) = 0 rather than NaN.
_NEG_LARGE = tl.constexpr(-1.0e30)  # a constexpr: jitted code may only read constexpr globals
_LOG2E = 1.4426950408889634
_TWO_LOG2E = tl.constexpr(2.0 * _LOG2E)
_LOG2E_C = tl.constexpr(_LOG2E)

MAX_KV_SPLITS = 64
# Which requests a launch serves (the kernel's SUBSET): all; only those of at most BLOCK_Q query tokens, one
# program each; only the longer ones (more than SHORT_MAX tokens). A batch mixing decodes and prefill chunks
# runs as the last two, each with its own launch shape (see unified_attention).
_ALL = tl.constexpr(0)
_SHORT = tl.constexpr(1)
_LONG = tl.constexpr(2)


@triton.jit
def _find_request(query_start_loc_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b in [0, num_seqs) with query_start_loc[b] // BLOCK_Q + b <= pid (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits (+-1) for large |x| where e^2x over/underflows; no libdevice needed.
    return 1.0 - 2.0 / (tl.math.exp2(x * _TWO_LOG2E) + 1.0)


@triton.jit
def _load(ptrs, mask, USE_MASK: tl.constexpr):
    # Unmasked loads where the mask is provably all-true keep the hot loop free of predication.
    if USE_MASK:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _tile_offsets(j, block_table_row_ptr, stride_c_block, stride_c_slot, key_end, offs_n, offs_d,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, HOIST: tl.constexpr):
    """Key positions of tile j, which of them are in the context, and their K/V offsets in the paged cache.
    HOIST: unmasked tiles of whole cache blocks index the block table from loop-invariant parts: fewer
    instructions per tile, more registers held (measured in SASS for sm_90: 128-key prefill tiles lose 11% of
    their loop's instructions and their spills; decode's and sm_80's masked tiles spill with it)."""
    k_pos = j * TILE_N + offs_n
    in_ctx = k_pos < key_end
    if TILE_N % BLOCK_SIZE == 0 and HOIST and not MASKED:
        block = tl.load(block_table_row_ptr + j * (TILE_N // BLOCK_SIZE) + offs_n // BLOCK_SIZE)
        row = block.to(tl.int64) * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot
    elif BLOCK_SIZE % TILE_N == 0:
        # The tile lies inside one block, found by one scalar load (its first key is always in the context).
        first = j * TILE_N
        block = tl.load(block_table_row_ptr + first // BLOCK_SIZE).to(tl.int64)
        row = block * stride_c_block + (first % BLOCK_SIZE + offs_n) * stride_c_slot
    else:
        # Past the context the block table holds garbage (or is out of bounds): never follow it there.
        block = _load(block_table_row_ptr + k_pos // BLOCK_SIZE, in_ctx, MASKED).to(tl.int64)
        row = block * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot
    return k_pos, in_ctx, row[:, None] + offs_d[None, :]


@triton.jit
def _load_kv(ptr, offs_kv, kv_mask, dtype, USE_MASK: tl.constexpr, KV_FP8: tl.constexpr, UPCAST: tl.constexpr):
    x = _load(ptr + offs_kv, kv_mask, USE_MASK)  # [TILE_N, BLOCK_D]
    if KV_FP8:  # widened to the queries' type; the scales are folded into qk_scale and the output
        x = x.to(dtype)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _online_softmax(acc, l_i, m_i, s, v, scale, DOT_PRECISION: tl.constexpr):
    """Folds one tile of scores s * scale (log2 units, masked entries -inf; scale > 0) and its values into
    (acc, l, m). The row max is taken before scaling, so scaling and subtracting it is one FMA per score (a
    literal scale of 1.0 folds away)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale)
    p = tl.math.exp2(s * scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _load_full_tile(ptr, j, block_table_row_ptr, stride_c_block, stride_c_slot, key_end, offs_n, offs_d, d_mask,
                    dtype, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PAD_D: tl.constexpr,
                    KV_FP8: tl.constexpr, UPCAST: tl.constexpr):
    """K or V of unmasked tile j of a prefill-sized q-block (the hoisted block-table arithmetic)."""
    _, in_ctx, offs_kv = _tile_offsets(j, block_table_row_ptr, stride_c_block, stride_c_slot, key_end, offs_n,
                                       offs_d, BLOCK_SIZE, TILE_N, False, True)
    return _load_kv(ptr, offs_kv, in_ctx[:, None] & d_mask[None, :], dtype, PAD_D, KV_FP8, UPCAST)


@triton.jit
def _attend_full_tiles_pipelined(
    acc, l_i, m_i, q, key_cache_ptr, value_cache_ptr, block_table_row_ptr, stride_c_block, stride_c_slot,
    key_end, qk_scale, tile_start, tile_stop, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """The unmasked tiles of `_attend_tiles` (no soft-cap, no bias), software-pipelined by hand as in
    FlashAttention-3: tile j+1's scores are computed (an asynchronous tensor-core op on Hopper) before tile j's
    softmax, so the exponentials of one tile can overlap the next tile's Q.K^T instead of idling the tensor
    cores."""
    if tile_start < tile_stop:
        k = _load_full_tile(key_cache_ptr, tile_start, block_table_row_ptr, stride_c_block, stride_c_slot, key_end,
                            offs_n, offs_d, d_mask, q.dtype, BLOCK_SIZE, TILE_N, PAD_D, KV_FP8, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        for j in range(tile_start, tile_stop - 1):
            k = _load_full_tile(key_cache_ptr, j + 1, block_table_row_ptr, stride_c_block, stride_c_slot, key_end,
                                offs_n, offs_d, d_mask, q.dtype, BLOCK_SIZE, TILE_N, PAD_D, KV_FP8, UPCAST)
            s_next = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = _load_full_tile(value_cache_ptr, j, block_table_row_ptr, stride_c_block, stride_c_slot, key_end,
                                offs_n, offs_d, d_mask, q.dtype, BLOCK_SIZE, TILE_N, PAD_D, KV_FP8, UPCAST)
            acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION)
            s = s_next
        v = _load_full_tile(value_cache_ptr, tile_stop - 1, block_table_row_ptr, stride_c_block, stride_c_slot,
                            key_end, offs_n, offs_d, d_mask, q.dtype, BLOCK_SIZE, TILE_N, PAD_D, KV_FP8, UPCAST)
        acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q,
    key_cache_ptr, value_cache_ptr, block_table_row_ptr,
    stride_c_block, stride_c_slot,
    q_pos, q_last, key_end, sliding_window, key_lo, qk_scale, softcap_scale, bias_rows, bias_radius,
    tile_start, tile_stop,
    offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, USE_CHUNK: tl.constexpr, USE_BIAS: tl.constexpr,
    HOIST: tl.constexpr, PIPELINE_QK: tl.constexpr,
):
    """Online-softmax accumulation over key tiles [tile_start, tile_stop). MASKED tiles apply the causal /
    window / chunk / end-of-context masks (causal: keys up to q_last, each row's own position unless a causal limit
    moves it further; USE_CHUNK: keys from each row's key_lo on); unmasked tiles must be fully visible to every
    row. With USE_SOFTCAP, qk_scale is scale / cap and softcap_scale is cap * log2(e): scores become
    tanh(q.k * scale / cap) * cap (log2 units). USE_BIAS: each row's bias table row (`bias_rows`, pointing at
    distance 0) adds its entry at the key's distance, clamped to +-bias_radius (in natural units: times log2(e)).
    PIPELINE_QK: unmasked tiles without soft-cap or bias go through `_attend_full_tiles_pipelined`."""
    if PIPELINE_QK and not (MASKED or USE_SOFTCAP or USE_BIAS):
        return _attend_full_tiles_pipelined(acc, l_i, m_i, q, key_cache_ptr, value_cache_ptr, block_table_row_ptr,
                                            stride_c_block, stride_c_slot, key_end, qk_scale, tile_start,
                                            tile_stop, offs_n, offs_d, d_mask, BLOCK_SIZE, TILE_N, PAD_D, UPCAST,
                                            DOT_PRECISION, KV_FP8)
    for j in range(tile_start, tile_stop):
        k_pos, in_ctx, offs_kv = _tile_offsets(j, block_table_row_ptr, stride_c_block, stride_c_slot, key_end,
                                               offs_n, offs_d, BLOCK_SIZE, TILE_N, MASKED, HOIST)
        kv_mask = in_ctx[:, None] & d_mask[None, :]
        k = _load_kv(key_cache_ptr, offs_kv, kv_mask, q.dtype, MASKED or PAD_D, KV_FP8, UPCAST)
        v = _load_kv(value_cache_ptr, offs_kv, kv_mask, q.dtype, MASKED or PAD_D, KV_FP8, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
        if not (MASKED or USE_SOFTCAP or USE_BIAS):
            acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION)
        else:
            s = s * qk_scale  # log2 units
            if USE_SOFTCAP:
                s = _tanh(s) * softcap_scale
            if USE_BIAS:
                dist = tl.minimum(tl.maximum(k_pos[None, :] - q_pos[:, None], -bias_radius), bias_radius)
                s += tl.load(bias_rows[:, None] + dist) * _LOG2E_C
            if MASKED:
                visible = (k_pos[None, :] <= q_last[:, None]) & in_ctx[None, :]
                if USE_WINDOW:
                    visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
                if USE_CHUNK:
                    visible = visible & (k_pos[None, :] >= key_lo[:, None])
                s = tl.where(visible, s, float("-inf"))
            acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, v, 1.0, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _unified_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr, sinks_ptr, limit_ptr, bias_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, qk_scale, softcap_scale, sliding_window, attention_chunk, v_scale, bias_radius, stride_bias,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_block, stride_c_slot, stride_c_head,
    stride_bt,
    NUM_HEADS: tl.constexpr, QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, USE_LIMIT: tl.constexpr,
    USE_CHUNK: tl.constexpr, USE_BIAS: tl.constexpr, PIPELINE_QK: tl.constexpr, SUBSET: tl.constexpr,
    SHORT_MAX: tl.constexpr,
):
    # KV heads vary fastest: the GPU starts programs in id order, so every head's longest q-blocks (below) go first
    # and the short ones fill the tail. Modelled (bench/attention_schedule.py), a 2,048-token prompt's grid takes
    # 1.03x the ideal time over 132 SMs, against 1.22x with heads outermost (the last head's long q-blocks start late).
    NUM_KV_HEADS: tl.constexpr = NUM_HEADS // QPK
    pid_q = tl.program_id(0) // NUM_KV_HEADS
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    split = tl.program_id(1)

    if SUBSET == _SHORT:  # one program per request; requests of more than BLOCK_Q tokens are the other launch's
        seq = pid_q
        q_block = 0
    else:
        seq = _find_request(query_start_loc_ptr, pid_q, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if SUBSET == _SHORT:
        if q_len > BLOCK_Q:
            return
    else:
        q_block = pid_q - (q_start // BLOCK_Q + seq)
        if SUBSET == _LONG:
            if q_len <= SHORT_MAX:
                return
    num_q_blocks = tl.cdiv(q_len, BLOCK_Q)
    if q_block >= num_q_blocks:
        return
    if NUM_SPLITS == 1:
        # Under the causal mask the last q-blocks of a prompt do the most work; launching them first shortens
        # the tail of the grid (longest processing time first).
        q_block = num_q_blocks - 1 - q_block
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step's queries

    # Rows are (query token, query head) pairs: row r -> token q_block * BLOCK_Q + r // QPK, head r % QPK
    # within this KV head's group. Rows past BLOCK_Q * QPK only pad BLOCK_M to a power of two.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    q_local = q_block * BLOCK_Q + offs_m // QPK
    head = kv_head * QPK + offs_m % QPK
    row_valid = (offs_m < BLOCK_Q * QPK) & (q_local < q_len)
    q_pos = ctx_len + q_local
    d_mask = offs_d < HEAD_DIM
    token = (q_start + q_local).to(tl.int64)

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif KV_FP8 and q.dtype == tl.bfloat16:
        # An FP8 cache widens to fp16 in one instruction per pair (e4m3 -> bf16 goes through fp32: 2.3x the
        # decode loop's instructions on sm_90), so the dots run in fp16: q converts exactly (fp16 has more
        # mantissa than bf16) once clamped to fp16's range (in fp32: bf16 rounds 65504 up to 65536), and p in
        # [0, 1] loses nothing.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    # Keys this q-block needs: [key_start, key_end).
    q_lo = q_block * BLOCK_Q
    q_hi = tl.minimum(q_lo + BLOCK_Q, q_len)
    key_end = ctx_len + q_hi
    q_last = q_pos
    if USE_LIMIT:  # rows that see past themselves (a span seeing itself both ways): the keys extend to theirs
        q_last = tl.maximum(tl.load(limit_ptr + token, mask=row_valid, other=0), q_pos)
        key_end = tl.minimum(tl.maximum(key_end, tl.max(tl.where(row_valid, q_last, 0), axis=0) + 1), seq_len)
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(ctx_len + q_lo - sliding_window + 1, 0) // TILE_N
    key_lo = q_pos  # (read only with USE_CHUNK: each row's first visible key, the start of its chunk)
    if USE_CHUNK:
        key_lo = q_pos // attention_chunk * attention_chunk
        # the first row's chunk starts the earliest (rows' bounds never decrease with their positions)
        tile_lo = tl.maximum(tile_lo, (ctx_len + q_lo) // attention_chunk * attention_chunk // TILE_N)
    tile_hi = tl.cdiv(key_end, TILE_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tile_hi)
        tile_lo = tl.minimum(tile_lo, tile_hi)

    # Tiles [full_lo, full_hi) are visible to every row: wholly at or before the earliest query position and,
    # with a window, wholly inside the latest query's window (with chunks, inside the latest query's chunk). The
    # rest of [tile_lo, tile_hi) is masked.
    full_hi = (ctx_len + q_lo + 1) // TILE_N
    full_lo = tile_lo
    if USE_WINDOW:
        full_lo = tl.cdiv(tl.maximum(ctx_len + q_hi - sliding_window, 0), TILE_N)
    if USE_CHUNK:
        full_lo = tl.maximum(full_lo, tl.cdiv((ctx_len + q_hi - 1) // attention_chunk * attention_chunk, TILE_N))
    full_lo = tl.minimum(tl.maximum(full_lo, tile_lo), tile_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), tile_hi)

    m_i = tl.full([BLOCK_M], _NEG_LARGE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        # The sink is one more score (in log2 units, neither scaled nor capped) whose value is zero: it opens the
        # running statistics, in one segment only (the first) when the context is split.
        sink = tl.load(sinks_ptr + head) * _LOG2E_C
        first = split == 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = key_cache_ptr + kv_head.to(tl.int64) * stride_c_head
    v_base = value_cache_ptr + kv_head.to(tl.int64) * stride_c_head
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    HOIST: tl.constexpr = BLOCK_M >= 64  # prefill-sized q-blocks (see _tile_offsets)
    bias_rows = bias_ptr + head * stride_bias + bias_radius  # (each row's head's table, at distance 0)

    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, stride_c_block, stride_c_slot,
                                  q_pos, q_last, key_end, sliding_window, key_lo, qk_scale, softcap_scale,
                                  bias_rows, bias_radius,
                                  tile_lo, full_lo, offs_n, offs_d, d_mask, BLOCK_SIZE, TILE_N, PAD_D,
                                  True, USE_WINDOW, USE_SOFTCAP, UPCAST, DOT_PRECISION, KV_FP8, USE_CHUNK,
                                  USE_BIAS, HOIST, PIPELINE_QK)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, stride_c_block, stride_c_slot,
                                  q_pos, q_last, key_end, sliding_window, key_lo, qk_scale, softcap_scale,
                                  bias_rows, bias_radius,
                                  full_lo, full_hi, offs_n, offs_d, d_mask, BLOCK_SIZE, TILE_N, PAD_D,
                                  False, USE_WINDOW, USE_SOFTCAP, UPCAST, DOT_PRECISION, KV_FP8, USE_CHUNK,
                                  USE_BIAS, HOIST, PIPELINE_QK)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, stride_c_block, stride_c_slot,
                                  q_pos, q_last, key_end, sliding_window, key_lo, qk_scale, softcap_scale,
                                  bias_rows, bias_radius,
                                  full_hi, tile_hi, offs_n, offs_d, d_mask, BLOCK_SIZE, TILE_N, PAD_D,
                                  True, USE_WINDOW, USE_SOFTCAP, UPCAST, DOT_PRECISION, KV_FP8, USE_CHUNK,
                                  USE_BIAS, HOIST, PIPELINE_QK)

    store_mask = row_valid[:, None] & d_mask[None, :]
    if KV_FP8:  # sums of v' = v / v_scale (linear: the split partials can carry it too)
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only invalid rows have l == 0; they are not stored
        o = acc / l_safe[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Partials: acc [T, H, NUM_SPLITS, BLOCK_D], (m, l) [T, H, NUM_SPLITS, 2]. Every split stores, even an
        # empty one (m = -1e30, l = 0), so the reduction never reads uninitialised memory.
        part_row = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=store_mask)
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, num_seqs,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # padding rows have no partials
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2)
    l_part = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM,
                  other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.math.exp2(m - m_max)  # empty splits: exp2(-1e30 - m_max) = 0
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_part * w, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # rows per program (query tokens x grouped heads), a power of two >= 16
    tile_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    # Unmasked tiles computed one Q.K^T ahead of their softmax (FlashAttention-3's intra-warpgroup overlap)
    pipeline_qk: bool = False


# Shared memory the K/V pipeline of one program may take: two programs then fit an SM on Ampere/Hopper, and
# one on GPUs with ~100 KB.
_SMEM_BUDGET = 96 * 1024


def attention_config(head_dim: int, group: int, max_query_len: int, dtype: torch.dtype,
                     chunked: bool = False, target: Optional[tuple[int, int]] = None) -> AttentionConfig:
    """Launch shape. Decode-like batches (every request's rows fit 16) get the smallest tl.dot; prefill gets
    large q-blocks so each K/V tile feeds many rows. Sized from first principles and checked spill-free for
    sm_80/sm_90 with `python -m streamer_kernels.aot`; the GPU check times alternatives at the target shapes.
    `chunked`: the launch reads attention chunks (Llama 4's local layers). `target`: the GPU's (compute capability,
    shared memory per program), from `device_target`; None off-GPU."""
    block_d = max(16, next_pow2(head_dim))
    decode = max_query_len * group <= 16 or max_query_len == 1
    if dtype == torch.float32:
        # No 16-bit tensor-core path: dots run as 3xTF32 (fp32-accurate), whose register appetite wants small
        # tiles; these are the largest that compile without spills.
        if block_d <= 128:
            return (AttentionConfig(max(16, next_pow2(group)), 32, 4, 3) if decode
                    else AttentionConfig(max(32, next_pow2(group)), 32, 4, 2))
        return AttentionConfig(max(16, next_pow2(group)), 32, 8, 1)
    elem = torch.empty((), dtype=dtype).element_size()
    wide = block_d > 128  # wide heads: halve tiles (registers, shared memory)
    tile_n = 32 if wide else 64
    # K and V tiles per pipeline stage; as many stages (<= 3) as the budget allows.
    num_stages = max(1, min(3, _SMEM_BUDGET // (2 * tile_n * block_d * elem)))
    if decode and not wide and not chunked:
        # Measured on an H200 (bench/RESULTS.md, 2026-12-04, decode 64 x 4,096): 128-key tiles over 8 warps in 3
        # stages read the cache at 89% of copy bandwidth, 64-key tiles over 4 warps at 68-80%. They compile to
        # 73 KB of shared memory and no spills for sm_80 and sm_90 (`python -m streamer_kernels.aot`), except
        # with attention chunks (Llama 4) and split KV on sm_90, which keep the 64-key tiles.
        return AttentionConfig(block_m=max(16, next_pow2(group)), tile_n=128, num_warps=8, num_stages=3)
    if decode:
        return AttentionConfig(block_m=max(16, next_pow2(group)), tile_n=tile_n, num_warps=4,
                               num_stages=num_stages)
    block_m = max(64 if wide else 128, next_pow2(group))
    big_tiles = (2 * 2 * 128 + block_m) * block_d * elem  # two stages of 128-key K and V tiles, and Q's tile
    if (not wide and not chunked and block_m == 128 and target is not None and target[0] >= 90
            and target[1] >= big_tiles):
        # Hopper: measured on an H200 (bench/RESULTS.md, 2026-12-04, prefill 1 x 4,096), 128-key tiles in 2 stages
        # ran 1.08x faster than 64-key tiles in 3 (0.483 vs 0.520 ms). With wgmma (sm_90) they compile without
        # spills (160 KB of shared memory at D=128); with mma.sync (sm_80) their scores spill.
        return AttentionConfig(block_m=128, tile_n=128, num_warps=8, num_stages=2)
    # 8 warps even for 64-row wide tiles: with 4, the [64, 256] fp32 accumulator spills on sm_80.
    return AttentionConfig(block_m=block_m, tile_n=tile_n, num_warps=8 if block_m >= 128 or wide else 4,
                           num_stages=num_stages)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                         head_dim: int, dtype: torch.dtype, device: torch.device,
                         sliding_window: Optional[int] = None, attention_chunk: Optional[int] = None) -> int:
    """Split-KV factor for a batch: > 1 only for decode-only batches whose (request, KV head) programs would
    fill less than two programs per SM, and only as far as each split keeps >= 4 tiles of work (a window or an
    attention chunk bounds the context a query reads)."""
    if max_query_len != 1 or num_seqs == 0:
        return 1
    sms = device_sm_count(device)
    programs = num_seqs * num_kv_heads
    context = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    if attention_chunk:
        context = min(context, attention_chunk)
    tile_n = attention_config(head_dim, 1, 1, dtype, bool(attention_chunk)).tile_n
    tiles = cdiv(context, tile_n)
    splits = 1
    while (splits < MAX_KV_SPLITS and programs * splits < 2 * sms and tiles >= 4 * (splits * 2)):
        splits *= 2
    return splits


def unified_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      softmax_scale: float, max_query_len: int, max_seq_len: int,
                      sliding_window: Optional[int] = None, *, num_kv_splits: Optional[int] = None,
                      logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                      config: Optional[AttentionConfig] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                      causal_limit: Optional[torch.Tensor] = None, attention_chunk: Optional[int] = None,
                      position_bias: Optional[torch.Tensor] = None,
                      query_lens: Optional[Sequence[int]] = None) -> None:
    """See `streamer_kernels.unified_attention`. `num_kv_splits` None = `choose_num_kv_splits`; otherwise a
    power of two forcing the split-KV path (which is correct for any batch, just slower for prefill).
    `logit_softcap` (None or 0 = off) soft-caps the scaled scores. `sinks` (float32 [num_heads], None = off): a
    logit per head in every softmax's denominator. `config` overrides the launch shape (for tuning sweeps).
    An FP8 (float8_e4m3fn) cache holds k / k_scale and v / v_scale. `causal_limit` (int32 [T], None = off): the
    last position each query sees. `attention_chunk` (None or 0 = off): the query at position p sees keys from
    (p // attention_chunk) * attention_chunk on. `position_bias` (float32 [num_heads, 2R + 1], None = off): added
    to each scaled score, entry R + d for a key d positions after its query (d clamped to [-R, R])."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride(), \
        "key and value caches must share a layout (kv_cache[0] / kv_cache[1] do)"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and key_cache.stride(-1) == 1
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    assert out.shape == q.shape and (key_cache.dtype == q.dtype or kv_fp8)
    assert query_start_loc.shape[0] == num_seqs + 1 and block_table.shape[0] >= num_seqs
    assert block_table.stride(1) == 1
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.dtype == torch.float32
                             and sinks.is_contiguous()), "sinks: contiguous float32 [num_heads]"
    assert causal_limit is None or (causal_limit.dtype == torch.int32 and causal_limit.is_contiguous()
                                    and causal_limit.shape[0] >= num_tokens), "causal_limit: contiguous int32 [T]"
    assert position_bias is None or (position_bias.dtype == torch.float32 and position_bias.shape[0] == num_heads
                                     and position_bias.shape[1] % 2 == 1 and position_bias.stride(1) == 1), \
        "position_bias: float32 [num_heads, 2R + 1], rows contiguous"
    group = num_heads // num_kv_heads
    use_window = sliding_window is not None and sliding_window > 0
    use_chunk = bool(attention_chunk)
    assert not use_chunk or attention_chunk > 0, "attention_chunk must be positive"  # type: ignore[operator]
    use_softcap = bool(logit_softcap)
    # Scores in log2 units: q.k * scale * log2(e), or with a cap tanh(q.k * scale / cap) * cap * log2(e).
    qk_scale = (softmax_scale / logit_softcap if use_softcap else softmax_scale * _LOG2E) * (k_scale if kv_fp8 else 1.0)
    softcap_scale = logit_softcap * _LOG2E if use_softcap else 1.0

    target = device_target(q.device)
    cfg = config or attention_config(head_dim, group, max_query_len, q.dtype, use_chunk, target)
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs a reduction dim of at least 16

    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, head_dim,
                                             q.dtype, q.device, sliding_window if use_window else None,
                                             attention_chunk if use_chunk else None)
    assert num_kv_splits >= 1 and num_kv_splits & (num_kv_splits - 1) == 0, "num_kv_splits: a power of two"

    if num_kv_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_kv_splits, block_d, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_kv_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused by the single-pass kernel

    # bf16 arithmetic is broken in the numpy interpreter (bf16 lives there as raw uint16), so under it K/V/Q
    # are widened to fp32 right after loading. On the GPU fp32 inputs get 3xTF32 dots: fp32-accurate (plain
    # TF32 is not) yet on tensor cores (IEEE fp32 dots run on FMA units and spill registers).
    interpreted = interpret_mode()
    upcast = interpreted and q.dtype == torch.bfloat16 and not kv_fp8  # (an FP8 cache's dots run in fp16)
    precision = "ieee" if interpreted else ("tf32x3" if q.dtype == torch.float32 else "tf32")

    def launch(cfg: AttentionConfig, subset: int, short_max: int = 0) -> None:
        assert cfg.block_m >= group and cfg.block_m >= 16 and cfg.tile_n >= 16
        block_q = cfg.block_m // group
        # Program ids without reading query_start_loc: request b's q-blocks start at query_start_loc[b] // BLOCK_Q
        # + b and its last one is below query_start_loc[b + 1] // BLOCK_Q + b + 1, so num_tokens // BLOCK_Q +
        # num_seqs programs cover every request (the slack, at most one per request, exits at once). A _SHORT
        # launch has one program per request.
        q_programs = num_seqs if subset == _SHORT.value else num_tokens // block_q + num_seqs
        _unified_attention_kernel[(q_programs * num_kv_heads, num_kv_splits)](
            q, key_cache, value_cache, out, part_acc, part_ml, out if sinks is None else sinks,
            query_start_loc if causal_limit is None else causal_limit,
            out if position_bias is None else position_bias,
            query_start_loc, seq_lens, block_table,
            num_seqs, qk_scale, softcap_scale, int(sliding_window) if use_window else 0,
            int(attention_chunk) if use_chunk else 1, float(v_scale),
            0 if position_bias is None else position_bias.shape[1] // 2,
            0 if position_bias is None else position_bias.stride(0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_table.stride(0),
            NUM_HEADS=num_heads, QPK=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n,
            NUM_SPLITS=num_kv_splits, USE_WINDOW=use_window, USE_SOFTCAP=use_softcap,
            USE_SINKS=sinks is not None, UPCAST=upcast,
            DOT_PRECISION=precision, KV_FP8=kv_fp8, USE_LIMIT=causal_limit is not None, USE_CHUNK=use_chunk,
            USE_BIAS=position_bias is not None, PIPELINE_QK=cfg.pipeline_qk, SUBSET=subset, SHORT_MAX=short_max,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    short = attention_config(head_dim, group, 1, q.dtype, use_chunk, target)
    short_q = short.block_m // group
    # (counted only for a batch launched with a longer shape: decode-only steps pay nothing for the check)
    mixed = config is None and query_lens is not None and num_kv_splits == 1 and cfg != short
    lens = query_lens[:num_seqs] if mixed else ()  # type: ignore[index]
    num_short = sum(1 for n in lens if 0 < n <= short_q)
    if (num_short and num_short * num_kv_heads >= device_sm_count(q.device) and any(n > short_q for n in lens)):
        # With a prefill chunk's launch shape every decode in the batch would get a prefill-sized q-block: 128-row
        # dots and softmax for one token's rows. Given the host's query lengths, the decodes (and any request that
        # fits one decode-shaped q-block) run as a launch of their own, shaped for decode, and the rest as another.
        # Only with a program per SM at least: the launches run one after the other, and a few decode programs
        # alone would leave the GPU idle longer than they cost inside the chunks' grid.
        launch(short, _SHORT.value)
        launch(cfg, _LONG.value, short_q)
    else:
        launch(cfg, _ALL.value)
    if num_kv_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits,
            num_warps=1 if block_d * num_kv_splits <= 1024 else 4,
        )
