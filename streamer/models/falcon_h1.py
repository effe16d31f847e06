"""TII Falcon-H1 (FalconH1ForCausalLM: Falcon-H1-0.5B / 1.5B / 1.5B-Deep / 3B / 7B / 34B, base and instruct): every
layer runs attention AND a Mamba2 mixer side by side on the same normed input, their outputs summed into the
residual stream, then a SwiGLU MLP:

    h = norm(x);  x = x + mamba(h) * ssm_out_multiplier + attn(h * attention_in_multiplier) * attention_out_multiplier
    x = x + mlp(pre_ff_norm(x))

So every layer has both a paged KV cache (its `self_attn`) and a recurrent state slot (its `mamba`,
models/mamba.py). The µP multipliers, each 1.0 when absent:

- `embedding_multiplier` scales the embeddings, `lm_head_multiplier` the logits;
- `key_multiplier` scales k (before rotary);
- `ssm_in_multiplier` scales the mixer's input, and `ssm_multipliers` (5 values: the `mup_vector`) scale the
  in_proj output's parts z, x, B, C, dt;
- `mlp_multipliers` = (gate, down): the gate projection's output before its SiLU, the MLP's output.

The mixer's width is `mamba_d_ssm` (else `mamba_expand` x hidden_size); `mamba_rms_norm` turns on the grouped RMSNorm
(`mamba_norm_before_gate`: norm y then gate, else norm y * silu(z)); without it the output is y * silu(z).
`mamba_proj_bias` is in_proj's bias, `projectors_bias` out_proj's.

Checkpoint names: transformers' (`model.layers.N.{mamba, self_attn, feed_forward, input_layernorm,
pre_ff_layernorm}`, `model.final_layernorm`)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, LlamaForCausalLM, add_and_norm, require_silu
from streamer.models.mamba import HybridModel, MambaMixer


def _mixer_width(raw: dict[str, Any], hidden: int) -> tuple[int, int, int]:
    """(inner width, heads, head_dim) of the Mamba mixer."""
    inner = raw.get("mamba_d_ssm") or int(raw.get("mamba_expand", 2)) * hidden
    heads = int(raw.get("mamba_n_heads", 128))
    d_head = raw.get("mamba_d_head", "auto")
    return int(inner), heads, int(inner) // heads if d_head in (None, "auto") else int(d_head)


def mup_vector(raw: dict[str, Any], mixer: MambaMixer) -> torch.Tensor:
    """The in_proj output's per-channel multipliers (on this rank's share of it): [z (inner), x (inner), B, C
    (groups x d_state each), dt (heads)] times ssm_multipliers[0..4] (transformers' compute_mup_vector)."""
    gs = mixer.n_groups * mixer.d_state
    sizes = (mixer.inner, mixer.inner, gs, gs, mixer.num_heads)
    mults = [float(m) for m in (raw.get("ssm_multipliers") or [1.0] * 5)]
    return torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, mults)])


class FalconH1Mixer(MambaMixer):
    def __init__(self, cfg: ModelConfig) -> None:
        raw, hidden = cfg.raw, cfg.hidden_size
        inner, heads, d_head = _mixer_width(raw, hidden)
        m = {"mamba_n_heads": heads, "mamba_d_head": d_head, "mamba_n_groups": raw.get("mamba_n_groups", 1),
             "mamba_d_state": raw.get("mamba_d_state", 256), "mamba_d_conv": raw.get("mamba_d_conv", 4),
             "mamba_chunk_size": raw.get("mamba_chunk_size", 256),
             "time_step_limit": raw.get("time_step_limit") or (0.0, float("inf")),
             "mamba_proj_bias": bool(raw.get("mamba_proj_bias", False)),
             "mamba_conv_bias": bool(raw.get("mamba_conv_bias", True))}
        norm = "none"
        if raw.get("mamba_rms_norm", False):
            norm = "before_gate" if raw.get("mamba_norm_before_gate", True) else "gated"
        super().__init__(hidden, m, cfg.rms_norm_eps, inner=inner, norm=norm,
                         out_bias=bool(raw.get("projectors_bias", False)))
        self.in_multiplier = float(raw.get("ssm_in_multiplier", 1.0))
        self.register_buffer("mup_vector", mup_vector(raw, self).to(torch.get_default_dtype()), persistent=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.in_multiplier) * self.mup_vector


class FalconH1Attention(Attention):
    """Rotary attention with k scaled by `key_multiplier` before rotating."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, backend_cls, rotary)
        self.key_multiplier = float(cfg.raw.get("key_multiplier", 1.0))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.rotary(positions, q, k * self.key_multiplier)
        return self.attend(q, k, v, kv_cache, decode)


class FalconH1MLP(MLP):
    """SwiGLU with the gate's output scaled before its SiLU and the output scaled (`mlp_multipliers`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in (cfg.raw.get("mlp_multipliers")
                                                                        or [1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        self.mamba = FalconH1Mixer(cfg)
        self.self_attn = FalconH1Attention(cfg, backend_cls, rotary)
        self.feed_forward = FalconH1MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_in_multiplier = float(raw.get("attention_in_multiplier", 1.0))
        self.attention_out_multiplier = float(raw.get("attention_out_multiplier", 1.0))
        self.ssm_out_multiplier = float(raw.get("ssm_out_multiplier", 1.0))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        m = self.mamba(h, decode) * self.ssm_out_multiplier
        a = self.self_attn(positions, h * self.attention_in_multiplier, kv_cache, decode)
        h, residual = self.pre_ff_layernorm(m + a * self.attention_out_multiplier, residual)
        return self.feed_forward(h), residual


class FalconH1ForCausalLM(HybridModel, LlamaForCausalLM):
    decoder_layer = FalconH1DecoderLayer

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        MambaMixer.check_split(tp, "mamba_n_heads", _mixer_width(cfg.raw, cfg.hidden_size)[1], "mamba_n_groups",
                               int(cfg.raw.get("mamba_n_groups", 1)))

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        raw = cfg.raw
        require_silu(raw, "FalconH1ForCausalLM")
        if raw.get("mlp_bias"):
            raise ValueError("FalconH1ForCausalLM with mlp_bias is not supported")
        super().__init__(cfg, backend_cls, max_positions)
        self.embedding_multiplier = float(raw.get("embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(raw.get("lm_head_multiplier", 1.0))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.from_input_embeddings(self.embed_tokens(input_ids))

    def from_input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        # (transformers skips the multiplier for given inputs_embeds; the contract here is the token ids' path)
        return x * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            yield ("model.norm.weight" if name == "model.final_layernorm.weight" else name), t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        return "model.final_layernorm.weight" if name == "model.norm.weight" else name
