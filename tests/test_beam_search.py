"""Beam search (LLM.beam_search) returns transformers' beams: the same token sequences, best first, with the same
scores (cumulative log-probability / length ** length_penalty), for several widths."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.engine.beam_search import BeamSearchParams  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, [7]]


@pytest.fixture(scope="module")
def hf(llama_dir):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("width", [1, 3, 5])
def test_beams_equal_transformers(llama_dir, hf, width):
    n = 6
    with LLM(str(llama_dir), dtype="float32", block_size=4) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(width, n, ignore_eos=True))
        for p, out in zip(PROMPTS, outs):
            ids = torch.tensor([p])
            with torch.no_grad():
                g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                                max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                output_scores=True, return_dict_in_generate=True)
            assert [s.token_ids for s in out.sequences] == [s[len(p):].tolist() for s in g.sequences]
            if width > 1:
                got = [s.score(1.0) for s in out.sequences]
                assert got == pytest.approx(g.sequences_scores.tolist(), abs=1e-4)
            assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].token_ids)
        assert llm.engine.kv.prefix_hits > 0  # each step reuses the beams' cached prefixes
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_finished_beams_and_bad_params(llama_dir):
    with LLM(str(llama_dir), dtype="float32") as llm:
        eos = sorted(llm.engine.eos_token_ids)
        out = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(4, 12, length_penalty=0.5))[0]
        assert len(out.sequences) == 4
        scores = [s.score(0.5) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:  # an eos ends a beam; no other beam holds one
            assert s.finished == (s.token_ids[-1] in eos) and not set(s.token_ids[:-1]) & set(eos)
    with pytest.raises(ValueError, match="beam_width must be an integer in \\[1, 10\\]"):
        BeamSearchParams(11, 4)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        BeamSearchParams(2, 0)


def test_async_engine_and_server_beam_search(llama_dir, hf):
    """AsyncEngine.beam_search (each step's beams as concurrent requests) and vLLM's `use_beam_search` on
    /v1/completions (n beams become n choices) give the offline search's beams."""
    import asyncio

    import httpx

    from streamer import AsyncEngine
    from tests.server_utils import LiveServer
    params = BeamSearchParams(3, 5, ignore_eos=True)
    with LLM(str(llama_dir), dtype="float32") as llm:
        want = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)

    async def run_async() -> None:
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            got = await asyncio.gather(*(engine.beam_search({"prompt_token_ids": p}, params) for p in PROMPTS[:2]))
            assert [[s.token_ids for s in o.sequences] for o in got] == \
                [[s.token_ids for s in o.sequences] for o in want]
    asyncio.run(run_async())

    with LiveServer(llama_dir) as live:
        async def run_server() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                r = await http.post("/v1/completions", json={"prompt": PROMPTS[:2], "use_beam_search": True, "n": 3,
                                                             "max_tokens": 5, "ignore_eos": True})
                assert r.status_code == 200, r.text
                body = r.json()
                assert [c["text"] for c in body["choices"]] == [s.text for o in want for s in o.sequences]
                assert all(c["finish_reason"] == "length" for c in body["choices"])
                assert body["usage"]["completion_tokens"] == 6 * 5
                for extra, param in (({"stream": True}, "stream"), ({"n": 11}, "n"), ({"logprobs": 2}, "logprobs"),
                                      ({"logprobs": 0}, "logprobs"),
                                      ({"thinking_token_budget": 0}, "thinking_token_budget")):
                    r = await http.post("/v1/completions", json={"prompt": "x", "use_beam_search": True, "n": 2,
                                                                 "max_tokens": 3, **extra})
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                # Chat: the rendered conversation's beams, as chat answers.
                msgs = [{"role": "user", "content": "hello"}]
                ids = (await http.post("/tokenize", json={"messages": msgs})).json()["tokens"]
                r = await http.post("/v1/chat/completions", json={"messages": msgs, "use_beam_search": True, "n": 2,
                                                                  "max_tokens": 4, "ignore_eos": True,
                                                                  "return_token_ids": True})
                assert r.status_code == 200, r.text
                body = r.json()
                chat_want = await asyncio.to_thread(
                    lambda: LLM(str(llama_dir), dtype="float32").beam_search(
                        [{"prompt_token_ids": ids}], BeamSearchParams(2, 4, ignore_eos=True))[0].sequences)
                assert [c["message"]["content"] for c in body["choices"]] == [s.text for s in chat_want]
                assert [c["token_ids"] for c in body["choices"]] == [s.token_ids for s in chat_want]
                assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(ids)
                assert body["usage"]["completion_tokens"] == 8 and [c["index"] for c in body["choices"]] == [0, 1]
                r = await http.post("/v1/chat/completions", json={"messages": msgs, "use_beam_search": True,
                                                                  "stream": True})
                assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        asyncio.run(run_server())


@pytest.mark.parametrize("penalty", [1e30, 3.4e38, 1000.0, 1.0, 0.0, -1.0, -1000.0, -1e30, -3.4e38])
def test_scores_never_raise_and_rank_exactly(penalty):
    """cum_logprob / length ** length_penalty where length ** length_penalty leaves float range (a huge penalty:
    OverflowError; a huge negative one: 0.0, ZeroDivisionError): scores saturate (-inf, -0.0), and ranking
    follows the exact scores (compared in log space)."""
    import math
    from fractions import Fraction

    from streamer.engine.beam_search import BeamSequence
    beams = [BeamSequence([1] * n, c) for n, c in ((1, -0.5), (5, -3.0), (7, -2.0), (3, 0.0), (9, -math.inf),
                                                   (2, -1e-300), (4, -7.0))]
    scores = [b.score(penalty) for b in beams]
    assert all(s <= 0 for s in scores)

    def log_exact(b):  # log |score| (cum_logprob < 0), which no penalty overflows
        return math.log(-b.cum_logprob) - penalty * math.log(max(len(b.token_ids), 1))
    ranked = sorted(beams, key=lambda b: b.rank(penalty), reverse=True)
    assert ranked[0].cum_logprob == 0.0 and ranked[-1].cum_logprob == -math.inf
    rest = ranked[1:-1]
    assert [log_exact(b) for b in rest] == sorted(log_exact(b) for b in rest)
    if abs(penalty) <= 1:  # in range: the plain quotient, ranked as before
        assert scores == [float(Fraction(b.cum_logprob) / Fraction(max(len(b.token_ids), 1)) ** int(penalty))
                          if b.cum_logprob not in (0.0, -math.inf) else b.cum_logprob for b in beams]


def test_length_penalty_must_be_finite():
    import math
    for bad in (math.nan, math.inf, -math.inf, True, "1", None):
        with pytest.raises(ValueError, match="length_penalty must be a finite number"):
            BeamSearchParams(2, 4, length_penalty=bad)
    assert BeamSearchParams(2, 4, length_penalty=-1e300).length_penalty == -1e300
