"""Audio in chat requests (OpenAI's input_audio parts, vLLM's audio_url parts) on a live server, through the real
`openai` client, on a tiny Qwen2-Audio checkpoint (tests/checkpoints.py): the reply is transformers' greedy one for
the same clips, streamed and not; /tokenize counts the clips' tokens; bad audio, audio for a text model and images
for an audio model get OpenAI-style 400s, and the server serves on with nothing left allocated."""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import requests

from streamer.models.audio_tower import audio_tokens
from tests.checkpoints import hf_qwen2_audio_greedy, make_checkpoint, make_qwen2_audio_checkpoint
from tests.server_utils import LiveServer
from tests.test_qwen2_audio import AUDIO_ID, noise, tone
from tests.test_server_audio import wav_bytes

openai = pytest.importorskip("openai")


def input_audio(clip: np.ndarray) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(clip)).decode(),
                                                   "format": "wav"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_audio_checkpoint(tmp_path_factory.mktemp("qwen2_audio_server"))


@pytest.fixture(scope="module")
def server(ckpt: Path):
    with LiveServer(ckpt, dtype="float32", enforce_eager=True) as s:
        yield s


def test_chat_with_audio_matches_transformers(server: LiveServer, ckpt: Path) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    clips = [noise(2.5, seed=31), tone(1.2, 660.0)]
    url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(clips[1])).decode()
    messages = [{"role": "user", "content": [input_audio(clips[0]),
                                             {"type": "audio_url", "audio_url": {"url": url}},
                                             {"type": "text", "text": "Compare them."}]}]
    tok = requests.post(server.url + "/tokenize", json={"model": server.model_name, "messages": messages,
                                                        "add_generation_prompt": True}, timeout=30).json()
    ids = tok["tokens"]
    assert ids.count(AUDIO_ID) == audio_tokens(250) + audio_tokens(120) == 62 + 30  # (2.5 s and 1.2 s)
    r = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8, temperature=0,
                                       logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    (ref_tokens, ref_lps), = hf_qwen2_audio_greedy(ckpt, [(ids, clips)], 8)
    assert r.choices[0].token_ids == ref_tokens
    np.testing.assert_allclose([t.logprob for t in r.choices[0].logprobs.content], ref_lps, atol=2e-3)
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_bad_audio_gets_400s_and_the_server_serves_on(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    bad = [
        ({"type": "input_audio", "input_audio": {"data": "!!!not base64", "format": "wav"}}, "invalid_audio",
         "not valid base64"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"}},
         "invalid_audio", "audio"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "w/a/v"}}, None, "input_audio"),
        ({"type": "audio_url", "audio_url": {"url": "ftp://x/a.wav"}}, "invalid_audio", "audio_url must be"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "images_not_supported",
         "takes no images"),
    ]
    for part, code, message in bad:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.chat.completions.create(model=server.model_name, max_tokens=2, messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "hi"}]}])
        if code is not None:
            assert e.value.body["code"] == code
    with pytest.raises(openai.BadRequestError, match="too short"):
        client.chat.completions.create(model=server.model_name, max_tokens=2, messages=[
            {"role": "user", "content": [input_audio(np.zeros(200, np.float32)), {"type": "text", "text": "hi"}]}])
    ok = client.chat.completions.create(model=server.model_name, max_tokens=2, messages=[
        {"role": "user", "content": [input_audio(noise(0.5, seed=2)), {"type": "text", "text": "hi"}]}])
    assert ok.choices[0].finish_reason in ("length", "stop")
    state = server.wait_idle()
    assert state["free"] == state["blocks"] and state["running"] == 0


def test_text_model_refuses_audio(tmp_path: Path) -> None:
    with LiveServer(make_checkpoint(tmp_path / "text"), enforce_eager=True) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        with pytest.raises(openai.BadRequestError, match="takes no audio") as e:
            client.chat.completions.create(model=server.model_name, max_tokens=2, messages=[
                {"role": "user", "content": [input_audio(noise(0.5, seed=1)), {"type": "text", "text": "hi"}]}])
        assert e.value.body["code"] == "audio_not_supported"
        ok = client.chat.completions.create(model=server.model_name, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content is not None


def test_bench_sends_audio(server: LiveServer, ckpt: Path, tmp_path: Path) -> None:
    """`streamer bench --audio-per-request` against the live server: every request carries clips of its own as
    input_audio parts, and the server's usage counts their tokens."""
    import json

    from streamer.bench import main
    before = server.engine._core.runner.encoder_cache.num_encoded  # type: ignore[union-attr]
    out = tmp_path / "bench.json"
    code = main(["--base-url", server.url, "--endpoint", "chat", "--tokenizer", str(ckpt), "--input-len", "8",
                 "--output-len", "3", "--num-prompts", "3", "--audio-per-request", "2", "--audio-seconds", "1.5",
                 "--save-result", str(out), "--progress", "off"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert [r["success"] for r in doc["requests"]] == [True] * 3
    assert all(r["prompt_len"] > 8 + 2 * audio_tokens(150) for r in doc["requests"])  # text, template, the clips'
    assert server.engine._core.runner.encoder_cache.num_encoded - before == 6  # type: ignore[union-attr]
