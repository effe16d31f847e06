"""Structured outputs: JSON schema, regex, choice and grammar constraints, in the engine and through the server.

The strongest check is against an oracle: with greedy decoding, each constrained token must be transformers'
argmax over exactly the tokens llguidance allows at that point (so the mask is applied to the right row, in the
right place, and nothing else is masked). The rest checks that outputs match their constraint under sampling,
n > 1, preemption and chunked prefill, that the pool comes back whole, and the server's fields and errors."""
from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import openai
import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.engine.structured_output import StructuredOutputsParams as SO
from streamer.engine.structured_output import apply_bitmask, fill_bitmasks
from tests.server_utils import LiveServer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
LARK = 'start: "def " NAME "(" ARGS? "):"\nNAME: /[a-z_]{1,8}/\nARGS: /[a-z]( ?, ?[a-z]){0,2}/'
LARK_RE = r"def [a-z_]{1,8}\(([a-z]( ?, ?[a-z]){0,2})?\):"


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) <= {"name", "age", "pet", "tags"} and {"name", "age", "pet"} <= set(obj)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert obj["pet"] in ("cat", "dog", None)
    assert all(type(t) is bool for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 2


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=256)


def _pool_whole(llm: LLM) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.kv.req_blocks
    assert not e.seqs and not e.groups


