"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): a router picks each token's top-k experts; their SwiGLU
outputs, weighted by the router's probabilities, are summed. gpt-oss (models/gpt_oss.py) adds biases (router, experts)
and its clamped SwiGLU (`activation="swiglu_oai"`).

The experts' weights are stacked, [E, 2 * I, H] (gate and up) and [E, H, I] (down), and split over tensor-parallel
ranks along I, as a dense MLP's are (each rank holds a slice of every expert; the partial sums are all-reduced).
Which experts a step uses depends on the data, so the expert computation is one opaque custom op: torch.compile
captures the rest of the model whole, and the op groups the step's tokens by expert and runs one matmul per expert
that has any (all of them, batched, when there are only a few tokens: a decode step's gather is cheaper than a
loop over experts).
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.layers import ParallelContext

# One expert's matrix in a checkpoint: Qwen3-MoE's `mlp.experts.E.{gate,up,down}_proj`, Mixtral's
# `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down).
EXPERT_WEIGHT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                           r"\.weight$")
EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _gated(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> [..., I]. "silu": silu(gate) * up; "swiglu_oai" (gpt-oss): the gate clamped
    above and the up projection on both sides at `limit`, gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


@torch.library.custom_op("streamer::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, b13: Optional[torch.Tensor] = None, activation: str = "silu",
                alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """sum over a token's k experts e of weight * down_e(act(gate_e(x), up_e(x))). x [T, H]; ids/weights [T, k];
    b13 [E, 2I]: the gate/up biases (the down bias is the caller's: see SparseMoE.forward)."""
    tokens, k = topk_ids.shape
    if tokens * k <= w13.shape[0]:  # few tokens (decode): gather their experts' weights, no per-expert loop
        flat = topk_ids.reshape(-1)
        h = torch.bmm(w13[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
        if b13 is not None:
            h = h + b13[flat]
        y = torch.bmm(w2[flat], _gated(h, activation, alpha, limit).unsqueeze(-1)).squeeze(-1)
        return (y.view(tokens, k, -1) * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // k
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        rows = token_of[start:start + n]
        start += n
        h = F.linear(x[rows], w13[e], None if b13 is None else b13[e])
        y = F.linear(_gated(h, activation, alpha, limit), w2[e]) * topk_weights.reshape(-1)[sel].unsqueeze(-1)
        out.index_add_(0, rows, y.to(x.dtype))
    return out


@moe_experts.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
      b13: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.0,
      limit: float = 0.0) -> torch.Tensor:
    return torch.empty_like(x)


class SparseMoE(nn.Module):
    # gpt-oss's (models/gpt_oss.py sets them): per-expert biases of gate/up [E, 2I] and down [E, H], the activation
    w13_bias: Optional[nn.Parameter]
    w2_bias: Optional[nn.Parameter]
    activation, alpha, limit = "silu", 1.0, 0.0

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, fp32_weights: bool = False, router_bias: bool = False) -> None:
        """`fp32_weights`: scale the experts' outputs by the router's fp32 weights (Mixtral) rather than by weights
        cast to the model's dtype first (Qwen3-MoE), as each model's reference does."""
        super().__init__()
        self.fp32_weights = fp32_weights
        tp = ParallelContext.size
        if intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by {tp} ranks")
        self.tp_size = tp
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.inter = intermediate_size // tp
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)  # the router, whole on every rank
        self.gate.requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.register_parameter("w13_bias", None)
        self.register_parameter("w2_bias", None)

    def expected_shards(self) -> dict[str, list[str]]:
        """Parameter -> the checkpoint pieces it needs (for the loader's missing-tensor check)."""
        return {"w13": [f"{e}.{p}" for e in range(self.num_experts) for p in ("gate_proj", "up_proj")],
                "w2": [f"{e}.down_proj" for e in range(self.num_experts)]}

    def _slice(self, loaded: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        full = self.inter * self.tp_size
        if loaded.shape[dim] != full:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}: expected {full} along dim {dim}")
        rank = ParallelContext.rank
        return loaded.narrow(dim, rank * self.inter, self.inter)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        expert, proj = shard.split(".")  # type: ignore[union-attr]
        offset = 0 if proj == "gate_proj" else self.inter
        param.data[int(expert), offset:offset + self.inter].copy_(self._slice(loaded, 0, name))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        param.data[int(shard.split(".")[0])].copy_(self._slice(loaded, 1, name))  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.linear(x, self.gate.weight, self.gate.bias).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:  # (= a softmax over the top-k logits: gpt-oss's routing)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        out = moe_experts(x, self.w13, self.w2, weights, ids, self.w13_bias, self.activation, self.alpha, self.limit)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        if self.w2_bias is not None:  # after the all-reduce: every rank holds all of it
            out = out + (weights.unsqueeze(-1) * self.w2_bias[ids]).sum(dim=1).to(out.dtype)
        return out
