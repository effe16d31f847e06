"""Gemma 4 (text: Gemma4ForCausalLM, and the text model of Gemma4ForConditionalGeneration, which every Gemma 4
release is). Gemma 3's decoder (four norms per layer, per-head q/k norms, sliding and global layers, a scaled
embedding, soft-capped logits), with these differences:

- norms scale by w, not 1 + w (in fp32, then cast); v is RMS-normalised too, without a scale; attention scores are
  not scaled (the q/k norms take care of it);
- the global layers have their own geometry: wider heads (`global_head_dim`) and, with `attention_k_eq_v`, their
  own kv-head count (`num_global_key_value_heads`) and no v projection: v is k's projection, normalised without
  rotation. Their rotary is "proportional": the first `partial_rotary_factor` of each half-head's frequencies turn
  (exponents over the whole head), the rest stay still. The runner gives each layer a cache of its own geometry;
- KV sharing (`num_kv_shared_layers`): the last layers compute no k / v; each reads the cache of the last earlier
  layer of its kind (`kv_source`), which keeps no other copy (the runner allocates no cache for them), and its MLP
  may be twice as wide (`use_double_wide_mlp`);
- per-layer embeddings (PLE, `hidden_size_per_layer_input`): a second embedding table gives every token a small
  vector per layer, mixed with a projection of the token's embedding; after its MLP, each layer adds
  norm(proj(gelu(gate(x)) * vector)) to the stream;
- a MoE block (`enable_moe_block`, the 26B-A4B model) beside the dense MLP: its router reads the stream before the
  MLP (RMS-normalised, scaled), a softmax top-k renormalised and scaled per expert; the experts gate with GELU;
- each layer's output is multiplied by a learned `layer_scalar`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import GemmaMLP, GemmaRMSNorm, gemma_layer_types
from streamer.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RotaryEmbedding,
    VocabEmbedding,
    tp_all_reduce,
)
from streamer.models.llama import Attention, LlamaForCausalLM
from streamer.models.moe import SparseMoE, unstack_experts

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma4RMSNorm(GemmaRMSNorm):
    """x / rms(x) * w, in fp32, then cast."""

    offset = 0.0


def rms_norm_unscaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, cast back (Gemma 4's v norm and router norm have no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class LayerPlan:
    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # no v projection: v is k's projection (normalised, not rotated)
    kv_source: int  # the layer whose KV cache it attends over (itself, or an earlier one it shares)
    intermediate_size: int  # its dense MLP's


def layer_plans(cfg: ModelConfig) -> list[LayerPlan]:
    """Each layer's geometry and KV source, from config.json: transformers writes `per_layer_config` (the global
    layers' head_dim and kv heads by index); configs without it give `global_head_dim` (default 512) and, with
    `attention_k_eq_v`, `num_global_key_value_heads`."""
    raw, n = cfg.raw, cfg.num_layers
    kinds = gemma_layer_types(raw, n, 6)
    if len(kinds) != n:
        raise ValueError(f"layer_types has {len(kinds)} entries for {n} layers")
    kinds[-1] = FULL  # (as transformers forces it)
    k_eq_v = bool(raw.get("attention_k_eq_v"))
    per_layer = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items() if str(k).isdigit()}
    global_kv = raw.get("num_global_key_value_heads") if k_eq_v else None
    shared = int(raw.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers must be in [0, {n}) for {n} layers, got {shared}")
    last_of = {kind: i for i, kind in enumerate(kinds[:first_shared])}
    plans = []
    for i, kind in enumerate(kinds):
        over = per_layer.get(i) or ({} if kind == SLIDING else
                                    {"head_dim": raw.get("global_head_dim") or 512,
                                     **({"num_key_value_heads": global_kv} if global_kv else {})})
        if i >= first_shared and kind not in last_of:
            raise ValueError(f"layer {i} ({kind}) shares the KV of an earlier {kind} layer, but none of layers "
                             f"0..{first_shared - 1} is one")
        wide = 2 if raw.get("use_double_wide_mlp") and i >= first_shared else 1
        plans.append(LayerPlan(kind, int(over.get("head_dim") or cfg.head_dim),
                               int(over.get("num_key_value_heads") or cfg.num_kv_heads),
                               k_eq_v and kind == FULL, i if i < first_shared else last_of[kind],
                               cfg.intermediate_size * wide))
    return plans


def _rotaries(cfg: ModelConfig, plans: list[LayerPlan], max_positions: int) -> dict[str, RotaryEmbedding]:
    """A rotary table per layer kind, over its whole head (`rope_parameters` per kind; the global layers'
    default to proportional rotary over a quarter of the frequencies, base 1e6)."""
    params = cfg.raw.get("rope_parameters") or {}
    defaults = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    out = {}
    for kind in {p.kind for p in plans}:
        p = dict(params.get(kind) or defaults[kind])
        head_dim = next(x.head_dim for x in plans if x.kind == kind)
        theta = float(p.pop("rope_theta", defaults[kind]["rope_theta"]))
        scaling = p if p.get("rope_type", "default") != "default" else None
        out[kind] = RotaryEmbedding(head_dim, max_positions, theta, scaling)
    return out


class Gemma4Attention(Attention):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, plan: LayerPlan, index: int) -> None:
        geometry = replace(cfg, head_dim=plan.head_dim, num_kv_heads=plan.num_kv_heads)
        window = cfg.raw.get("sliding_window") if plan.kind == SLIDING else None
        super().__init__(geometry, backend_cls, rotary, scale=1.0, sliding_window=window,
                         qk_norm_cls=Gemma4RMSNorm)
        self.attn.spec.causal_only = plan.kind == FULL  # (image tokens see each other both ways in sliding layers)
        self.eps = cfg.rms_norm_eps
        self.shared = plan.kv_source != index
        self.k_eq_v = plan.k_eq_v
        q_total = cfg.num_heads * plan.head_dim
        if self.shared:  # q alone: k and v come from the source layer, which stored them in the cache it reads
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_total], shard_names=["q"])
            self.k_norm = None
            self.attn.spec.kv_shared = True
        elif self.k_eq_v:
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_total, self.kv_size * self.qkv_proj.tp_size],
                                                 shard_names=["q", "k"], replicable=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None,
                shared_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Returns (output, this step's (k, v)): a KV-shared layer's are its source's (a backend whose prefill reads
        a fresh request's k / v as given, not from the cache, needs them; it stores nothing: `kv_shared`)."""
        if self.shared:
            assert shared_kv is not None, "a KV-shared layer needs its source layer's k and v"
            q = self.q_norm(self.qkv_proj(x).view(-1, self.num_heads, self.head_dim))
            q, _ = self.rotary(positions, q, q[:, :1])
            k, v = shared_kv
        else:
            if self.k_eq_v:
                q, k = self.qkv_proj(x).split([self.q_size, self.kv_size], dim=-1)
                q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
                v = k
            else:
                q, k, v = self.project(x)
            v = rms_norm_unscaled(v, self.eps)
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        return self.attend(q, k, v, kv_cache, decode), (k, v)