# ---------------------------------------------------------------------------------------------- params
@pytest.mark.parametrize("kw, field", [
    ({}, "structured_outputs"), ({"json": PERSON, "regex": "a"}, "structured_outputs"),
    ({"json": 5}, "structured_outputs.json"), ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"), ({"choice": "yes"}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"), ({"grammar": 3}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs"),
    ({"structural_tag": "{"}, "structured_outputs.structural_tag"),
    ({"structural_tag": {"structures": [], "triggers": ["<f"]}}, "structured_outputs.structural_tag"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]}},
     "structured_outputs.structural_tag.structures[0].begin"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "end": 3}], "triggers": ["<f"]}},
     "structured_outputs.structural_tag.structures[0]"),
])
def test_params_refuse_bad_values(kw, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SO(**kw)


def test_importing_streamer_stays_light():
    """SamplingParams holds StructuredOutputsParams, and `import streamer` (the CLI, the bench client) must not
    import torch or llguidance for it."""
    import subprocess
    import sys
    code = ("import sys, streamer; from streamer import SamplingParams; SamplingParams(structured_outputs="
            "{'regex': 'a'}); print(sorted(m for m in ('torch', 'numpy', 'llguidance') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sampling_params_takes_a_dict():
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert p.structured_outputs == SO(regex="a+")
    with pytest.raises(ValueError, match="structured_outputs has unknown fields: schema"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="a+")


def test_bitmask_round_trip():
    """The sampler's unpacking reads bit t % 32 of word t // 32, as llguidance writes it."""
    vocab = 70
    allowed = [0, 5, 31, 32, 63, 64, 69]
    words = np.zeros((1, 3), dtype=np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    logits = torch.randn(3, vocab)
    out = apply_bitmask(logits.clone(), torch.tensor([1]), torch.from_numpy(words.view(np.int32)))
    assert torch.isfinite(out[1]).nonzero().squeeze(1).tolist() == allowed
    assert torch.equal(out[1, allowed], logits[1, allowed])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    # Every row masked (the in-place path for a batch that is all constrained).
    full = apply_bitmask(logits.clone(), torch.arange(3), torch.from_numpy(np.repeat(words, 3, 0).view(np.int32)))
    assert all(torch.isfinite(full[r]).nonzero().squeeze(1).tolist() == allowed for r in range(3))


def test_bitmask_unpacking_paths_agree():
    """The host path (numpy, CPU) and the device path (torch shifts, GPU) read the same bits; on a machine
    without a GPU the device path runs on CPU tensors."""
    from streamer.engine.structured_output import unpack_bitmask
    rng = np.random.default_rng(0)
    words = torch.from_numpy(rng.integers(-2 ** 31, 2 ** 31, size=(5, 9), dtype=np.int64).astype(np.int32))
    host = unpack_bitmask(words, 270, on_host=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.equal(unpack_bitmask(words.to(dev), 270, on_host=False).cpu(), host)
    bits = [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(270)] for r in range(5)]
    assert host.tolist() == bits


# ---------------------------------------------------------------------------------------------- engine
def _hf_constrained_greedy(llama_dir, engine, prompt_ids, spec: SO, max_new: int, jump_forward: bool) -> list[int]:
    """transformers' logits, masked by a fresh llguidance matcher at each step: the oracle. With jump-forward,
    the tokens the grammar forces are taken as they are, without the model."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    matcher = engine.grammars.compile(spec).matcher()
    ids = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new:
        forced = matcher.compute_ff_tokens() if jump_forward and out else []
        if forced:
            forced = forced[:max_new - len(out)]
            assert matcher.consume_tokens(forced)
            out += forced
            ids += forced
            if matcher.is_stopped():
                break
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        mask = fill_bitmasks([matcher], engine.vocab_size)
        logits = apply_bitmask(logits.unsqueeze(0).clone(), torch.tensor([0]), torch.from_numpy(mask))[0]
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    return out


@pytest.fixture(scope="module")
def llm_no_jump(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, jump_forward=False)


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "every-token-sampled"])
@pytest.mark.parametrize("spec", [SO(json=PERSON), SO(regex=PHONE), SO(grammar=LARK)], ids=["json", "regex", "lark"])
def test_greedy_equals_transformers_argmax_over_allowed_tokens(request, llama_dir, spec, jump_forward):
    engine = request.getfixturevalue("llm" if jump_forward else "llm_no_jump")
    prompt = [1, 45, 368, 173, 170, 299, 43]
    steps = engine.engine.num_steps
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=spec)
    got = engine.generate([prompt], params)[0].outputs[0]
    want = _hf_constrained_greedy(llama_dir, engine.engine, prompt, spec, 60, jump_forward)
    assert got.token_ids == want
    assert got.finish_reason == "stop"  # the grammar completed: no step spent on EOS
    steps = engine.engine.num_steps - steps
    if jump_forward and spec.json is not None:  # forced keys and punctuation skip their steps
        assert steps < 0.75 * len(got.token_ids)
    elif not jump_forward:
        assert steps == len(got.token_ids)
    _pool_whole(engine)


N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"], "additionalProperties": False}


def check_tagged(text: str, trigger: str, finished: bool) -> int:
    """Every `trigger` in text opens `trigger<f>{json}</f>`, the JSON fitting N_SCHEMA (the last segment may be
    cut short by max_tokens when not finished). Returns how many whole segments there are."""
    begin, end = trigger + "<f>", "</f>"
    whole, at = 0, text.find(trigger)
    while at >= 0:
        rest = text[at:]
        if not rest.startswith(begin):
            assert not finished and begin.startswith(rest), text
            break
        try:
            obj, used = json.JSONDecoder().raw_decode(rest[len(begin):])
        except ValueError:
            assert not finished, text
            break
        assert set(obj) == {"n"} and type(obj["n"]) is int and 0 <= obj["n"] <= 99, text
        tail = rest[len(begin) + used:]
        if not tail.startswith(end):
            assert not finished and end.startswith(tail), text
            break
        whole += 1
        at = text.find(trigger, at + len(begin) + used + len(end))
    return whole


def test_structural_tag_greedy_equals_transformers_and_segments_fit(llama_dir, llm):
    """vLLM's structural tag: free text, and each trigger the model writes opens a tagged JSON segment. The
    trigger is the text of the model's first greedy token, so it is met at once."""
    prompt = [1, 45, 368, 173, 170, 299, 43]
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].outputs[0].text
    trigger = first  # the model's first pick: with the trigger allowed, it still writes it
    spec = SO(structural_tag=json.dumps({"structures": [{"begin": trigger + "<f>", "schema": N_SCHEMA,
                                                         "end": "</f>"}], "triggers": [trigger]}))
    assert trigger.strip() and "\ufffd" not in trigger
    got = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=spec))[0]
    got = got.outputs[0]
    assert got.token_ids == _hf_constrained_greedy(llama_dir, llm.engine, prompt, spec, 60, jump_forward=True)
    assert check_tagged(got.text, trigger, finished=False) >= 1, got.text
    # Sampled, batched with n=3: every segment fits.
    outs = llm.generate([prompt, [7, 8, 9]], SamplingParams(max_tokens=60, temperature=1.0, seed=1, n=3,
                                                            structured_outputs=spec))
    for o in (o for out in outs for o in out.outputs):
        check_tagged(o.text, trigger, finished=False)
    _pool_whole(llm)


