"""BERT-family encoders for embeddings, classification and cross-encoder reranking: BERT (`BertModel`,
`BertForSequenceClassification`: bge-*-en, e5, all-MiniLM, ms-marco cross-encoders), RoBERTa and XLM-RoBERTa
(`XLMRobertaModel`, `*ForSequenceClassification`: bge-m3, multilingual-e5, bge-reranker).

An encoder's tokens attend to each other both ways, so a prompt is computed whole, in one step (the scheduler never
cuts it into chunks: Request.whole_prompt), and no prefix of it can be reused (a prefix's hidden states depend on
what follows: the engine turns prefix caching off). The KV cache still holds the keys and values, as for any model:
the attention backends read them with every token's `causal_limit` at its prompt's last position
(ModelRunner._metadata), so the same kernels serve. Differences from the Llama decoder:

- no rotary: learned absolute positions, at position + `pad_token_id` + 1 for (XLM-)RoBERTa (its first rows are
  never read), and token-type embeddings, all added to the token embeddings and then LayerNorm'ed;
- post-LN layers: h = ln1(x + attn(x)), out = ln2(h + mlp(h)), no final norm; biases everywhere; GELU MLP;
- token types: transformers' tokenizer marks a pair's second text (a cross-encoder's document) as type 1. The engine
  passes token ids only, so the type is read from them the same way: 1 after the prompt's first separator token
  ([SEP]), as the pair template puts it (a single text's only [SEP] ends it). Models with one type
  (RoBERTa's) add that row everywhere;
- heads: BERT's classifier reads the pooler (dense + tanh over the first token) then a linear layer; RoBERTa's, a
  dense + tanh then `out_proj`, over the first token too. An embedding model (`BertModel`) skips the pooler:
  sentence-transformers pools the final hidden states itself (CLS or mean: streamer/engine/pooling.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.arcee import UNGATED_PACKED, UpMLP
from streamer.models.config import ModelConfig
from streamer.models.family_configs import position_offset
from streamer.models.layers import GELU_APPROXIMATE, LayerNorm, RotaryEmbedding, VocabEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM
from streamer.models.opt import AddOnly


def sep_token_id(model_dir: Path) -> Optional[int]:
    """The tokenizer's separator token id (tokenizer_config.json's sep_token, looked up in tokenizer.json's added
    tokens, or a slow tokenizer's vocabulary; BERT's "[SEP]" / RoBERTa's "</s>" by default), None if there is none."""
    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    sep = cfg.get("sep_token")
    sep = sep.get("content") if isinstance(sep, dict) else sep
    try:
        if (model_dir / "tokenizer.json").is_file():
            added = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens") or []
            ids = {t["content"]: t["id"] for t in added}
        elif (model_dir / "vocab.txt").is_file():  # (a slow tokenizer's vocabulary: streamer/tokenizer/slow_tokenizer.py)
            ids = {w: i for i, w in enumerate((model_dir / "vocab.txt").read_text(encoding="utf-8").split("\n"))}
        else:
            ids = json.loads((model_dir / "vocab.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for name in ([sep] if sep else ["[SEP]", "</s>"]):
        if name in ids:
            return int(ids[name])
    return None


class EncoderLayer(nn.Module):
    """Post-LN: each sum is normalised before it goes on, so no residual is carried to the next layer."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend_cls, rotary, use_rope=False)
        self.mlp = UpMLP(cfg, nn.GELU(approximate=GELU_APPROXIMATE[cfg.raw["hidden_act"]]), bias=True)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)  # (attention.output.LayerNorm)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)  # (output.LayerNorm)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h = self.input_layernorm(x + self.self_attn(positions, x, kv_cache, decode))
        return self.post_attention_layernorm(h + self.mlp(h)), None


class ClassifierHead(nn.Module):
    """dense + tanh over the first token's final hidden state, then the label projection (BERT's pooler and
    classifier; RoBERTa's classifier.dense and out_proj): the same computation, named apart by rename_weights. Its
    weights only: `BertModel.classify` computes it, in fp32."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)


# checkpoint name fragment -> ours, in order (after the family's root became `model.`)
_NAMES = (("embeddings.word_embeddings.", "embed_tokens."), ("embeddings.position_embeddings.", "embed_positions."),
          ("embeddings.token_type_embeddings.", "embed_types."), ("embeddings.LayerNorm.", "embed_norm."),
          ("encoder.layer.", "layers."),
          (".attention.self.query.", ".self_attn.q_proj."), (".attention.self.key.", ".self_attn.k_proj."),
          (".attention.self.value.", ".self_attn.v_proj."), (".attention.output.dense.", ".self_attn.o_proj."),
          (".attention.output.LayerNorm.", ".input_layernorm."), (".intermediate.dense.", ".mlp.up_proj."),
          (".output.dense.", ".mlp.down_proj."), (".output.LayerNorm.", ".post_attention_layernorm."))
_HEADS = {"bert": (("model.pooler.dense.", "score.dense."), ("classifier.", "score.out_proj.")),
          "roberta": (("classifier.dense.", "score.dense."), ("classifier.out_proj.", "score.out_proj."))}
_HEADS["mpnet"] = _HEADS["roberta"]
_OLD_NORM = re.compile(r"LayerNorm\.(gamma|beta)$")  # (TF-converted checkpoints' spelling)


class BertModel(LlamaForCausalLM):
    """An encoder (see the module's docstring); `bidirectional` tells the engine and the runner."""

    decoder_layer = EncoderLayer
    packed = UNGATED_PACKED
    bidirectional = True
    classifier_pooling = "cls"

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        raw, hidden = cfg.raw, cfg.hidden_size
        self.family = raw["_encoder_family"]
        self.offset = position_offset(raw)
        self.embed_positions = VocabEmbedding(raw["encoder_positions"], hidden)
        self.embed_types: Optional[VocabEmbedding] = None  # (MPNet has no token types)
        if int(raw["type_vocab_size"]) > 0:
            self.embed_types = VocabEmbedding(int(raw["type_vocab_size"]), hidden)
            self.sep_token_id: Optional[int] = None  # set by the runner from the tokenizer (see token_types)
        self.embed_norm = LayerNorm(hidden, cfg.rms_norm_eps)
        self.norm = AddOnly()  # (post-LN: the last layer's output is already normalised)
        self.score = ClassifierHead(hidden, cfg.num_labels) if cfg.num_labels else None

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """1 after each prompt's first separator, else 0 (see the module's docstring). Prompts are whole in a step,
        so position 0 starts each one: a running count of separators, less the count where the prompt started."""
        assert self.embed_types is not None
        if self.embed_types.weight.shape[0] < 2 or self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        sep = (input_ids == self.sep_token_id).to(torch.int64)
        before = torch.cumsum(sep, 0) - sep  # separators before each token, in the whole step
        # the count where the token's prompt starts: the latest start's (counts only grow, so a running maximum)
        at_start = torch.cummax(torch.where(positions == 0, before, 0), 0).values
        return (before > at_start).to(input_ids.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Optional[DecodeBatch] = None, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.embed_positions(positions + self.offset)
        if self.embed_types is not None:
            x = x + self.embed_types(self.token_types(input_ids, positions))
        return self.run_layers(positions, self.embed_norm(x), kv_caches, decode)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classifier head's logits (fp32) of the pooled first-token hidden states [n, hidden]."""
        assert self.score is not None
        head = self.score
        h = torch.tanh(nn.functional.linear(pooled.float(), head.dense.weight.float(), head.dense.bias.float()))
        return nn.functional.linear(h, head.out_proj.weight.float(), head.out_proj.bias.float())

    names = _NAMES  # (the family's checkpoint name fragments -> ours, in order; MPNet's add to them)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The family's names in Llama's spelling. A pooler the head does not read (sentence-transformers pools
        itself), a masked-LM head (`*ForMaskedLM` checkpoints serve as embedding models) and saved position / type
        id buffers are skipped."""
        heads = _HEADS[self.family]
        reads_pooler = self.score is not None and any(theirs.startswith("model.pooler.") for theirs, _ in heads)
        for name, t in weights:
            name = _OLD_NORM.sub(lambda m: "LayerNorm." + {"gamma": "weight", "beta": "bias"}[m.group(1)], name)
            if name.startswith(("bert.", "roberta.", "mpnet.")):
                name = name.split(".", 1)[1]
            if name.endswith(("embeddings.position_ids", "embeddings.token_type_ids")) \
                    or name.startswith(("lm_head.", "cls.")):
                continue
            if not name.startswith("classifier."):
                name = "model." + name
            if name.startswith("model.pooler.") and not reads_pooler:
                continue
            yield _to_ours(name, heads + self.names), t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        for theirs, ours in reversed(_HEADS[self.family] + self.names):
            name = name.replace(ours, theirs)
        return name.removeprefix("model.")


def _to_ours(name: str, names: tuple[tuple[str, str], ...]) -> str:
    for theirs, ours in names:
        name = name.replace(theirs, ours)
    return name
