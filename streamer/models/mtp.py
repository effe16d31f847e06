"""Multi-token-prediction (MTP) heads as speculative drafters: the extra layer DeepSeek-V3 / R1 and GLM-4.5 / 4.6
checkpoints carry past their last decoder layer (`model.layers.<num_hidden_layers>.*`; loading the target skips
it, as transformers does).

At position i the layer reads the embedding of token i + 1 and the target's final hidden state of position i:
    x = eh_proj([enorm(embed(t[i + 1])), hnorm(h[i])])  ->  one decoder layer of the target's kind (MLA + MoE for
    DeepSeek)  ->  stream;  logits = shared_head.head(shared_head.norm(stream))
and predicts token i + 2. Applied again on its own output stream it drafts further (as vLLM does with one layer).
The embedding at position 0 is zeroed, as vLLM's DeepSeek MTP does. The runner side is streamer/spec_decode/eagle.py's
(`EagleDrafter`): the same fill / keep / propose steps as an EAGLE-1 head.

Qwen3-Next and Qwen3.5 checkpoints store theirs apart, as `mtp.*` (`Qwen3NextMTP`, below): the same shape with other names
(fc, pre_fc_norm_embedding / _hidden, norm), zero-centred norms, and the normed output as the next feature.
Nemotron-H's (`NemotronHMTP`) is a short stack of its own blocks (`mtp_hybrid_override_pattern`, e.g. "*E"), the
fusion before the first and a norm after the last. Both targets are hybrid: a rejected draft rolls the target's
recurrent state back (kv_cache.StateSnapshots), while the head, plain attention, just overwrites its KV when the
target recomputes.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import GemmaRMSNorm
from streamer.models.layers import ColumnParallelLinear, RMSNorm, VocabEmbedding
from streamer.models.llama import LlamaForCausalLM
from streamer.models.nemotron_h import NemotronHForCausalLM
from streamer.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM

_OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")  # the head's tensors beside its decoder layer


class MTPDrafting:
    """What EagleDrafter asks of an MTP head beyond its forward (both heads below): features pass through as the
    target gives them (its final hidden states), greedy proposals, and no prepacked LM head of its own."""

    target_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # the target's, where the head shares it

    def combine(self, target_features: torch.Tensor) -> torch.Tensor:
        return target_features

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden).argmax(dim=-1)  # type: ignore[attr-defined]

    def pack_head_for_cpu(self) -> None:
        pass

    def inputs(self, input_ids: torch.Tensor, feature: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' embeddings and the features (zeros in the runner's warm-up steps, which pass none)."""
        embeds = self.embed(input_ids)  # type: ignore[attr-defined]
        return embeds, torch.zeros_like(embeds) if feature is None else feature


class OwnModuleMTP(MTPDrafting):
    """An MTP module stored apart from the layers (`mtp.*`: Qwen3-Next's, Nemotron-H's): its own tensors (`own`,
    by their first name part) beside blocks of the target's kind; embeddings and LM head always the target's."""

    own: tuple[str, ...] = ()

    def share_target(self, target: LlamaForCausalLM) -> None:
        self.embed_tokens = target.embed_tokens
        self.target_logits = target.compute_logits  # (its LM head may be prepacked for the CPU)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.target_logits is not None, "share_target first"
        return self.target_logits(hidden)

    def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
        if ckpt_name.split(".")[0] in self.own:
            return ckpt_name, None
        return super().param_name(ckpt_name)  # type: ignore[misc]

    def expected_weights(self) -> set[str]:
        return super().expected_weights() - {"embed_tokens.weight"}  # type: ignore[misc]


@functools.cache
def mtp_class(target_cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """The MTP head of a family: its model class, built with only the layer past the last (Qwen3-Next and
    Nemotron-H store a module of their own: `Qwen3NextMTP`, `NemotronHMTP`)."""
    if issubclass(target_cls, Qwen3NextForCausalLM):
        return Qwen3NextMTP
    if issubclass(target_cls, NemotronHForCausalLM):
        return NemotronHMTP

    class MTPHead(MTPDrafting, target_cls):  # type: ignore[valid-type, misc]
        version = 1  # (drafts as an EAGLE-1 head does: the target's final hidden states are its features)

        def layer_indices(self, cfg: ModelConfig) -> Iterable[int]:
            return [cfg.num_layers]

        def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                     max_positions: int) -> None:
            super().__init__(cfg, backend_cls, max_positions)
            h, eps = cfg.hidden_size, cfg.rms_norm_eps
            self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
            self.eh_proj = ColumnParallelLinear(2 * h, [h])
            self.shared_head = nn.Module()
            self.shared_head.norm = RMSNorm(h, eps)
            self.shared_head.head = VocabEmbedding(cfg.vocab_size, h)
            self.norm = None  # type: ignore[assignment]
            self.lm_head = None
            self.own = {"embed_tokens.weight": False, "shared_head.head.weight": False}
            self.mtp_name = re.compile(rf"^model\.layers\.{cfg.num_layers}\.(.*)$")

        def share_target(self, target: LlamaForCausalLM) -> None:
            """Checkpoints usually repeat the target's embeddings (and LM head) in the layer; where not, share."""
            if not self.own["embed_tokens.weight"]:
                self.embed_tokens = target.embed_tokens
            if not self.own["shared_head.head.weight"]:  # (the target's LM head may be prepacked for the CPU)
                self.target_logits = target.compute_logits

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                    kv_caches: list[torch.Tensor], decode: Optional[DecodeBatch] = None,
                    feature: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
            embeds, feature = self.inputs(input_ids, feature)
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
            x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
            x, residual = self.layers[0](positions, x, None, kv_caches[0], decode)
            stream = x + residual
            return self.shared_head.norm(stream), stream

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            if self.target_logits is not None:
                return self.target_logits(hidden)
            return torch.nn.functional.linear(hidden, self.shared_head.head.weight).float()

        def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            """Only the MTP layer's tensors: its decoder layer's as layer 0, the rest by their own names."""
            for name, t in super().rename_weights(weights):
                m = self.mtp_name.match(name)
                if m is None:
                    continue
                rest = m.group(1)
                if rest.split(".")[0] in _OWN:
                    if rest in self.own:
                        self.own[rest] = True
                    yield rest, t
                else:
                    yield f"model.layers.0.{rest}", t

        def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
            if ckpt_name.split(".")[0] in _OWN:
                return ckpt_name, None
            return super().param_name(ckpt_name)

        def expected_weights(self) -> set[str]:
            return super().expected_weights() - {name for name, own in self.own.items() if not own}

    MTPHead.__name__ = MTPHead.__qualname__ = target_cls.__name__ + "MTP"
    return MTPHead


