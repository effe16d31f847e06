"""Media URL fetching without server-side request forgery (streamer/multimodal/media_fetch.py): loopback and other non-public
addresses refused however spelled, redirects checked hop by hop, one deadline per fetch, a byte cap, one error text
for every failure, and the allow-list (EngineConfig.allowed_media_domains). Every connection here goes to a local
HTTP server on 127.0.0.1; public addresses are only classified, never connected to."""
from __future__ import annotations

import base64
import io
import logging
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytest
from PIL import Image

from streamer.config import EngineConfig
from streamer.multimodal import media_fetch
from streamer.multimodal.audio_prompts import load_audio
from streamer.multimodal.inputs import MAX_IMAGE_BYTES, load_image, load_video
from streamer.multimodal.media_fetch import MAX_REDIRECTS, FetchPolicy, fetch, is_public_address

FAILED = "could not fetch the image URL"
LOCAL = FetchPolicy(allowed_domains=("127.0.0.1",))
SIZE = (13, 7)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # (quiet)
        pass

    def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("Content-Length", headers.get("Content_Length", str(len(body))))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.hits.append(self.path)  # type: ignore[attr-defined]
        self.server.hosts.append(self.headers["Host"])  # type: ignore[attr-defined]
        port = self.server.server_address[1]
        path = self.path
        if path == "/cat.png":  # (as most servers answer a request saying Connection: close)
            self._send(200, PNG, Content_Type="image/png", Connection="close")
            self.close_connection = True
        elif path == "/to-localhost":  # off the allowed host, to a loopback name
            self._send(302, Location=f"http://localhost:{port}/cat.png")
        elif path.startswith("/chain/"):  # /chain/N: N more redirects, then the image (relative Locations)
            n = int(path.rsplit("/", 1)[1])
            self._send(302 if n % 2 else 307, Location=f"/chain/{n - 1}" if n > 0 else "/cat.png")
        elif path == "/loop":
            self._send(301, Location="/loop")
        elif path == "/401":
            self._send(401, b"who are you?", WWW_Authenticate="Basic")
        elif path == "/text":
            self._send(200, b"hello, not an image", Content_Type="text/plain")
        elif path == "/huge":  # a Content-Length far over the cap, then nothing: refused without waiting
            self.send_response(200)
            self.send_header("Content-Length", str(10 ** 12))
            self.end_headers()
            self.wfile.flush()
            time.sleep(3)
        elif path == "/chunked":  # no Content-Length, more bytes than the cap
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"400\r\n" + b"x" * 0x400 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/short":  # the body ends before its Content-Length
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(PNG[:10])
            self.close_connection = True
        elif path in ("/drip", "/drip-headers"):  # a byte every 0.5 s: each read succeeds within any timeout
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
            body = b"x" * 100
            if path == "/drip":
                self.wfile.write(head)
                self.wfile.flush()
            try:
                for b in (body if path == "/drip" else head + body)[:40]:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
            self.close_connection = True
        else:
            self._send(404, b"no such thing")


def _serve(tls: Optional[ssl.SSLContext] = None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    server.hits, server.hosts = [], []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def media_server() -> Iterator[ThreadingHTTPServer]:
    server = _serve()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def server(media_server) -> ThreadingHTTPServer:
    media_server.hits.clear()  # type: ignore[attr-defined]
    media_server.hosts.clear()  # type: ignore[attr-defined]
    return media_server


def _port(server: ThreadingHTTPServer) -> int:
    return server.server_address[1]


def _url(server: ThreadingHTTPServer, path: str = "/cat.png") -> str:
    return f"http://127.0.0.1:{_port(server)}{path}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- non-public hosts
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "[::1]", "127.1", "0.0.0.0", "0x7f.0.0.1",
                                  "[::ffff:127.0.0.1]", "LOCALHOST.", "127.0.0.1."])
