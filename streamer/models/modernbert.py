"""ModernBERT (`ModernBertModel`, `ModernBertForSequenceClassification`: answerdotai/ModernBERT, gte-modernbert,
modernbert-embed, gte-reranker-modernbert): an encoder (models/bert.py says how the engine serves one: whole prompts,
every token seeing its whole prompt, no prefix caching) in a modern decoder's shape:

- no position embeddings: rotary (neox layout) on q and k, with its own base in the global and the local layers
  (`rope_parameters` per layer type, or the older `global_rope_theta` / `local_rope_theta`);
- global layers (every `global_attn_every_n_layers`-th, or `layer_types`) attend to the whole prompt; local ones to
  the keys within `local_attention // 2` positions either way (AttentionSpec.two_sided_window);
- pre-LN layers with LayerNorms (no bias unless `norm_bias`), the first layer's attention norm left out; a LayerNorm
  after the token embeddings and a final one; fused Wqkv, a GeGLU MLP (Wi holds the activated half first, then the
  gate), no biases unless `attention_bias` / `mlp_bias`;
- the classifier reads the first token or the mean of all (`classifier_pooling`), through a head of dense,
  activation and LayerNorm, then the label projection.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import GELU_APPROXIMATE, LayerNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from streamer.models.opt import AddOnly


class ModernBertLayer(DecoderLayer):
    """Llama's pre-norm layer with LayerNorms, GeGLU, and a global or a two-sided local attention."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        local = raw["layer_types"][index] == "sliding_attention"
        # (the window counts the query itself: |p - k| <= local_attention // 2)
        self.self_attn = Attention(cfg, backend_cls, rotary, sliding_window=raw["local_attention"] // 2 + 1
                                   if local else None, two_sided_window=local)
        self.local = local
        self.mlp = MLP(cfg, bias=bool(raw["mlp_bias"]))
        bias = bool(raw["norm_bias"])
        self.input_layernorm: nn.Module = AddOnly() if index == 0 else LayerNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                                                  bias=bias)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=bias)


class ModernBertHead(nn.Module):
    """norm(act(dense(pooled))), then the label projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        raw, hidden = cfg.raw, cfg.hidden_size
        self.dense = nn.Linear(hidden, hidden, bias=bool(raw["classifier_bias"]))
        self.norm = LayerNorm(hidden, cfg.rms_norm_eps, bias=bool(raw["norm_bias"]))
        self.out_proj = nn.Linear(hidden, cfg.num_labels or 1)
        self.gelu = GELU_APPROXIMATE[raw["classifier_activation"]]


def _f32(t: Any) -> Any:
    return None if t is None else t.float()


# checkpoint name fragment -> ours, in order (after the root became `model.`)
_NAMES = (("model.embeddings.tok_embeddings.", "model.embed_tokens."), ("model.embeddings.norm.", "model.embed_norm."),
          ("model.final_norm.", "model.norm."), (".attn.Wqkv.", ".self_attn.qkv_proj."),
          (".attn.Wo.", ".self_attn.o_proj."), (".mlp.Wi.", ".mlp.gate_up_proj."), (".mlp.Wo.", ".mlp.down_proj."),
          (".attn_norm.", ".input_layernorm."), (".mlp_norm.", ".post_attention_layernorm."))
_HEAD = (("head.", "score."), ("classifier.", "score.out_proj."))  # (a classifier's, at the names' start)


class ModernBertModel(LlamaForCausalLM):
    decoder_layer = ModernBertLayer
    bidirectional = True

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # (every layer rotates with the global base so far)
        raw = cfg.raw
        local_rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, raw["local_rope_theta"], None, is_neox=True)
        for layer in self.layers:
            if layer.local:
                layer.self_attn.rotary = local_rotary
        self.two_sided_window = raw["local_attention"] // 2 + 1 if "sliding_attention" in raw["layer_types"] else 0
        self.classifier_pooling = raw["classifier_pooling"]
        self.embed_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=bool(raw["norm_bias"]))
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=bool(raw["norm_bias"]))
        self.score = ModernBertHead(cfg) if cfg.num_labels else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.from_input_embeddings(self.embed_tokens(input_ids))

    def from_input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(x)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's logits (fp32) of the pooled hidden states [n, hidden] (the first token's, or the mean)."""
        head = self.score
        assert isinstance(head, ModernBertHead)
        h = F.gelu(F.linear(pooled.float(), head.dense.weight.float(), _f32(head.dense.bias)), approximate=head.gelu)
        h = F.layer_norm(h, (h.shape[-1],), _f32(head.norm.weight), _f32(head.norm.bias), head.norm.eps)
        return F.linear(h, head.out_proj.weight.float(), head.out_proj.bias.float())

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in weights:
            head = next(((theirs, ours) for theirs, ours in _HEAD if name.startswith(theirs)), None)
            if head is not None:
                yield head[1] + name.removeprefix(head[0]), t
                continue
            name = "model." + name.removeprefix("model.")
            for theirs, ours in _NAMES:
                name = name.replace(theirs, ours)
            yield name, t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        for theirs, ours in reversed(_HEAD):
            if name.startswith(ours):
                return theirs + name.removeprefix(ours)
        for theirs, ours in reversed(_NAMES):
            name = name.replace(ours, theirs)
        return name
