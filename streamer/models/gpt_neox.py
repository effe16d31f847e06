"""GPT-NeoX (GPTNeoXForCausalLM: EleutherAI's Pythia suite, 14M to 12B, GPT-NeoX-20B, and their fine-tunes: Dolly
v2, OpenAssistant's Pythia SFTs, RedPajama-INCITE, ...). The Llama decoder's attention and weight loading, with
GPT-NeoX's differences:

- q, k and v come out of one fused `query_key_value` linear whose rows are laid out per head, [q_h, k_h, v_h] for
  each head h in turn (not all q rows, then all k, then all v): `rename_weights` de-interleaves them into q/k/v
  (so tensor parallelism splits them by heads as any other model's); biases on it and on `dense` (o_proj) unless
  `attention_bias` is false;
- partial rotary: only the first `rotary_pct` (0.25 by default; the config's older spelling of
  `partial_rotary_factor`) of each head rotates, with base `rotary_emb_base` (older spelling of `rope_theta`),
  Llama's rotate-halves layout within that part;
- LayerNorm with a bias (eps `layer_norm_eps`), not RMSNorm, two per layer and a final one;
- `use_parallel_residual` (on by default, as in every Pythia): x + attn(ln1(x)) + mlp(ln2(x)); off: Llama's order,
  h = x + attn(ln1(x)), h + mlp(ln2(h));
- the MLP is two biased linears with GELU between them (`dense_h_to_4h`, `dense_4h_to_h`, exact GELU by default),
  no gate;
- an untied LM head stored as `embed_out`; embeddings `embed_in`, final norm `final_layer_norm`.

`ParallelResidualLayer`, `GeluMLP` and `gelu_approximate` are shared with Phi (models/phi.py) and StableLM
(models/stablelm.py), and with Falcon, GPT-J and OPT (models/falcon.py, gptj.py, opt.py); `fused_qkv_parts` (a fused
q/k/v cut into q, k and v) with GPTBigCode and Falcon.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import ColumnParallelLinear, LayerNorm, RotaryEmbedding, RowParallelLinear, gelu_approximate
from streamer.models.llama import Attention, LlamaForCausalLM, add_and_norm


def layer_norm_eps(cfg: ModelConfig) -> float:
    eps = cfg.raw.get("layer_norm_eps")
    return 1e-5 if eps is None else float(eps)


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))), both linears biased unless `bias` is off (GPT-NeoX's dense_h_to_4h / dense_4h_to_h, Phi's
    fc1 / fc2; Falcon's `bias`)."""

    def __init__(self, cfg: ModelConfig, approximate: str, bias: bool = True) -> None:
        super().__init__()
        self.approximate = approximate
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], bias=bias)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class ParallelResidualLayer(nn.Module):
    """A pre-LayerNorm decoder layer, parallel or sequential. Parallel: x + attn(ln1(x)) + mlp(ln2(x)), or
    mlp(ln1(x)) when there is no second norm (Phi, StableLM-2-12B); sequential: Llama's order. Subclasses set
    `self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm` (or None) and `parallel`."""

    self_attn: Attention
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: Optional[nn.Module]
    parallel: bool

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        if self.parallel:
            # Returns (branch, stream), not yet added: the next norm adds them (as the Cohere layer does).
            attn = self.self_attn(positions, h, kv_cache, decode)
            post = self.post_attention_layernorm
            return self.mlp(h if post is None else post(residual)), residual + attn
        h = self.self_attn(positions, h, kv_cache, decode)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class GPTNeoXLayer(ParallelResidualLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        bias = bool(cfg.attention_bias)
        self.self_attn = Attention(dataclasses.replace(cfg, attention_bias=bias, o_proj_bias=bias), backend_cls,
                                   rotary)
        self.mlp = GeluMLP(cfg, gelu_approximate(cfg, "gelu"))
        eps = layer_norm_eps(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.parallel = bool(cfg.raw.get("use_parallel_residual", True))


def fused_qkv_parts(name: str, t: Any, kv_heads: int, head_dim: int, rows: int, family: str) -> list[Any]:
    """A fused q/k/v checkpoint tensor (weight or bias; `name` ends in its kind) cut into q, k and v. Its rows are
    grouped by kv head: each of the `kv_heads` groups holds its query heads' rows, then its key head's, then its value
    head's. That covers GPT-NeoX's per-head [q_h, k_h, v_h] (groups of one query head), multi-query [all q; k; v] (one
    group) and Falcon-40B's grouped layout. A names-only look (the loader's, at a quantized checkpoint) passes through
    thrice; a quantized tensor is refused (its packed form cannot be cut by rows)."""
    if name.rsplit(".", 1)[-1] not in ("weight", "bias"):
        raise ValueError(f"{name!r}: quantized {family} checkpoints are not supported (the fused q/k/v cannot be split "
                         "in its packed form)")
    if not isinstance(t, torch.Tensor):
        return [t] * 3
    if t.shape[0] != rows:
        raise ValueError(f"tensor {name!r} has {t.shape[0]} rows, expected {rows}")
    rest = t.shape[1:]
    groups = t.reshape(kv_heads, -1, head_dim, *rest)  # (GPT-2's transposed Conv1D weights are not contiguous)
    return [groups[:, :-2].reshape(-1, *rest), groups[:, -2].reshape(-1, *rest), groups[:, -1].reshape(-1, *rest)]


# checkpoint name fragment -> ours (after `gpt_neox.` is dropped)
def to_ours(name: str, names: Sequence[tuple[str, str]], root: str = "") -> str:
    """A checkpoint tensor name in Llama's spelling: its `root` (GPT-2's, GPT-J's, Falcon's `transformer.`) read as
    `model.`, then each (theirs, ours) fragment replaced, in order."""
    if root and name.startswith(root):
        name = "model." + name.removeprefix(root)
    for frag, ours in names:
        name = name.replace(frag, ours)
    return name


def to_theirs(name: str, names: Sequence[tuple[str, str]], root: str = "") -> str:
    """`to_ours` undone, for error messages (the fragments in the same order: one that contains another, listed
    first, goes back first)."""
    for frag, ours in names:
        name = name.replace(ours, frag)
    return root + name.removeprefix("model.") if root and name.startswith("model.") else name


def renamed_lora_parts(model: Any, module: str, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A LoRA adapter's module (named as in the checkpoint) in our spelling, with its B [out, r]: read by the
    model's `rename_weights` as the module's weight is, so a fused query_key_value's B is cut into q, k and v by rows
    exactly as its weight (the families' layouts differ; A is shared by the three). The families whose checkpoint
    names differ from Llama's set `lora_parts = renamed_lora_parts` (streamer/models/lora.py place_adapter)."""
    return [(name.removesuffix(".weight"), part) for name, part in model.rename_weights([(f"{module}.weight", b)])]


_NEOX_NAMES = ((".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.fc1."),
               (".mlp.dense_4h_to_h.", ".mlp.fc2."))
_QKV = re.compile(r"(layers\.\d+)\.attention\.query_key_value\.(\w+)$")


class GPTNeoXForCausalLM(LlamaForCausalLM):
    decoder_layer = GPTNeoXLayer
    lora_parts = renamed_lora_parts
    # (older checkpoints store the causal mask and the rotary frequencies as buffers)
    ignored_suffixes = LlamaForCausalLM.ignored_suffixes + ("attention.bias", "attention.masked_bias",
                                                           "rotary_emb.inv_freq")

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.head_dim * cfg.num_heads != cfg.hidden_size or cfg.num_kv_heads != cfg.num_heads:
            raise ValueError(f"GPT-NeoX needs head_dim * heads == hidden_size and as many kv heads as heads (got "
                             f"{cfg.head_dim} x {cfg.num_heads} / {cfg.num_kv_heads}, hidden {cfg.hidden_size})")
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, layer_norm_eps(cfg))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """GPT-NeoX's names in Llama's spelling; the fused per-head-interleaved query_key_value split into q/k/v
        (as whole checkpoint tensors: their loaders take each rank's heads)."""
        heads, dim = self.cfg.num_heads, self.cfg.head_dim
        for name, t in weights:
            name = name.removeprefix("gpt_neox.")
            if name.startswith(("embed_out.", "lm_head.")):
                yield "lm_head." + name.split(".", 1)[1], t
                continue
            if name.endswith(self.ignored_suffixes):
                continue
            name = name.replace("embed_in.", "embed_tokens.").replace("final_layer_norm.", "norm.")
            name = to_ours(name, _NEOX_NAMES)
            qkv = _QKV.search(name)
            if qkv is None:
                yield f"model.{name}", t
                continue
            layer, suffix = qkv.groups()
            parts = fused_qkv_parts(name, t, heads, dim, 3 * heads * dim, "GPT-NeoX")  # (per head: groups of one)
            for proj, part in zip(("q", "k", "v"), parts):
                yield f"model.{layer}.self_attn.{proj}_proj.{suffix}", part

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        if name.startswith("lm_head."):
            return name.replace("lm_head.", "embed_out.")
        name = re.sub(r"\.self_attn\.[qkv]_proj\.", ".attention.query_key_value.", name)
        name = to_theirs(name, _NEOX_NAMES).replace("model.embed_tokens.", "model.embed_in.").replace("model.norm.", "model.final_layer_norm.")
        return "gpt_neox." + name.removeprefix("model.")
