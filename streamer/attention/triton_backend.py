"""Paged attention through the Triton kernels of `streamer_kernels`: the default backend on CUDA.

forward() = reshape_and_cache (write this step's k/v at slot_mapping) + unified_attention (one launch for a
batch of one kind, two for decodes mixed with prefill chunks, each shaped for its kind; decode-only batches with
few long sequences take the split-KV path).
Nothing here synchronises with the host: launch sizes come from shapes and from the Python ints in the
metadata. With TRITON_INTERPRET=1 (set before the engine starts) the same code runs on CPU tensors.
"""
from __future__ import annotations

from typing import Optional

import torch

from streamer.attention.base import FP8_KV_DTYPE, AttentionMetadata, AttentionSpec, KVScales
from streamer_kernels import interpret_mode
from streamer_kernels.attention import choose_num_kv_splits, unified_attention
from streamer_kernels.cache import reshape_and_cache


class TritonAttentionBackend(KVScales):
    name = "triton"

    def __init__(self, spec: AttentionSpec) -> None:
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not q.is_cuda and not interpret_mode():
            raise RuntimeError("the triton attention backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                               "the engine starts to run on CPU")
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        fp8 = key_cache.dtype == FP8_KV_DTYPE  # (quantized by the kernel, which otherwise only copies)
        if k.dtype != key_cache.dtype and not fp8:
            k, v = k.to(key_cache.dtype), v.to(key_cache.dtype)
        if not self.spec.kv_shared:  # (else an earlier layer stored them)
            reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, self.k_scale, self.v_scale)

        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if q.shape[0] > meta.num_tokens:
            # Padding rows are never written by the kernel; zero them so that nothing downstream (say an MoE
            # router) ever sees uninitialised memory.
            out[meta.num_tokens:].zero_()
        if meta.num_reqs == 0 or meta.num_tokens == 0:
            return out
        spec = self.spec
        num_kv_splits = choose_num_kv_splits(meta.num_reqs, spec.num_kv_heads, meta.max_query_len,
                                             meta.max_seq_len, spec.head_dim, q.dtype, q.device,
                                             spec.sliding_window, spec.attention_chunk)
        limit = meta.window_limit if spec.two_sided_window else None if spec.causal_only else meta.causal_limit
        unified_attention(q, key_cache, value_cache, out, meta.query_start_loc[:meta.num_reqs + 1],
                          meta.seq_lens[:meta.num_reqs], meta.block_table, spec.scale, meta.max_query_len,
                          meta.max_seq_len, spec.sliding_window, num_kv_splits=num_kv_splits,
                          logit_softcap=spec.logit_softcap, sinks=sinks, k_scale=self.k_scale, v_scale=self.v_scale,
                          causal_limit=limit,
                          attention_chunk=spec.attention_chunk, position_bias=meta.position_bias,
                          query_lens=_query_lens(meta))
        return out


def _query_lens(meta: AttentionMetadata) -> list[int]:
    """The step's query lengths on the host (computed once a step, shared by every layer): with them a batch of
    decodes and prefill chunks attends in two launches, each shaped for its kind."""
    lens = meta.backend_cache.get("query_lens")
    if lens is None:
        qsl = meta.query_start_loc_cpu[:meta.num_reqs + 1]
        lens = meta.backend_cache["query_lens"] = (qsl[1:] - qsl[:-1]).tolist()
    return lens
