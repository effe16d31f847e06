"""Small helpers shared by the kernel modules: when Triton can run, and launch-size arithmetic."""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

# Found, not imported: Triton decides interpreter-or-compiler for every @triton.jit function (its own standard
# library included) when that function is defined, so it must not be imported before TRITON_INTERPRET is set.
# triton is an optional dependency; the torch references serve without it.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET is set: kernels then run on CPU tensors through Triton's numpy interpreter.

    Triton reads the variable when a kernel is *decorated*, i.e. when our kernel modules are first imported, so
    it must be set before that (tests set it before importing anything from this package).
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_interpreter_consistency() -> None:
    """Raise if TRITON_INTERPRET is on but Triton was imported before it was set (its standard library, e.g.
    tl.cdiv / tl.max, would then be compiled-mode functions that fail deep inside our kernels)."""
    if not interpret_mode():
        return
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.cdiv, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton had been imported; set it before the first "
                           "`import triton` (e.g. in the environment of the process)")


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernel can serve a tensor on this device (else the torch reference is used)."""
    return HAS_TRITON and (t.is_cuda or interpret_mode())


def empty_output(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty for kernel outputs; NaN-filled when STREAMER_KERNELS_POISON=1 (the tests set it), so that an
    element a kernel forgets to write cannot pass by holding stale memory that happens to be right."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("STREAMER_KERNELS_POISON") == "1" and dtype.is_floating_point:
        out.fill_(float("nan"))
    return out


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


# Set by streamer_kernels.aot while it compiles for a GPU target on CPU tensors: the (compute capability, shared
# memory per program) that launch heuristics should size for, as if the tensors were on that GPU.
COMPILE_TARGET: tuple[int, int] | None = None


@functools.lru_cache(maxsize=None)
def _device_target(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    return (props.major * 10 + props.minor,
            int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)))


def device_target(device: torch.device) -> tuple[int, int] | None:
    """(compute capability as 80, 90, ..., shared memory one program may take) of `device`, cached; None
    off-GPU (unless streamer_kernels.aot is compiling for a target)."""
    if device.type != "cuda":
        return COMPILE_TARGET
    return _device_target(device.index if device.index is not None else torch.cuda.current_device())