def test_structural_tag_triggers_that_look_special(llm):
    """A trigger spelled <...> is the special token when the vocabulary has one, and plain text otherwise."""
    for trigger in ("<|begin_of_text|>", "<tool_call>"):
        tag = {"structures": [{"begin": trigger + "{", "schema": N_SCHEMA, "end": "}"}], "triggers": [trigger]}
        llm.engine.grammars.compile(SO(structural_tag=tag))  # raises if llguidance refused it
    with pytest.raises(ValueError, match="structured_outputs.structural_tag is invalid"):
        llm.engine.grammars.compile(SO(structural_tag={"structures": [{"begin": "<f", "schema": {"type": "nope"},
                                                                       "end": ">"}], "triggers": ["<f"]}))


def test_jump_forward_stops_at_max_tokens(llm):
    """Forced tokens count against max_tokens: an output cut inside a forced run ends exactly at the limit."""
    spec = SO(regex="abcdefghijklmnopqrstuvwxyz")  # after the first token, the rest is forced
    grammar = llm.engine.grammars.compile(spec)
    assert len(llm.engine.tokenizer.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)) > 9
    for max_tokens in range(1, 9):
        out = llm.generate([[1, 2]], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
                                                    structured_outputs=spec))[0].outputs[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        assert grammar.matcher().try_consume_tokens(out.token_ids) == max_tokens
    _pool_whole(llm)


def test_sampled_outputs_match_their_constraint_under_preemption(llama_dir):
    """Sampling at temperature 1 with n=2, a pool small enough to preempt and chunked prefill; unconstrained
    requests share the batch."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=24, block_size=16, max_num_batched_tokens=64)
    specs = [SO(json=PERSON), SO(regex=PHONE), SO(choice=["yes", "no", "maybe (so)"]), SO(grammar=LARK),
             SO(grammar='root ::= "x" [0-9]+ "y"'), SO(json_object=True), None]
    prompts = [list(range(3 + 7 * i, 40 + 11 * i)) for i in range(len(specs))]
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, n=2, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for spec, out in zip(specs, outs):
        for o in out.outputs:
            text = o.text
            if spec is None:
                assert o.finish_reason == "length"
                continue
            if o.finish_reason == "length":  # json_object on a random model may run long: a valid prefix
                assert spec.json_object
                continue
            assert o.finish_reason == "stop", (spec, text)
            if spec.json is not None:
                check_person(text)
            elif spec.regex is not None:
                assert re.fullmatch(PHONE, text)
            elif spec.choice is not None:
                assert text in spec.choice
            elif spec.grammar == LARK:
                assert re.fullmatch(LARK_RE, text)
            elif spec.grammar is not None:
                assert re.fullmatch(r"x[0-9]+y", text)
            else:
                assert isinstance(json.loads(text), dict)
            # llguidance agrees the tokens form a complete match.
            m = llm.engine.grammars.compile(spec).matcher()
            assert m.consume_tokens(o.token_ids) and m.is_accepting()
    _pool_whole(llm)


def test_async_scheduling_gives_the_same_tokens(llama_dir, llm):
    """The overlapped pipeline waits for a constrained row's token before masking its next one."""
    fast = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, async_scheduling=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41]]
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=SO(json=PERSON)),
              SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=SO(regex=PHONE))]
    outs = fast.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "length", "stop"]
    # Once the constrained requests are done, the unconstrained one runs overlapped again.
    assert fast.engine.num_overlapped_steps > 0


