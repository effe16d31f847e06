"""thinking_token_budget (vLLM's): at most that many reasoning tokens, then the closing think tag is forced and the
model answers from there. The state machine on token streams (and a property test of it), the engine against its
own greedy continuation of the forced text (the oracle: what follows the tag is the model's free choice), the
prompt deciding where the output starts, async scheduling, sampling with n and preemption, errors, and the live
server splitting reasoning from content around the forced tag."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer import LLM, SamplingParams
from streamer.engine.thinking import BEFORE, CLOSED, INSIDE, ThinkTags
from tests.server_utils import LiveServer

PROMPT = [1, 45, 368, 173, 170, 299, 43]
TAGS = ThinkTags(start=(7, 8), end=(7, 9, 8), starts_inside=False)  # a tag of several tokens, like the test vocab's


# ---------------------------------------------------------------------------------------------- the state machine
@pytest.mark.parametrize("prompt, starts_inside, phase", [
    ([1, 2, 7, 8], False, INSIDE), ([7, 8, 3, 7, 9, 8], False, CLOSED), ([7, 9, 8, 7, 8, 5], False, INSIDE),
    ([1, 2, 3], False, BEFORE), ([1, 2, 3], True, INSIDE), ([7, 8, 7, 9, 8], True, CLOSED), ([7, 9], False, BEFORE),
])
def test_where_the_prompt_leaves_the_output(prompt, starts_inside, phase):
    tags = ThinkTags(TAGS.start, TAGS.end, starts_inside)
    assert tags.budget(prompt, 5).phase == phase


def _run(tags: ThinkTags, prompt: list[int], budget: int, model: list[int]) -> list[int]:
    """The output when the model would write `model` (one token a step) and the budget forces its tokens."""
    b = tags.budget(prompt, budget)
    out: list[int] = []
    for want in model:
        t = b.forced(out)
        out.append(want if t is None else t)
        b.feed(out)
    return out


def test_forcing_on_token_streams():
    assert _run(TAGS, [7, 8], 2, [1, 2, 3, 4, 5, 6]) == [1, 2, 7, 9, 8, 6]
    assert _run(TAGS, [7, 8], 0, [1, 2, 3, 4]) == [7, 9, 8, 4]
    assert _run(TAGS, [7, 8], 3, [1, 7, 9, 8, 4, 4]) == [1, 7, 9, 8, 4, 4]  # closed by the model: nothing forced
    assert _run(TAGS, [7, 8], 2, [1, 7, 5, 5, 5, 5]) == [1, 7, 9, 8, 5, 5]  # the model's own "7" begins the tag
    assert _run(TAGS, [7, 8, 7, 9, 8], 0, [1, 2, 3]) == [1, 2, 3]  # the prompt closed it
    assert _run(TAGS, [1], 1, [2, 7, 8, 3, 4, 5, 6]) == [2, 7, 8, 3, 7, 9, 8]  # opened by the model, then counted
    assert _run(TAGS, [1], 1, [2, 7, 8, 3, 7, 9, 8, 7, 8, 1, 1, 1]) == [2, 7, 8, 3, 7, 9, 8, 7, 8, 1, 1, 1]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(model=st.lists(st.sampled_from([1, 2, 7, 8, 9]), max_size=30), budget=st.integers(0, 6),
       inside=st.booleans())
def test_reasoning_never_outruns_the_budget(model, budget, inside):
    """Whatever the model writes, its first reasoning ends (the closing tag complete) within budget + len(end)
    tokens of where it started, and a token is forced only once the budget is spent."""
    prompt = [7, 8] if inside else [1]
    out = _run(TAGS, prompt, budget, model)
    start = 0 if inside else next((i + 2 for i in range(len(out) - 1) if out[i:i + 2] == [7, 8]), None)
    if start is None:
        assert out == model  # never opened: nothing forced
        return
    closed = next((i + 3 for i in range(start, len(out) - 2) if out[i:i + 3] == [7, 9, 8]), None)
    if closed is None:
        assert len(out) - start < budget + 3
    else:
        assert closed - start <= budget + 3
    assert out[:start + budget] == model[:start + budget]


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, reasoning_parser="deepseek_r1")


def _pool_whole(llm: LLM) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.kv.req_blocks and not e.seqs


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_the_tag_comes_at_the_budget_and_the_model_goes_on_from_it(llm, budget):
    end = list(llm.engine.think_tags.end)
    free = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0].token_ids
    assert not any(free[i:i + len(end)] == end for i in range(len(free)))  # the model would not close it itself
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, thinking_token_budget=budget,
                                                logprobs=0))[0].outputs[0]
    ids = out.token_ids
    assert ids[:budget] == free[:budget] and ids[budget:budget + len(end)] == end
    assert "</think>" in out.text and len(out.logprobs) == len(ids)
    cut = budget + len(end)
    rest = llm.generate([PROMPT + ids[:cut]], SamplingParams(max_tokens=24 - cut, temperature=0.0))[0].outputs[0]
    assert ids[cut:] == rest.token_ids
    _pool_whole(llm)


def test_the_prompt_decides_where_the_output_starts(llama_dir, llm):
    tags = llm.engine.think_tags
    closed = PROMPT + list(tags.start) + [5, 6] + list(tags.end)
    p = SamplingParams(max_tokens=12, temperature=0.0)
    budgeted = p.clone(thinking_token_budget=1)
    free, out = (llm.generate([closed], q)[0].outputs[0].token_ids for q in (p, budgeted))
    assert out == free  # already closed: nothing to count
    # qwen3: no tag in the prompt, so the output starts before the reasoning (this model never opens it).
    qwen = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, reasoning_parser="qwen3")
    assert [qwen.generate([PROMPT], q)[0].outputs[0].token_ids for q in (p, budgeted)] == \
        [llm.generate([PROMPT], p)[0].outputs[0].token_ids] * 2
    opened = PROMPT + list(tags.start)  # ... unless the prompt opened it
    ids = qwen.generate([opened], budgeted)[0].outputs[0].token_ids
    assert ids[1:1 + len(tags.end)] == list(tags.end)


def test_async_scheduling_and_batches_give_the_same_tokens(llama_dir, llm):
    fast = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, reasoning_parser="deepseek_r1",
               async_scheduling=True)
    prompts = [PROMPT, [9, 8, 7, 6], [40, 41, 42]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, thinking_token_budget=2),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, thinking_token_budget=5)]
    outs = fast.generate(prompts, params)
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert fast.engine.num_overlapped_steps > 0
    # Alone, with room left in its budget, a request's steps still overlap: only the last two tokens of the budget
    # (and the forced tag) wait for the token before them.
    steps = fast.engine.num_overlapped_steps
    long = SamplingParams(max_tokens=30, temperature=0.0, thinking_token_budget=16)
    got = fast.generate([PROMPT], long)[0].outputs[0].token_ids
    assert got == llm.generate([PROMPT], long)[0].outputs[0].token_ids
    assert got[16:16 + len(llm.engine.think_tags.end)] == list(llm.engine.think_tags.end)
    assert fast.engine.num_overlapped_steps - steps >= 18  # (29 steps after the first; before, ~7 overlapped)
    _pool_whole(fast)


def test_sampled_with_n_and_preemption(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=12, block_size=16, max_num_batched_tokens=64,
              reasoning_parser="deepseek_r1")
    end = list(llm.engine.think_tags.end)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, n=2, thinking_token_budget=4 * i)
              for i in range(4)]
    outs = llm.generate([list(range(3 + i, 30 + 5 * i)) for i in range(4)], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(params, outs):
        for o in out.outputs:
            ids = o.token_ids
            first = next((i for i in range(len(ids)) if ids[i:i + len(end)] == end), None)
            if first is None:  # it ended (eos) while still within its budget
                assert o.finish_reason == "stop" and len(ids) <= p.thinking_token_budget, ids
            else:
                assert first <= p.thinking_token_budget, (p.thinking_token_budget, ids)
                assert o.finish_reason == "length" or ids[-1] in llm.engine.eos_token_ids
    _pool_whole(llm)


def test_errors(llama_dir, llm):
    plain = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="thinking_token_budget needs the engine's reasoning_parser"):
        plain.generate([PROMPT], SamplingParams(max_tokens=4, thinking_token_budget=3))
    harmony = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, reasoning_parser="openai_gptoss")
    with pytest.raises(ValueError, match="one with think tags"):
        harmony.generate([PROMPT], SamplingParams(max_tokens=4, thinking_token_budget=3))
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
            SamplingParams(thinking_token_budget=bad)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, reasoning_parser="nope")
    # An output held to a grammar starts outside the reasoning: the budget has nothing to count.
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, thinking_token_budget=0,
                                                structured_outputs={"regex": "[a-z]{3}"}))[0].outputs[0]
    assert len(out.text) == 3 and out.text.isalpha()
    for e in (plain, harmony, llm):
        _pool_whole(e)


# ---------------------------------------------------------------------------------------------- the server
def test_server_reasoning_and_content_split_at_the_forced_tag(llama_dir):
    with LiveServer(llama_dir, reasoning_parser="deepseek_r1") as live:
        async def main():
            async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=60) as c:
                msgs = [{"role": "user", "content": "hello"}]
                kw = dict(model=live.model_name, messages=msgs, max_tokens=16, temperature=0.0)
                free = await c.chat.completions.create(**kw, logprobs=True)
                r = await c.chat.completions.create(**kw, logprobs=True, extra_body={"thinking_token_budget": 3})
                chunks = [ch async for ch in await c.chat.completions.create(
                    **kw, stream=True, stream_options={"include_usage": True},
                    extra_body={"thinking_token_budget": 3})]
                resp = await c.responses.create(model=live.model_name, input="hello", max_output_tokens=16,
                                                temperature=0.0, extra_body={"thinking_token_budget": 3})
                return free, r, chunks, resp

        free, r, chunks, resp = asyncio.run(main())
        # usage counts the reasoning tokens (the tags' own left out); all 16 are reasoning when nothing closes it.
        assert r.usage.completion_tokens_details.reasoning_tokens == 3 == chunks[-1].usage.completion_tokens_details \
            .reasoning_tokens == resp.usage.output_tokens_details.reasoning_tokens
        assert free.usage.completion_tokens_details.reasoning_tokens == 16
        assert [o.type for o in resp.output] == ["reasoning", "message"]
        assert resp.output_text == r.choices[0].message.content
        m = r.choices[0].message
        first3 = "".join(e.token for e in free.choices[0].logprobs.content[:3])
        assert m.reasoning_content == first3 and m.content
        assert "".join(e.token for e in r.choices[0].logprobs.content) == first3 + "</think>" + m.content
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == first3
        assert "".join(d.content or "" for d in deltas) == m.content
        bad = httpx.post(live.base_url + "/chat/completions", timeout=60,
                         json={"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
        state = live.pool_state()
        assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == 0


def test_server_without_a_reasoning_parser_refuses_a_budget(llama_dir):
    with LiveServer(llama_dir) as live:
        r = httpx.post(live.base_url + "/completions", timeout=60,
                       json={"prompt": "hi", "max_tokens": 3, "thinking_token_budget": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "thinking_token_budget" and "reasoning_parser" in err["message"], err
