"""unified_attention (single pass and split-KV) against the plain-torch reference on random paged batches.

On a machine without a GPU the kernels run on CPU under TRITON_INTERPRET=1 (set here, before they are
imported); with a GPU the same tests run compiled on CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch

from streamer_kernels.testing import TOLERANCE, configure_for_tests, make_paged_batch, max_examples, rel_err

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import streamer_kernels.attention as attn_mod  # noqa: E402
from streamer_kernels import reference  # noqa: E402
from streamer_kernels.attention import choose_num_kv_splits, unified_attention  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=max_examples(50, 14), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _check(batch, num_heads: int, head_dim: int, dtype: torch.dtype, sliding_window=None, num_kv_splits=None,
           scale=None, hints=None, logit_softcap=None, sinks=None, attention_chunk=None,
           config=None, query_lens=True) -> torch.Tensor:
    scale = head_dim ** -0.5 if scale is None else scale
    max_query_len, max_seq_len = hints or (batch.max_query_len, batch.max_seq_len)
    out = torch.full_like(batch.q, float("nan"))  # poisoned: any row the kernel fails to write stays NaN
    unified_attention(batch.q, batch.key_cache, batch.value_cache, out, batch.query_start_loc, batch.seq_lens,
                      batch.block_table, scale, max_query_len, max_seq_len, sliding_window,
                      num_kv_splits=num_kv_splits, logit_softcap=logit_softcap, sinks=sinks,
                      attention_chunk=attention_chunk, config=config,
                      query_lens=batch.query_lens if query_lens else None)
    expected = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, scale, batch.max_query_len,
                                batch.max_seq_len, sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                                attention_chunk=attention_chunk)
    n = batch.num_tokens
    err = rel_err(out[:n], expected[:n])
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]:g}"
    return expected[:n]


@st.composite
def attention_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    head_dim = draw(st.sampled_from([64, 80, 96, 128, 256]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    block_size = draw(st.sampled_from([16, 32, 64]))
    num_reqs = draw(st.integers(1, 4))
    # Query lengths: decode (1), short, and chunks that straddle block boundaries; contexts from empty to a few
    # blocks, so queries start mid-block.
    q_lens = draw(st.lists(st.one_of(st.just(1), st.integers(1, 2 * block_size + 3)),
                           min_size=num_reqs, max_size=num_reqs))
    ctx_lens = draw(st.lists(st.integers(0, 3 * block_size + 5), min_size=num_reqs, max_size=num_reqs))
    window = draw(st.one_of(st.none(), st.integers(1, 70)))
    splits = draw(st.sampled_from([None, None, 2, 4]))
    pad = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, group, num_kv_heads, block_size, q_lens, ctx_lens, window, splits, pad, seed


@SETTINGS
@given(attention_cases(), st.booleans())
def test_unified_attention_random(case, query_lens) -> None:
    """With the host's query lengths (as the engine passes them) a batch mixing decodes and longer chunks runs as
    two launches; without them, as one."""
    dtype, head_dim, group, num_kv_heads, block_size, q_lens, ctx_lens, window, splits, pad, seed = case
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(q_lens, ctx_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype,
                             DEVICE, num_pad_tokens=pad, generator=g)
    _check(batch, group * num_kv_heads, head_dim, dtype, window, splits, query_lens=query_lens)


@settings(SETTINGS, max_examples=max_examples(30, 12))
@given(case=attention_cases(), block_size=st.sampled_from([16, 24, 48, 64, 128, 256]),
       tile_n=st.sampled_from([16, 32, 64, 128]), rows=st.sampled_from([1, 2, 4]), pipeline_qk=st.booleans(),
       softcap=st.sampled_from([None, None, 30.0]), long_ctx=st.integers(0, 260))
def test_launch_configs(case, block_size, tile_n, rows, pipeline_qk, softcap, long_ctx) -> None:
    """Every launch shape the tuning sweeps may pick computes the same thing: key tiles that hold whole cache
    blocks, sit inside one block, or straddle blocks of a size that is no power of two; q-blocks of several sizes;
    the unmasked tiles software-pipelined (one Q.K^T ahead) or not, which soft-capping turns off."""
    dtype, head_dim, group, num_kv_heads, _, q_lens, ctx_lens, window, splits, pad, seed = case
    ctx_lens = [long_ctx] + ctx_lens[1:]  # one request with many full tiles before its queries
    q_lens = [min(n, 48) for n in q_lens]  # (the interpreter's cost grows with the programs: keep them few)
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(q_lens, ctx_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype,
                             DEVICE, num_pad_tokens=pad, generator=g)
    heads = 1 << (group - 1).bit_length()
    block_m = heads * max(16 // heads, 4) * rows  # >= 16 rows, >= 4 query tokens
    if DEVICE.type == "cuda":  # (only shapes whose tiles fit a GPU's shared memory launch there)
        assume((2 * tile_n + block_m) * max(16, 1 << (head_dim - 1).bit_length()) * dtype.itemsize <= 160 * 1024)
    config = attn_mod.AttentionConfig(block_m, tile_n, 4, 1, pipeline_qk=pipeline_qk)
    _check(batch, group * num_kv_heads, head_dim, dtype, window, splits, logit_softcap=softcap, config=config)


@settings(SETTINGS, max_examples=max_examples(25, 6))
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([64, 128]),
       block_size=st.sampled_from([16, 32, 64]),
       seq_lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
       splits=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 2**31 - 1))
def test_decode_batch_split_kv(dtype, group, head_dim, block_size, seq_lens, splits, seed) -> None:
    """Decode-only batches (the flash-decoding path), including more splits than a context has tiles."""
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([1] * len(seq_lens), [s - 1 for s in seq_lens], 2 * group, 2, head_dim, block_size,
                             dtype, DEVICE, generator=g)
    _check(batch, 2 * group, head_dim, dtype, num_kv_splits=splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_chunk_after_context(dtype) -> None:
    """One long chunk on top of a cached prefix next to decodes: several q-blocks per request, unmasked
    middle tiles, reversed q-block order."""
    g = torch.Generator().manual_seed(0)
    batch = make_paged_batch([150, 1, 1, 37], [70, 200, 0, 15], 8, 2, 64, 16, dtype, DEVICE, num_pad_tokens=5,
                             generator=g)
    for query_lens in (True, False):  # the decodes in a launch of their own, and in the chunks' launch
        _check(batch, 8, 64, dtype, query_lens=query_lens)
        _check(batch, 8, 64, dtype, sliding_window=33, query_lens=query_lens)


def test_mixed_batch_runs_its_decodes_as_a_launch_of_their_own(monkeypatch) -> None:
    """Given the query lengths, a batch of decodes and prefill chunks is two launches: one program per request
    shaped for decode, then the chunks' shape (whose programs skip the decodes); a batch of one kind is one."""
    kernel = attn_mod._unified_attention_kernel
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK_M"], kwargs["SUBSET"]))
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(attn_mod, "_unified_attention_kernel", Recorder())
    # The split is taken only when the decodes' programs fill the SMs: one SM (what the CPU reports) until the end,
    # so that the launches below are the same on an H100's 132.
    monkeypatch.setattr(attn_mod, "device_sm_count", lambda device: 1)
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    batch = make_paged_batch([1, 40, 1, 3, 1], [60, 10, 0, 20, 33], 8, 2, 64, 16, dtype, DEVICE, generator=g)
    _check(batch, 8, 64, dtype)
    short, long = attn_mod._SHORT.value, attn_mod._LONG.value
    assert [(grid, subset) for grid, _, subset in launches] == [((5 * 2, 1), short), (((46 // 32 + 5) * 2, 1), long)]
    assert launches[0][1] == 16 and launches[1][1] == 128  # decode rows: 4 tokens x 4 heads; chunks: 128
    launches.clear()
    _check(batch, 8, 64, dtype, query_lens=False)
    assert [subset for _, _, subset in launches] == [attn_mod._ALL.value]
    launches.clear()
    decodes = make_paged_batch([1, 1, 2], [60, 10, 0], 8, 2, 64, 16, dtype, DEVICE, generator=g)
    _check(decodes, 8, 64, dtype)
    assert len(launches) == 1
    # On a GPU, only when the decodes' programs (requests x KV heads) fill its SMs: the launches run in turn.
    launches.clear()
    monkeypatch.setattr(attn_mod, "device_sm_count", lambda device: 4 * 2)
    _check(batch, 8, 64, dtype)
    assert [subset for _, _, subset in launches] == [short, long]  # 4 decode-sized requests x 2 heads
    launches.clear()
    monkeypatch.setattr(attn_mod, "device_sm_count", lambda device: 4 * 2 + 1)
    _check(batch, 8, 64, dtype)
    assert [subset for _, _, subset in launches] == [attn_mod._ALL.value]


def test_wrong_length_hints_do_not_change_results() -> None:
    """max_query_len / max_seq_len only choose the launch shape: a mixed batch launched with decode-sized
    hints (small q-blocks, auto split-KV considered) is still exact."""
    g = torch.Generator().manual_seed(4)
    batch = make_paged_batch([40, 1, 7], [10, 90, 0], 8, 2, 64, 16, torch.float32, DEVICE, generator=g)
    _check(batch, 8, 64, torch.float32, hints=(1, 1))
    _check(batch, 8, 64, torch.float32, hints=(1, 1), num_kv_splits=2)


def test_extreme_scores_stay_finite() -> None:
    """Large logits (scale 1, big values) must not overflow the online softmax."""
    g = torch.Generator().manual_seed(1)
    batch = make_paged_batch([20, 1], [40, 100], 4, 1, 64, 16, torch.float32, DEVICE, generator=g)
    batch.q.mul_(30)
    _check(batch, 4, 64, torch.float32, scale=1.0)
    _check(batch, 4, 64, torch.float32, scale=1.0, num_kv_splits=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [
    # (q_lens, ctx_lens, num_heads, num_kv_heads, sliding_window, num_kv_splits)
    ([20, 1, 1], [10, 40, 0], 4, 2, None, None),  # a prefill chunk on a context, decodes, a fresh token
    ([20, 1, 3], [10, 40, 0], 4, 1, 12, None),  # under a sliding window (Gemma 2's local layers), MQA
    ([1, 1], [60, 90], 4, 2, None, 4),  # decode batch on the split-KV path
], ids=["mixed", "window", "split-kv"])
def test_logit_softcap(case, dtype) -> None:
    """Gemma 2's soft-capped scores, tanh(s / cap) * cap, in the masked and unmasked tiles and across splits.
    Scores reach ~3x the cap, so an uncapped kernel is far off."""
    q_lens, ctx_lens, num_heads, num_kv_heads, window, splits = case
    g = torch.Generator().manual_seed(6)
    batch = make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, 64, 16, dtype, DEVICE, num_pad_tokens=2,
                             generator=g)
    batch.q.mul_(4)  # scores ~ N(0, 4^2) at scale 1/8
    capped = _check(batch, num_heads, 64, dtype, window, splits, logit_softcap=5.0)
    plain = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, plain, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, 64 ** -0.5, 0, 0, window)
    assert rel_err(plain[:batch.num_tokens], capped) > 0.1, "the cap should matter at these scores"
    # 0 means off, as None does.
    _check(batch, num_heads, 64, dtype, window, splits, logit_softcap=0.0)


@settings(SETTINGS, max_examples=max_examples(16, 10))
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([32, 64]),
       block_size=st.sampled_from([8, 16]), num_kv_heads=st.sampled_from([1, 2]),
       lens=st.lists(st.tuples(st.one_of(st.just(1), st.integers(1, 40)), st.integers(0, 60)), min_size=1,
                     max_size=3),
       window=st.one_of(st.none(), st.integers(1, 20)), splits=st.sampled_from([None, 1, 2, 4]),
       sink_scale=st.sampled_from([0.5, 4.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_attention_sinks(dtype, group, head_dim, block_size, num_kv_heads, lens, window, splits, sink_scale,
                         seed) -> None:
    """gpt-oss's sinks (a logit per head in the softmax's denominator) in mixed batches, under windows (rows whose
    window holds one key: the sink takes a real share) and across split-KV segments (only the first carries the
    sink). Sinks from small to far above every score (the output then shrinks towards zero)."""
    g = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    batch = make_paged_batch([q for q, _ in lens], [c for _, c in lens], num_heads, num_kv_heads, head_dim,
                             block_size, dtype, DEVICE, num_pad_tokens=1, generator=g)
    sinks = (torch.randn(num_heads, generator=g) * sink_scale).to(DEVICE)
    _check(batch, num_heads, head_dim, dtype, window, splits, sinks=sinks)
    # The sinks are not ignored: ones far above every score take nearly all the weight. (Random ones may matter
    # by less than any fixed margin: a negative draw against many keys.)
    dominant = _check(batch, num_heads, head_dim, dtype, window, splits, sinks=torch.full_like(sinks, 12.0))
    plain = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, plain, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, head_dim ** -0.5, 0, 0, window)
    assert rel_err(plain[:batch.num_tokens], dominant) > 0.5, "the sinks should matter"


def test_non_contiguous_query_and_output() -> None:
    """q as a slice of a fused qkv projection, out as a strided view: strides must be honoured."""
    g = torch.Generator().manual_seed(2)
    batch = make_paged_batch([5, 1, 19], [3, 50, 0], 4, 2, 64, 16, torch.float16, DEVICE, generator=g)
    qkv = torch.randn(batch.q.shape[0], 8 * 64, generator=g).to(torch.float16).to(DEVICE)
    q = qkv[:, :4 * 64].view(-1, 4, 64)
    q.copy_(batch.q)
    out_big = torch.full((q.shape[0], 4, 2 * 64), float("nan"), dtype=torch.float16, device=DEVICE)
    out = out_big[:, :, :64]
    unified_attention(q, batch.key_cache, batch.value_cache, out, batch.query_start_loc, batch.seq_lens,
                      batch.block_table, 0.125, batch.max_query_len, batch.max_seq_len)
    expected = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, 0.125, 0, 0)
    assert rel_err(out, expected) <= TOLERANCE[torch.float16]
    assert torch.isnan(out_big[:, :, 64:]).all(), "wrote outside the output view"


def test_zero_query_requests_and_empty_batch() -> None:
    """A request with no query tokens this step is skipped; an empty batch launches nothing."""
    g = torch.Generator().manual_seed(3)
    batch = make_paged_batch([3, 1], [5, 9], 2, 1, 64, 16, torch.float32, DEVICE, generator=g)
    # Insert a zero-length request between the two.
    qsl = torch.tensor([0, 3, 3, 4], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([8, 4, 10], dtype=torch.int32, device=DEVICE)
    table = torch.stack([batch.block_table[0], batch.block_table[1], batch.block_table[1]])
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.key_cache, batch.value_cache, out, qsl, seq_lens, table, 0.125, 3, 10)
    expected = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, qsl, seq_lens, table,
                                0.125, 3, 10)
    assert rel_err(out, expected) <= TOLERANCE[torch.float32]
    empty = batch.q[:0]
    unified_attention(empty, batch.key_cache, batch.value_cache, empty.clone(), qsl[:1], seq_lens[:0],
                      table[:0], 0.125, 0, 0)


def test_choose_num_kv_splits(monkeypatch) -> None:
    monkeypatch.setattr(attn_mod, "device_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    bf16 = torch.bfloat16
    # Few long decodes: split until there are at least 2 programs per SM (8 KV heads x 64 >= 264).
    assert choose_num_kv_splits(1, 8, 1, 32768, 128, bf16, cuda) == 64
    assert choose_num_kv_splits(4, 8, 1, 32768, 128, bf16, cuda) == 16
    # Many sequences already fill the GPU.
    assert choose_num_kv_splits(64, 8, 1, 4096, 128, bf16, cuda) == 1
    # Prefill or mixed batches never split.
    assert choose_num_kv_splits(1, 8, 7, 32768, 128, bf16, cuda) == 1
    # Short contexts keep >= 4 tiles per split.
    splits = choose_num_kv_splits(1, 8, 1, 512, 128, bf16, cuda)
    assert splits * 4 <= math.ceil(512 / attn_mod.attention_config(128, 1, 1, bf16).tile_n)
    # A sliding window bounds the useful context, and so does an attention chunk.
    assert choose_num_kv_splits(1, 8, 1, 32768, 128, bf16, cuda, sliding_window=256) <= 1
    assert choose_num_kv_splits(1, 8, 1, 32768, 128, bf16, cuda, attention_chunk=256) <= 1
    assert choose_num_kv_splits(1, 8, 1, 32768, 128, bf16, cuda, attention_chunk=8192) > 1
    monkeypatch.setattr(attn_mod, "device_sm_count", lambda device: 1)
    assert choose_num_kv_splits(1, 8, 1, 32768, 128, bf16, torch.device("cpu")) == 1


def test_engine_gpt_oss_triton_backend_matches_torch_backend(request) -> None:
    """gpt-oss's sinks through the whole engine on the Triton backend (sliding and full layers, chunked prefill over
    cached context, decodes) give the torch backend's tokens, which tests/test_engine_hf_parity.py holds to
    transformers'."""
    pytest.importorskip("transformers")  # (the checkpoint is built with it)
    from streamer import LLM, SamplingParams
    path = request.getfixturevalue("make_ckpt")("gpt_oss", family="gpt_oss")
    prompts = [list(range(5, 5 + n)) for n in (3, 12, 25)]

    def greedy(backend: str) -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", device=DEVICE.type, attention_backend=backend, enforce_eager=True,
                  max_num_batched_tokens=8, block_size=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]

    assert greedy("triton") == greedy("torch")


def _limits(batch, spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """int32 [T]: each query's own position, or for a query inside one of its request's [start, end) spans (absolute
    positions), end - 1: the span sees itself both ways (Gemma 3's images)."""
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    limit = []
    for b in range(len(lens)):
        q_len = qsl[b + 1] - qsl[b]
        for pos in range(lens[b] - q_len, lens[b]):
            limit.append(next((e - 1 for s, e in spans[b] if s <= pos < e), pos))
    return torch.tensor(limit + [0] * (batch.q.shape[0] - len(limit)), dtype=torch.int32, device=batch.q.device)


@settings(SETTINGS, max_examples=max_examples(25, 8))
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([16, 32]),
       window=st.one_of(st.none(), st.integers(4, 40)), splits=st.sampled_from([None, 2]),
       lens=st.lists(st.tuples(st.integers(2, 60), st.integers(0, 40)), min_size=1, max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_causal_limit_spans(dtype, group, block_size, window, splits, lens, seed) -> None:
    """Queries inside a span see the whole span (keys after them too), within the window; others stay causal."""
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = [q for q, _ in lens], [c for _, c in lens]
    batch = make_paged_batch(q_lens, ctx_lens, 2 * group, 2, 64, block_size, dtype, DEVICE, num_pad_tokens=2,
                             generator=g)
    # One span per request inside its chunk (a chunk never ends inside one): a random [start, end).
    spans = []
    for q, c in lens:
        s = c + int(torch.randint(0, q - 1, (1,), generator=g))
        spans.append([(s, s + 1 + int(torch.randint(1, c + q - s, (1,), generator=g)))])
    limit = _limits(batch, spans)
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.key_cache, batch.value_cache, out, batch.query_start_loc, batch.seq_lens,
                      batch.block_table, 0.125, batch.max_query_len, batch.max_seq_len, window,
                      num_kv_splits=splits, causal_limit=limit, query_lens=batch.query_lens)
    expected = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, 0.125, 0, 0, window, causal_limit=limit)
    n = batch.num_tokens
    assert rel_err(out[:n], expected[:n]) <= TOLERANCE[dtype]
    causal = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, causal, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, 0.125, 0, 0, window)
    moved = limit[:n] > _limits(batch, [[] for _ in lens])[:n]
    if moved.any():  # the limit changes exactly the queries it moves
        assert not torch.allclose(expected[:n][moved], causal[:n][moved])
    assert torch.equal(expected[:n][~moved], causal[:n][~moved])


