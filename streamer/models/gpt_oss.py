"""OpenAI's gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b). The Llama decoder's parts, with gpt-oss's
differences:

- attention: q/k/v and o projections with biases; a learned *sink* per head, one more logit in the softmax's
  denominator with no value to attend (the backends' `sinks`); layers alternate between a sliding window (128) and
  full attention (`layer_types`), all rotating with one YaRN-scaled table;
- every MLP is sparse (models/moe.py): the router has a bias and softmaxes its top-k logits (= softmax, top-k,
  renormalise); the experts have biases and a clamped SwiGLU, gate * sigmoid(1.702 gate) * (up + 1) with
  gate <= 7 and |up| <= 7 (`swiglu_limit`);
- the checkpoint stores each layer's experts fused, laid out for x @ W: gate_up_proj [E, H, 2I] with gate and up
  interleaved column by column, down_proj [E, I, H]; the Hub's checkpoints store them in MXFP4, which
  models/quant.py dequantizes into that same layout as they load.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import gemma_layer_types
from streamer.models.layers import RMSNorm, RotaryEmbedding, default_weight_loader
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE

# (checkpoint name fragment, ours); a prefix rename, so `gate_up_proj_bias` becomes `w13_bias`.
_RENAMES = ((".mlp.router.", ".mlp.gate."), (".mlp.experts.gate_up_proj", ".mlp.w13"),
            (".mlp.experts.down_proj", ".mlp.w2"))
FUSED = "fused"  # the shard id of an expert matrix that holds every expert


class GptOssMoE(SparseMoE):
    activation = "swiglu_oai"

    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        top_k = raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4
        super().__init__(cfg.hidden_size, cfg.intermediate_size, raw["num_local_experts"], top_k,
                         norm_topk_prob=True, router_bias=True)
        self.alpha = float(raw.get("swiglu_alpha", 1.702))
        self.limit = float(raw.get("swiglu_limit", 7.0))
        # (this rank's experts' gate/up biases; the down biases are added after the all-reduce, all of them on
        # every rank, indexed by the router's ids)
        self.w13_bias = nn.Parameter(torch.empty(self.local_experts, 2 * self.inter), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size), requires_grad=False)
        self.w13_bias.weight_loader = self._load_w13  # type: ignore[attr-defined]

    def expected_shards(self) -> dict[str, list[str]]:
        return {"w13": [FUSED], "w2": [FUSED]}

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        """gate_up_proj [E, H, 2I] or its bias [E, 2I], gate and up interleaved along the last dim -> this rank's
        gate rows then up rows, as w13 [E, 2I, H] / w13_bias [E, 2I] hold them."""
        loaded = self.local_rows(loaded, name)  # (this rank's experts: all but with expert parallelism)
        last = loaded.dim() - 1
        rows = torch.cat([self._slice(loaded[..., i::2], last, name) for i in (0, 1)], dim=last)
        if loaded.dim() == 3:
            rows = rows.transpose(1, 2)
        default_weight_loader(param, rows, name)

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Optional[str] = None):
        """down_proj [E, I, H] -> this rank's columns of w2 [E, H, I]."""
        loaded = self.local_rows(loaded, name)
        default_weight_loader(param, self._slice(loaded, 1, name).transpose(1, 2), name)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        sliding = gemma_layer_types(cfg.raw, cfg.num_layers, 2)[index] == "sliding_attention"
        self.self_attn = Attention(cfg, backend_cls, rotary, sliding_window=cfg.sliding_window if sliding else None,
                                   sinks=True)
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer

    def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
        for theirs, ours in _RENAMES:
            if theirs in ckpt_name:
                name = ckpt_name.removeprefix("model.").replace(theirs, ours)
                return name, FUSED if name.endswith((".w13", ".w2")) else None
        return super().param_name(ckpt_name)

    def checkpoint_name(self, internal: str) -> str:
        name = internal.partition(":")[0]
        if ".mlp." not in name:
            return super().checkpoint_name(internal)
        for theirs, ours in _RENAMES:
            name = name.replace(ours, theirs)
        return f"model.{name}"
