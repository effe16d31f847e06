"""Pipeline parallelism (-pp, worker/pipeline.py): the layers in contiguous stages, each a process (or a
tensor-parallel group of processes), hidden states passed between them and back to rank 0, which samples; up to P
steps of different requests in flight. fp32 outputs equal the single-process engine's (greedy and seeded sampling)
on a dense Llama, a MoE and hybrid families, eager and compiled, offline and through the server with the openai
client; stages hold only their own layers; what cannot split is refused with the reason. (Across two nodes: test_multi_node.py.)"""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")  # the checkpoints
openai = pytest.importorskip("openai")

import tests.test_hybrid_tp  # noqa: E402,F401  (registers the hybrid checkpoint families)
from streamer import LLM, SamplingParams  # noqa: E402
from streamer.config import EngineConfig  # noqa: E402
from streamer.core.kv_cache import KVCacheManager  # noqa: E402
from streamer.core.request import Request  # noqa: E402
from streamer.core.scheduler import Scheduler  # noqa: E402
from streamer.models.layers import stage_holds, stage_layers  # noqa: E402
from streamer.models.llama import MissingLayer  # noqa: E402
from tests.server_utils import LiveServer  # noqa: E402

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(4 + 5 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
EAGER = dict(dtype="float32", enforce_eager=True)

# family -> (checkpoint name, make_checkpoint arguments)
CHECKPOINTS = {
    "llama": ("llama_pp", {"family": "llama", "seed": 5, "num_hidden_layers": 4}),
    "qwen3_moe": ("qwen3_moe_tp", {"family": "qwen3_moe", "seed": 3}),
    "granitemoehybrid": ("granite_moe", {"family": "granitemoehybrid"}),  # Mamba2 + attention + MoE
    "qwen3_next": ("qwen3_next", {"family": "qwen3_next"}),  # gated DeltaNet + gated attention + MoE
    "gemma3": ("gemma3_pp", {"family": "gemma3"}),  # builds its layers itself: the loader keeps its stage's
}


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _reference(model) -> tuple[list[list[int]], list[list[int]]]:
    with LLM(str(model), **EAGER) as llm:
        return _tokens(llm, GREEDY), _tokens(llm, SEEDED)


# ---------------------------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("layers", range(1, 13))
def test_stages_cover_the_layers_in_order(layers) -> None:
    for stages in range(1, layers + 1):
        spans = [stage_layers(layers, s, stages) for s in range(stages)]
        assert spans[0][0] == 0 and spans[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
        sizes = [hi - lo for lo, hi in spans]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_stage_holds_its_layers_the_first_the_head_and_the_last_the_norm() -> None:
    first, middle, last = ((0, 2), True, False), ((2, 4), False, False), ((4, 6), False, True)
    assert stage_holds("model.layers.1.self_attn.q_proj.weight", *first)
    assert not stage_holds("model.layers.2.self_attn.q_proj.weight", *first)
    assert stage_holds("layers.3.mlp.w13", *middle) and not stage_holds("layers.13.mlp.w13", *middle)
    assert stage_holds("model.embed_tokens.weight", *first) and not stage_holds("model.embed_tokens.weight", *last)
    assert stage_holds("lm_head.weight", *first) and not stage_holds("lm_head.weight", *middle)
    assert stage_holds("model.norm.weight", *last) and not stage_holds("model.norm.weight", *first)
    assert stage_holds("model.layers.5.input_layernorm.weight", *last)


def test_scheduler_keeps_steps_of_different_requests_in_flight() -> None:
    """With 2 stages: a step takes half the requests; the next one the others (not those in flight); once the first
    step landed its requests come back; no request is ever in two steps in flight."""
    cfg = EngineConfig(pipeline_parallel_size=2, max_num_batched_tokens=256, block_size=4)
    kv = KVCacheManager(200, 4, True)
    sched = Scheduler(cfg, kv, max_model_len=512)
    reqs = [Request(f"r{i}", [i + 1] * 6, SamplingParams(max_tokens=5), 5, block_size=4) for i in range(6)]
    for r in reqs:
        sched.add(r)
    a = sched.schedule()
    b = sched.schedule()
    ids_a, ids_b = {s.req.request_id for s in a.scheduled}, {s.req.request_id for s in b.scheduled}
    assert len(ids_a) == 3 and len(ids_b) == 3 and not ids_a & ids_b
    assert not sched.schedule().scheduled, "a third step while both halves are in flight"
    for s in a.scheduled:  # step a's tokens arrive
        s.req.append_token(9)
    sched.landed(a)
    c = sched.schedule()
    assert {s.req.request_id for s in c.scheduled} == ids_a


def test_what_cannot_split_into_stages_is_refused(make_ckpt) -> None:
    name, kw = CHECKPOINTS["llama"]
    model = make_ckpt(name, **kw)
    with pytest.raises(ValueError, match="5 stages for its 4 decoder layers"):
        LLM(str(model), pipeline_parallel_size=5, **EAGER)
    mamba2 = make_ckpt("recurrent_mamba2", family="mamba2")
    with pytest.raises(ValueError, match="Mamba2ForCausalLM does not split into pipeline stages: its forward is its "
                                         "own"):
        LLM(str(mamba2), pipeline_parallel_size=2, **EAGER)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        EngineConfig(pipeline_parallel_size=2, speculative_model=str(model), num_speculative_tokens=2)


# ---------------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("family,tp", [("llama", 1), ("llama", 2), ("qwen3_moe", 1), ("granitemoehybrid", 1),
                                       ("qwen3_next", 1), ("gemma3", 1)])
