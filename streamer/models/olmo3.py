"""AI2's OLMo 3 (Olmo3ForCausalLM: Olmo-3-7B, Olmo-3-32B and their Instruct / Think variants). OLMo 2
(models/olmo2.py) with sliding-window layers; its differences from Llama are therefore:

- post-normalization (no norm before attention or the MLP; their outputs RMS-normalised before they join the
  residual stream), q and k RMS-normalised over the whole projection (all heads at once: tensor parallelism, which
  splits the heads, is refused), every norm's weight applied in fp32 before the cast (OLMo 2's);
- `layer_types`: "sliding_attention" layers attend within `sliding_window`, "full_attention" ones globally (by
  default every 4th layer is global);
- each layer type has its own rotary parameters: the full layers take the rope scaling (Olmo-3's YaRN), the
  sliding ones plain rotary. From a config.json in the older spelling (`rope_theta` + `rope_scaling`) transformers
  gives the full layers that theta and scaling and the sliding layers plain rotary at OLMo 3's default base
  (500,000), whatever `rope_theta` says; this module does the same.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models import registry
from streamer.models.config import ModelConfig, rope_scaling
from streamer.models.layers import ParallelContext, RotaryEmbedding, VocabEmbedding
from streamer.models.llama import MLP, Attention, LlamaForCausalLM, require_silu
from streamer.models.olmo2 import Olmo2DecoderLayer, Olmo2RMSNorm

DEFAULT_THETA = 500_000.0
LAYER_TYPES = ("sliding_attention", "full_attention")


def olmo3_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's kind: the config's `layer_types`, else (as transformers derives them) every 4th layer full."""
    types = list(raw.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                            for i in range(num_layers)])
    if len(types) < num_layers or any(t not in LAYER_TYPES for t in types[:num_layers]):
        raise ValueError(f"unsupported layer_types {types!r} for OLMo 3 ({', '.join(LAYER_TYPES)})")
    return types[:num_layers]


def _yarn_lengths(scaling: Optional[dict[str, Any]], raw: dict[str, Any]) -> Optional[dict[str, Any]]:
    """YaRN's lengths as ModelConfig fills them in (a top-level original length wins; else the model's)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return scaling
    length = raw.get("max_position_embeddings", 2048)
    if raw.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", length)
    scaling.setdefault("max_position_embeddings", length)
    return scaling


def olmo3_rope(raw: dict[str, Any]) -> dict[str, tuple[float, Optional[dict[str, Any]]]]:
    """layer type -> (rotary base, rope scaling or None), as transformers' Olmo3Config reads them: the
    transformers-5 `rope_parameters` per layer type, or the older `rope_theta` / `rope_scaling` (see the module
    docstring: those set the full layers only)."""
    params = raw.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):
        per_type = {t: dict(params.get(t) or {}) for t in LAYER_TYPES}
    else:
        full = dict(raw.get("rope_scaling") or {})
        full.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
        per_type = {"full_attention": full, "sliding_attention": {}}
    out = {}
    for t, p in per_type.items():
        theta = float(p.pop("rope_theta", DEFAULT_THETA))
        out[t] = (theta, _yarn_lengths(rope_scaling(None, p), raw))
    return out


class Olmo3Attention(Attention):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, sliding_window: Optional[int]) -> None:
        if ParallelContext.size > 1:
            raise ValueError(f"OLMo 3 does not support tensor parallelism: "
                             f"{registry.entry('Olmo3ForCausalLM').no_tensor_parallel}")
        super().__init__(cfg, backend_cls, rotary, sliding_window=sliding_window)
        self.q_norm = Olmo2RMSNorm(self.q_size, cfg.rms_norm_eps, flat=True)
        self.k_norm = Olmo2RMSNorm(self.kv_size, cfg.rms_norm_eps, flat=True)


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, sliding_window: Optional[int]) -> None:
        nn.Module.__init__(self)
        self.self_attn = Olmo3Attention(cfg, backend_cls, rotary, sliding_window)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Olmo3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        nn.Module.__init__(self)
        require_silu(cfg.raw, "OLMo 3")
        self.cfg = cfg
        types = olmo3_layer_types(cfg.raw, cfg.num_layers)
        rotaries = {t: RotaryEmbedding(cfg.rotary_dim, max_positions, theta, scaling)
                    for t, (theta, scaling) in olmo3_rope(cfg.raw).items() if t in types}
        window = cfg.raw.get("sliding_window")
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Olmo3DecoderLayer(cfg, backend_cls, rotaries[t], window if t == "sliding_attention" else None)
            for t in types)
        self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.score = torch.nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
