"""The server through the real `openai` client: completions and chat, streamed and not, n, stop, logprobs, usage,
and 32 concurrent streams that each get exactly the tokens offline greedy generation gives."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from streamer import LLM, SamplingParams
from tests.server_utils import ENGINE_KWARGS, LiveServer, metric

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 300))


@pytest.fixture(scope="module", params=[None, True], ids=["default", "async-scheduling"])
def live(request, llama_dir):
    """Every test against the default server (CPU: steps one after another) and one with async scheduling."""
    with LiveServer(llama_dir, async_scheduling=request.param) as server:
        yield server


def client(live: LiveServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)


async def _stream_completion(c: AsyncOpenAI, **kw: Any) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = []
    async for chunk in await c.completions.create(stream=True, **kw):
        chunks.append(chunk)
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                assert ch.index not in finish, "finish_reason twice for one choice"
                finish[ch.index] = ch.finish_reason
    return texts, finish, chunks


def test_models(live):
    async def main():
        async with client(live) as c:
            models = await c.models.list()
            assert [m.id for m in models.data] == [live.model_name] == ["llama"]
            from streamer import __version__
            async with httpx.AsyncClient(base_url=live.url) as h:
                assert (await h.get("/version")).json() == {"version": __version__}
            with pytest.raises(openai.NotFoundError) as e:
                await c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
            assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
            # OpenAI's retrieve: GET /v1/models/{model}, the list's card; 404 for another name.
            card = await c.models.retrieve("llama")
            assert card.model_dump() == models.data[0].model_dump()
            with pytest.raises(openai.NotFoundError) as e:
                await c.models.retrieve("org/gpt-4")
            assert e.value.body["code"] == "model_not_found"
    run(main())


def test_completion_stream_equals_non_stream_and_usage(live):
    async def main():
        async with client(live) as c:
            full = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=20, **GREEDY)
            texts, finish, chunks = await _stream_completion(
                c, model="llama", prompt=PROMPT, max_tokens=20, stream_options={"include_usage": True}, **GREEDY)
        assert full.object == "text_completion" and len(full.choices) == 1
        assert texts[0] == full.choices[0].text and len(full.choices[0].text) > 0
        assert finish[0] == full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 20
        assert full.usage.prompt_tokens_details.cached_tokens >= 0
        # OpenAI's shape: usage null on every chunk, then one usage chunk with no choices.
        assert all(ch.usage is None and ch.choices for ch in chunks[:-1])
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == 20
        assert last.usage.prompt_tokens == full.usage.prompt_tokens
        assert last.usage.total_tokens == last.usage.prompt_tokens + 20
        # The same prompt again: its full blocks come from the prefix cache.
        assert last.usage.prompt_tokens_details.cached_tokens > 0
        assert len({ch.id for ch in chunks}) == 1
    run(main())


def test_continuous_usage_stats(live):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far,
    its completion tokens counting up to the total of the final usage chunk; without include_usage it is off."""
    async def main():
        async with client(live) as c:
            opts = {"include_usage": True, "continuous_usage_stats": True}
            _, _, chunks = await _stream_completion(c, model="llama", prompt=PROMPT, max_tokens=12,
                                                    stream_options=opts, **GREEDY)
            _, _, plain = await _stream_completion(c, model="llama", prompt=PROMPT, max_tokens=4,
                                                   stream_options={"continuous_usage_stats": True}, **GREEDY)
        counts = [ch.usage.completion_tokens for ch in chunks]
        assert counts == sorted(counts) and counts[-1] == 12 and 1 <= counts[0] < 12
        assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in chunks)
        assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)
        assert chunks[-1].choices == [] and chunks[-2].usage.completion_tokens == 12  # the last token's chunk
        assert all(ch.usage is None for ch in plain)
    run(main())


def test_chat_stream_equals_non_stream(live):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]

    async def main():
        async with client(live) as c:
            full = await c.chat.completions.create(model="llama", messages=messages, max_tokens=16, **GREEDY)
            chunks = [ch async for ch in await c.chat.completions.create(
                model="llama", messages=messages, max_completion_tokens=16, stream=True,
                stream_options={"include_usage": True}, **GREEDY)]
        assert full.object == "chat.completion"
        msg = full.choices[0].message
        assert msg.role == "assistant" and msg.content
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content == msg.content
        with_choices = [ch for ch in chunks if ch.choices]
        # finish_reason rides on the last content chunk; after it only the usage chunk
        assert with_choices[-1].choices[0].finish_reason == "length"
        assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
        assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    run(main())


