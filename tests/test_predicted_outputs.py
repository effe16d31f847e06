"""OpenAI's Predicted Outputs (`prediction` on chat): with n-gram speculative decoding on, the prediction's tokens are
drafted where the output lines up with them. Outputs stay exactly the model's (greedy: the same tokens, with or
without a prediction, right or edited), while a good prediction cuts the steps; usage reports the prediction's
tokens accepted and rejected. On the embedded demo model, whose greedy Python is clean text."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

from streamer import LLM, SamplingParams
from streamer.demo_model import default_model_path
from streamer.spec_decode.ngram import propose_predicted
from tests.server_utils import LiveServer

PROMPT = "import os\n\ndef list_files(path):\n"


def test_drafts_follow_the_prediction_in_order():
    pred = np.array([5, 6, 7, 8, 5, 6, 9, 10], dtype=np.int32)
    assert propose_predicted(pred, np.zeros(0, np.int32), 3, 1, 3, 0) == ([5, 6, 7], 0)
    assert propose_predicted(pred, np.array([1, 5, 6]), 2, 1, 3, 0) == ([7, 8], 2)
    # "5 6" occurs twice: the first place at or after the cursor wins (the text is read in order)
    assert propose_predicted(pred, np.array([8, 5, 6]), 2, 1, 3, 4) == ([9, 10], 6)
    assert propose_predicted(pred, np.array([5, 6]), 2, 2, 2, 5) == ([9, 10], 6)  # (past the cursor: the last)
    assert propose_predicted(pred, np.array([3, 4]), 2, 1, 3, 2) == ([], 2)  # nothing lines up
    assert propose_predicted(pred, np.array([9, 10]), 2, 1, 3, 0) == ([], 0)  # at its end: nothing follows


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_path()), num_kv_blocks=512, num_speculative_tokens=4)


def test_same_tokens_fewer_steps(llm):
    p = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    e = llm.engine
    steps = e.num_steps
    free = llm.generate([PROMPT], p)[0].outputs[0]
    plain_steps, steps = e.num_steps - steps, e.num_steps
    assert "\ufffd" not in free.text and len(free.token_ids) == 96
    right = llm.generate([PROMPT], p.clone(prediction=free.text))[0].outputs[0]
    right_steps, steps = e.num_steps - steps, e.num_steps
    edited = free.text[:50] + "    value = compute(path)\n" + free.text[50:]
    with_edit = llm.generate([PROMPT], p.clone(prediction=edited))[0].outputs[0]
    edited_steps, steps = e.num_steps - steps, e.num_steps
    wrong = llm.generate([PROMPT], p.clone(prediction="SELECT * FROM users WHERE id = 1;"))[0].outputs[0]
    assert right.token_ids == with_edit.token_ids == wrong.token_ids == free.token_ids
    # A right prediction drafts k tokens nearly every step (5 a step at most); an edit costs a few steps more.
    assert right_steps <= 96 / 3.5 < plain_steps and edited_steps <= right_steps + 6
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.seqs


def test_server_usage_and_errors():
    with LiveServer(default_model_path(), num_speculative_tokens=4) as live:
        async def main():
            async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=60) as c:
                msgs = [{"role": "user", "content": "write a function"}]
                kw = dict(model=live.model_name, messages=msgs, max_tokens=48, temperature=0.0,
                          extra_body={"ignore_eos": True})
                free = await c.chat.completions.create(**kw)
                text = free.choices[0].message.content
                pred = await c.chat.completions.create(**kw, prediction={"type": "content", "content": text})
                parts = await c.chat.completions.create(**kw, prediction={"type": "content", "content": [
                    {"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]})
                return free, pred, parts

        free, pred, parts = asyncio.run(main())
        assert pred.choices[0].message.content == free.choices[0].message.content
        d = pred.usage.completion_tokens_details
        assert d.accepted_prediction_tokens >= 44 and d == parts.usage.completion_tokens_details  # (47 after the first)
        n_pred = len(live.call(lambda: live.engine.engine.tokenizer.encode(
            free.choices[0].message.content, add_special_tokens=False)))
        assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == n_pred
        assert free.usage.completion_tokens_details is None
        for bad in ("text", {"type": "content"}, {"type": "content", "content": [{"type": "image"}]}):
            r = httpx.post(live.base_url + "/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "prediction": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
        state = live.pool_state()
        assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == 0
