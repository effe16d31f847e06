"""Every sampling option at once, drawn by hypothesis, through the real engine on a small KV pool (so that
chunked prefill and preemption are in play): each request ends within its limits and its own rules, and the
pool is whole afterwards."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from streamer import LLM, SamplingParams
from streamer.engine.structured_output import StructuredOutputsParams as SO

VOCAB_LIMIT = 400  # token ids drawn below this (the test model's vocabulary is larger)
GRAMMARS = [SO(regex="[a-e]{2,6}!"), SO(choice=["alpha", "beta gamma"]),
            SO(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})]


@pytest.fixture(scope="module", params=[{}, {"num_speculative_tokens": 3, "prompt_lookup_min": 1}],
                ids=["plain", "speculative"])
def llm(llama_dir, request) -> LLM:
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=14, block_size=8, max_num_batched_tokens=24,
               **request.param)


token = st.integers(3, VOCAB_LIMIT)
params_st = st.builds(
    SamplingParams,
    max_tokens=st.integers(3, 12),  # >= min_tokens
    min_tokens=st.integers(0, 3),
    temperature=st.sampled_from([0.0, 0.7, 1.3]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    top_k=st.sampled_from([-1, 1, 5, 50]),
    min_p=st.sampled_from([0.0, 0.1]),
    presence_penalty=st.sampled_from([0.0, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.one_of(st.none(), st.integers(0, 1000)),
    stop_token_ids=st.lists(token, max_size=2),
    logprobs=st.one_of(st.none(), st.integers(0, 3)),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 2)),
    logit_bias=st.one_of(st.none(), st.dictionaries(token, st.floats(-100, 100), max_size=3)),
    allowed_token_ids=st.one_of(st.none(), st.lists(token, min_size=1, max_size=6)),
    ignore_eos=st.booleans(),
    n=st.integers(1, 2),
    structured_outputs=st.one_of(st.none(), st.none(), st.sampled_from(GRAMMARS)),
)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(st.tuples(st.lists(token, min_size=1, max_size=30), params_st), min_size=1, max_size=5))
def test_any_mix_of_sampling_options(llm, reqs) -> None:
    for _, sp in reqs:  # refused up front (test_sampling.py): only stop tokens allowed while min_tokens bans them
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(llm.engine.eos_token_ids))
        assume(not (sp.allowed_token_ids and sp.min_tokens and set(sp.allowed_token_ids) <= stops))
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    outs = llm.generate(prompts, [sp for _, sp in reqs])
    for (prompt, sp), out in zip(reqs, outs):
        assert len(out.outputs) == sp.n
        if sp.prompt_logprobs is not None:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
            assert out.prompt_logprobs[0] is None and all(prompt[i] in out.prompt_logprobs[i]
                                                          for i in range(1, len(prompt)))
        for c in out.outputs:
            # A grammar with no token left that the other options allow ends the output early, possibly empty.
            assert (0 if sp.structured_outputs else 1) <= len(c.token_ids) <= sp.max_tokens
            assert c.finish_reason in ("stop", "length")
            if sp.logprobs is not None:
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            if sp.allowed_token_ids is not None:
                assert set(c.token_ids) <= set(sp.allowed_token_ids)
            if c.finish_reason == "length":  # a stop token either ends the sequence or is banned (min_tokens)
                assert not set(c.token_ids) & set(sp.stop_token_ids)
            if sp.structured_outputs is not None:  # every emitted token fits the grammar
                matcher = llm.engine.grammars.compile(sp.structured_outputs).matcher()
                assert matcher.try_consume_tokens(c.token_ids) == len(c.token_ids)
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.seqs and not e.groups
    assert torch.is_inference_mode_enabled() is False


def test_the_pool_is_small_enough_to_preempt(llm) -> None:
    """The engine above really runs out of blocks with a few such requests (what the property test relies on)."""
    before = llm.engine.scheduler.num_preemptions
    params = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=1, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(5)], params)
    assert llm.engine.scheduler.num_preemptions > before
    assert all(len(o.prompt_logprobs) == 30 for o in outs)
    if llm.engine.config.num_speculative_tokens:  # drafts really get verified (accepted and rejected) here
        # (greedy over a repeating prompt, so the test does not lean on the property test's draws before it)
        llm.generate([[5, 6, 7, 8] * 6], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        assert llm.engine.num_accepted_tokens > 0 and llm.engine.num_draft_tokens > llm.engine.num_accepted_tokens
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