# ------------------------------------------------------------------------------------------------ chunked attention
def _chunk_moved(batch, chunk: int, window) -> torch.Tensor:
    """bool [T]: the queries whose chunk hides a key they would otherwise see (their chunk starts past both 0 and
    their window's first key)."""
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    moved = []
    for b in range(len(lens)):
        for pos in range(lens[b] - (qsl[b + 1] - qsl[b]), lens[b]):
            moved.append(pos // chunk * chunk > (0 if window is None else max(0, pos - window + 1)))
    return torch.tensor(moved, dtype=torch.bool)


def _check_chunked(batch, num_heads: int, head_dim: int, dtype: torch.dtype, chunk: int, window=None,
                   splits=None) -> None:
    """Kernel == reference with `chunk`; the chunk changes exactly the queries it hides keys from (so a kernel that
    ignored it would fail)."""
    chunked = _check(batch, num_heads, head_dim, dtype, window, splits, attention_chunk=chunk)
    plain = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, plain, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, head_dim ** -0.5, 0, 0, window)
    plain = plain[:batch.num_tokens]
    moved = _chunk_moved(batch, chunk, window).to(plain.device)
    assert torch.equal(chunked[~moved], plain[~moved])
    if moved.any():
        assert not torch.allclose(chunked[moved], plain[moved], atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    # (q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, chunk, window, num_kv_splits)
    ([40, 1, 1, 13], [5, 70, 0, 30], 4, 2, 64, 16, 8, None, None),  # chunk < block: prompts cross many chunks
    ([150, 1], [70, 200], 8, 2, 64, 16, 64, None, None),  # chunk > block and tile: unmasked tiles inside a chunk
    ([25, 9], [0, 20], 4, 1, 32, 8, 13, None, None),  # a chunk not a multiple of the block (nor of a tile)
    ([1, 1, 1], [60, 90, 130], 4, 2, 64, 16, 48, None, 4),  # decodes on the split-KV path
    ([30, 1, 1], [20, 50, 9], 4, 2, 64, 16, 16, 10, None),  # a window inside the chunk, and past its start
], ids=["chunk<block", "chunk>tile", "odd-chunk", "split-kv", "with-window"])
def test_attention_chunk(case, dtype) -> None:
    """Llama 4's chunked local attention: the query at position p sees keys [(p // C) * C, p]. Prefill chunks that
    cross attention-chunk boundaries, on a cached context, beside decodes."""
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, chunk, window, splits = case
    g = torch.Generator().manual_seed(21)
    batch = make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE,
                             num_pad_tokens=2, generator=g)
    _check_chunked(batch, num_heads, head_dim, dtype, chunk, window, splits)


