"""Hostile bodies against every POST endpoint of a live server: none may get a 5xx (or hang, or drop the
connection), and the server must still answer /health at the end.

    python bench/fuzz_server.py [--bodies 5000] [--seed 0] [--concurrency 8]           # starts its own server
    python bench/fuzz_server.py --url http://127.0.0.1:8000 [--model NAME]             # an already running one

Bodies come from tests/fuzz_bodies.py's hypothesis strategies (valid bodies with fields made wrong: types, nulls,
huge / NaN / Infinity numbers, long strings, deep nesting, unknown keys; raw non-JSON bytes), drawn by a seeded
hypothesis run (`given` with max_examples = --bodies, generation phase only: no shrinking, no example database).
Without --url the server is the tests' tiny llama (tests/server_utils.py's LiveServer) with every optional route
(runtime LoRA loading, weight updates), the hermes tool-call and qwen3 reasoning parsers, and prompt embeddings
on. Prints per endpoint how many bodies got 2xx / 4xx / 5xx (and errors: timeouts, dropped connections), each 5xx
or error with its body, and exits 1 if there was any.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import fuzz_bodies  # noqa: E402


def draw_requests(n: int, seed: int, paths: tuple[str, ...] = ()) -> list[tuple[str, str, dict[str, str], bytes]]:
    """n requests from a seeded hypothesis run (generation only)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    out: list[tuple[str, str, dict[str, str], bytes]] = []

    @hypothesis_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_bodies.request(paths))
    def collect(req: tuple[str, str, dict[str, str], bytes]) -> None:
        out.append(req)
    collect()
    return out


def status_class(status: int) -> str:
    return f"{status // 100}xx"


CANCEL_PATH = "/v1/responses/resp_00000000000000000000000000000000/cancel"
RESPONSE_ID = re.compile(rb'"id":"(resp_[0-9a-f]+)"')


async def send_all(url: str, requests: list[tuple[str, str, dict[str, str], bytes]], concurrency: int,
                   timeout: float, seed: int = 0) -> tuple[dict[str, collections.Counter], list[str]]:
    """Send every request (a worker per connection, `concurrency` of them); a pause is always followed by a
    /continue_generation (its worker's next request), so that no pause outlives the one that asked for it.
    Responses the server stored are used again: some later /v1/responses bodies continue one of them
    (previous_response_id), some cancels name one; at the end each is retrieved, its input items listed with
    hostile query parameters, and deleted."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    rng = random.Random(seed)
    stored: list[str] = []
    params: Optional[dict[str, collections.Counter]] = collections.defaultdict(collections.Counter) \
        if PARAMS_OUT else None

    async def one(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str], raw: bytes,
                  label: str) -> None:
        try:
            r = await client.request(method, path, content=raw, headers=headers)
            kind = status_class(r.status_code)
            if r.status_code >= 500 or (400 <= r.status_code < 500 and not fuzz_bodies.error_shape(r.content)):
                failures.append(f"{r.status_code} {method} {path} {raw[:300]!r}\n  -> {r.content[:500]!r}")
                if r.status_code < 500:
                    kind = "4xx_bad_shape"
            if 400 <= r.status_code < 500 and params is not None:
                try:
                    err = r.json()["error"]
                    params[label][str(err.get("param", err.get("type")))] += 1
                except (ValueError, KeyError, TypeError):
                    pass
            if path == "/v1/responses" and r.status_code == 200:
                stored.extend(m.decode() for m in RESPONSE_ID.findall(r.content[:2000])[:1])
        except httpx.HTTPError as e:
            kind = "error"
            failures.append(f"{type(e).__name__} {method} {path} {raw[:300]!r}: {e!r}")
        counts[label][kind] += 1

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            while not queue.empty():
                method, path, headers, raw = queue.get_nowait()
                label = path
                if stored and path == CANCEL_PATH and rng.random() < 0.7:
                    path = f"/v1/responses/{rng.choice(stored)}/cancel"
                elif stored and path == "/v1/responses" and rng.random() < 0.3:
                    raw = _continuing(raw, rng.choice(stored))
                await one(client, method, path, headers, raw, label)
                if path == "/pause_generation":
                    await client.post("/continue_generation")
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        for rid in stored:
            query = rng.choice(["", "?limit=0", "?limit=101", "?limit=x", "?order=up", "?after=nope",
                                "?limit=99999999999999999999", "?after=", "?order=asc&limit=1"])
            for method, path in (("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"
                                                                    + query),
                                 ("DELETE", f"/v1/responses/{rid}")):
                label = f"{method} /v1/responses/{{id}}" + ("/input_items" if "input_items" in path else "")
                await one(client, method, path, {}, b"", label)
    if params is not None:
        Path(PARAMS_OUT).write_text(json.dumps({k: dict(v.most_common()) for k, v in params.items()}, indent=1))
    return counts, failures


PARAMS_OUT = ""  # --params-out: where the 4xx answers' `param` counts go, per endpoint


def _continuing(raw: bytes, response_id: str) -> bytes:
    """The body with previous_response_id set (when it is a JSON object Python reads; else as it was)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    if not isinstance(body, dict):
        return raw
    body["previous_response_id"] = response_id
    try:
        return json.dumps(body).encode()
    except (ValueError, RecursionError):
        return raw