def test_length_limit_and_bad_grammars(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0,
                                                   structured_outputs=SO(json=PERSON)))[0].outputs[0]
    assert out.finish_reason == "length" and out.text.startswith('{"')
    for spec, field in [(SO(regex="a(b"), "structured_outputs.regex"), (SO(json='{"type": '), "structured_outputs.json"),
                        (SO(json={"type": "objectx"}), "structured_outputs.json"),
                        (SO(grammar="start: undefined_rule"), "structured_outputs.grammar")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, structured_outputs=spec))
    # The engine still serves, and nothing leaked.
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids
    _pool_whole(llm)


def test_no_token_fits_grammar_and_allowed_ids(llm):
    """allowed_token_ids outside the grammar leave a row no token: it ends, empty, without breaking either rule,
    and its batch-mate is untouched."""
    z = llm.engine.tokenizer.encode("z", add_special_tokens=False)
    alone = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    outs = llm.generate([[1, 2, 3], [4, 5]], [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, logprobs=2, allowed_token_ids=z,
                       structured_outputs=SO(regex="[a-e]+!"))])
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    dead = outs[1].outputs[0]
    assert dead.token_ids == [] and dead.text == "" and dead.finish_reason == "stop" and dead.logprobs == []
    # Found by the property test: here the grammar takes token 3 first, then nothing allowed fits, and the
    # sampler's pick from a row of -inf happened to fit the grammar (but not allowed_token_ids).
    out = llm.generate([[3]], SamplingParams(max_tokens=3, temperature=0.7, top_k=1, allowed_token_ids=[3],
                                             structured_outputs=SO(regex="[a-e]{2,6}!")))[0].outputs[0]
    assert set(out.token_ids) <= {3} and out.finish_reason == "stop"
    _pool_whole(llm)


def test_compiled_grammars_are_cached_per_source(llm):
    g = llm.engine.grammars
    a, b = g.compile(SO(regex="[ab]+")), g.compile(SO(regex="[ab]+"))
    assert a is b and a.matcher() is not b.matcher()
    assert g.compile(SO(regex="[ab]*")) is not a


# ---------------------------------------------------------------------------------------------- server
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}]


@pytest.fixture(scope="module")
def live(llama_dir):
    with LiveServer(llama_dir) as server:
        yield server


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def _client(live):
    return openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


MSG = [{"role": "user", "content": "Who are you?"}]


