"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM: V2, V2-Lite, V2.5, Coder-V2; DeepseekV3ForCausalLM: V3, R1,
Moonlight, Kimi-K2). The Llama decoder's skeleton (pre-norms, fused residual adds, SwiGLU) with two new parts:

- **Multi-head latent attention (MLA).** q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with `q_lora_rank`;
  kv_a_proj_with_mqa(x) = a `kv_lora_rank` latent and a `qk_rope_head_dim` rope key shared by every head;
  kv_b_proj(kv_a_layernorm(latent)) = per head a `qk_nope_head_dim` key part and a `v_head_dim` value. Each head's
  key is [k_nope, rope(k_pe)] and its query [q_nope, rope(q_pe)]. By default (`MLADims.latent_cache`) the paged
  cache holds only the normed latent and rope(k_pe), one kv "head" of kv_lora_rank + qk_rope_head_dim shared by
  every query head, and kv_b_proj is absorbed ("absorbed attention"): q_nope . k_nope = (q_nope W_UK) . latent, so
  each head's query is [q_nope W_UK, rope(q_pe)] over that one kv head, and its output, a weighted sum of latents,
  goes through W_UV to v_head_dim. Otherwise (`mla_latent_cache=False`) MLA is computed as ordinary multi-head
  attention: the cache holds every head's K and V, V padded with zeros to K's width (the backends and the cache
  take one head_dim), and the output is sliced back to v_head_dim. Either way the softmax scale is
  qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under rope scaling, as transformers has it.
- **DeepSeekMoE.** The first `first_k_dense_replace` layers (and those off the `moe_layer_freq` beat) keep a dense
  MLP; the others have `n_shared_experts` shared experts (one dense MLP, n_shared * moe_intermediate_size wide)
  added to the routed experts' output. The routed experts are models/moe.py's stacked experts; only the router
  differs (`DeepseekMoE.route`), and it runs in fp32 as transformers keeps it:
  V2: softmax scores, top-k ("greedy") or top-k within the `topk_group` groups (of `n_group`) whose best expert
  scores highest ("group_limited_greedy"), weights times `routed_scaling_factor`;
  V3: sigmoid scores; experts are *chosen* by score + `e_score_correction_bias` within the `topk_group` groups whose
  two best biased scores add up highest, but *weighted* by the unbiased scores (normalised with `norm_topk_prob`),
  times `routed_scaling_factor`.

Rotary: DeepSeek's rope dims rotate in interleaved pairs (x0, x1), (x2, x3), ... (V2 as complex numbers, V3 with
`rope_interleave`, its default). q_pe and k_pe are de-interleaved ([evens, odds]) and rotated by the ordinary
half-split rotary: the same numbers as transformers' V3 interleaved path, and V2's complex product with the pair
(real, imaginary) stored apart instead of side by side, which no dot product of q with k can tell.

