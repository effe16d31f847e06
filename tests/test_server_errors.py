"""Bad input never gives a 5xx and never stops the server; auth guards every endpoint but /health."""
from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamer.server.chat_template import ChatTemplate
from tests.server_utils import LiveServer

MAX_BODY = 64 * 1024
COMPLETION = {"model": "llama", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def live(llama_dir):
    with LiveServer(llama_dir, max_body_bytes=MAX_BODY) as server:
        yield server


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


def assert_error(r: httpx.Response, status: Any = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "param" in err and "code" in err
    return err


# ---------------------------------------------------------------------------------------------- strategies
wrong_type = st.one_of(st.text(max_size=4), st.lists(st.integers(-3, 3), max_size=3),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
not_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
huge = st.one_of(st.integers(min_value=2 ** 63), st.integers(max_value=-(2 ** 63) - 1),
                 st.sampled_from([1e30, -1e30, 1e308]))
not_int = st.one_of(wrong_type, st.booleans(), not_finite, st.floats(0.1, 0.9), huge)
not_number = st.one_of(wrong_type, st.booleans(), not_finite, st.sampled_from([1e39, -1e300, 10 ** 40]))
not_bool = st.one_of(st.text(max_size=4), st.integers(), st.lists(st.booleans(), max_size=2), not_finite)


def below(lo: float) -> st.SearchStrategy:
    return st.one_of(st.floats(max_value=lo, exclude_max=True, allow_nan=False, allow_infinity=False),
                     st.integers(max_value=int(lo) - 1) if lo == int(lo) else st.nothing())


def above(hi: float) -> st.SearchStrategy:
    return st.floats(min_value=hi, exclude_min=True, allow_nan=False, allow_infinity=False)


SHARED: dict[str, st.SearchStrategy] = {
    "model": st.one_of(st.text(max_size=8).filter(lambda s: s != "llama"), st.integers(), st.lists(st.text())),
    "max_tokens": st.one_of(not_int, st.integers(max_value=0), st.integers(10 ** 4, 2 ** 62)),
    "n": st.one_of(not_int, st.integers(max_value=0), st.integers(65, 10 ** 9)),
    "temperature": st.one_of(not_number, below(0)),
    "top_p": st.one_of(not_number, below(0), st.just(0), above(1)),
    "top_k": st.one_of(not_int, st.integers(max_value=-2)),
    "min_p": st.one_of(not_number, below(0), above(1)),
    "presence_penalty": st.one_of(not_number, below(-2), above(2)),
    "frequency_penalty": st.one_of(not_number, below(-2), above(2)),
    "repetition_penalty": st.one_of(not_number, below(0), st.just(0)),
    "seed": st.one_of(wrong_type, st.booleans(), not_finite, huge.filter(lambda v: not isinstance(v, float))),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1), st.just([""]), st.just(""),
                      st.lists(st.text(min_size=1), min_size=65, max_size=70), st.just([["a"]])),
    "stop_token_ids": st.one_of(st.text(min_size=1), st.lists(st.integers(max_value=-1), min_size=1),
                                st.just([[1]]), st.just([1.5])),
    "min_tokens": st.one_of(not_int, st.integers(max_value=-1)),
    "stream": not_bool,
    "stream_options": st.one_of(st.text(), st.integers(), st.just({"include_usage": True})),
    "ignore_eos": not_bool,
    "skip_special_tokens": not_bool,
    "include_stop_str_in_output": not_bool,
    "priority": st.one_of(not_int, st.integers(min_value=2 ** 31)),
    "user": st.one_of(st.integers(), st.lists(st.text(), min_size=1)),
    "cache_salt": st.one_of(st.just(""), st.integers(), st.lists(st.text(), min_size=1)),
}

bad_prompt = st.one_of(
    st.just(""), st.just([]), st.just([[]]), st.just([""]), st.integers(), st.booleans(), st.just({"a": 1}),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3), st.lists(st.integers(10 ** 6, 10 ** 9), min_size=1),
    st.just([True, 1]), st.just([1, "a"]), st.just([["a"]]), st.just([[1, [2]]]), st.just([600] * 3),
    st.just(list(range(1, 2)) * 600),  # longer than max_model_len
)
COMPLETION_FIELDS = {**SHARED, "prompt": bad_prompt, "logprobs": st.one_of(not_int, st.integers(21, 10 ** 6), below(0)),
                     "echo": not_bool}

