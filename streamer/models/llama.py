"""One decoder for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 (qkv bias, tied
embeddings), Qwen3 (per-head q/k RMSNorm), Qwen3-MoE and Mixtral (sparse MLPs, models/moe.py) and Phi-3 / Phi-4-mini
(fused checkpoint tensors, LongRoPE, partial rotary). The differences are config switches, not subclasses; Gemma 2
and 3 (models/gemma3.py), gpt-oss (models/gpt_oss.py), Granite (models/granite.py), OLMo 2 (models/olmo2.py),
Llama 4 (models/llama4.py), GLM-4 / GLM-4.5 (models/glm4.py) and SmolLM3 (models/smollm3.py) reuse its attention,
layers and weight loading."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import streamer_kernels as K
from streamer.attention.base import (
    AttentionBackend,
    AttentionSpec,
    DecodeBatch,
    current_metadata,
)
from streamer.attention.op import paged_attention, register_layer
from streamer.models.config import ModelConfig
from streamer.models.layers import (
    GELU_APPROXIMATE,
    ColumnParallelLinear,
    KernelSwitch,
    ParallelContext,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    default_weight_loader,
    rank_rows_loader,
    silu_and_mul,
    stage_holds,
    stage_layers,
)
from streamer.models.moe import EXPERT_PROJ, EXPERT_WEIGHT, INT4_PARTS, SparseMoE

_FROM_CONFIG: Any = object()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, scale: Optional[float] = None, sliding_window: Any = _FROM_CONFIG,
                 qk_norm_cls: Optional[Callable[[int, float], nn.Module]] = None,
                 logit_softcap: Optional[float] = None, sinks: bool = False,
                 attention_chunk: Optional[int] = None, use_rope: bool = True,
                 two_sided_window: bool = False) -> None:
        """`scale` (default head_dim ** -0.5), `sliding_window` (default the config's), `qk_norm_cls`
        (per-head q/k norms of another kind) and `logit_softcap` (attention scores soft-capped) are for models whose
        layers differ (Gemma 2 and 3); `sinks` (a learned logit per head in the softmax, kept in fp32) is gpt-oss's;
        `attention_chunk` (chunked local attention, AttentionSpec's) Llama 4's; `use_rope` False: a NoPE layer,
        whose q and k do not rotate (Llama 4, SmolLM3: `rope_layers`); `two_sided_window` (AttentionSpec's) an
        encoder's local layers'."""
        super().__init__()
        tp = ParallelContext.size
        if cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
            raise ValueError(f"heads ({cfg.num_heads}/{cfg.num_kv_heads}) do not split over {tp} ranks")
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp)  # kv heads are replicated when tp > num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        kv_total = self.kv_size * tp
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.num_heads * cfg.head_dim, kv_total, kv_total],
                                             bias=cfg.attention_bias, shard_names=["q", "k", "v"],
                                             replicable=True)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.sinks: Optional[nn.Parameter] = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = rank_rows_loader  # type: ignore[attr-defined]
        self.rotary = rotary
        self.use_rope = use_rope
        norm_cls = qk_norm_cls or (RMSNorm if cfg.qk_norm else None)
        self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if norm_cls else None
        self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if norm_cls else None
        window = cfg.sliding_window if sliding_window is _FROM_CONFIG else sliding_window
        spec = AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                             self.head_dim ** -0.5 if scale is None else scale, window, logit_softcap,
                             attention_chunk, two_sided_window)
        self.attn: AttentionBackend = backend_cls(spec)
        self.layer_id = register_layer(self.attn)
        self.use_op = False  # set when the model is compiled: attention becomes an opaque custom op

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rotary(positions, q, k)
        return self.attend(q, k, v, kv_cache, decode)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D] from the fused projection."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        """Attention of the projected (normed, rotated) q [T, H, D], k, v [T, Hkv, D], then o_proj."""
        if decode is not None:
            out = self.attn.forward_decode(q, k, v, kv_cache, decode, self.sinks)  # type: ignore[attr-defined]
        elif self.use_op:
            out = paged_attention(q, k, v, kv_cache, self.layer_id, self.sinks)
        else:
            out = self.attn.forward(q, k, v, kv_cache, current_metadata(), self.sinks)
        return self.o_proj(out.reshape(-1, self.q_size))


def require_silu(raw: dict, family: str) -> None:
    """Refuse a config whose `hidden_act` is not SiLU, the only activation these gated MLPs compute."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{family} with hidden_act={act!r} is not supported (silu is)")


class MLP(nn.Module, KernelSwitch):
    """down(act(gate(x)) * up(x)): SiLU (fused kernel on GPU), or GELU where the config's `hidden_act` says so."""

    def __init__(self, cfg: ModelConfig, intermediate_size: Optional[int] = None, bias: bool = False) -> None:
        """`intermediate_size`: default the config's (Llama 4's dense layers have their own). `bias`: on all three
        projections (ERNIE 4.5's `use_bias`, Seed-OSS's; the down projection's is added after the all-reduce)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter] * 2, bias=bias, shard_names=["gate", "up"])
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias)
        act = cfg.raw.get("hidden_act") or "silu"
        self.gelu: Optional[str] = None  # F.gelu's `approximate`, for a GELU-gated MLP
        if act in GELU_APPROXIMATE:
            self.gelu = GELU_APPROXIMATE[act]
        elif act not in ("silu", "swish"):
            raise ValueError(f"{cfg.architecture} with hidden_act {act!r} is not supported "
                             f"(silu, {', '.join(GELU_APPROXIMATE)} are)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.gelu is not None:
            gate, up = h.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate=self.gelu) * up)
        act = K.silu_and_mul if self.use_kernel else silu_and_mul
        return self.down_proj(act(h))


def add_and_norm(norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's entry: the residual stream is x + residual (not yet added: the norm fuses the addition), or x
    alone in the first layer. Returns (normed, stream)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def rope_layers(raw: dict[str, Any], num_layers: int) -> list[bool]:
    """Which layers rotate q and k (Llama 4's and SmolLM3's `no_rope_layers`: 1 rotates, 0 is a NoPE layer); by
    default every `no_rope_layer_interval`-th layer (4) is a NoPE layer, as transformers derives it."""
    interval = int(raw.get("no_rope_layer_interval") or 4)
    flags = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return [bool(f) for f in flags[:num_layers]]


def moe_layer(cfg: ModelConfig, index: int) -> Optional[SparseMoE]:
    """The sparse MLP of layer `index` (Qwen3-MoE, Mixtral), or None where the layer keeps a dense one."""
    raw = cfg.raw
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if cfg.architecture == "MixtralForCausalLM":
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, experts, raw.get("num_experts_per_tok", 2),
                         norm_topk_prob=True, fp32_weights=True)
    if cfg.architecture != "Qwen3MoeForCausalLM" or not experts:
        return None
    step = raw.get("decoder_sparse_step") or 1
    if index in (raw.get("mlp_only_layers") or []) or (index + 1) % step:
        return None
    return SparseMoE(cfg.hidden_size, raw["moe_intermediate_size"], experts, raw.get("num_experts_per_tok", 8),
                     bool(raw.get("norm_topk_prob", False)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp: nn.Module = moe_layer(cfg, index) or MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        """Layer `index`'s attention (built once: each one registers a backend); Granite's scales differently,
        SmolLM3's NoPE layers do not rotate."""
        return Attention(cfg, backend_cls, rotary)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        h = self.self_attn(positions, h, kv_cache, decode)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# (layer index, x, residual) -> (x, residual): LlamaForCausalLM.run_layers' hook between layers
LayerHook = Callable[[int, torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, Optional[torch.Tensor]]]


class MissingLayer(nn.Module):
    """Another pipeline stage's decoder layer: nothing here (no weights, no KV cache)."""


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[nn.Module] = DecoderLayer  # built as decoder_layer(cfg, backend_cls, rotary, index)
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }
    ignored_suffixes = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
    rope_is_neox = True  # the rotary layout (False: GPT-J's interleaved pairs, Llama 4's and GLM-4's)

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend], max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 is_neox=self.rope_is_neox)
        if cfg.mrope_section:
            rotary.use_mrope(cfg.mrope_section, interleaved=cfg.mrope_interleaved)
        # (sequence length past which positions take the long LongRoPE table, that table's row offset)
        self.long_rope = (rotary.long_threshold, rotary.long_offset) if rotary.long_threshold else None
        # Pipeline parallelism (ParallelContext.stage): a stage builds only its layers (the others are empty
        # placeholders, so that layer i stays self.layers[i]); the first stage embeds and holds the LM head (rank 0
        # samples), the last one the final norm.
        stage, stages = ParallelContext.stage, ParallelContext.num_stages
        self.pp_first, self.pp_last = stage == 0, stage == stages - 1
        indices = list(self.layer_indices(cfg))
        self.pp_layers = stage_layers(len(indices), stage, stages) if stages > 1 else (0, len(indices))
        lo, hi = self.pp_layers
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if self.pp_first else None
        self.layers = nn.ModuleList(self.decoder_layer(cfg, backend_cls, rotary, i) if lo <= k < hi else MissingLayer()
                                    for k, i in enumerate(indices))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings or not self.pp_first
                        else VocabEmbedding(cfg.vocab_size, cfg.hidden_size))
        # A sequence classifier's head (its config ties the embeddings: there is no LM head); the runner applies it
        # to the pooled last-token hidden states.
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The score head's logits (fp32) of pooled hidden states [n, hidden] (fp32). Linear without a bias, so the
        runner may apply it to a chunk's share of the pooled sum."""
        assert self.score is not None
        return pooled @ self.score.weight.float().T

    def layer_indices(self, cfg: ModelConfig) -> Iterable[int]:
        """The indices of the decoder layers built (a multi-token-prediction head builds only the one past the last)."""
        return range(cfg.num_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Optional[DecodeBatch] = None, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; `compute_logits` projects only the rows that sample.
        The step's attention metadata comes from `streamer.attention.base.forward_context`; a decode-only step
        may instead carry its own (`decode`), so that a backend that can attends inside the compiled graph.
        `inputs_embeds`: the residual stream's start given (images' features placed among the tokens' embeddings,
        run eagerly; or, in a later pipeline stage, the stage before's output, through its own compiled graphs)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        return self.run_layers(positions, x, kv_caches, decode)

    def run_layers(self, positions: torch.Tensor, x: torch.Tensor, kv_caches: list[torch.Tensor],
                   decode: Optional[DecodeBatch] = None, after_layer: Optional[LayerHook] = None) -> torch.Tensor:
        """The decoder layers over the residual stream's start `x`, then the final norm. `after_layer(i, x,
        residual) -> (x, residual)` may change the stream after layer i (Qwen3-VL's DeepStack, on image steps).
        With `aux_layers` (an EAGLE-3 head's), the residual streams entering those layers follow the final hidden
        states in each row: [T, hidden * (1 + len(aux_layers))] (the runner splits them)."""
        residual = None
        aux = []
        layers = self.layers
        lo, hi = self.pp_layers or (0, len(layers))
        for i in range(lo, hi):
            if i in self.aux_layers:
                aux.append(x if residual is None else x + residual)
            x, residual = layers[i](positions, x, residual, kv_caches[i], decode)
            if after_layer is not None:
                x, residual = after_layer(i, x, residual)
        if not self.pp_last:  # the residual stream for the next pipeline stage (its first layer adds the same way)
            return x if residual is None else x + residual
        out = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return torch.cat([out, *aux], dim=-1) if aux else out

    def keep_stage(self) -> None:
        """A class whose own __init__ built every layer (Gemma 3's): keep only this pipeline stage's, as __init__
        builds them (the loader calls it before loading; nothing to do with one stage or after __init__ did it)."""
        stage, stages = ParallelContext.stage, ParallelContext.num_stages
        if stages == 1 or self.pp_layers is not None:
            return
        self.pp_first, self.pp_last = stage == 0, stage == stages - 1
        self.pp_layers = lo, hi = stage_layers(len(self.layers), stage, stages)
        for i in range(len(self.layers)):
            if not lo <= i < hi:
                self.layers[i] = MissingLayer()
        if not self.pp_first:
            self.embed_tokens = self.lm_head = None

    def own_layers(self) -> list[nn.Module]:
        """The decoder layers this pipeline stage runs (all of them with one stage)."""
        lo, hi = self.pp_layers or (0, len(self.layers))
        return list(self.layers[lo:hi])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start (Gemma and Granite scale it)."""
        return self.embed_tokens(input_ids)

    @property
    def input_width(self) -> int:
        """The embedding layer's output width: a prompt embedding's."""
        return self.cfg.hidden_size

    def from_input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Given rows of the embedding layer's output (prompt embeddings: what transformers'
        `get_input_embeddings()` makes of token ids, Gemma's scale included), the residual stream's start as
        `embed` makes it of token ids (Granite's multiplier and OPT's projection come after that layer)."""
        return x

    packed_head: Optional[torch.Tensor] = None
    aux_layers: tuple[int, ...] = ()  # see run_layers
    # Pipeline parallelism: this stage's decoder layers [lo, hi) (None: all), whether it is the first / the last
    pp_layers: Optional[tuple[int, int]] = None
    pp_first = pp_last = True
    long_rope: Optional[tuple[int, int]] = None
    bidirectional_images = False  # (vision-language models: models/vlm.py)
    bidirectional = False  # every token attends to its whole prompt (an encoder: models/bert.py)
    two_sided_window = 0  # an encoder's local layers' window, both ways (AttentionSpec.two_sided_window); 0: none
    classifier_pooling = "last"  # the token(s) a sequence classifier's head reads: "last", "cls" or "mean"
    relative_bias = False  # its attention adds a relative position bias (position_bias_table: MPNet's)

    def position_bias_table(self) -> torch.Tensor:
        """A model with `relative_bias`: the step's AttentionMetadata.position_bias, computed from its weights."""
        raise NotImplementedError(f"{type(self).__name__} has no relative position bias")

    def use_kernels(self, on: bool) -> None:
        """Norms, rotary and SiLU-and-mul through `streamer_kernels`' Triton kernels (see KernelSwitch)."""
        for module in self.modules():
            if isinstance(module, KernelSwitch):
                module.use_kernel = on

    def pack_head_for_cpu(self) -> None:
        """Keep the LM head in oneDNN's prepacked layout (as PackableLinear does for the other linears): it runs
        eagerly after the (possibly compiled) model, once per step. A tied head keeps its plain weight: the
        embedding reads it."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        self.packed_head = torch.ops.mkldnn._reorder_linear_weight(head.weight.detach(), 16)
        if self.lm_head is not None:
            self.lm_head.weight.data = self.lm_head.weight.data.new_empty(0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_head, None, "none", [], "").float()
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return torch.nn.functional.linear(hidden, head.weight).float()

    # ------------------------------------------------------------------ weights
    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensor names in the text families' spelling (a wrapper model renames its own)."""
        return weights

    def param_name(self, ckpt_name: str) -> tuple[str, Optional[str]]:
        """Map a checkpoint tensor name to (our parameter name, shard id within a packed parameter)."""
        name = ckpt_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router
        for frag, (ours, shard) in self.packed.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{ours}."), shard
        return name, None

    def holds(self, name: str) -> bool:
        """Whether this pipeline stage holds the weight `name` (every weight with one stage)."""
        return ParallelContext.num_stages == 1 or stage_holds(name, self.pp_layers, self.pp_first, self.pp_last)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the names of the parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(self.ignored_suffixes) or not self.holds(ckpt_name):
                continue
            if ckpt_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy of the embedding
            expert = EXPERT_WEIGHT.match(ckpt_name.removeprefix("model."))
            if expert is not None:  # one expert's matrix of a sparse MLP: into its slot of the stacked weights
                prefix, e, proj, part = expert.groups()
                proj = EXPERT_PROJ.get(proj, proj)
                name = f"{prefix}.mlp.{'w2' if proj == 'down_proj' else 'w13'}{part or ''}"
                param = params.get(name)
                if param is None:
                    raise ValueError(f"unexpected tensor {ckpt_name!r} in checkpoint for {self.cfg.architecture}")
                param.weight_loader(param, tensor, ckpt_name, f"{e}.{proj}")  # type: ignore[attr-defined]
                loaded.add(f"{name}:{e}.{proj}")
                continue
            name, shard = self.param_name(ckpt_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected tensor {ckpt_name!r} in checkpoint for {self.cfg.architecture}")
            loader = getattr(param, "weight_loader", None)
            parts = self._fused_parts(name, tensor) if shard is None else None
            if parts is not None:  # already fused in the checkpoint (Phi-3): each part goes to its shard
                for part_shard, part in parts:
                    loader(param, part, ckpt_name, part_shard)  # type: ignore[misc]
                    loaded.add(f"{name}:{part_shard}")
                continue
            if loader is not None:
                loader(param, tensor, ckpt_name, shard)
            else:
                default_weight_loader(param, tensor, ckpt_name)
            loaded.add(name if shard is None else f"{name}:{shard}")
        return loaded

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
        """A checkpoint tensor that already packs q/k/v or gate/up (Phi-3's qkv_proj, gate_up_proj), split into
        its sub-matrices at the checkpoint's (unsharded) sizes; None for any other tensor."""
        c = self.cfg
        fused = {"qkv_proj": (("q", "k", "v"), (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                                 c.num_kv_heads * c.head_dim)),
                 "gate_up_proj": (("gate", "up"), (c.intermediate_size, c.intermediate_size))}
        frag = name.split(".")[-2]
        if frag not in fused:
            return None
        shards, sizes = fused[frag]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"fused tensor {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                             f"({' + '.join(map(str, sizes))})")
        return list(zip(shards, tensor.split(list(sizes), dim=0)))

    def expected_weights(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if not self.holds(name):  # (built by a subclass on every stage, but not this stage's to load)
                continue
            owner_name, attr = name.rsplit(".", 1)
            owner = self.get_submodule(owner_name)
            if isinstance(owner, SparseMoE) and attr in INT4_PARTS:
                names.update(f"{name}:{piece}" for piece in owner.expected_shards()[attr.split("_")[0]])
            elif isinstance(owner, ColumnParallelLinear):
                names.update(f"{name}:{s}" if len(owner.shard_names) > 1 else name for s in owner.shard_names)
            else:
                names.add(name)
        return names

    def checkpoint_name(self, internal: str) -> str:
        """Inverse of param_name, for error messages."""
        name, _, shard = internal.partition(":")
        if shard and name.rsplit(".", 1)[-1] in INT4_PARTS:
            e, proj = shard.split(".")
            layer, part = name.rsplit(".", 2)[0], name.rsplit(".", 1)[-1].partition("_")[2]
            suffix = f"weight_{part}" if part else "weight"
            if self.cfg.architecture == "MixtralForCausalLM":
                w = {v: k for k, v in EXPERT_PROJ.items()}[proj]
                return f"model.{layer}.block_sparse_moe.experts.{e}.{w}.{suffix}"
            return f"model.{layer}.mlp.experts.{e}.{proj}.{suffix}"
        if shard:
            fused = {v: k for k, v in self.packed.items()}
            frag = fused[(name.split(".")[-2], shard)]
            name = name.replace(f".{name.split('.')[-2]}.", f".{frag}.")
        return name if name.startswith(("lm_head", "score")) else f"model.{name}"
