"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM): Granite's multipliers (models/granite.py) over layers that are
either attention (paged KV cache, rotary only with `position_embedding_type: rope`, else NoPE) or a Mamba2 mixer
(models/mamba.py: per-request recurrent state, no KV cache), by `layer_types` / `layers_block_type`
("mamba" / "linear_attention" vs "attention" / "full_attention"). Every layer's MLP is a shared (dense) SwiGLU of
`shared_intermediate_size`, plus a sparse MoE (softmax over the top-k router logits) when `num_local_experts` > 0.

Checkpoint names: `mamba.*` as ours; `shared_mlp.input_linear` = [gate; up], `shared_mlp.output_linear` = down;
`block_sparse_moe.input_linear` [E, 2I, H] = each expert's [gate; up], `output_linear` [E, H, I] = down,
`router.layer` = the router (transformers 5's spellings `experts.gate_up_proj`, `experts.down_proj`, `router.weight`
too).

Bamba (BambaForCausalLM) is the same stack without Granite's multipliers or experts: attention layers at
`attn_layer_indices` (rotary over half of each head), a dense SwiGLU `feed_forward` after `pre_ff_layernorm`, the
final norm named `final_layernorm`."""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.granite import GraniteForCausalLM
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, add_and_norm
from streamer.models.mamba import HybridModel, MambaMixer
from streamer.models.moe import SparseMoE

_MAMBA_KINDS = ("mamba", "linear_attention")
_ATTENTION_KINDS = ("attention", "full_attention")


def hybrid_layer_kinds(raw: dict[str, Any], num_layers: int) -> list[str]:
    """"mamba" or "attention" per layer, from `layer_types` (or the older `layers_block_type`; Bamba's
    `attn_layer_indices`)."""
    if "attn_layer_indices" in raw and not raw.get("layer_types"):
        attn = set(raw.get("attn_layer_indices") or ())
        return ["attention" if i in attn else "mamba" for i in range(num_layers)]
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * num_layers
    if len(kinds) < num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    out = []
    for k in kinds[:num_layers]:
        if k not in _MAMBA_KINDS + _ATTENTION_KINDS:
            raise ValueError(f"unsupported layer type {k!r} in a hybrid model (supported: "
                             f"{', '.join(_MAMBA_KINDS + _ATTENTION_KINDS)})")
        out.append("mamba" if k in _MAMBA_KINDS else "attention")
    return out


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        bamba = cfg.architecture == "BambaForCausalLM"
        if bamba and raw.get("mlp_bias"):
            raise ValueError("BambaForCausalLM with mlp_bias is not supported")
        self.residual_multiplier = float(raw.get("residual_multiplier", 1.0))
        self.self_attn: Optional[Attention] = None
        self.mamba: Optional[MambaMixer] = None
        if hybrid_layer_kinds(raw, cfg.num_layers)[index] == "mamba":
            self.mamba = MambaMixer(cfg.hidden_size, raw, cfg.rms_norm_eps)
        else:
            scale = None if bamba else float(raw.get("attention_multiplier", 1.0))
            self.self_attn = Attention(cfg, backend_cls, rotary, scale=scale,
                                       use_rope=bamba or raw.get("position_embedding_type") == "rope")
        experts = 0 if bamba else int(raw.get("num_local_experts") or 0)
        # (named `mlp`: the loader puts experts' matrices into `layers.N.mlp.w13 / w2`)
        self.mlp = SparseMoE(cfg.hidden_size, cfg.intermediate_size, experts, int(raw.get("num_experts_per_tok", 2)),
                             norm_topk_prob=True) if experts else None
        self.shared_mlp = MLP(cfg, cfg.intermediate_size if bamba else int(raw.get("shared_intermediate_size", 1024)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        if self.mamba is not None:
            h = self.mamba(h, decode)
        else:
            h = self.self_attn(positions, h, kv_cache, decode)  # type: ignore[misc]
        h, residual = self.post_attention_layernorm(h * self.residual_multiplier, residual)
        out = self.shared_mlp(h)
        if self.mlp is not None:
            out = self.mlp(h) + out
        return out * self.residual_multiplier, residual


_LAYER = re.compile(r"^(model\.layers\.\d+)\.(shared_mlp|block_sparse_moe)\.(.+)$")


class GraniteMoeHybridForCausalLM(HybridModel, GraniteForCausalLM):
    decoder_layer = HybridDecoderLayer

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        MambaMixer.check_split(tp, "mamba_n_heads", int(cfg.raw.get("mamba_n_heads", 128)), "mamba_n_groups",
                               int(cfg.raw.get("mamba_n_groups", 1)))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            m = _LAYER.match(name)
            if m is None:
                yield name, t
                continue
            prefix, part, rest = m.groups()
            if part == "shared_mlp":
                if rest == "input_linear.weight":
                    gate, up = t.chunk(2, dim=0)
                    yield f"{prefix}.shared_mlp.gate_proj.weight", gate
                    yield f"{prefix}.shared_mlp.up_proj.weight", up
                elif rest == "output_linear.weight":
                    yield f"{prefix}.shared_mlp.down_proj.weight", t
                else:
                    yield name, t
            elif rest in ("input_linear.weight", "experts.gate_up_proj"):
                for e in range(t.shape[0]):
                    gate, up = t[e].chunk(2, dim=0)
                    yield f"{prefix}.block_sparse_moe.experts.{e}.gate_proj.weight", gate
                    yield f"{prefix}.block_sparse_moe.experts.{e}.up_proj.weight", up
            elif rest in ("output_linear.weight", "experts.down_proj"):
                for e in range(t.shape[0]):
                    yield f"{prefix}.block_sparse_moe.experts.{e}.down_proj.weight", t[e]
            elif rest in ("router.layer.weight", "router.weight"):
                yield f"{prefix}.mlp.gate.weight", t
            else:
                yield name, t


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name == "model.final_layernorm.weight":
                name = "model.norm.weight"
            yield name.replace(".feed_forward.", ".shared_mlp.").replace(".pre_ff_layernorm.",
                                                                          ".post_attention_layernorm."), t

    def checkpoint_name(self, internal: str) -> str:
        if internal == "norm.weight":
            return "model.final_layernorm.weight"
        return super().checkpoint_name(internal).replace(".shared_mlp.", ".feed_forward.").replace(
            ".post_attention_layernorm.", ".pre_ff_layernorm.")