def test_pipeline_matches_one_process(make_ckpt, family, tp) -> None:
    """PP=2 (and TP=2 x PP=2 on the Llama: four processes) gives the single process's greedy and seeded tokens,
    with two steps in flight; rank 0 holds only the first stage's layers (and the head)."""
    name, kw = CHECKPOINTS[family]
    model = make_ckpt(name, **kw)
    want_greedy, want_seeded = _reference(model)
    with LLM(str(model), pipeline_parallel_size=2, tensor_parallel_size=tp, **EAGER) as llm:
        got_greedy, got_seeded = _tokens(llm, GREEDY), _tokens(llm, SEEDED)
        engine = llm.engine
        layers = engine.runner.model.layers
        lo, hi = engine.runner.model.pp_layers
        overlapped = engine.num_overlapped_steps
    assert got_greedy == want_greedy
    assert got_seeded == want_seeded
    assert lo == 0 and 0 < hi < len(layers)
    assert all(isinstance(layers[i], MissingLayer) for i in range(hi, len(layers)))
    assert not any(isinstance(layers[i], MissingLayer) for i in range(hi))
    assert overlapped > 0, "no step was launched while another was in flight"


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_compiled_stages_match_one_process(make_ckpt, family) -> None:
    """torch.compile'd stages (a later stage's graphs start from the hidden states it receives) give the eager
    single process's greedy and seeded tokens."""
    name, kw = CHECKPOINTS[family]
    model = make_ckpt(name, **kw)
    want_greedy, want_seeded = _reference(model)
    with LLM(str(model), pipeline_parallel_size=2, dtype="float32", enforce_eager=False) as llm:
        got_greedy, got_seeded = _tokens(llm, GREEDY), _tokens(llm, SEEDED)
        compiled = llm.engine.runner.compiled
    assert compiled
    assert got_greedy == want_greedy
    assert got_seeded == want_seeded


def test_prompt_logprobs_through_stages(make_ckpt) -> None:
    """The last stage sends rank 0 only the sampled tokens' rows, except in a step that scores prompt tokens, which
    needs them all: requests with and without prompt_logprobs in one batch give the single process's numbers."""
    name, kw = CHECKPOINTS["llama"]
    model = make_ckpt(name, **kw)
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    params = [scored if i % 2 else plain for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(**kw) -> list:
        with LLM(str(model), **EAGER, **kw) as llm:
            return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in llm.generate(prompts, params)]

    want, got = run(), run(pipeline_parallel_size=2)
    assert [t for t, _ in got] == [t for t, _ in want]
    for i, ((_, w), (_, g)) in enumerate(zip(want, got)):
        if i % 2 == 0:
            assert w is None and g is None
            continue
        assert len(g) == len(w) == len(PROMPTS[i])
        for wp, gp in zip(w[1:], g[1:]):
            assert wp.keys() == gp.keys()
            assert all(abs(wp[t].logprob - gp[t].logprob) < 1e-4 for t in wp)


def test_pipeline_through_the_server(make_ckpt) -> None:
    """PP=2 behind the HTTP server: concurrent greedy completions through the openai client (so that two steps are
    in flight) and a streamed one give the single process's tokens and text."""
    name, kw = CHECKPOINTS["llama"]
    model = make_ckpt(name, **kw)
    want, _ = _reference(model)
    with LLM(str(model), **EAGER) as llm:
        want_text = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY)[0].outputs[0].text

    async def ask(url: str) -> tuple[list[list[int]], str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model_id = (await client.models.list()).data[0].id

        async def one(prompt: list[int]) -> list[int]:
            r = await client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0.0,
                                                logprobs=1, extra_body={"ignore_eos": True,
                                                                        "return_tokens_as_token_ids": True})
            return [int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens]
        tokens = await asyncio.gather(*(one(p) for p in PROMPTS))
        stream = await client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=10, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        return list(tokens), text

    with LiveServer(model, pipeline_parallel_size=2, **EAGER) as server:
        got, text = asyncio.run(ask(server.url))
        overlapped = server.engine.num_overlapped_steps
    assert got == want
    assert text == want_text
    assert overlapped > 0, "the server never had two steps in flight"


def test_a_layer_partition_given_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("STREAMER_PP_LAYER_PARTITION", "5,7")
    assert [stage_layers(12, s, 2) for s in range(2)] == [(0, 5), (5, 12)]
    monkeypatch.setenv("STREAMER_PP_LAYER_PARTITION", "6,7")
    with pytest.raises(ValueError, match="adding up to the model's 12 layers"):
        stage_layers(12, 0, 2)
