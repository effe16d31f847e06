"""Drives a workload against a server: arrival schedule, concurrency cap, warm-ups, progress, results."""
from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass, field
from time import perf_counter, process_time
from typing import Any, Optional, Sequence

import numpy as np

from streamer.bench.client import HttpClient, RawResponse, error_of, interpret, interpret_transcription
from streamer.bench.datasets import AnyTokenizer, SampleRequest
from streamer.bench.metrics import RequestResult
from streamer.bench.remote_tokenizer import RemoteTokenizerError


@dataclass
class RunConfig:
    base_url: str
    model: Optional[str] = None  # None: the first id of GET /v1/models
    endpoint: str = "completions"  # "completions" | "chat" | "messages" (Anthropic's) | "embeddings" | "transcriptions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    num_warmups: int = 0
    reset_prefix_cache: bool = False  # POST /reset_prefix_cache before the timed run (after any warm-ups)
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: Optional[str] = None
    timeout: float = 3600.0
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = False
    language: Optional[str] = "en"  # transcriptions: the `language` form field (None: not sent, the server detects)


@dataclass
class RunOutput:
    model: str
    duration: float
    results: list[RequestResult]
    client_cpu: float = 0.0  # CPU seconds this process spent during the timed run (all threads)


class BenchError(Exception):
    """A run that cannot start (no model name, unreachable server); the message is for the user."""


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send offsets (s): all 0 for an infinite rate, else a gamma process (shape = burstiness, mean gap
    1/rate; burstiness 1 is Poisson). The first request goes at 0."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if n else np.zeros(0)


# One boundary for every upload (the Content-Type is the run's); multipart_body checks that no part holds it.
BOUNDARY = "streamer-bench-a61f3c0e9d2b47b5b8e4"


def content_type(endpoint: str) -> str:
    return f"multipart/form-data; boundary={BOUNDARY}" if endpoint == "transcriptions" else "application/json"


def multipart_body(fields: dict[str, str], files: Sequence[tuple[str, str, str, bytes]],
                   boundary: str = BOUNDARY) -> bytes:
    """A multipart/form-data body (RFC 7578): text `fields`, then `files` as (field name, file name, content type,
    bytes) parts."""
    sep = b"--" + boundary.encode()
    parts: list[bytes] = []
    for name, value in fields.items():
        parts += [sep, b'\r\nContent-Disposition: form-data; name="%s"\r\n\r\n' % _quoted(name),
                  value.encode(), b"\r\n"]
    for name, filename, ctype, data in files:
        head = b'\r\nContent-Disposition: form-data; name="%s"; filename="%s"\r\nContent-Type: %s\r\n\r\n' % (
            _quoted(name), _quoted(filename), ctype.encode())
        parts += [sep, head, data, b"\r\n"]
    parts += [sep, b"--\r\n"]
    body = b"".join(parts)
    if body.count(sep) != len(fields) + len(files) + 1:
        raise ValueError("a multipart field holds the boundary")  # (random audio: practically never)
    return body


def _quoted(name: str) -> bytes:
    """A name inside a quoted Content-Disposition parameter, escaped as browsers do (WHATWG's form encoding)."""
    return name.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A").encode()


def transcription_body(cfg: RunConfig, model: str, req: SampleRequest) -> bytes:
    """OpenAI's transcription form: the clip as `file`, streamed json; --extra-body entries as more fields."""
    fields = {"model": model, "response_format": "json", "stream": "true", "temperature": f"{cfg.temperature:g}"}
    if cfg.language:
        fields["language"] = cfg.language
    for k, v in cfg.extra_body.items():
        fields[k] = v if isinstance(v, str) else json.dumps(v)
    return multipart_body(fields, [("file", "audio.wav", "audio/wav", req.audio)])


