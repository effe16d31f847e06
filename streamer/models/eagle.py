"""EAGLE draft heads (EAGLE-1 and EAGLE-3) for speculative decoding over a Llama-shaped target.

An EAGLE head is a one-layer (EAGLE-1: a few layers) transformer that drafts from the target's own features
instead of from tokens alone: at position i it reads the embedding of token i + 1 beside a feature of position i,
and predicts token i + 2. The first draft of a step takes the target's feature; each later one takes the head's
own output from the pass before.
- EAGLE-1 (`EagleLlamaForCausalLM`, SafeAILab's EAGLE-* checkpoints): feature = the target's final hidden state
  (after its norm). `fc` fuses [embedding, feature] (2H -> H); the first layer has no input norm; the output
  (residual stream, no final norm) goes through the target's LM head.
- EAGLE-3 (`LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM`, EAGLE3-* checkpoints): feature = `fc` of three of
  the target's residual streams (3H -> H; by default at the inputs of layers 2, L/2 and L - 3, or the config's
  `eagle_aux_hidden_state_layer_ids`). The layer normalises embedding and feature apart and attends over both
  side by side (q/k/v read 2H); its own head covers `draft_vocab_size` tokens, mapped to the target's by `d2t`.
The runner side (feeding features, the head's KV cache, the step's passes) is streamer/spec_decode/eagle.py.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, VocabEmbedding
from streamer.models.llama import DecoderLayer, LlamaForCausalLM

# (the registry's two draft heads; EAGLE-3's other spelling, LlamaForCausalLMEagle3, is served as EAGLE3)
EAGLE1 = "EagleLlamaForCausalLM"
EAGLE3 = "Eagle3LlamaForCausalLM"


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input streams EAGLE-3 heads are trained on, unless their config says otherwise."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle1Layer(DecoderLayer):
    """Llama's decoder layer; the first one of the head has no input norm (`fc`'s output goes in as is)."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index)
        if index == 0:
            self.input_layernorm = nn.Identity()  # type: ignore[assignment]


class Eagle3Layer(DecoderLayer):
    """Llama's layer over [input_layernorm(embedding), hidden_norm(feature)]: q/k/v read 2H; the feature (or,
    with `norm_before_residual`, its normed self) starts the residual stream."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index)
        attn = self.self_attn
        attn.qkv_proj = ColumnParallelLinear(2 * cfg.hidden_size, attn.qkv_proj.output_sizes,
                                             bias=cfg.attention_bias, shard_names=["q", "k", "v"], replicable=True)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = bool(cfg.raw.get("norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor,  # type: ignore[override]
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        h = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = self.self_attn(positions, h, kv_cache, decode)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class EagleDraftModel(LlamaForCausalLM):
    """Both EAGLE versions (by `cfg.architecture`). `forward(ids, positions, kv_caches, decode, feature)` returns
    (what the LM head reads, the feature for the next pass); `combine(target_features)` makes a first pass's
    feature from what the target gives (EAGLE-3: its three streams through `fc`)."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        self.version = 3 if cfg.architecture == EAGLE3 else 1
        self.decoder_layer = Eagle3Layer if self.version == 3 else Eagle1Layer  # type: ignore[assignment]
        if cfg.raw.get("add_para_norm"):
            raise ValueError("EAGLE heads with add_para_norm (HASS) are not supported")
        super().__init__(cfg, backend_cls, max_positions)
        h = cfg.hidden_size
        if self.version == 3:
            if cfg.num_layers != 1:
                raise ValueError(f"an EAGLE-3 head has one layer; this config has {cfg.num_layers}")
            target_h = int(cfg.raw.get("target_hidden_size") or h)
            self.fc = ColumnParallelLinear(3 * target_h, [h])
            self.draft_vocab = int(cfg.raw.get("draft_vocab_size") or cfg.vocab_size)
            self.lm_head = VocabEmbedding(self.draft_vocab, h)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64), persistent=False)
        else:
            self.fc = ColumnParallelLinear(2 * h, [h], bias=True)  # (a checkpoint without fc.bias keeps zeros)
            self.fc.bias.data.zero_()
            self.lm_head = None
            self.norm = None  # type: ignore[assignment]  # the head's output is read as it is
        self.own_embeddings = False  # set when the checkpoint has them; otherwise the target's are shared
        self.target: Optional[LlamaForCausalLM] = None  # (EAGLE-1 reads its LM head)

    def share_target(self, target: LlamaForCausalLM) -> None:
        """Use the target's embeddings (unless the head has its own) and, for EAGLE-1, its LM head."""
        if not self.own_embeddings:
            if target.embed_tokens.weight.shape[1] != self.cfg.hidden_size:
                raise ValueError("the EAGLE head's hidden size differs from the target's and it has no embeddings")
            self.embed_tokens = target.embed_tokens
        if self.version == 1:
            object.__setattr__(self, "target", target)  # not a submodule: its weights are the target's

    def combine(self, target_features: torch.Tensor) -> torch.Tensor:
        return self.fc(target_features) if self.version == 3 else target_features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                kv_caches: list[torch.Tensor], decode: Optional[DecodeBatch] = None,
                feature: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if feature is None:  # (the runner's warm-up steps)
            feature = torch.zeros(len(input_ids), self.cfg.hidden_size, dtype=self.embed_tokens.weight.dtype,
                                  device=input_ids.device)
        embeds = self.embed_tokens(input_ids)
        if self.version == 3:
            x, residual = self.layers[0](positions, embeds, feature, kv_caches[0], decode)
            return self.norm(x, residual)[0], x + residual
        x, residual = self.fc(torch.cat([embeds, feature], dim=-1)), None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv, decode)
        out = x if residual is None else x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.version == 1:
            assert self.target is not None, "share_target() first"
            return self.target.compute_logits(hidden)
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()  # type: ignore[union-attr]

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft token (a target token id) of each row."""
        best = self.compute_logits(hidden).argmax(dim=-1)
        return best + self.d2t[best] if self.version == 3 else best

    def pack_head_for_cpu(self) -> None:
        pass  # (a small head: plain matmuls)

    # ------------------------------------------------------------------ weights
    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d":
                continue  # (the target -> draft vocabulary mask: d2t alone maps drafts back)
            if name == "d2t":
                self.d2t.copy_(t.to(torch.int64))
                continue
            if name == "embed_tokens.weight":
                self.own_embeddings = True
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.rename_weights(weights))

    def expected_weights(self) -> set[str]:
        optional = {"fc.bias"} | (set() if self.own_embeddings else {"embed_tokens.weight"})
        return super().expected_weights() - optional