@settings(SETTINGS, max_examples=max_examples(16, 10))
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([32, 64]),
       block_size=st.sampled_from([8, 16]), num_kv_heads=st.sampled_from([1, 2]),
       lens=st.lists(st.tuples(st.one_of(st.just(1), st.integers(1, 50)), st.integers(0, 80)), min_size=1,
                     max_size=3),
       chunk=st.sampled_from([1, 3, 8, 16, 24, 40, 128]), window=st.one_of(st.none(), st.integers(1, 30)),
       splits=st.sampled_from([None, 1, 2, 4]), seed=st.integers(0, 2**31 - 1))
def test_attention_chunk_random(dtype, group, head_dim, block_size, num_kv_heads, lens, chunk, window, splits,
                                seed) -> None:
    """Chunks smaller and larger than blocks and tiles, with or without a window, single pass or split-KV."""
    g = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    batch = make_paged_batch([q for q, _ in lens], [c for _, c in lens], num_heads, num_kv_heads, head_dim,
                             block_size, dtype, DEVICE, num_pad_tokens=1, generator=g)
    _check_chunked(batch, num_heads, head_dim, dtype, chunk, window, splits)


# ------------------------------------------------------------------------------------------ relative position bias
@settings(SETTINGS, max_examples=max_examples(16, 8))
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([8, 16]),
       num_kv_heads=st.sampled_from([1, 2]), radius=st.integers(0, 40), whole=st.booleans(),
       lens=st.lists(st.tuples(st.one_of(st.just(1), st.integers(1, 50)), st.integers(0, 40)), min_size=1,
                     max_size=3),
       window=st.one_of(st.none(), st.integers(2, 30)), splits=st.sampled_from([None, 1, 2]),
       seed=st.integers(0, 2**31 - 1))
