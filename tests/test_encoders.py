"""Encoders (models/bert.py, modernbert.py, mpnet.py, t5.py): embeddings, label probabilities and cross-encoder
scores equal transformers' (fp32) for BERT, XLM-RoBERTa, ModernBERT, MPNet and T5-encoder checkpoints, batched,
compiled, over the server; MPNet's and T5's relative position biases matter; a pair's second text reads as token
type 1; ModernBERT's and EmbeddingGemma's local layers see a window both ways; EmbeddingGemma's sentence-transformers
Dense modules project the pooled vector; prompts are never split; what an encoder cannot do is refused."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM, PoolingParams, SamplingParams  # noqa: E402
from streamer.engine.pooling import encode_pair  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!", "what time is it? it is half past seven.",
         "a"]
QUERY, DOCS = "what does the fox do?", ["The quick brown fox jumps over the lazy dog.", "Hello, world!",
                                        "def fibonacci(n: int) -> int:", "The dog did not care; it was asleep."]


def _build(root: Path, name: str, **kw) -> Path:
    from tests.encoder_checkpoints import make_encoder_checkpoint
    path = root / name
    if not (path / "config.json").exists():
        make_encoder_checkpoint(path, **kw)
    return path


@pytest.fixture(scope="module")
def bert_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "bert-embed")


@pytest.fixture(scope="module")
def xlmr_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "xlmr-embed-mean", family="roberta", pooling="mean")


@pytest.fixture(scope="module")
def bert_ce_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "bert-cross-encoder", labels=("relevance",))


@pytest.fixture(scope="module")
def xlmr_clf_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "xlmr-classifier", family="roberta", labels=("negative", "neutral", "positive"))


@pytest.fixture(scope="module")
def modernbert_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "modernbert-embed", family="modernbert")


@pytest.fixture(scope="module")
def modernbert_clf_dir(ckpt_root) -> Path:
    """Mean pooling into the head, and every optional bias."""
    return _build(ckpt_root, "modernbert-classifier", family="modernbert", labels=("negative", "neutral", "positive"),
                  classifier_pooling="mean", norm_bias=True, mlp_bias=True, attention_bias=True,
                  classifier_bias=True)


@pytest.fixture(scope="module")
def mpnet_dir(ckpt_root) -> Path:
    """Saved as all-mpnet-base-v2 is: `MPNetForMaskedLM` (its LM head skipped), mean pooling."""
    return _build(ckpt_root, "mpnet-embed", family="mpnet", pooling="mean", masked_lm=True)


@pytest.fixture(scope="module")
def mpnet_clf_dir(ckpt_root) -> Path:
    return _build(ckpt_root, "mpnet-cross-encoder", family="mpnet", labels=("relevance",))


def _hf(model_dir: Path, classifier: bool = False):
    import transformers as tf
    cls = tf.AutoModelForSequenceClassification if classifier else tf.AutoModel
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval(), tf.AutoTokenizer.from_pretrained(model_dir)


def _hidden(model, tok, text: str) -> np.ndarray:
    with torch.no_grad():
        return model(**tok(text, return_tensors="pt")).last_hidden_state[0].double().numpy()


def _pooled(hidden: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    vec = hidden[0] if pooling == "cls" else hidden.mean(0)
    return vec / np.linalg.norm(vec) if normalize else vec


def _logits(model, tok, *texts: str, types: bool = True) -> np.ndarray:
    enc = tok(*texts, return_tensors="pt")
    if not types:
        enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    with torch.no_grad():
        return model(**enc).logits[0].double().numpy()


def _close(got, want, tol: float = 2e-5) -> bool:
    return np.allclose(np.asarray(got), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("compiled", [False, True])
def test_bert_embeddings_match_transformers(bert_dir, compiled):
    model, tok = _hf(bert_dir)
    with LLM(str(bert_dir), dtype="float32", enforce_eager=not compiled) as llm:
        assert llm.engine.prefix_caching is False and llm.engine.default_pooling == "cls"
        ids = [tok(t)["input_ids"] for t in TEXTS]
        assert [llm.engine.tokenizer.encode(t) for t in TEXTS] == ids
        for pooling in ("cls", "mean"):
            for normalize in (False, True):
                outs = llm.embed(TEXTS, PoolingParams(pooling=pooling, normalize=normalize))  # one batch
                for text, out in zip(TEXTS, outs):
                    assert _close(out.embedding, _pooled(_hidden(model, tok, text), pooling, normalize)), \
                        (text, pooling, normalize)
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_xlm_roberta_embeddings_pool_as_sentence_transformers_declares(xlmr_dir):
    # The offset positions (pad_token_id + 1), one token type, and the Pooling module's mean.
    model, tok = _hf(xlmr_dir)
    with LLM(str(xlmr_dir), dtype="float32") as llm:
        assert llm.engine.default_pooling == "mean" and llm.engine.max_model_len == 64
        outs = llm.embed(TEXTS)
        for text, out in zip(TEXTS, outs):
            assert _close(out.embedding, _pooled(_hidden(model, tok, text), "mean", True))
        long = " ".join(["fox"] * 80)
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.embed(long)
        # truncated as the tokenizer truncates: the start kept, and the closing </s>
        cut = llm.embed(long, PoolingParams(truncate_prompt_tokens=64))[0]
        assert cut.prompt_token_ids == tok(long, truncation=True, max_length=64)["input_ids"]
        with torch.no_grad():
            h = model(**tok(long, truncation=True, max_length=64, return_tensors="pt")).last_hidden_state[0]
        assert _close(cut.embedding, _pooled(h.double().numpy(), "mean", True))


def test_bert_cross_encoder_reads_the_pair_s_token_types(bert_ce_dir):
    model, tok = _hf(bert_ce_dir, classifier=True)
    want = np.array([1 / (1 + np.exp(-_logits(model, tok, QUERY, d)[0])) for d in DOCS])
    without_types = np.array([1 / (1 + np.exp(-_logits(model, tok, QUERY, d, types=False)[0])) for d in DOCS])
    assert not _close(want, without_types, 1e-3)  # (the types matter to this checkpoint: the test can fail)
    with LLM(str(bert_ce_dir), dtype="float32") as llm:
        assert [encode_pair(llm.engine.tokenizer, QUERY, d) for d in DOCS] == \
            [tok(QUERY, d)["input_ids"] for d in DOCS]
        scores = [s.score for s in llm.score(QUERY, DOCS)]
        assert _close(scores, want)
        # a single text's only separator ends it: all type 0, as transformers' tokenizer gives
        for text in TEXTS:
            assert _close(llm.classify(text, PoolingParams(activation=False))[0].probs,
                          _logits(model, tok, text))
        with pytest.raises(ValueError, match="pooling must be 'cls'"):
            llm.classify("hello", PoolingParams(pooling="last"))


def test_xlm_roberta_classifier_labels(xlmr_clf_dir):
    model, tok = _hf(xlmr_clf_dir, classifier=True)
    with LLM(str(xlmr_clf_dir), dtype="float32", enforce_eager=False) as llm:
        outs = llm.classify(TEXTS)
        for text, out in zip(TEXTS, outs):
            logits = _logits(model, tok, text)
            e = np.exp(logits - logits.max())
            assert _close(out.probs, e / e.sum())
            assert out.label == ("negative", "neutral", "positive")[int(np.argmax(logits))]


def test_prompts_are_computed_whole(bert_dir):
    # A step's budget that holds one prompt of the four: each is still computed whole (in a step of its own), and
    # equals what it is alone.
    model, tok = _hf(bert_dir)
    texts = ["It is half past seven.", "The dog did not care.", "I am fine, thank you.", TEXTS[1]]
    assert all(16 < len(tok(t)["input_ids"]) <= 32 for t in texts[:3])
    with LLM(str(bert_dir), dtype="float32", max_model_len=32, max_num_batched_tokens=32) as llm:
        steps = llm.engine.num_steps
        outs = llm.embed(texts, PoolingParams(normalize=False))
        assert llm.engine.num_steps - steps >= 2
        for text, out in zip(texts, outs):
            assert _close(out.embedding, _pooled(_hidden(model, tok, text), "cls", False))
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_what_an_encoder_cannot_do(bert_dir, tmp_path):
    with LLM(str(bert_dir), dtype="float32", max_num_batched_tokens=16) as llm:  # (raised: prompts are whole)
        assert llm.engine.config.max_num_batched_tokens == llm.engine.max_model_len == 64
        assert len(llm.embed({"prompt_token_ids": [2] + [10] * 60 + [3]})[0].embedding) == 64
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(str(bert_dir), dtype="float32", tensor_parallel_size=2)
    with LLM(str(bert_dir), dtype="float32") as llm:
        with pytest.raises(ValueError, match="encoder .*cannot generate"):
            llm.generate("hello", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="sequence-classification model"):
            llm.classify("hello")


def test_bf16_embeddings_stay_close(bert_dir):
    model, tok = _hf(bert_dir)
    with LLM(str(bert_dir), dtype="bfloat16") as llm:
        for text, out in zip(TEXTS, llm.embed(TEXTS)):
            want = _pooled(_hidden(model, tok, text), "cls", True)
            assert float(np.dot(out.embedding, want)) > 0.99


def test_old_layernorm_names_load(bert_dir, tmp_path):
    # TF-converted checkpoints spell LayerNorm's parameters gamma / beta.
    import shutil

    from safetensors.torch import load_file, save_file
    old = tmp_path / "old-names"
    shutil.copytree(bert_dir, old)
    tensors = load_file(str(old / "model.safetensors"))
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    with LLM(str(bert_dir), dtype="float32") as a, LLM(str(old), dtype="float32") as b:
        assert _close(a.embed(TEXTS[0])[0].embedding, b.embed(TEXTS[0])[0].embedding, 1e-7)


def test_server_embeddings_and_rerank(bert_dir, bert_ce_dir):
    import httpx
    import openai

    from tests.server_utils import LiveServer
    model, tok = _hf(bert_dir)
    with LiveServer(bert_dir) as live:
        async def embed() -> None:
            client = openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
            r = await client.embeddings.create(model=live.model_name, input=TEXTS)
            for d, text in zip(r.data, TEXTS):
                assert _close(d.embedding, _pooled(_hidden(model, tok, text), "cls", True))
            assert r.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
            with pytest.raises(openai.BadRequestError, match="cannot generate"):
                await client.completions.create(model=live.model_name, prompt="hello", max_tokens=2)
        asyncio.run(embed())
        state = live.wait_idle()
        assert state["free"] == state["blocks"]
    ce, ce_tok = _hf(bert_ce_dir, classifier=True)
    want = np.array([1 / (1 + np.exp(-_logits(ce, ce_tok, QUERY, d)[0])) for d in DOCS])
    with LiveServer(bert_ce_dir) as live:
        async def rerank() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                r = (await http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})).json()
                order = list(np.argsort(-want, kind="stable"))
                assert [x["index"] for x in r["results"]] == order
                assert _close([x["relevance_score"] for x in r["results"]], want[order])
                # Cohere's v2 path, without the texts
                r = (await http.post("/v2/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                                          "return_documents": False})).json()
                assert [x["index"] for x in r["results"]] == order[:2]
                assert all("document" not in x for x in r["results"])
                assert _close([x["relevance_score"] for x in r["results"]], want[order[:2]])
                bad = await http.post("/v2/rerank", json={"query": QUERY, "documents": DOCS,
                                                           "return_documents": "no"})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_documents"
        asyncio.run(rerank())


@pytest.mark.parametrize("compiled, rows", [(False, False), (True, False), (False, True)],
                         ids=["eager", "compiled", "window-by-rows"])
def test_modernbert_embeddings_match_transformers(modernbert_dir, compiled, rows, monkeypatch):
    # Prompts longer than the local layers' window (4 either way): those layers must see a window, both ways.
    # rows: the window's queries 2 at a time over the keys they reach (a long prompt's path, here on short ones).
    if rows:
        import streamer.attention.torch_backend as tb
        monkeypatch.setattr(tb, "WINDOW_ROWS", 2)
        calls = []
        real = tb.TorchAttentionBackend._windowed_by_rows
        monkeypatch.setattr(tb.TorchAttentionBackend, "_windowed_by_rows",
                            lambda self, *a: calls.append(1) or real(self, *a))
    model, tok = _hf(modernbert_dir)
    assert all(len(tok(t)["input_ids"]) > 9 for t in TEXTS[:3])
    with LLM(str(modernbert_dir), dtype="float32", enforce_eager=not compiled) as llm:
        assert llm.engine.prefix_caching is False and llm.engine.runner.model.two_sided_window == 5
        for pooling in ("cls", "mean"):
            outs = llm.embed(TEXTS, PoolingParams(pooling=pooling, normalize=False))
            for text, out in zip(TEXTS, outs):
                assert _close(out.embedding, _pooled(_hidden(model, tok, text), pooling, False)), (text, pooling)
    assert not rows or calls


def test_modernbert_classifier_reads_the_mean(modernbert_clf_dir):
    model, tok = _hf(modernbert_clf_dir, classifier=True)
    with LLM(str(modernbert_clf_dir), dtype="float32") as llm:
        outs = llm.classify(TEXTS, PoolingParams(activation=False))
        for text, out in zip(TEXTS, outs):
            assert _close(out.probs, _logits(model, tok, text))
        with pytest.raises(ValueError, match="pooling must be 'mean'"):
            llm.classify("hello", PoolingParams(pooling="cls"))


@pytest.fixture(scope="module")
def embeddinggemma_dir(ckpt_root) -> Path:
    from tests.encoder_checkpoints import make_embeddinggemma_checkpoint
    path = ckpt_root / "embeddinggemma"
    if not (path / "config.json").exists():
        make_embeddinggemma_checkpoint(path)
    return path


def _st_dense(model_dir: Path, vec: np.ndarray) -> np.ndarray:
    """sentence-transformers' Dense modules (identity, no bias), read back from the checkpoint."""
    from safetensors.torch import load_file
    for name in ("2_Dense", "3_Dense"):
        vec = load_file(str(model_dir / name / "model.safetensors"))["linear.weight"].double().numpy() @ vec
    return vec


