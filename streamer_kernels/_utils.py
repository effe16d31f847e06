"""Small helpers shared by the kernel modules: when Triton can run, and launch-size arithmetic."""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # triton is an optional dependency; the references serve without it
    HAS_TRITON = False


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET is set: kernels then run on CPU tensors through Triton's numpy interpreter.

    Triton reads the variable when a kernel is *decorated*, i.e. when our kernel modules are first imported, so
    it must be set before that (tests set it before importing anything from this package).
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernel can serve a tensor on this device (else the torch reference is used)."""
    return HAS_TRITON and (t.is_cuda or interpret_mode())


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (cached), or 1 off-GPU, where splitting work buys nothing."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_sms(index)