Tensor parallelism splits the heads (q_proj / q_b_proj and kv_b_proj column-parallel, so each rank absorbs its own
heads' W_UK / W_UV; o_proj row-parallel); the down-projections q_a_proj and kv_a_proj_with_mqa and their norms are
small and replicated (every head needs all of their output), and so is the latent cache (each rank writes and reads
the same latents for its heads' queries); experts split along their intermediate size as every sparse MLP's do.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch, current_metadata
from streamer.attention.op import paged_attention, register_layer
from streamer.models.config import ModelConfig
from streamer.models.layers import (
    ColumnParallelLinear,
    ParallelContext,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from streamer.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE

logger = logging.getLogger("streamer")

V3 = "DeepseekV3ForCausalLM"
GLM4_MOE = "Glm4MoeForCausalLM"  # GLM-4.5's MoE is V3's (models/glm4.py): sigmoid router, correction bias, groups
# transformers' config defaults, for keys a config.json leaves out (they differ between V2, V3 and GLM-4.5)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": dict(n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=None,
                                  routed_scaling_factor=1.0, topk_method="greedy", n_group=None, topk_group=None,
                                  norm_topk_prob=False, first_k_dense_replace=0, moe_intermediate_size=1407),
    V3: dict(n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, routed_scaling_factor=2.5,
             topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True, first_k_dense_replace=3,
             moe_intermediate_size=2048),
    GLM4_MOE: dict(n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, routed_scaling_factor=1.0,
                   topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True, first_k_dense_replace=1,
                   moe_intermediate_size=1408),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def without_mtp_layers(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int,
                       ) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its multi-token-prediction layers (model.layers.<i> for i >= num_layers:
    `num_nextn_predict_layers` of them in DeepSeek-V3 and GLM-4.5 checkpoints), which transformers skips too."""
    for name, t in weights:
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            yield name, t


@dataclass(frozen=True)
class Routing:
    """A DeepSeek (or GLM-4.5) config's MoE settings, checked (`from_config`)."""

    sigmoid: bool  # V3 and GLM-4.5: sigmoid scores and e_score_correction_bias; V2: softmax
    num_experts: int  # routed experts (0: every layer dense)
    top_k: int
    n_group: int  # experts form n_group equal groups; a token's experts come from its topk_group best groups
    topk_group: int
    norm_topk_prob: bool  # (V3) the chosen experts' weights normalised to sum to 1, before the scaling factor
    scaling: float  # routed_scaling_factor
    n_shared: int
    moe_intermediate_size: int
    first_dense: int  # first_k_dense_replace
    freq: int  # moe_layer_freq

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Routing":
        raw, arch = cfg.raw, cfg.architecture
        c = {k: raw.get(k, d) for k, d in _DEFAULTS[arch].items()}
        sigmoid = arch in (V3, GLM4_MOE)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{arch} with hidden_act {act!r} is not supported (silu is)")
        if raw.get("mlp_bias"):
            raise ValueError(f"{arch} with mlp_bias=true is not supported")
        scoring = raw.get("scoring_func", "sigmoid" if sigmoid else "softmax")
        if scoring != ("sigmoid" if sigmoid else "softmax"):
            raise ValueError(f"{arch} with scoring_func {scoring!r} is not supported "
                             f"({'sigmoid' if sigmoid else 'softmax'} is)")
        method = c["topk_method"]
        methods = ("noaux_tc",) if sigmoid else ("greedy", "group_limited_greedy")
        if method not in methods:
            raise ValueError(f"{arch} with topk_method {method!r} is not supported ({', '.join(methods)})")
        experts = int(c["n_routed_experts"] or 0)
        top_k = int(c["num_experts_per_tok"] or 0)
        if experts and not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok {c['num_experts_per_tok']!r} must be 1..n_routed_experts "
                             f"({experts})")
        if not sigmoid and c["norm_topk_prob"] and top_k > 1:
            # (DeepSeek's own V2 code then normalises and drops routed_scaling_factor; transformers ignores the
            # flag; every released V2 config has it false)
            raise ValueError("DeepseekV2ForCausalLM with norm_topk_prob=true is not supported")
        grouped = sigmoid or method == "group_limited_greedy"
        n_group, topk_group = (int(c["n_group"] or 1), int(c["topk_group"] or 1)) if grouped else (1, 1)
        if experts and grouped:
            if experts % n_group or not 0 < topk_group <= n_group:
                raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not group {experts} experts")
            if sigmoid and n_group > 1 and experts // n_group < 2:
                raise ValueError(f"n_group {n_group} leaves fewer than 2 experts a group (a group scores by its "
                                 "best two)")
            if top_k > topk_group * (experts // n_group):
                raise ValueError(f"num_experts_per_tok {top_k} is more than the topk_group {topk_group} groups "
                                 f"hold ({topk_group * (experts // n_group)} experts)")
        freq = int(raw.get("moe_layer_freq") or 1)
        return cls(sigmoid, experts, top_k, n_group, topk_group, bool(c["norm_topk_prob"]),
                   float(c["routed_scaling_factor"]), int(c["n_shared_experts"] or 0),
                   int(c["moe_intermediate_size"]), int(c["first_k_dense_replace"] or 0), freq)

    def sparse(self, index: int) -> bool:
        """Whether layer `index` has the sparse MLP (DeepSeek's rule; transformers omits moe_layer_freq, which every
        released config sets to 1)."""
        return bool(self.num_experts) and index >= self.first_dense and index % self.freq == 0


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when the rope is scaled and the config has
    mscale_all_dim (transformers' `yarn_apply_mscale`; the rotary table carries the other YaRN factor)."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.get("mscale_all_dim"):
        factor = s.get("factor") or cfg.max_position_embeddings / s["original_max_position_embeddings"]
        m = yarn_mscale(float(factor), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: interleaved rope pairs laid out for the
    half-split rotary."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention over the paged cache (see the module docstring), in one of two forms.

    Latent cache (the default): per token and layer one kv head [latent, rope(k_pe)] of kv_lora_rank + qk_rope_head_dim
    values as K, and the same tensor as V (the output's rope dims are a weighted sum of rope keys, dropped: only the
    first kv_lora_rank dims, the weighted latents, go through W_UV). The cache stores V as a second copy of K because
    the backends take a K and a V of one width: 2 * 576 values a token for V3, twice the minimal latent cache; a
    backend that read V from K's first kv_lora_rank dims would halve it. Every rank holds the whole latent cache.
    MHA (`mla_latent_cache=False`): every head's K (qk_nope + qk_rope dims) and V padded to that width,
    2 * heads * max(qk_head_dim, v_head_dim) values a token: 2 * 128 * 192 = 49152 for V3 (42.7x the latent form's
    1152; 85x the minimal 576), 2 * 16 * 192 = 6144 for V2-Lite (5.3x), divided by the ranks under tensor parallelism.

    Absorbed, attention costs more arithmetic per (query, key) pair (576 against 192 dims, for H heads over one kv
    head) and reads far fewer bytes: a win for decode, which is bound by reading the cache; prefill pays it."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "MLAttention needs an MLA config (ModelConfig.mla)"
        tp = ParallelContext.size
        if cfg.num_heads % tp:
            raise ValueError(f"{cfg.num_heads} attention heads do not split over {tp} ranks")
        heads = cfg.num_heads
        self.num_heads = heads // tp
        self.latent = mla.latent_cache
        # (the runner sizes and shapes the cache by these two: latent, 1 x (kv_lora_rank + qk_rope) on every rank)
        self.num_kv_heads, self.head_dim = mla.cache_geometry(self.num_heads)
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim, self.kv_lora_rank = mla.qk_head_dim, mla.kv_lora_rank
        self.interleaved = cfg.architecture != V3 or bool(cfg.raw.get("rope_interleave", True))
        bias = cfg.attention_bias  # (transformers: on q_a_proj, kv_a_proj_with_mqa and o_proj only)
        self.q_proj: Optional[ColumnParallelLinear] = None
        self.q_a_proj: Optional[ReplicatedLinear] = None
        self.q_a_layernorm: Optional[RMSNorm] = None
        self.q_b_proj: Optional[ColumnParallelLinear] = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [heads * self.qk_dim])
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, mla.q_lora_rank, bias=bias)
            # (the latent norms keep RMSNorm's default eps in DeepSeek's code and transformers', not rms_norm_eps)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [heads * self.qk_dim])
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        # rows head by head, [k_nope, v] each: splitting the rows over ranks splits the heads. Kept in float (never
        # 4-bit or FP8, a 4-bit checkpoint's dequantized) in both forms: the latent form absorbs it (`absorb`) and
        # then frees its weight; the MHA form computes the same rounding-free maths, so the two agree under
        # quantization.
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, [heads * (self.nope + self.v_dim)])
        self.kv_b_proj.keep_float = True
        # kv_b_proj's key half per head [h, nope, kv_lora_rank] and value half transposed [h, kv_lora_rank, v_dim]
        # (this rank's heads), in the compute dtype: built by `absorb` after loading (latent form only)
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.rotary = rotary
        spec = AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, softmax_scale(cfg))
        self.attn: AttentionBackend = backend_cls(spec)
        self.layer_id = register_layer(self.attn)
        self.use_op = False  # set when the model is compiled: attention becomes an opaque custom op

    @torch.no_grad()
    def absorb(self) -> None:
        """Latent form: split kv_b_proj's loaded float weight into W_UK and W_UV, then free it (the forward pass
        never uses it; keeping it would double these weights' memory). After loading, and after each load of new
        weights in place (`unabsorb` first), into the same tensors: compiled graphs and CUDA graphs read them."""
        if not self.latent:
            return
        w = self.kv_b_proj.weight.detach()
        if not w.is_floating_point() or w.numel() == 0:  # (keep_float keeps it so; a guard against a change)
            raise RuntimeError("MLA absorption needs kv_b_proj's float weight")
        self.absorbed_shape = w.shape
        w = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        uk, uv = w[:, :self.nope].contiguous(), w[:, self.nope:].transpose(1, 2).contiguous()
        if self.w_uk is None:
            self.w_uk, self.w_uv = uk, uv
        else:
            self.w_uk.copy_(uk)
            self.w_uv.copy_(uv)
        self.kv_b_proj.weight.data = w.new_empty(0)

    def unabsorb(self) -> None:
        """Give kv_b_proj back a weight for a loader to fill (new weights in place); `absorb` again after."""
        if self.latent:
            self.kv_b_proj.weight.data = self.kv_b_proj.weight.data.new_empty(self.absorbed_shape)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # type: ignore[misc]
        q_nope, q_pe = q.view(t, h, self.qk_dim).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.unsqueeze(1)  # [T, 1, rope]: one rope key for every head
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        if self.latent:
            assert self.w_uk is not None and self.w_uv is not None, "MLAttention.absorb was not called"
            # per head q_nope [T, nope] @ W_UK [nope, kv_lora_rank]: q_lat . latent == q_nope . k_nope
            q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            q = torch.cat([q_lat, q_pe], dim=-1)  # [T, h, kv_lora_rank + rope]
            k = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, kv_lora_rank + rope]
            out = self._attend(q, k, k, kv_cache, decode)  # V = K: see the class docstring
            # per head the weighted latents [T, kv_lora_rank] @ W_UV^T [kv_lora_rank, v_dim]
            out = torch.bmm(out[..., :self.kv_lora_rank].transpose(0, 1), self.w_uv).transpose(0, 1)
            return self.o_proj(out.reshape(t, h * self.v_dim))
        kv = self.kv_b_proj(latent).view(t, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, h, self.rope)], dim=-1)
        # One width for K and V in the cache: pad the narrower with zeros (zero q/k dims add nothing to a score,
        # zero v dims are sliced off the output)
        if self.qk_dim < self.head_dim:
            q, k = (F.pad(a, (0, self.head_dim - self.qk_dim)) for a in (q, k))
        if self.v_dim < self.head_dim:
            v = F.pad(v, (0, self.head_dim - self.v_dim))
        out = self._attend(q, k, v, kv_cache, decode)
        return self.o_proj(out[..., :self.v_dim].reshape(t, h * self.v_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch]) -> torch.Tensor:
        if decode is not None:
            return self.attn.forward_decode(q, k, v, kv_cache, decode)  # type: ignore[attr-defined]
        if self.use_op:
            return paged_attention(q, k, v, kv_cache, self.layer_id)
        return self.attn.forward(q, k, v, kv_cache, current_metadata())


