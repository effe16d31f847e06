"""`streamer run-batch`: OpenAI Batch API files answered offline through the server's own handlers."""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamer.server.batch import BATCH_URLS, parse_line, run_batch

REPO = Path(__file__).resolve().parents[1]


def _line(cid: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("text, code", [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_request"),
    (json.dumps({"url": "/v1/completions", "body": {}}), "missing_custom_id"),
    (json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}), "invalid_method"),
    (json.dumps({"custom_id": "x", "url": "/v1/load_lora_adapter", "body": {}}), "invalid_url"),
    (json.dumps({"custom_id": "x", "url": "/v1/completions", "body": "prompt"}), "invalid_body"),
    (json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"stream": True}}), "invalid_body"),
])
def test_lines_that_are_not_requests(text, code):
    line = parse_line(text, set())
    assert line.error is not None and line.error[0] == code


def test_custom_ids_must_be_unique():
    seen: set[str] = set()
    assert parse_line(_line("a", prompt="x"), seen).error is None
    assert parse_line(_line("a", prompt="y"), seen).error[0] == "duplicate_custom_id"
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= BATCH_URLS


def test_batch_answers_as_the_server_and_in_order(llama_dir):
    """Every line is answered, in input order, by the server's handlers: the greedy texts are LLM.generate's, a
    refused request carries the server's 400 body, a malformed line an error and no response; the engine has
    nothing left running or allocated afterwards."""
    from streamer import LLM, SamplingParams
    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.app import build_app

    prompts = [f"word {i} " * (1 + i % 5) for i in range(12)]
    lines = [_line(f"c{i}", prompt=p, max_tokens=6, temperature=0) for i, p in enumerate(prompts)]
    lines.insert(3, _line("bad", prompt="x", max_tokens=-1))
    lines.insert(5, "{oops")
    lines.insert(7, "")  # blank lines are skipped
    lines.append(_line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "hello"}],
                       max_tokens=4, temperature=0))

    async def go() -> tuple[str, object, int]:
        async with AsyncEngine(str(llama_dir), dtype="float32", max_num_seqs=4) as engine:
            out = io.StringIO()
            summary = await run_batch(build_app(engine), lines, out, concurrency=5)
            core = engine.engine
            idle = core.kv.pool.num_free == core.kv.num_blocks and not core.scheduler.has_work()
            return out.getvalue(), summary, idle

    text, summary, idle = asyncio.run(go())
    answers = [json.loads(x) for x in text.splitlines()]
    assert [a["custom_id"] for a in answers] == ["c0", "c1", "c2", "bad", "c3", None] + \
        [f"c{i}" for i in range(4, 12)] + ["chat"]
    assert (summary.total, summary.succeeded, summary.failed) == (15, 13, 2)
    assert idle
    bad = answers[3]
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert answers[5]["response"] is None and answers[5]["error"]["code"] == "invalid_json"
    assert len({a["id"] for a in answers}) == len(answers)
    texts = {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers
             if a["custom_id"] and a["custom_id"][1:].isdigit()}
    with LLM(str(llama_dir), dtype="float32") as llm:
        want = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [texts[f"c{i}"] for i in range(12)] == [o.outputs[0].text for o in want]
    chat = answers[-1]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"


def test_command_line(tmp_path):
    """`streamer run-batch -i IN -o OUT` on the embedded model: exit 0, a summary on stderr, one answer a line;
    `-o -` writes to standard output; a missing input file is exit 2 with one line."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("one", prompt="def ", max_tokens=3),
                              _line("two", "/v1/embeddings", input="import os")]) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "streamer", "run-batch", "--enforce-eager", "--num-kv-blocks", "64", "-i", str(src)]
    p = subprocess.run(cmd + ["-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=300,
                       env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "2 requests, 2 succeeded, 0 failed" in p.stderr
    answers = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["response"]["body"]["object"] for a in answers] == ["text_completion", "list"]
    p = subprocess.run(cmd + ["-o", "-"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert p.returncode == 0 and [json.loads(x)["custom_id"] for x in p.stdout.splitlines()] == ["one", "two"]
    p = subprocess.run(cmd[:-1] + [str(tmp_path / "missing.jsonl"), "-o", "-"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=REPO)
    assert p.returncode == 2 and p.stderr.startswith("streamer run-batch: error:") and "Traceback" not in p.stderr