def test_loopback_urls_are_refused_by_default(server, host: str) -> None:
    """Loopback however spelled (a name, a decimal or hex number, IPv6, IPv4-mapped IPv6, 0.0.0.0): refused with
    the one error text, without a connection (the local server sees nothing)."""
    url = f"http://{host}:{_port(server)}/cat.png"
    with pytest.raises(ValueError) as e:
        load_image(url)
    assert str(e.value) == FAILED
    with pytest.raises(ValueError, match="^could not fetch the video URL$"):
        load_video(url)
    with pytest.raises(ValueError, match="^could not fetch the audio URL$"):
        load_audio(url)
    assert server.hits == []


def test_the_allow_list_fetches_from_a_local_server(server) -> None:
    im = load_image(_url(server), LOCAL)
    assert im.size == SIZE
    assert np.array_equal(np.asarray(im), np.asarray(Image.open(io.BytesIO(PNG))))
    assert server.hits == ["/cat.png"]
    assert load_image(_url(server), FetchPolicy(allowed_domains=("10.0.0.0", "127.0.0.1"))).size == SIZE
    # The engine config's field is what the server and LLM.chat use
    policy = FetchPolicy.of(EngineConfig(allowed_media_domains=["127.0.0.1"]))
    assert policy == LOCAL and load_image(_url(server), policy).size == SIZE


def test_hosts_off_the_allow_list_are_refused_before_any_connection(server) -> None:
    for url, policy in [(_url(server), FetchPolicy(allowed_domains=("localhost",))),
                        (f"http://localhost:{_port(server)}/cat.png", LOCAL),
                        (f"http://2130706433:{_port(server)}/cat.png", LOCAL),
                        (_url(server), FetchPolicy(allowed_domains=()))]:
        with pytest.raises(ValueError, match="only from its allowed media domains"):
            load_image(url, policy)
    with pytest.raises(ValueError, match="does not fetch image URLs"):
        load_image(_url(server), FetchPolicy(allow_remote=False, allowed_domains=("127.0.0.1",)))
    for url in [f"http://user:pw@127.0.0.1:{_port(server)}/cat.png", f"http://127.0.0.1:{_port(server)}@x/",
                "http://127.0.0.1:99999/cat.png", "http://127.0.0.1:0/", "http:///cat.png"]:
        with pytest.raises(ValueError, match="not a valid http"):
            load_image(url, LOCAL)
    assert server.hits == []


def test_allow_list_matching() -> None:
    policy = FetchPolicy(allowed_domains=("Example.COM.", "[::1]", "127.0.0.1"))
    assert policy.allowed_domains == ("example.com", "::1", "127.0.0.1")
    for host in ("example.com", "media.example.com", "a.b.example.com", "EXAMPLE.com.", "::1", "0:0::1",
                 "127.0.0.1"):
        assert policy.trusts(host), host
    for host in ("badexample.com", "example.com.evil.net", "example.co", "com", "x.127.0.0.1", "127.0.0.2",
                 "2130706433", "localhost", "", "::2"):
        assert not policy.trusts(host), host
    assert not FetchPolicy().trusts("example.com")


# ---------------------------------------------------------------------------------------------- redirects
def test_redirects_are_checked_hop_by_hop(server) -> None:
    with pytest.raises(ValueError) as e:  # allowed host -> loopback name not on the list
        load_image(_url(server, "/to-localhost"), LOCAL)
    assert str(e.value) == FAILED
    assert server.hits == ["/to-localhost"]  # the redirect's target was never asked
    server.hits.clear()
    assert load_image(_url(server, f"/chain/{MAX_REDIRECTS - 1}"), LOCAL).size == SIZE  # MAX_REDIRECTS hops
    assert server.hits[-1] == "/cat.png" and len(server.hits) == MAX_REDIRECTS + 1
    server.hits.clear()
    with pytest.raises(ValueError) as e:
        load_image(_url(server, f"/chain/{MAX_REDIRECTS}"), LOCAL)
    assert str(e.value) == FAILED
    assert "/cat.png" not in server.hits and len(server.hits) == MAX_REDIRECTS + 1
    server.hits.clear()
    with pytest.raises(ValueError) as e:
        load_image(_url(server, "/loop"), LOCAL)
    assert str(e.value) == FAILED and server.hits == ["/loop"] * (MAX_REDIRECTS + 1)