@pytest.mark.parametrize("compiled", [False, True])
def test_embeddinggemma_matches_transformers_and_sentence_transformers_modules(embeddinggemma_dir, compiled):
    model, _ = _hf(embeddinggemma_dir)
    prompts = [[2] + list(range(10, 10 + n)) + [3] for n in (1, 7, 20)]  # (longer than the window of 4)
    with LLM(str(embeddinggemma_dir), dtype="float32", enforce_eager=not compiled) as llm:
        eng = llm.engine
        assert eng.encoder and not eng.prefix_caching and eng.default_pooling == "mean"
        assert eng.projection is not None and eng.projection.out_features == 64
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
        for p, out in zip(prompts, outs):
            with torch.no_grad():
                h = model(torch.tensor([p])).last_hidden_state[0].double().numpy()
            vec = _st_dense(embeddinggemma_dir, h.mean(0))
            assert _close(out.embedding, vec / np.linalg.norm(vec)), len(p)
        cut = llm.embed({"prompt_token_ids": prompts[2]}, PoolingParams(dimensions=16))[0].embedding
        assert len(cut) == 16 and _close(np.asarray(cut) * np.linalg.norm(outs[2].embedding[:16]),
                                         outs[2].embedding[:16])
        with pytest.raises(ValueError, match="cannot generate"):
            llm.generate("hello", SamplingParams(max_tokens=2))


