"""Whisper (WhisperForConditionalGeneration: openai/whisper-tiny .. large-v3, large-v3-turbo, distil-whisper):
speech to text, an encoder-decoder. The encoder reads 30 s of log-mel features (streamer/multimodal/audio.py) once per request;
the decoder is a text decoder whose layers also attend to the encoder's output (cross-attention).

How it fits the engine:
- The decoder is a decoder like the others: its self-attention runs on the paged KV cache (llama.Attention, no
  rotary: learned positions are added to the token embeddings), its prompt is the task's special tokens
  (`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`) and it samples as any model does.
- Each running request holds a state slot (the hybrid models' slots: kv_cache.StateSlotPool), which keeps its
  encoder output as every cross-attention layer's K and V, [slots, frames, heads, head_dim] per layer. They are
  computed once, by the step that computes the request's first token (a preempted request's again, on its return),
  and read by every later step. Cross K/V depend on the audio, not on the tokens, so no prefix is reused across
  requests (prefix caching is off) and nothing is checkpointed.
- Runs eagerly (the encoder's batch and the cross-attention's slots change from step to step); no tensor
  parallelism.

transformers' layout: pre-LayerNorm layers (eps 1e-5) with biased q/v/out projections and an unbiased k
projection, a GELU MLP (fc1, fc2); the encoder's two convolutions (the second of stride 2: 3000 mel frames -> 1500
positions) with GELU, plus its sinusoidal position table (stored in the checkpoint); the LM head (`proj_out`) tied
to the decoder's token embeddings.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, CrossStep, DecodeBatch, current_metadata
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import GeluMLP
from streamer.models.layers import ColumnParallelLinear, LayerNorm, VocabEmbedding, gelu_approximate
from streamer.models.llama import Attention, LlamaForCausalLM

# Clips encoded at once: large-v3's MLP activation is 1500 x 5120 per clip, so a step that admits many requests
# encodes them in batches of this many
ENCODER_BATCH = 16
_EPS = 1e-5  # (transformers' Whisper layers are nn.LayerNorm with its default eps)


class EncoderAttention(nn.Module):
    """The encoder's self-attention, over its 1500 positions both ways, with no cache: one q/k/v matmul (the
    checkpoint's k projection has no bias: a zero one is loaded, `rename_weights`)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv_proj = ColumnParallelLinear(width, [width] * 3, bias=True, shard_names=["q", "k", "v"])
        self.out_proj = ColumnParallelLinear(width, [width], bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, L, width]
        # [B, L, 3, H, D] -> three [B, H, L, D]
        q, k, v = self.qkv_proj(x).unflatten(-1, (3, self.heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class EncoderMLP(GeluMLP):
    """fc2(gelu(fc1(x))), on CPU with the GELU fused into oneDNN's fc1 matmul where its weight is prepacked (the
    encoder's widest activation, [clips, 1500, 4 x width], is then written once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1 = self.fc1
        if fc1.packed is not None and fc1.op_id is None and fc1.lora is None:
            h = torch.ops.mkldnn._linear_pointwise(x, fc1.packed, fc1.bias, "gelu", [], self.approximate)
            return self.fc2(h)
        return super().forward(x)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int, heads: int, ffn: int, act: str) -> None:
        super().__init__()
        self.self_attn = EncoderAttention(width, heads)
        self.self_attn_layer_norm = LayerNorm(width, _EPS)
        self.mlp = EncoderMLP(dataclasses.replace(cfg, hidden_size=width, intermediate_size=ffn), act)
        self.final_layer_norm = LayerNorm(width, _EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.mlp(self.final_layer_norm(x))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        raw = cfg.raw
        width = cfg.hidden_size
        self.num_mel_bins = int(raw.get("num_mel_bins", 80))
        self.positions = int(raw.get("max_source_positions", 1500))
        self.frames = 2 * self.positions  # mel frames: the second convolution halves them
        self.conv1 = nn.Conv1d(self.num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.embed_positions = VocabEmbedding(self.positions, width)
        act = gelu_approximate(cfg, "gelu", "activation_function")
        self.ffn = int(raw.get("encoder_ffn_dim", cfg.intermediate_size))
        self.layers = nn.ModuleList(
            EncoderLayer(cfg, width, int(raw.get("encoder_attention_heads", cfg.num_heads)), self.ffn, act)
            for _ in range(int(raw.get("encoder_layers", cfg.num_layers))))
        self.layer_norm = LayerNorm(width, _EPS)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, mels, frames] log-mel features -> [B, positions, width]."""
        if features.shape[1:] != (self.num_mel_bins, self.frames):
            raise ValueError(f"Whisper's encoder takes [{self.num_mel_bins}, {self.frames}] log-mel features, got "
                             f"{list(features.shape[1:])}")
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class CrossAttention(nn.Module):
    """A decoder layer's attention over its request's encoder output, whose K and V sit in the request's state
    slot (`allocate_state`, `fill`)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q_proj = ColumnParallelLinear(width, [width], bias=True)
        self.k_proj = ColumnParallelLinear(width, [width])
        self.v_proj = ColumnParallelLinear(width, [width], bias=True)
        self.out_proj = ColumnParallelLinear(width, [width], bias=True)
        # [slots, heads, positions, head_dim]: heads first, so that a span of slots is SDPA's [B, H, L, D] as it is
        self.k_state = torch.zeros(0)
        self.v_state = torch.zeros(0)

    def fill(self, slots: torch.Tensor, encoded: torch.Tensor) -> None:
        """Project the encoder's output [F, positions, width] of the requests in `slots` [F] into their K / V."""
        shape = (*encoded.shape[:2], self.heads, self.head_dim)
        self.k_state[slots] = self.k_proj(encoded).view(shape).transpose(1, 2)
        self.v_state[slots] = self.v_proj(encoded).view(shape).transpose(1, 2)

    def forward(self, x: torch.Tensor, step: CrossStep) -> torch.Tensor:
        """x [T, width]: each request's queries (step.rows, padded to the longest) over its slot's K / V."""
        q = self.q_proj(x).view(-1, self.heads, self.head_dim)
        if step.span is not None:  # the slots fill most of a span: read K / V through a view, no gathered copy
            lo, hi = step.span
            k, v = self.k_state[lo:hi], self.v_state[lo:hi]
            queries = q.new_zeros(hi - lo, *step.rows.shape[1:], self.heads, self.head_dim)
            queries[step.span_pos] = q[step.rows]
        else:
            k, v = self.k_state[step.slots], self.v_state[step.slots]
            queries = q[step.rows]
        # [R, L, H, D] queries over [R, H, positions, D]; padded query rows are discarded
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), k, v).transpose(1, 2)
        if step.span is not None:
            out = out[step.span_pos]
        flat = torch.empty_like(q)
        if step.valid is None:
            flat[step.rows.view(-1)] = out.reshape(-1, self.heads, self.head_dim)
        else:
            flat[step.rows[step.valid]] = out[step.valid]
        return self.out_proj(flat.view(-1, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend]) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.self_attn = Attention(dataclasses.replace(cfg, attention_bias=True, o_proj_bias=True, qk_norm=False,
                                                       sliding_window=None),
                                   backend_cls, None, use_rope=False)  # type: ignore[arg-type]
        self.self_attn_layer_norm = LayerNorm(width, _EPS)
        self.encoder_attn = CrossAttention(width, cfg.num_heads)
        self.encoder_attn_layer_norm = LayerNorm(width, _EPS)
        self.mlp = GeluMLP(cfg, gelu_approximate(cfg, "gelu", "activation_function"))
        self.final_layer_norm = LayerNorm(width, _EPS)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, cross: CrossStep,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        x = x + self.self_attn(positions, self.self_attn_layer_norm(x), kv_cache, decode)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), cross)
        return x + self.mlp(self.final_layer_norm(x))