# ---------------------------------------------------------------------------------------------- deadline, size
@pytest.mark.parametrize("path", ["/drip", "/drip-headers"])
def test_a_dripping_server_is_cut_off_at_the_deadline(server, path: str) -> None:
    """A byte every 0.5 s keeps any per-read timeout happy: the fetch's one deadline (1.5 s here) ends it."""
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        load_image(_url(server, path), FetchPolicy(allowed_domains=("127.0.0.1",), deadline_s=1.5))
    took = time.monotonic() - start
    assert str(e.value) == FAILED
    assert 1.4 < took < 2.5, took


def test_the_default_deadline_is_15_seconds_in_all() -> None:
    assert FetchPolicy().deadline_s == media_fetch.FETCH_DEADLINE_S == 15.0


def test_too_large_bodies_are_refused(server) -> None:
    start = time.monotonic()
    for path in ("/huge", "/chunked"):
        with pytest.raises(ValueError) as e:
            fetch(_url(server, path), LOCAL, "image", 10_000)
        assert str(e.value) == FAILED
    assert time.monotonic() - start < 2  # /huge is refused on its header, not after its 3 s of silence
    assert len(fetch(_url(server, "/chunked"), LOCAL, "image", 20 * 0x400)) == 20 * 0x400  # (at the cap: read)
    with pytest.raises(ValueError, match=f"^{FAILED}$"):
        fetch(_url(server, "/cat.png"), LOCAL, "image", len(PNG) - 1)
    assert fetch(_url(server, "/cat.png"), LOCAL, "image", MAX_IMAGE_BYTES) == PNG


# ---------------------------------------------------------------------------------------------- no oracle
def test_every_fetch_failure_reads_the_same(server, caplog) -> None:
    """A refused port, a 404, a 401, a cut-short body, a refused address, too many redirects: one text (no port
    scanning through error messages); the reason is in the debug log. A fetched non-image fails in decoding."""
    closed = f"http://127.0.0.1:{_closed_port()}/cat.png"
    cases = [(closed, LOCAL), (_url(server, "/nothing-here"), LOCAL), (_url(server, "/401"), LOCAL),
             (_url(server, "/short"), LOCAL), (_url(server), FetchPolicy()),
             (_url(server, "/loop"), LOCAL), (_url(server, "/to-localhost"), LOCAL)]
    texts = set()
    with caplog.at_level(logging.DEBUG, logger="streamer.multimodal.media_fetch"):
        for url, policy in cases:
            with pytest.raises(ValueError) as e:
                load_image(url, policy)
            texts.add(str(e.value))
    assert texts == {FAILED}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for reason in ("HTTP 404", "HTTP 401", "ConnectionRefusedError", "non-public", "ended after 10 of 1000",
                   "more than 5 redirects", "not an allowed media domain"):
        assert reason in logged, reason
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(_url(server, "/text"), LOCAL)
    data = "data:image/png;base64," + base64.b64encode(PNG).decode()  # data: URLs as before, whatever the policy
    assert load_image(data, FetchPolicy(allow_remote=False)).size == load_image(data).size == SIZE


# ---------------------------------------------------------------------------------------------- https
@pytest.fixture(scope="module")
def tls_server(tmp_path_factory) -> Iterator[tuple[ThreadingHTTPServer, Path, list]]:
    """An HTTPS media server on 127.0.0.1 with a self-signed certificate for the name "localhost" only; the SNI
    names its clients send."""
    from shutil import which
    if which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    names: list = []
    ctx.sni_callback = lambda sock, name, _: names.append(name)
    server = _serve(ctx)
    yield server, cert, names
    server.shutdown()
    server.server_close()