def test_n2_seeded_sampling(live):
    kw = dict(model="llama", prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})

    async def main():
        async with client(live) as c:
            a = await c.completions.create(**kw)
            b = await c.completions.create(**kw)
            texts, finish, _ = await _stream_completion(c, **kw)
            chat = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, n=2, temperature=1.0, seed=5)
        assert [ch.index for ch in a.choices] == [0, 1]
        assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeds make it reproducible
        assert texts == {0: a.choices[0].text, 1: a.choices[1].text}
        assert finish == {0: "length", 1: "length"}
        assert a.usage.completion_tokens == 16
        assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens <= 8
    run(main())


def test_best_of_keeps_the_likeliest_samples(live):
    """best_of: best_of sequences sampled (seeded: sequence i with seed + i, as n's), the n with the highest
    cumulative logprob returned, likeliest first; usage counts every sampled token."""
    kw = dict(model="llama", prompt=[PROMPT, "Hello"], max_tokens=6, temperature=1.0, seed=77,
              extra_body={"ignore_eos": True})

    async def main():
        async with client(live) as c:
            every = await c.completions.create(n=4, logprobs=0, **kw)
            best = await c.completions.create(n=2, **{**kw, "extra_body": {"ignore_eos": True, "best_of": 4}})
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(n=2, stream=True, **{**kw, "extra_body": {"best_of": 3}})
            assert e.value.body["param"] == "best_of"
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(n=3, **{**kw, "extra_body": {"best_of": 2}})
            assert e.value.body["param"] == "best_of"
        return every, best

    every, best = run(main())
    want = []
    for prompt in range(2):
        group = every.choices[4 * prompt:4 * prompt + 4]
        scored = sorted(group, key=lambda ch: -sum(ch.logprobs.token_logprobs))
        assert len({sum(ch.logprobs.token_logprobs) for ch in group}) > 1  # (a choice to make)
        want += [ch.text for ch in scored[:2]]
    assert [ch.text for ch in best.choices] == want
    assert [ch.index for ch in best.choices] == [0, 1, 2, 3]
    assert all(ch.logprobs is None for ch in best.choices)  # scored inside, not asked for
    assert best.usage.completion_tokens == every.usage.completion_tokens == 2 * 4 * 6


def test_echo_with_max_tokens_0_scores_the_prompt_only(live):
    """OpenAI's legacy scoring call: echo + max_tokens 0 returns the prompt and its logprobs, nothing generated."""
    kw = dict(model="llama", prompt=PROMPT, echo=True, logprobs=1)

    async def main():
        async with client(live) as c:
            one = await c.completions.create(max_tokens=1, temperature=0.0, **kw)
            zero = await c.completions.create(max_tokens=0, **kw)
            texts, finish, chunks = await _stream_completion(c, max_tokens=0, **kw)
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="llama", prompt=PROMPT, max_tokens=0)
            assert e.value.body["param"] == "max_tokens"
        return one, zero, texts, finish, chunks

    one, zero, texts, finish, chunks = run(main())
    choice = zero.choices[0]
    assert choice.text == PROMPT == texts[0] and choice.finish_reason == "length" == finish[0]
    assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:-1]
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:-1]
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == one.usage.prompt_tokens
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs if ch.choices and
                                             ch.choices[0].logprobs else [])]
    assert streamed == choice.logprobs.token_logprobs


def _stop_in(text: str) -> str:
    """A stop string from the middle of a greedy output: two characters, no replacement character."""
    for i in range(4, len(text) - 2):
        s = text[i:i + 2]
        if "\ufffd" not in s and s.strip():
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(live):
    async def main():
        async with client(live) as c:
            base = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=24, **GREEDY)
            text = base.choices[0].text
            stop = _stop_in(text)
            cut = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=24, stop=[stop, "\x00zz"],
                                             **GREEDY)
            texts, finish, chunks = await _stream_completion(c, model="llama", prompt=PROMPT, max_tokens=24,
                                                             stop=stop, **GREEDY)
            chat_base = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=24, **GREEDY)
            chat_stop = _stop_in(chat_base.choices[0].message.content)
            chat_cut = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=24, stop=chat_stop, **GREEDY)
        expected = text[:text.index(stop)]
        assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].model_extra["stop_reason"] == stop
        assert texts[0] == expected and finish[0] == "stop"
        chat_text = chat_base.choices[0].message.content
        assert chat_cut.choices[0].message.content == chat_text[:chat_text.index(chat_stop)]
        assert chat_cut.choices[0].finish_reason == "stop"
    run(main())


