"""Meta's Llama 4 (Llama4ForCausalLM; the text model of Llama4ForConditionalGeneration checkpoints, which is how
Llama-4-Scout and Llama-4-Maverick are released: their vision encoder is not loaded, and images are refused). The
Llama decoder's parts, with Llama 4's differences:

- attention: most layers rotate q and k (interleaved GPT-J pairs, as complex numbers; llama3 rope scaling), then
  L2-normalise them per head without a weight (`use_qk_norm`), and attend *chunked*: the query at position p sees
  only the keys of its own `attention_chunk_size` chunk, [(p // C) * C, p] (`AttentionSpec.attention_chunk`).
  The others (`no_rope_layers` 0: every fourth by default) are NoPE layers: no rotary, no norm, full causal
  attention, and with `attn_temperature_tuning` queries scaled by log(floor((p + 1) / floor_scale) + 1) *
  attn_scale + 1;
- MLPs: the layers in `moe_layers` (by default every `interleave_moe_layer_step`-th) are sparse, the others dense
  with their own width (`intermediate_size_mlp`). The router takes each token's top-k logits (k = 1 in the released
  models) and their sigmoids scale the expert's *input*, not its output; an always-on shared expert (a dense MLP of
  `intermediate_size`) is added. The checkpoint stores each layer's experts fused, laid out for x @ W:
  `experts.gate_up_proj` [E, H, 2I] (gate columns, then up columns) and `experts.down_proj` [E, I, H]; they are
  split over tensor-parallel ranks along I as every sparse MLP's are (models/moe.py). Per-expert tensors
  (`experts.E.gate_proj.weight`, ...) load too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.gpt_oss import FUSED
from streamer.models.layers import RMSNorm, RotaryEmbedding, default_weight_loader, tp_all_reduce
from streamer.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, rope_layers
from streamer.models.moe import SparseMoE

# (checkpoint name suffix, ours): the fused experts' tensors
_FUSED_EXPERTS = ((".mlp.experts.gate_up_proj", ".mlp.w13"), (".mlp.experts.down_proj", ".mlp.w2"))
# A Llama4ForConditionalGeneration checkpoint's tensors outside its text model
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")


@dataclass(frozen=True)
class Llama4Layers:
    """A Llama 4 config's per-layer choices, checked (`from_config`), as transformers derives them."""

    rope: list[bool]  # the layer rotates q and k (no_rope_layers 1) or is a NoPE layer (0)
    chunked: list[bool]  # the layer attends within chunks (layer_types "chunked_attention")
    sparse: list[bool]  # the layer's MLP is the MoE (moe_layers)
    chunk: Optional[int]  # attention_chunk_size
    qk_norm: bool  # L2 norm of q and k, on the rope layers
    temperature: Optional[tuple[float, float]]  # NoPE layers' query scaling: (attn_scale, floor_scale)
    num_experts: int
    top_k: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Llama4Layers":
        raw, n = cfg.raw, cfg.num_layers
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Llama 4 with hidden_act {act!r} is not supported (silu is)")
        rope = rope_layers(raw, n)
        chunk = raw.get("attention_chunk_size", 8192)  # (transformers' default; null: no chunked layers)
        if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"attention_chunk_size must be a positive integer or null (got {chunk!r})")
        types = raw.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                           for r in rope]
        if len(types) < n or any(t not in ("chunked_attention", "full_attention") for t in types[:n]):
            raise ValueError(f"unsupported layer_types {types!r} for Llama 4 (chunked_attention, full_attention)")
        chunked = [t == "chunked_attention" and chunk is not None for t in types[:n]]
        step = int(raw.get("interleave_moe_layer_step") or 1)
        moe_layers = raw.get("moe_layers")
        moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
        experts = int(raw.get("num_local_experts", 16) or 0)
        top_k = int(raw.get("num_experts_per_tok") or 1)
        if moe_layers and not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be 1..num_local_experts ({experts})")
        temperature = None
        if raw.get("attn_temperature_tuning", True):  # (a number in some released configs: any nonzero means on)
            floor_scale = float(raw.get("floor_scale", 8192))
            if floor_scale <= 0:
                raise ValueError(f"floor_scale must be positive (got {floor_scale})")
            temperature = (float(raw.get("attn_scale", 0.1)), floor_scale)
        return cls(rope, chunked, [i in moe_layers for i in range(n)], chunk, bool(raw.get("use_qk_norm", True)),
                   temperature, experts, top_k)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, no weight (transformers' Llama4TextL2Norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(Attention):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, layers: Llama4Layers, index: int) -> None:
        super().__init__(cfg, backend_cls, rotary, sliding_window=None,
                         attention_chunk=layers.chunk if layers.chunked[index] else None, use_rope=layers.rope[index])
        self.l2_eps: Optional[float] = cfg.rms_norm_eps if layers.qk_norm and self.use_rope else None
        self.temperature = None if self.use_rope else layers.temperature

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.use_rope:
            q, k = self.rotary(positions, q, k)
        if self.l2_eps is not None:  # (after the rotary, as transformers has it)
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature is not None:
            attn_scale, floor_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales.view(-1, 1, 1)).to(q.dtype)
        return self.attend(q, k, v, kv_cache, decode)


