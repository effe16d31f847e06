"""Sequence-classification models (classifiers, reward models, cross-encoders): the label probabilities and pair
scores equal transformers' `*ForSequenceClassification` (fp32) through batches, chunked prefill, preemption and
prefix-cache hits; /classify, /score and /rerank answer in vLLM's shapes; what such a model cannot do is refused."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM, AsyncEngine, PoolingParams, SamplingParams  # noqa: E402
from streamer.engine.pooling import Classifier, encode_pair, pair_up  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.tokenizer.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, [7, 8], list(range(60, 100)), [3]]
QUERY, DOCS = "what does the fox do?", ["The quick brown fox jumps over the lazy dog.", "Hello, world!",
                                        "def fibonacci(n: int) -> int:", "The dog did not care; it was asleep."]


def _build(root: Path, name: str, **kw) -> Path:
    from tests.checkpoints import make_classifier_checkpoint
    path = root / name
    if not (path / "config.json").exists():
        make_classifier_checkpoint(path, **kw)
    return path


@pytest.fixture(scope="module")
def clf_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "seqcls-qwen3-3labels", family="qwen3")


@pytest.fixture(scope="module")
def ce_dir(ckpt_root) -> Path:
    """A cross-encoder: one label."""
    return _build(ckpt_root, "seqcls-llama-1label", family="llama", labels=("relevance",))


def _reference(model_dir: Path):
    """transformers' pooled logits of one prompt (alone: no padding), fp32."""
    import transformers as tf
    model = tf.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()
    return logits


@pytest.fixture(scope="module")
def clf_ref(clf_dir):
    return _reference(clf_dir)


@pytest.fixture(scope="module")
def ce_ref(ce_dir):
    return _reference(ce_dir)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _close(got, want) -> bool:
    return np.allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


LABELS = ("negative", "neutral", "positive")


def test_classify_matches_transformers_through_chunks_and_prefix_hits(clf_dir, clf_ref):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    # A 16-token budget chunks the long prompts (and batches the short ones with their chunks).
    with LLM(str(clf_dir), dtype="float32", max_num_batched_tokens=16, block_size=4) as llm:
        engine = llm.engine
        outs = llm.classify(prompts)
        for out, p in zip(outs, PROMPTS):
            want = _softmax(clf_ref(p))
            assert out.prompt_token_ids == p and out.num_classes == 3
            assert _close(out.probs, want), (p, out.probs, want)
            assert out.label == LABELS[int(np.argmax(want))]
        assert len({o.label for o in outs}) > 1  # (the head does tell these prompts apart)
        # The same prompts again, and one that extends a cached one: last-token pooling takes prefix-cache hits.
        hits = engine.kv.prefix_hits
        again = llm.classify(prompts[1:2] + [{"prompt_token_ids": PROMPTS[3] + [7, 8, 9]}],
                             PoolingParams(activation=False))
        assert engine.kv.prefix_hits > hits and all(o.num_cached_tokens > 0 for o in again)
        assert _close(again[0].probs, clf_ref(PROMPTS[1]))  # raw logits
        assert _close(again[1].probs, clf_ref(PROMPTS[3] + [7, 8, 9]))
        assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_a_preempted_request_classifies_from_its_recomputed_prompt(clf_dir, clf_ref):
    # One seat: the urgent request preempts the one halfway through its prompt, which then starts over.
    with LLM(str(clf_dir), dtype="float32", max_num_batched_tokens=16, block_size=4, max_num_seqs=1,
             scheduling_policy="priority") as llm:
        engine = llm.engine
        task = PoolingParams(task="classify")
        slow = engine.add_request("slow", {"prompt_token_ids": PROMPTS[3]}, SamplingParams(), priority=1,
                                  pooling=task)[0]
        engine.step()
        urgent = engine.add_request("urgent", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(), pooling=task)[0]
        while engine.has_unfinished():
            engine.step()
        assert engine.scheduler.num_preemptions == 1 and slow.req.num_preemptions == 1
        for state, p in ((slow, PROMPTS[3]), (urgent, PROMPTS[1])):
            assert state.req.finish_reason == "stop" and _close(state.embedding, _softmax(clf_ref(p)))
        assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_each_family_loads_and_classifies(ckpt_root, family):
    # (qwen2: q/k/v biases and tied embeddings; sharded safetensors with an index: the head lands in a shard of its own)
    path = _build(ckpt_root, f"seqcls-{family}-2labels", family=family, labels=("no", "yes"),
                  max_shard_size="40KB" if family == "qwen2" else None)
    assert (family == "qwen2") == (path / "model.safetensors.index.json").exists()
    ref = _reference(path)
    with LLM(str(path), dtype="float32") as llm:
        assert llm.engine.model_config.num_labels == 2 and llm.engine.runner.model.lm_head is None
        outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    for out, p in zip(outs, PROMPTS):
        assert _close(out.probs, _softmax(ref(p))) and out.label in ("no", "yes")