def test_server_response_format_and_vllm_fields(live):
    async def main():
        async with _client(live) as c:
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
            plain = await c.chat.completions.create(model="llama", messages=MSG, max_tokens=100, temperature=0.0,
                                                    response_format=fmt)
            streamed = ""
            async for chunk in await c.chat.completions.create(model="llama", messages=MSG, max_tokens=100,
                                                               temperature=0.0, response_format=fmt, stream=True):
                if chunk.choices:
                    streamed += chunk.choices[0].delta.content or ""
            obj = await c.chat.completions.create(model="llama", messages=MSG, max_tokens=200, temperature=0.0,
                                                  response_format={"type": "json_object"})
            choice = await c.completions.create(model="llama", prompt="The answer:", max_tokens=10, n=3,
                                                temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
            regex = await c.completions.create(model="llama", prompt="Call", max_tokens=30, temperature=1.0,
                                               extra_body={"structured_outputs": {"regex": PHONE}})
            text = await c.completions.create(model="llama", prompt="Call", max_tokens=3, temperature=0.0,
                                              extra_body={"response_format": {"type": "text"}})
            return plain, streamed, obj, choice, regex, text

    plain, streamed, obj, choice, regex, text = _run(main())
    check_person(plain.choices[0].message.content)
    assert plain.choices[0].finish_reason == "stop" and streamed == plain.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert obj.choices[0].message.content.startswith("{")
    assert len(choice.choices) == 3 and all(ch.text in ("yes", "no") for ch in choice.choices)
    assert re.fullmatch(PHONE, regex.choices[0].text)
    assert text.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_server_forced_tool_calls(live, stream):
    async def call(c, tool_choice, **extra):
        # Seeded sampling: greedy decoding of this random model repeats one call until max_tokens.
        kw = dict(model="llama", messages=MSG, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                  temperature=1.0, **{"seed": 0, **extra})
        if not stream:
            r = await c.chat.completions.create(**kw)
            return r.choices[0].message.tool_calls, r.choices[0].message.content, r.choices[0].finish_reason
        # Streamed: join the deltas of each call index as an OpenAI client does (the first has id and name).
        calls: dict = {}
        content, finish, deltas = "", None, 0
        async for chunk in await c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    deltas += 1
                    if d.index not in calls:
                        assert d.id.startswith("call_") and d.function.name and d.type == "function"
                        calls[d.index] = d
                    else:
                        assert d.id is None and not d.function.name
                        calls[d.index].function.arguments += d.function.arguments or ""
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
        if isinstance(tool_choice, dict):  # a named call streams its arguments piece by piece
            assert deltas > 3
        return list(calls.values()), content or None, finish

    async def main():
        async with _client(live) as c:
            named = await call(c, {"type": "function", "function": {"name": "get_weather"}})
            required = await call(c, "required")
            for seed in range(3):  # parallel_tool_calls: false holds "required" to a single call
                single = await call(c, "required", parallel_tool_calls=False, seed=seed)
                assert len(single[0]) == 1 and single[2] == "tool_calls", single
            return named, required

    (named_calls, named_content, named_finish), (req_calls, req_content, req_finish) = _run(main())
    assert named_finish == "stop" and not named_content and len(named_calls) == 1
    assert named_calls[0].function.name == "get_weather" and named_calls[0].id.startswith("call_")
    args = json.loads(named_calls[0].function.arguments)
    assert args["city"] in ("Paris", "Oslo") and set(args) <= {"city", "days"}
    assert req_finish == "tool_calls" and not req_content and req_calls
    for tc in req_calls:
        args = json.loads(tc.function.arguments)
        if tc.function.name == "get_weather":
            assert args["city"] in ("Paris", "Oslo")
        else:
            assert tc.function.name == "get_time" and re.fullmatch("[A-Z]{3}", args["zone"])


def test_server_structural_tag(live):
    hello = [{"role": "user", "content": "hello"}]  # (its first token is a whole character, unlike MSG's)

    async def main():
        async with _client(live) as c:
            first = await c.chat.completions.create(model="llama", messages=hello, max_tokens=1, temperature=0.0)
            trigger = first.choices[0].message.content  # met at once (see the engine's structural tag test)
            fmt = {"type": "structural_tag", "triggers": [trigger],
                   "structures": [{"begin": trigger + "<f>", "schema": N_SCHEMA, "end": "</f>"}]}
            plain = await c.chat.completions.create(model="llama", messages=hello, max_tokens=60, temperature=0.0,
                                                    extra_body={"response_format": fmt})
            streamed = ""
            async for chunk in await c.chat.completions.create(model="llama", messages=hello, max_tokens=60,
                                                               temperature=0.0, stream=True,
                                                               extra_body={"response_format": fmt}):
                if chunk.choices:
                    streamed += chunk.choices[0].delta.content or ""
            return trigger, plain.choices[0].message.content, streamed

    trigger, plain, streamed = _run(main())
    assert trigger.strip() and "\ufffd" not in trigger
    assert streamed == plain and check_tagged(plain, trigger, finished=False) >= 1, plain


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "end": ">"}],
                          "triggers": ["<g"]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
])
def test_server_errors_name_the_field(live, body, param):
    import httpx
    for stream in (False, True):
        r = httpx.post(live.base_url + "/chat/completions", timeout=60,
                       json={"model": "llama", "messages": MSG, "max_tokens": 4, "stream": stream, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert "structured_outputs." not in err["message"] or param == "structured_outputs"
    # Still serving.
    assert httpx.post(live.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_cli_generate_flags(llama_dir, capsys, tmp_path):
    """`streamer generate --choice/--regex/--json-schema FILE`, and a bad regex is a clean error (exit 1)."""
    from streamer.cli import main
    common = ["generate", "--model", str(llama_dir), "--dtype", "float32", "--num-kv-blocks", "64"]
    assert main([*common, "--prompt", "Q:", "--choice", "yes", "--choice", "no", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() in ("Q:yes", "Q:no")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(PERSON))
    assert main([*common, "--prompt", "Q:", "--json-schema", str(schema), "--max-tokens", "100"]) == 0
    check_person(capsys.readouterr().out.strip().removeprefix("Q:"))
    assert main([*common, "--prompt", "Q:", "--regex", "a("]) == 1
    assert "structured_outputs.regex is invalid" in capsys.readouterr().err


def test_jump_forward_respects_allowed_token_ids(llm):
    """Found by the property test: a token the grammar forced was appended though allowed_token_ids excluded it.
    Jump-forward now stands aside when other options restrict the tokens: the output stops before it instead."""
    spec = SO(regex="[a-e]{2,6}!")
    letters = [t for t in range(llm.engine.vocab_size)
               if re.fullmatch("[a-e]+", llm.engine.tokenizer.decode([t]) or "-")]
    for allowed in ([letters[0]], letters):
        out = llm.generate([[3]], SamplingParams(max_tokens=7, temperature=0.0, allowed_token_ids=allowed,
                                                 structured_outputs=spec))[0].outputs[0]
        assert set(out.token_ids) <= set(allowed) and out.finish_reason in ("stop", "length")
        assert not out.text.endswith("!")
    _pool_whole(llm)


def test_sentencepiece_tokenizer(make_ckpt):
    """A sentencepiece-style tokenizer (metaspace, byte fallback: Llama-2, Mistral) works with llguidance too,
    non-ASCII choices included."""
    path = make_ckpt("mistral_sp_structured", family="mistral", tokenizer="sentencepiece")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    choices = ["héllo wörld", "日本", "plain"]
    for seed in range(4):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured_outputs=SO(choice=choices))
        out = llm.generate("Hello", params)[0].outputs[0]
        assert out.text in choices and out.finish_reason == "stop"
        out = llm.generate("Hello", SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                   structured_outputs=SO(regex="[a-z]{1,8} [0-9]{2}!")))[0].outputs[0]
        assert re.fullmatch("[a-z]{1,8} [0-9]{2}!", out.text), out.text
    _pool_whole(llm)


# ---------------------------------------------------------------------------------------------- strict tool calling
STRICT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                    "additionalProperties": False}}},
                {"type": "function", "function": {"name": "get_time", "parameters": {
                    "type": "object", "properties": {"zone": {"type": "string"}}}}}]


