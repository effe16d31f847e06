"""Paged attention in plain torch: the CPU path, and the reference the Triton backend is checked against.

Decode tokens (query length 1) of all requests go through one call that reads keys and values straight out of
the paged cache: written as gather + multiply + reduce in torch and compiled by Inductor into fused C++ loops,
it never materialises a gathered copy of any context (6x faster than gather-then-matmul at 64 x 320 tokens on
this project's 2-core CPU box). Without a working compiler (or with `enforce_eager`) an eager loop runs instead:
per request, gather exactly its slots and call SDPA.
Prefill chunks go one request at a time through SDPA; a chunk that is its request's whole context attends to
this step's k/v directly, the others to their gathered cached context with an offset causal mask.
A sliding window and chunked local attention (`AttentionSpec.attention_chunk`, Llama 4) bound each query's first
key: the decode kernels take it as the request's first position (`first_keys`), prefill as part of its mask.
Attention logit soft-capping (`AttentionSpec.logit_softcap`, Gemma 2) and attention sinks (gpt-oss: a learned
logit per head that joins the softmax's denominator) are Python branches: the compiled decode kernel gets a tanh
before its softmax / the sink in its statistics, and where SDPA would run (which can do neither) `_attend_explicit`
does.
A relative position bias (MPNet's, BLOOM's ALiBi: `AttentionMetadata.position_bias`) reaches SDPA as a float mask
in prefill, and the decode kernels as one more gathered term.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from streamer.attention.base import FP8_KV_DTYPE, AttentionMetadata, AttentionSpec, DecodeBatch, KVScales
from streamer.core.kv_cache import cdiv
from streamer.worker.compile_cache import healing, may_compile
from streamer_kernels.reference import quantize_fp8, relative_bias

logger = logging.getLogger("streamer")

# A prefill's relative-position float mask ([heads, queries, keys]) is made whole, once a step for every layer, up to
# this many elements (64 MiB in fp32); a longer one is made a block of query rows at a time, in each layer.
BIAS_MASK_ELEMENTS = 1 << 24
# A windowed prefill longer than this many queries runs this many at a time, each over the keys its window reaches.
WINDOW_ROWS = 256


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """SDPA on [heads, tokens, dim] tensors, given a batch dimension on the way: PyTorch's CPU flash kernel takes
    only 4-D inputs, and 3-D ones fall to the math path, which materializes [heads, q, L] scores (GBs for a long
    prompt) and runs 3-4x slower."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], **kw)[0]