def test_position_bias(dtype, group, block_size, num_kv_heads, radius, whole, lens, window, splits, seed) -> None:
    """A per-head table indexed by the key's clamped distance from its query (MPNet's relative attention bias) is
    added to every score: masked tiles and unmasked ones, causal queries and ones that see their whole request
    (`whole`: an encoder's causal limit at the request's end)."""
    g = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    batch = make_paged_batch([q for q, _ in lens], [c for _, c in lens], num_heads, num_kv_heads, 32, block_size,
                             dtype, DEVICE, num_pad_tokens=1, generator=g)
    table = (torch.randn(num_heads, 2 * radius + 1, generator=g) * 2).to(DEVICE)
    limit = None
    if whole:
        ends = [s - 1 for s in batch.seq_lens.tolist()]
        q_lens = [q for q, _ in lens]
        limit = torch.tensor(sum(([e] * q for e, q in zip(ends, q_lens)), []) + [0], dtype=torch.int32,
                             device=DEVICE)
    args = (batch.q, batch.key_cache, batch.value_cache)
    rest = (batch.query_start_loc, batch.seq_lens, batch.block_table, 32 ** -0.5)
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(*args, out, *rest, batch.max_query_len, batch.max_seq_len, window, num_kv_splits=splits,
                      causal_limit=limit, position_bias=table, query_lens=batch.query_lens)
    expected = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(*args, expected, *rest, 0, 0, window, causal_limit=limit, position_bias=table)
    n = batch.num_tokens
    assert rel_err(out[:n], expected[:n]) <= TOLERANCE[dtype]
    unbiased = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(*args, unbiased, *rest, 0, 0, window, causal_limit=limit)
    # the bias matters wherever a query sees keys at different distances (a request's last query does, in any
    # request longer than one token; with radius 0 every key gets its head's one entry, which the softmax cancels)
    if radius > 0 and batch.seq_lens.max() > 1:
        assert not torch.allclose(expected[:n].float(), unbiased[:n].float(), atol=1e-3)