def test_strict_tool_tag_holds_calls_to_their_tools(llm):
    """tool_choice "auto" with a strict tool: free text, and a hermes call must name a tool and (strict) fit its
    schema; the hermes parser reads back what the tag lets through."""
    from streamer.server.structured import strict_tool_tag
    from streamer.server.tool_calls import parse_all
    loose = [{"type": "function", "function": {**t["function"], "strict": False}} for t in STRICT_TOOLS]
    assert strict_tool_tag("hermes", loose) is None and strict_tool_tag("pythonic", STRICT_TOOLS) is None
    assert strict_tool_tag("hermes", loose, enforce_all=True) is not None
    grammar = llm.engine.grammars.compile(strict_tool_tag("hermes", STRICT_TOOLS))

    def fits(text: str) -> bool:
        ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
        return grammar.matcher().try_consume_tokens(ids) == len(ids)

    good = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call> ok'
    assert fits(good) and fits("no call at all, <tool_ or tool_call>")
    assert fits('<tool_call>\n{"name": "get_time", "arguments": {"anything":[1,2]}}\n</tool_call>')  # not strict
    assert not fits('<tool_call>\n{"name": "get_weather", "arguments": {"town":"Paris"}}\n</tool_call>')
    assert not fits('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert not fits('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>')
    content, calls = parse_all(good, "hermes")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("parser,call", [
    ("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"),
    ("deepseek_v31", "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"),
    ("llama3_json", '{{"name": "{name}", "parameters": {args}}}'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{args}"
                "<|tool_call_end|><|tool_calls_section_end|>"),
    ("mistral", "[TOOL_CALLS]{name}[ARGS]{args}"),
    ("mistral_list", '[TOOL_CALLS][{{"name": "{name}", "arguments": {args}}}]'),
])
def test_strict_tool_tag_other_formats(llm, parser, call):
    """DeepSeek-V3's and V3.1's call blocks, Llama 3's JSON calls, Kimi K2's numbered calls and Mistral's (v11+
    `name[ARGS]{...}`, or the older JSON list) held to their tools the same way; the parser reads back what the tag
    lets through."""
    from streamer.server.structured import strict_tool_tag
    from streamer.server.tool_calls import parse_all
    tag = strict_tool_tag(parser.removesuffix("_list"), STRICT_TOOLS, mistral_args=not parser.endswith("_list"))
    grammar = llm.engine.grammars.compile(tag)
    parser = parser.removesuffix("_list")

    def fits(text: str) -> bool:
        ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
        return grammar.matcher().try_consume_tokens(ids) == len(ids)

    good = call.format(name="get_weather", args='{"city":"Paris"}')
    if parser != "llama3_json":  # (its calls are read at the output's start only)
        good = "Sure. " + good + " ok"
    assert fits(good) and fits("no call at all")
    assert fits(call.format(name="get_time", args='{"anything":[1,2]}'))  # (not strict: any object)
    assert not fits(call.format(name="get_weather", args='{"town":"Paris"}'))
    assert not fits(call.format(name="nope", args="{}"))
    content, calls = parse_all(good, parser)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]


