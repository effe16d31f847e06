"""The served model's tokenizer, borrowed through the server's own POST /tokenize and /detokenize (vLLM's routes;
streamer's server serves them too): `streamer bench --base-url URL` against a server whose model folder is not on
this machine.

It does only what the bench asks of a tokenizer: text to ids (random prompts' exact lengths, a prompt file's prompt
and reply lengths, the output of streams that report no usage) and ids to text (random prompts are sampled as ids and
decoded). Random prompts sample the vocabulary's ids; its size is found by asking /detokenize which ids it accepts
(streamer's server refuses an id past the vocabulary with a 400): about 25 requests, once. Two differences from a
local tokenizer: /detokenize has no skip_special_tokens (special tokens come back as their text), and the only
special tokens known are those /tokenize adds to an empty prompt (a BOS), so a random prompt may hold another
special token (its text; the server reads it back as that token, so the lengths still hold). Every call is one
HTTP request on a kept-alive connection: a random prompt costs two to six, which a server on this machine answers
in a few milliseconds.
"""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

_FIRST_PROBE = 1024  # the vocabulary search starts here and doubles
_MAX_VOCAB = 1 << 26  # a /detokenize that accepts ids past this checks none: it cannot size the vocabulary


class RemoteTokenizerError(RuntimeError):
    """The server's /tokenize or /detokenize did not answer as expected; the message says how."""


@dataclass(frozen=True, slots=True)
class RemoteEncoding:
    ids: list[int]


class RemoteTokenizer:
    """The subset of `tokenizers.Tokenizer` the bench uses (encode, encode_batch, decode), answered by a server."""

    def __init__(self, base_url: str, *, model: Optional[str] = None, api_key: Optional[str] = None,
                 timeout: float = 60.0) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"expected http(s)://HOST:PORT, got {base_url!r}")
        self.base_url = base_url
        self._https, self._host, self._port = u.scheme == "https", u.hostname, u.port
        self._root = u.path.rstrip("/").removesuffix("/v1")  # /tokenize lives beside /v1, not under it
        self.model, self.timeout = model, timeout
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._conn: Optional[http.client.HTTPConnection] = None
        self._vocab_size: Optional[int] = None
        self._special: Optional[frozenset[int]] = None
        self.requests = 0  # HTTP requests sent (the tests count them)

    def __repr__(self) -> str:
        return f"RemoteTokenizer({self.base_url!r}, model={self.model!r})"

    # --- the Tokenizer subset --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> RemoteEncoding:
        doc = self._call("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
        tokens = doc.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RemoteTokenizerError(f"POST /tokenize answered without a `tokens` list of ids: {_show(doc)}")
        return RemoteEncoding(tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[RemoteEncoding]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The server's decoding of `ids`. (skip_special_tokens is not sent: /detokenize keeps special tokens.)"""
        doc = self._call("/detokenize", {"tokens": [int(t) for t in ids]})
        text = doc.get("prompt")
        if not isinstance(text, str):
            raise RemoteTokenizerError(f"POST /detokenize answered without a `prompt` string: {_show(doc)}")
        return text

    # --- what random prompts sample ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The number of ids /detokenize accepts: the smallest it refuses, found by doubling then bisecting."""
        if self._vocab_size is None:
            if not self._accepts(0):
                raise RemoteTokenizerError("POST /detokenize refuses token id 0")
            lo, hi = 0, _FIRST_PROBE  # invariant once hi is refused: lo accepted, hi refused
            while self._accepts(hi):
                lo, hi = hi, hi * 2
                if hi > _MAX_VOCAB:
                    raise RemoteTokenizerError(f"POST /detokenize accepts token ids past {lo}: it does not say "
                                               "how large the vocabulary is")
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self._accepts(mid) else (lo, mid)
            self._vocab_size = hi
        return self._vocab_size

    def special_ids(self) -> frozenset[int]:
        """The special tokens known from here: those /tokenize adds to an empty prompt (a BOS, where it has one)."""
        if self._special is None:
            self._special = frozenset(self.encode("", add_special_tokens=True).ids)
        return self._special

    def token_ids(self) -> range:
        return range(self.vocab_size)

    def check(self, decode: bool) -> None:
        """Raises RemoteTokenizerError unless /tokenize answers (and, with `decode`, /detokenize and the vocabulary
        search do): called once before a run relies on it."""
        self.encode("Hello, world", add_special_tokens=False)
        if decode:
            self.decode(self.encode("Hello, world", add_special_tokens=False).ids)
            _ = self.vocab_size

    # --- HTTP ------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _accepts(self, token_id: int) -> bool:
        status, doc = self._post("/detokenize", {"tokens": [token_id]})
        if status == 200 and isinstance(doc, dict) and isinstance(doc.get("prompt"), str):
            return True
        if status in (400, 422):  # out of the vocabulary (422: a validating server's word for it)
            return False
        raise RemoteTokenizerError(f"POST /detokenize answered HTTP {status}: {_message(doc)}")

    def _call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        status, doc = self._post(route, body)
        if status != 200 or not isinstance(doc, dict):
            raise RemoteTokenizerError(f"POST {route} answered HTTP {status}: {_message(doc)}")
        return doc

    def _post(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self.model is not None:
            body = {"model": self.model, **body}
        payload = json.dumps(body).encode()
        for attempt in (0, 1):  # a kept-alive connection the server has closed meanwhile: once more, on a new one
            if self._conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = cls(self._host, self._port, timeout=self.timeout)
            try:
                self.requests += 1
                self._conn.request("POST", self._root + route, payload, self._headers)
                resp = self._conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt or isinstance(e, (ConnectionRefusedError, TimeoutError)):
                    raise RemoteTokenizerError(f"POST {route} failed: {e or type(e).__name__}") from None
                continue
            if resp.will_close:
                self.close()
            try:
                return resp.status, json.loads(data)
            except ValueError:
                return resp.status, data[:200].decode(errors="replace")
        raise AssertionError("unreachable")  # pragma: no cover


def _message(doc: Any) -> str:
    """An OpenAI-style error body's message, else the body itself, short."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and "message" in doc["error"]:
        return str(doc["error"]["message"])[:200]
    if isinstance(doc, dict) and isinstance(doc.get("detail"), (str, list)):  # FastAPI's (vLLM's) errors
        return str(doc["detail"])[:200]
    return _show(doc)


def _show(doc: Any) -> str:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    return text[:200] + ("..." if len(text) > 200 else "")
