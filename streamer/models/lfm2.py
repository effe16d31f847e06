"""Liquid AI LFM2 (Lfm2ForCausalLM: LFM2-350M / 700M / 1.2B / 2.6B): pre-norm layers that are either a gated short
convolution or GQA attention (`layer_types`: "conv" / "full_attention", older configs `full_attn_idxs`), each
followed by a SwiGLU MLP; the final norm is called `embedding_norm`.

- short conv (`LFM2ShortConv`): B, C, x = in_proj(h) (three hidden-size parts); y = C * conv(B * x), a causal
  depthwise conv of `conv_L_cache` taps (3) without activation; out_proj(y). Its per-request state is the conv
  window only, the last `conv_L_cache - 1` values of B * x, kept in a state slot (models/mamba.py RecurrentMixer,
  with an empty SSM state) and advanced like Mamba's conv: decode rows shift their windows, prefill chunks convolve
  after the carried window, so a prompt chunked anyhow gives the same outputs;
- attention: rotary, per-head RMSNorm of q and k before rotating (`q_layernorm`, `k_layernorm`), paged KV cache;
- MLP: w2(silu(w1 x) * w3 x), its width from `block_ff_dim` / `intermediate_size` by `block_auto_adjust_ff_dim`
  (2/3 of it, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`), as transformers does.

LFM2-MoE (Lfm2MoeForCausalLM: LFM2-8B-A1B) is the same stack whose MLPs after the first `num_dense_layers` (dense,
`intermediate_size` wide, no adjustment) are sparse: a sigmoid router whose `expert_bias` (fp32) only chooses the
top `num_experts_per_tok` experts, their sigmoid scores renormalised (`norm_topk_prob`, + 1e-6) and scaled by
`routed_scaling_factor`, SwiGLU experts `moe_intermediate_size` wide (models/moe.py).

Checkpoint names: `model.layers.N.{conv.{in_proj, conv, out_proj}, self_attn.{q,k,v}_proj, self_attn.out_proj,
self_attn.{q,k}_layernorm, feed_forward.{w1, w3, w2}, operator_norm, ffn_norm}`, `model.embedding_norm`; the head
is tied to the embeddings (`tie_embedding`). MoE layers: `feed_forward.gate` (the router), `feed_forward.expert_bias`,
the experts per expert (`feed_forward.experts.E.{w1, w3, w2}`) or stacked as transformers 5 writes them
(`feed_forward.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])."""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding, RowParallelLinear
from streamer.models.llama import MLP, Attention, LlamaForCausalLM, add_and_norm
from streamer.models.mamba import HybridModel, PartsLinear, RecurrentMixer, check_divides, split_conv, split_parts
from streamer.models.moe import SparseMoE, unfuse_experts

_MOE_ARCH = "Lfm2MoeForCausalLM"


def lfm2_layer_kinds(raw: dict[str, Any], num_layers: int) -> list[str]:
    """"conv" or "attention" per layer."""
    kinds = raw.get("layer_types")
    if not kinds:
        attn = raw.get("full_attn_idxs")
        attn = set(range(num_layers) if attn is None else attn)
        return ["attention" if i in attn else "conv" for i in range(num_layers)]
    if len(kinds) < num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    bad = sorted({k for k in kinds if k not in ("conv", "full_attention")})
    if bad:
        raise ValueError(f"unsupported LFM2 layer type(s) {bad!r} (supported: conv, full_attention)")
    return ["conv" if k == "conv" else "attention" for k in kinds[:num_layers]]