def test_https_connects_to_the_vetted_address_with_sni_and_checks_the_certificate(tls_server, monkeypatch,
                                                                                  caplog) -> None:
    server, cert, names = tls_server
    url = f"https://localhost:{_port(server)}/cat.png"
    policy = FetchPolicy(allowed_domains=("localhost",))
    with caplog.at_level(logging.DEBUG, logger="streamer.multimodal.media_fetch"):
        with pytest.raises(ValueError, match=f"^{FAILED}$"):  # self-signed: not trusted by the system's CAs
            load_image(url, policy)
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
    monkeypatch.setattr(media_fetch, "_tls_context", lambda: ssl.create_default_context(cafile=str(cert)))
    names.clear()
    assert load_image(url, policy).size == SIZE
    assert names[-1] == "localhost" and server.hosts[-1] == f"localhost:{_port(server)}"
    with pytest.raises(ValueError, match=f"^{FAILED}$"):  # the certificate names localhost, not 127.0.0.1
        load_image(f"https://127.0.0.1:{_port(server)}/cat.png", LOCAL)
    with pytest.raises(ValueError, match=f"^{FAILED}$"):  # loopback refused by default over https too
        load_image(url)
    assert server.hits == ["/cat.png"]


# ---------------------------------------------------------------------------------------------- classification
PUBLIC = ["8.8.8.8", "1.1.1.1", "9.255.255.255", "11.0.0.1", "172.15.255.255", "172.32.0.1", "192.169.0.1",
          "100.63.255.255", "100.128.0.1", "2606:4700:4700::1111", "2001:4860:4860::8888", "::ffff:8.8.8.8",
          "64:ff9b::808:808", "2002:808:808::"]
NOT_PUBLIC = [
    "10.0.0.1", "10.255.255.255", "172.16.0.1", "172.31.255.255", "192.168.0.1", "192.168.255.255",
    "169.254.169.254", "169.254.0.1", "100.64.0.1", "100.127.255.255", "0.0.0.0", "0.1.2.3", "127.0.0.1",
    "127.255.255.254", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255", "192.0.0.1", "192.0.2.1",
    "198.18.0.1", "198.51.100.1", "203.0.113.1",
    "::", "::1", "fe80::1", "fe80::1%eth0", "febf::1", "fc00::1", "fd12:3456::1", "fec0::1", "ff02::1", "ff0e::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::ffff:0.0.0.0", "::127.0.0.1",
    "2002:7f00:1::", "2002:a00:1::", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b:1::1", "2001:db8::1",
    "2001::1", "100::1"]


@pytest.mark.parametrize("addr", PUBLIC + NOT_PUBLIC)
def test_address_classification(addr: str) -> None:
    assert is_public_address(addr) is (addr in PUBLIC)


def test_config_validates_allowed_media_domains() -> None:
    assert EngineConfig().allowed_media_domains is None
    cfg = EngineConfig(allowed_media_domains=["Media.Internal", "10.1.2.3", "[::1]", "media.internal"])
    assert cfg.allowed_media_domains == ("media.internal", "10.1.2.3", "::1")
    assert EngineConfig(allowed_media_domains=()).allowed_media_domains == ()
    for bad in ("media.internal", [""], [" "], [3], {"a": 1}, ["http://media.internal"], ["media.internal:80"],
                ["a/b"], ["a..b"], ["user@host"]):
        with pytest.raises(ValueError, match="allowed_media_domains"):
            EngineConfig(allowed_media_domains=bad)


def test_cli_flag_reaches_the_engine_config() -> None:
    from streamer.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["serve", "m", "--allowed-media-domains", "127.0.0.1", "media.internal"])
    assert engine_kwargs(args)["allowed_media_domains"] == ["127.0.0.1", "media.internal"]
    assert engine_kwargs(build_parser().parse_args(["serve", "m"]))["allowed_media_domains"] is None


