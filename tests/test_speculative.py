"""Speculative decoding with n-gram drafts: greedy output identical to transformers', sampled output with the
model's distribution, stops and limits inside an accepted run, chunked prefill and preemption, and the server."""
from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import openai
import pytest

from streamer import LLM, SamplingParams
from streamer.spec_decode.ngram import propose_ngram
from tests.checkpoints import hf_greedy
from tests.server_utils import LiveServer, metric

# Prompts that repeat themselves, so that n-gram drafts exist (and a few that do not).
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 40)) * 3, [7, 7, 7, 7, 7, 7],
           [100, 101, 102, 103] * 6 + [100], [300, 12, 450, 3]]
MAX_NEW = 40


def _pool_whole(llm: LLM) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.seqs and not e.groups
    assert all(not r.draft_token_ids for r in e.scheduler.requests.values())


def test_propose_ngram():
    t = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 2, 3])
    # The longest n that occurred before wins (n=2: "2 3" -> last occurrence at 6, followed by 5 6 2 ...).
    assert propose_ngram(t, 3, 2, 4) == [5, 6, 2]
    assert propose_ngram(np.array([1, 2, 3, 9, 1, 2, 3, 7, 1, 2]), 2, 2, 3) == [3, 7]  # the latest occurrence
    assert propose_ngram(np.array([4, 5, 6, 7]), 3, 1, 3) == []  # nothing repeats
    assert propose_ngram(np.array([8]), 3, 1, 3) == []
    # A loop: the copy runs into the present and goes on around the loop.
    assert propose_ngram(np.array([1, 2, 1, 2]), 5, 1, 2) == [1, 2, 1, 2, 1]
    assert propose_ngram(np.array([5, 7, 7, 7]), 4, 1, 3) == [7, 7, 7, 7]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill, and budgets that cut drafts short
    {"num_kv_blocks": 20, "block_size": 8},  # preemption
    {"enforce_eager": False},  # compiled: verification steps run the general graph, decode the lone one
], ids=["plain", "chunked", "preempting", "compiled"])
def test_greedy_matches_transformers(llama_dir, engine_args):
    llm = LLM(str(llama_dir), dtype="float32", num_speculative_tokens=3, prompt_lookup_min=1, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, PROMPTS, MAX_NEW)
    e = llm.engine
    assert e.num_accepted_tokens > 0 and e.num_draft_tokens > e.num_accepted_tokens  # both outcomes happened
    assert e.num_steps < len(PROMPTS) * MAX_NEW
    if "num_kv_blocks" in engine_args:
        assert e.scheduler.num_preemptions > 0
    _pool_whole(llm)


@pytest.fixture(scope="module")
def pair(llama_dir):
    base = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512)
    spec = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512, num_speculative_tokens=4, prompt_lookup_min=1,
               speculative_max_batch=10_000)
    return base, spec


def test_stops_limits_and_logprobs_inside_accepted_runs(pair):
    """max_tokens, stop strings and stop token ids that fall inside a run of accepted drafts end the output
    exactly where one-token-at-a-time decoding ends it; logprobs come per token."""
    base, spec = pair
    text = base.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=30, temperature=0.0,
                                                                              ignore_eos=True))[0].outputs[0]
    stop_str = text.text[len(text.text) // 2:][:3]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in range(1, 12)]
    params += [SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_str]),
               SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[text.token_ids[9]])]
    prompts = [{"prompt_token_ids": PROMPTS[1]}] * len(params)
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason)
        if w.logprobs is not None:
            assert len(g.logprobs) == len(g.token_ids)
            for a, b in zip(w.logprobs, g.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert spec.engine.num_accepted_tokens > 0
    _pool_whole(spec)


def test_sampling_keeps_the_distribution(pair):
    """Drawing at a draft's position and keeping it if equal is speculative sampling's rejection rule for a
    one-hot draft. The joint distribution of the first generated tokens, over 1,000 seeded samples each, is the
    same with and without drafts (total variation well under what a wrong rule gives: see below)."""
    base, spec = pair
    # The prompt holds its own greedy continuation, so that drafts are likely continuations.
    start = [5, 6, 7]
    greedy = base.generate([{"prompt_token_ids": start}], SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True))[0].outputs[0].token_ids
    prompt = [{"prompt_token_ids": start + greedy + start}]

    def joint(llm, offset):
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=offset + i, ignore_eos=True)
                  for i in range(1000)]
        return Counter(tuple(o.outputs[0].token_ids) for o in llm.generate(prompt * 1000, params))

    before = spec.engine.num_draft_tokens
    a, b, c = joint(base, 0), joint(spec, 10_000), joint(base, 20_000)
    assert spec.engine.num_draft_tokens - before > 500

    def tv(x, y):
        return 0.5 * sum(abs(x[k] - y[k]) for k in set(x) | set(y)) / 1000

    # Two base runs with other seeds differ by sampling noise only; spec vs base must be as close. (Measured:
    # 0.15 spec vs base, 0.16 base vs base; an engine that always accepted its drafts gave 0.62.)
    assert tv(a, b) < max(0.12, 1.5 * tv(a, c)), (tv(a, b), tv(a, c))
    _pool_whole(spec)