class ShortConv(RecurrentMixer):
    """LFM2's gated short convolution; its state is the conv window alone (`ssm_state` is empty). With tensor
    parallelism each rank holds hidden / tp of its channels: in_proj column-parallel by parts (B, C, x), the conv
    over them, out_proj row-parallel."""

    def __init__(self, hidden: int, kernel: int, bias: bool) -> None:
        super().__init__()
        channels = split_parts([hidden])
        self.conv_dim, self.d_conv, self.state_shape = channels[0][1], kernel, (0,)
        self.in_proj = PartsLinear(hidden, channels * 3, bias=bias)
        self.conv1d = split_conv(nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=bias),
                                 channels)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        step = self.begin_step(decode)
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        bx = b * v
        y = torch.empty_like(bx)
        if step.decode_tokens is not None:  # one token each: the windows shift by one
            y[step.decode_tokens] = self.conv_decode(bx[step.decode_tokens], step.decode_slots).to(y.dtype)
        batch = step.prefill_batch
        if batch is not None:  # short chunks at once, each convolved after its carried window
            y[batch.rows[batch.valid]] = self.conv_prefill_batch(bx[batch.rows], batch)[batch.valid].to(y.dtype)
        for slot, lo, hi in step.long_prefills:  # longer ones one by one
            y[lo:hi] = self.conv_prefill(bx[lo:hi], slot).to(y.dtype)
        return self.out_proj(c * y)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        self.self_attn: Optional[Attention] = None  # (the runner gives layers with a `self_attn` a KV cache)
        self.conv: Optional[ShortConv] = None
        if lfm2_layer_kinds(raw, cfg.num_layers)[index] == "attention":
            self.self_attn = Attention(cfg, backend_cls, rotary, qk_norm_cls=RMSNorm)
        else:
            self.conv = ShortConv(cfg.hidden_size, int(raw.get("conv_L_cache", 3)), bool(raw.get("conv_bias", False)))
        self.feed_forward = self.make_mlp(cfg, index)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, index: int) -> Optional[nn.Module]:
        """The dense MLP (None in LFM2-MoE's sparse layers: their `mlp`, named so for the loader's experts)."""
        self.mlp: Optional[Lfm2MoE] = None
        if cfg.architecture == _MOE_ARCH and index >= int(cfg.raw.get("num_dense_layers", 2)):
            self.mlp = Lfm2MoE(cfg)
            return None
        return MLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.operator_norm, x, residual)
        if self.self_attn is not None:
            h = self.self_attn(positions, h, kv_cache, decode)
        else:
            h = self.conv(h, decode)  # type: ignore[misc]
        h, residual = self.ffn_norm(h, residual)
        return (self.mlp if self.feed_forward is None else self.feed_forward)(h), residual  # type: ignore[misc]


class Lfm2MoE(SparseMoE):
    """Routed SwiGLU experts behind LFM2-MoE's sigmoid router (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        super().__init__(cfg.hidden_size, int(raw.get("moe_intermediate_size", 1792)), int(raw.get("num_experts", 32)),
                         int(raw.get("num_experts_per_tok", 4)), bool(raw.get("norm_topk_prob", True)))
        self.scaling = float(raw.get("routed_scaling_factor", 1.0))
        self.expert_bias: Optional[nn.Parameter] = None
        if raw.get("use_expert_bias", True):
            self.expert_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.gate.weight).sigmoid()
        if self.expert_bias is not None:  # the bias only chooses
            ids = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return (weights * self.scaling).to(x.dtype), ids


_RENAME = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
           (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".conv.conv.", ".conv.conv1d."),
           (".feed_forward.w1.", ".feed_forward.gate_proj."), (".feed_forward.w3.", ".feed_forward.up_proj."),
           (".feed_forward.w2.", ".feed_forward.down_proj."))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Lfm2ForCausalLM(HybridModel, LlamaForCausalLM):
    decoder_layer = Lfm2DecoderLayer

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        check_divides(tp, hidden_size=cfg.hidden_size)  # (the short convolutions' channels)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return unfuse_experts(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name == "model.embedding_norm.weight":
                name = "model.norm.weight"
            elif (m := _LAYER.match(name)) is not None:
                if getattr(self.layers[int(m.group(1))], "feed_forward", 0) is None:  # an LFM2-MoE sparse layer: `mlp`
                    name = name.replace(".feed_forward.", ".mlp.")
                for theirs, ours in _RENAME:
                    name = name.replace(theirs, ours)
            yield name, t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        if name == "model.norm.weight":
            return "model.embedding_norm.weight"
        name = name.replace(".mlp.", ".feed_forward.")
        for theirs, ours in _RENAME:
            name = name.replace(ours, theirs)
        return name
