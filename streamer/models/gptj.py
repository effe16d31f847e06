"""GPT-J (GPTJForCausalLM: EleutherAI/gpt-j-6b and the models trained or tuned in its shape: GPT4All-J, Dolly v1,
Pygmalion-6B, ...). The Llama decoder's attention and weight loading, with GPT-J's differences:

- one LayerNorm a layer (`ln_1`, with a bias, eps `layer_norm_epsilon`), read by attention and the MLP in parallel:
  x + attn(ln(x)) + mlp(ln(x)) (models/gpt_neox.py ParallelResidualLayer); a final LayerNorm (`ln_f`);
- partial rotary in GPT-J's own layout: the first `rotary_dim` dims of each head (64 of 256 in GPT-J-6B) rotate in
  interleaved pairs (2i, 2i + 1), not Llama's halves; the base is always 10000;
- separate q, k, v and `out_proj` (o_proj), none with a bias;
- the MLP is two biased linears with GELU (`activation_function`, tanh-approximated `gelu_new` by default) between
  them (`fc_in`, `fc_out`; width `n_inner`, 4 x hidden by default), no gate;
- the LM head has a bias, and is untied (models/phi.py HeadBias);
- GPT-2's config spellings (`n_embd`, `n_head`, `n_layer`, `n_positions`, `n_inner`: models/family_configs.py
  gptj_config), with GPT-J's defaults.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import (
    GeluMLP,
    ParallelResidualLayer,
    layer_norm_eps,
    renamed_lora_parts,
    to_ours,
    to_theirs,
)
from streamer.models.layers import LayerNorm, RotaryEmbedding, gelu_approximate
from streamer.models.llama import Attention
from streamer.models.phi import HeadBias


class GPTJBlock(ParallelResidualLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend_cls, rotary)
        self.mlp = GeluMLP(cfg, gelu_approximate(cfg, "gelu_new", "activation_function"))
        self.input_layernorm = LayerNorm(cfg.hidden_size, layer_norm_eps(cfg))
        self.post_attention_layernorm = None
        self.parallel = True


# checkpoint name fragment -> ours (after `transformer.` became `model.`)
_NAMES = (("model.wte.", "model.embed_tokens."), ("model.ln_f.", "model.norm."), ("model.h.", "model.layers."),
          (".ln_1.", ".input_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."),
          (".mlp.fc_in.", ".mlp.fc1."), (".mlp.fc_out.", ".mlp.fc2."))
# (older checkpoints store the causal mask as buffers)
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPTJForCausalLM(HeadBias):
    decoder_layer = GPTJBlock
    rope_is_neox = False
    lora_parts = renamed_lora_parts

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, layer_norm_eps(cfg))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name.endswith(_BUFFERS):
                continue
            yield to_ours(name, _NAMES, "transformer."), t

    def checkpoint_name(self, internal: str) -> str:
        # (in order: o_proj goes back to out_proj before self_attn to attn)
        return to_theirs(super().checkpoint_name(internal), _NAMES, "transformer.")