class Qwen3NextMTP(OwnModuleMTP, LlamaForCausalLM):
    """Qwen3-Next's MTP module (`mtp.*` in the released checkpoints; `num_nextn_predict_layers` = 1), as vLLM runs
    it: x = fc([pre_fc_norm_embedding(embed(t[i + 1])), pre_fc_norm_hidden(h[i])]) -> one full-attention decoder
    layer of the target's kind (gated attention, the sparse MoE of a layer 0) -> norm; the target's LM head reads
    that, and it is also the next pass's feature. Every norm is zero-centred (Gemma's). No position is zeroed.
    Embeddings and LM head are the target's. A plain attention model: no recurrent state of its own."""

    version = 1
    decoder_layer = Qwen3NextDecoderLayer
    own = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden")

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        layer_cfg = dataclasses.replace(cfg, raw={**cfg.raw, "layer_types": ["full_attention"] * cfg.num_layers})
        super().__init__(layer_cfg, backend_cls, max_positions)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = ColumnParallelLinear(2 * h, [h])
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps), GemmaRMSNorm(h, eps)
        self.norm = GemmaRMSNorm(h, eps)
        self.lm_head = None

    def layer_indices(self, cfg: ModelConfig) -> Iterable[int]:
        return [0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                kv_caches: list[torch.Tensor], decode: Optional[DecodeBatch] = None,
                feature: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, feature = self.inputs(input_ids, feature)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(feature)], dim=-1))
        x, residual = self.layers[0](positions, x, None, kv_caches[0], decode)
        out = self.norm(x, residual)[0]
        return out, out

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Only the `mtp.*` tensors: its decoder layer's as layer 0, its final norm as the model's."""
        for name, t in weights:
            if not name.startswith("mtp."):
                continue
            rest = name[len("mtp."):]
            yield (rest if rest.split(".")[0] in self.own else f"model.{rest}"), t


class NemotronHMTP(OwnModuleMTP, NemotronHForCausalLM):
    """Nemotron-H's MTP module (`mtp.layers.<i>.*`), as vLLM runs it: blocks of the target's kinds by
    `mtp_hybrid_override_pattern` (attention "*" and MoE "E"; a recurrent one would need a state of its own). The
    first block fuses x = eh_proj([enorm(embed(t[i + 1])), hnorm(h[i])]) before its norm and mixer; after the last,
    final_layernorm of the stream is what the target's LM head reads and the next pass's feature. Plain RMSNorms."""

    is_hybrid = False  # (attention and MoE blocks only: no state slots)
    own = ("enorm", "hnorm", "eh_proj", "final_layernorm")

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        pattern = str(cfg.raw.get("mtp_hybrid_override_pattern") or "*E")
        if set(pattern) - set("*E-"):
            raise ValueError(f"mtp_hybrid_override_pattern {pattern!r}: the MTP module's blocks may be attention "
                             "(*), MLP (-) or MoE (E)")
        raw = {**cfg.raw, "hybrid_override_pattern": pattern, "layers_block_type": None, "layer_types": None}
        super().__init__(dataclasses.replace(cfg, raw=raw, num_layers=len(pattern)), backend_cls, max_positions)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.final_layernorm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = ColumnParallelLinear(2 * h, [h])
        self.norm = None  # type: ignore[assignment]
        self.lm_head = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                kv_caches: list[torch.Tensor], decode: Optional[DecodeBatch] = None,
                feature: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, feature = self.inputs(input_ids, feature)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv, decode)
        out = self.final_layernorm(x + residual)
        return out, out

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Only the `mtp.*` tensors: the fusion (first block's) and final norm (last block's) as the head's own,
        the blocks by the target's names (NemotronHForCausalLM.rename_weights)."""
        def blocks() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                m = re.match(r"^(?:language_model\.)?mtp\.layers\.(\d+)\.(.*)$", name)
                if m is None:
                    continue
                if m.group(2).split(".")[0] in self.own:
                    yield m.group(2), t
                else:
                    yield f"backbone.layers.{m.group(1)}.{m.group(2)}", t
        yield from NemotronHForCausalLM.rename_weights(self, blocks())