def test_logit_bias_and_allowed_token_ids(live):
    async def main():
        async with client(live) as c, httpx.AsyncClient(base_url=live.base_url.removesuffix("/v1")) as http:
            x = (await http.post("/tokenize", json={"prompt": "x", "add_special_tokens": False})).json()["tokens"]
            assert len(x) == 1
            forced = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=5,
                                                logit_bias={str(x[0]): 100}, **GREEDY)
            # Sampling at temperature 1, but only one token is allowed.
            only = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=1.0,
                                                   extra_body={"allowed_token_ids": x, "ignore_eos": True})
            base = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, **GREEDY)
            banned = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, **GREEDY,
                                                logit_bias={str(t): -100 for t in (await http.post(
                                                    "/tokenize", json={"prompt": base.choices[0].text,
                                                                       "add_special_tokens": False})).json()["tokens"]})
        assert forced.choices[0].text == "xxxxx"
        assert only.choices[0].message.content == "xxxx"
        assert banned.choices[0].text != base.choices[0].text
    run(main())


def test_bad_words(live):
    """vLLM's bad_words: the greedy output changes where it would have completed the word, and never holds it
    (with async scheduling too: the next step waits for the token its bans depend on)."""
    from streamer.worker.sampler import bad_words_token_ids
    tok = live.engine.tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    kw = dict(model="llama", prompt=PROMPT, max_tokens=24, **{**GREEDY, "extra_body": {"ignore_eos": True,
                                                                                       "return_token_ids": True}})

    async def main():
        async with client(live) as c:
            base = (await c.completions.create(**kw)).choices[0].model_extra["token_ids"]
            word = next(w for i in range(2, len(base) - 1) for w in [tok.decode(base[i:i + 2])]
                        if w.strip() and base[i:i + 2] in bad_words_token_ids([w], encode))
            out = await c.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "bad_words": [word]}})
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(**{**kw, "extra_body": {"bad_words": "word"}})
            assert e.value.body["param"] == "bad_words"
        return base, word, out.choices[0].model_extra["token_ids"]

    base, word, out = run(main())
    seqs = bad_words_token_ids([word], encode)
    ends = [i for i in range(len(base)) for s in seqs if i + 1 >= len(s) and base[i + 1 - len(s):i + 1] == s]
    assert out[:min(ends)] == base[:min(ends)] and out[min(ends)] != base[min(ends)]
    assert not any(out[i:i + len(s)] == s for s in seqs for i in range(len(out)))


