"""A mixed-feature soak of a live server: random completions, chat and Anthropic Messages requests combining n,
streaming, usage, logprobs, stops, seeds, bad_words, penalties, min_tokens, top-k/p, priorities, best_of, echo
(max_tokens 0 too), JSON mode, token ids, thinking budgets, strict tools and prompt embeddings, plus some invalid
ones and ~15%
abandoned mid-way. Prints the status counts (any 5xx, error event or unexpected 400 is printed with its body) and,
after the load, the running/waiting/KV-usage gauges, which must be back to 0 (nothing leaked).

    streamer serve --port 8012 --num-kv-blocks 96 --max-num-seqs 24 \
        --reasoning-parser deepseek_r1 --tool-call-parser hermes    # small cache: preemptions happen
    python bench/stress_server.py http://127.0.0.1:8012 --requests 600 --seed 2 --reasoning --tools
(`--embeds 256`: the server has --enable-prompt-embeds and that hidden size, the demo model's.)
"""
import argparse
import asyncio
import base64
import io
import json
import random
import time

import httpx
import torch

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("url")
ap.add_argument("--requests", type=int, default=300)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--concurrency", type=int, default=48)
ap.add_argument("--model", default=None, help="default: the server's first model")
ap.add_argument("--reasoning", action="store_true", help="the server has a reasoning parser: send thinking budgets")
ap.add_argument("--tools", action="store_true", help="the server has the hermes tool parser: send strict tools")
ap.add_argument("--embeds", type=int, default=0, metavar="HIDDEN",
                help="the server takes prompt_embeds of this width: send some (and some of the wrong width)")