def test_dense_projection_reads_sentence_transformers_modules(tmp_path):
    # LaBSE's kind: one Dense with a bias and sentence-transformers' default Tanh, its weights in a .bin file.
    import json

    from streamer.engine.pooling import DenseProjection
    assert DenseProjection.load(tmp_path) is None  # (no modules.json)
    (tmp_path / "2_Dense").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 4, "out_features": 3,
                                                                  "bias": True}))
    w, b = torch.randn(3, 4), torch.randn(3)
    torch.save({"linear.weight": w, "linear.bias": b}, tmp_path / "2_Dense" / "pytorch_model.bin")
    proj = DenseProjection.load(tmp_path)
    x = np.random.default_rng(0).normal(size=4)
    assert proj.out_features == 3
    assert _close(proj(x), np.tanh(w.double().numpy() @ x + b.double().numpy()), 1e-12)
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 4, "out_features": 3, "activation_function": "torch.nn.modules.activation.GELU"}))
    with pytest.raises(ValueError, match="activation torch.nn.modules.activation.GELU is not supported"):
        DenseProjection.load(tmp_path)


# A prompt of ~230 tokens: its keys reach distances past MPNet's last bias bucket (128) both ways.
LONG = " ".join(["the quick brown fox jumps over the lazy dog; it was asleep."] * 5)


