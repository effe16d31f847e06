"""Hybrid attention + Mamba2 models (IBM Granite 4.0-H, GraniteMoeHybridForCausalLM; Bamba): greedy tokens identical to
transformers (fp32) whatever the batching (chunked prefill carrying the state across chunks, requests arriving while
others decode, preemption), the state slots all back in their pool at the end, and the SSD scan against a plain
recurrence."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer import LLM, SamplingParams
from streamer.core.kv_cache import KVCacheManager, StateSlotPool
from streamer.core.request import Request
from streamer.models.mamba import ssd_scan
from tests.checkpoints import hf_greedy
from tests.parity import assert_state_freed, greedy, greedy_params, prompts_of_lengths

MAX_NEW = 10


# A single token (the decode path from a fresh state), fewer than d_conv - 1, within one SSD chunk (8), several
LENGTHS = (1, 2, 6, 9, 17, 26, 33, 40)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def moe_ckpt(make_ckpt):
    return make_ckpt("granitemoehybrid", family="granitemoehybrid")


@pytest.fixture(scope="module")
def moe_ref(moe_ckpt, prompts):
    return hf_greedy(moe_ckpt, prompts, MAX_NEW)


@pytest.mark.parametrize("variant", ["moe_nope", "dense_rope_1group"])
def test_matches_transformers(make_ckpt, moe_ckpt, moe_ref, prompts, variant):
    if variant == "moe_nope":
        path, ref = moe_ckpt, moe_ref
    else:  # no experts (the shared MLP alone), rotary attention, one B/C group, attention first
        path = make_ckpt("granitemoehybrid_dense", family="granitemoehybrid", num_local_experts=0,
                         position_embedding_type="rope", mamba_n_groups=1,
                         layer_types=["attention", "mamba", "mamba", "attention"])
        ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.prefix_caching is True  # (resuming from checkpoints of the state: test_hybrid_prefix_caching)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert greedy(llm, prompts[:1], MAX_NEW) == ref[:1]  # alone, after the batch: its slot starts fresh
    assert len({tuple(r) for r in ref}) > 4, "degenerate reference: the test would not discriminate"
    assert sum(len(set(r)) for r in ref) > 2 * len(ref), "degenerate reference: continuations repeat one token"
    assert_state_freed(llm)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=5),  # prompts over many chunks (state carried), mixed with decodes
    dict(max_num_batched_tokens=7, num_kv_blocks=8, block_size=8),  # chunking + preemption
    dict(num_kv_blocks=14, block_size=4),  # a small KV pool: preemption by recompute
    dict(max_num_seqs=3),  # few seats: slots reused by later requests
    dict(kv_cache_memory=100_000),  # the state pool (half the budget) holds one slot: one sequence at a time
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_scheduling_variants_match(moe_ckpt, moe_ref, prompts, engine_args):
    llm = LLM(str(moe_ckpt), dtype="float32", **engine_args)
    assert greedy(llm, prompts, MAX_NEW) == moe_ref
    assert_state_freed(llm)
    if engine_args.get("num_kv_blocks", 1000) < 16:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    if "kv_cache_memory" in engine_args:
        assert llm.engine.kv.state.num_slots == 1


def test_bamba_matches_transformers(make_ckpt, prompts):
    """Bamba: the same stack without Granite's multipliers or experts, half-rotary attention, `final_layernorm`;
    chunked prefill."""
    path = make_ckpt("bamba", family="bamba")
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=7)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert len({tuple(r) for r in ref}) > 4, "degenerate reference: the test would not discriminate"
    assert_state_freed(llm)


def test_requests_arriving_while_others_decode(moe_ckpt, moe_ref, prompts):
    """Continuous batching: new prompts (chunked) join steps where earlier requests decode."""
    llm = LLM(str(moe_ckpt), dtype="float32", max_num_batched_tokens=12)
    engine = llm.engine
    out: dict[str, list[int]] = {}
    arrivals = {0: [7, 1], 3: [2, 5], 5: [4], 9: [0, 6], 14: [3]}
    mixed_steps = 0
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy_params(MAX_NEW))
        sched = engine.scheduler
        before = {r.request_id: r.num_computed_tokens for r in sched.running}
        for u in engine.step():
            out.setdefault(u.req.request_id, []).extend(u.new_token_ids)
        decoding = [r for r in sched.running if r.request_id in before and r.num_computed_tokens - before[
            r.request_id] == 1 and r.num_output_tokens > 1]
        mixed_steps += bool(decoding) and any(r.request_id not in before for r in sched.running)
        step += 1
    assert [out[str(i)] for i in range(len(prompts))] == moe_ref
    assert mixed_steps > 0, "no step mixed a new request's prefill with decodes"
    assert_state_freed(llm)


def test_abort_frees_the_state_slot(moe_ckpt, prompts):
    llm = LLM(str(moe_ckpt), dtype="float32")
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompts[1]}, greedy_params(MAX_NEW))
    engine.step()
    assert engine.kv.state.slot_of.keys() == {"a"}
    engine.abort("a")
    assert_state_freed(llm)


def _naive_scan(x, dt, A, B, C, state):
    ys = []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        ys.append((state @ C[t][..., None]).squeeze(-1))
    return torch.stack(ys), state


@pytest.mark.parametrize("length,chunk,groups", [(1, 4, 1), (7, 4, 2), (8, 4, 4), (13, 5, 1), (20, 256, 2),
                                                 (9, 3, 2)])
def test_ssd_scan_matches_recurrence(length, chunk, groups):
    """Any chunk size (longer than the sequence too), B and C shared by each group's heads."""
    g = torch.Generator().manual_seed(length * 31 + chunk)
    h, p, n = 4, 3, 5
    x = torch.randn(length, h, p, generator=g, dtype=torch.float64)
    B, C = (torch.randn(length, groups, n, generator=g, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(length, h, generator=g, dtype=torch.float64)
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 2
    state = torch.randn(h, p, n, generator=g, dtype=torch.float64)
    y, final = ssd_scan(x, dt, A, B, C, chunk, state)
    per_head = [t.repeat_interleave(h // groups, dim=1) for t in (B, C)]
    y_ref, final_ref = _naive_scan(x, dt, A, *per_head, state)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(final, final_ref)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "preempt"]), st.integers(0, 7), st.integers(1, 9)),
                max_size=60))
