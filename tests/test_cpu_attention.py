"""The torch backend's CPU attention: the Inductor-compiled paged decode and the prefill paths against the kernel
reference on paged batches (GQA/MQA, sliding window, batches of one, contexts of one block, NaN in unused slots),
compiled == eager, soft-capped scores (Gemma 2) and attention sinks (gpt-oss) in every path, and the fallback to
eager when compilation is impossible."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from streamer.attention import torch_backend
from streamer.attention.base import AttentionMetadata, AttentionSpec, DecodeBatch
from streamer.attention.torch_backend import TorchAttentionBackend, decode_table
from streamer_kernels import reference
from streamer_kernels.testing import TOLERANCE, make_paged_batch, rel_err


def _meta(batch, num_reqs: int) -> AttentionMetadata:
    return AttentionMetadata(
        num_reqs=num_reqs, num_tokens=batch.num_tokens, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table, slot_mapping=batch.slot_mapping,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        query_start_loc_cpu=batch.query_start_loc.numpy().astype(np.int64),
        seq_lens_cpu=batch.seq_lens.numpy().astype(np.int64))


CASES = [
    # (q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window)
    ([1], [0], 4, 4, 32, 16, None),  # one request, one token, one block: the padded-to-2 path
    ([1], [100], 8, 2, 64, 16, None),  # a lone request over 7 blocks: its context split across threads
    ([1], [150], 4, 1, 32, 8, 30),  # split context under a sliding window: early parts are empty
    ([1, 1, 1, 1, 1], [30, 0, 77, 15, 16], 8, 2, 64, 16, None),  # decode batch, GQA 4, block-boundary lengths
    ([1, 1, 1], [40, 3, 100], 8, 1, 64, 8, 24),  # MQA, sliding window
    ([9, 1, 40, 1], [0, 12, 7, 100], 4, 4, 128, 32, None),  # mixed: fresh prefill, chunk continuation, decodes
    ([17, 1, 1], [20, 64, 2], 6, 3, 32, 4, 10),  # chunk + decodes under a window, tiny blocks
]


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=["single", "single-split", "split-window", "gqa", "mqa-window", "mixed",
                                             "window-chunk"])
def test_matches_reference(case, dtype, compile) -> None:
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, window = case
    seed = 3

    def batch(write_new: bool):
        return make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu",
                                write_new=write_new, generator=torch.Generator().manual_seed(seed))

    before, after = batch(False), batch(True)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window)
    kv = before.kv_cache.clone()  # NaN wherever nothing was written: it must never reach the output
    out = TorchAttentionBackend(spec, compile=compile).forward(before.q, before.new_k, before.new_v, kv,
                                                               _meta(before, len(q_lens)))
    written = ~after.kv_cache.isnan()
    assert torch.equal(kv[written], after.kv_cache[written])
    expected = torch.empty_like(after.q)
    reference.unified_attention(after.q, after.key_cache, after.value_cache, expected, after.query_start_loc,
                                after.seq_lens, after.block_table, spec.scale, 0, 0, window)
    assert not out.isnan().any()
    assert rel_err(out, expected) <= TOLERANCE[dtype]


def _softcap_reference(b, spec: AttentionSpec, cap, sinks=None) -> torch.Tensor:
    out = torch.empty_like(b.q)
    reference.unified_attention(b.q, b.key_cache, b.value_cache, out, b.query_start_loc, b.seq_lens, b.block_table,
                                spec.scale, 0, 0, spec.sliding_window, logit_softcap=cap, sinks=sinks)
    return out[:b.num_tokens]


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5], CASES[6]],
                         ids=["single-split", "mqa-window", "mixed", "window-chunk"])
def test_logit_softcap_matches_reference(case, compile) -> None:
    """Soft-capped scores (tanh(s / cap) * cap) in the compiled and eager decode kernels and both prefill paths
    (a fresh prompt, a chunk over its cached context). Scores reach ~3x the cap: uncapped attention is far off."""
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, window = case

    def batch(write_new: bool):
        b = make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
                             write_new=write_new, generator=torch.Generator().manual_seed(8))
        b.q.mul_(4)  # scores ~ N(0, 4^2)
        return b

    before, after = batch(False), batch(True)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window, logit_softcap=5.0)
    out = TorchAttentionBackend(spec, compile=compile).forward(before.q, before.new_k, before.new_v,
                                                               before.kv_cache.clone(), _meta(before, len(q_lens)))
    expected = _softcap_reference(after, spec, 5.0)
    assert rel_err(out, expected) <= TOLERANCE[torch.float32]
    assert rel_err(out, _softcap_reference(after, spec, None)) > 0.1, "the cap should matter at these scores"


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[3], CASES[5], CASES[6]],
                         ids=["single", "single-split", "split-window", "gqa", "mixed", "window-chunk"])
def test_sinks_match_reference(case, compile) -> None:
    """gpt-oss's sinks (a logit per head in the softmax's denominator) in the compiled and eager decode kernels
    (one part or a context split across threads, where early parts are empty under a window) and both prefill
    paths. Sinks ~ N(0, 2^2), some above every score: without them the output is far off."""
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, window = case

    def batch(write_new: bool):
        return make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
                                write_new=write_new, generator=torch.Generator().manual_seed(10))

    before, after = batch(False), batch(True)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window)
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(11)) * 2
    out = TorchAttentionBackend(spec, compile=compile).forward(before.q, before.new_k, before.new_v,
                                                               before.kv_cache.clone(), _meta(before, len(q_lens)),
                                                               sinks)
    assert rel_err(out, _softcap_reference(after, spec, None, sinks)) <= TOLERANCE[torch.float32]
    assert rel_err(out, _softcap_reference(after, spec, None)) > 0.05, "the sinks should matter"


@pytest.mark.parametrize("softcap,with_sinks", [(5.0, False), (None, True), (5.0, True)],
                         ids=["softcap", "sinks", "both"])
def test_forward_decode(softcap, with_sinks) -> None:
    """The decode that a compiled model runs inline (`forward_decode`: KV write + `paged_decode` on graph inputs),
    here called eagerly, with a soft cap and/or sinks and each context split in two."""
    args = ([1, 1, 1], [30, 5, 77], 8, 2, 64, 16, torch.float32, "cpu")
    before = make_paged_batch(*args, write_new=False, generator=torch.Generator().manual_seed(9))
    after = make_paged_batch(*args, write_new=True, generator=torch.Generator().manual_seed(9))
    for b in (before, after):
        b.q.mul_(4)
    spec = AttentionSpec(8, 2, 64, 0.125, logit_softcap=softcap)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(12)) * 2 + 8 if with_sinks else None  # ~ top scores
    kv = before.kv_cache.clone()
    splits = 2
    table = decode_table(before.block_table.numpy(), before.seq_lens.numpy(), 16, splits)
    half = kv.shape[1] * kv.shape[2]  # value slots follow the key slots in the flat cache
    d = DecodeBatch(torch.cat([before.slot_mapping, before.slot_mapping + half]), torch.from_numpy(table),
                    before.seq_lens.long(), splits)
    out = TorchAttentionBackend(spec).forward_decode(before.q, before.new_k, before.new_v, kv, d, sinks)
    written = ~after.kv_cache.isnan()
    assert torch.equal(kv[written], after.kv_cache[written])
    assert rel_err(out, _softcap_reference(after, spec, softcap, sinks)) <= TOLERANCE[torch.float32]
    assert rel_err(out, _softcap_reference(after, spec, None)) > 0.1


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_split_context_matches_unsplit(threads, compile) -> None:
    """Whatever the thread count (and so the number of parts), a lone request gets the same attention."""
    b = make_paged_batch([1], [200], 8, 2, 64, 16, torch.float32, "cpu", generator=torch.Generator().manual_seed(5))
    spec = AttentionSpec(8, 2, 64, 0.125)
    kv = b.kv_cache.nan_to_num(0)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = TorchAttentionBackend(spec, compile=compile).forward(b.q, b.new_k, b.new_v, kv.clone(), _meta(b, 1))
    finally:
        torch.set_num_threads(old)
    expected = torch.empty_like(b.q)
    reference.unified_attention(b.q, b.key_cache, b.value_cache, expected, b.query_start_loc, b.seq_lens,
                                b.block_table, spec.scale, 0, 0, None)
    assert rel_err(out, expected) <= 1e-5


def test_compiled_decode_equals_eager_on_varied_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    spec = AttentionSpec(8, 2, 64, 0.125)
    for n in (2, 7, 33):
        ctx = torch.randint(0, 200, (n,), generator=gen).tolist()
        b = make_paged_batch([1] * n, ctx, 8, 2, 64, 16, torch.float32, "cpu", generator=gen)
        outs = [TorchAttentionBackend(spec, compile=c).forward(b.q, b.new_k, b.new_v, b.kv_cache.nan_to_num(0),
                                                               _meta(b, n)) for c in (True, False)]
        assert rel_err(outs[0], outs[1]) <= 1e-5


def test_falls_back_to_eager_when_compilation_fails(monkeypatch, caplog) -> None:
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch_backend, "_compiled_decode", broken)
    monkeypatch.setattr(torch_backend, "_compile_failed", False)
    b = make_paged_batch([1, 1], [5, 9], 4, 4, 32, 16, torch.float32, "cpu",
                         generator=torch.Generator().manual_seed(1))
    spec = AttentionSpec(4, 4, 32, 32 ** -0.5)
    out = TorchAttentionBackend(spec).forward(b.q, b.new_k, b.new_v, b.kv_cache.nan_to_num(0), _meta(b, 2))
    assert torch_backend._compile_failed and "eager path" in caplog.text
    ref = TorchAttentionBackend(spec, compile=False).forward(b.q, b.new_k, b.new_v, b.kv_cache.nan_to_num(0),
                                                             _meta(b, 2))
    assert torch.equal(out, ref)


def _chunk_reference(b, spec: AttentionSpec, chunk) -> torch.Tensor:
    out = torch.empty_like(b.q)
    reference.unified_attention(b.q, b.key_cache, b.value_cache, out, b.query_start_loc, b.seq_lens, b.block_table,
                                spec.scale, 0, 0, spec.sliding_window, attention_chunk=chunk)
    return out[:b.num_tokens]


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("case", [
    # (q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, attention_chunk)
    ([30, 1, 13, 1], [0, 40, 21, 8], 4, 2, 32, 8, None, 8),  # fresh and continued prefills across chunks, decodes
    ([1], [150], 8, 2, 64, 16, None, 40),  # a lone decode split across threads: the early parts are empty
    ([1, 1, 1], [15, 16, 77], 4, 1, 32, 16, None, 16),  # decodes at a chunk's first and last positions, MQA
    ([20, 1], [10, 50], 4, 2, 32, 8, 6, 16),  # a window inside the chunk
], ids=["prefill", "single-split", "decode-edges", "window"])
def test_attention_chunk_matches_reference(case, compile) -> None:
    """Llama 4's chunked local attention (the query at position p sees keys [(p // C) * C, p]) in the compiled and
    eager decode kernels and both prefill paths; without the chunk the output is far off."""
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, window, chunk = case

    def batch(write_new: bool):
        return make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
                                write_new=write_new, generator=torch.Generator().manual_seed(13))

    before, after = batch(False), batch(True)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window, attention_chunk=chunk)
    out = TorchAttentionBackend(spec, compile=compile).forward(before.q, before.new_k, before.new_v,
                                                               before.kv_cache.clone(), _meta(before, len(q_lens)))
    assert not out.isnan().any()
    assert rel_err(out, _chunk_reference(after, spec, chunk)) <= TOLERANCE[torch.float32]
    assert rel_err(out, _chunk_reference(after, spec, None)) > 0.05, "the chunk should matter"


def test_forward_decode_attention_chunk() -> None:
    """The inline decode of a compiled model (`forward_decode`) with chunked attention, each context split in two."""
    args = ([1, 1, 1], [30, 8, 77], 8, 2, 64, 16, torch.float32, "cpu")
    before = make_paged_batch(*args, write_new=False, generator=torch.Generator().manual_seed(14))
    after = make_paged_batch(*args, write_new=True, generator=torch.Generator().manual_seed(14))
    spec = AttentionSpec(8, 2, 64, 0.125, attention_chunk=24)
    kv = before.kv_cache.clone()
    splits = 2
    table = decode_table(before.block_table.numpy(), before.seq_lens.numpy(), 16, splits)
    half = kv.shape[1] * kv.shape[2]
    d = DecodeBatch(torch.cat([before.slot_mapping, before.slot_mapping + half]), torch.from_numpy(table),
                    before.seq_lens.long(), splits)
    out = TorchAttentionBackend(spec).forward_decode(before.q, before.new_k, before.new_v, kv, d)
    assert rel_err(out, _chunk_reference(after, spec, 24)) <= TOLERANCE[torch.float32]
    assert rel_err(out, _chunk_reference(after, spec, None)) > 0.05
