"""A prompt longer than the model could take is refused before it is tokenized (issue 49: an 8 MB prompt cost every
other user seconds and the server a gigabyte); truncate_prompt_tokens still takes long texts, tokenizing their tail."""
from __future__ import annotations

import httpx
import pytest

from streamer import LLM, SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer
from tests.server_utils import LiveServer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex the jovial boxer "


def test_max_token_chars_bounds_every_token(llama_dir):
    tok = Tokenizer.from_pretrained(llama_dir)
    longest = max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size))
    assert 1 <= longest <= tok.max_token_chars
    text = WORDS * 50
    assert len(tok.encode(text)) * tok.max_token_chars >= len(text)


class CountingTokenizer:
    """Counts the characters handed to encode (the tokenizer's work)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.chars = tok, 0

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)


def test_offline_refuses_untokenized(llm):
    engine = llm.engine
    spy = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    try:
        limit = engine.max_model_len * spy.max_token_chars
        with pytest.raises(ValueError, match="max_model_len") as e:
            llm.generate(WORDS * (limit // len(WORDS) + 2), SamplingParams(max_tokens=2))
        assert "characters" in str(e.value)
        assert spy.chars == 0  # refused on its length alone
        out = llm.generate("hello there", SamplingParams(max_tokens=2, temperature=0))  # the engine goes on
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        engine.tokenizer = spy.tok


def test_truncation_tokenizes_the_tail_only(llm):
    engine = llm.engine
    tok = engine.tokenizer
    keep = 40
    text = WORDS * (20 * engine.max_model_len * tok.max_token_chars // len(WORDS))
    whole = tok.encode(text)
    spy = engine.tokenizer = CountingTokenizer(tok)
    try:
        out = llm.generate(text, SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=keep))
    finally:
        engine.tokenizer = tok
    assert out[0].prompt_token_ids == whole[-keep:]  # the same tokens as cutting the whole text's
    assert 0 < spy.chars < len(text) // 4


@pytest.fixture(scope="module")
def live(llama_dir):
    with LiveServer(llama_dir, max_body_bytes=32 << 20) as server:
        yield server


def _huge(live) -> str:
    engine = live.engine
    return "x" * (engine.max_model_len * engine.tokenizer.max_token_chars + 1)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", lambda s: {"model": "m", "prompt": s, "max_tokens": 2}),
    ("/v1/completions", lambda s: {"model": "m", "prompt": ["hi", s], "max_tokens": 2}),
    ("/v1/chat/completions", lambda s: {"model": "m", "messages": [{"role": "user", "content": s}],
                                        "max_tokens": 2}),
    ("/tokenize", lambda s: {"model": "m", "prompt": s}),
    ("/v1/embeddings", lambda s: {"model": "m", "input": s}),
])
def test_server_refuses_before_tokenizing(live, path, body):
    engine = live.engine._core
    spy = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            r = http.post(path, json={**body(_huge(live)), "model": live.model_name})
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert "max_model_len" in err["message"] and err["type"] == "invalid_request_error"
            assert spy.chars < 1000  # (the other prompt of a list, the chat template's own text)
            ok = http.post("/v1/completions", json={"model": live.model_name, "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text[:300]
    finally:
        engine.tokenizer = spy.tok


def test_server_chat_truncation_takes_long_texts(live):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={
            "model": live.model_name, "messages": [{"role": "user", "content": _huge(live)}], "max_tokens": 1,
            "truncate_prompt_tokens": 30})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] == 30


def test_auto_body_limit_is_what_the_model_can_take(llama_dir):
    """With no --max-body-bytes, a text-only model's limit is the most a request could need (between 1 and 8 MiB):
    an 8 MB prompt is refused (413) by its Content-Length, before its body is read, and a body within it is served."""
    from streamer.server.app import DEFAULT_MAX_BODY_BYTES, MIN_AUTO_BODY_BYTES
    with LiveServer(llama_dir) as server:
        engine = server.engine
        limit = server.app.state.server.max_body_bytes
        need = 12 * engine.max_model_len * engine.tokenizer.max_token_chars
        assert limit == min(max(need, MIN_AUTO_BODY_BYTES), DEFAULT_MAX_BODY_BYTES)
        assert limit < 8_000_000  # (this model: 8 MB is far past what it takes)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = b'{"model": "m", "max_tokens": 2, "prompt": "' + b"x" * 8_000_000 + b'"}'
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text[:300]
            assert r.json()["error"]["code"] == "request_too_large"
            near = "x" * (limit - 1000)  # within the limit: read, then refused as too long for the model (400)
            r = http.post("/v1/completions", json={"model": server.model_name, "prompt": near, "max_tokens": 2})
            assert r.status_code == (400 if len(near) > need // 12 else 200), r.text[:300]
            ok = http.post("/v1/completions", json={"model": server.model_name, "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text[:300]


def test_auto_body_limit_keeps_8_mib_for_prompt_embeds(llama_dir):
    from streamer.server.app import DEFAULT_MAX_BODY_BYTES
    with LiveServer(llama_dir, enable_prompt_embeds=True) as server:
        assert server.app.state.server.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    with LiveServer(llama_dir, max_body_bytes=3 << 20) as server:  # an explicit limit is kept
        assert server.app.state.server.max_body_bytes == 3 << 20
