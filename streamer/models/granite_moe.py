"""IBM Granite 3.x MoE (GraniteMoeForCausalLM: granite-3.0-1b-a400m, granite-3.0-3b-a800m, granite-3.1-*-a*m and
their -instruct versions; PowerMoE-3b) and GraniteMoeShared (GraniteMoeSharedForCausalLM: the same with a shared
MLP, e.g. the MoE students of Granite 4 previews). Granite's decoder (models/granite.py: embeddings scaled by
`embedding_multiplier`, each branch by `residual_multiplier`, the softmax by `attention_multiplier`, logits divided
by `logits_scaling`) whose MLP is always sparse (models/moe.py):

- the router keeps each token's top `num_experts_per_tok` logits and softmaxes them (= softmax, top-k, renormalise),
  the weights cast to the model's dtype;
- GraniteMoeShared adds a dense SwiGLU of `shared_intermediate_size` (when not 0) to the experts' output, before the
  residual multiplier.

Checkpoint names: the Hub's store each layer's experts fused, `block_sparse_moe.input_linear.weight` [E, 2I, H] (each
expert's gate rows, then its up rows) and `output_linear.weight` [E, H, I] (models/moe.unfuse_experts splits them per
expert), the router as `block_sparse_moe.router.layer.weight`, the shared MLP as `shared_mlp.input_linear` ([gate;
up]) / `output_linear`; transformers 5's spellings (`block_sparse_moe.experts.gate_up_proj` / `down_proj`,
`router.weight`) load too. 4-bit (GPTQ / AWQ) experts are not covered: the fused 3-D expert tensors have no
per-expert quantized form to read.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.granite import GraniteDecoderLayer, GraniteForCausalLM
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, add_and_norm
from streamer.models.moe import SparseMoE, unfuse_experts

_SHARED = "GraniteMoeSharedForCausalLM"
_ROUTER = re.compile(r"^(.*)\.block_sparse_moe\.router\.(?:layer\.)?weight$")
_SHARED_MLP = re.compile(r"^(.*)\.shared_mlp\.(input|output)_linear\.weight$")


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        self.residual_multiplier = float(raw.get("residual_multiplier", 1.0))
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        # (named `mlp`: the loader puts the experts' matrices into `layers.N.mlp.w13 / w2`)
        self.mlp = SparseMoE(cfg.hidden_size, cfg.intermediate_size, int(raw.get("num_local_experts", 8)),
                             int(raw.get("num_experts_per_tok", 2)), norm_topk_prob=True)
        shared = int(raw.get("shared_intermediate_size") or 0) if cfg.architecture == _SHARED else 0
        self.shared_mlp: Optional[MLP] = MLP(cfg, shared) if shared else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        h = self.self_attn(positions, h, kv_cache, decode) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        out = self.mlp(h)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(h)
        return out * self.residual_multiplier, residual


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """GraniteMoeForCausalLM and GraniteMoeSharedForCausalLM (the shared MLP is read from the config)."""

    decoder_layer = GraniteMoeDecoderLayer

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in unfuse_experts(weights):
            router = _ROUTER.match(name)
            shared = _SHARED_MLP.match(name)
            if router is not None:
                yield f"{router.group(1)}.mlp.gate.weight", t
            elif shared is not None and isinstance(t, torch.Tensor):
                prefix, kind = shared.groups()
                if kind == "input":
                    gate, up = t.chunk(2, dim=0)
                    yield f"{prefix}.shared_mlp.gate_proj.weight", gate
                    yield f"{prefix}.shared_mlp.up_proj.weight", up
                else:
                    yield f"{prefix}.shared_mlp.down_proj.weight", t
            else:
                yield name, t
