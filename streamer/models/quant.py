"""FP8 and MXFP4 checkpoints, dequantized as they load: the model then runs in its compute dtype (bf16 by default).

Two on-disk layouts, as the Hub ships them:
- `quant_method: "fp8"` (transformers' fine-grained FP8: Qwen3-*-FP8, DeepSeek-V3 style): `X.weight` in float8 and
  `X.weight_scale_inv` in float32, one scale per `weight_block_size` block (e.g. 128 x 128);
- `quant_method: "compressed-tensors"` with float 8-bit weights (llm-compressor's FP8 / FP8-dynamic): `X.weight` in
  float8 and `X.weight_scale`, per tensor, per output channel or per group of input columns; `X.input_scale`
  (static activation scales) is not needed once the weights are dequantized and is dropped.
Layers a config leaves unquantized (`ignore`, often lm_head) are stored in full precision and pass through. The
weights take the compute dtype's memory, not FP8's (FP8 compute, below, re-quantizes them per channel).

MXFP4 (`quant_method: "mxfp4"`, gpt-oss's experts): `X_blocks` (uint8 [..., rows, G, 16]: 32 FP4 E2M1 values per
block, two a byte, the low nibble first) and `X_scales` (uint8 [..., rows, G]: E8M0, the block's power of two biased
by 127) become `X`, laid out as transformers' `convert_moe_packed_tensors` returns it (rows last: gpt-oss's x @ W).
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional

import torch

logger = logging.getLogger("streamer")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALES = (".weight_scale_inv", ".weight_scale")
_DROPPED = (".input_scale", ".k_scale", ".v_scale", ".q_scale", ".kv_scale")


def check_quantization(qc: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The checkpoint's quantization_config, if streamer can load it (ValueError naming what it cannot)."""
    if not qc:
        return None
    from streamer.models.woq import parse_int_quant
    if parse_int_quant(qc) is not None:  # GPTQ, AWQ, pack-quantized: integer weights (models/woq.py)
        return qc
    method = qc.get("quant_method")
    if method == "bitsandbytes":  # 4- and 8-bit bitsandbytes (models/bnb.py)
        from streamer.models.bnb import check_bnb
        return check_bnb(qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        return qc
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (FP8 'float-quantized' and integer "
                             "'pack-quantized' are)")
        for name, group in (qc.get("config_groups") or {}).items():
            w = (group or {}).get("weights") or {}
            if w.get("type", "float") != "float" or w.get("num_bits", 8) != 8:
                raise ValueError(f"compressed-tensors group {name!r} quantizes weights to {w.get('num_bits')}-bit "
                                 f"{w.get('type')}: 8-bit float (FP8) weights are supported, and integer ones in "
                                 "the 'pack-quantized' format")
        return qc
    if method == "mxfp4":
        return qc
    raise ValueError(f"quantization method {method!r} is not supported: streamer loads FP8 ('fp8', "
                     "'compressed-tensors'), MXFP4 ('mxfp4'), 4- or 8-bit integer ('gptq', 'awq', "
                     "'compressed-tensors' pack-quantized) and bitsandbytes ('bitsandbytes') checkpoints")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, name: str, block: Optional[list[int]] = None,
               ) -> torch.Tensor:
    """weight (FP8 [out, in]) times its scale, in float32. `block`: fp8's block sizes (`scale` holds one per block,
    the edge blocks partial); otherwise the scale is per tensor, per row ([out, 1]) or per column group
    ([out, in / group])."""
    w, s = weight.float(), scale.float()
    out, cols = w.shape
    if block is not None:
        bo, bi = block
        if tuple(s.shape) != (-(-out // bo), -(-cols // bi)):
            raise ValueError(f"{name}: {tuple(s.shape)} scales do not fit a {tuple(w.shape)} weight in "
                             f"{bo} x {bi} blocks")
        return w * s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.dim() == 2 and s.shape[0] == out and cols % s.shape[1] == 0:
        return w * s.repeat_interleave(cols // s.shape[1], 1)
    if s.dim() == 1 and s.shape[0] == out:
        return w * s[:, None]
    raise ValueError(f"{name}: scale of shape {tuple(s.shape)} does not fit a {tuple(w.shape)} weight")


class _Pairs:
    """A quantized weight is two tensors (values, scales) that may come in either order, from different shards:
    holds the first of each pair until its partner arrives. `orphans`: what to say of values / scales left alone."""

    def __init__(self, orphans: tuple[str, str]) -> None:
        self.orphans = orphans
        self.waiting: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})

    def add(self, base: str, part: int, t: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """part 0: the values, 1: the scales. Returns (values, scales) once both are in."""
        partner = self.waiting[1 - part].pop(base, None)
        if partner is None:
            self.waiting[part][base] = t
            return None
        return (t, partner) if part == 0 else (partner, t)

    def check_complete(self) -> None:
        for part, waiting in enumerate(self.waiting):
            if waiting:
                raise ValueError(f"{self.orphans[part]}: {', '.join(sorted(waiting)[:4])}")


def dequantizing(weights: Iterable[tuple[str, torch.Tensor]], qc: dict[str, Any],
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized weight replaced by its dequantized self."""
    if qc.get("quant_method") == "mxfp4":
        return _dequantizing_mxfp4(weights)
    return _dequantizing_fp8(weights, qc)


def _dequantizing_fp8(weights: Iterable[tuple[str, torch.Tensor]], qc: dict[str, Any],
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """FP8 weights times their scales; activation and KV-cache scales are dropped."""
    block = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
    pairs = _Pairs(("FP8 weight(s) without a scale", "weight scale(s) without an FP8 weight"))
    dropped = 0
    for name, t in weights:
        if name.endswith(_DROPPED):
            dropped += 1
            continue
        scale_suffix = next((s for s in _SCALES if name.endswith(s)), None)
        if scale_suffix is not None:
            base, part = name[:-len(scale_suffix)], 1
        elif t.dtype in FP8_DTYPES and name.endswith(".weight"):
            base, part = name[:-len(".weight")], 0
        elif t.dtype in FP8_DTYPES:
            raise ValueError(f"tensor {name!r} is FP8 but not a weight with a scale")
        else:
            yield name, t
            continue
        pair = pairs.add(base, part, t)
        if pair is not None:
            yield f"{base}.weight", dequantize(*pair, f"{base}.weight", block)
    pairs.check_complete()
    if dropped:
        logger.info("dropped %d activation / KV-cache scale tensors (weights are dequantized at load)", dropped)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code
_MXFP4_PARTS = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> bf16 [..., G * 32, rows] (see the module's
    docstring). bf16 holds every such value exactly (FP4 has one mantissa bit, E8M0 fp32's exponent range)."""
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "up ([..., rows, G, 16] and [..., rows, G])")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*scales.shape, 32, dtype=torch.bfloat16, device=blocks.device)
    flat_out, flat_blocks = out.view(-1, *out.shape[-3:]), blocks.reshape(-1, *blocks.shape[-3:])
    flat_scales = scales.reshape(-1, *scales.shape[-2:])
    for i in range(flat_out.shape[0]):  # one expert at a time: the fp32 temporaries stay small
        codes = flat_blocks[i].long()
        values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)  # [rows, G, 32]
        flat_out[i] = torch.ldexp(values, flat_scales[i].int().unsqueeze(-1) - 127)
    return out.flatten(-2).transpose(-2, -1)


