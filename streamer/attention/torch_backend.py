"""Paged attention in plain torch: the CPU path, and the reference the Triton backend is checked against.

Decode tokens (query length 1) of all requests go through one call that reads keys and values straight out of
the paged cache: written as gather + multiply + reduce in torch and compiled by Inductor into fused C++ loops,
it never materialises a gathered copy of any context (6x faster than gather-then-matmul at 64 x 320 tokens on
this project's 2-core CPU box). Without a working compiler (or with `enforce_eager`) the same maths runs eagerly.
Prefill chunks go one request at a time through SDPA; a chunk that is its request's whole context attends to
this step's k/v directly, the others to their gathered cached context with an offset causal mask.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from streamer.attention.base import AttentionMetadata, AttentionSpec

logger = logging.getLogger("streamer")


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    n = slot_mapping.shape[0]
    k, v = k[:n], v[:n]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    hkv, d = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v)


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
    """One query token per request over its paged context.

    q: [B, Hkv, G, D], already scaled; key/value_cache: [num_blocks, block_size, Hkv, D]; block_table: [B, M];
    seq_lens / first_pos: [B], the request attends positions first_pos <= p < seq_len. Returns [B, Hkv, G, D].
    Every step is elementwise or a reduction with indirect loads, so Inductor fuses the gather into the loops.
    """
    bs = key_cache.shape[1]
    pos = torch.arange(block_table.shape[1] * bs, device=q.device)
    slots = block_table[:, pos // bs].long() * bs + pos % bs  # [B, L]
    keys = key_cache.flatten(0, 1)[slots]  # [B, L, Hkv, D] (never materialised when compiled)
    scores = (q.unsqueeze(1).float() * keys.unsqueeze(3).float()).sum(-1)  # [B, L, Hkv, G]
    valid = (pos[None, :] < seq_lens[:, None]) & (pos[None, :] >= first_pos[:, None])
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    values = value_cache.flatten(0, 1)[slots]
    # Masked positions may hold anything (stale or never-written blocks): select, do not multiply by zero.
    weighted = torch.where(valid[:, :, None, None, None], probs.unsqueeze(-1) * values.unsqueeze(3).float(), 0.0)
    return weighted.sum(1).to(q.dtype)


_compiled_decode: Optional[Callable] = None
_compile_failed = False


def run_decode_kernel(compile: bool, *args: torch.Tensor) -> torch.Tensor:
    """`paged_decode`, compiled unless told otherwise: one graph per dtype and head layout (static, so Inductor
    unrolls the head loops: 25% faster than all-dynamic), dynamic in batch size, context blocks and pool size."""
    global _compiled_decode
    if not compile or _compile_failed:
        return paged_decode(*args)
    if _compiled_decode is None:
        _compiled_decode = torch.compile(paged_decode, dynamic=False, fullgraph=True)
    q, key_cache, value_cache, block_table, seq_lens, first_pos = args
    for t, dim in ((q, 0), (key_cache, 0), (value_cache, 0), (block_table, 0), (block_table, 1), (seq_lens, 0),
                   (first_pos, 0)):
        torch._dynamo.maybe_mark_dynamic(t, dim)
    # Guards must not depend on the caller: below ADInplaceOrView the dispatch keys are the same whether we are
    # called from eager code or from inside the compiled model's custom op. Without duck sizing, sizes that happen
    # to be equal at the first call (a batch of 2 and 2 blocks) are not assumed equal forever. The recompile limit
    # is raised for this function only: a process that builds engines of many head layouts (the tests) needs more
    # than the default 8 graphs.
    with (torch._C._AutoDispatchBelowADInplaceOrView(),
          torch.fx.experimental._config.patch(use_duck_shape=False),
          torch._dynamo.config.patch(recompile_limit=64)):
        return _compiled_decode(*args)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, spec: AttentionSpec, compile: bool = True) -> None:
        self.spec = spec
        self.gqa = spec.num_heads // spec.num_kv_heads
        self.compile = compile

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
            self._prefill(q, k, v, kv_cache, meta, int(i), out)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows,
                out: torch.Tensor) -> None:
        dev = q.device
        tok = torch.as_tensor(meta.query_start_loc_cpu[rows], device=dev)
        lens = torch.as_tensor(meta.seq_lens_cpu[rows], device=dev)
        table = meta.block_table[torch.as_tensor(rows, device=dev)]
        table = table[:, :-(-int(lens.max()) // kv_cache.shape[2])]
        b, hkv, d = len(rows), self.spec.num_kv_heads, self.spec.head_dim
        qb = (q[tok] * self.spec.scale).view(b, hkv, self.gqa, d)
        first = (lens - self.spec.sliding_window).clamp(min=0) if self.spec.sliding_window else torch.zeros_like(lens)
        # Dynamo specialises sizes 0 and 1; padding to >= 2 rows and blocks keeps one graph for every batch.
        if b == 1:
            qb, lens, first, table = (torch.cat([x, x]) for x in (qb, lens, first, table))
        if table.shape[1] == 1:
            table = torch.cat([table, table], dim=1)
        o = self._run_decode(qb, kv_cache[0], kv_cache[1], table.contiguous(), lens, first)
        out[tok] = o[:b].reshape(b, hkv * self.gqa, d)

    def _run_decode(self, *args: torch.Tensor) -> torch.Tensor:
        global _compile_failed
        try:
            return run_decode_kernel(self.compile, *args)
        except Exception as e:  # no C++ toolchain, or an Inductor bug: fall back once and for all
            if not self.compile or _compile_failed:
                raise
            _compile_failed = True
            logger.warning("compiled CPU decode attention unavailable (%s: %s); using the eager path",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return paged_decode(*args)

    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, i: int, out: torch.Tensor) -> None:
        start, end = int(meta.query_start_loc_cpu[i]), int(meta.query_start_loc_cpu[i + 1])
        seq_len = int(meta.seq_lens_cpu[i])
        q_len = end - start
        if seq_len == q_len:  # nothing cached before this chunk: its own k/v are the whole context
            k, v = k_new[start:end], v_new[start:end]
        else:
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

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """Contiguous [length, Hkv, D] keys and values of the blocks listed in `block_ids`."""
        bs = kv_cache.shape[2]
        ids = block_ids[:-(-length // bs)]
        k = kv_cache[0][ids].flatten(0, 1)[:length]
        v = kv_cache[1][ids].flatten(0, 1)[:length]
        return k, v