@pytest.mark.parametrize("compiled, rows", [(False, False), (True, False), (False, True)],
                         ids=["eager", "compiled", "mask-by-rows"])
def test_mpnet_embeddings_match_transformers(mpnet_dir, compiled, rows, monkeypatch):
    """rows: the bias mask too big to make whole (a budget of 3 keys' rows), so it is made a few rows at a time."""
    if rows:
        import streamer.attention.torch_backend as tb
        monkeypatch.setattr(tb, "BIAS_MASK_ELEMENTS", 3 * 320 * 4)
    model, tok = _hf(mpnet_dir)
    texts = TEXTS + [LONG]
    assert len(tok(LONG)["input_ids"]) > 2 * 128 - 40
    with LLM(str(mpnet_dir), dtype="float32", enforce_eager=not compiled) as llm:
        assert llm.engine.default_pooling == "mean" and llm.engine.max_model_len == 320
        assert llm.engine.runner.model.relative_bias
        outs = llm.embed(texts)  # one batch: each prompt's distances from its own start
        for text, out in zip(texts, outs):
            assert _close(out.embedding, _pooled(_hidden(model, tok, text), "mean", True)), text[:20]
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_mpnet_bias_shows_in_the_output(mpnet_dir):
    """The checkpoint's bias table matters (the test above can fail): transformers with it zeroed differs."""
    model, tok = _hf(mpnet_dir)
    want = _hidden(model, tok, LONG)
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.zero_()
    assert not _close(_hidden(model, tok, LONG), want, 1e-3)


