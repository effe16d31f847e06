"""LoRA adapters inside the model: per-layer slot-stacked low-rank weights, which layers get them, and an adapter's
matrices put into them.

Every linear layer that adapters may target (q/k/v, o, gate/up, down) gets two stacked tensors,
`a` [slots, subs * R, in] and `b` [slots, out, subs * R], where `slots` = max_loras + 1 (slot 0 is all zeros:
no adapter), R = max_lora_rank and `subs` = the sub-matrices a packed layer holds (3 for qkv: q, k and v each
have their own A and B; B is block-diagonal over them). An adapter of a smaller rank fills its first rows with
zeros after them, which changes nothing; its scale (alpha / r) is folded into B. Under tensor parallelism a
column layer's B is split along its output rows as the weight is, a row layer's A along its input columns;
a row layer's LoRA output is added to its partial sum before the all-reduce (it is linear in the input too).

Adding the adapters' output at forward time (the step's token -> slot map, `add_lora`, the compiled model's
`lora_add_` op) is models/lora_ops.py's.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from streamer.models.layers import ColumnParallelLinear, PackableLinear, RowParallelLinear

# (the forward-time half, kept importable from here)
from streamer.models.lora_ops import SMALL_BATCH, LoRAStep, add_lora, lora_add_, lora_context, register  # noqa: F401

# The layers adapters may target, by our parameter's name, and the checkpoint modules each one holds (in Llama's
# spelling: a family whose checkpoints name them otherwise renames an adapter's modules as it renames its weights,
# `lora_parts`).
LORA_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
               # MLPs without a gate: Arcee's up_proj, StarCoder2's c_fc / c_proj, GeluMLP's fc1 / fc2 (GPT-NeoX,
               # Falcon, GPT-J, Phi, GPTBigCode, GPT-2)
               "up_proj": ("up_proj",), "c_fc": ("c_fc",), "c_proj": ("c_proj",), "fc1": ("fc1",), "fc2": ("fc2",)}


class LoRAWeights:
    """One layer's adapter slots (see the module docstring)."""

    def __init__(self, layer: PackableLinear, slots: int, rank: int) -> None:
        w = layer.weight
        self.row = isinstance(layer, RowParallelLinear)
        self.sub_sizes = [w.shape[0]] if self.row else list(layer.output_sizes)  # type: ignore[attr-defined]
        self.rank = rank
        n = len(self.sub_sizes)
        dtype = layer.compute_dtype or w.dtype  # (a 4-bit layer's weight holds its codes until it is packed)
        self.a = torch.zeros(slots, n * rank, w.shape[1], dtype=dtype, device=w.device)
        self.b = torch.zeros(slots, w.shape[0], n * rank, dtype=dtype, device=w.device)
        # Per-slot views (A, and B transposed), made once: a decode step calls `add_lora` for every linear, and
        # indexing the stacks there cost as much as the matmuls.
        self.a_of = list(self.a.unbind(0))
        self.bt_of = [b.t() for b in self.b.unbind(0)]
        # CPU, half precision: fp32 twins for small batches, where oneDNN's bf16 matmul of a few rows costs ~5x its
        # fp32 one (25 vs 4.5 us for [1 x 768] x [768 x 48] on the 2-core box).
        self.twins = w.device.type == "cpu" and w.dtype != torch.float32
        if self.twins:
            self.a32, self.b32 = self.a.float(), self.b.float()
            self.a32_of, self.bt32_of = list(self.a32.unbind(0)), [b.t() for b in self.b32.unbind(0)]
        self.layer = weakref.ref(layer)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.twins:
            self.a32[slot].zero_()
            self.b32[slot].zero_()

    def place(self, slot: Optional[int], sub: int, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """Copy one sub-matrix's A [r, in] and B [out, r] (full, unsharded checkpoint shapes; B already scaled)
        into `slot`, this rank's shard of them; `slot=None` only checks the shapes (raises ValueError)."""
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair up")
        if r > self.rank:
            raise ValueError(f"{name}: rank {r} exceeds max_lora_rank {self.rank}")
        layer = self.layer()
        assert layer is not None
        tp, rank = layer.tp_size, layer.tp_rank  # type: ignore[attr-defined]
        if self.row:
            n = self.a.shape[2]
            if a.shape[1] != n * tp or b.shape[0] != self.b.shape[1]:
                raise ValueError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a layer of "
                                 f"{n * tp} inputs and {self.b.shape[1]} outputs")
            a_local, b_rows, offset = a[:, rank * n:(rank + 1) * n], b, 0
        else:
            if a.shape[1] != self.a.shape[2]:
                raise ValueError(f"{name}: lora_A has {a.shape[1]} inputs, the layer {self.a.shape[2]}")
            offset, _, b_rows = layer.shard_rows(sub, b, name)  # type: ignore[attr-defined]
            a_local = a
        if slot is None:
            return
        cols = slice(sub * self.rank, sub * self.rank + r)
        self.a[slot, cols].copy_(a_local)
        self.b[slot, offset:offset + b_rows.shape[0], cols].copy_(b_rows)
        if self.twins:  # (the model's rounding, so that both paths compute with the same weights)
            rows = slice(offset, offset + b_rows.shape[0])
            self.a32[slot, cols].copy_(self.a[slot, cols])
            self.b32[slot, rows, cols].copy_(self.b[slot, rows, cols])


