"""Rotary position embedding for q and k in one launch (neox and GPT-J pairings, partial rotary)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import check_interpreter_consistency, empty_output, next_pow2

check_interpreter_consistency()


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, num_heads, cos, sin,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    HALF: tl.constexpr = ROT_DIM // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & (offs_r[None, :] < HALF)
    if IS_NEOX:  # pairs (i, i + rot/2)
        i1 = offs_r
        i2 = offs_r + HALF
    else:  # GPT-J: pairs (2i, 2i + 1)
        i1 = 2 * offs_r
        i2 = 2 * offs_r + 1
    x_row = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh
    o_row = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh
    x1 = tl.load(x_row + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + i1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(o_row + i2[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: the tail of each head is copied unchanged
        offs_p = ROT_DIM + tl.arange(0, BLOCK_PASS)
        p_mask = h_mask[:, None] & (offs_p[None, :] < HEAD_DIM)
        tl.store(o_row + offs_p[None, :], tl.load(x_row + offs_p[None, :], mask=p_mask), mask=p_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # One program per token: cos/sin are loaded once and applied to all of its q and k heads.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    r_mask = offs_r < ROT_DIM // 2
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + ROT_DIM // 2 + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads, cos, sin,
                  HEAD_DIM, ROT_DIM, IS_NEOX, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, num_kv_heads, cos, sin,
                  HEAD_DIM, ROT_DIM, IS_NEOX, BLOCK_HKV, BLOCK_HALF, BLOCK_PASS)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == q.dtype
    assert rot_dim % 2 == 0 and rot_dim <= head_dim
    assert positions.shape[0] >= num_tokens and positions.stride(0) == 1
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    q_out = empty_output(q.shape, q.dtype, q.device)
    k_out = empty_output(k.shape, k.dtype, k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_half = next_pow2(rot_dim // 2)
    block_h = next_pow2(num_heads)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads,
        HEAD_DIM=head_dim, ROT_DIM=rot_dim, IS_NEOX=is_neox,
        BLOCK_H=block_h, BLOCK_HKV=next_pow2(num_kv_heads), BLOCK_HALF=block_half,
        BLOCK_PASS=next_pow2(head_dim - rot_dim) if head_dim > rot_dim else 0,
        num_warps=4 if block_h * block_half >= 1024 else 2,
    )
    return q_out, k_out