def test_position_bias_reference_reads_the_clamped_distance() -> None:
    """The reference's table lookup, by hand: distance d reads entry R + clamp(d, -R, R)."""
    table = torch.arange(2 * 11, dtype=torch.float32).view(2, 11)  # R = 5
    got = reference.relative_bias(table, torch.tensor([[3], [9]]), torch.arange(12)[None, :])
    for h in range(2):
        for qi, qp in enumerate((3, 9)):
            for kp in range(12):
                assert got[h, qi, kp] == table[h, 5 + max(-5, min(5, kp - qp))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_heads_of_gemma4_global_layers(dtype) -> None:
    """Heads of 512 (Gemma 4's global layers; the widest launch shape: 32-key tiles) with one kv head for 8 query
    heads, unscaled scores (its q/k norms stand in for the scale): a prefill chunk on a context beside decodes,
    single pass and split-KV."""
    g = torch.Generator().manual_seed(7)
    batch = make_paged_batch([19, 1, 1], [13, 70, 0], 8, 1, 512, 16, dtype, DEVICE, num_pad_tokens=3, generator=g)
    batch.q.mul_(512 ** -0.5)
    _check(batch, 8, 512, dtype, scale=1.0)
    _check(batch, 8, 512, dtype, scale=1.0, num_kv_splits=4)
