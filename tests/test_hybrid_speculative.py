"""Speculative decoding on hybrid and recurrent models (kv_cache.py StateSnapshots): a verify step runs the drafts
through the recurrent layers, so before it each verifying request's state is snapshotted, and when a draft is
rejected the state goes back and the request recomputes the accepted tokens (with new drafts) in its next chunk.

Engine tests: for every hybrid / recurrent family, greedy tokens with drafts equal transformers' (fp32). Random
models seldom repeat themselves, so n-gram lookup would rarely be right: the drafts come from an oracle that knows
the reference continuation and spoils some of it, so that whole runs are accepted, some are cut short and some
rejected at once, and rolled-back requests draft again. Also: chunked prefill, preemption, tp=2, a draft model,
EAGLE heads (each proposal checked against a reference), the backoff after misses, next turns resuming from
checkpoints taken between verify chunks, and the live server. (The MTP modules: tests/test_mtp.py.)

Property tests: with a simulated model whose "state" is the tokens it consumed, random drafts, acceptances and
stops, every chunk starts from exactly the tokens before it, every checkpoint holds a prefix some request has, and
every position a chunk attends to holds its token (no rejected draft's KV is ever cached), for hybrid and
attention-only models alike."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamer.engine.engine_core
import tests.test_mamba1  # noqa: F401  (registers the test checkpoint families)
import tests.test_recurrent_families  # noqa: F401
from streamer import LLM
from streamer.core.kv_cache import KVCacheManager, cdiv
from streamer.core.request import Request, RequestStatus
from streamer.core.scheduler import SPEC_CHECKPOINT_BLOCKS, Scheduler
from streamer.sampling_params import SamplingParams
from tests.parity import assert_state_freed, family_checkpoints, family_references, greedy_params, prompts_of_lengths
from tests.test_eagle import Reference, assert_proposals_match, make_head, spy_proposals
from tests.test_hybrid_prefix_caching import StateSim
from tests.test_nemotron_h import make_nemotron_h
from tests.test_scheduler_properties import ops

MAX_NEW = 16
K = 3
PROMPTS = prompts_of_lengths((5, 13, 22, 9), seed=23)
FAMILIES = ("granitemoehybrid", "bamba", "qwen3_next", "nemotron_h", "mamba2", "falcon_h1", "lfm2", "lfm2_moe",
            "mamba1", "falcon_mamba")


@pytest.fixture(scope="module")
def ckpt(make_ckpt, ckpt_root):
    plain = family_checkpoints(make_ckpt, "spec_")

    def get(family: str, name: str = "", **overrides: object) -> Path:
        if family == "nemotron_h":
            path = ckpt_root / "nemotron_h"
            return path if (path / "config.json").exists() else make_nemotron_h(path)
        return plain(family, name, **overrides)
    return get


@pytest.fixture(scope="module")
def refs(ckpt):
    return family_references(ckpt, PROMPTS, MAX_NEW)


class OracleDrafts:
    """In place of n-gram lookup (streamer.engine.engine_core.propose_ngram): the next k tokens of the reference continuation
    of whichever sequence the tokens start, each spoilt with probability `spoil` (a spoilt draft is rejected, and
    everything after it with it)."""

    def __init__(self, sequences: list[list[int]], spoil: float, seed: int = 0) -> None:
        self.sequences = sequences
        self.spoil = spoil
        self.rng = random.Random(seed)
        self.calls: list[int] = []  # the drafts' count of each proposal

    def __call__(self, tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
        known = tokens.tolist()
        for seq in self.sequences:
            if seq[:len(known)] == known:
                drafts = [t if self.rng.random() >= self.spoil else (t + 1) % 500 + 3
                          for t in seq[len(known):len(known) + k]]
                self.calls.append(len(drafts))
                return drafts
        raise AssertionError("tokens that no reference continues: the output already went wrong")


def spec_llm(path: Path, monkeypatch, sequences: list[list[int]], spoil: float = 0.35,
             **engine_args) -> tuple[LLM, OracleDrafts]:
    oracle = OracleDrafts(sequences, spoil)
    monkeypatch.setattr(streamer.engine.engine_core, "propose_ngram", oracle)
    return LLM(str(path), dtype="float32", num_speculative_tokens=K, **engine_args), oracle


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_drafts_matches_transformers(ckpt, refs, family, monkeypatch):
    path, want = ckpt(family), refs(family)
    llm, oracle = spec_llm(path, monkeypatch, [p + r for p, r in zip(PROMPTS, want)])
    e = llm.engine
    counts = []  # (drafts, accepted) of each verification, and whether it recomputed accepted tokens too
    verify = e.output._verify

    def spy(state, sampled, result, row, now):
        gap = len(state.req.all_token_ids) - 1 - e.kv.snapshots.taken[state.req.request_id][1]
        update = verify(state, sampled, result, row, now)
        counts.append((len(sampled) - 1, len(update.new_token_ids) - 1, gap))
        return update
    monkeypatch.setattr(e.output, "_verify", spy)
    assert generate(llm, PROMPTS) == want
    # Every outcome happened: all drafts accepted, some, none; and verifications that started from a rolled-back
    # state, recomputing accepted tokens before the new drafts.
    assert any(a == d for d, a, _ in counts) and any(0 < a < d for d, a, _ in counts)
    assert any(a == 0 for _, a, _ in counts) and any(g > 0 for _, _, g in counts)
    assert e.kv.snapshots.num_rollbacks == sum(a < d for d, a, _ in counts)
    assert e.num_steps < len(PROMPTS) * MAX_NEW // 2, "drafts did not save steps"
    assert_state_freed(llm)
    e.kv.check_consistency()


@pytest.mark.parametrize("spoil", [0.0, 0.3])
def test_next_turn_resumes_as_far_as_without_drafts(ckpt, refs, monkeypatch, spoil):
    """Verified runs of drafts would jump over block boundaries, where the state is checkpointed while decoding, and
    a conversation's next turn would find no checkpoint to resume from. A hybrid's verify chunk therefore ends no
    further than the next multiple of SPEC_CHECKPOINT_BLOCKS blocks: the next turn resumes inside the answer, at
    most that many blocks short of where it would without drafts (which checkpoint every block)."""
    path, want = ckpt("granitemoehybrid"), refs("granitemoehybrid")
    turns = [p + r + [7, 8, 9] for p, r in zip(PROMPTS, want)]
    plain = LLM(str(path), dtype="float32", block_size=4)
    assert generate(plain, PROMPTS) == want
    hits = [o.num_cached_tokens for o in plain.generate([{"prompt_token_ids": t} for t in turns],
                                                        SamplingParams(max_tokens=1))]
    assert min(h - len(p) for h, p in zip(hits, PROMPTS)) > 4, "no checkpoint into the answers: nothing to compare"
    llm, _ = spec_llm(path, monkeypatch, [p + r for p, r in zip(PROMPTS, want)], spoil=spoil, block_size=4)
    assert generate(llm, PROMPTS) == want
    assert llm.engine.num_accepted_tokens > 0
    outs = llm.generate([{"prompt_token_ids": t} for t in turns], SamplingParams(max_tokens=1))
    every = SPEC_CHECKPOINT_BLOCKS * 4
    for out, p, hit in zip(outs, PROMPTS, hits):
        got = out.num_cached_tokens
        assert got > len(p) and hit - every < got <= hit, (got, hit)


def test_drafts_that_keep_missing_back_off(ckpt, refs, monkeypatch):
    """A hybrid's rejected draft costs more than the plain step it replaces, so a request whose drafts keep missing
    decodes without them for a while (from the third miss in a row: 1, 2, 4, ... up to 16 steps); an accepted draft
    ends that. Every draft wrong here: far fewer verifications than steps, and the output unchanged."""
    path, want = ckpt("granitemoehybrid"), refs("granitemoehybrid")
    llm, oracle = spec_llm(path, monkeypatch, [p + r for p, r in zip(PROMPTS, want)], spoil=1.0)
    e = llm.engine
    assert generate(llm, PROMPTS) == want
    assert e.num_accepted_tokens == 0 and e.kv.snapshots.num_rollbacks == len(oracle.calls)
    # Per request: misses 1-3 draft back to back, then 1 + 2 + 4 steps without before misses 4, 5 and 6.
    assert len(oracle.calls) <= len(PROMPTS) * 7 < len(PROMPTS) * (MAX_NEW - 1)
    req = Request("x", [5, 6, 7], SamplingParams(max_tokens=4), 4, block_size=4)
    backoffs = []
    for _ in range(9):
        e.core._settle_backoff(req, 0, 3)
        backoffs.append(req.draft_backoff)
    assert backoffs == [0, 0, 1, 2, 4, 8, 16, 16, 16]
    e.core._settle_backoff(req, 1, 3)
    assert req.draft_misses == 0
    assert_state_freed(llm)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=8, block_size=4),  # chunked prefill; budgets that cut drafts short
    dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=16),  # preemption
], ids=["chunked", "preemption"])
def test_chunked_prefill_preemption_and_next_turn(ckpt, refs, monkeypatch, engine_args):
    """Prefix caching stays on: the conversation's next turn resumes from a checkpoint taken while drafts were
    verified and rolled back, and must still equal transformers."""
    path, want = ckpt("granitemoehybrid"), refs("granitemoehybrid")
    turns = [p + r + [7, 8, 9] for p, r in zip(PROMPTS, want)]
    from tests.checkpoints import hf_greedy
    turn_want = hf_greedy(path, turns, MAX_NEW)
    llm, _ = spec_llm(path, monkeypatch, [p + r for p, r in zip(PROMPTS + turns, want + turn_want)], **engine_args)
    e = llm.engine
    assert generate(llm, PROMPTS) == want
    assert generate(llm, turns) == turn_want
    assert e.kv.snapshots.num_rollbacks > 0 and e.num_accepted_tokens > 0
    if "num_kv_blocks" in engine_args:
        assert e.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    else:
        assert e.kv.checkpoints.num_restores > 0
    assert_state_freed(llm)
    e.kv.check_consistency()


def test_tensor_parallel_snapshots_on_every_rank(ckpt, refs, monkeypatch):
    """Each rank snapshots and rolls back its own heads' state, from the step's inputs."""
    path, want = ckpt("granitemoehybrid"), refs("granitemoehybrid")
    llm, _ = spec_llm(path, monkeypatch, [p + r for p, r in zip(PROMPTS, want)], tensor_parallel_size=2)
    try:
        assert generate(llm, PROMPTS) == want
        assert llm.engine.kv.snapshots.num_rollbacks > 0
        assert_state_freed(llm)
    finally:
        llm.close()


def test_draft_model_drafts_for_a_hybrid_target(ckpt, refs, make_ckpt):
    """A small attention model drafts for a hybrid target (one tokenizer): the target's rejections roll its state
    back; the draft's own KV catches up on the recomputed tokens."""
    path, want = ckpt("granitemoehybrid"), refs("granitemoehybrid")
    draft = make_ckpt("spec_llama_draft", family="llama")
    llm = LLM(str(path), dtype="float32", speculative_model=str(draft), num_speculative_tokens=K)
    assert generate(llm, PROMPTS) == want
    e = llm.engine
    assert e.num_draft_tokens > 0 and e.kv.snapshots.num_rollbacks > 0
    assert_state_freed(llm)


