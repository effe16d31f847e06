"""Zhipu's GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) and GLM-4.5 (Glm4MoeForCausalLM: GLM-4.5,
GLM-4.5-Air, GLM-4.6). The Llama decoder's parts, with GLM's differences:

- both: biases on q/k/v (`attention_bias`) but never on o_proj; only the first `partial_rotary_factor` (0.5) of each
  head rotates: GLM-4 in interleaved GPT-J pairs (dims 2i, 2i + 1), GLM-4.5 in Llama's halves;
- GLM-4: "sandwich" norms, the attention and MLP outputs RMS-normalised again (post_self_attn_layernorm,
  post_mlp_layernorm) before they join the residual stream; the checkpoint stores gate_up_proj fused;
- GLM-4.5: per-head q/k RMSNorms with `use_qk_norm`; the first `first_k_dense_replace` layers keep a dense MLP, the
  others are DeepSeek-V3's MoE (models/deepseek.py's DeepseekMoE: sigmoid scores, experts chosen by score +
  `e_score_correction_bias` within the `topk_group` best of `n_group` groups, weighted by the unbiased scores,
  `norm_topk_prob`, `routed_scaling_factor`, plus `n_shared_experts` shared experts); the checkpoints' MTP layers
  (model.layers.<num_hidden_layers>) are skipped.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.deepseek import DeepseekMoE, Routing, without_mtp_layers
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, DecoderLayer, LlamaForCausalLM, add_and_norm


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        # Returns (branch, stream), not yet added, as Llama's layer: the next norm adds them.
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        h = self.post_self_attn_layernorm(self.self_attn(positions, h, kv_cache, decode))
        h, residual = self.post_attention_layernorm(h, residual)
        return self.post_mlp_layernorm(self.mlp(h)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    decoder_layer = Glm4DecoderLayer
    rope_is_neox = False


class Glm4MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        routing = Routing.from_config(cfg)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp: nn.Module = DeepseekMoE(cfg, routing) if routing.sparse(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = Glm4MoeDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        Routing.from_config(cfg)  # (refuses an unsupported config before anything is built)
        super().__init__(cfg, backend_cls, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(without_mtp_layers(weights, self.cfg.num_layers))