args = ap.parse_args()
URL = args.url
N = args.requests
rng = random.Random(args.seed)
M = args.model or httpx.get(URL + "/v1/models").json()["data"][0]["id"]
PROMPTS = ["def f(", "import os\n", "class A:\n    def __init__(self", "# comment\n" * 20, "x = [" * 30, "for i in range(10):"]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def messages_body():
    """Anthropic's Messages API (its own field names; no n, logprobs or best_of there)."""
    b: dict = {"model": M, "max_tokens": rng.choice([1, 8, 32, 100]), "temperature": rng.choice([0, 1.0]),
               "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    if rng.random() < 0.3:
        b["system"] = "be brief"
    if rng.random() < 0.4:
        b["stream"] = True
    if rng.random() < 0.2:
        b["stop_sequences"] = ["\n"]
    if args.reasoning and rng.random() < 0.3:
        b["thinking"] = {"type": "enabled", "budget_tokens": rng.choice([0, 4, 16])}
    if rng.random() < 0.1:
        b["tools"] = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
        b["tool_choice"] = rng.choice([{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}])
    return "/v1/messages", b


BAD: dict = {}  # bodies the server must refuse with a 400 (besides temperature < 0), by id (kept alive: ids unique)


def embeds_b64(rows: int, width: int) -> str:
    buf = io.BytesIO()
    torch.save(torch.randn(rows, width, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 0.05,
               buf)
    return base64.b64encode(buf.getvalue()).decode()


def body():
    if rng.random() < 0.15:
        return messages_body()
    chat = rng.random() < 0.4
    b: dict = {"model": M, "max_tokens": rng.choice([1, 2, 8, 32, 100]), "temperature": rng.choice([0, 0.7, 1.0])}
    if chat:
        b["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        b["prompt"] = rng.choice(PROMPTS) if rng.random() < 0.8 else [rng.choice(PROMPTS), rng.choice(PROMPTS)]
    if rng.random() < 0.3:
        b["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        b["stream"] = True
        if rng.random() < 0.5:
            b["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        if chat:
            b["logprobs"], b["top_logprobs"] = True, rng.choice([0, 3])
        else:
            b["logprobs"] = rng.choice([0, 2])
    extras = [(0.2, {"stop": ["\n", "):"]}), (0.15, {"seed": rng.randrange(1000)}),
              (0.15, {"bad_words": ["self", "import"]}), (0.1, {"presence_penalty": 1.0}),
              (0.1, {"min_tokens": min(2, b["max_tokens"])}), (0.1, {"top_k": 5, "top_p": 0.9}),
              (0.1, {"priority": rng.choice([-1, 0, 5])}), (0.05, {"temperature": -1}),  # (a 400)
              (0.05, {"return_token_ids": True, "return_tokens_as_token_ids": True})]
    for p, fields in extras:
        if rng.random() < p:
            b.update(fields)
    if chat and rng.random() < 0.1:
        b["response_format"] = {"type": "json_object"}
    elif chat and args.tools and rng.random() < 0.1:
        b["tools"] = TOOLS  # strict: a structural tag holds any call the model starts
    if args.reasoning and rng.random() < 0.15:
        b["thinking_token_budget"] = rng.choice([0, 3, 10])
    if not chat and not b.get("stream") and rng.random() < 0.1:
        b["best_of"] = (b.get("n") or 1) + 1
    if not chat and rng.random() < 0.1:
        b["echo"] = True
        if rng.random() < 0.5:
            b["max_tokens"], b["min_tokens"] = 0, 0
    if not chat and args.embeds and not b.get("echo") and rng.random() < 0.15:
        wrong = rng.random() < 0.1
        b["prompt_embeds"] = [embeds_b64(rng.choice([3, 20, 70]), args.embeds + wrong)
                              for _ in range(rng.choice([1, 1, 2]))]
        if rng.random() < 0.5:
            b["prompt"] = ""  # (the embedded prompts alone)
        if wrong:
            BAD[id(b)] = b
        stats["(sent with prompt_embeds)"] = stats.get("(sent with prompt_embeds)", 0) + 1
    return ("/v1/chat/completions" if chat else "/v1/completions"), b

def expected_400(b: dict) -> bool:
    return b.get("temperature", 0) < 0 or id(b) in BAD


stats: dict = {}
async def one(c, i):
    path, b = body()
    abandon = rng.random() < 0.15
    try:
        if b.get("stream"):
            async with c.stream("POST", path, json=b) as r:
                key = r.status_code
                if r.status_code == 200:
                    k = 0
                    async for line in r.aiter_lines():
                        k += 1
                        if abandon and k > 3:
                            key = "abandoned"
                            break
                        if line.startswith(("data: {\"error", "event: error")):
                            key = "stream-error:" + line[:200]
                else:
                    await r.aread()
                    if r.status_code >= 500 or not expected_400(b):
                        key = f"{r.status_code}:{json.dumps(b)[:200]} -> {r.text[:300]}"
        else:
            if abandon:
                try:
                    key = (await c.post(path, json=b, timeout=0.05)).status_code
                except httpx.TimeoutException:
                    key = "abandoned"
            else:
                r = await c.post(path, json=b)
                key = r.status_code
                if r.status_code >= 500 or r.status_code == 400 and not expected_400(b):
                    key = f"{r.status_code}:{json.dumps(b)[:300]} -> {r.text[:300]}"
    except Exception as e:
        key = f"exc:{type(e).__name__}:{e}"
    if key == 200 and id(b) in BAD:
        key = f"unexpected 200: {json.dumps(b)[:200]}"
    stats[key] = stats.get(key, 0) + 1

async def main():
    async with httpx.AsyncClient(base_url=URL, timeout=300) as c:
        sem = asyncio.Semaphore(args.concurrency)
        async def guarded(i):
            async with sem:
                await one(c, i)
        t = time.time()
        await asyncio.gather(*[guarded(i) for i in range(N)])
        print("took", round(time.time() - t, 1), "s")
        await asyncio.sleep(2)
        m = (await c.get("/metrics")).text
        for line in m.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")):
                print(line)
    for k, v in sorted(stats.items(), key=lambda kv: str(kv[0])):
        print(v, k)


if __name__ == "__main__":
    asyncio.run(main())