XML_TOOLS = [{"type": "function", "function": {"name": "plan_trip", "strict": True, "parameters": {
                "type": "object", "properties": {
                    "city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": ["number", "null"]},
                    "units": {"type": "string", "enum": ["metric", "imperial"]}, "flexible": {"type": "boolean"},
                    "stops": {"type": "array", "items": {"type": "string"}}},
                "required": ["city", "days"]}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "ping", "strict": True, "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.mark.parametrize("parser,call,param", [
    ("qwen3_coder", "<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>",
     "<parameter={key}>\n{value}\n</parameter>\n"),
    ("seed_oss", "<seed:tool_call>\n<function={name}>\n{params}</function>\n</seed:tool_call>",
     "<parameter={key}>\n{value}\n</parameter>\n"),
    ("glm45", "<tool_call>{name}\n{params}</tool_call>", "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"),
])
def test_strict_tool_tag_xml_formats(llm, parser, call, param):
    """Qwen3-Coder's, Seed-OSS's and GLM-4.5's XML calls held to their tools: a strict tool's parameters in its
    schema's order, the required ones present, each value of its type (strings any text up to the closing tag,
    newlines included; enums one of theirs; arrays JSON), no unknown parameter; a non-strict tool's any parameters.
    The parser reads back what the tag lets through, typed."""
    from streamer.server.structured import strict_tool_tag
    from streamer.server.tool_calls import parse_all
    grammar = llm.engine.grammars.compile(strict_tool_tag(parser, XML_TOOLS))

    def fits(text: str) -> bool:
        ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
        return grammar.matcher().try_consume_tokens(ids) == len(ids)

    def make(name: str, **values: str) -> str:
        return call.format(name=name, params="".join(param.format(key=k, value=v) for k, v in values.items()))

    good = make("plan_trip", city="New York,\nNY <downtown>", days="3", budget="1500.5", units="metric",
                flexible="true", stops='["Boston", "DC"]')
    assert fits("Sure. " + good + " ok") and fits(make("plan_trip", city="Paris", days="-2"))
    assert fits(make("get_time", zone="UTC", anything="goes\nhere")) and fits("no call at all")
    assert not fits(make("plan_trip", city="Paris"))  # (days is required)
    assert not fits(make("plan_trip", days="3", city="Paris"))  # (the schema's order)
    assert not fits(make("plan_trip", city="Paris", days="three"))
    assert not fits(make("plan_trip", city="Paris", days="3", units="kelvin"))
    assert not fits(make("plan_trip", city="Paris", days="3", stops="Boston"))
    assert not fits(make("plan_trip", city="Paris", days="3", town="x"))
    assert not fits(make("nope", city="Paris"))
    assert fits(make("ping")) and not fits(make("ping", x="1"))  # (strict, without parameters)
    content, calls = parse_all("Sure. " + good, parser, XML_TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("plan_trip", {"city": "New York,\nNY <downtown>", "days": 3, "budget": 1500.5, "units": "metric",
                       "flexible": True, "stops": ["Boston", "DC"]})]


