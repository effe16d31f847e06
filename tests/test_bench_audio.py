"""`streamer bench --endpoint transcriptions`: synthetic WAV uploads as multipart forms, OpenAI's transcription
events timed (TTFT at the first delta with text), audio seconds per second, failures; against the scripted fake
server, and once against a live `streamer serve` of a tiny Whisper."""
from __future__ import annotations

import asyncio
import io
import json
import wave
from pathlib import Path
from typing import Any

import pytest

from streamer.bench import main
from streamer.bench.cli import run_loop
from streamer.bench.client import HttpClient, RawResponse
from streamer.bench.datasets import audio_requests, count_tokens, load_tokenizer
from streamer.bench.fake_server import FakeServer, Plan
from streamer.bench.metrics import summarize
from streamer.bench.report import format_compare, format_summary
from streamer.bench.runner import RunConfig, multipart_body, run, to_result
from streamer.bench.testing import make_tokenizer

PIECES = ["", "Hello", " there", "", " world"]  # (empty deltas are not tokens)
DELAYS = [0.01, 0.06, 0.02, 0.01, 0.03]


def test_synthetic_clips_are_16k_mono_pcm_and_differ() -> None:
    reqs = audio_requests(3, 1.5, seed=4)
    for r in reqs:
        with wave.open(io.BytesIO(r.audio)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16000, 1, 2, 24000)
        assert r.audio_seconds == 1.5 and r.prompt == "" and r.output_len == 0
    assert len({r.audio for r in reqs}) == 3
    assert [r.audio for r in audio_requests(3, 1.5, seed=4)] == [r.audio for r in reqs]  # seeded
    assert audio_requests(1, 1.5, seed=5)[0].audio != reqs[0].audio


def test_multipart_body_and_content_type_reach_the_server() -> None:
    """Client.post sends the given content type (JSON by default); the fake parses the hand-built form."""
    heads: list[bytes] = []

    async def go() -> None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                heads.append(head)
                size = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await r.readexactly(size)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await w.drain()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = HttpClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", timeout=10)
        assert (await client.post("/x", b"{}")).status == 200
        assert (await client.post("/x", b"a=1", content_type="text/plain; charset=x")).status == 200
        await client.close()
        srv.close()

    asyncio.run(go())
    assert b"\r\nContent-Type: application/json\r\n" in heads[0]
    assert b"\r\nContent-Type: text/plain; charset=x\r\n" in heads[1] and b"application/json" not in heads[1]
    with pytest.raises(ValueError, match="holds the boundary"):
        multipart_body({"a": "x--B y"}, [], boundary="B")


def test_streamed_deltas_are_timed_and_counted(tmp_path: Path) -> None:
    """TTFT waits for the first delta with text; ITL spans the deltas with text; output = those deltas (no
    tokenizer, no token usage), or the tokenizer's count of the transcript; audio s/s = clip seconds / duration."""
    reqs = audio_requests(4, 2.0, seed=1)
    tok = load_tokenizer(make_tokenizer(tmp_path / "tok"))
    with FakeServer(lambda i, b: Plan(pieces=PIECES, delays=DELAYS, done_delay=0.02)) as srv:
        cfg = RunConfig(base_url=srv.base_url, endpoint="transcriptions", language="de", max_concurrency=2)
        out = run_loop(run(cfg, reqs))
        out_tok = run_loop(run(cfg, reqs[:1], tok))
    form = srv.received[0]
    assert {k: form[k] for k in ("model", "language", "stream", "response_format")} == \
        {"model": "fake", "language": "de", "stream": "true", "response_format": "json"}
    f = form["file"]
    assert (f["filename"], f["content_type"], f["rate"], f["channels"], f["sampwidth"], f["seconds"]) == \
        ("audio.wav", "audio/wav", 16000, 1, 2, 2.0)
    assert len({r["file"]["sha1"] for r in srv.received[:4]}) == 4  # every request its own clip
    for r in out.results:
        assert r.success, r.error
        assert r.ttft >= DELAYS[0] + DELAYS[1]  # (causal: the first text comes after both delays)
        # (each text arrives no sooner than the server sent it; a gap alone may shrink when the one before came late)
        assert len(r.itl) == 2 and r.ttft + r.itl[0] >= sum(DELAYS[:3]) and r.ttft + sum(r.itl) >= sum(DELAYS[:5])
        assert r.latency >= sum(DELAYS) + 0.02
        assert (r.output_len, r.output_len_source, r.audio_seconds) == (3, "chunks", 2.0)
    s = summarize(out.results, out.duration)
    assert s.total_audio_seconds == 8.0 and s.audio_throughput == pytest.approx(8.0 / out.duration)
    table = format_summary(s, transcriptions=True)
    assert "Audio throughput (audio s/s):" in table and "Total audio (s):" in table
    assert "Total input tokens" not in table and "Time to First Token" in table
    r = out_tok.results[0]
    assert (r.output_len, r.output_len_source) == (count_tokens(tok, "Hello there world"), "tokenizer")
    assert summarize(out_tok.results, 1.0).audio_throughput == 2.0


def _vllm_style(chunks: list[dict[str, Any]]) -> RawResponse:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    return RawResponse(status=200, headers={"content-type": "text/event-stream"}, body=bytearray(body),
                       read_times=[2.0], read_ends=[len(body)], complete=True)


