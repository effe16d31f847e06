"""Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear attention and gated full
attention layers (`layer_types`: "linear_attention" / "full_attention", every 4th by default), each followed by a
sparse MoE with a gated shared expert (or a dense SwiGLU: `mlp_only_layers`, `decoder_sparse_step`).

- Every RMSNorm is zero-centred, x / rms(x) * (1 + w) (Gemma's: models/gemma3.py GemmaRMSNorm), the per-head q/k
  norms included; the Gated DeltaNet's output norm is the exception (a plain weight, then the SiLU gate).
- Full attention: q_proj yields per head [query; gate] (2 x head_dim); the attention output is multiplied by
  sigmoid(gate) before o_proj. Rotary over the first `partial_rotary_factor` (0.25) of each head.
- Gated DeltaNet: in_proj_qkvz / in_proj_ba hold per key head [q, k, v (heads_v / heads_k heads), z] and [b, a];
  a causal depthwise conv1d (SiLU) over [q; k; v]; q, k L2-normalised; beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias); per value head the state S [k_dim, v_dim] (fp32) follows the gated delta
  rule S <- exp(g) S; S <- S + k (outer) beta (v - S^T k); out = S^T q / sqrt(k_dim), as transformers'
  torch_recurrent_gated_delta_rule (one-token steps) and torch_chunk_gated_delta_rule (prefill chunks, chunk 64);
  then RMSNorm(out) * silu(z) and out_proj.

Like the Mamba layers of models/granite_hybrid.py, a linear-attention layer keeps no KV cache: each running request
holds its conv window and recurrent state in a slot (kv_cache.StateSlotPool), driven by the step's MambaStep from
the forward context (fresh slots zeroed, one-token rows vectorised, prefill chunks from the carried state).
The multi-token-prediction module (`mtp.*`) of released checkpoints is not part of the model: with
speculative_method="mtp" it drafts (models/mtp.py Qwen3NextMTP).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch, PrefillBatch, current_metadata
from streamer.attention.op import paged_attention
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import GemmaRMSNorm
from streamer.models.layers import ColumnParallelLinear, ParallelContext, RotaryEmbedding, RowParallelLinear
from streamer.models.llama import MLP, Attention, LlamaForCausalLM, add_and_norm, require_silu
from streamer.models.mamba import (
    HybridModel,
    RecurrentMixer,
    check_divides,
    from_span,
    over_span,
    per_rank,
    split_conv,
    split_parts,
)
from streamer.models.moe import SparseMoE


def qwen3_next_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's kind: the config's `layer_types`, else every `full_attention_interval`-th (4) full attention."""
    interval = int(raw.get("full_attention_interval") or 4)
    kinds = raw.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                       for i in range(num_layers)]
    if len(kinds) < num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    for k in kinds[:num_layers]:
        if k not in ("linear_attention", "full_attention"):
            raise ValueError(f"unsupported layer type {k!r} in a Qwen3-Next model (linear_attention, full_attention)")
    if "full_attention" not in kinds[:num_layers]:
        raise ValueError("a Qwen3-Next model without a full_attention layer is not supported")
    return list(kinds[:num_layers])


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence by chunks (fp32), from `state`; as transformers'
    torch_chunk_gated_delta_rule. q, k [L, H, Dk] (L2-normalised, q not yet scaled); v [L, H, Dv]; g, beta [L, H];
    state [H, Dk, Dv]. Returns out [L, H, Dv] and the final state."""
    length = q.shape[0]
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
    beta, g = beta.float().T, g.float().T  # [H, L]
    q = q * q.shape[-1] ** -0.5
    pad = (-length) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    h = q.shape[0]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(h, -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(h, -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, out.shape[-1])[:, :length].transpose(0, 1), s


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for each of R requests (fp32), as transformers'
    torch_recurrent_gated_delta_rule: q, k [R, H, Dk] (L2-normalised, q not yet scaled); v [R, H, Dv]; g, beta
    [R, H]; state [R, H, Dk, Dv] (contiguous fp32), updated in place. Returns out [R, H, Dv] and the state."""
    r, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v = q.float().reshape(r * h, 1, dk) / dk ** 0.5, k.float().reshape(r * h, 1, dk), v.float()
    state.mul_(g.float().exp()[..., None, None])
    s = state.view(r * h, dk, dv)  # (products as batched matmuls: no state-sized temporaries)
    delta = (v.reshape(r * h, 1, dv) - torch.bmm(k, s)) * beta.float().reshape(r * h, 1, 1)
    s.baddbmm_(k.transpose(1, 2), delta)
    return torch.bmm(q, s).view(r, h, dv), state