def request_body(cfg: RunConfig, model: str, req: SampleRequest) -> bytes:
    if cfg.endpoint == "transcriptions":
        return transcription_body(cfg, model, req)
    if cfg.endpoint == "embeddings":  # one input a request, answered whole (nothing streams)
        return json.dumps({"model": model, "input": req.prompt, **cfg.extra_body}, ensure_ascii=False).encode()
    body: dict[str, Any] = {"model": model, "stream": True, "temperature": cfg.temperature}
    if cfg.endpoint == "messages":  # Anthropic's: usage always streams; images as base64 image blocks
        content: Any = req.prompt
        if req.images:
            content = [_anthropic_image(u) for u in req.images] + [{"type": "text", "text": req.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        body["max_tokens"] = req.output_len
    elif cfg.endpoint == "chat":
        body["stream_options"] = {"include_usage": True}
        content = req.prompt
        if req.images or req.audios:  # OpenAI's content parts: the images, the audio clips, then the text
            content = [{"type": "image_url", "image_url": {"url": u}} for u in req.images]
            content += [{"type": "input_audio", "input_audio": {"data": a, "format": "wav"}} for a in req.audios]
            content.append({"type": "text", "text": req.prompt})
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["stream_options"] = {"include_usage": True}
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; streamer's server accepts it too
    body.update(cfg.extra_body)
    return json.dumps(body, ensure_ascii=False).encode()


def _anthropic_image(url: str) -> dict[str, Any]:
    """A data: URL as an Anthropic base64 image block."""
    head, _, data = url.partition(",")
    return {"type": "image", "source": {"type": "base64", "media_type": head.removeprefix("data:").split(";")[0],
                                        "data": data}}


def endpoint_path(endpoint: str) -> str:
    return {"chat": "/chat/completions", "messages": "/messages", "embeddings": "/embeddings",
            "transcriptions": "/audio/transcriptions"}.get(endpoint, "/completions")


def to_result(resp: RawResponse, req: SampleRequest, sent: float,
              endpoint: str = "completions") -> tuple[RequestResult, Optional[str]]:
    """RequestResult (absolute `start`) plus the generated text when its tokens must still be counted."""
    res = RequestResult(prompt_len=req.prompt_len, asked_output_len=req.output_len, start=sent,
                        audio_seconds=req.audio_seconds)
    if resp.status != 200:
        res.error = error_of(resp)
        return res, None
    if endpoint == "embeddings":
        return embedding_result(resp, res, sent), None
    transcription = endpoint == "transcriptions"
    # (after a broken connection too: an error event says more)
    out = interpret_transcription(resp) if transcription else interpret(resp, messages=endpoint == "messages")
    if out.error:
        res.error = out.error
    elif resp.error:
        res.error = resp.error
    elif not out.done:
        res.error = {"messages": "stream ended without message_stop",
                     "transcriptions": "stream ended without transcript.text.done or data: [DONE]"}.get(
                         endpoint, "stream ended without data: [DONE]")
    elif not out.token_times and not transcription:
        res.error = "no token chunks in the stream"
    if res.error:
        return res, None
    # An empty transcript (silence, or sound without speech) is an answer: its "first token" is the end.
    times = out.token_times or [out.end_time]
    res.ttft = times[0] - sent
    res.itl = [b - a for a, b in zip(times, times[1:])]
    res.latency = out.end_time - sent
    res.success = True
    if out.prompt_tokens is not None:
        res.prompt_len = int(out.prompt_tokens)
    if out.completion_tokens is not None:
        res.output_len, res.output_len_source = int(out.completion_tokens), "usage"
        return res, None
    res.output_len, res.output_len_source = len(out.token_times), "chunks"
    return res, out.text


def embedding_result(resp: RawResponse, res: RequestResult, sent: float) -> RequestResult:
    """An embeddings answer: its latency (also its "first token": the whole answer comes at once), and the prompt
    tokens its usage counts; an answer without a vector of numbers is an error."""
    if resp.error or not resp.complete:
        res.error = resp.error or "response body cut short"
        return res
    try:
        doc = json.loads(bytes(resp.body))
        vec = doc["data"][0]["embedding"]
        ok = isinstance(vec, str) or (isinstance(vec, list) and len(vec) > 0
                                      and all(isinstance(x, (int, float)) for x in vec[:8]))
    except (ValueError, KeyError, IndexError, TypeError):
        ok, doc = False, {}
    if not ok:
        res.error = "no embedding in the response"
        return res
    res.latency = res.ttft = resp.read_times[-1] - sent if resp.read_times else 0.0
    res.prompt_len = int((doc.get("usage") or {}).get("prompt_tokens") or res.prompt_len)
    res.output_len, res.output_len_source, res.success = 0, "usage", True
    return res


class Progress:
    """A live one-line progress bar on stderr, redrawn on a timer (never per chunk or per request)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.failed = 0
        self.t0 = perf_counter()
        self._task: Optional[asyncio.Task[None]] = None

    def start(self) -> None:
        if self.enabled:
            self.t0 = perf_counter()
            self._task = asyncio.get_running_loop().create_task(self._tick())

    def add(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok

    def render(self) -> str:
        el = perf_counter() - self.t0
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        rate = self.done / el if el > 0 else 0.0
        return (f"\r[{bar:<30}] {self.done}/{self.total} requests, {self.failed} failed, "
                f"{rate:.1f} req/s, {el:.1f} s")

    async def _tick(self) -> None:
        while True:
            sys.stderr.write(self.render())
            sys.stderr.flush()
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            sys.stderr.write(self.render() + "\n")
            sys.stderr.flush()


@dataclass
class ServedModel:
    """What GET /v1/models says of a model: its id and, where the server reports them, its context length and its
    `root` (vLLM's and streamer's: the folder or hub name it was loaded from)."""
    id: str
    max_model_len: Optional[int] = None
    root: Optional[str] = None


async def list_models(client: HttpClient) -> list[ServedModel]:
    resp = await client.get("/models")
    if resp.error or resp.status != 200:
        raise BenchError(f"could not list the server's models ({error_of(resp)}); pass --model")
    try:
        cards = json.loads(bytes(resp.body))["data"]
        models = [ServedModel(str(c["id"]), _positive_int(c.get("max_model_len")),
                              c["root"] if isinstance(c.get("root"), str) and c["root"] else None) for c in cards]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BenchError("GET /v1/models returned no model list; pass --model") from None
    if not models:
        raise BenchError("GET /v1/models returned no model; pass --model")
    return models


def _positive_int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


async def discover_model(client: HttpClient) -> str:
    return (await list_models(client))[0].id


def count_output_tokens(pending: list[tuple[RequestResult, str]], tok: Optional[AnyTokenizer]) -> None:
    """Counts tokens of texts whose stream had no usage chunk; after the run, in one batch. (A server's tokenizer
    that stopped answering leaves them counted by chunks.)"""
    if tok is None or not pending:
        return
    try:
        encs = tok.encode_batch([text for _, text in pending], add_special_tokens=False)
    except RemoteTokenizerError as e:
        print(f"streamer bench: warning: output tokens counted by chunks, not tokens: {e}", file=sys.stderr)
        return
    for (res, _), enc in zip(pending, encs):
        res.output_len, res.output_len_source = len(enc.ids), "tokenizer"


async def run(cfg: RunConfig, requests: Sequence[SampleRequest], tok: Optional[AnyTokenizer] = None) -> RunOutput:
    """Warm-ups (results dropped), then the timed run on one event loop."""
    client = HttpClient(cfg.base_url, timeout=cfg.timeout, api_key=cfg.api_key)
    try:
        model = cfg.model or await discover_model(client)
        path = endpoint_path(cfg.endpoint)
        bodies = [request_body(cfg, model, r) for r in requests]
        if cfg.num_warmups:
            await _warmup(cfg, client, path, bodies)
        if cfg.reset_prefix_cache:
            await _reset_prefix_cache(client)
        return await _timed(cfg, client, path, model, requests, bodies, tok)
    finally:
        await client.close()


async def _reset_prefix_cache(client: HttpClient) -> None:
    """A cold prefix cache for the timed run: the warm-ups (or an earlier run) sent the same prompts."""
    r = await client.post("/reset_prefix_cache", b"", root=True)
    if r.error or r.status != 200:
        why = r.error or f"HTTP {r.status}: {bytes(r.body[:200]).decode(errors='replace')}"
        raise BenchError(f"--reset-prefix-cache: POST /reset_prefix_cache failed ({why}); vLLM serves it only "
                         "with VLLM_SERVER_DEV_MODE=1")


async def _warmup(cfg: RunConfig, client: HttpClient, path: str, bodies: list[bytes]) -> None:
    sem = asyncio.Semaphore(cfg.max_concurrency or cfg.num_warmups)

    async def one(body: bytes) -> None:
        async with sem:
            await client.post(path, body, content_type=content_type(cfg.endpoint))

    await asyncio.gather(*(one(bodies[i % len(bodies)]) for i in range(cfg.num_warmups)))


async def _timed(cfg: RunConfig, client: HttpClient, path: str, model: str, requests: Sequence[SampleRequest],
                 bodies: list[bytes], tok: Optional[AnyTokenizer]) -> RunOutput:
    loop = asyncio.get_running_loop()
    n = len(requests)
    offsets = arrival_times(n, cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[Optional[RequestResult]] = [None] * n
    pending: list[tuple[RequestResult, str]] = []
    progress = Progress(n, cfg.progress)
    ctype = content_type(cfg.endpoint)

    async def one(i: int) -> None:
        if sem is not None:
            await sem.acquire()
        sent = perf_counter()
        try:
            resp = await client.post(path, bodies[i], content_type=ctype)
        except Exception as e:  # a bug or odd server must cost one request, not the run
            resp = RawResponse(error=f"{type(e).__name__}: {e}")
        finally:
            if sem is not None:
                sem.release()
        res, text = to_result(resp, requests[i], sent, cfg.endpoint)
        if text is not None:
            pending.append((res, text))
        results[i] = res
        progress.add(res.success)

    progress.start()
    cpu0 = process_time()
    t0 = perf_counter()
    tasks = []
    for i in range(n):
        while (wait := t0 + offsets[i] - perf_counter()) > 0:  # loop: uvloop timers may wake <1 ms early
            await asyncio.sleep(wait)
        tasks.append(loop.create_task(one(i)))
    await asyncio.gather(*tasks)
    duration = perf_counter() - t0
    cpu = process_time() - cpu0
    progress.stop()
    count_output_tokens(pending, tok)
    final = [r for r in results if r is not None]
    for r in final:
        r.start -= t0
    return RunOutput(model=model, duration=duration, results=final, client_cpu=cpu)
