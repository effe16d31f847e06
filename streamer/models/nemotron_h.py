"""NVIDIA Nemotron-H (NemotronHForCausalLM: Nemotron-H-8B / 47B, NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2, and the MoE
Nemotron-3-Nano): a stack of single-block layers, each a pre-norm and a residual around ONE mixer, by
`hybrid_override_pattern` ("M" Mamba2, "*" attention, "-" MLP, "E" MoE) or transformers 5's `layers_block_type`
("linear_attention", "full_attention", "mlp", "moe").

- Mamba2: models/mamba.py's mixer (B/C in `n_groups` groups, the gated RMSNorm per group of channels, norm after the
  gate), its width `mamba_num_heads` x `mamba_head_dim` (not necessarily `expand` x hidden_size);
- attention: no rotary embedding (NoPE), paged KV cache;
- MLP: down_proj(relu(up_proj(x)) ** 2), no gate;
- MoE: DeepSeek-V3's router (sigmoid scores, `e_score_correction_bias` that only chooses, `n_group` / `topk_group`,
  `norm_topk_prob`, `routed_scaling_factor`), non-gated relu2 experts (optionally inside a `moe_latent_size`
  projection) plus a relu2 shared expert.

Checkpoint names: `backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer.*`, `backbone.norm_f`,
`lm_head` (transformers 5 writes `model.` for `backbone.`, and may stack the experts: `mixer.experts.up_proj`
[E, I, H], `mixer.experts.down_proj` [E, H, I]). Multi-token-prediction layers (`mtp.*`) are not part of the
model: with speculative_method="mtp" they draft (models/mtp.py NemotronHMTP).

The `time_step_limit` clamp of dt is the config's (NVIDIA's reference code; transformers' port clamps prefill at
`time_step_min` instead and decode not at all)."""
from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.family_configs import nemotron_h_layer_kinds, nemotron_h_mixer_config
from streamer.models.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    tp_all_reduce,
)
from streamer.models.llama import Attention, LlamaForCausalLM, add_and_norm
from streamer.models.mamba import HybridModel, MambaMixer
from streamer.models.moe import SparseMoE
from streamer_kernels.reference import expert_activation


class Relu2MLP(nn.Module):
    """down(relu(up(x)) ** 2) (`fc1` / `fc2`: the loader would pack an `up_proj` with a gate), split over the
    tensor-parallel ranks along its intermediate size (fc1 column-, fc2 row-parallel)."""

    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, [inter], bias)
        self.fc2 = RowParallelLinear(inter, hidden, bias)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(expert_activation(self.fc1(x), "relu2"))