class Llama4MoE(SparseMoE):
    """Top-k routing by sigmoid scores that scale each expert's input; plus the shared expert."""

    def __init__(self, cfg: ModelConfig, layers: Llama4Layers) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, layers.num_experts, layers.top_k,
                         norm_topk_prob=False)
        self.shared_expert = MLP(cfg)
        self.fused = False  # the checkpoint's experts came fused (gate_up_proj / down_proj), not one by one

    def expected_shards(self) -> dict[str, list[str]]:
        return {"w13": [FUSED], "w2": [FUSED]} if self.fused else super().expected_shards()

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        """gate_up_proj [E, H, 2I] (gate columns, then up) -> this rank's gate rows then up rows of w13 [E, 2I, H]."""
        if shard != FUSED:
            return super()._load_w13(param, loaded, name, shard)
        self.fused = True
        if loaded.dim() != 3 or loaded.shape[-1] % 2:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected [experts, hidden, 2 * I]")
        gate, up = self.local_rows(loaded, name).chunk(2, dim=-1)
        rows = torch.cat([self._slice(gate, 2, name), self._slice(up, 2, name)], dim=2).transpose(1, 2)
        default_weight_loader(param, rows, name)

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        """down_proj [E, I, H] -> this rank's columns of w2 [E, H, I]."""
        if shard != FUSED:
            return super()._load_w2(param, loaded, name, shard)
        self.fused = True
        if loaded.dim() != 3:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected [experts, I, hidden]")
        loaded = self.local_rows(loaded, name)
        default_weight_loader(param, self._slice(loaded, 1, name).transpose(1, 2), name)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmoid of the top-k logits in x's dtype [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.gate.weight)
        top, ids = logits.topk(self.top_k, dim=-1)
        return torch.sigmoid(top.float()).to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        tokens, k = ids.shape
        # One row per (token, expert) pair, its input scaled by the expert's score; the experts' outputs are summed
        # unweighted.
        scaled = (x.unsqueeze(1) * weights.unsqueeze(-1)).reshape(tokens * k, -1)
        ids = ids.reshape(tokens * k, 1)
        ones = torch.ones_like(ids, dtype=x.dtype)
        routed = self.run_experts(scaled, ones, ids)
        if k > 1:
            routed = routed.view(tokens, k, -1).sum(dim=1)
        if self.tp_size > 1:
            tp_all_reduce(routed)
        return self.shared_expert(x) + routed


class Llama4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        layers = Llama4Layers.from_config(cfg)
        self.self_attn = Llama4Attention(cfg, backend_cls, rotary, layers, index)
        self.mlp = (Llama4MoE(cfg, layers) if layers.sparse[index]
                    else MLP(cfg, int(cfg.raw.get("intermediate_size_mlp") or 16384)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama4ForCausalLM(LlamaForCausalLM):
    decoder_layer = Llama4DecoderLayer
    rope_is_neox = False

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        Llama4Layers.from_config(cfg)  # (a bad config fails here, once)
        super().__init__(cfg, backend_cls, max_positions)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """transformers' names (`feed_forward`, `router`) in the Llama decoder's spelling (`mlp`, `gate`); a
        Llama4ForConditionalGeneration checkpoint's text model out of `language_model.`, its vision weights
        skipped."""
        for name, t in weights:
            if name.startswith(_VISION_PREFIXES):
                continue
            if name.startswith("language_model."):
                name = name.removeprefix("language_model.")
            elif name.startswith("model.language_model."):
                name = "model." + name.removeprefix("model.language_model.")
            yield name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate."), t

    def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
        for theirs, ours in _FUSED_EXPERTS:
            if ckpt_name.endswith(theirs):
                return ckpt_name.removeprefix("model.").replace(theirs, ours), FUSED
        return super().param_name(ckpt_name)

    def checkpoint_name(self, internal: str) -> str:
        name, _, shard = internal.partition(":")
        if shard == FUSED:
            for theirs, ours in _FUSED_EXPERTS:
                name = name.replace(ours, theirs)
            name = f"model.{name}"
        else:
            name = super().checkpoint_name(internal)
        name = name.replace(".mlp.gate.", ".mlp.router.").replace(".mlp.", ".feed_forward.")
        return f"language_model.{name}" if self.cfg.text_only_of else name
