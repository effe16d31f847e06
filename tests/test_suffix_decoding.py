"""Suffix decoding (speculative_method="suffix"): SuffixIndex's drafts equal a brute-force reading of its
definition (longest suffix match, the matches' votes, the probability cut, the length budget) through eviction and
compaction; greedy output stays transformers'; a repeated request drafts from the earlier one's output and has its
drafts accepted; bad settings are refused."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer import LLM, SamplingParams
from streamer.config import EngineConfig
from streamer.spec_decode.ngram import SuffixIndex
from tests.checkpoints import hf_greedy


def reference(seqs: list[list[int]], context: list[int], k: int, factor: float, min_prob: float,
              depth: int) -> tuple[list[int], int]:
    """The definition, by brute force over the cached sequences."""
    if len(context) < 2:
        return [], 0
    occ = []  # (sequence, index of the token after the occurrence, match length)
    for s in seqs:
        for i in range(2, len(s)):
            if s[i - 2:i] != context[-2:]:
                continue
            m = 2
            while m < min(depth, len(context)) and i - m - 1 >= 0 and s[i - m - 1] == context[-m - 1]:
                m += 1
            occ.append((s, i, m))
    if not occ:
        return [], 0
    best = max(m for _, _, m in occ)
    cands = [(s, i) for s, i, m in occ if m == best]
    budget = min(k, max(1, int(factor * best)))
    draft, prob = [], 1.0
    while len(draft) < budget:
        votes = Counter(s[i] for s, i in cands if i < len(s))
        if not votes:
            break
        top = max(votes.values())
        token = min(t for t, c in votes.items() if c == top)
        prob *= top / len(cands)
        if prob < min_prob:
            break
        draft.append(token)
        cands = [(s, i + 1) for s, i in cands if i < len(s) and s[i] == token]
    return draft, best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=12),
       contexts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=4),
       keep=st.integers(0, 5), depth=st.integers(2, 8), k=st.integers(1, 8),
       factor=st.sampled_from([0.5, 1.0, 3.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_index_drafts_follow_the_definition(seqs, contexts, keep, depth, k, factor, min_prob):
    index = SuffixIndex(keep, depth, capacity=16)  # (a small stream: compactions happen)
    live: list[list[int]] = []
    for s in seqs:
        index.add(np.array(s, dtype=np.int64))
        if keep and len(s) >= 3:
            live = (live + [s])[-keep:]
        assert len(index) == len(live)
        for c in contexts:
            got = index.propose(np.array(c, dtype=np.int64), k, factor, min_prob)
            assert got == reference(live, c, k, factor, min_prob, depth), (live, c)


def test_index_examples():
    index = SuffixIndex(10, 24)
    for s in ([1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [8, 2, 3, 4, 6, 7]):
        index.add(np.array(s))
    # "2 3" matched by three: "4" for all, then "6" (2 of 3 votes), then "7" (1 of 2: 1/3 overall)
    assert index.propose(np.array([2, 3]), 2, 8.0, 0.1) == ([4, 6], 2)
    assert index.propose(np.array([2, 3]), 8, 8.0, 0.1) == ([4, 6, 7], 2)
    assert index.propose(np.array([2, 3]), 8, 8.0, 0.5) == ([4, 6], 2)  # 1/3 < 0.5: no "7"
    assert index.propose(np.array([2, 3]), 8, 1.0, 0.0) == ([4, 6], 2)  # a 2-token match drafts 2 at factor 1
    # the longest match wins over the majority: "9 2 3" -> 4 6, then 9's sequence ends
    assert index.propose(np.array([5, 9, 2, 3]), 8, 8.0, 0.0) == ([4, 6], 3)
    assert index.propose(np.array([7, 7]), 4, 1.0, 0.0) == ([], 0)


def test_index_evicts_and_compacts():
    index = SuffixIndex(2, 24, capacity=16)
    for i in range(50):
        index.add(np.array([100 + i, 1, 2, 3 + i], dtype=np.int64))
    assert len(index) == 2 and len(index.tokens) <= 64  # only the last two are kept, and the stream stays small
    assert index.propose(np.array([1, 2]), 1, 1.0, 0.0) == ([51], 2)  # 51 and 52 tie (1 each): the smaller
    assert index.propose(np.array([148, 1, 2]), 4, 8.0, 0.0) == ([51], 3)
    assert index.propose(np.array([147, 1, 2]), 4, 8.0, 0.0)[0] == [51]  # 147's sequence is gone: a 2-token match


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [300, 12, 450, 3, 77, 81], [40, 41, 42]]
MAX_NEW = 32


def test_repeated_requests_draft_from_earlier_outputs(llama_dir):
    want = hf_greedy(llama_dir, PROMPTS, MAX_NEW)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    counts = {}
    for keep in (1000, 0):
        llm = LLM(str(llama_dir), dtype="float32", speculative_method="suffix", num_speculative_tokens=6,
                  suffix_decoding_max_cached_requests=keep)
        e = llm.engine
        assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                             params)] == want
        d0, a0 = e.num_draft_tokens, e.num_accepted_tokens
        for p, w in zip(PROMPTS, want):  # the same requests again, one by one
            assert llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids == w
        counts[keep] = (e.num_draft_tokens - d0, e.num_accepted_tokens - a0, len(e.suffix))
        assert e.kv.pool.num_free == e.kv.num_blocks
        llm.close()
    drafts, accepted, cached = counts[1000]
    assert cached == 2 * len(PROMPTS) and accepted == drafts and accepted >= 0.8 * len(PROMPTS) * MAX_NEW
    assert counts[0][2] == 0 and counts[0][1] < accepted / 2  # without the cache: the request's own tokens only


@pytest.mark.parametrize("kwargs, field", [
    ({"speculative_method": "suffix"}, "num_speculative_tokens"),
    ({"speculative_method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 1},
     "suffix_decoding_max_tree_depth"),
    ({"speculative_method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": -1},
     "suffix_decoding_max_cached_requests"),
    ({"speculative_method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 0},
     "suffix_decoding_max_spec_factor"),
    ({"speculative_method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 2},
     "suffix_decoding_min_token_prob"),
    ({"speculative_method": "suffix", "num_speculative_tokens": 4, "speculative_model": "x"}, "speculative_model"),
    ({"speculative_method": "tree"}, "speculative_method"),
])
def test_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(None, **kwargs)


def test_vllm_speculative_config():
    """vLLM's speculative_config (a dict in Python, JSON on the command line) sets the same engine arguments."""
    from streamer.cli import build_parser, engine_kwargs
    cfg = EngineConfig.from_kwargs(None, speculative_config={"method": "suffix", "num_speculative_tokens": 12,
                                                             "suffix_decoding_min_token_prob": 0.2})
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.suffix_decoding_min_token_prob) == \
        ("suffix", 12, 0.2)
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'])
    cfg = EngineConfig.from_kwargs(None, **engine_kwargs(args))
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == (None, 5, 3)
    cfg = EngineConfig.from_kwargs(None, speculative_config={"model": "/draft", "num_speculative_tokens": 3})
    assert (cfg.speculative_model, cfg.speculative_method) == ("/draft", None)
    for bad, msg in ([{"method": "medusa", "num_speculative_tokens": 2}, "method"],
                     [{"method": "ngram"}, "num_speculative_tokens"],
                     [{"method": "eagle3", "num_speculative_tokens": 2}, "needs a model"],
                     [{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unsupported"],
                     ["{not json", "not JSON"]):
        with pytest.raises(ValueError, match=msg):
            EngineConfig.from_kwargs(None, speculative_config=bad)


def test_server_chat_repeats_draft_from_the_cache(llama_dir):
    """A live server with suffix decoding: concurrent chat requests, then the same ones again; the texts repeat
    exactly and the repeats' drafts (from the first round's outputs) are almost all accepted."""
    import asyncio

    import openai

    from tests.server_utils import LiveServer
    questions = ["what is two plus two?", "name a colour", "say something long about the sea"]
    with LiveServer(llama_dir, speculative_method="suffix", num_speculative_tokens=6) as live:
        async def round_() -> list[str]:
            async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as c:
                rs = await asyncio.gather(*[c.chat.completions.create(
                    model="llama", messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0.0,
                    extra_body={"ignore_eos": True}) for q in questions])
                return [r.choices[0].message.content for r in rs]

        first = asyncio.run(asyncio.wait_for(round_(), 300))
        before = live.engine.stats()
        again = asyncio.run(asyncio.wait_for(round_(), 300))
        after = live.engine.stats()
    assert again == first
    drafts = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafts >= 0.5 * 24 * len(questions) and accepted >= 0.9 * drafts
