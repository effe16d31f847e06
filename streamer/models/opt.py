"""OPT (OPTForCausalLM: facebook/opt-125m to opt-66b, OPT-IML, and Galactica, trained in OPT's shape). The Llama
decoder's attention and weight loading, with OPT's differences:

- no rotary: learned absolute position embeddings (`embed_positions`, max_position_embeddings + 2 rows) looked up at
  position + 2 (OPT's offset: its first two rows are never read) and added to the token embeddings;
- biases on q, k, v, `out_proj` (o_proj) and the MLP's `fc1` / `fc2`, unless `enable_bias` is false;
- the MLP is fc2(act(fc1(x))) with ReLU (`activation_function`; Galactica's is GELU), no gate (models/arcee.py UpMLP);
- LayerNorms with a bias, eps 1e-5 (neither weight nor bias with `layer_norm_elementwise_affine` false):
  `self_attn_layer_norm` and `final_layer_norm` in each layer, `final_layer_norm` after the last;
- `do_layer_norm_before` false (opt-350m): post-LN layers, h = ln1(x + attn(x)), out = ln2(h + mlp(h)), and no
  final norm (nor with `_remove_final_layer_norm`);
- `word_embed_proj_dim` narrower than hidden_size (opt-350m: 512 of 1024): embeddings (and the tied LM head) that
  wide, a bias-less `project_in` widening them into the layers and `project_out` narrowing the final hidden states
  (which are then that wide: transformers' last_hidden_state);
- `ffn_dim` (the MLP's width), the LM head tied to `embed_tokens` by default, names under `model.decoder.`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.arcee import UNGATED_PACKED, UpMLP
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import ParallelResidualLayer, renamed_lora_parts, to_ours, to_theirs
from streamer.models.layers import GELU_APPROXIMATE, LayerNorm, ReplicatedLinear, RotaryEmbedding, VocabEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM

POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding's
_EPS = 1e-5  # (nn.LayerNorm's default: OPT's configs name no eps)


def opt_activation(cfg: ModelConfig) -> nn.Module:
    act = cfg.raw.get("activation_function") or "relu"
    if act == "relu":
        return nn.ReLU()
    if act not in GELU_APPROXIMATE:
        raise ValueError(f"OPT with activation_function {act!r} is not supported (relu, {', '.join(GELU_APPROXIMATE)} "
                         "are)")
    return nn.GELU(approximate=GELU_APPROXIMATE[act])


class AddOnly(nn.Module):
    """The final "norm" of an OPT without one: the last layer's branch added to the stream, nothing more."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return x
        x = x + residual
        return x, x


class OPTDecoderLayer(ParallelResidualLayer):
    """Pre-LN (Llama's sequential order), or post-LN where `do_layer_norm_before` is false."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        self.self_attn = Attention(dataclasses.replace(cfg, qk_norm=False, sliding_window=None), backend_cls, rotary,
                                   use_rope=False)  # (cfg.attention_bias: enable_bias, o_proj's too)
        self.mlp = UpMLP(cfg, opt_activation(cfg), bias=cfg.attention_bias)
        affine = bool(raw.get("layer_norm_elementwise_affine", True))
        self.input_layernorm = LayerNorm(cfg.hidden_size, _EPS, affine)  # (self_attn_layer_norm)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, _EPS, affine)  # (the layer's final_layer_norm)
        self.parallel = False
        self.norm_before = bool(raw.get("do_layer_norm_before", True))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        if self.norm_before:
            return super().forward(positions, x, residual, kv_cache, decode)
        # Post-LN: each sum is normalised before it goes on, so nothing is left for the next layer to add.
        stream = x if residual is None else x + residual
        h = self.input_layernorm(stream + self.self_attn(positions, stream, kv_cache, decode))
        return self.post_attention_layernorm(h + self.mlp(h)), None


# checkpoint name fragment -> ours (after `model.decoder.` became `model.`); the decoder's final_layer_norm first
_NAMES = (("model.final_layer_norm.", "model.norm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
          (".self_attn_layer_norm.", ".input_layernorm."), (".final_layer_norm.", ".post_attention_layernorm."),
          (".fc1.", ".mlp.up_proj."), (".fc2.", ".mlp.down_proj."))


class OPTForCausalLM(LlamaForCausalLM):
    decoder_layer = OPTDecoderLayer
    packed = UNGATED_PACKED  # (fc1 is the MLP's up_proj, no gate to pack it with)
    lora_parts = renamed_lora_parts

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        raw, hidden = cfg.raw, cfg.hidden_size
        self.embed_positions = VocabEmbedding(cfg.max_position_embeddings + POSITION_OFFSET, hidden)
        self.has_final_norm = bool(raw.get("do_layer_norm_before", True)) and not raw.get("_remove_final_layer_norm")
        affine = bool(raw.get("layer_norm_elementwise_affine", True))
        self.norm: nn.Module = LayerNorm(hidden, _EPS, affine) if self.has_final_norm else AddOnly()
        width = raw.get("word_embed_proj_dim") or hidden
        self.output_width = width  # the final hidden states' (what embeddings pool: streamer/engine/pooling.py)
        self.project_in: Optional[ReplicatedLinear] = None
        self.project_out: Optional[ReplicatedLinear] = None
        if width != hidden:  # embeddings (and the head) narrower than the layers
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, width)
            if self.lm_head is not None:
                self.lm_head = VocabEmbedding(cfg.vocab_size, width)
            self.project_in = ReplicatedLinear(width, hidden)
            self.project_out = ReplicatedLinear(hidden, width)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.from_input_embeddings(self.embed_tokens(input_ids))

    @property
    def input_width(self) -> int:
        return self.output_width

    def from_input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.project_in is None else self.project_in(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Optional[DecodeBatch] = None, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = self.run_layers(positions, x + self.embed_positions(positions + POSITION_OFFSET), kv_caches, decode)
        return h if self.project_out is None else self.project_out(h)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """OPT's names in Llama's spelling (`decoder.` dropped; the Hub's older checkpoints lack `model.` too). A
        final_layer_norm of a model without one is skipped, as transformers skips it."""
        for name, t in weights:
            if not name.startswith("lm_head."):
                name = "model." + name.removeprefix("model.").removeprefix("decoder.")
            if name.startswith("model.final_layer_norm.") and not self.has_final_norm:
                continue
            yield to_ours(name, _NAMES), t

    def checkpoint_name(self, internal: str) -> str:
        name = to_theirs(super().checkpoint_name(internal), _NAMES)
        return "model.decoder." + name.removeprefix("model.") if name.startswith("model.") else name