def test_echo_with_logprobs_scores_the_prompt(live, llama_dir):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 1; the prompt's logprobs are transformers'."""
    import torch
    import transformers

    ids = [5, 17, 33, 9, 100, 44, 45, 46, 47, 48]

    async def main():
        async with client(live) as c:
            full = await c.completions.create(model="llama", prompt=ids, max_tokens=1, echo=True, logprobs=2,
                                              **GREEDY)
            texts, _, chunks = await _stream_completion(c, model="llama", prompt=ids, max_tokens=1, echo=True,
                                                         logprobs=2, **GREEDY)
            plain = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0,
                                               **GREEDY)
            # vLLM's field, without echo: a list beside the choice, streamed with the first chunk.
            vllm_style = await c.completions.create(model="llama", prompt=ids, max_tokens=2, temperature=0.0,
                                                    extra_body={"prompt_logprobs": 1, "ignore_eos": True})
            _, _, vllm_chunks = await _stream_completion(c, model="llama", prompt=ids, max_tokens=2, temperature=0.0,
                                                         extra_body={"prompt_logprobs": 1, "ignore_eos": True})
            chat = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, extra_body={"prompt_logprobs": 0})
        return full, texts, chunks, plain, vllm_style, vllm_chunks, chat

    full, texts, chunks, plain, vllm_style, vllm_chunks, chat = run(main())
    # Chat: vLLM's top-level list, one entry per token of the rendered prompt.
    chat_pl = chat.model_extra["prompt_logprobs"]
    assert chat_pl[0] is None and len(chat_pl) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_pl[1:])
    pl = vllm_style.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    scores = [pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    assert scores == full.choices[0].logprobs.token_logprobs[1:len(ids)]
    streamed_pl = [ch.choices[0].model_extra.get("prompt_logprobs") for ch in vllm_chunks if ch.choices]
    assert [x for x in streamed_pl if x is not None] == [pl]
    lp = full.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i - 1, ids[i]].item()) < 1e-4
        assert len(lp.top_logprobs[i]) >= 2 and lp.tokens[i] in lp.top_logprobs[i]
    assert "".join(lp.tokens) == full.choices[0].text and lp.text_offset[1] == len(lp.tokens[0])
    # Streamed: the same text and the same logprobs, the prompt's in the first chunk.
    assert texts[0] == full.choices[0].text
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs if ch.choices and
                                             ch.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
    # A text prompt: its tokens (the BOS the tokenizer added among them) come back, a logprob each but the first.
    plp = plain.choices[0].logprobs
    assert plain.choices[0].text.startswith(PROMPT) and "".join(plp.tokens).endswith(plain.choices[0].text)
    assert plp.tokens[0] == "<|begin_of_text|>"
    assert plp.token_logprobs[0] is None and all(x is not None for x in plp.token_logprobs[1:])


def test_tools_with_the_parser_on(live):
    """With --tool-call-parser hermes and `tools` in the request, output without tags is still plain content
    (this random model writes none; tests/test_server_tool_calls.py feeds the parser real calls)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    server = live.app.state.server
    server.tool_call_parser = "hermes"

    async def main():
        async with client(live) as c:
            with_tools = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                                         tools=tools, max_tokens=8, **GREEDY)
            without = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=8, **GREEDY)
            # tool_choice null is the default ("auto"), not an error.
            null_choice = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                                          tools=tools, max_tokens=2, temperature=0.0,
                                                          extra_body={"tool_choice": None})
            assert null_choice.choices[0].finish_reason in ("stop", "length")
        return with_tools, without

    try:
        with_tools, without = run(main())
    finally:
        server.tool_call_parser = None
    msg = with_tools.choices[0].message
    assert isinstance(msg.content, str) and not msg.tool_calls
    assert with_tools.choices[0].finish_reason in ("stop", "length")
    assert without.choices[0].message.content  # the plain path is untouched


def test_logprobs(live):
    async def main():
        async with client(live) as c:
            comp = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
            _, _, chunks = await _stream_completion(c, model="llama", prompt=PROMPT, max_tokens=6, logprobs=3,
                                                    **GREEDY)
            chat = await c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
        lp = comp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
        assert "".join(lp.tokens) == comp.choices[0].text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
        for val, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert 1 <= len(top) <= 4 and val <= 0
            assert val == pytest.approx(max(top.values()))  # greedy: the sampled token is the best one
        streamed = [t for ch in chunks for c_ in ch.choices if c_.logprobs for t in c_.logprobs.tokens]
        assert streamed == lp.tokens
        content = chat.choices[0].logprobs.content
        assert len(content) == 6
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.bytes == list(entry.token.encode())
        assert "".join(e.token for e in content) == chat.choices[0].message.content
    run(main())


