"""streamer_kernels: Triton kernels for the streamer engine, with pure-torch references.

Every public function here dispatches: the Triton kernel when the tensors are on a GPU (or when
TRITON_INTERPRET=1, which runs the kernels on CPU tensors through Triton's interpreter), the torch reference in
`streamer_kernels.reference` otherwise. The kernel modules are imported lazily, so importing this package does
not need Triton, and TRITON_INTERPRET is honoured as long as it is set before the first kernel call.

Conventions shared by all kernels:
- the last dim of every tensor is contiguous; other dims may be strided (slices of a fused qkv are fine);
- the KV cache per layer is key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim]
  (kv_cache[0] / kv_cache[1] of the engine's [2, ...] tensor);
- query_start_loc / seq_lens / block_table are int32 (int64 also works), slot_mapping is int64;
- no function synchronises with the host: every size the launch needs comes from shapes or Python ints.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from streamer_kernels import reference
from streamer_kernels._utils import HAS_TRITON, interpret_mode, use_triton
from streamer_kernels.reference import build_cos_sin_cache

__all__ = [
    "HAS_TRITON", "interpret_mode", "use_triton", "reference", "build_cos_sin_cache",
    "reshape_and_cache", "unified_attention", "choose_num_kv_splits",
    "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "top_k_top_p_sample", "lora_add",
    "fused_moe",
]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, block_size, Hkv, D] at slot_mapping
    (int64 [T]; slot = block * block_size + offset; -1 = padding, skipped). key/value must have the cache dtype,
    or the cache is FP8 (float8_e4m3fn): then it stores key / k_scale and value / v_scale, saturated at +-448.
    Only the first min(T, len(slot_mapping)) rows are written."""
    if use_triton(key):
        from streamer_kernels.cache import reshape_and_cache as impl
    else:
        impl = reference.reshape_and_cache
    impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def unified_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      softmax_scale: float, max_query_len: int, max_seq_len: int,
                      sliding_window: Optional[int] = None, *, num_kv_splits: Optional[int] = None,
                      logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      causal_limit: Optional[torch.Tensor] = None, attention_chunk: Optional[int] = None,
                      position_bias: Optional[torch.Tensor] = None,
                      query_lens: Optional[Sequence[int]] = None) -> None:
    """Causal paged attention over a varlen batch mixing prefill chunks and decode tokens; writes out [T, H, D].

    q [T, H, D]; key_cache/value_cache [num_blocks, block_size, Hkv, D] (same dtype as q, same strides);
    query_start_loc int32 [B+1]; seq_lens int32 [B] (context length including this step's tokens);
    block_table int32 [B, max_blocks]. Request b's queries sit at positions seq_len_b - q_b ... seq_len_b - 1;
    the query at position p attends keys [max(0, p - sliding_window + 1), p]. max_query_len / max_seq_len are
    host-side hints that pick the launch shape and the split-KV factor; results never depend on them. Rows of
    `out` past query_start_loc[B] are left untouched. num_kv_splits: None = automatic split-KV for decode
    batches; a power of two forces that many splits. logit_softcap: scaled scores s become tanh(s / cap) * cap
    before the softmax (Gemma 2's attention soft-capping); None or 0 = off. sinks: float32 [H] (gpt-oss), one more
    logit per head in the softmax's denominator, with no value; None = off. The caches may instead be FP8
    (float8_e4m3fn), holding k / k_scale and v / v_scale (see reshape_and_cache). causal_limit: int32 [T], the
    last position each query may see (at least its own, within its request's context), in place of its own: a span
    of queries given its end sees itself both ways (Gemma 3's images); None = plain causal. attention_chunk: C
    (Llama 4's chunked local attention), the query at position p sees keys from (p // C) * C on only; None = off.
    position_bias: float32 [H, 2R + 1] (MPNet's relative attention bias), entry R + clamp(d, -R, R) of its head's
    row added to the scaled score of a key d positions after its query; None = off. query_lens: the B query lengths
    on the host (another hint): with them a batch mixing decodes and longer chunks runs as two launches, each
    shaped for its kind.
    """
    args = (q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, softmax_scale, max_query_len,
            max_seq_len, sliding_window)
    kwargs = dict(num_kv_splits=num_kv_splits, logit_softcap=logit_softcap, sinks=sinks, k_scale=k_scale,
                  v_scale=v_scale, causal_limit=causal_limit, attention_chunk=attention_chunk,
                  position_bias=position_bias)
    if use_triton(q):
        from streamer_kernels.attention import unified_attention as impl
        impl(*args, **kwargs, query_lens=query_lens)
    else:
        reference.unified_attention(*args, **kwargs)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                         head_dim: int, dtype: torch.dtype, device: torch.device,
                         sliding_window: Optional[int] = None, attention_chunk: Optional[int] = None) -> int:
    """The split-KV factor `unified_attention` picks by itself (1 = single pass); exposed for planning/tests."""
    from streamer_kernels.attention import choose_num_kv_splits as impl

    return impl(num_seqs, num_kv_heads, max_query_len, max_seq_len, head_dim, dtype, device, sliding_window,
                attention_chunk)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 statistics; output in x's dtype). Returns a new tensor."""
    if use_triton(x):
        from streamer_kernels.norm import rms_norm as impl
    else:
        impl = reference.rms_norm
    return impl(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass. Returns new tensors; inputs are not modified."""
    if use_triton(x):
        from streamer_kernels.norm import fused_add_rms_norm as impl
    else:
        impl = reference.fused_add_rms_norm
    return impl(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] at `positions` [T]; cos_sin_cache [max_pos, rot_dim] = cat(cos, sin)
    (see build_cos_sin_cache, which handles Llama-3 scaling). rot_dim <= D; the rest of each head passes
    through. is_neox: rotate halves (Llama, neox) vs interleaved pairs (GPT-J). Returns new tensors."""
    if use_triton(q):
        from streamer_kernels.rotary import rotary_embedding as impl
    else:
        impl = reference.rotary_embedding
    return impl(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]."""
    if use_triton(x):
        from streamer_kernels.activation import silu_and_mul as impl
    else:
        impl = reference.silu_and_mul
    return impl(x)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """In place: y[t] += x[t] A_s^T B_s^T with s = slots[t] (slot 0: no adapter, row untouched). x [T, in],
    y [T, out], a [S, R, in], b [S, out, R] (last dims contiguous), slots int [T]."""
    if use_triton(x):
        from streamer_kernels.lora import lora_add as impl
    else:
        impl = reference.lora_add
    impl(y, x, a, b, slots)


def top_k_top_p_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor], exp_noise: torch.Tensor,
                       min_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row (int64 [B]) by the exponential race, argmax(p / exp_noise), over what top-k, then top-p
    (renormalised over the top-k set), then min-p keep of softmax(logits / temperature). logits [B, V] (last dim
    contiguous); temperature [B] (<= 0: greedy row, argmax of the logits); top_k int [B] (<= 0 or >= V: off);
    top_p [B] (1.0: off); min_p [B] (0: off); exp_noise fp32 [B, V], E ~ Exp(1). Ties at a boundary are kept."""
    if use_triton(logits):
        from streamer_kernels.sampling import top_k_top_p_sample as impl
    else:
        impl = reference.top_k_top_p_sample
    return impl(logits, temperature, top_k, top_p, exp_noise, min_p)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, b13: Optional[torch.Tensor] = None, activation: str = "silu",
              alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """sum over each token's k experts e of weight * down_e(act(gate_up_e(x) + b13_e)), in x's dtype (each pair's
    product rounded to it, as an unfused loop rounds it). x [T, H]; w13 [E, 2I, H] (gate rows, then up rows; [E, I, H]
    for an ungated activation); w2 [E, H, I]; topk_weights [T, k] (any float dtype); topk_ids int [T, k] in [0, E);
    b13 [E, 2I] or None. activation: "silu", "gelu_tanh", "swiglu_oai" (gpt-oss: alpha, limit) or "relu2"
    (ungated); see reference.expert_activation.
    On the GPU: two grouped GEMM launches over the pairs sorted by expert, no host sync (CUDA-graph safe)."""
    if use_triton(x):
        from streamer_kernels.moe import fused_moe as impl
    else:
        impl = reference.fused_moe
    return impl(x, w13, w2, topk_weights, topk_ids, b13, activation, alpha, limit)