bad_message = st.one_of(
    st.integers(), st.text(), st.just({}), st.just({"role": "wizard", "content": "x"}),
    st.builds(lambda r: {"role": r, "content": "x"}, st.text(max_size=8).filter(
        lambda r: r not in {"system", "developer", "user", "assistant", "tool"})),
    st.just({"role": "user"}), st.just({"content": "x"}), st.just({"role": "user", "content": 5}),
    st.just({"role": "user", "content": []}), st.just({"role": "user", "content": [{"type": "image_url"}]}),
    st.just({"role": "user", "content": [{"type": "text", "text": 3}]}), st.just({"role": None, "content": "x"}),
)
CHAT_FIELDS = {**SHARED,
               "messages": st.one_of(st.just([]), st.text(), st.integers(), st.just({"role": "user"}),
                                     st.lists(bad_message, min_size=1, max_size=3)),
               "max_completion_tokens": SHARED["max_tokens"],
               "logprobs": not_bool, "top_logprobs": st.one_of(not_int, st.integers(21, 10 ** 6), below(0))}


def corrupt(base: dict, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """The valid `base` body with one field made invalid, plus a few unknown fields (which must be ignored)."""
    def build(name: str, value: Any, extra: dict, stream: bool) -> dict:
        body = {**extra, **base, name: value}
        if stream and name not in ("stream", "stream_options"):
            body["stream"] = True  # errors must come before any SSE byte
        return body
    names = sorted(fields)
    return st.sampled_from(names).flatmap(lambda name: st.builds(
        build, st.just(name), fields[name],
        st.dictionaries(st.text(min_size=1, max_size=6).map(lambda k: "x_" + k), st.integers(), max_size=2),
        st.booleans()))


def dumps(body: dict) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals, which Python's json accepts


raw_garbage = st.one_of(
    st.binary(max_size=64), st.text(max_size=64).map(str.encode),
    st.sampled_from([b"", b"null", b"[]", b"42", b'"x"', b"{", b'{"prompt": "a",}', b"\xff\xfe",
                     b'{"prompt": NaN}', b'{"prompt": "a", "max_tokens": Infinity}',
                     b"[" * 30_000 + b"]" * 30_000, b'{"a":' * 5000 + b"1" + b"}" * 5000]),
    st.integers(34, 200).map(lambda d: b'{"prompt": "a", "user": ' + b"[" * d + b"]" * d + b"}"),
)


# ---------------------------------------------------------------------------------------------- tests
@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=corrupt(COMPLETION, COMPLETION_FIELDS))
def test_malformed_completion_bodies(http, body):
    assert_error(http.post("/v1/completions", content=dumps(body), headers={"content-type": "application/json"}))


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=corrupt(CHAT, CHAT_FIELDS))
def test_malformed_chat_bodies(http, body):
    assert_error(http.post("/v1/chat/completions", content=dumps(body), headers={"content-type": "application/json"}))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=raw_garbage, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
def test_garbage_bodies(http, raw, path):
    assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)


def test_server_survives_and_serves(live, http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={**COMPLETION, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    live.wait_idle()


def test_oversized_bodies_get_413(http):
    big = {"model": "llama", "prompt": "a" * (MAX_BODY + 10)}
    assert_error(http.post("/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 8192
        yield json.dumps(COMPLETION).encode()
    assert_error(http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}),
                 413)
    assert_error(http.post("/v1/completions", content=b"x" * (4 << 20)), 413)
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": list(range(1, 601))}, 400, "prompt"),  # longer than max_model_len (512)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # past the vocab
    ("/v1/completions", {"prompt": "hi", "logit_bias": [5]}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "allowed_token_ids": []}, 400,
     "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21}, 400,
     "prompt_logprobs"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    # Errors found past parsing (the context's length) name the field the client wrote.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000}, 400,
     "max_completion_tokens"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 10_000}, 400, "max_output_tokens"),
    ("/v1/responses", {"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    # Tools are checked whole, whatever tool_choice says.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": 5}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                           "tool_calls": ["abc"]}]}, 400, "messages[1].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, "messages[0].name"),
    # Past 64 bits, orjson reads an integer literal as a float: it must not round into range.
    ("/v1/completions", {"prompt": "hi", "seed": -2 ** 63 - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 64}, 400, "seed"),
])
def test_specific_errors(http, path, body, status, param):
    for stream in (False, True):
        b = {**body, "stream": True} if stream and path.startswith("/v1") and "stream_options" not in body else body
        err = assert_error(http.post(path, json=b), status)
        assert err["param"] == param, err


