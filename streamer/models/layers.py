"""Building blocks of the decoder: linear layers laid out for tensor parallelism, RMSNorm, rotary embedding.

Linear layers follow the Megatron split: a *column* layer splits its output features across ranks (q/k/v,
gate/up), a *row* layer splits its input features (o_proj, down_proj) and all-reduces its output. Packed layers
(qkv, gate_up) hold several checkpoint tensors in one parameter; each parameter carries a `weight_loader`
that copies one checkpoint tensor (or one shard of it) into the right rows. With tp_size == 1 the split is
the identity, so tensor parallelism only adds the collective, not a rewrite.
"""
from __future__ import annotations

import math
import os
import re
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import streamer_kernels as K
from streamer.models.lora_ops import add_lora, lora_add_
from streamer.models.quant import fp8_linear

if TYPE_CHECKING:
    from streamer.models.config import ModelConfig
from streamer.models.woq import (
    Int4Weight,
    Int8Weight,
    Unpacked,
    copy_into,
    int4_supported,
    int8_supported,
    kernel_group,
    pack_int4,
    pack_int8,
    quantize_rtn,
    quantize_rtn_int8,
)


class ParallelContext:
    """Which shard of each layer this process builds: rank `rank` of `size` (streamer/worker/parallel.py runs one
    process per rank). Read when layers are built and loaded; a layer keeps its own copy of `size`."""

    rank: int = 0
    size: int = 1
    # The ranks this one all-reduces with: its pipeline stage's (None: every rank, one stage). Read at each
    # all-reduce (`tp_all_reduce`), not kept by the layers.
    group: Any = None
    # vLLM's --enable-expert-parallel: sparse MoE layers (models/moe.py) place whole experts on the ranks instead of
    # a slice of every expert; everything else stays split as above. Meaningless with size 1.
    expert_parallel: bool = False
    # Pipeline parallelism: this rank's stage of `num_stages` (models/llama.py builds only its layers)
    stage: int = 0
    num_stages: int = 1


def stage_layers(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The decoder layers [lo, hi) that pipeline stage `stage` of `num_stages` runs: contiguous, the first stages
    one layer more when they do not divide, or as $STREAMER_PP_LAYER_PARTITION says (vLLM's
    VLLM_PP_LAYER_PARTITION: layers per stage, "5,7"; the same on every node)."""
    given = os.environ.get("STREAMER_PP_LAYER_PARTITION")
    if given:
        sizes = [int(n) for n in given.split(",")]
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"STREAMER_PP_LAYER_PARTITION={given!r}: {num_stages} positive layer counts adding up to "
                             f"the model's {num_layers} layers are needed")
        lo = sum(sizes[:stage])
        return lo, lo + sizes[stage]
    base, extra = divmod(num_layers, num_stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (stage < extra)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_holds(name: str, layers: tuple[int, int], first: bool, last: bool) -> bool:
    """Whether a pipeline stage holds the weight `name` (a checkpoint's name or the model's own): a decoder layer's
    if it is one of its `layers`; the embeddings and the LM head on the first stage (which samples); the final norm
    on the last; anything else on every stage."""
    m = _LAYER_INDEX.search(name)
    if m is not None:
        return layers[0] <= int(m.group(1)) < layers[1]
    bare = name.removeprefix("model.")
    if bare.startswith(("embed_tokens.", "lm_head.")):
        return first
    if bare.startswith("norm."):
        return last
    return True


def tp_all_reduce(t: torch.Tensor) -> None:
    """Sum `t` in place over this rank's tensor-parallel group (its pipeline stage's ranks)."""
    torch.distributed.all_reduce(t, group=ParallelContext.group)


def _check_shape(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    _check_shape(name, param, loaded)
    param.data.copy_(loaded)


def rank_rows_loader(param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
    """This rank's rows of a tensor split by rows over the ranks (per-head values of a column-parallel layer)."""
    n = param.shape[0]
    _check_shape(name, torch.empty(n * ParallelContext.size, *param.shape[1:], device="meta"), loaded)
    param.data.copy_(loaded[ParallelContext.rank * n:(ParallelContext.rank + 1) * n])