def report(counts: dict[str, collections.Counter], failures: list[str], sent: int, seconds: float) -> int:
    kinds = ["2xx", "4xx", "4xx_bad_shape", "5xx", "error"]
    print(f"{'endpoint':60} " + " ".join(f"{k:>13}" for k in kinds))
    for path in sorted(counts):
        print(f"{path:60} " + " ".join(f"{counts[path][k]:>13}" for k in kinds))
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    print(f"{'total':60} " + " ".join(f"{total[k]:>13}" for k in kinds))
    for f in failures[:50]:
        print("FAIL", f)
    print(f"{sent} bodies in {seconds:.1f} s; 5xx: {total['5xx']}, bad 4xx bodies: {total['4xx_bad_shape']}, "
          f"errors: {total['error']}")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start the tests' tiny llama)")
    ap.add_argument("--bodies", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    ap.add_argument("--paths", nargs="*", default=(), help="only these endpoints")
    ap.add_argument("--tool-call-parser", default=fuzz_bodies.APP_KWARGS["tool_call_parser"],
                    help="the started server's (default: %(default)s)")
    ap.add_argument("--reasoning-parser", default=fuzz_bodies.APP_KWARGS["reasoning_parser"],
                    help="the started server's (default: %(default)s)")
    ap.add_argument("--params-out", default="", help="write how often each field was refused (JSON)")
    ap.add_argument("--model", default=None, help="with --url: the served model's name (the bodies say llama)")
    args = ap.parse_args()
    global PARAMS_OUT
    PARAMS_OUT = args.params_out
    t0 = time.monotonic()
    paths = args.paths or fuzz_bodies.PATH_NAMES
    requests = []
    for i, path in enumerate(paths):  # as many for each endpoint
        requests += draw_requests(args.bodies // len(paths) + (i < args.bodies % len(paths)), args.seed + i, (path,))
    random.Random(args.seed).shuffle(requests)
    if args.model is not None:  # the bodies name the tests' model
        requests = [(m, p, h, raw.replace(b'"llama"', json.dumps(args.model).encode())) for m, p, h, raw in requests]
    print(f"drew {len(requests)} requests in {time.monotonic() - t0:.1f} s", flush=True)
    if args.url is not None:
        return run(args.url, requests, args)
    from tests.checkpoints import make_checkpoint
    from tests.server_utils import LiveServer
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / fuzz_bodies.MODEL
        make_checkpoint(model, family="llama")
        fuzz_bodies.use_rich_template(model)
        server = LiveServer(model, **fuzz_bodies.SERVER_KWARGS)
        server.app_kwargs.update(fuzz_bodies.APP_KWARGS, tool_call_parser=args.tool_call_parser,
                                 reasoning_parser=args.reasoning_parser)
        errors = fuzz_bodies.ErrorLog()
        with server, errors:
            rc = run(server.url, requests, args)
            server.wait_idle()  # nothing leaked: every KV block back, nothing running
            print("idle after the fuzz:", server.pool_state())
        for record in errors.records[:20]:
            print("LOGGED", record)
        print(f"errors logged by the server: {len(errors.records)}")
        return rc or (1 if errors.records else 0)


def run(url: str, requests: list, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    counts, failures = asyncio.run(send_all(url, requests, args.concurrency, args.timeout, args.seed))
    seconds = time.monotonic() - t0
    health = httpx.get(url + "/health", timeout=30).status_code
    print(f"/health after the fuzz: {health}")
    if health != 200:
        failures.append(f"/health answered {health}")
    return report(counts, failures, len(requests), seconds)


if __name__ == "__main__":
    sys.exit(main())
