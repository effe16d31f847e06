"""Paged attention in plain torch: the CPU path, and the reference the Triton backend is checked against.

Decode tokens (query length 1) of all requests are attended in one batched call over their gathered,
padded contexts; prefill chunks go one request at a time with an explicit causal mask offset by the
number of tokens already cached.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from streamer.attention.base import AttentionMetadata, AttentionSpec


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    n = slot_mapping.shape[0]
    k, v = k[:n], v[:n]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    hkv, d = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.gqa = spec.num_heads // spec.num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.zeros_like(q)
        qsl = meta.query_start_loc_cpu
        q_lens = qsl[1:meta.num_reqs + 1] - qsl[:meta.num_reqs]
        decode = (q_lens == 1).nonzero()[0]
        if len(decode):
            self._decode(q, kv_cache, meta, decode, out)
        for i in (q_lens > 1).nonzero()[0]:
            self._prefill(q, kv_cache, meta, int(i), out)
        return out

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """Contiguous [.., length, Hkv, D] keys and values of the blocks listed in `block_ids`."""
        bs = kv_cache.shape[2]
        n_blocks = -(-length // bs)
        ids = block_ids[..., :n_blocks]
        k = kv_cache[0][ids].flatten(-4, -3)[..., :length, :, :]
        v = kv_cache[1][ids].flatten(-4, -3)[..., :length, :, :]
        return k, v

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows,
                out: torch.Tensor) -> None:
        """All single-token queries at once. Plain matmuls, not SDPA: for one query row SDPA's CPU kernels are
        several times slower (in bf16 especially). GQA groups ride in the matmul's M dimension, so K/V are
        never repeated per query head."""
        rows_t = torch.as_tensor(rows, device=q.device)
        seq_lens = meta.seq_lens_cpu[rows]
        max_len = int(seq_lens.max())
        k, v = self._gather(kv_cache, meta.block_table[rows_t], max_len)  # [B, L, Hkv, D]
        tok = torch.as_tensor(meta.query_start_loc_cpu[rows], device=q.device)
        b, hkv, d = len(rows), k.shape[2], k.shape[3]
        qb = q[tok].view(b, hkv, self.gqa, d)
        scores = torch.matmul(qb, k.permute(0, 2, 3, 1)).float() * self.spec.scale  # [B, Hkv, G, L]
        key_pos = torch.arange(max_len, device=q.device)
        lens = torch.as_tensor(seq_lens, device=q.device).unsqueeze(1)
        mask = key_pos < lens
        if self.spec.sliding_window is not None:
            mask &= key_pos >= lens - self.spec.sliding_window
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype)
        out[tok] = torch.matmul(probs, v.transpose(1, 2)).reshape(b, hkv * self.gqa, d)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int,
                 out: torch.Tensor) -> None:
        start, end = int(meta.query_start_loc_cpu[i]), int(meta.query_start_loc_cpu[i + 1])
        seq_len = int(meta.seq_lens_cpu[i])
        q_len = end - start
        k, v = self._gather(kv_cache, meta.block_table[i], seq_len)  # [L, Hkv, D]
        mask = None
        window = self.spec.sliding_window
        if seq_len != q_len or (window is not None and window < seq_len):
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, is_causal=mask is None, scale=self.spec.scale,
                                           enable_gqa=self.gqa > 1)
        out[start:end] = o.transpose(0, 1)