def test_return_tokens_as_token_ids(live):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:{id}", the same ids as the output's
    and in the same order, values unchanged; the echoed prompt's tokens too."""
    ids_too = {"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True}
    kw = dict(model="llama", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0.0)

    msgs = [{"role": "user", "content": "hi"}]

    async def main():
        async with client(live) as c, httpx.AsyncClient(base_url=live.url, timeout=60) as h:
            plain = await c.completions.create(**kw)
            named = await c.completions.create(**kw, echo=True, extra_body=ids_too)
            _, _, chunks = await _stream_completion(c, **{**kw, "prompt": [PROMPT, "Hello"]}, extra_body=ids_too)
            chat = await c.chat.completions.create(model="llama", messages=msgs, max_tokens=6, logprobs=True,
                                                   top_logprobs=2, temperature=0.0, extra_body=ids_too)
            chat_chunks = [ch async for ch in await c.chat.completions.create(
                model="llama", messages=msgs, max_tokens=2, stream=True, extra_body={"return_token_ids": True})]
            tokenized = [(await h.post("/tokenize", json=body)).json()["tokens"] for body in (
                {"prompt": PROMPT}, {"prompt": "Hello"}, {"messages": msgs})]
        return plain, named, chunks, chat, chat_chunks, tokenized

    plain, named, chunks, chat, chat_chunks, tokenized = run(main())
    lp, choice = named.choices[0].logprobs, named.choices[0]
    prompt_ids, out_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    # return_token_ids: the prompt's ids as vLLM returns them; streamed, once per choice, in its first chunk.
    assert prompt_ids == tokenized[0]
    sent = [(c_.index, c_.model_extra["prompt_token_ids"]) for ch in chunks for c_ in ch.choices
            if c_.model_extra.get("prompt_token_ids") is not None]
    assert sorted(sent) == [(0, tokenized[0]), (1, tokenized[1])]
    assert chat.model_extra["prompt_token_ids"] == tokenized[2]
    assert [ch.model_extra.get("prompt_token_ids") for ch in chat_chunks][:2] == [tokenized[2], None]
    assert lp.tokens == [f"token_id:{t}" for t in prompt_ids + out_ids]
    assert lp.token_logprobs[len(prompt_ids):] == plain.choices[0].logprobs.token_logprobs
    for tid, top in zip(out_ids, lp.top_logprobs[len(prompt_ids):]):
        assert f"token_id:{tid}" in top and all(k.startswith("token_id:") for k in top)
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(e.top_logprobs[0].token.startswith("token_id:") and e.bytes == list(e.token.encode())
               for e in content)


def test_concurrent_streams_match_offline_greedy(live, llama_dir):
    prompts = [f"Client {i} says: the number {i * 7} is" for i in range(32)]
    offline = LLM(str(llama_dir), **ENGINE_KWARGS).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))

    async def one(c: AsyncOpenAI, prompt: str) -> tuple[list[int], str]:
        ids: list[int] = []
        text = ""
        async for chunk in await c.completions.create(model="llama", prompt=prompt, max_tokens=12, stream=True,
                                                      temperature=0.0,
                                                      extra_body={"ignore_eos": True, "return_token_ids": True}):
            for ch in chunk.choices:
                ids += ch.model_extra["token_ids"]
                text += ch.text
        return ids, text

    async def main():
        async with client(live) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    results = run(main())
    for (ids, text), ref in zip(results, offline):
        assert ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
    live.wait_idle()
    # The async-scheduling server really overlapped steps (the default one, on CPU, never does).
    assert (live.engine.num_overlapped_steps > 0) == bool(live.engine_kwargs.get("async_scheduling"))


def test_prompt_forms_echo_and_tokenize(live):
    async def main():
        async with client(live) as c, httpx.AsyncClient(base_url=live.url, timeout=60) as h:
            tok = (await h.post("/tokenize", json={"model": "llama", "prompt": PROMPT})).json()
            assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == live.engine.max_model_len
            detok = (await h.post("/detokenize", json={"model": "llama", "tokens": tok["tokens"]})).json()
            assert detok["prompt"].endswith(PROMPT)
            by_text = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, **GREEDY)
            by_ids = await c.completions.create(model="llama", prompt=tok["tokens"], max_tokens=5, **GREEDY)
            assert by_ids.choices[0].text == by_text.choices[0].text
            assert by_text.usage.prompt_tokens == tok["count"]
            many = await c.completions.create(model="llama", prompt=[PROMPT, "Hello"], max_tokens=3, n=2,
                                              temperature=0.0)
            assert [ch.index for ch in many.choices] == [0, 1, 2, 3]
            assert many.choices[0].text == many.choices[1].text == by_text.choices[0].text[:len(many.choices[0].text)]
            batch = await c.completions.create(model="llama", prompt=[tok["tokens"], tok["tokens"][:5]], max_tokens=3,
                                               temperature=0.0)
            assert len(batch.choices) == 2
            echo = await c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, echo=True, **GREEDY)
            assert echo.choices[0].text == PROMPT + by_text.choices[0].text
            msgs = [{"role": "user", "content": "hi"}]
            chat_tok = (await h.post("/tokenize", json={"model": "llama", "messages": msgs})).json()
            chat = await c.chat.completions.create(model="llama", messages=msgs, max_tokens=2)
            assert chat.usage.prompt_tokens == chat_tok["count"]
    run(main())


