"""reshape_and_cache: scatter the step's new keys and values into the paged KV cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import check_interpreter_consistency, next_pow2
from streamer_kernels.reference import quantize_fp8

check_interpreter_consistency()


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: all of its heads are copied at once ([BLOCK_H, BLOCK_D] tile).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(kc + offs_h[:, None] * stride_kc_head + offs_d[None, :], k.to(key_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_head + offs_d[None, :], v.to(value_cache_ptr.dtype.element_ty),
             mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """See `streamer_kernels.reshape_and_cache`. Strided key/value views (e.g. slices of a fused qkv) are fine;
    the last dim of every tensor must be contiguous."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert key.shape[1:] == (num_kv_heads, head_dim) and value.shape[1:] == (num_kv_heads, head_dim)
    assert value_cache.shape == key_cache.shape
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "the last dim must be contiguous"
    assert key.dtype == value.dtype and key_cache.dtype == value_cache.dtype
    # bf16 -> bf16 is a plain copy; converting between float types inside the kernel is not worth a special case
    # for the interpreter (whose bf16 conversions truncate), so keep them equal.
    if key_cache.dtype == torch.float8_e4m3fn and key.dtype != key_cache.dtype:
        # Quantized by torch, then copied: one elementwise pass, and exact under the interpreter too (whose
        # float -> fp8 conversion mis-rounds values that carry into the next exponent).
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    assert key.dtype == key_cache.dtype, "key/value must already have the cache dtype (or the cache be FP8)"
    assert slot_mapping.stride(0) == 1

    block_h = next_pow2(num_kv_heads)
    block_d = next_pow2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