class GatedDeltaNet(RecurrentMixer):
    """Qwen3-Next's linear attention; parameter names as in the checkpoints (`linear_attn.in_proj_qkvz`,
    `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`).

    With tensor parallelism each rank holds key heads / tp key heads and their value heads (`num_k_heads`,
    `num_v_heads`, `key_dim`, `value_dim`, `conv_dim` are this rank's): the projections hold their rows per key head,
    so they split by rows (column-parallel), the conv by parts (q, k, v), out_proj by its input (row-parallel)."""

    chunk_size = 64

    def __init__(self, hidden_size: int, raw: dict[str, Any], eps: float) -> None:
        super().__init__()
        require_silu(raw, "Qwen3-Next")
        v_heads = int(raw.get("linear_num_value_heads", 32))
        k_heads = int(raw.get("linear_num_key_heads", 16))
        self.head_k_dim = int(raw.get("linear_key_head_dim", 128))
        self.head_v_dim = int(raw.get("linear_value_head_dim", 128))
        if v_heads % k_heads:
            raise ValueError(f"linear_num_key_heads ({k_heads}) does not divide linear_num_value_heads ({v_heads})")
        tp = ParallelContext.size
        check_divides(tp, linear_num_key_heads=k_heads)
        self.num_v_heads, self.num_k_heads = v_heads // tp, k_heads // tp
        self.ratio = v_heads // k_heads
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.d_conv = int(raw.get("linear_conv_kernel_dim", 4))
        self.eps = eps
        self.conv_dim = 2 * self.key_dim + self.value_dim
        key, value = self.key_dim * tp, self.value_dim * tp
        self.conv1d = split_conv(nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim,
                                           bias=False), split_parts([key, key, value]))
        self.make_projections(hidden_size, key, value, v_heads)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        per_rank(self.dt_bias, self.A_log)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.out_proj = RowParallelLinear(value, hidden_size)
        for p in self.parameters():
            p.requires_grad_(False)
        self.state_shape = (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def make_projections(self, hidden_size: int, key: int, value: int, v_heads: int) -> None:
        """The input projections (whole-model sizes): Qwen3-Next's two, whose rows run per key head."""
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, [2 * key + 2 * value])
        self.in_proj_ba = ColumnParallelLinear(hidden_size, [2 * v_heads])

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections un-mixed (transformers' fix_query_key_value_ordering): the conv's input [T, conv_dim]
        = [q; k; v], z [T, Hv, Dv], b and a [T, Hv]."""
        t = x.shape[0]
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, self.ratio * self.head_v_dim,
                                 self.ratio * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, -1).split([self.ratio, self.ratio], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, self.num_v_heads, self.head_v_dim), b.reshape(t, self.num_v_heads),
                a.reshape(t, self.num_v_heads))

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [T, conv_dim] -> q, k [T, Hv, Dk] (repeated to the value heads, L2-normalised, fp32)
        and v [T, Hv, Dv]."""
        q, k, v = h.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (l2norm(t.reshape(-1, self.num_k_heads, self.head_k_dim).repeat_interleave(self.ratio, dim=1)
                       .float()) for t in (q, k))
        return q, k, v.reshape(-1, self.num_v_heads, self.head_v_dim)

    def _prefill_batch(self, batch: PrefillBatch, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       out: torch.Tensor, dtype: torch.dtype) -> None:
        """A step's short chunks at once (padded at their ends with g = beta = 0, which leave a state as it is):
        their requests' heads side by side, as one sequence of N x heads heads, for the chunked rule."""
        assert self.ssm_state is not None
        n, length = batch.rows.shape
        h = F.silu(self.conv_prefill_batch(mixed[batch.rows], batch)).to(dtype)  # [N, L, conv_dim]

        def side_by_side(t: torch.Tensor) -> torch.Tensor:  # [N * L, H, ...] -> [L, N * H, ...]
            t = t.unflatten(0, (n, length))
            return t.transpose(0, 1).reshape(length, n * t.shape[2], *t.shape[3:])
        q, k, v = (side_by_side(t) for t in self._qkv(h.flatten(0, 1)))
        keep = batch.valid[..., None]
        gs, betas = (side_by_side((t[batch.rows] * keep).flatten(0, 1)) for t in (g, beta))
        state = self.ssm_state[batch.slots].flatten(0, 1)  # [N * H, Dk, Dv]
        o, final = chunk_gated_delta_rule(q, k, v, gs, betas, self.chunk_size, state)
        self.ssm_state[batch.slots] = final.unflatten(0, (n, -1))
        o = o.unflatten(1, (n, -1)).transpose(0, 1)  # [N, L, H, Dv]
        out[batch.rows[batch.valid]] = o[batch.valid]

    def forward(self, x: torch.Tensor, decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        step = self.begin_step(decode)
        ssm_state = self.ssm_state
        assert ssm_state is not None
        mixed, z, b, a = self._split(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=x.device)
        if step.decode_tokens is not None:  # one token each: a recurrence step, all of them at once
            idx, slots = step.decode_tokens, step.decode_slots
            h = F.silu(self.conv_decode(mixed[idx], slots)).to(x.dtype)
            q, k, v = (over_span(step, t) for t in self._qkv(h))
            state = self.decode_states(step)
            o, _ = recurrent_gated_delta_step(q, k, v, over_span(step, g[idx]), over_span(step, beta[idx]), state)
            self.store_states(step, state)
            out[idx] = from_span(step, o)
        if step.prefill_batch is not None:
            self._prefill_batch(step.prefill_batch, mixed, g, beta, out, x.dtype)
        for slot, start, end in step.long_prefills:  # several tokens: conv after the carried window, then by chunks
            h = F.silu(self.conv_prefill(mixed[start:end], slot)).to(x.dtype)
            q, k, v = self._qkv(h)
            o, final = chunk_gated_delta_rule(q, k, v, g[start:end], beta[start:end], self.chunk_size,
                                              ssm_state[slot])
            ssm_state[slot] = final
            out[start:end] = o
        # RMSNormGated: normalise each head's output (fp32), scale, then the SiLU gate
        o = out.to(x.dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm.weight * o.to(x.dtype)) * F.silu(z.float())
        return self.out_proj(o.to(x.dtype).reshape(x.shape[0], self.value_dim))


class GatedAttention(Attention):
    """Full attention whose q_proj yields per head [query; gate]: out = o_proj(attn * sigmoid(gate)); zero-centred
    q/k norms, partial rotary."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        super().__init__(replace(cfg, qk_norm=False), backend_cls, rotary, qk_norm_cls=GemmaRMSNorm)
        kv = self.kv_size * ParallelContext.size  # (whole-model sizes, as Attention's: kv heads maybe replicated)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [2 * self.q_size * ParallelContext.size, kv, kv],
                                             bias=cfg.attention_bias, shard_names=["q", "k", "v"], replicable=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # type: ignore[misc]
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))  # type: ignore[misc]
        q, k = self.rotary(positions, q, k)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if decode is not None:
            out = self.attn.forward_decode(q, k, v, kv_cache, decode, None)  # type: ignore[attr-defined]
        elif self.use_op:
            out = paged_attention(q, k, v, kv_cache, self.layer_id, None)
        else:
            out = self.attn.forward(q, k, v, kv_cache, current_metadata(), None)
        out = out.reshape(-1, self.q_size) * torch.sigmoid(gate.reshape(-1, self.q_size))
        return self.o_proj(out)


class Qwen3NextSparseMoE(SparseMoE):
    """Softmax top-k routing over the experts, plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        super().__init__(cfg.hidden_size, int(raw["moe_intermediate_size"]), int(raw["num_experts"]),
                         int(raw.get("num_experts_per_tok", 10)), bool(raw.get("norm_topk_prob", True)))
        self.shared_expert = MLP(cfg, int(raw.get("shared_expert_intermediate_size") or 512))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.shared_expert_gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    linear_attention_cls: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        self.self_attn: Optional[GatedAttention] = None
        self.linear_attn: Optional[GatedDeltaNet] = None
        if qwen3_next_layer_types(raw, cfg.num_layers)[index] == "linear_attention":
            self.linear_attn = self.linear_attention_cls(cfg.hidden_size, raw, cfg.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(cfg, backend_cls, rotary)
        sparse = int(raw.get("num_experts") or 0) > 0 and index not in (raw.get("mlp_only_layers") or []) \
            and (index + 1) % int(raw.get("decoder_sparse_step") or 1) == 0
        self.mlp: nn.Module = Qwen3NextSparseMoE(cfg) if sparse else MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        if self.linear_attn is not None:
            h = self.linear_attn(h, decode)
        else:
            h = self.self_attn(positions, h, kv_cache, decode)  # type: ignore[misc]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(HybridModel, LlamaForCausalLM):
    decoder_layer = Qwen3NextDecoderLayer

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        check_divides(tp, linear_num_key_heads=int(cfg.raw.get("linear_num_key_heads", 16)))  # (value heads follow)

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if not name.startswith("mtp."):  # the multi-token-prediction head: not used
                yield name, t