def test_mpnet_cross_encoder_scores_pairs(mpnet_clf_dir):
    # No token types: the pair <s> q </s></s> d </s> is told apart by its separators alone.
    model, tok = _hf(mpnet_clf_dir, classifier=True)
    want = np.array([1 / (1 + np.exp(-_logits(model, tok, QUERY, d)[0])) for d in DOCS])
    with LLM(str(mpnet_clf_dir), dtype="float32") as llm:
        assert [encode_pair(llm.engine.tokenizer, QUERY, d) for d in DOCS] == [tok(QUERY, d)["input_ids"]
                                                                              for d in DOCS]
        assert _close([s.score for s in llm.score(QUERY, DOCS)], want)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_lm_checkpoints_serve_as_embedding_models(ckpt_root, family):
    # BertForMaskedLM's `cls.predictions.*` and (XLM-)RoBERTa's `lm_head.*` are skipped; the encoder is the same.
    path = _build(ckpt_root, f"{family}-mlm", family=family, masked_lm=True)
    assert "ForMaskedLM" in (path / "config.json").read_text()
    model, tok = _hf(path)
    with LLM(str(path), dtype="float32") as llm:
        for text, out in zip(TEXTS, llm.embed(TEXTS, PoolingParams(pooling="cls", normalize=False))):
            assert _close(out.embedding, _pooled(_hidden(model, tok, text), "cls", False))


def test_sentence_transformers_max_seq_length_and_lower_case(ckpt_root, tmp_path):
    """sentence_bert_config.json's max_seq_length caps max_model_len (sentence-transformers truncates there: a longer
    text is refused, or with truncate_prompt_tokens cut as the tokenizer cuts it), and do_lower_case lower-cases
    texts before they are tokenized."""
    import json
    import shutil

    from streamer.tokenizer.tokenizer import Tokenizer
    from tests.tokenizer_factory import make_bytelevel_tokenizer
    path = tmp_path / "st"
    shutil.copytree(_build(ckpt_root, "mpnet-embed", family="mpnet", pooling="mean", masked_lm=True), path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    model, tok = _hf(path)
    with LLM(str(path), dtype="float32") as llm:
        assert llm.engine.max_model_len == 40
        with pytest.raises(ValueError, match="max_model_len is 40"):
            llm.embed(LONG)
        cut = llm.embed(LONG, PoolingParams(truncate_prompt_tokens=40))[0]
        enc = tok(LONG, truncation=True, max_length=40, return_tensors="pt")
        assert cut.prompt_token_ids == enc["input_ids"][0].tolist()
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].double().numpy()
        assert _close(cut.embedding, _pooled(h, "mean", True))
    cased = make_bytelevel_tokenizer(tmp_path / "cased")
    assert Tokenizer.from_pretrained(cased).encode("Hello World") != Tokenizer.from_pretrained(cased).encode(
        "hello world")
    (cased / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": True}))
    lower = Tokenizer.from_pretrained(cased)
    assert lower.encode("Hello World") == lower.encode("hello world")
    assert lower.encode_pair("A B", "C") == lower.encode_pair("a b", "c")


@pytest.mark.parametrize("ff", ["gated-gelu", "relu"])
def test_t5_encoder_embeddings_match_transformers(ckpt_root, ff):
    """T5's encoder (sentence-t5, GTR): unscaled scores plus the bucketed bias both ways (a prompt past its last
    bucket, 128 away), RMSNorms, a GELU-gated or ReLU MLP, a head size apart from d_model / heads."""
    import transformers as tf
    path = _build(ckpt_root, f"t5-encoder-{ff}", family="t5", pooling="mean", feed_forward_proj=ff)
    model = tf.T5EncoderModel.from_pretrained(path, dtype=torch.float32).eval()  # (AutoModel: T5's encoder-decoder)
    tok = tf.AutoTokenizer.from_pretrained(path)
    texts = TEXTS + [LONG]
    assert len(tok(LONG)["input_ids"]) > 2 * 128 - 40
    with LLM(str(path), dtype="float32") as llm:
        assert llm.engine.default_pooling == "mean" and llm.engine.runner.model.relative_bias
        outs = llm.embed(texts)
        for text, out in zip(texts, outs):
            assert _close(out.embedding, _pooled(_hidden(model, tok, text), "mean", True)), text[:20]
    with torch.no_grad():  # (the bias matters: without it transformers' vectors differ)
        model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.zero_()
    assert not _close(_pooled(_hidden(model, tok, LONG), "mean", True), outs[-1].embedding, 1e-3)