def _dequantizing_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    pairs = _Pairs(("MXFP4 blocks without scales", "MXFP4 scales without blocks"))
    for name, t in weights:
        part = next((i for i, suffix in enumerate(_MXFP4_PARTS) if name.endswith(suffix)), None)
        if part is None:
            yield name, t
            continue
        base = name[:-len(_MXFP4_PARTS[part])]
        pair = pairs.add(base, part, t)
        if pair is not None:
            yield base, dequantize_mxfp4(*pair, base)
    pairs.check_complete()


# ---------------------------------------------------------------------------------------------------------------
# FP8 compute (W8A8): weights kept in FP8 with a scale per output channel, activations quantized per token as they
# come; the matmul is torch._scaled_mm (FP8 tensor cores on Hopper/Ada; a reference path on CPU, for tests).
# ---------------------------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight transposed to [in, out] column-major, as _scaled_mm takes it; float32 scales [1, out])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.t(), scale.view(1, -1)


def fp8_linear(x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] (bf16/fp16/fp32) times the FP8 weight: x quantized per row (token) with its own scale."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if x.is_cuda and rows % 16:  # cuBLASLt's FP8 matmul wants every dimension a multiple of 16: pad the tokens
        x2 = torch.cat([x2, x2.new_zeros(16 - rows % 16, x2.shape[1])])
    sx = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    xq = (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # (row-wise scaled FP8 matmuls on CUDA produce bf16 only)
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, weight_t, scale_a=sx, scale_b=scale, bias=bias, out_dtype=out_dtype)
    return y[:rows].to(x.dtype).view(*x.shape[:-1], weight_t.shape[1])


def fp8_supported(device: torch.device) -> bool:
    """Row-wise scaled FP8 matmuls (what fp8_linear runs) need compute capability 9.0+ (Hopper and later) on CUDA;
    on CPU torch has a (slow) reference, which the tests use."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