class NemotronHMoE(SparseMoE):
    """Routed relu2 experts (ungated: `w13` holds each expert's up projection alone; the experts run as SparseMoE's
    opaque op, so a compiled step has no graph break and a GPU step no host sync), each token's top-k by DeepSeek-V3's
    router (fp32), optionally inside a latent projection, plus the shared expert."""

    activation = "relu2"

    def __init__(self, cfg: ModelConfig) -> None:
        raw, hidden = cfg.raw, cfg.hidden_size
        num_experts, top_k = int(raw.get("n_routed_experts", 8)), int(raw.get("num_experts_per_tok", 2))
        n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
        if num_experts % n_group or not 0 < topk_group <= n_group \
                or not 0 < top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"NemotronH MoE: {num_experts} experts, n_group {n_group}, topk_group "
                             f"{topk_group}, num_experts_per_tok {top_k} do not fit together")
        latent = raw.get("moe_latent_size")
        width = int(latent) if latent else hidden
        super().__init__(width, int(raw.get("moe_intermediate_size", 7688)), num_experts, top_k,
                         norm_topk_prob=bool(raw.get("norm_topk_prob", True)), fp32_weights=True)
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling = float(raw.get("routed_scaling_factor", 1.0))
        bias = bool(raw.get("mlp_bias", False))
        self.gate = nn.Module()  # the router, fp32 (as transformers keeps it), on the stream (not the latent)
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                         requires_grad=False)
        self.shared_experts = Relu2MLP(hidden, int(raw.get("moe_shared_expert_intermediate_size", 7688)), bias)
        self.fc1_latent_proj = nn.Linear(hidden, width, bias=bias).requires_grad_(False) if latent else None
        self.fc2_latent_proj = nn.Linear(width, hidden, bias=bias).requires_grad_(False) if latent else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        tokens, experts = choice.shape
        if self.n_group > 1:
            group_scores = choice.view(tokens, self.n_group, -1).topk(2, dim=-1).values.sum(-1)
            best = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(experts // self.n_group, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = self.run_experts(h, weights, ids)
        if self.tp_size > 1:  # every rank summed its slice of each expert
            tp_all_reduce(out)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        self.kind = nemotron_h_layer_kinds(raw)[index]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # (the runner looks for `self_attn` (a KV cache) and `mamba` (state slots))
        self.self_attn: Optional[Attention] = None
        self.mamba: Optional[MambaMixer] = None
        self.mixer: Optional[nn.Module] = None  # an MLP block
        self.mlp: Optional[NemotronHMoE] = None  # a MoE block (named `mlp`: the loader stacks experts under `mlp`)
        if self.kind == "mamba":
            m = nemotron_h_mixer_config(raw)
            self.mamba = MambaMixer(cfg.hidden_size, m, cfg.rms_norm_eps,
                                    inner=int(m["mamba_n_heads"]) * int(m["mamba_d_head"]))
        elif self.kind == "attention":
            self.self_attn = Attention(cfg, backend_cls, rotary, use_rope=False)
        elif self.kind == "mlp":
            self.mixer = Relu2MLP(cfg.hidden_size, cfg.intermediate_size, bool(raw.get("mlp_bias", False)))
        else:
            self.mlp = NemotronHMoE(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.norm, x, residual)
        if self.self_attn is not None:
            return self.self_attn(positions, h, kv_cache, decode), residual
        if self.mamba is not None:
            return self.mamba(h, decode), residual
        return (self.mixer or self.mlp)(h), residual  # type: ignore[operator]


_MIXER = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.(.+)$")
_STACKED = re.compile(r"^experts\.(up_proj|down_proj)(?:\.weight)?$")


class NemotronHForCausalLM(HybridModel, LlamaForCausalLM):
    decoder_layer = NemotronHBlock

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        m = nemotron_h_mixer_config(cfg.raw)
        MambaMixer.check_split(tp, "mamba_num_heads", int(m["mamba_n_heads"]), "n_groups", int(m["mamba_n_groups"]))
        if "moe" in nemotron_h_layer_kinds(cfg.raw):  # (experts split along their intermediate size)
            # (expert parallelism: the routed experts stay whole, the shared expert still splits)
            fields = ("moe_shared_expert_intermediate_size",) if ParallelContext.expert_parallel else \
                ("moe_intermediate_size", "moe_shared_expert_intermediate_size")
            for field in fields:
                if int(cfg.raw.get(field, 7688)) % tp:
                    raise ValueError(f"tensor_parallel_size {tp} does not divide {field} "
                                     f"({cfg.raw.get(field, 7688)}): each rank holds a slice of every expert")

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if cfg.raw.get(key, want) != want:
                raise ValueError(f"NemotronHForCausalLM with {key}={cfg.raw[key]!r} is not supported ({want} is)")
        super().__init__(cfg, backend_cls, max_positions)
        self.kinds = nemotron_h_layer_kinds(cfg.raw)

    _PART = {"mamba": "mamba", "attention": "self_attn", "mlp": "mixer", "moe": "mlp"}
    _FC = {"up_proj": "fc1", "down_proj": "fc2"}

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name.startswith("mtp."):
                continue  # multi-token prediction layers (not used)
            if name.startswith("backbone."):
                name = "model." + name.removeprefix("backbone.")
            if name == "model.embeddings.weight":
                yield "model.embed_tokens.weight", t
                continue
            if name == "model.norm_f.weight":
                yield "model.norm.weight", t
                continue
            m = _MIXER.match(name)
            if m is None:
                yield name, t
                continue
            i, rest = int(m.group(1)), m.group(2)
            kind = self.kinds[i] if i < len(self.kinds) else "mamba"
            prefix = f"model.layers.{i}.{self._PART[kind]}"
            if kind == "mlp" or (kind == "moe" and rest.startswith("shared_experts.")):
                for frag, ours in self._FC.items():
                    rest = rest.replace(f"{frag}.", f"{ours}.")
            elif kind == "moe" and (s := _STACKED.match(rest)) is not None:  # (routed experts keep their names:
                for e in range(t.shape[0]):                                 # the loader stacks them)
                    yield f"{prefix}.experts.{e}.{s.group(1)}.weight", t[e]
                continue
            yield f"{prefix}.{rest}", t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        for part in (".mamba.", ".self_attn.", ".mixer.", ".mlp."):
            name = name.replace(part, ".mixer.")
        name = name.replace(".fc1.", ".up_proj.").replace(".fc2.", ".down_proj.")
        return {"model.embed_tokens.weight": "backbone.embeddings.weight",
                "model.norm.weight": "backbone.norm_f.weight"}.get(name, name.replace("model.", "backbone.", 1))