class Gemma4MoE(SparseMoE):
    """The experts beside a layer's dense MLP: routed by the stream before the MLP, fed its own norm of it."""

    activation = "gelu_tanh"

    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        super().__init__(cfg.hidden_size, raw["moe_intermediate_size"], raw["num_experts"], raw["top_k_experts"],
                         norm_topk_prob=True, fp32_weights=True)
        self.eps = cfg.rms_norm_eps
        self.root = cfg.hidden_size ** -0.5
        self.router_scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(raw["num_experts"]), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = rms_norm_unscaled(x, self.eps) * self.router_scale * self.root
        weights, ids = super().route(h)  # (softmax, top-k, renormalised; fp32)
        return weights * self.per_expert_scale[ids], ids

    def forward(self, x: torch.Tensor, stream: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights, ids = self.route(x if stream is None else stream)
        out = self.run_experts(x, weights, ids)
        if self.tp_size > 1:
            tp_all_reduce(out)
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, plan: LayerPlan, index: int) -> None:
        super().__init__()
        raw, size, eps = cfg.raw, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, backend_cls, rotary, plan, index)
        dense = GemmaMLP(replace(cfg, intermediate_size=plan.intermediate_size))
        self.moe = bool(raw.get("enable_moe_block"))
        # (with experts, `mlp` is the MoE, as the loader files experts under `mlp`; the dense MLP is `dense_mlp`)
        if self.moe:
            self.dense_mlp, self.mlp = dense, Gemma4MoE(cfg)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(size, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps)
        else:
            self.mlp = dense
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(size, eps))
        self.ple = int(raw.get("hidden_size_per_layer_input") or 0)
        if self.ple:
            self.per_layer_input_gate = ReplicatedLinear(size, self.ple)
            self.per_layer_projection = ReplicatedLinear(self.ple, size)
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch], shared_kv: Optional[tuple[torch.Tensor, torch.Tensor]],
                per_layer: Optional[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h, kv = self.self_attn(positions, self.input_layernorm(x), kv_cache, decode, shared_kv)
        x = x + self.post_attention_layernorm(h)
        if self.moe:
            h = self.post_feedforward_layernorm_1(self.dense_mlp(self.pre_feedforward_layernorm(x)))
            h = h + self.post_feedforward_layernorm_2(self.mlp(self.pre_feedforward_layernorm_2(x), x))
        else:
            h = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(h)
        if per_layer is not None:
            h = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar, kv


class Gemma4ForCausalLM(LlamaForCausalLM):
    takes_prompt_embeds = True  # (False with per-layer embeddings: they are looked up by token id)

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        raw = cfg.raw
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if raw.get("use_bidirectional_attention") == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' (an encoder) is not supported")
        if raw.get("enable_moe_block") and not all(raw.get(k) for k in ("num_experts", "top_k_experts",
                                                                         "moe_intermediate_size")):
            raise ValueError("a Gemma 4 config with enable_moe_block needs num_experts, top_k_experts and "
                             "moe_intermediate_size")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 4 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
        self.plans = layer_plans(cfg)
        rotaries = _rotaries(cfg, self.plans, max_positions)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, backend_cls, rotaries[p.kind], p, i)
                                    for i, p in enumerate(self.plans))
        self.kv_source = [p.kv_source for p in self.plans]
        self.kv_producers = {p.kv_source for i, p in enumerate(self.plans) if p.kv_source != i}
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self.softcap = raw.get("final_logit_softcapping")
        self.ple = int(raw.get("hidden_size_per_layer_input") or 0)
        if self.ple:
            n = cfg.num_layers * self.ple
            self.embed_tokens_per_layer = VocabEmbedding(int(raw.get("vocab_size_per_layer_input")
                                                             or cfg.vocab_size), n)
            self.per_layer_model_projection = ReplicatedLinear(cfg.hidden_size, n)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple, cfg.rms_norm_eps)
            self.takes_prompt_embeds = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the dtype first, as transformers

    def per_layer_inputs(self, token_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple]: (norm(proj(x) / sqrt(hidden)) + the tokens' own per-layer embeddings) / sqrt(2)."""
        t, n = x.shape[0], self.cfg.num_layers
        own = self.embed_tokens_per_layer(token_ids)
        own = own * torch.tensor(float(self.ple) ** 0.5, dtype=own.dtype)
        proj = self.per_layer_model_projection(x) * (self.cfg.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.view(t, n, self.ple))
        return (proj + own.view(t, n, self.ple)) * (2.0 ** -0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Optional[DecodeBatch] = None, inputs_embeds: Optional[torch.Tensor] = None,
                per_layer_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As LlamaForCausalLM's. `per_layer_ids`: the ids whose per-layer embeddings the tokens take (images'
        placeholders take the pad token's: models/vlm.py); default input_ids."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids if per_layer_ids is None else per_layer_ids, x) \
            if self.ple else None
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            src = self.kv_source[i]
            x, kv = layer(positions, x, kv_caches[src], decode, shared.get(src) if src != i else None,
                          None if per_layer is None else per_layer[:, i])
            if i in self.kv_producers:
                shared[i] = kv
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ------------------------------------------------------------------ weights
    def rename_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """transformers' names in ours: a Gemma4ForConditionalGeneration checkpoint's text model out of
        `model.language_model.` (its vision and audio towers skipped when served as text alone); with the MoE
        block, the dense MLP as `dense_mlp`, the router and stacked experts under `mlp`; the KV-shared layers' k / v
        projections and norms (which transformers ignores too) dropped."""
        def renamed():
            for name, t in weights:
                if name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                elif name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                      "model.embed_audio.")):
                    if self.cfg.text_only_of:
                        continue
                if not name.startswith("model."):  # (the vision tower's and projector's: models/vlm.py)
                    yield name, t
                    continue
                parts = name.split(".")
                if len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn" \
                        and self.kv_source[int(parts[2])] != int(parts[2]) \
                        and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    continue
                if self.cfg.raw.get("enable_moe_block"):
                    name = (name.replace(".mlp.", ".dense_mlp.").replace(".experts.", ".mlp.experts.")
                            .replace(".router.proj.", ".mlp.gate.").replace(".router.scale", ".mlp.router_scale")
                            .replace(".router.per_expert_scale", ".mlp.per_expert_scale"))
                yield name, t
        return unstack_experts(renamed(), self.cfg) if self.cfg.raw.get("enable_moe_block") else renamed()

    def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
        name, shard = super().param_name(ckpt_name)
        layer = self._layer_of(name) if shard == "q" else None
        if layer is not None and self.layers[layer].self_attn.shared:
            return name, None  # (a KV-shared layer's projection is q alone)
        return name, shard

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
        layer = self._layer_of(name)
        if layer is not None and self.layers[layer].self_attn.shared:
            return None
        return super()._fused_parts(name, tensor)

    @staticmethod
    def _layer_of(name: str) -> Optional[int]:
        parts = name.split(".")
        return int(parts[1]) if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() else None

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        if self.cfg.raw.get("enable_moe_block"):
            name = (name.replace(".mlp.gate.", ".router.proj.").replace(".mlp.router_scale", ".router.scale")
                    .replace(".mlp.per_expert_scale", ".router.per_expert_scale")
                    .replace(".mlp.experts.", ".experts.").replace(".dense_mlp.", ".mlp."))
        return name.replace("model.", "model.language_model.", 1) if self.cfg.text_only_of else name
