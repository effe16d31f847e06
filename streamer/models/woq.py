"""Integer weight-only quantization (W4A16): GPTQ, AWQ and llm-compressor's pack-quantized checkpoints, and
`quantization="int4"` for any checkpoint.

A quantized linear stores small integer codes q, and per group of `group_size` input columns of each output row a
scale s and a zero point z: w = (q - z) * s. The three on-disk layouts, as the Hub ships them:
- GPTQ (AutoGPTQ / GPTQModel, `quant_method: "gptq"`): `X.qweight` int32 [in / (32 / bits), out], packed along
  the input dimension (value j of an int32 in bits [j * bits, (j + 1) * bits)); `X.qzeros` int32 [groups, out / (32 /
  bits)], packed along the output dimension, holding z - 1 in the original ("gptq", v1) format (z itself in
  "gptq_v2"); `X.scales` [groups, out]; `X.g_idx` int32 [in], each input column's group (act-order checkpoints,
  `desc_act`, assign columns to groups out of order).
- AWQ (AutoAWQ GEMM, `quant_method: "awq"`): `X.qweight` int32 [in, out / 8] and `X.qzeros` int32 [groups, out / 8],
  both packed along the output dimension in AWQ's interleaved order (the j-th nibble holds column
  [0, 2, 4, 6, 1, 3, 5, 7][j] of its eight); `X.scales` [groups, out].
- compressed-tensors `format: "pack-quantized"` (llm-compressor W4A16 / W8A16): `X.weight_packed` int32
  [out, in / (32 / bits)], packed along the input dimension, each value stored as its signed self + 2^(bits-1);
  `X.weight_scale` [out, groups]; `X.weight_zero_point` (asymmetric only) packed along the output dimension the same
  way; `X.weight_shape`; `X.weight_g_idx` (actorder "group").

Every layout is first unpacked to one form, `Unpacked` (codes [out, in], scale and zero [out, groups]). 4-bit
weights of the decoder's linears whose groups are contiguous then stay 4-bit: the layer multiplies with torch's
int4 kernels (`_weight_int4pack_mm_for_cpu` on CPU, tinygemm's `_weight_int4pack_mm` for bf16 on CUDA), a quarter
of bf16's memory and bandwidth (on CPU, a matmul of many rows dequantizes a chunk of the weight at a time and multiplies densely instead: `Int4Weight.matmul`); act-order groups are made contiguous by permuting the weight's input columns (and
the layer's input alike). Everything else (8-bit codes, MoE experts, layers whose shapes the kernels refuse) is
dequantized to the compute dtype as it loads.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

logger = logging.getLogger("streamer")

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes torch's int4 kernels take
_AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of eight sits in nibble _AWQ_COLUMN_NIBBLE[c]


@dataclass(frozen=True)
class IntQuant:
    """What a checkpoint's quantization_config says about its integer weights."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int
    group_size: int  # -1: one group per output row ("channel")
    sym: bool
    act_order: bool  # groups assigned by g_idx, not contiguous
    zero_minus_one: bool  # GPTQ v1 stores z - 1

    def parts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) tensor-name suffixes of one quantized linear."""
        if self.method == "gptq":
            return (".qweight", ".qzeros", ".scales"), (".g_idx",)
        if self.method == "awq":
            return (".qweight", ".qzeros", ".scales"), ()
        zp = () if self.sym else (".weight_zero_point",)
        return (".weight_packed", ".weight_scale", ".weight_shape") + zp, (".weight_g_idx",)


def parse_int_quant(qc: dict[str, Any]) -> Optional[IntQuant]:
    """The IntQuant of a GPTQ / AWQ / pack-quantized config (ValueError naming what streamer cannot load); None
    for other methods."""
    method = qc.get("quant_method")
    if method == "gptq":
        bits, group = qc.get("bits", 4), qc.get("group_size", 128)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported ('gptq' and 'gptq_v2' are)")
        _check_bits_group(bits, group)
        return IntQuant("gptq", bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
                        zero_minus_one=fmt == "gptq")
    if method == "awq":
        bits, group = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (the GEMM layout, 'gemm', is)")
        if bits != 4:
            raise ValueError(f"AWQ checkpoints with bits={bits!r} are not supported (4-bit ones are)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
        _check_bits_group(bits, group)
        return IntQuant("awq", 4, group, False, False, False)
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [(g or {}).get("weights") or {} for g in groups]
        if len(weights) != 1:
            raise ValueError(f"pack-quantized checkpoints with {len(weights)} config groups are not supported "
                             "(one group is)")
        w = weights[0]
        if w.get("type", "int") != "int":
            raise ValueError(f"pack-quantized weights of type {w.get('type')!r} are not supported (int ones are)")
        strategy = w.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ValueError(f"pack-quantized strategy {strategy!r} is not supported ('group' and 'channel' are)")
        bits, group = w.get("num_bits", 4), (w.get("group_size") if strategy == "group" else -1)
        _check_bits_group(bits, group)
        return IntQuant("compressed-tensors", bits, group, bool(w.get("symmetric", True)),
                        w.get("actorder") == "group", False)
    return None


def _check_bits_group(bits: Any, group: Any) -> None:
    if bits not in (4, 8):
        raise ValueError(f"{bits!r}-bit integer weights are not supported (4- and 8-bit ones are)")
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise ValueError(f"group_size must be a positive integer or -1 (one group per row), got {group!r}")


# ---------------------------------------------------------------------------------------------------------------
# Unpacking
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Unpacked:
    """One linear's weight as w[o, i] = (codes[o, i] - zero[o, g]) * scale[o, g], g = g_idx[i] (or i // group)."""

    codes: torch.Tensor  # uint8 [out, in]
    scale: torch.Tensor  # float32 [out, groups]
    zero: torch.Tensor  # float32 [out, groups], in code units
    g_idx: Optional[torch.Tensor] = None  # int64 [in]; None: contiguous groups

    def fits_int4(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether torch's int4 kernels take this (contiguous-group) weight."""
        out, cols = self.codes.shape
        groups = self.scale.shape[1]
        return int4_supported(out, cols, cols // groups if groups > 1 else -1, dtype, device)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        idx = self.g_idx if self.g_idx is not None else contiguous_groups(self.codes.shape[1], self.scale.shape[1])
        idx = idx.to(self.codes.device)
        return ((self.codes.float() - self.zero[:, idx]) * self.scale[:, idx]).to(dtype)


def contiguous_groups(cols: int, groups: int) -> torch.Tensor:
    """Each input column's group when `groups` groups take the columns in order."""
    return torch.arange(cols) // -(-cols // groups)


def _nibbles(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 values packed along `dim` (value j in bits [j * bits, (j + 1) * bits)) -> uint8 codes, that dim grown
    32 / bits times. (Right shifts of int32 are arithmetic: the mask drops the sign bits.)"""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).movedim(dim, -1)
    codes = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n, per]
    return codes.flatten(-2).movedim(-1, dim).to(torch.uint8)


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def unpack(iq: IntQuant, parts: dict[str, torch.Tensor], name: str) -> Unpacked:
    """One linear's checkpoint tensors (by suffix) in the canonical form."""
    mask = (1 << iq.bits) - 1
    if iq.method == "gptq":
        codes = _nibbles(parts[".qweight"], iq.bits, 0).t()  # [in, out] -> [out, in]
        zeros = _nibbles(parts[".qzeros"], iq.bits, 1).t().to(torch.int32)  # [groups, out] -> [out, groups]
        if iq.zero_minus_one:  # v1 stores z - 1, wrapping around: z = 0 reads back as 2^bits - 1
            zeros = (zeros + 1) & mask
        scale, g_idx = parts[".scales"].t(), parts.get(".g_idx")
    elif iq.method == "awq":
        order = torch.tensor(_AWQ_COLUMN_NIBBLE)

        def columns(p: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [out, rows], columns in order
            n = _nibbles(p, 4, 1)
            return n.view(n.shape[0], -1, 8)[:, :, order].flatten(1).t()
        codes, zeros = columns(parts[".qweight"]), columns(parts[".qzeros"]).to(torch.int32)
        scale, g_idx = parts[".scales"].t(), None
    else:
        out, cols = (int(v) for v in parts[".weight_shape"].tolist())
        codes = _nibbles(parts[".weight_packed"], iq.bits, 1)[:, :cols]
        scale, zp = parts[".weight_scale"], parts.get(".weight_zero_point")  # [out, groups]
        offset = 1 << (iq.bits - 1)  # stored = signed + offset, so w = (stored - (signed zero + offset)) * s
        if zp is None:  # symmetric
            zeros = torch.full(scale.shape, offset, dtype=torch.int32)
        elif zp.dtype == torch.int32 and zp.shape[0] == -(-out // (32 // iq.bits)):  # packed along the rows
            zeros = _nibbles(zp, iq.bits, 0)[:out].to(torch.int32)
        else:  # unpacked signed zero points
            zeros = zp.to(torch.int32) + offset
        g_idx = parts.get(".weight_g_idx")
    codes, scale, zero = codes.contiguous(), scale.float().contiguous(), zeros.float().contiguous()
    out, cols = codes.shape
    _check(scale.shape[0] == out and zero.shape == scale.shape, name,
           f"codes {tuple(codes.shape)}, scales {tuple(scale.shape)} and zeros {tuple(zero.shape)} "
           "(as [out, groups]) do not fit together")
    groups = scale.shape[1]
    if g_idx is not None:
        g_idx = g_idx.long()
        _check(g_idx.shape == (cols,) and int(g_idx.min()) >= 0 and int(g_idx.max()) < groups, name,
               f"g_idx must hold a group in [0, {groups}) for each of the {cols} input columns")
        if torch.equal(g_idx, contiguous_groups(cols, groups)):
            g_idx = None  # contiguous after all (what non-act-order GPTQ writes)
    if g_idx is None:
        _check(cols % groups == 0, name, f"{cols} input columns do not split into {groups} groups")
    return Unpacked(codes, scale, zero, g_idx)


def int_weights(weights: Iterable[tuple[str, torch.Tensor]], iq: IntQuant, dtype: torch.dtype,
                keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear `X` (its parts in any order, from any shard) replaced by
    either its 4-bit form, when keep(X) — `X.weight` (uint8 codes), `X.weight_scale`, `X.weight_zero` — or its
    dequantized `X.weight` in `dtype`."""
    required, optional = iq.parts()
    suffixes = required + optional
    waiting: dict[str, dict[str, torch.Tensor]] = {}

    def done(base: str) -> Iterator[tuple[str, torch.Tensor]]:
        u = unpack(iq, waiting.pop(base), base)
        if keep(base):
            # Act-order groups made contiguous: the layer permutes its input the same way (its `act_perm`).
            codes = u.codes if u.g_idx is None else u.codes[:, group_order(u.g_idx, u.scale.shape[1], base)]
            yield f"{base}.weight", codes
            yield f"{base}.weight_scale", u.scale
            yield f"{base}.weight_zero", u.zero
        else:
            yield f"{base}.weight", u.dequantize(dtype)

    for name, t in weights:
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None:
            yield name, t
            continue
        base = name[:-len(suffix)]
        got = waiting.setdefault(base, {})
        got[suffix] = t
        if len(got) == len(suffixes):
            yield from done(base)
    for base in sorted(waiting):  # those without their optional parts (older GPTQ files have no g_idx)
        missing = [s for s in required if s not in waiting[base]]
        if missing:
            raise ValueError(f"quantized weight {base!r} lacks {', '.join(base + s for s in missing)}")
        yield from done(base)


def group_order(g_idx: torch.Tensor, groups: int, name: str) -> torch.Tensor:
    """The input-column order that makes act-order groups contiguous (each group's columns in their own order).
    Act-order GPTQ gives every group the same number of columns; the kernels need that."""
    counts = torch.bincount(g_idx.long(), minlength=groups)
    _check(bool((counts == counts[0]).all()), name, "act-order groups of unequal sizes")
    return torch.argsort(g_idx.long(), stable=True)


# ---------------------------------------------------------------------------------------------------------------
# Computing with 4-bit weights
# ---------------------------------------------------------------------------------------------------------------

def quantize_rtn(w: torch.Tensor, group_size: int = 128) -> Unpacked:
    """Round-to-nearest asymmetric 4-bit quantization of a [out, in] weight, per group of input columns (what
    `quantization="int4"` does at load): each group's minimum and maximum land on codes 0 and 15."""
    out, cols = w.shape
    g = w.float().reshape(out, cols // group_size, group_size)
    lo, hi = g.amin(-1).clamp(max=0.0), g.amax(-1).clamp(min=0.0)  # (zero stays exactly representable)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    codes = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(out, cols)
    return Unpacked(codes, scale, zero)


def kernel_group(cols: int, group_size: int) -> Optional[int]:
    """The group size the int4 kernels run `cols`-wide rows with, for a checkpoint's `group_size` (-1: the whole
    row): the largest they take that divides both (a coarser group's scale repeats over its finer groups)."""
    size = cols if group_size == -1 else group_size
    return next((g for g in KERNEL_GROUPS if size % g == 0 and cols % g == 0), None)


# CPU: from this many rows on (prefill chunks, large batches), dequantizing the weight a chunk at a time (a compiled
# loop, ~0.3 ns a weight) and multiplying densely beats `_weight_int4pack_mm_for_cpu`, whose cost grows with every
# row: ~2x faster at 512 rows of bf16 (bench/RESULTS.md). Its fp32 path is ~30x slower a row than bf16's.
DEQUANT_ROWS = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 4}
_CHUNK_ROWS = 1024  # output rows dequantized at a time: a few MB of weights
_NIBBLES = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)


@functools.lru_cache(maxsize=None)
def cpu_int4_block() -> Optional[int]:
    """Output rows per block of torch's CPU int4 layout on this machine, read off a probe: torch packs for its
    kernel's vector width (64 rows with AVX-512, 32 with AVX2). Block b stores, for each input column k, `block / 2`
    bytes whose low nibbles are rows b*block .. + block/2 - 1 and high nibbles the block's other half. None if the
    layout is none of these (the kernel then takes every matmul)."""
    rows, cols = 128, 64
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2).view(torch.uint8).reshape(-1)
    for block in (64, 32, 16):
        q = (packed.view(rows // block, cols, 1, block // 2) >> _NIBBLES) & 15  # [blocks, cols, 2, block / 2]
        if torch.equal(q.reshape(rows // block, cols, block).permute(0, 2, 1).reshape(rows, cols), codes.byte()):
            return block
    return None


def _dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """W^T of some blocks of output rows from the CPU int4 layout (`cpu_int4_block`). packed: uint8 [blocks,
    cols * block / 2]; scales, zeros: [blocks, groups, block] (`Int4Weight.block_scales`). Returns [blocks, cols,
    block]."""
    blocks, groups, block = scales.shape
    group = packed.shape[1] * 2 // block // groups
    q = (packed.view(blocks, groups, group, 1, block // 2) >> _NIBBLES.to(packed.device)) & 15
    w = (q.reshape(blocks, groups, group, block).float() - 8) * scales[:, :, None].float() + zeros[:, :, None].float()
    return w.to(scales.dtype).view(blocks, groups * group, block)


_compiled_dequantize: Optional[Callable] = None
_compile_failed = False


def _dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Optional[torch.Tensor]:
    """`_dequantize_blocks` compiled into one fused loop (eager, it loses to the int4 kernel); None once compiling
    has failed (no C++ toolchain, an Inductor bug: said once). Static shapes: a model has a handful."""
    global _compiled_dequantize, _compile_failed
    if _compile_failed:
        return None
    if _compiled_dequantize is None:
        _compiled_dequantize = torch.compile(_dequantize_blocks, dynamic=False, fullgraph=True)
    dyn = torch._dynamo.config
    saved, dyn.recompile_limit = dyn.recompile_limit, max(dyn.recompile_limit, 64)
    try:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return _compiled_dequantize(packed, scales, zeros)
    except Exception as e:
        _compile_failed = True
        logger.warning("compiled 4-bit dequantization unavailable (%s: %s); the int4 kernel takes every matmul",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    finally:
        dyn.recompile_limit = saved


def copy_into(dst: "Int4Weight | Int8Weight", src: "Int4Weight | Int8Weight") -> None:
    """A weight quantized anew (new weights in place) copied into the tensors of the one it replaces, which the
    model's graphs read."""
    for f in fields(dst):
        old, new = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(old, torch.Tensor):
            assert isinstance(new, torch.Tensor) and new.shape == old.shape, f"{f.name} changed shape"
            old.copy_(new)
        else:
            assert not isinstance(new, torch.Tensor) and (f.name == "compile" or new == old), f"{f.name} changed"


@dataclass
class Int4Weight:
    """A linear's 4-bit weight in the layout of torch's int4 kernels: w = (q - 8) * s + m, per group of input
    columns (what the kernels call scale and zero: m = (8 - z) * s)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [groups, out, 2], the activations' dtype
    group_size: int
    out_features: int
    compile: bool = True  # whether many rows may take the compiled dequantization (False under enforce_eager)
    # CPU: scales and zeros again, [2, out / block, groups, block], laid out as the packed blocks are
    # (`cpu_int4_block`), for the dequantizing path (read through the kernels' [groups, out, 2], the dequantization
    # was ~100x slower); 1/16 of the 4-bit weight's bytes at 128-column groups
    block_scales: Optional[torch.Tensor] = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = None
        if x2.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        elif self.block_scales is not None and self.compile and x2.shape[0] >= DEQUANT_ROWS[x2.dtype]:
            y = self._dequantized_matmul(x2)
        if y is None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.block_scales)
                   if t is not None)

    def _dequantized_matmul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Many rows on CPU: the weight dequantized a chunk of output rows at a time (a few MB, never the whole
        matrix) and multiplied densely. None where the compiler is unavailable."""
        scales = self.block_scales
        assert scales is not None
        block = scales.shape[-1]
        cols, blocks, chunk = x.shape[1], self.out_features // block, max(_CHUNK_ROWS // block, 1)
        packed = self.packed.view(torch.uint8).reshape(blocks, cols * block // 2)
        parts = []
        for b in range(0, blocks, chunk):
            e = min(b + chunk, blocks)
            w_t = _dequantize(packed[b:e], scales[0, b:e], scales[1, b:e])  # [n, cols, block]
            if w_t is None:
                return None
            parts.append(x @ w_t.transpose(0, 1).reshape(cols, (e - b) * block))
        return torch.cat(parts, dim=1)


def int4_supported(out: int, cols: int, group_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's int4 kernels take this weight: rows a multiple of 16 (CPU) or 8 (CUDA), a group size they
    take; on CUDA bf16 activations only (tinygemm) and rows of a multiple of 32 input columns."""
    g = kernel_group(cols, group_size)
    if g is None:
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and out % 8 == 0 and cols % 32 == 0
    return device.type == "cpu" and out % 16 == 0 and dtype in (torch.float32, torch.bfloat16, torch.float16)


def pack_int4(u: Unpacked, dtype: torch.dtype, device: torch.device) -> Int4Weight:
    """The kernels' layout of a contiguous-group 4-bit weight (check `int4_supported` first)."""
    out, cols = u.codes.shape
    groups = u.scale.shape[1]
    g = kernel_group(cols, cols // groups if groups > 1 else -1)
    assert g is not None
    repeat = cols // groups // g  # a coarser checkpoint group: its scale and zero over each of its kernel groups
    scale = u.scale.repeat_interleave(repeat, 1).to(device)
    zero = u.zero.repeat_interleave(repeat, 1).to(device)
    sz = torch.stack([scale, (8 - zero) * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [groups, out, 2]
    codes = u.codes.to(device)
    if device.type == "cuda":
        tiles = next(t for t in (8, 4, 2) if cols % (t * 16) == 0)
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()  # two codes a byte, the even column high
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        block = cpu_int4_block()
        if block is not None and out % block == 0:  # (a partial block's layout is another: it keeps the kernel)
            blocks = sz.view(groups * repeat, out // block, block, 2).permute(3, 1, 0, 2).contiguous()
            return Int4Weight(packed, sz, g, out, block_scales=blocks)
    return Int4Weight(packed, sz, g, out)


# ---------------------------------------------------------------------------------------------------------------
# Computing with 8-bit weights (CPU)
# ---------------------------------------------------------------------------------------------------------------

# torch's `_weight_int8pack_mm` (one scale per output channel) beats oneDNN's bf16 matmul at one row by ~1.45x and
# loses from a few rows on, and in fp32 it loses everywhere (bench/RESULTS.md, session 11): more rows, and fp32,
# multiply by the codes converted to the activations' dtype (exact: |q| <= 128) and scale the output.
INT8_KERNEL_ROWS = 4
_INT8_CHUNK = 1024  # output rows converted at a time


@dataclass
class Int8Weight:
    """A linear's 8-bit weight, one scale per output channel: w = q * s, plus for asymmetric checkpoints a per-
    channel offset c: w = q * s + c, so y = (x q^T) * s + sum(x) * c."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], the activations' dtype
    offsets: Optional[torch.Tensor]  # [out], the activations' dtype; None when every zero point is the midpoint
    out_features: int
    compile: bool = True  # (unused: the interface Int4Weight's users set)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype == torch.bfloat16 and x2.shape[0] <= INT8_KERNEL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.codes, self.scales)
        else:
            y = torch.cat([x2 @ self.codes[i:i + _INT8_CHUNK].to(x2.dtype).t()
                           for i in range(0, self.out_features, _INT8_CHUNK)], dim=1) * self.scales
        if self.offsets is not None:
            y = y + x2.sum(-1, keepdim=True) * self.offsets
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)


def int8_supported(u: Unpacked, dtype: torch.dtype, device: torch.device) -> bool:
    """8-bit codes with one group per row (channel-wise) on CPU; grouped ones, and CUDA, are dequantized."""
    return device.type == "cpu" and u.scale.shape[1] == 1 and u.g_idx is None and \
        dtype in (torch.float32, torch.bfloat16, torch.float16)


def pack_int8(u: Unpacked, dtype: torch.dtype, device: torch.device) -> Int8Weight:
    """w = (q - z) * s with unsigned 8-bit codes q: q - 128 as int8, and the offset (128 - z) * s (None where
    every z is 128, as symmetric checkpoints store)."""
    codes = (u.codes.to(torch.int16) - 128).to(torch.int8).to(device)
    scale, zero = u.scale[:, 0], u.zero[:, 0]
    offsets = None if bool((zero == 128).all()) else ((128 - zero) * scale).to(device, dtype)
    return Int8Weight(codes.contiguous(), scale.to(device, dtype), offsets, codes.shape[0])


def quantize_rtn_int8(w: torch.Tensor) -> Unpacked:
    """Round-to-nearest symmetric 8-bit quantization per output channel (`quantization="int8"`): each row's
    largest magnitude lands on code 127 away from the midpoint 128."""
    scale = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
    codes = ((w.float() / scale).round().clamp(-127, 127) + 128).to(torch.uint8)
    return Unpacked(codes, scale, torch.full_like(scale, 128.0))