def attach(model: torch.nn.Module, slots: int, rank: int) -> dict[str, LoRAWeights]:
    """Give every adaptable linear of `model` its slots (before its weights are packed); returns them by the
    layer's module name."""
    found: dict[str, LoRAWeights] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_LAYERS and isinstance(module, (ColumnParallelLinear, RowParallelLinear)) \
                and ".experts." not in name:  # (routed experts take no adapters)
            w = LoRAWeights(module, slots, rank)
            module.lora = w
            module.lora_id = register(w)
            found[name] = w
    return found


def place_adapter(model: Any, layers: dict[str, LoRAWeights], slot: Optional[int],
                  modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put an adapter's matrices ({checkpoint module name: (A, scaled B)}) into `slot` of each layer it targets,
    after clearing the slot; `slot=None` only checks that every matrix fits the model (ValueError naming it)."""
    if slot is not None:
        for w in layers.values():
            w.clear(slot)
    for module, (a, b) in modules.items():
        targets = _our_modules(model, module, b)
        if not targets:
            raise ValueError(_unsupported(model, layers, module))
        for target, b_part in targets:
            _place_module(model, layers, slot, module, target, a, b_part)


def _our_modules(model: Any, module: str, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """An adapter's module in our spelling, with its B: as is, or, for a family whose checkpoints name modules
    otherwise, through the model's `lora_parts` (a fused query_key_value becomes q, k and v, B cut by rows)."""
    rename = getattr(model, "lora_parts", None)
    return [(module, b)] if rename is None else rename(module, b)


def _place_module(model: Any, layers: dict[str, LoRAWeights], slot: Optional[int], module: str, target: str,
                  a: torch.Tensor, b: torch.Tensor) -> None:
    """One adapter matrix pair into the layer holding `target` (our spelling; `module` names it in errors)."""
    name, shard = model.param_name(f"{target}.weight")
    w = layers.get(name.removesuffix(".weight"))
    if w is None:
        raise ValueError(_unsupported(model, layers, module))
    if shard is not None:
        w.place(slot, w.layer().shard_names.index(shard), a, b, module)  # type: ignore[union-attr]
        return
    parts = model._fused_parts(name, b) if len(w.sub_sizes) > 1 else None
    if parts is None:
        w.place(slot, 0, a, b, module)
    else:  # a fused checkpoint module (Phi-3's qkv_proj): one A, B's rows split over the sub-matrices
        for i, (_, part) in enumerate(parts):
            w.place(slot, i, a, part, module)


def _unsupported(model: Any, layers: dict[str, LoRAWeights], module: str) -> str:
    """The refusal of a target, listing the modules this model's adapters may target in its checkpoints' names."""
    names = set()
    for name, w in layers.items():
        shards = w.layer().shard_names if len(w.sub_sizes) > 1 else [None]  # type: ignore[union-attr]
        for shard in shards:
            internal = f"{name}.weight" if shard is None else f"{name}.weight:{shard}"
            names.add(model.checkpoint_name(internal).rsplit(".", 2)[-2])
    return f"LoRA on {module!r} is not supported (adapters may target {', '.join(sorted(names))})"