def test_state_slots_follow_blocks(ops):
    """The state slots are held exactly by the requests holding blocks, never shared, never lost; a request
    without a free slot gets no blocks either."""
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=False, state_slots=3)
    reqs = [Request(str(i), [1] * 5, SamplingParams(), max_tokens=4, block_size=4, hash_blocks=False)
            for i in range(8)]
    for op, i, n in ops:
        req = reqs[i]
        if op == "alloc":
            had = kv.state_slot(req.request_id)
            free_before = kv.state.num_free
            ok = kv.allocate_slots(req, n)
            if ok:
                req.num_computed_tokens += n
                assert kv.state_slot(req.request_id) >= 0
                if had >= 0:
                    assert kv.state_slot(req.request_id) == had  # a running request keeps its slot
            else:
                assert kv.state_slot(req.request_id) == had
                assert had >= 0 or free_before == 0 or kv.pool.num_free < -(-n // 4)
        else:
            kv.free(req)
            req.num_computed_tokens = 0
            assert kv.state_slot(req.request_id) == -1
        kv.check_consistency()
        assert kv.state.num_free + len(kv.state.slot_of) == 3


def test_state_slot_pool_refuses_when_dry():
    pool = StateSlotPool(2)
    assert {pool.allocate("a"), pool.allocate("b")} == {0, 1}
    assert pool.allocate("a") == pool.slot_of["a"]  # idempotent
    with pytest.raises(RuntimeError):
        pool.allocate("c")
    pool.free("a")
    pool.free("a")  # (twice: no effect)
    assert pool.allocate("c") in (0, 1)
    pool.check_consistency()


def test_decode_states_updated_in_place_over_their_span(moe_ckpt, moe_ref, prompts, monkeypatch):
    """Decode steps whose requests' slots fill most of their span update the states through a view of it, the
    span's other slots (here also prefilling requests' slots) untouched by zero inputs; the others gather and
    scatter. All three happen here (requests arriving while others decode), and the tokens equal transformers'."""
    from streamer.worker.model_runner import ModelRunner
    seen: list[str] = []
    build = ModelRunner._mamba_step

    def spy(self, step):
        m = build(self, step)
        if m.decode_slots is not None and len(m.decode_slots) > 1:
            span = m.decode_span
            seen.append("gather" if span is None else "span+prefill" if any(
                span[0] <= slot < span[1] for slot, _, _ in m.prefills) else "span")
        return m
    monkeypatch.setattr(ModelRunner, "_mamba_step", spy)
    llm = LLM(str(moe_ckpt), dtype="float32", max_num_batched_tokens=12)
    engine = llm.engine
    out: dict[str, list[int]] = {}
    arrivals = {0: [7, 1], 3: [2, 5], 5: [4], 9: [0, 6], 14: [3]}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy_params(MAX_NEW))
        for u in engine.step():
            out.setdefault(u.req.request_id, []).extend(u.new_token_ids)
        step += 1
    assert [out[str(i)] for i in range(len(prompts))] == moe_ref
    assert {"gather", "span", "span+prefill"} <= set(seen), seen
    assert_state_freed(llm)


@pytest.mark.parametrize("family", ["granitemoehybrid", "lfm2"])
def test_short_chunks_batched_long_ones_alone(make_ckpt, family, monkeypatch):
    """A step's prefill chunks of at most 64 tokens are convolved (and scanned) together, padded to the longest;
    longer ones one by one: steps with both, and the tokens equal transformers'."""
    import tests.test_recurrent_families  # noqa: F401  (registers lfm2)
    from streamer.worker.model_runner import ModelRunner
    path = make_ckpt("granitemoehybrid" if family == "granitemoehybrid" else "recurrent_lfm2", family=family)
    prompts = prompts_of_lengths((3, 70, 9, 130, 1, 64, 65), seed=6)
    ref = hf_greedy(path, prompts, MAX_NEW)
    mixed = []
    build = ModelRunner._mamba_step

    def spy(self, step):
        m = build(self, step)
        mixed.append(m.prefill_batch is not None and bool(m.long_prefills))
        if m.prefill_batch is not None:
            assert int(m.prefill_batch.lens.max()) <= 64 and all(b - a > 64 for _, a, b in m.long_prefills)
        return m
    monkeypatch.setattr(ModelRunner, "_mamba_step", spy)
    llm = LLM(str(path), dtype="float32")
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert any(mixed)
    assert_state_freed(llm)
