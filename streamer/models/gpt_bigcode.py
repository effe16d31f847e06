"""GPTBigCode (GPTBigCodeForCausalLM: bigcode/starcoder, starcoderbase (1B to 15.5B), starcoderplus, gpt_bigcode-
santacoder, WizardCoder-15B, OctoCoder, ...; not StarCoder2, models/starcoder2.py). GPT-2's decoder as BigCode
trained it, built from the Llama decoder's parts, with these differences from Llama:

- no rotary: learned absolute position embeddings (`wpe`, `n_positions` rows) added to the token embeddings;
- multi-query attention (`multi_query`, on by default): one k/v head shared by every query head, from one fused
  `c_attn` linear whose rows are [q (all heads); k; v]; without multi_query every head has its own k/v and the
  rows are laid out per head, [q_h, k_h, v_h] for each head h (split here into q/k/v either way); biases on
  c_attn and the output projection (`attn.c_proj`); scores scaled by head_dim ** -0.5 unless
  `scale_attn_weights` is false (then 1);
- LayerNorm with a bias (`ln_1`, `ln_2`, `ln_f`; eps `layer_norm_epsilon`), sequential pre-norm layers;
- the MLP is two biased linears with GELU (`activation_function`, tanh-approximated by default) between them
  (`c_fc`, `mlp.c_proj`; width `n_inner`, default 4 x hidden), no gate;
- GPT-2's config spellings (`n_embd`, `n_head`, `n_layer`, `n_positions`, `n_inner`: models/family_configs.py) and the LM
  head tied to `wte` by default.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Optional

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import (
    GeluMLP,
    ParallelResidualLayer,
    fused_qkv_parts,
    gelu_approximate,
    renamed_lora_parts,
    to_ours,
    to_theirs,
)
from streamer.models.layers import LayerNorm, RotaryEmbedding, VocabEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM


class GPTBigCodeBlock(ParallelResidualLayer):
    default_act = "gelu_pytorch_tanh"

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        scale = cfg.head_dim ** -0.5 if raw.get("scale_attn_weights", True) else 1.0
        if raw.get("scale_attn_by_inverse_layer_idx"):  # (GPT-2's option)
            scale /= float(index + 1)
        self.self_attn = Attention(dataclasses.replace(cfg, attention_bias=True, o_proj_bias=True, qk_norm=False,
                                                       sliding_window=None),
                                   backend_cls, rotary, scale=scale, use_rope=False)
        self.mlp = GeluMLP(cfg, gelu_approximate(cfg, self.default_act, "activation_function"))
        eps = float(raw.get("layer_norm_epsilon") or 1e-5)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.parallel = False


# checkpoint name fragment -> ours (after `transformer.` became `model.`)
_NAMES = (("model.wte.", "model.embed_tokens."), ("model.ln_f.", "model.norm."), ("model.h.", "model.layers."),
          (".attn.c_proj.", ".self_attn.o_proj."), (".mlp.c_fc.", ".mlp.fc1."), (".mlp.c_proj.", ".mlp.fc2."),
          (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."))
_C_ATTN = re.compile(r"(model\.layers\.\d+)\.attn\.c_attn\.(\w+)$")


class GPTBigCodeForCausalLM(LlamaForCausalLM):
    decoder_layer: type[ParallelResidualLayer] = GPTBigCodeBlock
    lora_parts = renamed_lora_parts
    per_head_qkv = True  # without multi_query, c_attn's rows are per head [q_h, k_h, v_h] (GPT-2's: all q, k, v)
    # (older checkpoints store the causal mask as buffers)
    ignored_suffixes = LlamaForCausalLM.ignored_suffixes + (".attn.bias", ".attn.masked_bias")

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.raw.get("add_cross_attention"):
            raise ValueError("GPTBigCode with cross-attention (add_cross_attention) is not supported")
        super().__init__(cfg, backend_cls, max_positions)
        eps = float(cfg.raw.get("layer_norm_epsilon") or 1e-5)
        self.norm = LayerNorm(cfg.hidden_size, eps)
        self.wpe = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Optional[DecodeBatch] = None, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        return self.run_layers(positions, x + self.wpe(positions), kv_caches, decode)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """GPTBigCode's names in Llama's spelling; the fused c_attn split into q/k/v (whole checkpoint tensors: their
        loaders take each rank's heads, or the one shared kv head)."""
        heads, dim, kv = self.cfg.num_heads, self.cfg.head_dim, self.cfg.num_kv_heads
        for name, t in weights:
            name = to_ours(name, _NAMES, "transformer.")
            m = _C_ATTN.match(name)
            if m is None:
                yield name, t
                continue
            layer, suffix = m.groups()
            rows = (heads + 2 * kv) * dim
            if self.per_head_qkv:  # grouped by kv head: multi_query [q; k; v], else per head [q_h, k_h, v_h]
                parts = fused_qkv_parts(name, t, kv, dim, rows, "GPTBigCode")
            else:  # GPT-2's [all q; all k; all v]: one group, of one query "head" as wide as all of them
                parts = fused_qkv_parts(name, t, 1, kv * dim, rows, "GPT-2")
            for proj, part in zip(("q", "k", "v"), parts):
                yield f"{layer}.self_attn.{proj}_proj.{suffix}", part

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        return to_theirs(re.sub(r"\.self_attn\.[qkv]_proj\.", ".attn.c_attn.", name), _NAMES, "transformer.")