def test_server_streams_the_same_text(llama_dir):
    """Through the server: several tokens per chunk; the joined text equals plain decoding's."""
    with LiveServer(llama_dir, num_speculative_tokens=4, prompt_lookup_min=1) as live:
        async def main():
            async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as c:
                plain = await c.completions.create(model="llama", prompt=PROMPTS[1], max_tokens=40,
                                                   temperature=0.0, extra_body={"ignore_eos": True})
                text, chunks = "", 0
                async for ch in await c.completions.create(model="llama", prompt=PROMPTS[1], max_tokens=40,
                                                           temperature=0.0, stream=True,
                                                           extra_body={"ignore_eos": True}):
                    if ch.choices:
                        text += ch.choices[0].text
                        chunks += 1
                return plain, text, chunks

        plain, text, chunks = asyncio.run(asyncio.wait_for(main(), 300))
        stats = live.engine.stats()
        import httpx
        prom = httpx.get(live.url + "/metrics", timeout=30).text
    base = LLM(str(llama_dir), dtype="float32").generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert plain.choices[0].text == text == base
    assert stats["spec_num_accepted_tokens"] > 0 and chunks < 40
    assert metric(prom, "vllm:spec_decode_num_accepted_tokens_total") == stats["spec_num_accepted_tokens"]
    assert metric(prom, "vllm:spec_decode_num_draft_tokens_total") == stats["spec_num_draft_tokens"]


def test_bad_arguments():
    for kw in [{"num_speculative_tokens": -1}, {"prompt_lookup_min": 0}, {"prompt_lookup_min": 5},
               {"num_speculative_tokens": 1.5}]:
        with pytest.raises(ValueError):
            LLM(**kw)


def test_server_mixed_load_with_disconnects_leaks_nothing(llama_dir):
    """40 concurrent requests on a server with drafts on and a small pool: grammars, n > 1, stop strings,
    logprobs, plain ones; a third of the streams are dropped after their first chunk. Every request that stays
    gets a complete, well-formed answer, and afterwards the pool is whole and nothing is left running."""
    import json as _json
    import re

    import httpx

    from tests.server_utils import sse_events
    bodies = []
    for i in range(40):
        b: dict = {"model": "llama", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 30, "stream": True,
                   "temperature": [0.0, 0.8][i % 2], "seed": i}
        kind = i % 5
        if kind == 0:
            b["structured_outputs"] = {"regex": "[a-c]{3,8}!"}
        elif kind == 1:
            b.update(n=2, stop=["e"])
        elif kind == 2:
            b.update(logprobs=2, ignore_eos=True)
        elif kind == 3:
            b["guided_choice"] = ["alpha", "beta"]
        bodies.append(b)

    with LiveServer(llama_dir, num_speculative_tokens=3, prompt_lookup_min=1, num_kv_blocks=40,
                    block_size=8) as live:
        async def one(c: httpx.AsyncClient, i: int, body: dict):
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                if i % 3 == 2:  # drop the connection after the first chunk
                    async for _ in r.aiter_lines():
                        return None
                raw = "".join([line + "\n" async for line in r.aiter_lines()])
            events = sse_events(raw)
            assert events[-1] == "[DONE]"
            texts: dict[int, str] = {}
            finish: dict[int, str] = {}
            for e in events[:-1]:
                for ch in _json.loads(e)["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                    if ch["finish_reason"]:
                        finish[ch["index"]] = ch["finish_reason"]
            assert sorted(finish) == list(range(body.get("n", 1)))
            return texts, finish

        async def main():
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, i, b) for i, b in enumerate(bodies)))

        results = asyncio.run(asyncio.wait_for(main(), 300))
        for body, res in zip(bodies, results):
            if res is None:
                continue
            texts, finish = res
            if "structured_outputs" in body and finish[0] == "stop":
                assert re.fullmatch("[a-c]{3,8}!", texts[0]), texts
            if "guided_choice" in body:
                assert texts[0] in ("alpha", "beta") and finish[0] == "stop"
        idle = live.wait_idle()
        stats = live.engine.stats()
    assert idle["free"] == idle["blocks"]
    assert stats["spec_num_draft_tokens"] > 0 and stats["num_preemptions"] > 0