def _attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                     softcap: Optional[float], sinks: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA's maths with what SDPA has no option for: soft-capped scores, sinks [H] (one more logit per head in the
    softmax, with no value). q [H, Lq, D], already scaled; k, v [Hkv, L, D]; mask [Lq, L] (True = attend) or None
    for all; bias [H, Lq, L] added after the cap. Scores and softmax in fp32, as transformers' eager Gemma 2 path
    upcasts its softmax."""
    g = q.shape[0] // k.shape[0]
    if g > 1:
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    scores = torch.matmul(q.float(), k.float().transpose(1, 2))
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, first_pos: torch.Tensor, splits: int,
                 softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query token per request over its paged context, optionally split into `splits` parts.

    q: [B, Hkv, G, D], already scaled; key/value_cache: [num_blocks, block_size, Hkv, D]; block_table:
    [B * splits, M], row b * splits + s holding part s of request b's blocks (part s starts at position
    s * M * block_size); seq_lens / first_pos: [B], request b attends positions first_pos <= p < seq_len.
    Returns [B, Hkv, G, D]. Every step is elementwise or a reduction with indirect loads, so Inductor fuses the
    gathers into its loops; parts run in parallel and are merged through their softmax statistics. `softcap`
    (a constant per graph) soft-caps the scores; `sinks` [Hkv, G] joins each head's denominator at the end; `bias`
    [Hkv, G, 2R + 1] (AttentionMetadata.position_bias's layout) adds its entry at each key's clamped distance.
    """
    bs = key_cache.shape[1]
    r, m = block_table.shape
    b = q.shape[0]
    local = torch.arange(m * bs, device=q.device)
    slots = block_table[:, local // bs].long() * bs + local % bs  # [R, L]
    part_start = (torch.arange(r, device=q.device) % splits) * (m * bs)
    pos = part_start[:, None] + local[None, :]  # [R, L] position in the request
    req = torch.arange(r, device=q.device) // splits
    valid = (pos < seq_lens[req][:, None]) & (pos >= first_pos[req][:, None])
    keys = key_cache.flatten(0, 1)[slots]  # [R, L, Hkv, D]
    scores = (q[req].unsqueeze(1).float() * keys.unsqueeze(3).float()).sum(-1)  # [R, L, Hkv, G]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        radius = (bias.shape[-1] - 1) // 2
        dist = (pos - seq_lens[req][:, None] + 1).clamp(-radius, radius) + radius  # [R, L]
        scores = scores + bias.float()[:, :, dist].permute(2, 3, 0, 1)
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    peak = scores.amax(1)  # [R, Hkv, G]; -inf for a part with nothing to attend
    safe = torch.where(peak == float("-inf"), 0.0, peak)
    e = torch.exp(scores - safe[:, None]).view(r, m, bs, *scores.shape[2:])  # [R, M, bs, Hkv, G]; 0 where masked
    denom = e.sum(2).sum(1)  # [R, Hkv, G]
    values = value_cache[block_table.long()].unsqueeze(4).float()  # [R, M, bs, Hkv, 1, D]
    weighted = torch.where(valid.view(r, m, bs, 1, 1, 1), e.unsqueeze(-1) * values, 0.0)
    num = weighted.sum(2).sum(1)  # [R, Hkv, G, D]
    if splits == 1:
        if sinks is not None:
            num, denom = _add_sinks(num, denom, safe, sinks)
        return (num / denom.unsqueeze(-1)).to(q.dtype)
    peak = peak.view(b, splits, *peak.shape[1:])
    top = peak.amax(1, keepdim=True)
    scale = torch.exp(peak - top)  # [B, S, Hkv, G]; 0 for an empty part (every request has a non-empty one)
    num = (num.view(b, splits, *num.shape[1:]) * scale.unsqueeze(-1)).sum(1)
    denom = (denom.view(b, splits, *denom.shape[1:]) * scale).sum(1)
    if sinks is not None:
        num, denom = _add_sinks(num, denom, top.squeeze(1), sinks)
    return (num / denom.unsqueeze(-1)).to(q.dtype)


def _add_sinks(num: torch.Tensor, denom: torch.Tensor, top: torch.Tensor, sinks: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax statistics (num [B, Hkv, G, D], denom [B, Hkv, G], both relative to exp(top)) with each head's sink
    logit [Hkv, G] added to the denominator, re-based on max(top, sink) so that neither side overflows."""
    new_top = torch.maximum(top, sinks.float())
    keep = torch.exp(top - new_top)
    return num * keep.unsqueeze(-1), denom * keep + torch.exp(sinks.float() - new_top)


def paged_decode_eager(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, first_pos: torch.Tensor,
                       splits: int, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`paged_decode` for eager mode (no compiler, or enforce_eager), same arguments: request by request, gather
    exactly the slots it attends (stale slots are never read) and call SDPA. Unfused, `paged_decode`'s elementwise
    form materialises [B, L, Hkv, G, D] products, and padded gather + mask + SDPA makes four passes over every
    context: 135 / 60 ms vs 16 ms for this at 64 requests x 320 tokens, bf16, on the 2-core box.
    The split table is read back as one row per request (a request's parts are consecutive rows)."""
    b, hkv, g, d = q.shape
    bs = key_cache.shape[1]
    table = block_table.reshape(b, -1).long()
    keys, values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    out = torch.empty_like(q)
    for i, (first, end) in enumerate(zip(first_pos.tolist(), seq_lens.tolist())):
        pos = torch.arange(first, end, device=q.device)
        slots = table[i, pos // bs] * bs + pos % bs
        k = keys.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, L, D] (an FP8 cache's, widened)
        v = values.index_select(0, slots).transpose(0, 1).to(q.dtype)
        qi = q[i].reshape(hkv * g, 1, d)
        b = None if bias is None else relative_bias(bias.reshape(hkv * g, -1), pos.new_tensor([[end - 1]]),
                                                    pos[None, :])  # [H, 1, L]
        if softcap or sinks is not None:
            o = _attend_explicit(qi, k, v, None, softcap, None if sinks is None else sinks.reshape(-1), b)
        else:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=None if b is None else b.to(qi.dtype), scale=1.0,
                                               enable_gqa=g > 1)
        out[i] = o.view(hkv, g, d)
    return out


_compiled_decode: Optional[Callable] = None
_compile_failed = False


def run_decode_kernel(compile: bool, *args) -> torch.Tensor:
    """`paged_decode`, compiled unless told otherwise: one graph per dtype and head layout (static, so Inductor
    unrolls the head loops: 25% faster than all-dynamic), dynamic in batch size, context blocks and pool size.
    If compiling fails (no C++ toolchain, an Inductor bug), it says so once and runs eagerly from then on."""
    global _compiled_decode, _compile_failed
    if not compile or _compile_failed or not may_compile():
        return paged_decode_eager(*args)
    if _compiled_decode is None:
        _compiled_decode = torch.compile(paged_decode, dynamic=False, fullgraph=True)
    q, key_cache, value_cache, block_table, seq_lens, first_pos = args[:6]
    for t, dim in ((q, 0), (key_cache, 0), (value_cache, 0), (block_table, 0), (block_table, 1), (seq_lens, 0),
                   (first_pos, 0)):
        torch._dynamo.maybe_mark_dynamic(t, dim)
    # Guards must not depend on the caller: below ADInplaceOrView the dispatch keys are the same whether we are
    # called from eager code or from inside the compiled model's custom op. Without duck sizing, sizes that happen
    # to be equal at the first call (a batch of 2 and 2 blocks) are not assumed equal forever. The recompile limit
    # is raised for this function only: a process that builds engines of many head layouts (the tests) needs more
    # than the default 8 graphs. (Plain attribute swaps: config.patch() costs ~30 us a call.)
    dyn, fx = torch._dynamo.config, torch.fx.experimental._config
    saved = dyn.recompile_limit, fx.use_duck_shape
    dyn.recompile_limit, fx.use_duck_shape = 64, False
    try:
        return _run_compiled_decode(args)
    except Exception as e:
        _compile_failed = True
        logger.warning("compiled CPU decode attention unavailable (%s: %s); using the eager path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return paged_decode_eager(*args)
    finally:
        dyn.recompile_limit, fx.use_duck_shape = saved


def _run_compiled_decode(args: tuple) -> torch.Tensor:
    def run() -> torch.Tensor:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return _compiled_decode(*args)
    return healing(run, "compiled CPU decode attention")


def thread_splits() -> int:
    """Parts to split one request's context into so that every thread has one (a power of two, at most 8); merged
    through the parts' softmax statistics (a part past the context is empty and merges as nothing)."""
    threads = torch.get_num_threads()
    return min(8, 1 << (threads.bit_length() - 1))


def decode_splits(num_reqs: int) -> int:
    """A lone request would keep one thread busy: split its context across the threads. Batches parallelise over
    requests. (Short contexts split too: one split count per batch-size class keeps the graphs few.)"""
    return thread_splits() if num_reqs == 1 else 1


def decode_table(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, splits: int) -> np.ndarray:
    """The decode rows' block table as `paged_decode` reads it: `splits` rows per request (row b * splits + s =
    part s of request b's blocks), each at least 2 blocks wide (Dynamo specialises sizes 0 and 1; this keeps one
    graph for every batch). Padding entries are block 0; the kernel selects them away."""
    b = len(seq_lens)
    need = cdiv(int(seq_lens.max()), block_size)
    width = max(2, cdiv(need, splits))
    n = min(need, block_table.shape[1])
    table = np.zeros((b * splits, width), dtype=np.int32)
    table.reshape(b, splits * width)[:, :n] = block_table[:, :n]
    return table


def _store(cache_rows: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache_rows[slots] = rows, in place. FP8 through byte views: CPU torch has no index_copy_ for float8."""
    if cache_rows.dtype == FP8_KV_DTYPE:
        cache_rows, rows = cache_rows.view(torch.uint8), rows.view(torch.uint8)
    cache_rows.index_copy_(0, slots, rows)


@dataclass
class _StepPlan:
    """What every layer of one step shares: derived once per step, not once per layer."""

    write_slots: torch.Tensor  # slot_mapping without the -1 rows
    write_rows: Optional[torch.Tensor]  # rows of k/v to write; None = the first len(write_slots) rows
    decode_tok: Optional[torch.Tensor]  # token rows of the decode requests; None when there are none
    decode_direct: bool  # every token row is a decode row, in order: the kernel's output is the layer's output
    num_decode: int
    table: Optional[torch.Tensor]  # [>=2, >=2] block table of the decode rows, padded
    seq_lens: Optional[torch.Tensor]
    first_pos: Optional[torch.Tensor]
    prefill_rows: list[int]
    splits: int = 1  # parts each decode row's context is split into (see paged_decode)


def first_keys(seq_lens: torch.Tensor, window: Optional[int], chunk: Optional[int]) -> torch.Tensor:
    """The first key position the query at position seq_len - 1 (a decode token) sees: past the window's start, and
    with chunked attention not before its own chunk's."""
    first = (seq_lens - window).clamp(min=0) if window else torch.zeros_like(seq_lens)
    if chunk:
        first = torch.maximum(first, (seq_lens - 1).clamp(min=0) // chunk * chunk)
    return first


def _plan(meta: AttentionMetadata, block_size: int, window: Optional[int], chunk: Optional[int]) -> _StepPlan:
    key = ("torch", window, chunk)
    plan = meta.backend_cache.get(key)
    if plan is not None:
        return plan
    slots = meta.slot_mapping
    keep = (slots >= 0).nonzero().squeeze(1)
    write_rows = None if len(keep) == len(slots) else keep
    qsl = meta.query_start_loc_cpu
    q_lens = qsl[1:meta.num_reqs + 1] - qsl[:meta.num_reqs]
    rows = (q_lens == 1).nonzero()[0]
    prefill_rows = [int(i) for i in (q_lens > 1).nonzero()[0]]
    b = len(rows)
    plan = _StepPlan(write_slots=slots if write_rows is None else slots[keep], write_rows=write_rows,
                     decode_tok=None, decode_direct=False, num_decode=b, table=None, seq_lens=None, first_pos=None,
                     prefill_rows=prefill_rows)
    if b:
        dev = slots.device
        tok_np = qsl[rows]
        lens_np = meta.seq_lens_cpu[rows].astype(np.int64)
        splits = decode_splits(b)
        table_np = decode_table(meta.block_table[torch.as_tensor(rows, device=dev)].cpu().numpy(), lens_np,
                                block_size, splits)
        if len(table_np) < 2:  # a lone request on one thread: Dynamo specialises size 1, so pad a row (block 0,
            table_np = np.concatenate([table_np, np.zeros_like(table_np)])  # length 1; its output is dropped)
            lens_np = np.concatenate([lens_np, np.ones(1, dtype=np.int64)])
        table, lens = torch.from_numpy(table_np).to(dev), torch.from_numpy(lens_np).to(dev)
        first = first_keys(lens, window, chunk)
        plan.decode_tok = torch.as_tensor(tok_np, device=dev)
        plan.decode_direct = b == meta.num_reqs and meta.num_tokens == b and len(slots) == b
        plan.table, plan.seq_lens, plan.first_pos, plan.splits = table, lens, first, splits
    meta.backend_cache[key] = plan
    return plan


class TorchAttentionBackend(KVScales):
    name = "torch"

    def __init__(self, spec: AttentionSpec, compile: bool = True) -> None:
        self.spec = spec
        self.gqa = spec.num_heads // spec.num_kv_heads
        self.compile = compile

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        plan = _plan(meta, kv_cache.shape[2], self.spec.sliding_window, self.spec.attention_chunk)
        if not self.spec.kv_shared:
            self._write(k, v, kv_cache, plan)
        if plan.decode_direct and q.shape[0] == plan.num_decode:
            return self._decode(q, kv_cache, plan, sinks, meta.position_bias)
        out = torch.zeros_like(q)
        if plan.num_decode:
            out[plan.decode_tok] = self._decode(q[plan.decode_tok], kv_cache, plan, sinks, meta.position_bias)
        for i in plan.prefill_rows:
            self._prefill(q, k, v, kv_cache, meta, i, out, sinks)
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        n = len(plan.write_slots)
        k, v = (k[:n], v[:n]) if plan.write_rows is None else (k[plan.write_rows], v[plan.write_rows])
        _store(kv_cache[0].flatten(0, 1), plan.write_slots, self._cached(k, kv_cache, self.k_scale))
        _store(kv_cache[1].flatten(0, 1), plan.write_slots, self._cached(v, kv_cache, self.v_scale))

    @staticmethod
    def _cached(x: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """k or v as the cache stores it (FP8: divided by its scale and saturated)."""
        return quantize_fp8(x, scale) if kv_cache.dtype == FP8_KV_DTYPE else x

    def _scaled(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Queries times the softmax scale, and with an FP8 cache times k_scale: q.(k_scale k') = (k_scale q).k'."""
        scale = self.spec.scale * (self.k_scale if kv_cache.dtype == FP8_KV_DTYPE else 1.0)
        return q * scale

    def _unscaled(self, out: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """The attention output times v_scale (FP8 cache): softmax-weighted sums of v' = v / v_scale."""
        return out * self.v_scale if kv_cache.dtype == FP8_KV_DTYPE and self.v_scale != 1.0 else out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       d: DecodeBatch, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A decode-only step inside the compiled model: the KV write and `paged_decode` become part of the model's
        graph. The write goes through a flat view of the whole cache: Inductor then updates it in place (through
        a `kv_cache[0]` view it would copy the whole cache every step)."""
        spec = self.spec
        n = q.shape[0]
        if not spec.kv_shared:
            new = torch.cat([self._cached(k, kv_cache, self.k_scale), self._cached(v, kv_cache, self.v_scale)])
            _store(kv_cache.view(-1, spec.num_kv_heads, spec.head_dim), d.write_slots, new)
        first = first_keys(d.seq_lens, spec.sliding_window, spec.attention_chunk)
        qb = self._scaled(q, kv_cache).view(n, spec.num_kv_heads, self.gqa, spec.head_dim)
        bias = None if d.position_bias is None else d.position_bias.view(spec.num_kv_heads, self.gqa, -1)
        out = paged_decode(qb, kv_cache[0], kv_cache[1], d.block_table, d.seq_lens, first, d.splits,
                           spec.logit_softcap, self._head_sinks(sinks), bias)
        return self._unscaled(out, kv_cache).view(n, spec.num_heads, spec.head_dim)

    def _head_sinks(self, sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """[H] -> [Hkv, G], the decode kernels' head layout."""
        return None if sinks is None else sinks.view(self.spec.num_kv_heads, self.gqa)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan,
                sinks: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: the decode rows' queries [b, H, D] -> their attention output [b, H, D]."""
        b, spec = plan.num_decode, self.spec
        qb = self._scaled(q, kv_cache).view(b, spec.num_kv_heads, self.gqa, spec.head_dim)
        if plan.splits == 1 and b < 2:
            qb = torch.cat([qb, qb.new_zeros((2 - b, *qb.shape[1:]))])
        o = run_decode_kernel(self.compile, qb, kv_cache[0], kv_cache[1], plan.table, plan.seq_lens, plan.first_pos,
                              plan.splits, spec.logit_softcap, self._head_sinks(sinks),
                              None if bias is None else bias.view(spec.num_kv_heads, self.gqa, -1))
        return self._unscaled(o[:b], kv_cache).view(b, spec.num_heads, spec.head_dim)

    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, i: int, out: torch.Tensor, sinks: Optional[torch.Tensor]) -> None:
        start, end = int(meta.query_start_loc_cpu[i]), int(meta.query_start_loc_cpu[i + 1])
        seq_len = int(meta.seq_lens_cpu[i])
        q_len = end - start
        if seq_len == q_len and kv_cache.dtype != FP8_KV_DTYPE:
            # Nothing cached before this chunk: its own k/v are the whole context. (Not with an FP8 cache: every
            # read must see the stored values, or a prefix-cache hit would compute differently from a miss.)
            k, v = k_new[start:end], v_new[start:end]
        else:
            k, v = self._gather(kv_cache, meta.block_table[i], seq_len, q.dtype)  # [L, Hkv, D]
        mask = None
        window, chunk = self.spec.sliding_window, self.spec.attention_chunk
        limits = meta.window_limit_cpu if self.spec.two_sided_window else \
            None if self.spec.causal_only else meta.causal_limit_cpu
        limit = None if limits is None else limits[start:end]
        # every query sees every key (an encoder's whole prompt, no window): no mask at all
        see_all = limit is not None and int(limit.min()) >= seq_len - 1 and window is None and not chunk
        if see_all:
            limit = None
        masked = not see_all and (seq_len != q_len or (window is not None and window < seq_len) or limit is not None
                                  or (chunk and chunk < seq_len))
        if masked or meta.position_bias is not None:  # (positions only where a mask or a bias reads them)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        if masked:
            last = q_pos if limit is None else torch.from_numpy(limit).to(q.device, torch.int64).unsqueeze(1)
            mask = k_pos <= last
            if window is not None:
                mask &= k_pos > q_pos - window
            if chunk:
                mask &= k_pos >= q_pos // chunk * chunk
        qi, k, v = q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if self.spec.logit_softcap or sinks is not None:
            if mask is None:
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
                mask = mask if see_all else mask.tril()
            bias = None if meta.position_bias is None else relative_bias(meta.position_bias, q_pos, k_pos)
            o = _attend_explicit(qi * self.spec.scale, k, v, mask, self.spec.logit_softcap, sinks, bias)
        elif meta.position_bias is not None and qi.shape[0] * q_len * seq_len <= BIAS_MASK_ELEMENTS:
            o = _sdpa(qi, k, v, attn_mask=self._bias_mask(meta, i, q_pos, k_pos, mask, see_all, qi.dtype),
                      scale=self.spec.scale, enable_gqa=self.gqa > 1)
        elif meta.position_bias is not None:
            o = self._biased_by_rows(qi, k, v, meta.position_bias, q_pos, k_pos, mask, see_all or limit is not None)
        elif mask is not None and q_len > WINDOW_ROWS and ((window or seq_len) < seq_len // 2
                                                          or (chunk or seq_len) < seq_len // 2):
            o = self._windowed_by_rows(qi, k, v, mask, seq_len - q_len, limit)
        else:
            o = _sdpa(qi, k, v, attn_mask=mask, is_causal=mask is None and not see_all, scale=self.spec.scale,
                      enable_gqa=self.gqa > 1)
        out[start:end] = o.transpose(0, 1)

    def _windowed_by_rows(self, qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          first: int, limit: Optional[np.ndarray]) -> torch.Tensor:
        """Attention under a sliding window (or chunked attention) a block of WINDOW_ROWS queries at a time, over
        only the keys the block can see: a long prompt's cost grows with its length times the window, not its
        length squared (SDPA with a mask computes every pair, then hides most). The key range comes from the
        positions on the host (`first`: the first query's; `limit`: each query's last key, where not causal)."""
        q_len, seq_len = mask.shape
        window, chunk = self.spec.sliding_window, self.spec.attention_chunk
        out = qi.new_empty(qi.shape[0], q_len, v.shape[-1])
        for r in range(0, q_len, WINDOW_ROWS):
            e = min(r + WINDOW_ROWS, q_len)
            lo = max(0, first + r - window + 1) if window else 0
            if chunk:
                lo = max(lo, (first + r) // chunk * chunk)
            hi = min(seq_len, (int(limit[r:e].max()) if limit is not None else first + e - 1) + 1)
            out[:, r:e] = _sdpa(qi[:, r:e], k[:, lo:hi], v[:, lo:hi], attn_mask=mask[r:e, lo:hi],
                                scale=self.spec.scale, enable_gqa=self.gqa > 1)
        return out

    def _biased_by_rows(self, qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                        q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor],
                        all_keys: bool) -> torch.Tensor:
        """A long prompt's biased attention a block of query rows at a time, each block's float mask made for it
        and dropped ([H, rows, L] of at most BIAS_MASK_ELEMENTS, where the whole [H, q, L] one could take GBs: a
        BLOOM prompt of 8k tokens). Causal blocks read only the keys up to their last query (`all_keys`: an
        encoder's, or a limit's, may look further)."""
        heads, q_len, seq_len = qi.shape[0], qi.shape[1], k.shape[1]
        rows = max(1, BIAS_MASK_ELEMENTS // (heads * seq_len))
        out = qi.new_empty(qi.shape[0], q_len, v.shape[-1])
        for r in range(0, q_len, rows):
            e = min(r + rows, q_len)
            keys = seq_len if all_keys else seq_len - q_len + e
            qp, kp = q_pos[r:e], k_pos[:, :keys]
            block = kp <= qp if mask is None and not all_keys else None if mask is None else mask[r:e, :keys]
            bias = relative_bias(table, qp, kp)
            bias = (bias if block is None else bias.masked_fill(~block, float("-inf"))).to(qi.dtype)
            out[:, r:e] = _sdpa(qi[:, r:e], k[:, :keys], v[:, :keys], attn_mask=bias, scale=self.spec.scale,
                                enable_gqa=self.gqa > 1)
        return out

    def _bias_mask(self, meta: AttentionMetadata, i: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   mask: Optional[torch.Tensor], see_all: bool, dtype: torch.dtype) -> torch.Tensor:
        """Request i's relative position bias as SDPA's float mask (-inf where `mask` hides a key, or above the
        diagonal where no mask is given and the request does not see all of itself): made once a step, for all the
        layers of one spec (MPNet's encoder has one)."""
        key = ("bias", i, self.spec.sliding_window, self.spec.attention_chunk, self.spec.two_sided_window, dtype)
        found = meta.backend_cache.get(key)
        if found is None:
            assert meta.position_bias is not None
            bias = relative_bias(meta.position_bias, q_pos, k_pos)
            if mask is None and not see_all:
                mask = k_pos <= q_pos
            found = (bias if mask is None else bias.masked_fill(~mask, float("-inf"))).to(dtype)
            meta.backend_cache[key] = found
        return found

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Contiguous [length, Hkv, D] keys and values of the blocks listed in `block_ids`, in `dtype` (an FP8
        cache's widened and scaled back)."""
        bs = kv_cache.shape[2]
        ids = block_ids[:cdiv(length, bs)]
        k = kv_cache[0][ids].flatten(0, 1)[:length]
        v = kv_cache[1][ids].flatten(0, 1)[:length]
        if kv_cache.dtype == FP8_KV_DTYPE:
            return (k.float() * self.k_scale).to(dtype), (v.float() * self.v_scale).to(dtype)
        return k, v
