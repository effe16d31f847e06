"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek; Qwen2-MoE, OLMoE, Granite MoE, ERNIE 4.5 MoE,
Hunyuan MoE and Phi-3.5-MoE in their own modules): a router picks each token's top-k experts; their SwiGLU outputs,
weighted by the router's probabilities, are summed. gpt-oss (models/gpt_oss.py) adds biases (router, experts) and its
clamped SwiGLU (`activation="swiglu_oai"`); DeepSeek (models/deepseek.py, reused by GLM-4.5), ERNIE, Hunyuan and
Phi-3.5-MoE their own routers (`route`); several families add shared experts around `forward`. `unfuse_experts`
splits a checkpoint's fused experts (transformers 5's layout, Granite MoE's) into the per-expert names the loader reads.

The experts' weights are stacked, [E, 2 * I, H] (gate and up; [E, I, H] for an ungated activation, Nemotron-H's
relu2) and [E, H, I] (down), and split over tensor-parallel
ranks along I, as a dense MLP's are (each rank holds a slice of every expert; the partial sums are all-reduced).
With expert parallelism (`ParallelContext.expert_parallel`, vLLM's --enable-expert-parallel) they are split along E
instead: rank r of T holds whole experts [r*E//T, (r+1)*E//T) (a balanced split: counts differ by at most one where
T does not divide E), every rank routes every token with the whole router, runs only its own experts (the others'
(token, expert) pairs are skipped, their weights zeroed) and the partial sums are all-reduced as before.
Which experts a step uses depends on the data, so the expert computation is one opaque custom op: torch.compile
captures the rest of the model whole. On a GPU the op is `streamer_kernels.fused_moe` (two grouped GEMM launches over
the step's (token, expert) pairs sorted by expert, no host sync, so MoE decode batches replay as CUDA graphs); on the
CPU it groups the step's tokens by expert and runs one matmul per expert that has any.
"""
from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

import streamer_kernels as K
from streamer.models.layers import ParallelContext, tp_all_reduce
from streamer.models.woq import Int4Weight, Unpacked, copy_into, int4_supported, kernel_group, pack_int4, quantize_rtn
from streamer_kernels.reference import expert_activation

logger = logging.getLogger("streamer")

# One expert's matrix in a checkpoint: Qwen3-MoE's and DeepSeek's `mlp.experts.E.{gate,up,down}_proj`, Mixtral's
# `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down); a 4-bit one's codes come with `weight_scale` and
# `weight_zero` (models/woq.py).
EXPERT_WEIGHT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                           r"\.weight(_scale|_zero)?$")
INT4_PARTS = ("w13", "w2", "w13_scale", "w13_zero", "w2_scale", "w2_zero")  # a 4-bit layer's loaded parameters
EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# A layer's experts stored fused: transformers 5's layout (`mlp.experts.gate_up_proj` [E, 2I, H], each expert's gate
# rows then its up rows, and `mlp.experts.down_proj` [E, H, I]), which Granite MoE's Hub checkpoints also use under
# `block_sparse_moe.input_linear.weight` / `output_linear.weight`.
FUSED_EXPERTS = re.compile(r"^(.*)\.(mlp|block_sparse_moe)\.(?:experts\.(gate_up_proj|down_proj)"
                           r"|(input_linear|output_linear)\.weight)$")


def unfuse_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with any layer's fused experts (FUSED_EXPERTS, gate rows before up rows) split into the
    per-expert names EXPERT_WEIGHT reads (`<prefix>.<mlp|block_sparse_moe>.experts.E.gate_proj.weight`, ...), so
    that they load (and split over ranks) as the Hub's per-expert layout does. Names paired with anything but a
    tensor (the loader's name-only passes) go through unchanged."""
    for name, t in weights:
        m = FUSED_EXPERTS.match(name)
        if m is None or not isinstance(t, torch.Tensor):
            yield name, t
            continue
        prefix, block, kind, granite = m.groups()
        up_kind = (kind or granite) in ("gate_up_proj", "input_linear")
        if t.dim() != 3 or (up_kind and t.shape[1] % 2):
            raise ValueError(f"fused experts {name!r} have shape {tuple(t.shape)}: expected "
                             + ("[experts, 2 * I, hidden]" if up_kind else "[experts, hidden, I]"))
        for e in range(t.shape[0]):
            if up_kind:
                gate, up = t[e].chunk(2, dim=0)
                yield f"{prefix}.{block}.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.{block}.experts.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{block}.experts.{e}.down_proj.weight", t[e]


def _expert_loop(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                 expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's k experts e of weight * expert(e, its rows of x), one call per expert that has tokens,
    in expert order, accumulated in x's dtype; ids >= num_experts (other ranks' experts) are skipped. A lone token
    (single-stream decode) skips the sort, the count and the scatter (~0.1 ms a layer on the CPU), with the same
    sums in the same order."""
    if x.shape[0] == 1:
        out = None
        for e, j in sorted(zip(topk_ids[0].tolist(), range(topk_ids.shape[1]))):
            if e >= num_experts:  # another rank's expert (expert parallelism: `SparseMoE.local_ids`)
                continue
            y = (expert(e, x) * topk_weights[0, j]).to(x.dtype)
            out = y if out is None else out + y
        return out if out is not None else torch.zeros_like(x)
    return _scattered(x, topk_weights, topk_ids, num_experts, expert)


def _scattered(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`_expert_loop` for any number of tokens: each expert's tokens gathered, its outputs scattered back."""
    out = torch.zeros_like(x)
    for e, sel, rows in _by_expert(topk_ids, num_experts):
        out.index_add_(0, rows, (expert(e, x[rows]) * topk_weights.reshape(-1)[sel].unsqueeze(-1)).to(x.dtype))
    return out


def _by_expert(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert that has tokens: (expert, its (token, slot) pairs' flat indices, their tokens). Ids past
    num_experts (other ranks' experts, which sort last) are left out."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort()
    token_of = order // k
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]):
        if n:
            yield e, order[start:start + n], token_of[start:start + n]
            start += n


_fused_moe_unbuildable = False  # set when Triton cannot build the kernels here: the torch path serves from then on


def _triton_build_errors() -> tuple[type[Exception], ...]:
    """Triton's failures to build a kernel (a compiler error, or a shared-memory limit this GPU does not meet)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    return CompilationError, OutOfResources


def _give_up_fused_moe(error: Exception) -> None:
    """Say once that the fused MoE kernels cannot be built here, and take the torch path for good."""
    global _fused_moe_unbuildable
    _fused_moe_unbuildable = True
    logger.warning("fused MoE kernels unavailable (%s: %s); running the experts one at a time",
                   type(error).__name__, str(error).splitlines()[0] if str(error) else "")


@torch.library.custom_op("streamer::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, b13: Optional[torch.Tensor] = None, activation: str = "silu",
                alpha: float = 1.0, limit: float = 0.0, fused: bool = False) -> torch.Tensor:
    """sum over a token's k experts e of weight * down_e(act(gate_e(x), up_e(x))). x [T, H]; ids/weights [T, k];
    b13 [E, 2I]: the gate/up biases (the down bias is the caller's: see SparseMoE.forward). fused: through
    streamer_kernels' grouped GEMM kernels (no per-expert loop, no host sync: CUDA-graph safe) where Triton runs."""
    if w13.shape[0] and x.device.type != "cpu":  # (other ranks' experts, zero-weighted, index a real one here)
        topk_ids = topk_ids.clamp(max=w13.shape[0] - 1)
    if fused and K.use_triton(x) and not _fused_moe_unbuildable:
        try:
            return K.fused_moe(x, w13, w2, topk_weights, topk_ids, b13, activation, alpha, limit)
        except _triton_build_errors() as e:
            _give_up_fused_moe(e)
    tokens, k = topk_ids.shape
    # Few tokens (decode) on a GPU without the fused kernels: gather their experts' weights, no per-expert loop (and
    # no host sync). On the CPU the gather's copy costs more than the loop: 2.5x slower for 1-4 tokens, top-2 of 8
    # experts of 768 x 512.
    if tokens * k <= w13.shape[0] and x.device.type != "cpu":
        flat = topk_ids.reshape(-1)
        h = torch.bmm(w13[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
        if b13 is not None:
            h = h + b13[flat]
        y = torch.bmm(w2[flat], expert_activation(h, activation, alpha, limit).unsqueeze(-1)).squeeze(-1)
        return (y.view(tokens, k, -1) * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = F.linear(rows, w13[e], None if b13 is None else b13[e])
        return F.linear(expert_activation(h, activation, alpha, limit), w2[e])
    return _expert_loop(x, topk_weights, topk_ids, w13.shape[0], expert)


@moe_experts.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
      b13: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.0,
      limit: float = 0.0, fused: bool = False) -> torch.Tensor:
    return torch.empty_like(x)


_int4_layers: list[weakref.ref["SparseMoE"]] = []  # the op takes its layer by index: Int4Weights are not tensors


@torch.library.custom_op("streamer::moe_experts_int4", mutates_args=())
def moe_experts_int4(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """moe_experts with 4-bit experts: one int4 matmul pair per expert that has tokens (a lone token's int4
    matmul is cheap: it reads a quarter of the bytes)."""
    m = _int4_layers[layer]()
    assert m is not None and m.int4 is not None, "moe_experts_int4 called for a layer that is gone"
    w13, w2 = m.int4

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = w13[e].matmul(rows)
        if m.w13_bias is not None:
            h = h + m.w13_bias[e]
        return w2[e].matmul(expert_activation(h, m.activation, m.alpha, m.limit))
    return _expert_loop(x, topk_weights, topk_ids, m.local_experts, expert)


@moe_experts_int4.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


_packed_moe_layers: list[weakref.ref["SparseMoE"]] = []  # as _int4_layers: oneDNN-packed experts by layer


@torch.library.custom_op("streamer::moe_experts_packed", mutates_args=())
def moe_experts_packed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """moe_experts with each expert's matrices prepacked for oneDNN (CPU, `SparseMoE.pack_for_cpu`): one packed
    matmul pair per expert that has tokens."""
    m = _packed_moe_layers[layer]()
    assert m is not None and m.cpu_packed is not None, "moe_experts_packed called for a layer that is gone"
    w13, w2 = m.cpu_packed

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = torch.ops.mkldnn._linear_pointwise(rows, w13[e], None if m.w13_bias is None else m.w13_bias[e],
                                               "none", [], "")
        act = expert_activation(h, m.activation, m.alpha, m.limit)
        return torch.ops.mkldnn._linear_pointwise(act, w2[e], None, "none", [], "")
    return _expert_loop(x, topk_weights, topk_ids, m.local_experts, expert)


@moe_experts_packed.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


class SparseMoE(nn.Module):
    # gpt-oss's (models/gpt_oss.py sets them): per-expert biases of gate/up [E, 2I] and down [E, H], the activation
    w13_bias: Optional[nn.Parameter]
    w2_bias: Optional[nn.Parameter]
    activation, alpha, limit = "silu", 1.0, 0.0

    int4: Optional[tuple[list[Int4Weight], list[Int4Weight]]] = None  # 4-bit experts (gate/up, down), packed
    int4_id: Optional[int] = None
    # CPU: each expert's gate/up and down matrices prepacked for oneDNN (`pack_for_cpu`); w13 / w2 then empty
    cpu_packed: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
    packed_id: Optional[int] = None
    compute_dtype: Optional[torch.dtype] = None  # set while w13 / w2 hold a checkpoint's 4-bit codes
    fused_kernel = False  # float experts through streamer_kernels.fused_moe: set on the Triton backend (GPU)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, fp32_weights: bool = False, router_bias: bool = False) -> None:
        """`fp32_weights`: scale the experts' outputs by the router's fp32 weights (Mixtral) rather than by weights
        cast to the model's dtype first (Qwen3-MoE), as each model's reference does."""
        super().__init__()
        self.fp32_weights = fp32_weights
        tp, rank = ParallelContext.size, ParallelContext.rank
        self.tp_size = tp  # (the partial sums are all-reduced whenever tp > 1, whichever way the experts split)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.expert_parallel = ParallelContext.expert_parallel and tp > 1
        if self.expert_parallel:  # whole experts per rank, a balanced split; I is not split
            if num_experts < tp:
                raise ValueError(f"expert parallelism: {num_experts} experts (the config's number of experts) "
                                 f"cannot be spread over {tp} ranks (at least one each)")
            self.expert_start = rank * num_experts // tp
            self.local_experts = (rank + 1) * num_experts // tp - self.expert_start
            self.inter_split, self.inter_rank = 1, 0
        else:
            if intermediate_size % tp:
                raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by {tp} ranks "
                                 "(--enable-expert-parallel places whole experts on ranks instead)")
            self.expert_start, self.local_experts = 0, num_experts
            self.inter_split, self.inter_rank = tp, rank
        self.inter = intermediate_size // self.inter_split
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)  # the router, whole on every rank
        self.gate.requires_grad_(False)
        n = self.local_experts
        self.w13 = nn.Parameter(torch.empty(n, (2 if self.gated else 1) * self.inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, self.inter), requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.register_parameter("w13_bias", None)
        self.register_parameter("w2_bias", None)

    @property
    def gated(self) -> bool:
        """Whether an expert's first matrix is a gate and an up projection (w13 [E, 2I, H]) or an up one alone."""
        return self.activation != "relu2"

    @property
    def expert_range(self) -> range:
        """The (checkpoint's) experts this rank holds: all of them unless expert-parallel."""
        return range(self.expert_start, self.expert_start + self.local_experts)

    def local_expert(self, e: int) -> Optional[int]:
        """Checkpoint expert `e`'s index in this rank's stacked weights; None where another rank holds it."""
        e -= self.expert_start
        return e if 0 <= e < self.local_experts else None

    def local_rows(self, loaded: torch.Tensor, name: str = "") -> torch.Tensor:
        """This rank's experts of a tensor stacked by expert along dim 0 (fused checkpoint experts, per-expert
        biases): all of them unless expert-parallel."""
        if loaded.shape[0] != self.num_experts:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}: expected {self.num_experts} experts "
                             "along dim 0")
        return loaded.narrow(0, self.expert_start, self.local_experts)

    def local_ids(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: the routed (weights, ids) with ids made this rank's local indices; another rank's
        expert becomes `local_experts` (the ops skip it) with weight 0. Unchanged otherwise."""
        if not self.expert_parallel:
            return weights, ids
        local = ids - self.expert_start
        mine = (local >= 0) & (local < self.local_experts)
        return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, self.local_experts)

    def expected_shards(self) -> dict[str, list[str]]:
        """Parameter -> the checkpoint pieces it needs (for the loader's missing-tensor check): this rank's experts'."""
        first = ("gate_proj", "up_proj") if self.gated else ("up_proj",)
        return {"w13": [f"{e}.{p}" for e in self.expert_range for p in first],
                "w2": [f"{e}.down_proj" for e in self.expert_range]}

    def _slice(self, loaded: torch.Tensor, dim: int, name: str, n: Optional[int] = None) -> torch.Tensor:
        """This rank's `n` (default: its share of I) of `loaded`'s `dim`; a lone scale (4-bit, one group per row)
        is every rank's."""
        n = self.inter if n is None else n
        if n == 1 and loaded.shape[dim] == 1:
            return loaded
        full = n * self.inter_split
        if loaded.shape[dim] != full:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}: expected {full} along dim {dim}")
        return loaded.narrow(dim, self.inter_rank * n, n)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        expert, proj = shard.split(".")  # type: ignore[union-attr]
        e = self.local_expert(int(expert))
        if e is None:  # another rank's expert (expert parallelism)
            return
        offset = self.inter if proj == "up_proj" and self.gated else 0
        param.data[e, offset:offset + self.inter].copy_(self._slice(loaded, 0, name))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        e = self.local_expert(int(shard.split(".")[0]))  # type: ignore[union-attr]
        if e is None:
            return
        param.data[e].copy_(self._slice(loaded, 1, name, param.shape[-1]))

    # ------------------------------------------------------------------ 4-bit experts (models/woq.py)
    def prepare_int4(self, group_size: int) -> bool:
        """Load a checkpoint's 4-bit experts: w13 / w2 become uint8 codes beside per-group scales and zeros
        (`w13_scale`, ...), split over ranks as the weights are; `finish_int4` packs them. False (nothing changes)
        when this rank's share of I would split a group."""
        (e, i2, hidden), inter = self.w13.shape, self.inter
        if group_size != -1 and (hidden % group_size or inter % group_size):
            return False
        groups = (1, 1) if group_size == -1 else (hidden // group_size, inter // group_size)
        self.compute_dtype, device = self.w13.dtype, self.w13.device
        shapes = {"w13": (e, i2, hidden), "w2": (e, hidden, inter)}
        for w, cols in zip(("w13", "w2"), groups):
            loader = self._load_w13 if w == "w13" else self._load_w2
            params = {w: torch.empty(shapes[w], dtype=torch.uint8, device=device),
                      f"{w}_scale": torch.empty(*shapes[w][:2], cols, device=device),
                      f"{w}_zero": torch.empty(*shapes[w][:2], cols, device=device)}
            for name, t in params.items():
                p = nn.Parameter(t, requires_grad=False)
                p.weight_loader = loader  # type: ignore[attr-defined]
                setattr(self, name, p)
        return True

    def finish_int4(self) -> None:
        """Pack each expert's codes for the int4 kernels, or dequantize them all where the kernels refuse a shape."""
        dtype, device = self.compute_dtype, self.w13.device
        assert dtype is not None, "finish_int4 without prepare_int4"
        experts = {w: [Unpacked(getattr(self, w).data[e], getattr(self, f"{w}_scale").data[e],
                                getattr(self, f"{w}_zero").data[e]) for e in range(self.local_experts)]
                   for w in ("w13", "w2")}
        for w in ("w13", "w2"):
            delattr(self, f"{w}_scale")
            delattr(self, f"{w}_zero")
        self.compute_dtype = None
        if all(u.fits_int4(dtype, device) for u in (experts["w13"][0], experts["w2"][0])):
            self._use_int4([pack_int4(u, dtype, device) for u in experts["w13"]],
                           [pack_int4(u, dtype, device) for u in experts["w2"]])
        else:
            for w in ("w13", "w2"):
                setattr(self, w, nn.Parameter(torch.stack([u.dequantize(dtype) for u in experts[w]]),
                                              requires_grad=False))

    def quantize_int4(self, group_size: int = 128) -> bool:
        """quantization="int4": round each expert to 4 bits (models/woq.quantize_rtn); False where the kernels
        refuse the shapes (the experts stay as they are)."""
        if self.int4 is not None:
            return True
        experts = self._rounded_experts(group_size)
        if experts is None:
            return False
        self._use_int4(*experts)
        return True

    def _rounded_experts(self, group_size: int = 128) -> Optional[tuple[list[Int4Weight], list[Int4Weight]]]:
        if self.w13.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        w13, w2 = self.w13.data, self.w2.data
        groups = [kernel_group(w.shape[-1], group_size) for w in (w13, w2)]
        if None in groups or not all(int4_supported(w.shape[1], w.shape[2], g, w.dtype, w.device)
                                     for w, g in zip((w13, w2), groups)):
            return None
        return tuple([pack_int4(quantize_rtn(w[e], g), w.dtype, w.device) for e in range(self.local_experts)]
                     for w, g in zip((w13, w2), groups))  # type: ignore[return-value]

    def _use_int4(self, w13: list[Int4Weight], w2: list[Int4Weight]) -> None:
        self.int4 = (w13, w2)
        self.float_shapes = (self.w13.shape, self.w2.shape)  # (for `unpack_for_load`)
        for w in (self.w13, self.w2):  # (the parameters stay, with their loaders)
            w.data = w.data.new_empty(0)
        _int4_layers.append(weakref.ref(self))
        self.int4_id = len(_int4_layers) - 1

    def pack_for_cpu(self) -> None:
        """Prepack each expert's matrices for oneDNN, as PackableLinear.pack_for_cpu does a linear's (a one-row
        bf16 matmul on a packed weight takes about half the time: bench/RESULTS.md, session 28). The float
        parameters are emptied (`unpack_for_load` restores them)."""
        if self.cpu_packed is not None or self.int4 is not None or self.compute_dtype is not None \
                or self.w13.numel() == 0:
            return
        self.float_shapes = (self.w13.shape, self.w2.shape)
        self.cpu_packed = self._packed_experts()
        for w in (self.w13, self.w2):
            w.data = w.data.new_empty(0)
        if self.packed_id is None:
            _packed_moe_layers.append(weakref.ref(self))
            self.packed_id = len(_packed_moe_layers) - 1

    @property
    def expert_shapes(self) -> tuple[torch.Size, torch.Size]:
        """w13's and w2's shapes (this rank's), whether the float experts are held, packed or rounded."""
        if self.w13.numel() == 0 and hasattr(self, "float_shapes"):
            return self.float_shapes
        return self.w13.shape, self.w2.shape

    def _packed_experts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return tuple([torch.ops.mkldnn._reorder_linear_weight(w[e].contiguous(), 16) for e in range(w.shape[0])]
                     for w in (self.w13.data, self.w2.data))  # type: ignore[return-value]

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token (this rank's part under tensor parallelism: a slice of
        every expert, or its own experts' whole outputs with expert parallelism). ids: the router's (global)."""
        weights, ids = self.local_ids(weights, ids)
        if self.int4_id is not None:
            return moe_experts_int4(x, weights, ids, self.int4_id)
        if self.cpu_packed is not None:
            return moe_experts_packed(x, weights, ids, self.packed_id)  # type: ignore[arg-type]
        return moe_experts(x, self.w13, self.w2, weights, ids, self.w13_bias, self.activation, self.alpha,
                           self.limit, self.fused_kernel)

    def unpack_for_load(self) -> bool:
        """Experts rounded to 4 bits or packed for oneDNN after load get their float parameters back for a loader
        to fill (new weights in place); True if so (then `repack`)."""
        if self.int4 is None and self.cpu_packed is None:
            return False
        for w, shape in zip((self.w13, self.w2), self.float_shapes):
            w.data = w.data.new_empty(shape)
        return True

    def repack(self) -> None:
        """Round (or pack) the new float experts again, into what the kernels read."""
        if self.cpu_packed is not None:
            self.cpu_packed = self._packed_experts()
            for w in (self.w13, self.w2):
                w.data = w.data.new_empty(0)
            return
        assert self.int4 is not None
        new = self._rounded_experts()
        assert new is not None, "experts rounded once round again"
        for olds, news in zip(self.int4, new):
            for old, fresh in zip(olds, news):
                copy_into(old, fresh)
        for w in (self.w13, self.w2):
            w.data = w.data.new_empty(0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: (weights [T, k], expert ids [T, k]). Softmax over the router's
        logits, top-k; DeepSeek's routers (models/deepseek.py) override this."""
        probs = F.linear(x, self.gate.weight, self.gate.bias).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:  # (= a softmax over the top-k logits: gpt-oss's routing)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.run_experts(x, weights, ids)
        if self.tp_size > 1:
            tp_all_reduce(out)
        if self.w2_bias is not None:  # after the all-reduce: every rank holds all of it
            out = out + (weights.unsqueeze(-1) * self.w2_bias[ids]).sum(dim=1).to(out.dtype)
        return out


def unstack_experts(weights: Iterable[tuple[str, Any]], cfg: Any) -> Iterator[tuple[str, Any]]:
    """Experts stacked per layer, as transformers 5 holds them (Qwen3-VL-MoE's and some Qwen3.5-MoE checkpoints):
    a layer's `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I] as each expert's
    gate_proj / up_proj / down_proj. Qwen3-VL-MoE's original release stores them transposed ([E, H, 2I],
    [E, I, H]), which transformers transposes on loading where the shape asks for it (as here). Other names pass."""
    hidden, inter = cfg.hidden_size, cfg.raw.get("moe_intermediate_size")
    for name, t in weights:
        fused = name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
        if not fused or not isinstance(t, torch.Tensor):  # (the int4 planner renames bare names)
            yield name, t
            continue
        prefix, kind = name.rsplit(".", 1)
        want = (2 * inter, hidden) if kind == "gate_up_proj" else (hidden, inter)
        if t.dim() == 3 and tuple(t.shape[1:]) != want and tuple(t.shape[1:]) == want[::-1]:
            t = t.transpose(1, 2)
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}; expected [experts, {want[0]}, "
                             f"{want[1]}] (or its last two dims swapped)")
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :inter]
                yield f"{prefix}.{e}.up_proj.weight", t[e, inter:]
            else:
                yield f"{prefix}.{e}.down_proj.weight", t[e]
