"""A standing hostile-client suite: hypothesis-generated bodies (tests/fuzz_bodies.py) for every POST endpoint of a
live server with every optional route on, each of which must get a status below 500 (a 4xx with the JSON error
shape), log no error, and leave the keep-alive connection usable; the server still answers /health at the end.
Plus regressions for what the fuzz (and bench/fuzz_server.py, its long run) found."""
from __future__ import annotations

import json
import shutil
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests import fuzz_bodies
from tests.server_utils import LiveServer

EXAMPLES_PER_ENDPOINT = 60  # x 26 endpoints: ~1,600 requests, about a minute on CPU


@pytest.fixture(scope="module")
def live(llama_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz") / fuzz_bodies.MODEL  # (a copy: its chat template is changed)
    shutil.copytree(llama_dir, model)
    fuzz_bodies.use_rich_template(model)
    server = LiveServer(model, **fuzz_bodies.SERVER_KWARGS)
    server.app_kwargs.update(fuzz_bodies.APP_KWARGS)
    with server:
        yield server


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as client:  # one keep-alive connection throughout
        yield client


@pytest.fixture(scope="module")
def errors(live):
    with fuzz_bodies.ErrorLog() as log:
        yield log


def check(http: httpx.Client, errors: fuzz_bodies.ErrorLog, method: str, path: str, headers: dict[str, str],
          raw: bytes) -> httpx.Response:
    logged = len(errors.records)
    try:
        r = http.request(method, path, content=raw, headers=headers)
    finally:
        if path == "/pause_generation":  # (whatever it answered: no pause outlives its request)
            http.post("/continue_generation")
    assert r.status_code < 500, (path, raw[:500], r.status_code, r.text[:1000])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), (path, r.headers)
        assert fuzz_bodies.error_shape(r.content), (path, raw[:500], r.text[:500])
    assert errors.records[logged:] == [], (path, raw[:500])
    return r


@pytest.mark.parametrize("path", fuzz_bodies.PATH_NAMES)
def test_every_post_endpoint_answers_hostile_bodies_below_500(http, errors, path):
    @settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, suppress_health_check=list(HealthCheck))
    @given(req=fuzz_bodies.request((path,)))
    def one(req: tuple[str, str, dict[str, str], bytes]) -> None:
        check(http, errors, *req)
    one()


# ---------------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("path,body", [
    # a role or an item type that is an array or an object: a set / dict lookup raised TypeError (unhashable)
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "hi"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": {"x": "user"}, "content": "hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": [{"role": ["user"], "content": "x"}], "max_output_tokens": 2}),
    ("/v1/responses", {"input": [{"type": ["x"]}], "max_output_tokens": 2}),
    ("/v1/responses", {"input": [{"type": {"a": 1}, "role": "user", "content": "x"}], "max_output_tokens": 2}),
    ("/tokenize", {"messages": [{"role": ["user"], "content": "hi"}]}),
    ("/v1/embeddings", {"messages": [{"role": {"r": 1}, "content": "hi"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": ["user"], "content": "hi"}]}),
    # a path the OS refuses to read (ENAMETOOLONG, ENOTDIR, EACCES...): an OSError was a 500
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "x" * 5000}),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/" + "a/" * 3000}),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc/passwd/x"}),
    ("/update_weights_from_disk", {"model_path": "x" * 5000}),
    ("/update_weights_from_disk", {"model_path": "/etc/passwd/x"}),
    ("/update_weights_from_disk", {"model_path": "/etc/passwd"}),
    ("/update_weights_from_disk", {"model_path": "/proc/self/mem"}),
])
def test_found_by_the_fuzz(http, errors, path, body):
    r = check(http, errors, "POST", path, {"content-type": "application/json"}, json.dumps(body).encode())
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error"), err
    if "path" in path or "lora" in path:
        assert len(err["message"]) < 500 and err["param"] in ("lora_path", "model_path"), err


def test_stored_responses_continued_cancelled_listed_deleted(http, errors):
    """The store's routes with real ids and hostile queries (the fuzz's bodies name ids that are not there)."""
    def post(body: dict[str, Any]) -> httpx.Response:
        return check(http, errors, "POST", "/v1/responses", {"content-type": "application/json"},
                     json.dumps(body).encode())
    first = post({"input": "hi", "max_output_tokens": 2})
    assert first.status_code == 200
    rid = first.json()["id"]
    for body in ({"previous_response_id": rid, "input": [{"role": ["user"], "content": "x"}]},
                 {"previous_response_id": rid, "input": "again", "text": "x"},
                 {"previous_response_id": [rid], "input": "again"}):
        assert post({"max_output_tokens": 2, **body}).status_code == 400
    assert post({"previous_response_id": rid, "input": "again", "max_output_tokens": 2}).status_code == 200
    for method, url in (("POST", f"/v1/responses/{rid}/cancel"), ("GET", f"/v1/responses/{rid}/input_items?limit=x"),
                        ("GET", f"/v1/responses/{rid}/input_items?limit=99999999999999999999999"),
                        ("GET", f"/v1/responses/{rid}/input_items?order=up"),
                        ("GET", f"/v1/responses/{rid}/input_items?after=nope"),
                        ("GET", f"/v1/responses/{rid}/input_items?order=asc&limit=1"),
                        ("GET", f"/v1/responses/{rid}"), ("DELETE", f"/v1/responses/{rid}"),
                        ("GET", f"/v1/responses/{rid}")):
        check(http, errors, method, url, {}, b"")


def test_health_after_the_fuzz(live, http, errors):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": fuzz_bodies.MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    live.wait_idle()  # nothing leaked: every KV block back, nothing running or waiting
    assert errors.records == []
