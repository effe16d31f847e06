"""Pure-torch references for every kernel in `streamer_kernels`.

They define correctness (the Triton kernels are tested against them) and are also what the engine runs on a
machine without Triton, so the elementwise ones (norm, rotary, activation) are vectorised; only the attention
reference loops over requests, because clarity matters more there than speed.

Signatures match the public API in `streamer_kernels/__init__.py` exactly.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "reshape_and_cache", "unified_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
    "silu_and_mul", "build_cos_sin_cache", "top_k_top_p_sample", "top_k_top_p_mask", "lora_add",
]


# --------------------------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------------------------

def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at `slot_mapping` (-1 = skip).

    Only the first min(T, len(slot_mapping)) rows are considered. An FP8 (float8_e4m3fn) cache stores
    key / k_scale and value / v_scale, saturated at +-448.
    """
    if key_cache.dtype == torch.float8_e4m3fn:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].to(torch.long)
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indexing on the first two dims writes through to the (possibly strided) cache views.
    key_cache[blocks, offsets] = key[:n][keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:n][keep].to(value_cache.dtype)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8_e4m3fn, saturated at +-448 (its largest finite value): an outlier must not become NaN."""
    y = x.float() / scale if scale != 1.0 else x.float()
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------

def _gather_context(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one request, [seq_len, Hkv, D], gathered through its block table row."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_row.to(torch.long)[positions // block_size]
    return cache[blocks, positions % block_size]


def unified_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      softmax_scale: float, max_query_len: int, max_seq_len: int,
                      sliding_window: Optional[int] = None, *, num_kv_splits: Optional[int] = None,
                      logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      causal_limit: Optional[torch.Tensor] = None, attention_chunk: Optional[int] = None,
                      position_bias: Optional[torch.Tensor] = None) -> None:
    """Causal paged attention for a varlen batch of prefill chunks and decode tokens; writes `out` [T, H, D].

    Request b owns query rows query_start_loc[b] : query_start_loc[b+1]; its q_b queries sit at positions
    seq_len_b - q_b ... seq_len_b - 1 and the query at position p attends keys [max(0, p - window + 1), p].
    With `logit_softcap` (Gemma 2), scaled scores s become tanh(s / cap) * cap before the softmax. `sinks` [H]
    (gpt-oss): each head's softmax gets one more logit, sinks[h], with no value to attend.
    `max_query_len`, `max_seq_len` and `num_kv_splits` are planning hints for the kernel and unused here.
    An FP8 cache holds k / k_scale and v / v_scale. `causal_limit` [T] (absolute positions, >= each query's own):
    the last key each query sees, in place of its own position (Gemma 3's images see themselves both ways).
    `attention_chunk` C (Llama 4's chunked local attention): the query at position p sees keys from
    (p // C) * C on only (also within the window, if any). `position_bias` [H, 2R + 1] (MPNet's relative
    attention bias): the scaled (and capped) score of a key d positions after its query gains entry
    R + clamp(d, -R, R) of its head's row.
    """
    del max_query_len, max_seq_len, num_kv_splits
    if key_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(key_cache, block_table[b], seq_len).float() * k_scale  # [S, Hkv, D]
        v = _gather_context(value_cache, block_table[b], seq_len).float() * v_scale
        qb = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qb, k) * softmax_scale  # [Hkv, G, q, S]
        if logit_softcap:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        if position_bias is not None:
            scores = scores + relative_bias(position_bias, q_pos, k_pos).view(num_kv_heads, group, q_len, seq_len)
        last = q_pos if causal_limit is None else causal_limit[q_start:q_end].to(q_pos)[:, None]
        allowed = k_pos <= last
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        if attention_chunk:
            allowed &= k_pos >= q_pos // attention_chunk * attention_chunk
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]
        o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, num_heads, head_dim)
        out[q_start:q_end] = o.to(out.dtype)


def relative_bias(table: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """A relative position bias table [H, 2R + 1] read at each (query, key) pair's distance: [H, Lq, Lk] fp32."""
    radius = table.shape[1] // 2
    return table.float()[:, ((k_pos - q_pos).clamp(-radius, radius) + radius)]


# --------------------------------------------------------------------------------------------------------------
# Norm, rotary, activation
# --------------------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm over the last dim: statistics in fp32, the normalised value rounded to x's dtype
    before the weight is applied (as Hugging Face does, so checkpoints reproduce bit-for-bit)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is taken in the model dtype, as the unfused model does."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def build_cos_sin_cache(rot_dim: int, max_position: int, base: float = 10000.0,
                        rope_scaling: Optional[dict] = None, dtype: torch.dtype = torch.float32,
                        device: Optional[torch.device | str] = None) -> torch.Tensor:
    """cat(cos, sin) [max_position, rot_dim] for `rotary_embedding`.

    `rope_scaling` follows the Hugging Face config: None, {"rope_type": "linear", "factor"}, or
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    Computed in fp32 step by step as Hugging Face's rotary embedding does (so checkpoints reproduce), then cast.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device=device).float() / rot_dim))
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    rope_type = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        pass
    elif rope_type == "linear":
        positions = positions / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, and the band between is interpolated.
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by position; returns new tensors (the inputs are not modified).

    cos_sin_cache [max_pos, rot_dim] = cat(cos, sin); the first rot_dim dims of each head are rotated, the rest
    pass through. neox pairs dim i with i + rot_dim/2; GPT-J pairs 2i with 2i+1. Math in fp32.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x_rot, x_pass = xf[..., :rot_dim], xf[..., rot_dim:]
        if is_neox:
            x1, x2 = x_rot.chunk(2, dim=-1)
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rotated, x_pass], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], as the unfused gated MLP computes it in x's dtype."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def expert_activation(h: torch.Tensor, activation: str = "silu", alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """An expert's activation. Gated ones, [..., 2I] (gate, then up) -> [..., I]: "silu", silu(gate) * up
    ("gelu_tanh": GELU's); "swiglu_oai" (gpt-oss), the gate clamped above and the up projection on both sides at
    `limit`, gate * sigmoid(alpha * gate) * (up + 1). Ungated, [..., I] -> [..., I]: "relu2" (Nemotron-H),
    relu(up) ** 2."""
    if activation == "relu2":
        return torch.square(F.relu(h))
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":  # (Gemma 4's experts)
        return F.gelu(gate, approximate="tanh") * up
    if activation != "swiglu_oai":
        raise ValueError(f"unknown expert activation {activation!r}")
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


# --------------------------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------------------------

def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, b13: Optional[torch.Tensor] = None, activation: str = "silu",
              alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """Each token's routed experts, one (token, expert) pair at a time, in x's dtype: the definition."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = F.linear(x[t], w13[e], None if b13 is None else b13[e])
            y = F.linear(expert_activation(h, activation, alpha, limit), w2[e])
            out[t] += (y * topk_weights[t, j]).to(x.dtype).float()
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------------

def top_k_top_p_mask(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                     top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [B, V] (fp32) with every token outside each row's top-k and top-p set set to -inf.

    top_k int [B] (values <= 0 or >= V mean "off"), top_p float [B] (1.0 = off). The top-p set is the smallest
    set of most-likely tokens (after top-k) whose probability reaches top_p; ties at the boundary are kept.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the tokens strictly more likely than it already reach top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p = 1.0 is "off": the cumsum's rounding must not drop a row's least likely tokens.
        drop_sorted = (mass_before >= top_p.float()[:, None]) & (top_p < 1.0)[:, None]
        drop_sorted[:, 0] = False  # always keep the most likely token
        threshold = sorted_logits.masked_fill(drop_sorted, float("inf")).min(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


def top_k_top_p_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor], exp_noise: torch.Tensor,
                       min_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sample one token per row by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d.

    That argmax is distributed exactly as p, needs no normalisation or cumulative sum, and is a deterministic
    function of `exp_noise` [B, V] (so per-request seeded generators can supply it). Rows with temperature
    <= 0 take the argmax of the logits. min_p [B] (0 = off) then keeps tokens with p >= min_p * p_max.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits.float() / temp[:, None]
    masked = top_k_top_p_mask(scaled, top_k, top_p)
    probs = masked.softmax(dim=-1)
    if min_p is not None:
        probs = probs * (probs >= min_p.float()[:, None] * probs.max(dim=-1, keepdim=True).values)
    sampled = (probs / exp_noise).argmax(dim=-1)
    return torch.where(greedy.to(sampled.device), logits.float().argmax(dim=-1), sampled)


# --------------------------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------------------------

def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """y[t] += x[t] A_s^T B_s^T, s = slots[t], by gathering each token's A and B (slot 0 is expected to hold
    zeros, as the engine keeps it; the kernel skips such rows instead)."""
    h = torch.bmm(x.unsqueeze(1), a.index_select(0, slots).transpose(1, 2))
    y += torch.bmm(h, b.index_select(0, slots).transpose(1, 2)).squeeze(1)
