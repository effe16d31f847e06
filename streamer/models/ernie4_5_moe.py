"""Baidu's ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B-PT, ERNIE-4.5-300B-A47B-PT and their -Base
versions; the "-PT" checkpoints, in transformers' layout). Llama's pre-norm decoder, with ERNIE's differences:

- rotary in interleaved (GPT-J) pairs over the whole head, rope_theta 500000 and a tied LM head by default;
- the first `moe_layer_start_index` layers (1) keep a dense MLP; then every `moe_layer_interval`-th layer up to
  `moe_layer_end_index` is sparse (models/moe.py);
- the router runs in fp32 (its weight kept fp32, as transformers keeps it): softmax over all experts, the top
  `moe_k` *chosen* by probability + the `moe_statics.e_score_correction_bias` (aux-loss-free balancing), weighted
  by the unbiased probabilities, renormalised (sum clamped at `moe_norm_min`), then cast to the model's dtype;
- `moe_num_shared_experts` shared experts (one dense SwiGLU, that many times `moe_intermediate_size` wide) are added
  to the routed experts' output;
- rms_norm_eps defaults to 1e-5 (these defaults: its registry entry's `defaults`); `use_bias` (biases on every
  linear, none in the released models) is refused;
- the multi-token-prediction weights (`mtp_*`) are skipped, as transformers does.

The Hub's checkpoints store one tensor per expert (`mlp.experts.E.{gate,up,down}_proj`) and the correction bias as
`mlp.moe_statics.e_score_correction_bias` [1, E]; transformers 5's spellings (fused `mlp.experts.gate_up_proj` /
`down_proj`, `mlp.gate.moe_statics.e_score_correction_bias`) load too.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE, unfuse_experts


def ernie_sparse(raw: dict[str, Any], num_layers: int, index: int) -> bool:
    """Whether layer `index` is sparse (transformers' Ernie4_5_MoeDecoderLayer's rule, with its config's defaults)."""
    if not int(raw.get("moe_num_experts", 64) or 0):
        return False
    start = int(raw.get("moe_layer_start_index", 1))
    end = int(raw.get("moe_layer_end_index", -1))
    end = num_layers - 1 if end == -1 else end
    return (index + 1) % int(raw.get("moe_layer_interval") or 1) == 0 and start <= index <= end


class ErnieMoE(SparseMoE):
    """Routed experts (the bias-corrected fp32 router of the module docstring) plus the shared experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        inter = int(raw.get("moe_intermediate_size", 1536))
        super().__init__(cfg.hidden_size, inter, int(raw.get("moe_num_experts", 64)), int(raw.get("moe_k", 6)),
                         norm_topk_prob=True)
        self.norm_min = float(raw.get("moe_norm_min", 1e-12))
        self.gate.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, dtype=torch.float32),
                                        requires_grad=False)
        bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)
        bias.weight_loader = _load_correction_bias  # type: ignore[attr-defined]
        self.gate.e_score_correction_bias = bias
        shared = int(raw.get("moe_num_shared_experts", 2) or 0)
        self.shared_experts: Optional[MLP] = MLP(cfg, shared * inter) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x.float(), self.gate.weight).softmax(dim=-1)
        ids = (probs + self.gate.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = probs.gather(1, ids)  # the unbiased probabilities: the bias only chooses
        if self.norm_topk_prob:  # (always, in transformers' ERNIE)
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _load_correction_bias(param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
    """[1, E] (one group, as the checkpoints store it) or [E] -> [E], in fp32."""
    if loaded.numel() != param.numel():
        raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}: expected {param.numel()} values")
    param.data.copy_(loaded.reshape(-1))


class ErnieDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp: nn.Module = ErnieMoE(cfg) if ernie_sparse(cfg.raw, cfg.num_layers, index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = ErnieDecoderLayer
    rope_is_neox = False

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.raw.get("use_bias"):
            raise ValueError("Ernie4_5_MoeForCausalLM with use_bias (biases on every linear) is not supported")
        super().__init__(cfg, backend_cls, max_positions)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in unfuse_experts(weights):
            if "mtp" in name:  # the multi-token-prediction block (transformers ignores "mtp" too): not used
                continue
            yield name.replace(".mlp.gate.moe_statics.", ".mlp.gate.").replace(".mlp.moe_statics.", ".mlp.gate."), t
