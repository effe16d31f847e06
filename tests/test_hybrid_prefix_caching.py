"""Prefix caching for hybrid and recurrent models (kv_cache.py StateCheckpoints): a request resumes from cached KV
blocks only where the recurrent state after them was checkpointed, and the state is restored there.

Engine tests: for every hybrid / recurrent family, greedy tokens equal transformers' (fp32) when prompts repeat
(a repeat ends a chunk where the cached blocks end, so the next one resumes at the last full block), when a
conversation continues (resumed from the last checkpoint taken
while decoding) and when prompts share a prefix (the second request ends a chunk where the shared blocks end, the
third resumes there); and the hits really happened. Property test: with a simulated model whose "state" is the
token sequence it has consumed, every request's state, whatever the interleaving of arrivals, chunks, preemptions
and aborts, holds exactly the tokens before its chunk when the chunk starts."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.test_mamba1  # noqa: F401  (registers the test checkpoint families)
import tests.test_recurrent_families  # noqa: F401
from streamer import LLM
from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager
from streamer.core.request import Request
from streamer.core.scheduler import Scheduler, SchedulerOutput
from streamer.sampling_params import SamplingParams
from tests.checkpoints import hf_greedy
from tests.parity import assert_state_freed, greedy_params, prompts_of_lengths
from tests.test_nemotron_h import make_nemotron_h
from tests.test_scheduler_properties import Sim, ops

MAX_NEW = 8
BS = 4
FAMILIES = ("granitemoehybrid", "bamba", "qwen3_next", "nemotron_h", "mamba2", "falcon_h1", "lfm2", "lfm2_moe",
            "mamba1", "falcon_mamba")


@pytest.fixture(scope="module")
def ckpt(make_ckpt, ckpt_root):
    def get(family: str) -> Path:
        if family == "nemotron_h":
            path = ckpt_root / "nemotron_h"
            return path if (path / "config.json").exists() else make_nemotron_h(path)
        return make_ckpt(f"prefix_{family}", family=family)
    return get


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and each request's prefix-cache hit (tokens)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(MAX_NEW))
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_resumes_from_checkpoints_and_matches_transformers(ckpt, family):
    path = ckpt(family)
    prompts = prompts_of_lengths((5, 13, 22, 31), seed=11)
    ref = hf_greedy(path, prompts, MAX_NEW)
    assert len({tuple(r) for r in ref}) == len(ref), "degenerate reference: the test would not discriminate"
    llm = LLM(str(path), dtype="float32", block_size=BS, max_num_batched_tokens=16)
    kv = llm.engine.kv
    assert llm.engine.prefix_caching and kv.checkpoints is not None

    first, hits = run(llm, prompts)
    assert first == ref and hits == [0] * len(prompts)
    # The same prompts again (resuming where chunks ended on block boundaries, then ending a chunk where the cached
    # blocks end), and a third time: each resumes at its last full block (its last token is always computed).
    assert run(llm, prompts)[0] == ref
    again, hits = run(llm, prompts)
    assert again == ref
    assert hits == [(len(p) - 1) // BS * BS for p in prompts]
    assert kv.checkpoints.num_restores >= sum(h > 0 for h in hits)

    # A conversation goes on: the prompt, the answer, a new turn. The hit reaches into the answer, where the
    # state was checkpointed while decoding.
    turns = [p + r + [7, 8, 9] for p, r in zip(prompts, ref)]
    want = hf_greedy(path, turns, MAX_NEW)
    got, hits = run(llm, turns)
    assert got == want
    assert all(h > len(p) for h, p in zip(hits, prompts)), hits

    # Prompts sharing 22 tokens: the first checkpointed at its first chunk's end (16), where the second resumes;
    # the second ends a chunk where the shared blocks end (20), where the third resumes.
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(22)]
    variants = [shared + [rng.randrange(3, 500) for _ in range(6)] for _ in range(3)]
    want = hf_greedy(path, variants, MAX_NEW)
    got, hits = [], []
    for v in variants:  # one at a time: each sees its predecessors' cache
        g, h = run(llm, [v])
        got += g
        hits += h
    assert got == want
    assert hits == [0, 16, 20]
    assert_state_freed(llm)
    kv.check_consistency()


def test_checkpoint_slots_and_switch_off(ckpt):
    """`state_checkpoints` sizes the checkpoint pool. With two slots the checkpoint a repeated prompt takes where
    the cached blocks end survives its own request's decode-time saves (each supersedes the one before, which goes
    first), so the next repeat resumes there; 0, or no prefix caching, switches the cache off; a negative count is
    refused."""
    path = ckpt("granitemoehybrid")
    prompts = prompts_of_lengths((9, 14, 19, 23, 27), seed=2)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", block_size=BS, state_checkpoints=2)
    assert llm.engine.kv.checkpoints.num_slots == 2
    for p, want in zip(prompts, ref):
        assert run(llm, [p]) == ([want], [0])
        assert run(llm, [p])[0] == [want]
        assert run(llm, [p]) == ([want], [(len(p) - 1) // BS * BS])
    assert_state_freed(llm)
    for args in (dict(state_checkpoints=0), dict(enable_prefix_caching=False)):
        llm = LLM(str(path), dtype="float32", block_size=BS, **args)
        assert not llm.engine.prefix_caching and llm.engine.kv.checkpoints is None
        run(llm, prompts)
        out, hits = run(llm, prompts)
        assert out == ref and hits == [0] * len(prompts)
    with pytest.raises(ValueError, match="state_checkpoints"):
        LLM(str(path), dtype="float32", state_checkpoints=-1)


# ------------------------------------------------------------------------ the bookkeeping, with a simulated model
class StateSim(Sim):
    """Sim (test_scheduler_properties) for a hybrid model: each request holds a state slot whose "state" is the
    tuple of (token, adapter) it has consumed. After each schedule the checkpoint copies run, saves first, then
    restores, then first chunks start empty (as models/mamba.py RecurrentMixer.begin_step does), and every
    scheduled chunk must find its request's state holding exactly the tokens before it."""

    def __init__(self, *args, checkpoints: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.kv = KVCacheManager(self.kv.num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching,
                                 state_slots=self.cfg.max_num_seqs, checkpoint_slots=checkpoints, kv_events=True)
        self.sched = Scheduler(self.cfg, self.kv, max_model_len=10_000)
        schedule = self.sched.schedule
        self.sched.schedule = lambda: self.run_states(schedule())  # type: ignore[method-assign]
        self.state: dict[int, tuple] = {}

    def run_states(self, out: SchedulerOutput) -> SchedulerOutput:
        for pairs in self.kv.take_state_copies():  # (each batch reads before it writes, as an index copy does)
            before = dict(self.state)
            for src, dst in pairs:
                self.state[dst] = before.get(src, ())
        bs = self.cfg.block_size
        for s in out.scheduled:
            req, slot = s.req, self.kv.state_slot(s.req.request_id)
            if s.start == 0:
                self.state[slot] = ()
            seen = [(t, id(req.lora)) for t in req.all_token_ids + req.draft_token_ids[:s.num_drafts]]
            assert self.state[slot] == tuple(seen[:s.start]), f"{req.request_id} resumes from a wrong state"
            self.state[slot] += tuple(seen[s.start:s.start + s.num_tokens])
            end = s.start + s.num_tokens
            if end < req.num_tokens:  # a chunk cut short ends on a block boundary, unless it is within one block
                assert end % bs == 0 or end // bs == s.start // bs, (s.start, end, bs)
        return out


@settings(max_examples=120, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(6, 40),
       budget=st.integers(1, 48), max_seqs=st.integers(1, 6), checkpoints=st.integers(1, 8),
       policy=st.sampled_from(["fcfs", "priority"]), max_loras=st.sampled_from([0, 0, 2]))
def test_states_resume_exactly(ops, block_size, num_blocks, budget, max_seqs, checkpoints, policy, max_loras):
    sim = StateSim(block_size, num_blocks, budget, max_seqs, True, policy, max_loras, checkpoints=checkpoints)
    sim.run(ops)
    assert sim.kv.state.num_free == sim.kv.state.num_slots


def test_hits_in_the_simulation():
    """The property test's hits are not vacuous. A prompt repeated: the first run checkpoints where its first chunk
    ends (16), where the second resumes, ending a chunk where the cached blocks end (20), where the third resumes.
    Prompts sharing 15 tokens: the second ends a chunk at the shared blocks' end (12), the third resumes there."""
    sim = StateSim(4, 64, 16, 4, True, "fcfs", checkpoints=4)
    for _ in range(3):
        req = Request(f"same{sim.n}", list(range(100, 123)), SamplingParams(max_tokens=5), 5, block_size=4)
        sim.n += 1
        sim.sched.add(req)
        sim.live.append(req)
        sim.drain()
    for _ in range(3):
        sim.add(23, 5, 2, 0)
        sim.drain()
    assert [r.num_cached_tokens for r in sim.finished] == [0, 16, 20, 0, 0, 12]
    assert sim.kv.checkpoints.num_restores == 3


def test_engine_config_refuses_bad_checkpoint_count():
    with pytest.raises(ValueError, match="state_checkpoints"):
        EngineConfig(state_checkpoints="4")


@pytest.mark.parametrize("engine_args", [
    dict(async_scheduling=True, max_num_batched_tokens=16),  # the next step scheduled while one runs
    dict(num_kv_blocks=24, max_num_batched_tokens=12),  # preemption: a preempted request checkpoints as it leaves
], ids=["async", "preemption"])
def test_async_scheduling_and_preemption(ckpt, engine_args):
    path = ckpt("granitemoehybrid")
    prompts = prompts_of_lengths((6, 17, 25, 30, 11, 21), seed=4)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", block_size=BS, **engine_args)
    for _ in range(3):
        assert run(llm, prompts)[0] == ref
    turns = [p + r + [5, 6] for p, r in zip(prompts, ref)]
    assert run(llm, turns)[0] == hf_greedy(path, turns, MAX_NEW)
    assert llm.engine.kv.checkpoints.num_restores >= len(prompts)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    else:
        assert llm.engine.num_overlapped_steps > 0
    assert_state_freed(llm)


def test_tensor_parallel_restores_on_every_rank(ckpt):
    """Each rank holds its heads' state and runs the copies itself (from the step's inputs)."""
    path = ckpt("granitemoehybrid")
    prompts = prompts_of_lengths((13, 22), seed=8)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", block_size=BS, tensor_parallel_size=2)
    try:
        assert run(llm, prompts) == (ref, [0, 0])
        assert run(llm, prompts)[0] == ref
        assert run(llm, prompts) == (ref, [12, 20])
        assert_state_freed(llm)
    finally:
        llm.close()


def test_live_server_reports_cached_tokens(ckpt):
    """Through the server and the openai client: a conversation's next turn resumes from its first turn's
    checkpoint (usage's cached_tokens, /metrics' prefix-cache hits), with transformers' tokens; after
    POST /reset_prefix_cache it resumes from nothing, to the same tokens."""
    import httpx
    import openai

    from tests.server_utils import LiveServer, metric
    path = ckpt("granitemoehybrid")
    first = prompts_of_lengths((21,), seed=9)[0]
    answer = hf_greedy(path, [first], MAX_NEW)[0]
    turn = first + answer + [11, 12, 13]
    want = hf_greedy(path, [turn], MAX_NEW)[0]
    with LiveServer(path, block_size=BS) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")

        def complete(prompt: list[int]):
            return client.completions.create(model=server.model_name, prompt=prompt, max_tokens=MAX_NEW,
                                             temperature=0.0, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
        out = complete(first)
        assert out.choices[0].token_ids == answer
        out = complete(turn)
        assert out.choices[0].token_ids == want
        cached = out.usage.prompt_tokens_details.cached_tokens
        assert cached > len(first), cached  # (into the answer: the checkpoint taken while it decoded)
        prom = httpx.get(server.url + "/metrics", timeout=30).text
        assert metric(prom, "vllm:prefix_cache_hits_total") == cached
        # vLLM's POST /reset_prefix_cache: the blocks and the state checkpoints are forgotten
        reset = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
        assert reset.status_code == 200 and reset.json()["blocks"] > 0
        out = complete(turn)
        assert out.choices[0].token_ids == want and out.usage.prompt_tokens_details.cached_tokens == 0
        server.wait_idle()
