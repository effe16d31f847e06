"""Embeddings: pooled final hidden states equal transformers' (`AutoModel(...).last_hidden_state`) for every
pooling, through chunked prefill, prefix-cache hits, preemption and batches shared with generating requests;
/v1/embeddings answers the real openai client."""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM, AsyncEngine, PoolingParams, SamplingParams  # noqa: E402
from streamer.engine.pooling import default_pooling  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, [7, 8], list(range(60, 100)), [3]]


@pytest.fixture(scope="module")
def reference(llama_dir):
    import transformers as tf
    model = tf.AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()

    def embed(prompt: list[int], pooling: str, normalize: bool = True, dimensions=None) -> np.ndarray:
        with torch.no_grad():
            h = model(torch.tensor([prompt])).last_hidden_state[0].double()
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling][:dimensions]
        return (v / v.norm() if normalize else v).numpy()
    return embed


def _close(got, want) -> bool:
    return np.allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooling_matches_transformers_through_chunks(llama_dir, reference, pooling):
    # A 16-token budget splits the long prompts over steps: mean pooling sums the chunks.
    with LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=16, block_size=4) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling=pooling))
        for out, p in zip(outs, PROMPTS):
            assert out.prompt_token_ids == p and len(out.embedding) == 64
            assert _close(out.embedding, reference(p, pooling)), pooling
        raw = llm.embed({"prompt_token_ids": PROMPTS[3]}, PoolingParams(pooling=pooling, normalize=False,
                                                                          dimensions=10))[0]
        assert _close(raw.embedding, reference(PROMPTS[3], pooling, False, 10))
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_embeddings_share_batches_with_generation_and_survive_preemption(llama_dir, reference):
    from tests.checkpoints import hf_greedy
    want_tokens = hf_greedy(llama_dir, PROMPTS[:2], 8)
    # A small pool preempts; prefix-cache hits serve the repeated "last"-pooled prompts.
    with LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=24, block_size=4, num_kv_blocks=20) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        gen = [engine.add_request(f"g{i}", {"prompt_token_ids": p}, params)[0] for i, p in enumerate(PROMPTS[:2])]
        emb = [engine.add_request(f"e{k}-{i}", {"prompt_token_ids": p}, SamplingParams(),
                                  pooling=PoolingParams(pooling=m))[0]
               for k, m in enumerate(("mean", "last", "last")) for i, p in enumerate(PROMPTS)]
        while engine.has_unfinished():
            engine.step()
        assert [s.req.output_token_ids for s in gen] == want_tokens
        for s in emb:
            assert s.req.output_token_ids == [] and s.req.finish_reason == "stop"
            assert _close(s.embedding, reference(s.req.prompt_token_ids, s.req.pooling.pooling))
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.prefix_hits > 0
        assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_bad_input_and_defaults(llama_dir, tmp_path):
    with LLM(str(llama_dir), dtype="float32", max_model_len=64) as llm:
        with pytest.raises(ValueError, match="dimensions .* exceeds the model's embedding size 64"):
            llm.embed("hi", PoolingParams(dimensions=65))
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.embed({"prompt_token_ids": [5] * 65})
        assert len(llm.embed({"prompt_token_ids": [5] * 64})[0].embedding) == 64  # the whole context may pool
        with pytest.raises(ValueError, match="pooling must be one of"):
            PoolingParams(pooling="max")
        with pytest.raises(ValueError, match="dimensions must be a positive integer"):
            PoolingParams(dimensions=0)
    assert default_pooling(tmp_path) == "last"
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert default_pooling(tmp_path) == "mean"


def test_async_engine_embed(llama_dir, reference):
    async def main() -> None:
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            outs = await asyncio.gather(*(engine.embed({"prompt_token_ids": p}) for p in PROMPTS))
            for out, p in zip(outs, PROMPTS):
                assert _close(out.embedding, reference(p, "last"))
    asyncio.run(main())


def test_openai_client_embeddings(llama_dir, reference):
    import openai

    from tests.server_utils import LiveServer
    with LiveServer(llama_dir) as live:
        client = openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
        tok = live.engine.tokenizer

        async def main() -> None:
            texts = ["def f(x):", "hello world, again and again"]
            r = await client.embeddings.create(model=live.model_name, input=texts)
            assert r.model == live.model_name and [d.index for d in r.data] == [0, 1]
            ids = [tok.encode(t) for t in texts]
            for d, p in zip(r.data, ids):
                assert _close(d.embedding, reference(p, "last"))
            assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
            r = await client.embeddings.create(model=live.model_name, input=PROMPTS[:2], dimensions=8,
                                               encoding_format="base64")
            for d, p in zip(r.data, PROMPTS):
                vec = d.embedding if isinstance(d.embedding, list) else \
                    np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                assert _close(vec, reference(p, "last", True, 8))
            for kwargs, param in (({"input": []}, "input"), ({"input": "x", "dimensions": 99}, "dimensions"),
                                  ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                                  ({"input": [[1, -2]]}, "input")):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.embeddings.create(model=live.model_name, **kwargs)
                assert e.value.body["param"] == param, e.value.body
            with pytest.raises(openai.NotFoundError):
                await client.embeddings.create(model="nope", input="x")
        asyncio.run(main())
        state = live.pool_state()
        assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == 0