def test_cross_encoder_scores_pairs_as_transformers(ce_dir, ce_ref):
    import transformers as tf
    hf_tok = tf.AutoTokenizer.from_pretrained(ce_dir)
    with LLM(str(ce_dir), dtype="float32") as llm:
        scores = llm.score(QUERY, DOCS)
        for out, doc in zip(scores, DOCS):
            ids = hf_tok(QUERY, doc)["input_ids"]
            assert out.prompt_token_ids == ids
            assert _close(out.score, _sigmoid(ce_ref(ids))[0])
        assert len({round(s.score, 3) for s in scores}) == len(DOCS)
        pairwise = llm.score(DOCS[:2], DOCS[2:])  # text_1[i] with text_2[i]
        assert [o.prompt_token_ids for o in pairwise] == [hf_tok(a, b)["input_ids"] for a, b in zip(DOCS[:2], DOCS[2:])]
        # One label: classify is a sigmoid too, and activation=False gives the logit.
        out = llm.classify(QUERY)[0]
        ids = hf_tok(QUERY)["input_ids"]
        assert out.label == "relevance" and out.num_classes == 1 and _close(out.probs, _sigmoid(ce_ref(ids)))
        assert _close(llm.classify(QUERY, PoolingParams(activation=False))[0].probs, ce_ref(ids))
        with pytest.raises(ValueError, match="text_1 holds 2 texts and text_2 3"):
            llm.score(DOCS[:2], DOCS[:3])
        with pytest.raises(ValueError, match="text_2 must be a string or a non-empty list"):
            llm.score(QUERY, [])
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_embedding_model_scores_by_cosine(llama_dir):
    with LLM(str(llama_dir), dtype="float32") as llm:
        vecs = np.asarray([o.embedding for o in llm.embed([QUERY] + DOCS)])
        scores = llm.score(QUERY, DOCS)
        assert _close([s.score for s in scores], vecs[1:] @ vecs[0])
        with pytest.raises(ValueError, match="task 'classify' needs a sequence-classification model"):
            llm.classify("hello")