# checkpoint name -> ours: the decoder's parts at the top level (where the runner and LlamaForCausalLM look for
# them), its self-attention's projections in Llama's spelling, the MLPs under `mlp`
_RENAMES = ((re.compile(r"^model\.decoder\.layer_norm\."), "model.norm."),
            (re.compile(r"^model\.decoder\."), "model."),
            (re.compile(r"^model\.(layers\.\d+)\.self_attn\.out_proj\."), r"model.\1.self_attn.o_proj."),
            (re.compile(r"(layers\.\d+)\.(fc1|fc2)\."), r"\1.mlp.\2."))
_SELF_QKV = re.compile(r"^((?:encoder\.)?layers\.\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")


class WhisperForConditionalGeneration(LlamaForCausalLM):
    is_hybrid = True  # requests hold state slots: their cross-attention K / V (see the module's docstring)
    cross_attention = True
    checkpointable_state = False  # (the state depends on the audio, not on a token prefix: nothing to checkpoint)
    packed: dict[str, tuple[str, str]] = {}  # (param_name packs the decoder's self-attention q/k/v alone)
    ignored_suffixes = ()

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.raw.get("scale_embedding") else 1.0
        self.encoder = WhisperEncoder(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend_cls) for _ in range(cfg.num_layers))
        self.norm = LayerNorm(cfg.hidden_size, _EPS)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.score = None

    # ------------------------------------------------------------------ state slots (the runner's)
    @property
    def encoder_positions(self) -> int:
        return self.encoder.positions

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * len(self.layers) * self.encoder.positions * self.cfg.hidden_size * elem

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        for layer in self.layers:
            attn = layer.encoder_attn
            shape = (num_slots, attn.heads, self.encoder.positions, attn.head_dim)
            attn.k_state = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_state = torch.zeros(shape, dtype=dtype, device=device)

    def silence(self) -> torch.Tensor:
        """The log-mel features of silence (what the warm-up steps encode): log10 of the floor, 1e-10, scaled as
        streamer/multimodal/audio.py's WhisperFeatures scales every input, (-10 + 4) / 4."""
        return torch.full((self.encoder.num_mel_bins, self.encoder.frames), -1.5)

    def encoder_bytes(self, max_tokens: int) -> int:
        """A bound on the encoder's activations: ENCODER_BATCH clips' positions, a few width- and ffn-sized buffers
        each (the runner adds its cache of encoder outputs)."""
        enc = self.encoder
        return ENCODER_BATCH * enc.positions * (self.cfg.hidden_size * 16 + enc.ffn * 6)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """The encoder's output [F, positions, width] for clips' features [F, mels, frames], ENCODER_BATCH clips at
        a time (bounds the encoder's activations, whatever the step)."""
        dtype = self.embed_tokens.weight.dtype
        return torch.cat([self.encoder(features[i:i + ENCODER_BATCH].to(dtype))
                          for i in range(0, len(features), ENCODER_BATCH)])

    def fill(self, slots: torch.Tensor, encoded: torch.Tensor) -> None:
        """Keep fresh requests' encoder output [F, positions, width], projected, as every layer's cross-attention
        K / V in their `slots` [F]."""
        for i in range(0, len(slots), ENCODER_BATCH):
            for layer in self.layers:
                layer.encoder_attn.fill(slots[i:i + ENCODER_BATCH], encoded[i:i + ENCODER_BATCH])

    @torch.inference_mode()
    def cross_attention_scores(self, encoded: torch.Tensor, token_ids: torch.Tensor,
                               heads: list[tuple[int, int]]) -> torch.Tensor:
        """Teacher-forced, for word timestamps (streamer/multimodal/word_timestamps.py): the decoder over `token_ids` [L]
        (positions from 0) for one clip's encoder output [positions, width], without a cache or a state slot,
        returning the (layer, head) `heads`' cross-attention scores, q.k / sqrt(head_dim) before the softmax:
        float32 [len(heads), L, positions]. Runs the layers up to the last one named."""
        weight = self.embed_tokens.weight
        token_ids = token_ids.to(weight.device)
        length = len(token_ids)
        x = self.embed(token_ids) + self.embed_positions.weight[:length]
        wanted: dict[tuple[int, int], torch.Tensor] = {}
        for i, layer in enumerate(self.layers[:max(layer for layer, _ in heads) + 1]):
            a = layer.self_attn
            q, k, v = a.qkv_proj(layer.self_attn_layer_norm(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q, k, v = (t.view(length, -1, a.head_dim).transpose(0, 1) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.o_proj(out.transpose(0, 1).reshape(length, -1))
            c = layer.encoder_attn
            q = c.q_proj(layer.encoder_attn_layer_norm(x)).view(length, c.heads, c.head_dim).transpose(0, 1)
            k = c.k_proj(encoded).view(-1, c.heads, c.head_dim).transpose(0, 1)
            v = c.v_proj(encoded).view(-1, c.heads, c.head_dim).transpose(0, 1)
            scores = (q @ k.transpose(1, 2)).float() * c.head_dim ** -0.5  # [heads, L, positions]
            for head in (h for layer_id, h in heads if layer_id == i):
                wanted[(i, head)] = scores[head]
            out = scores.softmax(dim=-1).to(v.dtype) @ v
            x = x + c.out_proj(out.transpose(0, 1).reshape(length, -1))
            x = x + layer.mlp(layer.final_layer_norm(x))
        return torch.stack([wanted[h] for h in heads])

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Optional[DecodeBatch] = None, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        cross = current_metadata().cross
        if cross is None:
            raise RuntimeError("Whisper's decoder ran without its cross-attention step (CrossStep)")
        if cross.fresh_slots is not None:
            self.fill(cross.fresh_slots, cross.encoded)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.embed_positions(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(positions, x, kv, cross, decode)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    # ------------------------------------------------------------------ weights
    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint names -> ours (see _RENAMES); `proj_out` is the LM head; the decoder self-attention's k
        projection, which has no bias, gets a zero one (ours is one q/k/v linear with a bias)."""
        for name, t in weights:
            if name == "proj_out.weight":
                name = "lm_head.weight"
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
            yield name, t
            m = _SELF_QKV.match(name.removeprefix("model."))
            if m is not None and m.group(2) == "k" and m.group(3) == "weight":  # (encoder's and decoder's)
                yield name.replace(".weight", ".bias"), t.new_zeros(t.shape[0])

    def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
        name = ckpt_name.removeprefix("model.")
        m = _SELF_QKV.match(name)
        if m is not None:
            return f"{m.group(1)}.self_attn.qkv_proj.{m.group(3)}", m.group(2)
        return name, None

    def checkpoint_name(self, internal: str) -> str:
        name, _, shard = internal.partition(":")
        if name.startswith(("lm_head", "score")):
            return "proj_out.weight"
        if shard:
            name = name.replace(".qkv_proj.", f".{shard}_proj.")
        name = name.replace(".self_attn.o_proj.", ".self_attn.out_proj.").replace(".mlp.fc", ".fc")
        if name.startswith("encoder."):
            return f"model.{name}"
        return "model.decoder.layer_norm." + name[5:] if name.startswith("norm.") else f"model.decoder.{name}"

