"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`: QLoRA fine-tunes saved quantized, unsloth's
*-bnb-4bit models), dequantized as they load, as the bitsandbytes library computes them. The model then runs in its
compute dtype; `quantization="int8"` / `"int4"` re-quantize it for memory, with streamer's own kernels.

4-bit (`load_in_4bit`, NF4 or FP4), the tensors transformers saves for a linear layer `X`:
- `X.weight`: the codes, two a byte, the first in the high nibble (uint8, or the bytes of `bnb_4bit_quant_storage`);
- `X.weight.quant_map`: the 16 values the codes stand for (NF4's or FP4's table);
- `X.weight.absmax`: one scale per `blocksize` values; with double quantization ("nested") these are 8-bit codes
  themselves, standing for `nested_quant_map[code] * nested_absmax[block] + nested_offset`;
- `X.weight.quant_state.bitsandbytes__nf4` (or `__fp4`): JSON bytes: blocksize, the weight's shape and dtype, and
  the nested blocksize and offset.

8-bit (`load_in_8bit`, LLM.int8()): `X.weight` int8 [out, in] and `X.SCB`, each row's absmax (float32 [out]): the
weight is `int8 * SCB / 127`. `X.weight_format` (the layout tag; always row-major in saved checkpoints) is dropped.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Iterator, Optional

import torch

_STATE = ".quant_state.bitsandbytes__"
_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_CHUNK = 1 << 22  # codes decoded at a time: keeps the int64 index temporaries at 32 MiB


def is_bnb(qc: Optional[dict[str, Any]]) -> bool:
    return qc is not None and qc.get("quant_method") == "bitsandbytes"


def check_bnb(qc: dict[str, Any]) -> dict[str, Any]:
    four, eight = bool(qc.get("load_in_4bit") or qc.get("_load_in_4bit")), \
        bool(qc.get("load_in_8bit") or qc.get("_load_in_8bit"))
    if four == eight:
        raise ValueError("a bitsandbytes quantization_config must set exactly one of load_in_4bit and load_in_8bit")
    if four and qc.get("bnb_4bit_quant_type", "fp4") not in ("nf4", "fp4"):
        raise ValueError(f"bnb_4bit_quant_type must be 'nf4' or 'fp4', got {qc.get('bnb_4bit_quant_type')!r}")
    return qc


def _blockwise(codes: torch.Tensor, table: torch.Tensor, absmax: torch.Tensor, blocksize: int,
               count: int) -> torch.Tensor:
    """table[codes[i]] * absmax[i // blocksize] for the first `count` codes, in float32."""
    out = torch.empty(count, dtype=torch.float32)
    table = table.float()
    scales = absmax.float()
    for start in range(0, count, _CHUNK):
        stop = min(start + _CHUNK, count)
        block_of = torch.arange(start, stop) // blocksize
        out[start:stop] = table[codes[start:stop].long()] * scales[block_of]
    return out


