"""Pure Mamba2 (Mamba2ForCausalLM: mistralai/Mamba-Codestral-7B-v0.1, state-spaces/mamba2-130m .. 2.7b in the
transformers format): a stack of Mamba2 (SSD) blocks and nothing else, no attention layer and so no KV cache at
all. Each block is `x + mixer(norm(x))` with models/mamba.py's mixer (B/C in `n_groups` groups, the gated RMSNorm
per group after the gate); with `residual_in_fp32` (the default) the residual stream stays fp32 and each block's
norm reads it in the model's dtype, as transformers does.

Every running request holds one state slot (conv windows and SSM states of all layers); the KV cache manager's
blocks are bookkeeping only (`ModelRunner.kv_bytes_per_block` is 0 and the blocks cost no memory), so the number
of state slots (max_num_seqs, or as many as the memory budget holds) is what bounds the running batch.

Checkpoint names: `backbone.embeddings` (older exports: `backbone.embedding`), `backbone.layers.N.norm`,
`backbone.layers.N.mixer.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}`, `backbone.norm_f`, `lm_head`
(tied to the embeddings with `tie_word_embeddings`). Config: `num_heads` x `head_dim` SSM heads (= expand x
hidden_size), `state_size`, `n_groups`, `conv_kernel`, `chunk_size`, `time_step_limit`, `layer_norm_epsilon`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.family_configs import mamba2_mixer_config
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import LlamaForCausalLM, require_silu
from streamer.models.mamba import HybridModel, MambaMixer


class Mamba2Block(nn.Module):
    """norm, then the mixer (the residual add is the model's: `Mamba2ForCausalLM.run_layers`)."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        m = mamba2_mixer_config(cfg.raw)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = MambaMixer(cfg.hidden_size, m, cfg.rms_norm_eps,
                                inner=int(m["mamba_n_heads"]) * int(m["mamba_d_head"]))

    def forward(self, x: torch.Tensor, decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        return self.mixer(self.norm(x), decode)


class Mamba2ForCausalLM(HybridModel, LlamaForCausalLM):
    decoder_layer = Mamba2Block
    has_attention = False

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        m = mamba2_mixer_config(cfg.raw)
        MambaMixer.check_split(tp, "num_heads", int(m["mamba_n_heads"]), "n_groups", int(m["mamba_n_groups"]))

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        require_silu(cfg.raw, "Mamba2ForCausalLM")
        super().__init__(cfg, backend_cls, max_positions)
        self.residual_in_fp32 = bool(cfg.raw.get("residual_in_fp32", True))

    def run_layers(self, positions: torch.Tensor, x: torch.Tensor, kv_caches: list[torch.Tensor],
                   decode: Optional[DecodeBatch] = None, after_layer: Any = None) -> torch.Tensor:
        dtype = x.dtype
        stream = x
        for layer in self.layers:
            h = layer(stream.to(dtype), decode)
            stream = (stream.float() if self.residual_in_fp32 else stream) + h
        # the final norm over the (fp32) stream itself, in its dtype; the head then reads it in the model's
        xf = stream.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        return (self.norm.weight * xf.to(stream.dtype)).to(dtype)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name.startswith("backbone."):
                name = "model." + name.removeprefix("backbone.")
            if name in ("model.embeddings.weight", "model.embedding.weight"):
                name = "model.embed_tokens.weight"
            elif name == "model.norm_f.weight":
                name = "model.norm.weight"
            yield name, t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        return {"model.embed_tokens.weight": "backbone.embeddings.weight",
                "model.norm.weight": "backbone.norm_f.weight"}.get(name, name.replace("model.", "backbone.", 1))
