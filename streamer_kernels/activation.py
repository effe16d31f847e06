"""SiLU-and-mul for gated MLPs: reads gate|up once, writes silu(gate) * up."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamer_kernels._utils import check_interpreter_consistency, empty_output, next_pow2

check_interpreter_consistency()


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the model dtype before the product, as the unfused F.silu(gate) * up does.
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    two_d = x.shape[-1]
    assert two_d % 2 == 0, "silu_and_mul needs an even last dim"
    d = two_d // 2
    rows = x.reshape(-1, two_d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = empty_output((*x.shape[:-1], d), x.dtype, x.device)
    out2 = out.view(-1, d)
    if rows.shape[0] == 0 or d == 0:
        return out
    block = min(1024, next_pow2(d))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
        rows, out2, rows.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
    return out