def test_other_answer_shapes() -> None:
    """vLLM's chat-style transcription chunks (token usage) and an empty transcript both succeed; a stream without
    its end fails."""
    req = audio_requests(1, 1.0)[0]
    res, text = to_result(_vllm_style([{"choices": [{"delta": {"content": "hi"}}]},
                                       {"choices": [{"delta": {"content": " you"}}]},
                                       {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}]),
                          req, 1.0, "transcriptions")
    assert res.success and text is None and (res.output_len, res.output_len_source, res.prompt_len) == (3, "usage", 7)
    res, text = to_result(_vllm_style([{"type": "transcript.text.done", "text": "", "usage": {"seconds": 1}}]),
                          req, 1.0, "transcriptions")
    assert res.success and res.output_len == 0 and res.ttft == res.latency == 1.0 and text == ""
    cut = _vllm_style([{"type": "transcript.text.delta", "delta": "a"}])
    cut.body = cut.body[: cut.body.index(b"data: [DONE]")]
    res, _ = to_result(cut, req, 1.0, "transcriptions")
    assert not res.success and "stream ended without transcript.text.done" in res.error


def test_cli_run_with_failures_json_answers_and_result_file(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Through `streamer bench`: no tokenizer needed; HTTP errors, error events and cut streams are failures with
    their messages; a non-streamed JSON answer is one chunk; the table and `compare` show audio throughput."""
    def script(i: int, form: dict[str, Any]) -> Plan:
        return [Plan(status=500), Plan(error_after=1), Plan(disconnect_after=1)][i] if i < 3 else Plan()

    res = tmp_path / "r.json"
    with FakeServer(script) as srv:
        assert main(["--base-url", srv.base_url, "--endpoint", "transcriptions", "--num-prompts", "6",
                     "--audio-seconds", "3", "--language", "", "--max-concurrency", "1", "--progress", "off",
                     "--save-result", str(res)]) == 0
        assert "language" not in srv.received[0] and srv.received[0]["file"]["seconds"] == 3.0
        assert main(["--base-url", srv.base_url, "--endpoint", "transcriptions", "--num-prompts", "1",
                     "--audio-seconds", "0.5", "--extra-body", '{"stream": false}', "--progress", "off",
                     "--save-result", str(tmp_path / "j.json")]) == 0
    table = capsys.readouterr().out
    assert "Audio throughput (audio s/s):" in table and "scripted failure" in table
    doc = json.loads(res.read_text())
    s, reqs = doc["summary"], doc["requests"]
    assert (s["completed"], s["failed"], s["total_audio_seconds"]) == (3, 3, 9.0)
    assert s["audio_throughput"] == pytest.approx(9.0 / s["duration"])
    errors = dict(s["errors"])
    assert "HTTP 500: scripted failure" in errors and "error in stream: scripted failure" in errors
    assert any(e.startswith("server closed the connection") for e in errors)
    ok = [r for r in reqs if r["success"]]
    assert all(r["output_len"] == 3 and r["output_len_source"] == "chunks" and len(r["itl"]) == 2 for r in ok)
    side = format_compare(doc, doc)
    assert "Audio throughput" in side and "Input throughput" not in side and "TTFT" in side
    j = json.loads((tmp_path / "j.json").read_text())["requests"][0]  # stream=false: the whole text at once
    assert j["success"] and j["ttft"] == j["latency"] > 0 and j["itl"] == [] and j["output_len"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--audio-seconds", "2"], "--audio-seconds needs --endpoint transcriptions"),
    (["--language", "en", "--endpoint", "chat"], "--language needs --endpoint transcriptions"),
    (["--endpoint", "transcriptions", "--audio-seconds", "0"], "must be > 0"),
    (["--endpoint", "transcriptions", "--images-per-request", "1"], "does not apply to --endpoint transcriptions"),
    (["--endpoint", "transcriptions", "--output-len", "8"], "does not apply to --endpoint transcriptions"),
    (["--endpoint", "transcriptions", "--audio-per-request", "1"], "does not apply to --endpoint transcriptions"),
    (["--audio-per-request", "1"], "--audio-per-request needs --endpoint chat"),
    (["--endpoint", "messages", "--audio-per-request", "1"], "--audio-per-request needs --endpoint chat"),
])
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--base-url", "http://127.0.0.1:9"] + argv) == 2
    assert message in capsys.readouterr().err


def test_live_whisper_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real `streamer serve` of a tiny random Whisper: every upload is transcribed, streamed and timed."""
    pytest.importorskip("transformers")
    from tests.server_utils import LiveServer
    from tests.whisper_checkpoints import make_whisper

    folder = make_whisper(tmp_path / "whisper")
    res = tmp_path / "r.json"
    with LiveServer(folder, dtype="float32", enforce_eager=True) as server:
        assert main(["--base-url", server.url, "--endpoint", "transcriptions", "--num-prompts", "4",
                     "--audio-seconds", "2", "--tokenizer", str(folder), "--progress", "off",
                     "--save-result", str(res)]) == 0
        server.wait_idle()
    assert "Audio throughput (audio s/s):" in capsys.readouterr().out
    doc = json.loads(res.read_text())
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["total_audio_seconds"]) == (4, 0, 8.0)
    assert s["audio_throughput"] > 0 and s["stats"]["ttft"]["mean"] > 0 and s["total_output_tokens"] > 0
    for r in doc["requests"]:
        assert 0 < r["ttft"] <= r["latency"] and r["output_len_source"] == "tokenizer"
