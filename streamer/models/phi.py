"""Phi (PhiForCausalLM: microsoft/phi-1, phi-1_5, phi-2, and their fine-tunes; not Phi-3, which is Llama's
decoder in models/llama.py). The Llama decoder's attention and weight loading, with Phi's differences:

- one LayerNorm (with a bias, eps `layer_norm_eps`) a layer, read by attention and the MLP in parallel:
  x + attn(ln(x)) + mlp(ln(x)) (models/gpt_neox.py ParallelResidualLayer); a final LayerNorm (`final_layernorm`);
- partial rotary: only the first `partial_rotary_factor` (0.5 by default; phi-2 0.4) of each head rotates, Llama's
  rotate-halves layout within that part;
- biases on q, k, v and the output projection (`dense`);
- optional `qk_layernorm`: q and k LayerNorm-ed (one weight and bias shared by all heads) before rotary;
- the MLP is two biased linears with GELU (tanh-approximated, `gelu_new`) between them (`fc1`, `fc2`), no gate;
- the LM head has a bias, and is untied (`HeadBias`, GPT-J's too).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import (
    GeluMLP,
    ParallelResidualLayer,
    gelu_approximate,
    layer_norm_eps,
    renamed_lora_parts,
    to_ours,
    to_theirs,
)
from streamer.models.layers import LayerNorm, RotaryEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM

# checkpoint name fragment -> ours
_PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
              (".self_attn.k_layernorm.", ".self_attn.k_norm."), ("model.final_layernorm.", "model.norm."))


class PhiDecoderLayer(ParallelResidualLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        eps = layer_norm_eps(cfg)
        self.self_attn = Attention(dataclasses.replace(cfg, attention_bias=True, o_proj_bias=True, qk_norm=False),
                                   backend_cls, rotary)
        if cfg.raw.get("qk_layernorm"):  # one LayerNorm over each head's dims, shared by the heads
            self.self_attn.q_norm = LayerNorm(cfg.head_dim, eps)
            self.self_attn.k_norm = LayerNorm(cfg.head_dim, eps)
        self.mlp = GeluMLP(cfg, gelu_approximate(cfg, "gelu_new"))
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = None
        self.parallel = True


class HeadBias(LlamaForCausalLM):
    """A Llama-built model whose LM head has a bias (Phi's, GPT-J's), so is never tied: logits + bias."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.tie_word_embeddings:
            raise ValueError(f"{cfg.architecture} with tie_word_embeddings is not supported (its LM head has a bias "
                             "of its own)")
        super().__init__(cfg, backend_cls, max_positions)
        assert self.lm_head is not None
        self.lm_head.bias = nn.Parameter(torch.zeros(cfg.vocab_size), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) + self.lm_head.bias.float()  # type: ignore[union-attr]


class PhiForCausalLM(HeadBias):
    decoder_layer = PhiDecoderLayer
    lora_parts = renamed_lora_parts

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, layer_norm_eps(cfg))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in weights:
            yield to_ours(name, _PHI_NAMES), t

    def checkpoint_name(self, internal: str) -> str:
        return to_theirs(super().checkpoint_name(internal), _PHI_NAMES)