def test_bare_backbone_checkpoint(llama_dir, reference, tmp_path):
    # `AutoModel.save_pretrained` writes the decoder alone ("LlamaModel", tensor names without "model."), as some
    # embedding checkpoints ship: it loads as the family's model and embeds the same.
    import shutil

    import transformers as tf
    tf.AutoModel.from_pretrained(llama_dir, dtype=torch.float32).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / f, tmp_path / f)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaModel"]
    with LLM(str(tmp_path), dtype="float32") as llm:
        out = llm.embed({"prompt_token_ids": PROMPTS[3]}, PoolingParams(pooling="mean"))[0]
        assert _close(out.embedding, reference(PROMPTS[3], "mean"))


def test_tensor_parallel_embeddings_equal_one_process(llama_dir):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(llama_dir), dtype="float32") as llm:
        want = [o.embedding for o in llm.embed(prompts, PoolingParams(pooling="mean"))]
    with LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2) as llm:
        got = [o.embedding for o in llm.embed(prompts, PoolingParams(pooling="mean"))]
    assert all(_close(g, np.asarray(w)) for g, w in zip(got, want))


def test_score_and_rerank_are_cosine_similarities(llama_dir):
    import httpx

    from tests.server_utils import LiveServer
    query, docs = "def add(a, b):", ["return a + b", "import os", "class Foo:", "x = 1"]
    with LiveServer(llama_dir) as live:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                emb = (await http.post("/v1/embeddings", json={"input": [query] + docs})).json()["data"]
                vecs = np.asarray([d["embedding"] for d in emb])
                want = vecs[1:] @ vecs[0]
                r = (await http.post("/v1/score", json={"text_1": query, "text_2": docs})).json()
                assert _close([d["score"] for d in r["data"]], want) and [d["index"] for d in r["data"]] == [0, 1, 2, 3]
                pairs = (await http.post("/score", json={"text_1": docs[:2], "text_2": docs[2:]})).json()["data"]
                assert _close([d["score"] for d in pairs], (vecs[1:3] * vecs[3:5]).sum(axis=1))
                r = (await http.post("/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                       "top_n": 3})).json()
                order = list(np.argsort(-want, kind="stable")[:3])
                assert [x["index"] for x in r["results"]] == order
                assert [x["document"]["text"] for x in r["results"]] == [docs[i] for i in order]
                assert _close([x["relevance_score"] for x in r["results"]], want[order])
                assert r["usage"]["total_tokens"] > 0
                for path, body, param in (("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
                                          ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
                                          ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
                                          ("/v1/rerank", {"query": "q", "documents": [3]}, "documents"),
                                          ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n")):
                    resp = await http.post(path, json=body)
                    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, resp.text)
        asyncio.run(main())
        state = live.pool_state()
        assert state["free"] == state["blocks"] and state["running"] == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(llama_dir):
    """vLLM's truncate_prompt_tokens (an explicit opt-in): generation and embeddings see only the prompt's last N
    tokens, so a prompt longer than the context can still run; the server counts the kept tokens."""
    import httpx

    from tests.server_utils import LiveServer
    long = list(range(3, 3 + 70))
    with LLM(str(llama_dir), dtype="float32", max_model_len=64) as llm:
        greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
        cut = llm.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=20, **greedy))[0]
        plain = llm.generate({"prompt_token_ids": long[-20:]}, SamplingParams(**greedy))[0]
        assert cut.prompt_token_ids == long[-20:] and cut.outputs[0].token_ids == plain.outputs[0].token_ids
        e1 = llm.embed({"prompt_token_ids": long}, PoolingParams(truncate_prompt_tokens=30))[0]
        e2 = llm.embed({"prompt_token_ids": long[-30:]})[0]
        assert e1.embedding == e2.embedding
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be a positive integer"):
            SamplingParams(truncate_prompt_tokens=0)
    with LiveServer(llama_dir, max_model_len=64) as live:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                r = await http.post("/v1/completions", json={"prompt": long, "max_tokens": 2,
                                                             "truncate_prompt_tokens": 16})
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
                r = await http.post("/v1/embeddings", json={"input": [long], "truncate_prompt_tokens": 8})
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8
                r = await http.post("/v1/completions", json={"prompt": long, "max_tokens": 2})
                assert r.status_code == 400  # without the opt-in, too long is an error, not a silent cut
                r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "truncate_prompt_tokens": 0})
                assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
        asyncio.run(main())


def test_chat_messages_embed_as_their_rendered_prompt(llama_dir):
    import httpx

    from tests.server_utils import LiveServer
    messages = [{"role": "user", "content": "find me a recipe"}]
    with LiveServer(llama_dir) as live:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                r = (await http.post("/v1/embeddings", json={"messages": messages})).json()
                text = live.app.state.server.chat_template.render(messages, False)
                ids = live.engine.tokenizer.encode(text, add_special_tokens=False)
                plain = (await http.post("/v1/embeddings", json={"input": [ids]})).json()
                assert r["data"][0]["embedding"] == plain["data"][0]["embedding"]
                assert r["usage"]["prompt_tokens"] == len(ids)
                bad = await http.post("/v1/embeddings", json={"messages": messages, "input": "x"})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        asyncio.run(main())