class DeepseekMoE(SparseMoE):
    """models/moe.py's sparse MLP (stacked experts, their loading, 4-bit experts, the all-reduce) with DeepSeek's
    router (`route`: see the module docstring) and shared experts."""

    def __init__(self, cfg: ModelConfig, routing: Routing) -> None:
        # fp32_weights: the expert outputs are scaled by the fp32 router weights, as transformers does
        super().__init__(cfg.hidden_size, routing.moe_intermediate_size, routing.num_experts, routing.top_k,
                         routing.norm_topk_prob, fp32_weights=True)
        self.routing = routing
        # The router in fp32 (transformers keeps gate.weight and e_score_correction_bias in fp32 whatever the dtype:
        # near-ties between experts decide which run)
        self.gate.weight = nn.Parameter(torch.empty(routing.num_experts, cfg.hidden_size, dtype=torch.float32),
                                        requires_grad=False)
        if routing.sigmoid:
            self.gate.e_score_correction_bias = nn.Parameter(  # (registered on the router, as checkpoints name it)
                torch.zeros(routing.num_experts, dtype=torch.float32), requires_grad=False)
        self.shared_experts: Optional[MLP] = None
        if routing.n_shared:
            self.shared_experts = MLP(replace(cfg, intermediate_size=routing.n_shared * routing.moe_intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        logits = F.linear(x.float(), self.gate.weight)
        tokens, experts = logits.shape
        if r.sigmoid:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias
        else:
            scores = choice = logits.softmax(dim=-1)
        if r.n_group > 1:
            grouped = choice.view(tokens, r.n_group, experts // r.n_group)
            # a group's score: its two best biased scores (V3), its best score (V2)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1) if r.sigmoid else grouped.amax(-1)
            best = group_scores.topk(r.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand(tokens, r.n_group, experts // r.n_group).reshape(tokens, experts)
            # (V2 zeroes the other groups' probabilities, V3 rules their experts out: as transformers)
            choice = choice.masked_fill(~keep, float("-inf") if r.sigmoid else 0.0)
        if r.sigmoid:
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)  # the unbiased scores: the bias only chooses
            if r.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights, ids = choice.topk(self.top_k, dim=-1)
        return weights * r.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_experts is not None:
            # (its own all-reduce: one collective more a layer than folding its partial sums into the experts')
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        routing = Routing.from_config(cfg)
        self.self_attn = MLAttention(cfg, backend_cls, rotary)
        self.mlp: nn.Module = DeepseekMoE(cfg, routing) if routing.sparse(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (their differences are read from the config)."""

    decoder_layer = DeepseekDecoderLayer
    # Only the MLPs' gate/up pack; MLA's projections load one to one (V2-Lite's q_proj is not Llama's).
    packed = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        Routing.from_config(cfg)  # (refuses an unsupported config before anything is built)
        super().__init__(cfg, backend_cls, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """V3 checkpoints also hold the multi-token-prediction layer (model.layers.61 for V3's 61 layers): skipped."""
        return super().load_weights(without_mtp_layers(weights, self.cfg.num_layers))

    def post_load(self) -> None:
        """After loading (the runner calls it before anything is rounded or packed): the latent form's absorbed
        weights. A checkpoint's calibrated FP8 k_scale / v_scale describe per-head K and V, not the latent: they
        are not used for a latent cache (scales 1.0)."""
        latent = False
        for layer in self.own_layers():
            layer.self_attn.absorb()
            latent = layer.self_attn.latent
        if latent and getattr(self, "kv_scales", None):
            logger.info("DeepSeek latent KV cache: the checkpoint's k/v scales (per-head K and V) are not used")
            self.kv_scales = None

    def pre_reload(self) -> None:
        """Before new weights load in place: the absorbed kv_b_proj weights get their float tensors back
        (`post_load` absorbs them again)."""
        for layer in self.own_layers():
            layer.self_attn.unabsorb()