def test_error_messages_name_what_the_client_wrote(http):
    err = assert_error(http.post("/v1/chat/completions", json={**CHAT, "tool_choice": 5}), 400)
    assert "tool_choice must be" in err["message"], err  # (not "no tools were given")
    err = assert_error(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": None,
                                                              "max_completion_tokens": 10_000}), 400)
    assert "max_completion_tokens" in err["message"] and "max_tokens" not in err["message"], err
    err = assert_error(http.post("/v1/chat/completions", json={
        **CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}]}), 400)
    assert "tools[0].function.parameters" in err["message"], err
    assert http.post("/v1/chat/completions", json={**CHAT, "seed": -1}).status_code == 200  # (any 64-bit seed)


def test_not_found_and_method_errors(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_model_without_chat_template(live, http):
    state = live.call(lambda: _swap_template(live, ChatTemplate(None, {})))
    try:
        err = assert_error(http.post("/v1/chat/completions", json=CHAT), 400)
        assert "chat template" in err["message"] and err["code"] == "no_chat_template"
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    finally:
        live.call(lambda: _swap_template(live, state))


def _swap_template(live: LiveServer, template: ChatTemplate) -> ChatTemplate:
    server = live.app.state.server
    old, server.chat_template = server.chat_template, template
    return old


def test_template_raise_exception_is_a_400(live, http):
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                            "{% endif %}{{ messages[0]['content'] }}", {})
    state = live.call(lambda: _swap_template(live, template))
    try:
        err = assert_error(http.post("/v1/chat/completions", json={**CHAT, "messages": [
            {"role": "assistant", "content": "x"}]}), 400)
        assert "first must be user" in err["message"]
    finally:
        live.call(lambda: _swap_template(live, state))


# ---------------------------------------------------------------------------------------------- auth
@pytest.fixture(scope="module")
def secured(llama_dir):
    with LiveServer(llama_dir, api_key="s3cret") as server:
        yield server