def test_what_a_classifier_cannot_do(clf_dir):
    with LLM(str(clf_dir), dtype="float32") as llm:
        with pytest.raises(ValueError, match="Qwen3ForSequenceClassification is a sequence-classification model: it "
                                             "has no LM head and cannot generate"):
            llm.generate("hello")
        with pytest.raises(ValueError, match="makes no embeddings"):
            llm.embed("hello")
        with pytest.raises(ValueError, match="task 'score' needs a cross-encoder .* has 3 labels"):
            llm.score("a", "b")
        with pytest.raises(ValueError, match="pooling must be 'last'"):
            llm.classify("hello", PoolingParams(pooling="mean"))
        with pytest.raises(ValueError, match="dimensions is for embeddings"):
            llm.classify("hello", PoolingParams(dimensions=2))
        with pytest.raises(ValueError, match="task is 'embed', but this call does 'classify'"):
            llm.classify("hello", PoolingParams(task="embed"))
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks and not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="rank")
    with pytest.raises(ValueError, match="activation must be true or false"):
        PoolingParams(activation=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text_1 holds 2 texts and text_2 3"):
        pair_up(["a", "b"], ["c", "d", "e"])


def test_config_labels_and_activations():
    base = dict(architectures=["LlamaForSequenceClassification"], vocab_size=100, hidden_size=64,
                intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    cfg = ModelConfig.from_dict(base)  # transformers writes no id2label for its default of two labels
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_labels == 2 and cfg.tie_word_embeddings
    clf = Classifier.from_config(cfg.raw, cfg.num_labels)
    assert clf is not None and clf.labels == ("LABEL_0", "LABEL_1") and clf.classify_activation == "softmax"
    assert Classifier.from_config({}, None) is None and ModelConfig.from_dict(
        dict(base, architectures=["LlamaForCausalLM"])).num_labels is None
    logits = np.array([2.0, -1.0])
    assert _close(clf.finish(logits, PoolingParams(task="classify")), _softmax(logits))
    assert clf.label([0.2, 0.8]) == "LABEL_1"
    # As vLLM (transformers' loss by problem_type): regression keeps the logits, multi-label takes a sigmoid each.
    reg = Classifier.from_config(dict(base, problem_type="regression"), 2)
    multi = Classifier.from_config(dict(base, problem_type="multi_label_classification"), 2)
    assert reg.finish(logits, PoolingParams(task="classify")) == logits.tolist()  # type: ignore[union-attr]
    assert _close(multi.finish(logits, PoolingParams(task="classify")), _sigmoid(logits))  # type: ignore[union-attr]
    # A cross-encoder's score takes the activation its sentence-transformers config names.
    one = np.array([3.0])
    identity = Classifier.from_config(dict(base, sentence_transformers={
        "activation_fn": "torch.nn.modules.linear.Identity"}), 1)
    assert identity.finish(one, PoolingParams(task="score")) == [3.0]  # type: ignore[union-attr]
    assert _close(identity.finish(one, PoolingParams(task="classify")), _sigmoid(one))  # type: ignore[union-attr]
    odd = Classifier.from_config(dict(base, sbert_ce_default_activation_function="torch.nn.modules.Tanh"), 1)
    with pytest.raises(ValueError, match="cross-encoder activation is not supported"):
        odd.resolve(PoolingParams(task="score"))  # type: ignore[union-attr]
    assert identity.finish(np.array([-800.0]), PoolingParams(task="classify")) == [0.0]  # type: ignore # (no overflow)


def test_encode_pair_is_transformers_pair_encoding(tmp_path):
    import transformers as tf

    from tests.tokenizer_factory import make_bytelevel_tokenizer, make_sentencepiece_tokenizer
    flags = make_sentencepiece_tokenizer(tmp_path / "sp")  # add_bos_token rules the special tokens
    plain = tmp_path / "plain"  # no flags: the post-processor's pair template
    make_bytelevel_tokenizer(plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"], cfg["add_eos_token"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    eos = tmp_path / "eos"  # both flags: <s> A </s> <s> B </s>
    shutil.copytree(flags, eos)
    cfg = json.loads((eos / "tokenizer_config.json").read_text())
    (eos / "tokenizer_config.json").write_text(json.dumps(dict(cfg, add_eos_token=True)))
    for folder in (flags, plain, eos):
        # (transformers 5 honours the flags when passed, as tests/test_tokenizer.py does; 4's Llama tokenizers read them)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        kw = {k: cfg[k] for k in ("add_bos_token", "add_eos_token") if k in cfg}
        ours, hf = Tokenizer.from_pretrained(folder), tf.AutoTokenizer.from_pretrained(folder, **kw)
        for a, b in ((QUERY, DOCS[0]), ("Über", "你好，世界")):
            assert encode_pair(ours, a, b) == hf(a, b)["input_ids"], folder.name
    assert encode_pair(ours, "a", "b").count(ours.eos_token_id) == 2


def test_async_engine_classify(clf_dir, clf_ref):
    async def main() -> None:
        async with AsyncEngine(str(clf_dir), dtype="float32") as engine:
            outs = await asyncio.gather(*(engine.classify({"prompt_token_ids": p}) for p in PROMPTS))
            for out, p in zip(outs, PROMPTS):
                assert _close(out.probs, _softmax(clf_ref(p))) and out.prompt_token_ids == p
            with pytest.raises(ValueError, match="makes no embeddings"):
                await engine.embed("hello")
    asyncio.run(main())


def test_classify_endpoint(clf_dir, clf_ref):
    import httpx

    from tests.server_utils import LiveServer
    with LiveServer(clf_dir) as live:
        tok = live.engine.tokenizer

        async def main() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                texts = ["The quick brown fox", "Hello, world! How are you today?"]
                r = await http.post("/classify", json={"model": live.model_name, "input": texts})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["object"] == "list" and body["id"].startswith("classify-")
                assert body["model"] == live.model_name and isinstance(body["created"], int)
                ids = [tok.encode(t) for t in texts]
                for i, (d, p) in enumerate(zip(body["data"], ids)):
                    want = _softmax(clf_ref(p))
                    assert set(d) == {"index", "label", "probs", "num_classes"} and d["index"] == i
                    assert d["num_classes"] == 3 and _close(d["probs"], want)
                    assert d["label"] == LABELS[int(np.argmax(want))]
                n = sum(map(len, ids))
                assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                         "prompt_tokens_details": None}
                r = (await http.post("/v1/classify", json={"input": PROMPTS[3], "activation": False})).json()
                assert len(r["data"]) == 1 and _close(r["data"][0]["probs"], clf_ref(PROMPTS[3]))
                r = (await http.post("/v1/classify", json={"input": "x", "use_activation": False})).json()
                assert _close(r["data"][0]["probs"], clf_ref(tok.encode("x")))
                for path, body, param in (
                        ("/classify", {"input": []}, "input"), ("/classify", {"input": [[1, -2]]}, "input"),
                        ("/classify", {"input": "x", "activation": "no"}, "activation"),
                        ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ("/classify", {"input": [[5] * 600]}, "input"),  # longer than the context
                        ("/v1/embeddings", {"input": "x"}, "model"),
                        ("/v1/score", {"text_1": "a", "text_2": "b"}, "model"),
                        ("/v1/rerank", {"query": "a", "documents": ["b"]}, "model"),
                        ("/v1/completions", {"prompt": "x", "max_tokens": 2}, None),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None)):
                    resp = await http.post(path, json=body)
                    assert resp.status_code == 400, (path, resp.text)
                    err = resp.json()["error"]
                    assert err["type"] == "invalid_request_error" and err["param"] == param, (path, err)
                    assert path.startswith("/classify") or "Qwen3ForSequenceClassification" in err["message"]
                r = await http.post("/classify", json={"model": "nope", "input": "x"})
                assert r.status_code == 404
        asyncio.run(main())
        state = live.wait_idle()
        assert state["free"] == state["blocks"]


def test_score_and_rerank_with_a_cross_encoder(ce_dir, ce_ref, llama_dir):
    import httpx
    import transformers as tf

    from tests.server_utils import LiveServer
    hf_tok = tf.AutoTokenizer.from_pretrained(ce_dir)
    pairs = [hf_tok(QUERY, d)["input_ids"] for d in DOCS]
    want = np.array([_sigmoid(ce_ref(ids))[0] for ids in pairs])
    with LiveServer(ce_dir) as live:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                r = (await http.post("/score", json={"text_1": QUERY, "text_2": DOCS})).json()
                assert [d["index"] for d in r["data"]] == [0, 1, 2, 3] and r["object"] == "list"
                assert _close([d["score"] for d in r["data"]], want)
                assert r["usage"]["prompt_tokens"] == sum(map(len, pairs))
                r = (await http.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]})).json()
                pw = [_sigmoid(ce_ref(hf_tok(a, b)["input_ids"]))[0] for a, b in zip(DOCS[:2], DOCS[2:])]
                assert _close([d["score"] for d in r["data"]], pw)
                r = (await http.post("/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                       "top_n": 3})).json()
                order = list(np.argsort(-want, kind="stable")[:3])
                assert [x["index"] for x in r["results"]] == order
                assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in order]
                assert _close([x["relevance_score"] for x in r["results"]], want[order])
                assert r["usage"]["total_tokens"] == sum(map(len, pairs))
                r = (await http.post("/classify", json={"input": QUERY})).json()  # one label: a sigmoid
                assert r["data"][0]["num_classes"] == 1 and r["data"][0]["label"] == "relevance"
                resp = await http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "text_1"
        asyncio.run(main())
        state = live.wait_idle()
        assert state["free"] == state["blocks"]
    with LiveServer(llama_dir) as live:  # not a classifier: /classify is refused
        async def refused() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                resp = await http.post("/classify", json={"input": "x"})
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
                assert "needs a sequence-classification model" in resp.json()["error"]["message"]
        asyncio.run(refused())


def _word_tokens(model_dir: Path, n: int) -> list[str]:
    """n whole-word tokens of the checkpoint's vocabulary (what a reranker's "yes" / "no" are)."""
    import re
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if re.fullmatch("Ġ[a-z]{3,}", t)][:n]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # (an LM head of its own; one tied to the embeddings)
def test_classifier_from_token_as_vllm(make_ckpt, family):
    """A causal LM served as a reranker through hf_overrides (vLLM's recipe for Qwen3-Reranker): the score head is
    the LM head's rows for the tokens; 2-way softmax (one label, the sigmoid of the logit difference) or their own
    logits (no post-processing). Both equal transformers' causal LM's last-token logits."""
    import transformers as tf
    path = make_ckpt(f"{family}-reranker", family=family)
    no, yes, other = _word_tokens(path, 3)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = Tokenizer.from_pretrained(path)
    ids = {t: tok.token_to_id(t) for t in (no, yes, other)}

    def last_logits(prompt: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
    arch = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification"}[family]
    overrides = {"architectures": [arch], "classifier_from_token": [no, yes], "method": "from_2_way_softmax"}
    with LLM(str(path), dtype="float32", hf_overrides=overrides) as llm:
        assert llm.engine.classifier.num_labels == 1
        scores = [s.score for s in llm.score(QUERY, DOCS)]
        want = []
        for d in DOCS:
            lg = last_logits(encode_pair(tok, QUERY, d))
            want.append(_softmax(np.array([lg[ids[no]], lg[ids[yes]]]))[1])
        assert _close(scores, want)
        llm.update_weights(str(path))  # (reloaded in place: the head is made of the rows again)
        assert _close([s.score for s in llm.score(QUERY, DOCS)], want)
    overrides = {"architectures": [arch], "classifier_from_token": [other, yes], "method": "no_post_processing"}
    with LLM(str(path), dtype="float32", hf_overrides=overrides) as llm:
        for p in PROMPTS[:3]:
            got = llm.classify({"prompt_token_ids": p}, PoolingParams(activation=False))[0].probs
            assert _close(got, last_logits(p)[[ids[other], ids[yes]]])
    for bad, match in (({"classifier_from_token": ["no-such-token", yes], "architectures": [arch]},
                        "not a token of the tokenizer"),
                       ({"classifier_from_token": [no, yes, other], "method": "from_2_way_softmax",
                         "architectures": [arch]}, "two tokens"),
                       ({"classifier_from_token": [no, yes]}, "ForSequenceClassification architecture")):
        with pytest.raises(ValueError, match=match):
            LLM(str(path), dtype="float32", hf_overrides=bad)


def test_classifier_from_token_methods():
    from streamer.models.config import head_from_tokens
    assert head_from_tokens({"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}) == \
        (["true"], "from_2_way_softmax")
    assert head_from_tokens({"classifier_from_token": ["0", "1"]}) == (["true"], "from_2_way_softmax")
    assert head_from_tokens({"classifier_from_token": ["Yes"]}) == (["Yes"], "no_post_processing")
    with pytest.raises(ValueError, match="method must be one of"):
        head_from_tokens({"classifier_from_token": ["Yes"], "method": "softmax"})
    with pytest.raises(ValueError, match="list of token strings"):
        head_from_tokens({"classifier_from_token": "yes"})