def dequantize_4bit(packed: torch.Tensor, parts: dict[str, torch.Tensor], state: dict[str, Any],
                    name: str) -> torch.Tensor:
    """The weight the 4-bit codes and their quant state stand for, in the state's dtype."""
    shape = tuple(state["shape"])
    count = math.prod(shape)
    raw = packed.contiguous().view(torch.uint8).flatten()
    if raw.numel() * 2 < count:
        raise ValueError(f"{name}: {raw.numel()} bytes of 4-bit codes cannot hold a {shape} weight")
    codes = torch.stack([raw >> 4, raw & 0x0F], dim=-1).flatten()
    absmax = parts["absmax"]
    if "nested_blocksize" in state:  # double quantization: the scales are 8-bit codes themselves
        absmax = _blockwise(absmax.view(torch.uint8), parts["nested_quant_map"], parts["nested_absmax"],
                            int(state["nested_blocksize"]), absmax.numel()) + float(state["nested_offset"])
    blocksize = int(state["blocksize"])
    if absmax.numel() != -(-count // blocksize):
        raise ValueError(f"{name}: {absmax.numel()} scales do not fit a {shape} weight in blocks of {blocksize}")
    values = _blockwise(codes, parts["quant_map"], absmax, blocksize, count)
    return values.view(shape).to(getattr(torch, str(state.get("dtype", "float32")).removeprefix("torch.")))


def dequantize_8bit(weight: torch.Tensor, scb: torch.Tensor, name: str) -> torch.Tensor:
    if weight.dim() != 2 or scb.shape != (weight.shape[0],):
        raise ValueError(f"{name}: an int8 weight {tuple(weight.shape)} needs one SCB scale a row, got "
                         f"{tuple(scb.shape)}")
    return weight.float() * (scb.float() / 127.0)[:, None]


class _Gathered:
    """The parts of one quantized weight, which come in any order (and may be split across shards)."""

    def __init__(self) -> None:
        self.weight: Optional[torch.Tensor] = None
        self.parts: dict[str, torch.Tensor] = {}
        self.state: Optional[dict[str, Any]] = None

    def complete(self) -> bool:
        if self.weight is None or self.state is None:
            return False
        needed = _PARTS if "nested_blocksize" in self.state else _PARTS[:2]
        return all(p in self.parts for p in needed)


def dequantizing_bnb(weights: Iterable[tuple[str, torch.Tensor]], qc: dict[str, Any],
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each bitsandbytes-quantized weight replaced by its dequantized self."""
    return _dequantizing_4bit(weights) if qc.get("load_in_4bit") or qc.get("_load_in_4bit") else \
        _dequantizing_8bit(weights)


def _dequantizing_4bit(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    gathered: dict[str, _Gathered] = {}  # "X.weight" -> its parts so far
    for name, t in weights:
        key, part = _split(name)
        if part is None and not (name.endswith(".weight") and _maybe_codes(t)):
            yield name, t
            continue
        g = gathered.setdefault(key, _Gathered())
        if part is None:
            g.weight = t
        elif part == "state":
            g.state = json.loads(bytes(t.flatten().tolist()).decode("utf-8"))
        else:
            g.parts[part] = t
        if g.complete():
            assert g.weight is not None and g.state is not None
            yield key, dequantize_4bit(g.weight, g.parts, g.state, key)
            del gathered[key]
    broken = []
    for key, g in gathered.items():
        if g.weight is not None and g.state is None and not g.parts:  # a plain weight that only looked like codes
            yield key, g.weight
        else:
            broken.append(key)
    if broken:
        raise ValueError("bitsandbytes 4-bit weight(s) with parts missing (codes, absmax, quant_map, quant_state "
                         f"and, when nested, nested_absmax / nested_quant_map): {', '.join(sorted(broken)[:4])}")


def _maybe_codes(t: torch.Tensor) -> bool:
    """Packed 4-bit codes are stored [n, 1] (uint8, or the bytes of another quant_storage dtype)."""
    return t.dtype == torch.uint8 or (t.dim() == 2 and t.shape[1] == 1)


def _split(name: str) -> tuple[str, Optional[str]]:
    """("X.weight", part) for a quant-state tensor of X.weight ("state" for the JSON one), else (name, None)."""
    i = name.find(_STATE)
    if i >= 0:
        return name[:i], "state"
    for part in _PARTS:
        if name.endswith(".weight." + part):
            return name[:-len(part) - 1], part
    return name, None


def _dequantizing_8bit(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    codes: dict[str, torch.Tensor] = {}  # module -> its int8 weight, until its SCB arrives
    scales: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.endswith(".weight_format"):
            continue
        if name.endswith(".SCB"):
            module = name[:-len(".SCB")]
            if module in codes:
                yield f"{module}.weight", dequantize_8bit(codes.pop(module), t, module)
            else:
                scales[module] = t
        elif name.endswith(".weight") and t.dtype == torch.int8:
            module = name[:-len(".weight")]
            if module in scales:
                yield name, dequantize_8bit(t, scales.pop(module), module)
            else:
                codes[module] = t
        else:
            yield name, t
    if codes or scales:
        raise ValueError("bitsandbytes 8-bit weights without their SCB scales, or scales without weights: "
                         f"{', '.join(sorted({**codes, **scales})[:4])}")
