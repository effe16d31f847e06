"""LoRA for a batch whose tokens use different adapters (the CUDA-graph decode path): y += x A_s^T B_s^T for each
token's slot s, without gathering per-token copies of A and B (a [T, R, in] gather reads and writes T copies of
the adapter; these kernels read each tile once per token, from cache when tokens share an adapter).

Two launches: shrink, h = x A_s^T in fp32 ([T, R]), then expand, y += h B_s^T in y's dtype. Slot 0 means no adapter:
both kernels return at once for such a token (h is left unwritten there and never read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import check_interpreter_consistency, next_pow2

check_interpreter_consistency()


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, k_dim, r_dim, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot == 0:
        return
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + ks, mask=ks < k_dim, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + rs[:, None] * stride_ar + ks[None, :],
                    mask=(rs[:, None] < r_dim) & (ks[None, :] < k_dim), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + rs, acc, mask=rs < r_dim)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, n_dim, r_dim, stride_h, stride_bs, stride_bn, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot == 0:
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + t * stride_h + rs, mask=rs < r_dim, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + ns[:, None] * stride_bn + rs[None, :],
                mask=(ns[:, None] < n_dim) & (rs[None, :] < r_dim), other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_y + ns, mask=ns < n_dim, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + ns, (y + delta).to(y_ptr.dtype.element_ty), mask=ns < n_dim)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    tokens, k_dim = x.shape
    _, r_dim, _ = a.shape
    n_dim = b.shape[1]
    if tokens == 0:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.stride(-1) == 1 and b.stride(-1) == 1
    h = torch.empty(tokens, r_dim, dtype=torch.float32, device=x.device)
    block_r = min(64, next_pow2(r_dim))
    block_k = max(16, min(256, 4096 // block_r))
    _shrink_kernel[(tokens, triton.cdiv(r_dim, block_r))](
        x, a, slots, h, k_dim, r_dim, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    block_r = next_pow2(r_dim)
    block_n = max(16, min(256, 8192 // block_r))
    _expand_kernel[(tokens, triton.cdiv(n_dim, block_n))](
        h, b, slots, y, n_dim, r_dim, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)