class PackableLinear(nn.Module):
    """A linear layer that can trade its plain weight for oneDNN's prepacked CPU layout after loading: 20-40%
    faster matmuls on CPU (bf16 and fp32, from one row to thousands), and the plain copy is freed."""

    weight: nn.Parameter
    packed: Optional[torch.Tensor] = None
    op_id: Optional[int] = None  # set by `pack_for_cpu(as_op=True)`: the matmul is the opaque `packed_linear` op
    lora: Any = None  # LoRAWeights (streamer/models/lora.py) when adapters are enabled
    lora_id: Optional[int] = None
    lora_op = False  # a compiled model adds the LoRA output through the opaque `lora_add_` op
    fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # FP8 compute: (weight [in, out], scales [1, out])
    qweight: Optional[Int4Weight | Int8Weight] = None  # 4- or 8-bit weight-only compute (models/woq.py)
    compute_dtype: Optional[torch.dtype] = None  # set while `weight` holds a checkpoint's 4- or 8-bit codes
    code_bits = 4

    def _add_weight(self, out: int, cols: int, bias: bool, bias_loader: bool = False) -> None:
        """`weight` [out, cols], loaded by this layer's `_load`, and `bias` [out] (None without one; `bias_loader`:
        split by `_load` too, else copied whole)."""
        self.weight = nn.Parameter(torch.empty(out, cols), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        if not bias:
            self.register_parameter("bias", None)
            return
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False)
        if bias_loader:
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
        default_weight_loader(param, loaded, name)

    act_perm: Optional[torch.Tensor] = None  # act-order 4-bit weights: the input-column order they are stored in
    # Never 4-bit or FP8: the weight is needed in float after loading (DeepSeek's kv_b_proj, absorbed into other
    # weights); a 4-bit checkpoint's codes are dequantized as they load
    keep_float = False

    def prepare_int4(self, group_size: int, order: Optional[torch.Tensor] = None, bits: int = 4) -> bool:
        """Load a checkpoint's 4-bit (or 8-bit) weight instead of a float one: `weight` becomes its uint8 codes,
        beside `weight_scale` and `weight_zero` per group of `group_size` input columns (-1: one group per row),
        each loaded and split over the ranks as the weight's rows or columns are; `finish_int4` packs them.
        `order`: an act-order checkpoint's input-column order (models/woq.group_order). False (and nothing
        changes) when this rank's columns would split a group, or hold a slice of an act-order input."""
        if self.keep_float:
            return False
        w = self.weight
        out, cols = w.shape
        if group_size != -1 and cols % group_size:
            return False
        if order is not None and self.tp_size > 1 and isinstance(self, RowParallelLinear):
            return False
        self.act_perm = None if order is None else order.to(w.device)
        groups = 1 if group_size == -1 else cols // group_size
        self.compute_dtype, self.code_bits = w.dtype, bits
        self.weight = nn.Parameter(torch.empty(out, cols, dtype=torch.uint8, device=w.device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out, groups, device=w.device), requires_grad=False)
        self.weight_zero = nn.Parameter(torch.empty(out, groups, device=w.device), requires_grad=False)
        for p in (self.weight, self.weight_scale, self.weight_zero):
            p.weight_loader = self._load  # type: ignore[attr-defined]
        return True

    def finish_int4(self) -> None:
        """Pack the loaded codes for the int4 (int8) kernels, or dequantize them where the kernels refuse the
        shape (or, on CUDA, a compute dtype other than bf16; 8-bit codes anywhere but on CPU)."""
        dtype = self.compute_dtype
        assert dtype is not None, "finish_int4 without prepare_int4"
        u = Unpacked(self.weight.data, self.weight_scale.data.float(), self.weight_zero.data.float())
        device = self.weight.device
        if self.code_bits == 8 and int8_supported(u, dtype, device):
            self.qweight = pack_int8(u, dtype, device)
        elif self.code_bits == 4 and u.fits_int4(dtype, device):
            self.qweight = pack_int4(u, dtype, device)
        if self.qweight is not None:
            self.out_features = u.codes.shape[0]
            self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
        else:
            self.weight = nn.Parameter(u.dequantize(dtype), requires_grad=False)
        del self.weight_scale, self.weight_zero
        self.compute_dtype = None

    def quantize_int4(self, group_size: int = 128, bits: int = 4) -> bool:
        """`quantization="int4"` (`"int8"`): round this layer's float weight to 4 bits (asymmetric, per group of
        input columns) or 8 (symmetric, per output channel) and compute with the int4 (int8) kernels. False (the
        weight stays) where they refuse the shape."""
        if self.qweight is not None or self.fp8 is not None:
            return self.qweight is not None
        if self.keep_float or self.packed is not None:
            return False
        w = self.weight.detach()
        out, cols = w.shape
        if bits == 8:
            u = quantize_rtn_int8(w)
            if not int8_supported(u, w.dtype, w.device):
                return False
            self.qweight = pack_int8(u, w.dtype, w.device)
        else:
            group = kernel_group(cols, group_size)
            if group is None or not int4_supported(out, cols, group, w.dtype, w.device):
                return False
            self.qweight = pack_int4(quantize_rtn(w, group), w.dtype, w.device)
        self.out_features, self.in_features = out, cols
        self.weight.data = w.new_empty(0)
        return True

    def quantize_fp8(self) -> None:
        """Keep the weight in FP8 (half of bf16's memory and bandwidth) with a scale per output channel; the plain
        weight is freed (models/quant.py)."""
        from streamer.models.quant import quantize_weight_fp8
        if self.keep_float:
            return
        if self.packed is not None:
            raise RuntimeError("quantize_fp8 needs the plain weight; this layer's is prepacked for oneDNN")
        self.out_features, self.in_features = self.weight.shape
        self.fp8 = quantize_weight_fp8(self.weight.detach())
        self.weight.data = self.weight.data.new_empty(0)

    def pack_for_cpu(self, as_op: bool = False) -> None:
        """as_op: a compiled model calls the packed matmul through a custom op, so that no weight is part of its
        graphs (Inductor cannot lower a packed weight unless it freezes the graph, and a frozen graph cannot go
        in its on-disk cache)."""
        if self.fp8 is not None:
            return  # FP8 weights run through _scaled_mm
        if self.packed is None and self.qweight is None and self.weight.numel() == 0:
            return  # a weight freed after loading, never run (DeepSeek's absorbed kv_b_proj)
        if self.packed is None and self.qweight is None:  # (4-/8-bit weights are in their kernels' layout)
            self.out_features, self.in_features = self.weight.shape
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
            self.weight.data = self.weight.data.new_empty(0)  # (nothing else reads it; `unpack_for_load` restores)
        if as_op and self.op_id is None:
            _packed_layers.append(weakref.ref(self))  # weak: an engine's weights die with its model
            self.op_id = len(_packed_layers) - 1

    def unpack_for_load(self) -> bool:
        """Give a layer whose float weight was packed or quantized after loading (`pack_for_cpu`, `quantize_int4`,
        `quantize_fp8`) a plain weight again for a loader to fill (new weights in place); True if it had one
        (then `repack` after the load). Not for a checkpoint's own codes (`prepare_int4`)."""
        if self.packed is None and self.qweight is None and self.fp8 is None:
            return False
        self.weight.data = self.weight.data.new_empty(self.out_features, self.in_features)
        return True

    def repack(self) -> None:
        """Derive from the new plain weight what `unpack_for_load` set aside: pack it again, or quantize it again
        into the same tensors (compiled graphs and CUDA graphs keep reading their memory)."""
        if self.qweight is not None:
            old, self.qweight = self.qweight, None
            done = self.quantize_int4(bits=8 if isinstance(old, Int8Weight) else 4)
            assert done, "a weight quantized once quantizes again"
            copy_into(old, self.qweight)
            self.qweight = old
        elif self.fp8 is not None:
            old_fp8, self.fp8 = self.fp8, None
            self.quantize_fp8()
            assert self.fp8 is not None
            for dst, src in zip(old_fp8, self.fp8):
                dst.copy_(src)
            self.fp8 = old_fp8
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
            self.weight.data = self.weight.data.new_empty(0)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.op_id is not None:
            return packed_linear(x, self.op_id, bias is not None)  # adds the LoRA output itself
        if self.qweight is not None:
            y = self.qweight.matmul(x if self.act_perm is None else x.index_select(-1, self.act_perm))
            if bias is not None:
                y = y + bias
        elif self.fp8 is not None:
            y = fp8_linear(x, *self.fp8, bias)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None:
            if self.lora_op:
                lora_add_(y, x, self.lora_id)
            else:
                add_lora(y, x, self.lora)
        return y