ENDPOINTS = [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
             ("POST", "/v1/chat/completions", CHAT), ("GET", "/metrics", None),
             ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/v1/models/llama", None), ("POST", "/invocations", COMPLETION)]


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "s3cret", "Basic s3cret", "Bearer s3cretx", "Bearer"])
def test_auth_rejects(secured, auth):
    headers = {"Authorization": auth} if auth is not None else {}
    with httpx.Client(base_url=secured.url, timeout=60, headers=headers) as h:
        for method, path, body in [*ENDPOINTS, ("GET", "/nothing", None), ("POST", "/v1/completions", "x")]:
            r = h.request(method, path, json=body) if body is not None else h.request(method, path)
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert h.get("/health").status_code == 200 and h.get("/ping").status_code == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_auth_accepts_the_key(secured, scheme):
    with httpx.Client(base_url=secured.url, timeout=60, headers={"Authorization": f"{scheme} s3cret"}) as h:
        for method, path, body in ENDPOINTS:
            r = h.request(method, path, json=body) if body is not None else h.request(method, path)
            assert r.status_code == 200, (path, r.text)
    import asyncio

    async def main():
        async with openai.AsyncOpenAI(base_url=secured.base_url, api_key="nope", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
        async with openai.AsyncOpenAI(base_url=secured.base_url, api_key="s3cret", max_retries=0) as c:
            out = await c.completions.create(model="llama", prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens <= 2
    asyncio.run(main())


def test_streamed_chat_refuses_prompt_logprobs(http):
    body = {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "prompt_logprobs" and "streamed chat" in err["message"]


# ---------------------------------------------------------------------------------------------- hostile-client audit
@pytest.mark.parametrize("body,param", [
    ({"text": "x"}, "text"), ({"text": ["format"]}, "text"), ({"text": 3}, "text"),
    ({"text": {"format": "json"}}, "text.format"), ({"metadata": "x"}, "metadata"),
    ({"metadata": {"a": 1}}, "metadata"), ({"tool_choice": 5}, "tool_choice"), ({"user": 5}, "user"),
    ({"previous_response_id": 5}, "previous_response_id")])
@pytest.mark.parametrize("mode", [{}, {"stream": True}, {"background": True}])
def test_responses_fields_of_the_wrong_type_are_400(http, body, param, mode):
    """`text` (and the other fields a response echoes) of the wrong type: a 400 naming it, before anything starts
    (it was an AttributeError: a 500, a 200 stream cut short, a 500 for a background response)."""
    r = http.post("/v1/responses", json={"model": "llama", "input": "hi", "max_output_tokens": 2, **body, **mode})
    assert assert_error(r, 400)["param"] == param


@pytest.mark.parametrize("penalty", [1000, 1e30, 3.4e38, -1000, -1e30, -3.4e38, 0])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_takes_any_finite_length_penalty(http, path, penalty):
    """length_penalty past where length ** length_penalty is a float (OverflowError, ZeroDivisionError): the
    beams are ranked in log space; NaN, infinities and non-numbers are a 400 naming the field."""
    body = {"model": "llama", "use_beam_search": True, "n": 3, "max_tokens": 3, "length_penalty": penalty,
            **({"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    for bad in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b'"2"', b"true", b"[1]"):
        raw = json.dumps({**body, "length_penalty": 0}).encode().replace(b'"length_penalty": 0',
                                                                         b'"length_penalty": ' + bad)
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        err = assert_error(r, 400)
        assert err["param"] in ("length_penalty", None), err  # (NaN / Infinity literals: not JSON at all)


def test_an_unhandled_error_is_a_json_500_and_the_connection_stays_usable(live, monkeypatch, caplog):
    """A bug in a handler: a 500 with OpenAI's error body, logged once with its traceback, and the client's
    keep-alive connection serves its next request (starlette re-raised it and uvicorn dropped the connection).
    A stream that fails after its first byte ends there, its connection usable too."""
    import http.client

    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    def broken():
        raise RuntimeError("a bug")
    monkeypatch.setattr(live.app.state.server, "_model_cards", broken)

    async def events():
        yield b"data: 1\n\n"
        raise RuntimeError("a bug mid-stream")

    async def stream(request):
        return StreamingResponse(events(), media_type="text/event-stream")
    live.app.router.routes.append(Route("/test-broken-stream", stream))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        with caplog.at_level("ERROR"):
            for _ in range(2):
                conn.request("GET", "/v1/models")
                r = conn.getresponse()
                assert r.status == 500 and r.getheader("content-type").startswith("application/json")
                assert json.loads(r.read()) == {"error": {"message": "internal server error",
                                                          "type": "internal_server_error", "param": None,
                                                          "code": None}}
                conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION),
                             headers={"content-type": "application/json"})
                r = conn.getresponse()
                assert r.status == 200 and json.loads(r.read())["choices"]
            conn.request("GET", "/test-broken-stream")
            r = conn.getresponse()
            assert r.status == 200 and r.read() == b"data: 1\n\n"
            conn.request("GET", "/version")
            r = conn.getresponse()
            assert r.status == 200 and "version" in json.loads(r.read())
        conn.close()
    finally:
        live.app.router.routes.pop()
    records = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in records] == ["unhandled error on GET /v1/models"] * 2 + [
        "unhandled error on GET /test-broken-stream"]
    assert all(r.exc_info is not None for r in records)


@pytest.mark.parametrize("path,prompts", [("/v1/completions", 1), ("/v1/completions", 2),
                                          ("/v1/chat/completions", 1)])
def test_client_leaving_a_beam_search_logs_nothing(live, caplog, path, prompts):
    """A client that disconnects during a beam search: the search stops and nothing is logged above debug (a
    cancelled gather of several prompts' searches logged "exception was never retrieved" with a traceback)."""
    import gc
    import socket
    import time
    body = {"model": "llama", "use_beam_search": True, "n": 4, "max_tokens": 400, "ignore_eos": True,
            **({"prompt": ["hello"] * prompts} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": "hi"}]})}
    raw = json.dumps(body).encode()
    with caplog.at_level("WARNING"):
        steps = lambda: live.call(lambda: live.engine.engine.num_steps)  # noqa: E731
        start = steps()
        s = socket.create_connection(("127.0.0.1", live.port))
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        # (a step counter, not `running`: each beam round's requests run for one step, so a poll of `running` on
        # a loaded box can fall between rounds every time)
        deadline = time.monotonic() + 30
        while steps() < start + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps() >= start + 3, "the beam search did not start"
        s.close()
        live.wait_idle()
        assert steps() < start + 400, "the search ran to the end: leaving did not stop it"
        live.call(gc.collect)
        time.sleep(0.2)
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []


def test_a_client_that_left_is_not_an_unhandled_error():
    """A write to a closed socket (ClientDisconnect), however wrapped (a cause, an anyio exception group), is logged
    at debug by the outermost layer, not as an unhandled error."""
    from starlette.requests import ClientDisconnect

    from streamer.server.app import _client_left
    try:
        try:
            raise ClientDisconnect()
        except ClientDisconnect as e:
            raise RuntimeError("Caught handled exception, but response already started.") from e
    except RuntimeError as wrapped:
        assert _client_left(wrapped)
    assert not _client_left(ValueError())
    import builtins
    group = getattr(builtins, "ExceptionGroup", None)
    if group is not None:  # (Python 3.11+)
        assert _client_left(group("task group", [ValueError(), ClientDisconnect()]))
        assert not _client_left(group("g", [KeyError()]))
