"""`python -m streamer serve` as a subprocess: prints its URL, logs each finished request, drains on SIGTERM
(the in-flight stream finishes, new connections are refused) and exits 0; a drain timeout aborts what is left."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from tests.server_utils import PipedProcess

REPO = Path(__file__).resolve().parents[1]


class ServeProcess(PipedProcess):
    def __init__(self, *args: str, env: Optional[dict[str, str]] = None) -> None:
        super().__init__([sys.executable, "-m", "streamer", "serve", *args], env)
        self.url = ""

    def wait_url(self, timeout: float = 180) -> str:
        """The URL the server prints once it listens (`--port 0` picks a free port)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.stderr}") from None
                continue
            m = re.search(r"at (https?://\S+)/v1", line)
            if m:
                self.url = m.group(1)
                return self.url
        raise AssertionError(f"no URL printed in {timeout}s:\n{self.stderr}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def long_dir(make_ckpt):
    return make_ckpt("server_long", family="llama", max_position_embeddings=4096)


def _data(line: str) -> Optional[str]:
    return line[6:] if line.startswith("data: ") else None


def test_sigterm_drains_in_flight_stream_then_exits_0(llama_dir):
    srv = ServeProcess(str(llama_dir), "--port", "0", "--dtype", "float32", "--num-kv-blocks", "256",
                       "--shutdown-timeout", "300", "--enforce-eager")
    try:
        url = srv.wait_url()
        port = url.rsplit(":", 1)[1]
        # A second server on the same port fails cleanly instead of hanging.
        clash = subprocess.run([sys.executable, "-m", "streamer", "serve", str(llama_dir), "--port", port,
                                "--num-kv-blocks", "64"], cwd=REPO, capture_output=True, text=True, timeout=180,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
        assert clash.returncode != 0
        body = {"model": llama_dir.name, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=url, timeout=300) as h, h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(d for d in map(_data, lines) if d is not None)
            assert json.loads(first)["choices"][0]["finish_reason"] is None
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            with pytest.raises(httpx.ConnectError):  # not accepting any more
                httpx.get(url + "/health", timeout=5)
            rest = [d for d in map(_data, lines) if d is not None]
        assert rest[-1] == "[DONE]"
        usage = json.loads(rest[-2])["usage"]
        assert usage["completion_tokens"] == 200
        assert json.loads(rest[-3])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(120) == 0
    finally:
        srv.kill()
    log = srv.stderr
    drain_at = log.index("SIGTERM: not accepting new connections")
    done = re.search(r"request (cmpl-\w+) finished: prompt_tokens=\d+ completion_tokens=200 "
                     r"finish_reason=length latency=[\d.]+s", log)
    assert done is not None, log
    assert drain_at < done.start()  # the request was still running when the signal came


def test_drain_timeout_aborts_and_api_key_from_env(long_dir):
    srv = ServeProcess(str(long_dir), "--port", "0", "--num-kv-blocks", "512", "--shutdown-timeout", "1",
                       "--served-model-name", "tiny", "--enforce-eager", env={"STREAMER_API_KEY": "k3y"})
    try:
        url = srv.wait_url()
        with httpx.Client(base_url=url, timeout=120) as h:
            assert h.get("/v1/models").status_code == 401
            assert h.get("/health").status_code == 200
            models = h.get("/v1/models", headers={"Authorization": "Bearer k3y"}).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with h.stream("POST", "/v1/completions", json=body, headers={"Authorization": "Bearer k3y"}) as r:
                lines = r.iter_lines()
                next(d for d in map(_data, lines) if d is not None)
                srv.proc.send_signal(signal.SIGTERM)
                rest = [d for d in map(_data, lines) if d is not None]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert srv.proc.wait(60) == 0
        assert "finish_reason=abort" in srv.stderr
    finally:
        srv.kill()


def test_second_sigterm_stops_at_once_without_tracebacks(long_dir):
    """A second signal while draining: one line, the in-flight requests end now (a stream with finish_reason
    "abort" and [DONE], a non-streamed request with a 503) and the process exits 0, with no traceback (uvicorn
    logged one per request the exit cancelled)."""
    srv = ServeProcess(str(long_dir), "--port", "0", "--num-kv-blocks", "512", "--shutdown-timeout", "300",
                       "--enforce-eager")
    try:
        url = srv.wait_url()
        results: dict[str, object] = {}

        def unstreamed() -> None:
            body = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        def beams() -> None:
            body = {"prompt": ["Hi", "Ho"], "max_tokens": 4000, "ignore_eos": True, "use_beam_search": True, "n": 2}
            try:
                results["beams"] = httpx.post(url + "/v1/completions", json=body, timeout=120).status_code
            except httpx.HTTPError as e:  # (cut: the search had no answer to give)
                results["beams"] = type(e).__name__
        threads = [threading.Thread(target=f, daemon=True) for f in (unstreamed, beams)]
        body = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=120) as h, h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(d for d in map(_data, lines) if d is not None)
            for t in threads:
                t.start()
            time.sleep(0.5)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest = [d for d in map(_data, lines) if d is not None]
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - start < 10
        for t in threads:
            t.join(30)
    finally:
        srv.kill()
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    assert results["plain"].status_code == 503, results["plain"].text  # type: ignore[union-attr]
    assert results["beams"] in (503, "RemoteProtocolError"), results
    log = srv.stderr
    assert log.count("SIGTERM again: exiting without waiting for in-flight requests") == 1
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_serve_without_model_uses_the_demo_model():
    from streamer.demo_model import DEFAULT_MODEL_NAME, DemoModelMissingError, default_model_path
    try:
        default_model_path()
    except DemoModelMissingError:
        pytest.skip("the embedded demo model is not in this checkout")
    srv = ServeProcess("--port", "0", "--num-kv-blocks", "64")
    try:
        url = srv.wait_url()
        with httpx.Client(base_url=url, timeout=120) as h:
            assert [m["id"] for m in h.get("/v1/models").json()["data"]] == [DEFAULT_MODEL_NAME]
            r = h.post("/v1/completions", json={"prompt": "def ", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["model"] == DEFAULT_MODEL_NAME
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4})
            assert r.status_code == 200, r.text  # (its template reads contents as strings)
            assert r.json()["usage"]["completion_tokens"] >= 1
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(60) == 0, srv.stderr[-4000:]
        # serve compiles the model by default, also on CPU: in the background, answering eagerly meanwhile
        assert "compiling in the background" in srv.stderr
    finally:
        srv.kill()


@pytest.mark.parametrize("flag,value,field", [("--cuda-graph-max-batch", "-1", "cuda_graph_max_batch"),
                                              ("--block-size", "0", "block_size"),
                                              ("--max-body-bytes", "0", "--max-body-bytes"),
                                              ("--chat-template", "/no/such/template.jinja", "chat_template"),
                                              ("--chat-template", "{% for m in messages %}", "chat_template"),
                                              ("--ssl-keyfile", "/no/key.pem", "--ssl-certfile"),
                                              ("--ssl-ca-certs", "/no/ca.pem", "--ssl-ca-certs")])
def test_bad_engine_argument_is_one_line_and_exit_2(flag, value, field):
    """Invalid engine arguments stop `serve` before it loads anything: an error naming the field, no traceback."""
    p = subprocess.run([sys.executable, "-m", "streamer", "serve", "--port", "0", flag, value], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2
    assert p.stderr.startswith("streamer serve: error:") and field in p.stderr
    assert "Traceback" not in p.stderr


def test_model_as_positional_or_flag(monkeypatch, capsys):
    """`serve M` and `serve --model M` (vLLM's users type either) name the same model; two different ones: exit 2."""
    import streamer.server.cli as server_cli
    from streamer.cli import main
    seen: list[Optional[str]] = []
    monkeypatch.setattr(server_cli, "cmd_serve", lambda args: seen.append(args.model) or 0)
    assert [main(a) for a in (["serve", "/m"], ["serve", "--model", "/m"], ["serve", "/m", "--model", "/m"],
                              ["serve"])] == [0, 0, 0, 0]
    assert seen == ["/m", "/m", "/m", None]
    with pytest.raises(SystemExit) as exc:
        main(["serve", "/a", "--model", "/b"])
    assert exc.value.code == 2 and "two models given" in capsys.readouterr().err


def test_vllm_command_lines_run_as_they_are(monkeypatch, capsys):
    """vLLM's common serve flags parse: no-ops (chunked prefill, remote code, request-log opt-out), aliases
    (prefix caching, uvicorn's log level, -tp); --enable-auto-tool-choice needs a parser, as in vLLM."""
    import streamer.server.cli as server_cli
    from streamer.cli import build_parser, engine_kwargs, main
    from streamer.config import EngineConfig
    vllm = ["serve", "/m", "--enable-prefix-caching", "--enable-chunked-prefill", "--trust-remote-code",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-requests",
            "--disable-log-stats", "--uvicorn-log-level", "warning", "-tp", "1", "--max-model-len", "512"]
    args = build_parser().parse_args(vllm)
    kw = engine_kwargs(args)
    assert kw["enable_prefix_caching"] is True and kw["max_model_len"] == 512 and args.log_level == "warning"
    assert "trust_remote_code" not in kw and "enable_chunked_prefill" not in kw
    assert engine_kwargs(build_parser().parse_args(["serve"]))["enable_prefix_caching"] is True
    assert engine_kwargs(build_parser().parse_args(["serve", "--no-enable-prefix-caching"]))[
        "enable_prefix_caching"] is False
    # The Python API takes vLLM's no-op arguments too; a chunked-prefill opt-out is refused, not ignored.
    cfg = EngineConfig.from_kwargs(None, trust_remote_code=True, disable_log_stats=True, enable_chunked_prefill=True)
    assert cfg.model is None
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineConfig.from_kwargs(None, enable_chunked_prefill=False)
    # Refused before anything loads (cmd_serve is the real one here).
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(server_cli, "cmd_serve", lambda a: seen.append(a) or 0)
    assert main(vllm) == 0 and seen[0].tool_call_parser == "hermes"


def test_startup_objects_are_frozen_while_serving():
    """What start-up made stays out of the cyclic GC's full collections while the server runs, and is handed back
    after."""
    import gc

    from streamer.server.cli import frozen_startup_objects
    made_at_startup = [[i] for i in range(1000)]
    assert gc.get_freeze_count() == 0
    with frozen_startup_objects():
        assert gc.get_freeze_count() >= len(made_at_startup)
    assert gc.get_freeze_count() == 0


def test_tls_and_cors(tmp_path):
    """`--ssl-keyfile/--ssl-certfile` serve HTTPS (the printed URL says so; plain HTTP gets no answer);
    `--allowed-origins` answers a browser's preflight before the API-key check and marks responses for that
    origin only."""
    from shutil import which
    if which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    srv = ServeProcess("--port", "0", "--enforce-eager", "--num-kv-blocks", "64", "--api-key", "k",
                       "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                       "--allowed-origins", "https://app.example")
    try:
        url = srv.wait_url()
        assert url.startswith("https://127.0.0.1:")
        with httpx.Client(base_url=url, verify=str(cert), timeout=120) as h:
            auth = {"Authorization": "Bearer k"}
            assert h.get("/v1/models", headers=auth).status_code == 200
            assert h.get("/v1/models").status_code == 401
            pre = h.options("/v1/chat/completions", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert pre.status_code == 200
            assert pre.headers["access-control-allow-origin"] == "https://app.example"
            r = h.post("/v1/completions", json={"prompt": "def ", "max_tokens": 2},
                       headers={**auth, "Origin": "https://app.example"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
            other = h.get("/v1/models", headers={**auth, "Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in other.headers
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is not served
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    finally:
        srv.kill()
