"""LoRA at forward time: the step's token -> adapter slot map, and the addition of each token's adapter output
(models/lora.py: the slots themselves, which layers get them, and putting adapters into them).

The layer adds `x A_s^T B_s^T` for each token's slot s. Which adapters a step uses is data, so in a compiled
model the addition is an opaque custom op (`lora_add_`) that reads the step's `LoRAStep` (set by the runner
around the forward, as the attention metadata is): one pair of matmuls per adapter in use over its tokens,
or, inside a CUDA graph, `streamer_kernels.lora_add` (each token reads its own slot's weights: fixed launch
shapes for any mix of slots).

(Its own module so that models/layers.py, whose linears call `add_lora` / `lora_add_`, need not import
models/lora.py, which picks the adaptable layers by their classes (ColumnParallelLinear, RowParallelLinear) and so
imports models/layers.py: this module imports neither, and the dependency runs one way. An isinstance check there is
the real criterion of what takes adapters, so it stays, rather than a duck-typed attribute.)
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F

import streamer_kernels as K

if TYPE_CHECKING:
    from streamer.models.lora import LoRAWeights


@dataclass
class LoRAStep:
    """Which adapter slot each of the step's tokens uses."""

    token_slots: torch.Tensor  # int64 [T] on the device; 0 = no adapter
    # (slot, indices of its tokens, or None for all of them), for every slot > 0 in use
    groups: list[tuple[int, Optional[torch.Tensor]]] = field(default_factory=list)
    gather: bool = False  # per-token weight gather (graph-safe) instead of the groups


class _Current(threading.local):  # (per thread: a background compile's warm-up runs beside the device thread)
    step: Optional[LoRAStep] = None


_current = _Current()
SMALL_BATCH = 8  # tokens up to which a CPU half-precision model runs its LoRA matmuls in fp32 (see LoRAWeights)


class lora_context:
    """`with lora_context(step):` the forward inside sees `step` (None: no adapter in use)."""

    def __init__(self, step: Optional[LoRAStep]) -> None:
        self.step = step

    def __enter__(self) -> None:
        self.prev, _current.step = _current.step, self.step

    def __exit__(self, *exc: Any) -> None:
        _current.step = self.prev


_lora_layers: list[weakref.ref[LoRAWeights]] = []  # every layer's slots, by the layer's `lora_id`


def register(w: LoRAWeights) -> int:
    """Make a layer's slots reachable from the compiled model's `lora_add_` op; returns its `lora_id`."""
    _lora_layers.append(weakref.ref(w))
    return len(_lora_layers) - 1


def add_lora(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights) -> None:
    """y += each token's adapter's x A^T B^T, in place (y [T, out], x [T, in], both 2-D and contiguous)."""
    step = _current.step
    if step is None:
        return
    if step.gather:  # (Triton on CUDA: each token reads its adapter's tiles, no per-token copies)
        K.lora_add(y, x, w.a, w.b, step.token_slots)
        return
    if w.twins and x.shape[0] <= SMALL_BATCH:
        for slot, idx in step.groups:
            xs = x if idx is None else x.index_select(0, idx)
            delta = F.linear(xs.float(), w.a32_of[slot]).mm(w.bt32_of[slot]).to(y.dtype)
            if idx is None:
                y += delta
            else:
                y.index_add_(0, idx, delta)
        return
    for slot, idx in step.groups:
        if idx is None:
            y.addmm_(F.linear(x, w.a_of[slot]), w.bt_of[slot])
        else:
            y.index_add_(0, idx, F.linear(x.index_select(0, idx), w.a_of[slot]).mm(w.bt_of[slot]))


# The compiled model's way in (a Library op, as `packed_linear`: less per-call overhead than @custom_op).
_lib = torch.library.Library("streamer", "FRAGMENT")
_lib.define("lora_add_(Tensor(a!) y, Tensor x, int layer) -> ()")


def _lora_add(y: torch.Tensor, x: torch.Tensor, layer: int) -> None:
    w = _lora_layers[layer]()
    assert w is not None, "lora_add_ called for a layer whose model is gone"
    add_lora(y, x, w)


_lib.impl("lora_add_", _lora_add, "CompositeExplicitAutograd")
lora_add_: Callable[..., None] = torch.ops.streamer.lora_add_.default


@torch.library.register_fake("streamer::lora_add_")
def _(y: torch.Tensor, x: torch.Tensor, layer: int) -> None:
    return None