def test_reasoning_effort_and_tokenize_render_as_chat(live):
    """reasoning_effort (chat) and reasoning.effort (Responses) reach the template as gpt-oss's reads them;
    /tokenize renders messages with chat's fields and returns vocabulary strings when asked."""
    from streamer.server.chat_template import ChatTemplate
    server = live.app.state.server
    source = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
              "{% if tools %}tools: {{ tools | length }}\n{% endif %}"
              "effort {{ reasoning_effort | default('medium') }}\n{% if add_generation_prompt %}assistant:{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    async def main():
        async with client(live) as c, httpx.AsyncClient(base_url=live.url, timeout=60) as h:
            async def count(**kw) -> dict:
                r = await h.post("/tokenize", json={"model": "llama", "messages": msgs, **kw})
                assert r.status_code == 200, r.text
                return r.json()
            base, high, kwargs_win, tools = (await count(), await count(reasoning_effort="high"),
                                             await count(reasoning_effort="high",
                                                         chat_template_kwargs={"reasoning_effort": "low"}),
                                             await count(tools=[tool], return_token_strs=True))
            bad = await h.post("/tokenize", json={"model": "llama", "messages": msgs, "reasoning_effort": "max"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
            chat = await c.chat.completions.create(model="llama", messages=msgs, max_tokens=1,
                                                   reasoning_effort="high")
            resp = await c.responses.create(model="llama", input="hi", max_output_tokens=1,
                                            reasoning={"effort": "high"})
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(model="llama", input="hi", reasoning={"effort": "max"})
            assert e.value.body["param"] == "reasoning.effort"
        return base, high, kwargs_win, tools, chat, resp

    old = server.chat_template
    server.chat_template = ChatTemplate(source, {})
    try:
        base, high, kwargs_win, tools, chat, resp = run(main())
    finally:
        server.chat_template = old
    tok = live.engine.tokenizer
    assert tok.decode(base["tokens"]) == "user: hi\neffort medium\nassistant:"
    assert tok.decode(high["tokens"]) == "user: hi\neffort high\nassistant:"
    assert tok.decode(kwargs_win["tokens"]) == "user: hi\neffort low\nassistant:"
    assert tok.decode(tools["tokens"]) == "user: hi\ntools: 1\neffort medium\nassistant:"
    assert tools["token_strs"] == [tok.id_to_token(t) for t in tools["tokens"]]
    assert chat.usage.prompt_tokens == high["count"] == resp.usage.input_tokens
    assert resp.reasoning.effort == "high"


def test_request_logging(live, caplog):
    """--enable-log-requests: each request's prompt (cut to --max-log-len) and parameters, in one line per prompt;
    off by default."""
    import logging

    from streamer.cli import build_parser
    args = build_parser().parse_args(["serve", "--enable-log-requests", "--max-log-len", "10"])
    assert args.enable_log_requests and args.max_log_len == 10
    server = live.app.state.server
    assert not server.log_requests

    def send(body: dict, path: str = "/v1/completions") -> None:
        assert httpx.post(live.url + path, json={"model": "llama", "max_tokens": 3, **body}, timeout=60).is_success

    with caplog.at_level(logging.INFO, logger="streamer.server"):
        send({"prompt": PROMPT})
        assert not [r for r in caplog.records if "received" in r.getMessage()]
        server.log_requests, server.max_log_len = True, 10
        try:
            send({"prompt": PROMPT, "temperature": 0.5})
            send({"prompt": [list(range(5, 30)), [7, 8]]})
            send({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
        finally:
            server.log_requests, server.max_log_len = False, None
    lines = [r.getMessage() for r in caplog.records if "received" in r.getMessage()]
    assert len(lines) == 4
    assert f"prompt: {PROMPT[:10]!r}," in lines[0] and "temperature=0.5" in lines[0] and "max_tokens=3" in lines[0]
    assert "(prompt 0)" in lines[1] and f"prompt_token_ids: {list(range(5, 15))}," in lines[1]
    assert "(prompt 1)" in lines[2] and "prompt_token_ids: [7, 8]," in lines[2]
    assert lines[3].startswith("request chatcmpl-") and "prompt_token_ids: [" in lines[3]


def test_sagemaker_ping_and_invocations(live):
    """/ping is the health check; /invocations answers as the endpoint the body's shape names."""
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0}
    cmpl_body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    with httpx.Client(base_url=live.url, timeout=60) as h:
        assert h.get("/ping").status_code == 200 and h.post("/ping").status_code == 200
        for body, path in ((chat_body, "/v1/chat/completions"), (cmpl_body, "/v1/completions")):
            via, direct = h.post("/invocations", json=body).json(), h.post(path, json=body).json()
            assert via["object"] == direct["object"] and via["choices"] == direct["choices"]
        emb = h.post("/invocations", json={"input": "hello"}).json()
        assert emb["data"][0]["embedding"] == h.post("/v1/embeddings", json={"input": "hello"}).json()[
            "data"][0]["embedding"]
        streamed = h.post("/invocations", json={**cmpl_body, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream") and "[DONE]" in streamed.text
        bad = h.post("/invocations", json={"max_tokens": 3})
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
        bad = h.post("/invocations", json={"prompt": PROMPT, "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_health_and_metrics(live):
    with httpx.Client(base_url=live.url, timeout=30) as h:
        assert h.get("/health").status_code == 200
        r = h.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "vllm:num_requests_running" in r.text and "vllm:kv_cache_usage_perc" in r.text
        live.wait_idle()
        text = h.get("/metrics").text
        assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0
        before = _families(text)
        c = httpx.post(live.base_url + "/completions", timeout=60,
                       json={"model": "llama", "prompt": PROMPT, "max_tokens": 5, "n": 2, "ignore_eos": True})
        assert c.status_code == 200
        live.wait_idle()
        after = _families(h.get("/metrics").text)
    # The reference parser reads every family; every sample carries model_name, as vLLM's dashboards select it.
    hist = {name for name, f in after.items() if f.type == "histogram"}
    assert {"vllm:e2e_request_latency_seconds", "vllm:request_prefill_time_seconds", "vllm:iteration_tokens_total",
            "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_params_n",
            "vllm:request_params_max_tokens", "vllm:time_to_first_token_seconds"} <= hist
    for name in hist:
        assert all(s.labels.get("model_name") == "llama" for s in after[name].samples), name

    def grew(name: str, suffix: str = "_count") -> float:
        def total(fams):
            return sum(s.value for s in fams[name].samples if s.name == name + suffix) if name in fams else 0.0
        return total(after) - total(before)

    # One request, n = 2: two sequences finish, the request's parameters are counted once.
    assert grew("vllm:e2e_request_latency_seconds") == grew("vllm:request_decode_time_seconds") == 2
    assert grew("vllm:request_params_n") == 1 and grew("vllm:request_params_n", "_sum") == 2
    assert grew("vllm:request_params_max_tokens", "_sum") == 5
    assert grew("vllm:iteration_tokens_total") >= 5 and grew("vllm:request_generation_tokens", "_sum") == 10


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_stream_interval_chunks_carry_several_tokens(llama_dir):
    """`--stream-interval 3`: after the first, a streamed choice's chunks carry 3 tokens (their text and logprobs
    too), and together they are what the non-streamed response holds; with n=2 both choices finish."""
    async def main(live):
        c = client(live)
        kw = dict(model="llama", prompt=PROMPT, max_tokens=10, logprobs=1, **GREEDY)
        whole = await c.completions.create(**kw)
        chunks = [ch async for ch in await c.completions.create(stream=True, **kw)]
        pieces = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].logprobs is not None
                  and ch.choices[0].logprobs.tokens]
        sizes = [len(p.logprobs.tokens) for p in pieces]  # (a consumer that fell behind may merge chunks)
        assert sizes[0] == 1 and all(n % 3 == 0 for n in sizes[1:]) and sum(sizes) == 10 and len(sizes) > 2
        assert "".join(p.text for p in pieces) == whole.choices[0].text
        assert sum((p.logprobs.token_logprobs for p in pieces), []) == whole.choices[0].logprobs.token_logprobs
        texts, finish, _ = await _stream_completion(c, model="llama", prompt=PROMPT, max_tokens=7, n=2,
                                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
        assert set(finish) == {0, 1} and all(f == "length" for f in finish.values())

    with LiveServer(llama_dir, stream_interval=3) as live:
        run(main(live))


def test_several_served_model_names(llama_dir):
    """`--served-model-name a b`: /v1/models lists both, requests may name either, responses report the first."""
    with LiveServer(llama_dir, served_model_name=["first", "second"]) as server:
        async def main():
            async with AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
                assert [m.id for m in (await c.models.list()).data] == ["first", "second"]
                for name in ("first", "second"):
                    r = await c.completions.create(model=name, prompt=PROMPT, max_tokens=2, **GREEDY)
                    assert r.model == "first"
                with pytest.raises(openai.NotFoundError):
                    await c.completions.create(model="third", prompt=PROMPT, max_tokens=2)
        run(main())