# ---------------------------------------------------------------------------------------------- the live server
def _llava(ckpt_root: Path) -> Path:
    from tests.checkpoints import make_llava_checkpoint
    path = ckpt_root / "llava_clip"
    if not (path / "config.json").exists():
        make_llava_checkpoint(path)
    return path


def _chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


def test_the_server_refuses_loopback_image_urls(ckpt_root: Path, server) -> None:
    """Through every route that reads images (chat, /v1/responses, /v1/messages, /tokenize): a 400 with the one
    text, nothing fetched, and the engine keeps serving."""
    import httpx

    from tests.server_utils import LiveServer
    data = "data:image/png;base64," + base64.b64encode(PNG).decode()
    with LiveServer(_llava(ckpt_root)) as live:
        h = httpx.Client(base_url=live.url, timeout=60)
        model = live.model_name
        for url in (_url(server), f"http://localhost:{_port(server)}/cat.png", f"http://[::1]:{_port(server)}/",
                    f"http://2130706433:{_port(server)}/cat.png", f"http://127.0.0.1:{_closed_port()}/"):
            bodies = [("/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": _chat(url)}),
                      ("/tokenize", {"model": model, "messages": _chat(url)}),
                      ("/v1/responses", {"model": model, "max_output_tokens": 2, "input": [
                          {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                       {"type": "input_text", "text": "What is it?"}]}]}),
                      ("/v1/messages", {"model": model, "max_tokens": 2, "messages": [
                          {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}},
                                                       {"type": "text", "text": "What is it?"}]}]})]
            for route, body in bodies:
                r = h.post(route, json=body)
                assert r.status_code == 400, (route, url, r.text)
                assert FAILED in r.text, (route, r.text)
            r = h.post("/v1/chat/completions", json=bodies[0][1])
            err = r.json()["error"]
            assert err["message"] == FAILED and err["code"] == "invalid_image" and err["type"]
        assert server.hits == []
        r = h.post("/v1/chat/completions", json={"model": model, "max_tokens": 4, "messages": _chat(data)})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    with LiveServer(_llava(ckpt_root), allowed_media_domains=("127.0.0.1",)) as live:
        h = httpx.Client(base_url=live.url, timeout=60)
        by_url = h.post("/v1/chat/completions", json={"model": live.model_name, "max_tokens": 4,
                                                      "temperature": 0.0, "messages": _chat(_url(server))})
        assert by_url.status_code == 200, by_url.text
        assert server.hits == ["/cat.png"]
        by_data = h.post("/v1/chat/completions", json={"model": live.model_name, "max_tokens": 4,
                                                       "temperature": 0.0, "messages": _chat(data)})
        assert by_url.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
        assert by_url.json()["usage"]["prompt_tokens"] == by_data.json()["usage"]["prompt_tokens"]
        r = h.post("/v1/chat/completions", json={"model": live.model_name, "max_tokens": 2,
                                                 "messages": _chat(_url(server, "/to-localhost"))})
        assert r.status_code == 400 and r.json()["error"]["message"] == FAILED


def test_llm_chat_fetches_under_the_engine_policy(ckpt_root: Path, server) -> None:
    """LLM.chat reads image URLs as the server does: loopback refused by default, fetched when allowed."""
    from streamer import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    llm = LLM(str(_llava(ckpt_root)), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match=f"^{FAILED}$"):
        llm.chat(_chat(_url(server)), greedy)
    assert server.hits == []
    allowed = LLM(str(_llava(ckpt_root)), dtype="float32", num_kv_blocks=32, allowed_media_domains=["127.0.0.1"])
    data = "data:image/png;base64," + base64.b64encode(PNG).decode()
    by_url, by_data = allowed.chat(_chat(_url(server)), greedy), allowed.chat(_chat(data), greedy)
    assert by_url[0].prompt_token_ids == by_data[0].prompt_token_ids
    assert by_url[0].outputs[0].token_ids == by_data[0].outputs[0].token_ids and server.hits == ["/cat.png"]