@pytest.mark.parametrize("family,version", [("granitemoehybrid", 1), ("granitemoehybrid", 3), ("qwen3_next", 1)])
def test_eagle_head_drafts_for_a_hybrid_target(ckpt, refs, family, version, tmp_path):
    """An EAGLE head reads the target's features. Those of the positions a verify step computed up to a rejected
    draft are right (the state went through them in order), so after a rollback the head drafts from them, and the
    step that recomputes them refills its KV. Every proposal the head makes equals the reference's (transformers'
    target features, the head in float64); the drafts then verified are the oracle's, so that every outcome occurs."""
    path, want = ckpt(family), refs(family)
    head = make_head(tmp_path / "head", path, version, seed=7, aux=[0, 1, 3] if version == 3 else None)
    llm = LLM(str(path), dtype="float32", speculative_model=str(head), num_speculative_tokens=K)
    e = llm.engine
    calls = spy_proposals(llm)
    oracle = OracleDrafts([p + r for p, r in zip(PROMPTS, want)], spoil=0.35)
    spied = e.runner.drafter.propose

    def propose(plan):
        out = spied(plan).clone()  # (the spy keeps the head's own)
        for r, rid in enumerate(plan.req_ids):
            tokens = np.array(e.seqs[rid].req.all_token_ids)
            out[r, :plan.counts[r]] = torch.tensor(oracle(tokens, int(plan.counts[r]), 1, 1))
        return out
    e.runner.drafter.propose = propose
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == want
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, PROMPTS)}
    assert assert_proposals_match(Reference(head, path), calls, sequences) >= 20
    assert e.kv.snapshots.num_rollbacks > 0 and 0 < e.num_accepted_tokens < e.num_draft_tokens
    assert_state_freed(llm)