def test_kimi_call_indices_go_on_from_the_conversation():
    """Kimi K2 numbers calls across the conversation: after two earlier calls the next is functions.NAME:2."""
    from streamer.server.structured import KIMI_INDICES, strict_tool_tag
    call = {"id": "functions.get_time:0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    begins = [s["begin"] for s in strict_tool_tag("kimi_k2", STRICT_TOOLS, messages=messages)
              .structural_tag["structures"]]
    indices = sorted({int(b.split(":")[1].split("<")[0]) for b in begins})
    assert indices == list(range(2, 2 + KIMI_INDICES))


def test_server_strict_tools(live):
    """With the hermes parser, a strict tool puts the structural tag on an "auto" request: the text stays free (whole
    characters), and a strict tool whose schema cannot compile is a 400 (a non-strict one is never compiled)."""
    import httpx
    server = live.app.state.server
    body = {"model": "llama", "messages": MSG, "max_tokens": 12, "temperature": 0.0, "tools": STRICT_TOOLS}
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    server.tool_call_parser = "hermes"
    try:
        plain = httpx.post(live.base_url + "/chat/completions", timeout=60,
                           json={**body, "tools": [dict(t, function={**t["function"], "strict": False})
                                                   for t in STRICT_TOOLS]}).json()
        strict = httpx.post(live.base_url + "/chat/completions", json=body, timeout=60).json()
        # No call: the text is the model's own, except that a grammar admits only whole UTF-8 characters (this
        # random model's plain text has stray bytes, shown as U+FFFD).
        message = strict["choices"][0]["message"]
        assert message["content"] and "\ufffd" not in message["content"] and not message.get("tool_calls")
        assert plain["choices"][0]["finish_reason"] == strict["choices"][0]["finish_reason"] == "length"
        ok = httpx.post(live.base_url + "/chat/completions", json={**body, "tools": broken}, timeout=60)
        bad = httpx.post(live.base_url + "/chat/completions", timeout=60, json={
            **body, "tools": [{"type": "function", "function": {**broken[0]["function"], "strict": True}}]})
        server.enforce_strict_tool_calling = True
        enforced = httpx.post(live.base_url + "/chat/completions", json={**body, "tools": broken}, timeout=60)
    finally:
        server.tool_call_parser, server.enforce_strict_tool_calling = None, False
    assert ok.status_code == 200 and bad.status_code == enforced.status_code == 400, (ok.text, bad.text)
    assert "structural_tag" in bad.json()["error"]["message"]