_packed_layers: list[weakref.ref[PackableLinear]] = []


# Defined through torch.library.Library rather than @custom_op: its per-call Python overhead is ~8 us instead of
# ~26 us (measured on a 64x64 matmul), and a compiled decode step makes four of these calls per layer.
_lib = torch.library.Library("streamer", "FRAGMENT")
_lib.define("packed_linear(Tensor x, int layer, bool with_bias) -> Tensor")


def _packed_linear(x: torch.Tensor, layer: int, with_bias: bool) -> torch.Tensor:
    m = _packed_layers[layer]()
    assert m is not None, "packed_linear called for a layer whose model is gone"
    if m.qweight is not None:  # (behind the op, its choice of kernel by row count is no guard of the graph's)
        y = m.qweight.matmul(x if m.act_perm is None else x.index_select(-1, m.act_perm))
        if with_bias:
            y = y + m.bias
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias if with_bias else None, "none", [], "")
    if m.lora is not None:
        add_lora(y, x, m.lora)
    return y


_lib.impl("packed_linear", _packed_linear, "CPU")
packed_linear = torch.ops.streamer.packed_linear.default


@torch.library.register_fake("streamer::packed_linear")
def _(x: torch.Tensor, layer: int, with_bias: bool) -> torch.Tensor:
    m = _packed_layers[layer]()
    assert m is not None
    return x.new_empty((*x.shape[:-1], m.out_features))


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class ColumnParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's output rows split across ranks. `output_sizes` lists the packed sub-matrices."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_names: Optional[Sequence[Any]] = None, replicable: bool = False) -> None:
        super().__init__()
        tp = ParallelContext.size
        self.tp_rank, self.tp_size = ParallelContext.rank, tp  # (LoRA slots are filled after the build)
        self.replicable = replicable  # checkpoint tensors may be narrower than tp shards (replicated kv heads)
        for s in output_sizes:
            if s % tp:
                raise ValueError(f"output size {s} is not divisible by tensor_parallel_size {tp}")
        self.output_sizes = [s // tp for s in output_sizes]
        self.shard_names = list(shard_names) if shard_names is not None else list(range(len(output_sizes)))
        self._add_weight(sum(self.output_sizes), input_size, bias, bias_loader=True)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
        idx = 0 if shard is None else self.shard_names.index(shard)
        offset, size, rows = self.shard_rows(idx, loaded, name, param.shape[1:])
        param.data[offset:offset + size].copy_(rows)

    def shard_rows(self, idx: int, loaded: torch.Tensor, name: str, cols: Optional[torch.Size] = None,
                   ) -> tuple[int, int, torch.Tensor]:
        """Sub-matrix `idx` of a checkpoint tensor (all ranks' rows): (its offset in this rank's rows, how many,
        this rank's rows). `cols`: the trailing shape it must have (None: any; LoRA's B has its own)."""
        size = self.output_sizes[idx]
        offset = sum(self.output_sizes[:idx])
        rank, tp = self.tp_rank, self.tp_size
        # A sub-matrix may hold fewer chunks than ranks: k/v with fewer kv heads than ranks, replicated so that
        # consecutive ranks share one (rank r takes chunk r // (tp / chunks)).
        chunks = loaded.shape[0] // size if size else 0
        if (chunks < 1 or loaded.shape[0] % size or tp % chunks or (chunks != tp and not self.replicable)
                or (cols is not None and loaded.shape[1:] != cols)):
            expected = (size * tp, *(loaded.shape[1:] if cols is None else cols))
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")
        chunk = rank // (tp // chunks)
        return offset, size, loaded[chunk * size:(chunk + 1) * size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ReplicatedLinear(PackableLinear):
    """y = x W^T (+ b) with the whole weight on every rank (small projections every rank needs all of, such as
    DeepSeek's latent down-projections). A PackableLinear: it packs for oneDNN, goes FP8 or 4-bit like the others."""

    tp_size = 1  # (read by prepare_int4: nothing of this layer is split)

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self._add_weight(output_size, input_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class RowParallelLinear(PackableLinear):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced (reduce=False: left to
    the caller, who sums several such outputs first, e.g. a token's routed experts; the bias is then rank 0's)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce: bool = True) -> None:
        super().__init__()
        tp = ParallelContext.size
        if input_size % tp:
            raise ValueError(f"input size {input_size} is not divisible by tensor_parallel_size {tp}")
        self.reduce = reduce
        self.tp_rank, self.tp_size = ParallelContext.rank, tp
        self.input_size = input_size // tp
        self._add_weight(output_size, self.input_size, bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
        rank, n = ParallelContext.rank, param.shape[1]  # (the weight's columns, or a 4-bit weight's groups)
        if n == 1 and loaded.dim() == 2 and loaded.shape == param.shape:
            param.data.copy_(loaded)  # one scale for a whole row: every rank's
            return
        _check_shape(name, torch.empty(param.shape[0], n * ParallelContext.size, device="meta"), loaded)
        param.data.copy_(loaded[:, rank * n:(rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.tp_size > 1 and self.reduce:  # each rank multiplied its slice of the input features: sum them
            tp_all_reduce(y)
        return y if self.bias is None or (not self.reduce and self.tp_rank) else y + self.bias


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class KernelSwitch:
    """Modules with a Triton kernel in `streamer_kernels` (RMSNorm, rotary, SiLU-and-mul) call it when
    `use_kernel` is set: on the Triton attention backend when the model runs uncompiled. Compiled, Inductor fuses
    the torch ops itself (and across them), which a kernel call would only get in the way of."""

    use_kernel = False


class RMSNorm(nn.Module, KernelSwitch):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.use_kernel:
            if residual is None:
                return K.rms_norm(x, self.weight, self.eps)
            return K.fused_add_rms_norm(x, residual, self.weight, self.eps)
        # Normalise in fp32 as HF does, then cast back before scaling by the weight.
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)


class LayerNorm(nn.Module):
    """nn.LayerNorm's computation (weight and bias, in the input's dtype), for the families that use it (StarCoder2,
    GPT-NeoX, Phi, StableLM, GPTBigCode, Phi-3.5-MoE, Falcon, GPT-J, OPT, Nemotron). With `residual`, adds it first and
    returns (normed, sum), as RMSNorm's fused add-and-norm does, so the Llama decoder can take either. `affine` False:
    no weight nor bias (OLMo's, OPT's `layer_norm_elementwise_affine: false`)."""

    def __init__(self, size: int, eps: float, affine: bool = True, bias: bool = True) -> None:
        """`bias` False: a weight but no bias (ModernBERT's `norm_bias: false`)."""
        super().__init__()
        self.eps = eps
        self.size = size
        self.weight: Optional[nn.Parameter] = None
        self.bias: Optional[nn.Parameter] = None
        if affine:
            self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
            if bias:
                self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)

    def scale(self) -> Optional[torch.Tensor]:
        """The multiplier applied after normalising (Nemotron's LayerNorm1P stores it less one)."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = F.layer_norm(x, (self.size,), self.scale(), self.bias, self.eps)
        return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# hidden_act -> F.gelu's `approximate`, as transformers' ACT2FN computes them (gelu_new, gelu_fast and
# gelu_pytorch_tanh are all the tanh approximation, written differently)
GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def gelu_approximate(cfg: ModelConfig, default: str, key: str = "hidden_act") -> str:
    """F.gelu's `approximate` for the config's activation (`key`: GPTBigCode's is activation_function)."""
    act = cfg.raw.get(key) or default
    if act not in GELU_APPROXIMATE:
        raise ValueError(f"{cfg.architecture} with {key} {act!r} is not supported "
                         f"({', '.join(GELU_APPROXIMATE)} are)")
    return GELU_APPROXIMATE[act]


# ---------------------------------------------------------------------------------------------- rotary
def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): low frequencies (wavelengths beyond the pretraining length)
    are interpolated by `factor`, high ones kept, the band between (set by beta_fast / beta_slow rotations) ramps
    linearly; returns (inv_freq, attention factor that scales cos and sin)."""
    factor = s.get("factor") or s["max_position_embeddings"] / s["original_max_position_embeddings"]
    original = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (as transformers: no zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it by factor)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep, float(attn)


def build_cos_sin_cache(rotary_dim: int, max_positions: int, theta: float,
                        scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """[max_positions, rotary_dim] = cat(cos, sin) over the rotary_dim/2 frequencies, in fp32 (YaRN: times its
    attention factor). rotary_dim is the head size, or less with partial rotary (as transformers, every frequency
    and YaRN's ramp are computed over it). LongRoPE: two tables stacked, [2 * max_positions, rotary_dim]: the short
    factors' rows, then the long factors' (see RotaryEmbedding)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = (scaling or {}).get("rope_type", "default")
    pos = torch.arange(max_positions, dtype=torch.float32)
    if kind in ("longrope", "su"):
        s = scaling or {}
        original = s["original_max_position_embeddings"]
        factor = s.get("factor") or s["max_position_embeddings"] / original
        attn = s.get("attention_factor") or (1.0 if factor <= 1.0 else
                                             math.sqrt(1 + math.log(factor) / math.log(original)))
        tables = []
        for ext in (s["short_factor"], s["long_factor"]):
            if len(ext) != rotary_dim // 2:
                raise ValueError(f"LongRoPE factors have {len(ext)} entries, expected rotary_dim / 2 = "
                                 f"{rotary_dim // 2}")
            freqs = torch.outer(pos, 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** exponents))
            tables.append(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attn)
        return torch.cat(tables)
    attn = 1.0
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    elif kind == "linear":
        pos = pos / scaling["factor"]  # type: ignore[index]
    elif kind == "yarn":
        inv_freq, attn = _yarn_inv_freq(rotary_dim, theta, scaling)  # type: ignore[arg-type]
    elif kind == "proportional":  # (Gemma 4's global layers: the first share of the frequencies turn, the rest not)
        turning = int(float(scaling.get("partial_rotary_factor", 1.0)) * rotary_dim // 2)  # type: ignore[union-attr]
        inv_freq[turning:] = 0.0
        inv_freq = inv_freq / float(scaling.get("factor", 1.0))  # type: ignore[union-attr]
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope, "
                         "proportional, yarn)")
    freqs = torch.outer(pos, inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table if attn == 1.0 else table * attn


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox layout (rotate halves), as HF's Llama/Qwen/Mistral. x: [T, H, D]; cos/sin: [T, R/2]: the first R dims
    of each head rotate, the other D - R pass unchanged (partial rotary, Phi-4-mini; R = D otherwise)."""
    d = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :d], xf[..., d:2 * d], xf[..., 2 * d:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J layout (Llama 4's complex pairs): dims (2i, 2i + 1) rotate together by frequency i, as the complex
    number x[2i] + j x[2i+1] times e^(j theta_i). Shapes as `apply_rotary`'s."""
    d = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., 0:2 * d:2], xf[..., 1:2 * d:2], xf[..., 2 * d:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module, KernelSwitch):
    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict[str, Any]], is_neox: bool = True) -> None:
        """rotary_dim: the leading dims of each head that rotate (ModelConfig.rotary_dim); the table is that wide.
        is_neox: dims i and i + rotary_dim / 2 rotate together (most families); False: the GPT-J layout, dims 2i and
        2i + 1 (Llama 4)."""
        super().__init__()
        self.is_neox = is_neox
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(rotary_dim, max_positions, theta, scaling),
                             persistent=False)
        # LongRoPE (Phi-3 long-context): a sequence longer than the pretraining length rotates with the long
        # factors, found `long_offset` rows further down the table: the runner adds the offset to the positions
        # of such sequences' tokens (as transformers decides: by the sequence's length when the token is computed).
        kind = (scaling or {}).get("rope_type")
        self.long_threshold: Optional[int] = (scaling or {}).get("original_max_position_embeddings") \
            if kind in ("longrope", "su") else None
        self.long_offset = max_positions
        self.register_buffer("mrope_select", None, persistent=False)

    def use_mrope(self, section: list[int], interleaved: bool = False) -> None:
        """M-RoPE (Qwen2-VL): positions may come as [3, T] (temporal, height, width); frequency i takes its angle
        from the row its section names (the sections split the rotary_dim / 2 frequencies in order).
        interleaved (Qwen3-VL, transformers' Qwen3VLTextRotaryEmbedding): the frequencies cycle t, h, w instead,
        frequency 3j + 1 taking the height for j < section[1], 3j + 2 the width for j < section[2], every other
        one (the tail included) the temporal position."""
        half = self.cos_sin_cache.shape[-1] // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must add up to rotary_dim / 2 = {half}")
        if len(section) != 3:
            raise ValueError(f"mrope_section {section} must have 3 parts (temporal, height, width)")
        if interleaved:
            i = torch.arange(half)
            rows = torch.zeros(half, dtype=torch.int64)
            rows[(i % 3 == 1) & (i < 3 * section[1])] = 1
            rows[(i % 3 == 2) & (i < 3 * section[2])] = 2
        else:
            rows = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("mrope_select", rows.to(self.cos_sin_cache.device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        rotate = apply_rotary if self.is_neox else apply_rotary_interleaved
        if positions.dim() == 2:  # [3, T] M-RoPE positions (steps with image tokens only: eager, torch maths)
            cos, sin = self._mrope_cos_sin(positions)
            return rotate(q, cos, sin), rotate(k, cos, sin)
        if self.use_kernel:
            return K.rotary_embedding(positions, q, k, self.cos_sin_cache, is_neox=self.is_neox)
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def _mrope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mrope_select is None:
            raise ValueError("[3, T] positions need M-RoPE (use_mrope)")
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [3, T, R/2] each
        idx = self.mrope_select.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return cos.gather(0, idx)[0], sin.gather(0, idx)[0]


WeightLoader = Callable[..., None]