def test_hybrid_drafts_are_refused(ckpt, llama_dir):
    """A hybrid cannot draft: its state would go through the proposals that the target rejects."""
    with pytest.raises(ValueError, match="cannot draft"):
        LLM(str(llama_dir), dtype="float32", speculative_model=str(ckpt("granitemoehybrid")),
            num_speculative_tokens=2)


# ------------------------------------------------------------------------ the bookkeeping, with a simulated model
class SpecStateSim(StateSim):
    """StateSim with speculative decoding, as the engine does it: before each schedule the decoding requests
    (`Scheduler.draft_limit`) get random drafts; a sampling step accepts a random number of them, then one more
    token, and a rejection rolls the state back (`KVCacheManager.reject_drafts`) before the tokens are appended.
    The state check counts drafts as tokens consumed, so a state left holding a rejected draft fails it. The KV
    check (as test_scheduler_properties' Sim): every position a chunk attends to holds the token its request has
    there, so a cached block whose KV came from a rejected draft fails it when another request hits it.
    hybrid=False: an attention-only model (no state, no rollback: rejected drafts' KV is overwritten)."""

    def __init__(self, *args, k: int, max_batch: int, hybrid: bool = True, **kw) -> None:
        super().__init__(*args, **kw)
        self.cfg = dataclasses.replace(self.cfg, num_speculative_tokens=k, speculative_max_batch=max_batch)
        self.kv = KVCacheManager(self.kv.num_blocks, self.cfg.block_size, True, state_slots=self.cfg.max_num_seqs,
                                 checkpoint_slots=self.kv.checkpoints.num_slots, snapshot_slots=max_batch) \
            if hybrid else KVCacheManager(self.kv.num_blocks, self.cfg.block_size, True)
        self.sched = Scheduler(self.cfg, self.kv, max_model_len=10_000)
        if hybrid:
            schedule = self.sched.schedule
            self.sched.schedule = lambda: self.run_states(schedule())  # type: ignore[method-assign]
        self.outcomes: list[tuple[int, int]] = []  # (drafts, accepted)

    def run_states(self, out):
        """StateSim's checks, and every checkpoint holds a block-aligned prefix of some request's known tokens (a
        rejected draft in it would be resumed from by a later request with that prefix)."""
        out = super().run_states(out)
        known = [tuple((t, id(r.lora)) for t in r.all_token_ids) for r in self.live + self.finished]
        for slot in self.kv.checkpoints.lru.values():
            state = self.state.get(slot, ())
            assert len(state) % self.cfg.block_size == 0 and any(k[:len(state)] == state for k in known), \
                "a checkpoint holds tokens that no request has"
        return out

    def propose(self) -> None:
        running = self.sched.running
        if len(running) > self.cfg.speculative_max_batch:
            return
        for req in running:
            room = req.max_tokens - req.num_output_tokens - 1
            n = min(self.rng.randint(0, self.cfg.num_speculative_tokens), room, self.sched.draft_limit(req))
            if n > 0:
                req.draft_token_ids = [self.rng.randrange(50_000) for _ in range(n)]

    def check_kv(self, out) -> None:
        bs = self.cfg.block_size

        def where(blocks: list[int], pos: int) -> int:
            return blocks[pos // bs] * bs + pos % bs
        for s in out.scheduled:  # the step writes each fed token's KV ...
            seq, blocks = s.req.all_token_ids + s.req.draft_token_ids[:s.num_drafts], self.kv.blocks_of(s.req.request_id)
            for pos in range(s.start, s.start + s.num_tokens):
                self.slots[where(blocks, pos)] = seq[pos]
        for s in out.scheduled:  # ... before any of them attends
            seq, blocks = s.req.all_token_ids + s.req.draft_token_ids[:s.num_drafts], self.kv.blocks_of(s.req.request_id)
            for pos in range(s.start + s.num_tokens):
                assert self.slots.get(where(blocks, pos)) == seq[pos], f"{s.req.request_id} reads wrong KV at {pos}"

    def step(self) -> None:
        self.propose()
        out = self.sched.schedule()
        self.check_kv(out)
        for s in out.scheduled:
            if not s.samples:
                continue
            req = s.req
            drafts, req.draft_token_ids = req.draft_token_ids[:s.num_drafts], []
            accepted = self.rng.randint(0, len(drafts))
            self.outcomes.append((len(drafts), accepted))
            if accepted < len(drafts):
                self.kv.reject_drafts(req)
            for t in drafts[:accepted] + [self.rng.randrange(50_000)]:
                req.append_token(t)
                if req.num_output_tokens >= req.max_tokens or self.rng.random() < 0.05:  # (or a stop token)
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.live.remove(req)
                    self.finished.append(req)
                    break
            else:
                req.num_computed_tokens = min(req.num_computed_tokens, len(req.all_token_ids) - 1)
                req.num_pending = 0
        self.sched.check_invariants()

    def next_turns(self) -> None:
        """Each finished request's conversation goes on: its tokens and one more, as a new prompt."""
        for req in list(self.finished):
            if cdiv(len(req.all_token_ids) + 7, self.cfg.block_size) > self.kv.num_blocks:
                continue  # (the engine rejects these up front)
            turn = Request(f"turn{self.n}", req.all_token_ids + [1], SamplingParams(max_tokens=6), 6,
                           block_size=self.cfg.block_size, hash_blocks=True)
            self.n += 1
            self.sched.add(turn)
            self.live.append(turn)


@settings(max_examples=120, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(8, 40),
       budget=st.integers(1, 48), max_seqs=st.integers(1, 6), checkpoints=st.integers(1, 8),
       k=st.integers(1, 4), max_batch=st.integers(1, 6), policy=st.sampled_from(["fcfs", "priority"]))
def test_states_resume_exactly_with_drafts(ops, block_size, num_blocks, budget, max_seqs, checkpoints, k,
                                           max_batch, policy):
    sim = SpecStateSim(block_size, num_blocks, budget, max_seqs, True, policy, checkpoints=checkpoints, k=k,
                       max_batch=max_batch)
    sim.run(ops)
    sim.next_turns()
    sim.drain()
    assert sim.kv.state.num_free == sim.kv.state.num_slots
    sim.kv.check_consistency()


@settings(max_examples=80, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(8, 40), budget=st.integers(1, 48),
       max_seqs=st.integers(1, 6), k=st.integers(1, 4), seed=st.integers(0, 1000))
def test_attention_kv_stays_right_with_drafts(ops, block_size, num_blocks, budget, max_seqs, k, seed):
    """An attention-only model: rejected drafts' KV is overwritten, never cached; next turns hit what is right."""
    sim = SpecStateSim(block_size, num_blocks, budget, max_seqs, True, "fcfs", checkpoints=1, k=k,
                       max_batch=max_seqs, hybrid=False)
    sim.rng.seed(seed)
    sim.run(ops)
    sim.next_turns()
    sim.drain()
    sim.kv.check_consistency()


def test_the_simulation_rolls_back():
    """The property test is not vacuous: drafts are verified, some rejected (rolled back), some accepted whole."""
    sim = SpecStateSim(4, 64, 32, 4, True, "fcfs", checkpoints=4, k=3, max_batch=4)
    for i in range(4):
        sim.add(10 + 3 * i, 30, i, 0)
    sim.drain()
    assert sim.kv.snapshots.num_rollbacks > 5
    assert any(a == d > 0 for d, a in sim.outcomes) and any(a < d for d, a in sim.outcomes)


def test_a_checkpoint_after_a_rollback_holds_the_restored_state():
    """With two checkpoint slots for three requests, requests evict each other's checkpoints, so a rolled-back
    request may save the checkpoint where it resumes again in the step after its rejection: the rollback's copy
    must run before that save (until then the state still holds the rejected drafts). Each conversation's next turn
    resumes from its last checkpoint."""
    restores = 0
    for seed in range(40):
        sim = SpecStateSim(4, 96, 64, 3, True, "fcfs", checkpoints=2, k=3, max_batch=3)
        sim.rng.seed(seed)
        for i in range(3):
            sim.add(9 + 4 * i, 24, i, 0)
        sim.drain()
        for req in list(sim.finished):
            turn = Request(f"next{sim.n}", req.all_token_ids + [1], SamplingParams(max_tokens=4), 4, block_size=4)
            sim.n += 1
            sim.sched.add(turn)
            sim.live.append(turn)
        sim.drain()
        restores += sim.kv.checkpoints.num_restores
    assert restores > 0


def test_live_server_streams_verified_runs(ckpt, refs, monkeypatch):
    """Through the server and the openai client, requests at once (plain, streamed, and a stream dropped after its
    first chunk): every answer is transformers' greedy one, several tokens arriving per chunk; the engine ends
    with its blocks and state slots whole."""
    import asyncio

    import openai

    from tests.server_utils import LiveServer, metric
    path, want = ckpt("granitemoehybrid"), refs("granitemoehybrid")
    monkeypatch.setattr(streamer.engine.engine_core, "propose_ngram", OracleDrafts([p + r for p, r in zip(PROMPTS, want)], 0.35))
    extra = {"min_tokens": MAX_NEW, "return_token_ids": True}
    with LiveServer(path, num_speculative_tokens=K) as server:
        async def main():
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
                def create(prompt, stream):
                    return c.completions.create(model=server.model_name, prompt=prompt, max_tokens=MAX_NEW,
                                                temperature=0.0, stream=stream, extra_body=extra)

                async def plain(prompt):
                    return (await create(prompt, False)).choices[0].token_ids, 1

                async def streamed(prompt):
                    ids, chunks = [], 0
                    async for ch in await create(prompt, True):
                        if ch.choices and ch.choices[0].token_ids:
                            ids += ch.choices[0].token_ids
                            chunks += 1
                    return ids, chunks

                async def dropped(prompt):
                    stream = await create(prompt, True)
                    async for _ in stream:
                        break
                    await stream.close()
                    return None, 0
                return await asyncio.gather(plain(PROMPTS[0]), plain(PROMPTS[1]), streamed(PROMPTS[2]),
                                            streamed(PROMPTS[3]), dropped(PROMPTS[1]))

        results = asyncio.run(asyncio.wait_for(main(), 300))
        server.wait_idle()
        import httpx
        prom = httpx.get(server.url + "/metrics", timeout=30).text
        e = server.engine.engine
        assert [ids for ids, _ in results[:4]] == want
        assert results[2][1] + results[3][1] < 2 * MAX_NEW, "no chunk carried a verified run"
        assert e.kv.snapshots.num_rollbacks > 0
        assert metric(prom, "vllm:spec_decode_num_accepted_tokens_total") == e.num_accepted_tokens > 0
        assert e.kv.state.num_free == e.kv.state.num_slots and not e.kv.state.slot_of


def test_no_rejected_draft_kv_is_cached():
    """A request that stops inside a verified run (a stop token, drawn where a draft was rejected) has KV from the
    rejected draft at its last position: the blocks it leaves cached end before it, and a next turn hits only right
    KV. Many seeds, a pool big enough that nothing is evicted before the next turns look."""
    for hybrid in (False, True):
        for seed in range(40):
            sim = SpecStateSim(2, 256, 64, 4, True, "fcfs", checkpoints=8, k=3, max_batch=4, hybrid=hybrid)
            sim.rng.seed(seed)
            for i in range(4):
                sim.add(7 + 3 * i, 20, i, 0)
            sim.drain()
            sim.next_turns()
            sim.drain()
