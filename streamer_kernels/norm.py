"""Fused RMSNorm, optionally adding the residual first: one read of x (and residual), one write per output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import check_interpreter_consistency, empty_output, next_pow2

check_interpreter_consistency()

# One program normalises one row held entirely in registers; wider rows than this would spill.
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_r, stride_o, stride_nr,
    n_cols, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The unfused model adds in the model dtype: round the sum before normalising it.
        s = (x + r).to(dtype)
        tl.store(new_residual_ptr + row * stride_nr + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.math.rsqrt(var + eps)).to(dtype).to(tl.float32)  # rounded before the weight, as HF does
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(dtype), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.stride(0) == 1
    assert n <= MAX_HIDDEN, f"rms_norm supports rows up to {MAX_HIDDEN} elements"
    x2 = _as_rows(x)
    out = empty_output(x.shape, x.dtype, x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = _as_rows(residual)
        new_residual = empty_output(x.shape, x.dtype, x.device)
        nr2 = new_residual.view(-1, n)
    else:
        r2 = nr2 = x2  # unused
        new_residual = None
    if x2.shape[0] == 0:
        return out, new_residual
    block_n = next_pow2(n)
    num_warps = 4 if block_n <= 2048 else (8 if block_n <= 8192 else 16)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, nr2,
        x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0),
        n, eps,
        ADD_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    normed, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return normed, new_residual
