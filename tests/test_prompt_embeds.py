"""Prompts given as embeddings (streamer/engine/prompt_embeds.py): the embedding layer's rows for a prompt's tokens give the
tokens' output, in every family whose start differs (Gemma's scale, Granite's and Falcon-H1's multipliers, OPT's
projection, GPT-2's learned positions); a soft prompt gives transformers' output for the same inputs_embeds;
prefix caching, chunked prefill, truncation and penalties read the rows, not the placeholders; and the server takes
vLLM's base64 prompt_embeds."""
from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import openai
import pytest
import torch

import tests.test_classic_families  # noqa: F401  (registers the test checkpoint families: gpt2)
import tests.test_more_classic_families  # noqa: F401  (opt)
import tests.test_recurrent_families  # noqa: F401  (falcon_h1)
from streamer.core.request import Request
from streamer.engine.beam_search import BeamSearchParams
from streamer.engine.pooling import PoolingParams
from streamer.engine.prompt_embeds import embeds_input
from streamer.llm import LLM
from streamer.sampling_params import SamplingParams
from streamer.worker.sampler import build_penalties
from tests.server_utils import LiveServer

PROMPTS = [list(range(40, 77)), [5, 9, 200, 3, 17, 88, 120]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)


def hf_model(model_dir) -> Any:
    import transformers as tf
    m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return m.eval()


def hf_embeds(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' input embedding layer's output for each prompt: what a client sends as prompt_embeds."""
    layer = hf_model(model_dir).get_input_embeddings()
    with torch.no_grad():
        return [layer(torch.tensor(p)) for p in prompts]


def llm(model_dir, **kw: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", enforce_eager=True, num_kv_blocks=64, enable_prompt_embeds=True,
               **kw)


def assert_same(a, b) -> None:
    """Same tokens, same logprobs (the same computation, up to how a row got into the residual stream)."""
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            (tx, px), = [(t, lp.logprob) for t, lp in lx.items() if lp.rank == 1]
            assert ly[tx].logprob == pytest.approx(px, abs=1e-4)


FAMILIES = [("llama", {}), ("gemma3", {}), ("granite", dict(embedding_multiplier=3.0)),
            ("opt", dict(word_embed_proj_dim=32)), ("gpt2", {}), ("falcon_h1", {})]


@pytest.mark.parametrize("family,overrides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_embeddings_of_the_tokens_give_the_tokens_output(make_ckpt, family, overrides):
    path = make_ckpt(f"embeds-{family}", family=family, **overrides)
    engine = llm(path)
    by_ids = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    embeds = hf_embeds(path, PROMPTS)
    by_embeds = engine.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert_same(by_ids, by_embeds)
    assert [o.prompt_token_ids for o in by_embeds] == [[0] * len(p) for p in PROMPTS]  # (placeholders)
    assert all(o.prompt is None for o in by_embeds)


def _soft_prompt(dim: int, n: int = 21) -> torch.Tensor:
    """Rows no token embeds to: what a trained soft prompt is."""
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(3)) * 0.08


@pytest.mark.parametrize("family", ["llama", "granite"])
def test_a_soft_prompt_gives_transformers_output_for_the_same_inputs_embeds(make_ckpt, family):
    path = make_ckpt(f"embeds-{family}", family=family,
                     **(dict(embedding_multiplier=3.0) if family == "granite" else {}))
    soft = _soft_prompt(64)
    with torch.no_grad():
        ref = hf_model(path).generate(inputs_embeds=soft[None], attention_mask=torch.ones(1, len(soft)),
                                      max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    whole = llm(path).generate({"prompt_embeds": soft}, GREEDY, use_tqdm=False)[0]
    assert whole.outputs[0].token_ids == ref[0, -8:].tolist()
    # chunked prefill: each chunk reads its own rows
    chunked = llm(path, max_num_batched_tokens=8).generate({"prompt_embeds": soft}, GREEDY, use_tqdm=False)[0]
    assert_same([whole], [chunked])


def test_prefix_caching_keys_blocks_by_the_rows(llama_dir):
    engine = llm(llama_dir, block_size=16)
    soft = _soft_prompt(64, 40)
    first, again = (engine.generate({"prompt_embeds": soft}, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32  # two full blocks
    assert_same([first], [again])
    other = soft.clone()
    other[-1] += 0.5  # the same placeholders, other rows: nothing shared
    changed = engine.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)[0]
    assert changed.num_cached_tokens == 0
    # a token prompt of the placeholder ids shares nothing with them either
    zeros = engine.generate({"prompt_token_ids": [0] * 40}, GREEDY, use_tqdm=False)[0]
    assert zeros.num_cached_tokens == 0


def test_truncation_keeps_the_last_rows(llama_dir):
    engine = llm(llama_dir)
    soft = _soft_prompt(64, 30)
    cut = engine.generate({"prompt_embeds": soft}, GREEDY.clone(truncate_prompt_tokens=10), use_tqdm=False)[0]
    tail = engine.generate({"prompt_embeds": soft[-10:]}, GREEDY, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 10
    assert_same([cut], [tail])


def test_embedding_a_prompt_of_embeddings(llama_dir):
    engine = llm(llama_dir)
    (embeds,) = hf_embeds(llama_dir, PROMPTS[:1])
    by_ids, by_embeds = engine.embed([{"prompt_token_ids": PROMPTS[0]}, {"prompt_embeds": embeds}],
                                     PoolingParams())
    assert by_embeds.embedding == pytest.approx(by_ids.embedding, abs=1e-5)


def test_placeholders_are_not_seen_by_the_repetition_penalty():
    rows = torch.zeros(4, 8)
    ids, inputs = embeds_input(rows)
    embedded = Request("e", ids, SamplingParams(repetition_penalty=2.0), 8, images=inputs)
    tokens = Request("t", [0, 0, 0, 0], SamplingParams(repetition_penalty=2.0), 8)
    for r in (embedded, tokens):
        r.append_token(5)
    pen = build_penalties([embedded, tokens], [0, 1], 2, 16, torch.device("cpu"))
    assert pen.seen[0].nonzero().flatten().tolist() == [5]
    assert pen.seen[1].nonzero().flatten().tolist() == [0, 5]


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_embeds": torch.zeros(3, 65)}, r"shape \[sequence length, 64\]"),
    ({"prompt_embeds": torch.zeros(64)}, r"shape \[sequence length, 64\]"),
    ({"prompt_embeds": torch.zeros(0, 64)}, "must not be empty"),
    ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.int64)}, "floating-point"),
    ({"prompt_embeds": torch.full((3, 64), float("nan"))}, "non-finite"),
    ({"prompt_embeds": [[0.0] * 64]}, "must be a torch.Tensor"),
    ({"prompt_embeds": torch.zeros(3, 64), "prompt": "x"}, "no other keys"),
])
def test_bad_embeddings_are_refused_and_the_engine_goes_on(llama_dir, prompt, match):
    engine = llm(llama_dir)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt, GREEDY, use_tqdm=False)
    assert engine.engine.kv.pool.num_free == engine.engine.kv.num_blocks
    out = engine.generate({"prompt_embeds": torch.zeros(1, 3, 64)}, GREEDY, use_tqdm=False)[0]  # ([1, L, H] too)
    assert len(out.outputs[0].token_ids) == 8


def test_what_prompt_embeds_cannot_do(llama_dir):
    soft = {"prompt_embeds": _soft_prompt(64)}
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        LLM(str(llama_dir), dtype="float32", enforce_eager=True, num_kv_blocks=64).generate(soft, GREEDY)
    engine = llm(llama_dir)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with prompt_embeds"):
        engine.generate(soft, GREEDY.clone(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="beam search"):
        engine.beam_search(soft, BeamSearchParams(beam_width=2, max_tokens=4))


def _b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_server_takes_base64_prompt_embeds(llama_dir):
    embeds = hf_embeds(llama_dir, PROMPTS)
    with LiveServer(llama_dir, enable_prompt_embeds=True) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="x")
        kw = dict(model=server.model_name, max_tokens=8, temperature=0.0)
        by_ids = [c.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
        # the OpenAI client insists on a prompt: an empty one stands for none, as with vLLM
        r = c.completions.create(prompt="", extra_body={"prompt_embeds": _b64(embeds[0])}, **kw)
        assert r.choices[0].text == by_ids[0]
        assert r.usage.prompt_tokens == len(PROMPTS[0])
        # several: the embedded prompts first, then the text ones
        r = c.completions.create(prompt=PROMPTS[1], extra_body={"prompt_embeds": [_b64(e) for e in embeds]}, **kw)
        assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == by_ids + by_ids[1:]
        stream = c.completions.create(prompt="", stream=True, extra_body={"prompt_embeds": _b64(embeds[1])}, **kw)
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == by_ids[1]
        for body, param, match in [
            ({"prompt_embeds": "not base64!"}, "prompt_embeds", "not valid base64"),
            ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds", "torch.save"),
            ({"prompt_embeds": _b64(torch.zeros(3, 7))}, "prompt_embeds", "shape"),
            ({"prompt_embeds": [_b64(embeds[0]), 5]}, "prompt_embeds", "base64 string"),
            ({"prompt_embeds": _b64(embeds[0]), "echo": True}, "echo", "echo"),
        ]:
            with pytest.raises(openai.BadRequestError, match=match) as e:
                c.completions.create(prompt="", extra_body=body, **kw)
            assert e.value.body["param"] == param
        assert c.completions.create(prompt=PROMPTS[0], **kw).choices[0].text == by_ids[0]  # (still serving)
        engine = server.engine
        assert engine is not None and engine._core.kv.pool.num_free == engine._core.kv.num_blocks
    with LiveServer(llama_dir) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="x")
        with pytest.raises(openai.BadRequestError, match="--enable-prompt-embeds"):
            c.completions.create(model=server.model_name, prompt="", extra_body={"prompt_embeds": _b64(embeds[0])})


def test_async_engine_streams_a_prompt_of_embeddings(llama_dir):
    from streamer.engine.async_engine import AsyncEngine
    (embeds,) = hf_embeds(llama_dir, PROMPTS[:1])
    bf16 = embeds.to(torch.bfloat16)

    async def main() -> list[list[int]]:
        async with AsyncEngine(str(llama_dir), dtype="float32", enforce_eager=True, num_kv_blocks=64,
                               enable_prompt_embeds=True) as engine:
            outs = []
            # bf16 rows are the model's dtype's (float32) rows of the same values
            for prompt in ({"prompt_embeds": bf16.float()}, {"prompt_embeds": bf16}):
                ids = []
                async for out in engine.stream(prompt, GREEDY.clone(logprobs=None)):
                    ids += out.token_ids
                outs.append(ids)
            return outs

    as_float, as_bf16 = asyncio.run(main())
    assert len(as_bf16) == 8 and as_bf16 == as_float


def test_tensor_parallel_ranks_place_the_same_rows(make_ckpt):
    """Under tensor parallelism every rank gets the step's rows with the step (OPT: each rank projects them)."""
    path = make_ckpt("embeds-opt", family="opt", word_embed_proj_dim=32)
    soft = _soft_prompt(32, 19)
    want = llm(path).generate({"prompt_embeds": soft}, GREEDY, use_tqdm=False)
    with LLM(str(path), dtype="float32", enforce_eager=True, num_kv_blocks=64, enable_prompt_embeds=True,
             tensor_parallel_size=2, max_num_batched_tokens=8) as tp:
        got = tp.generate({"prompt_embeds": soft}, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        (t, lp), = [(t, lp.logprob) for t, lp in a.items() if lp.rank == 1]
        assert b[t].logprob == pytest.approx(lp, abs=1e-3)


def test_speculative_decoding_over_a_prompt_of_embeddings(llama_dir):
    """n-gram drafts look up the request's tokens, the placeholders among them: drafts may be wasted, never the
    output (greedy: the plain engine's tokens)."""
    embeds = hf_embeds(llama_dir, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm(llama_dir).generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    spec_llm = llm(llama_dir, num_speculative_tokens=3, prompt_lookup_min=1)
    spec = spec_llm.generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine.num_draft_tokens > 0


# ---------------------------------------------------------------------------------------------- zip bombs (issue 49)
def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _recompressed(raw: bytes) -> bytes:
    """torch.save's archive with its entries deflated: a small body that torch.load would inflate."""
    import zipfile
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


def test_a_compressed_archive_is_refused_before_it_is_inflated():
    from streamer.engine.prompt_embeds import decode_base64
    raw = _recompressed(_saved(torch.zeros(4096, 1024)))  # 16 MiB of zeros
    assert len(raw) < 200_000
    with pytest.raises(ValueError, match="compressed"):
        decode_base64(base64.b64encode(raw).decode())
    plain = decode_base64(base64.b64encode(_saved(torch.ones(3, 8))).decode())  # torch.save's own still loads
    assert plain.shape == (3, 8)


def test_rows_past_max_model_len_are_refused_before_they_are_copied():
    from streamer.engine.prompt_embeds import check_embeds, decode_base64
    view = torch.zeros(1, 64).expand(50_000_000, 64)  # a stride-0 view: 12.8 GB once copied
    t = decode_base64(base64.b64encode(_saved(view)).decode())
    assert t.untyped_storage().nbytes() <= 64 * 4
    with pytest.raises(ValueError, match="max_model_len"):
        check_embeds(t, 64, torch.float32, max_rows=2048)


def test_server_refuses_a_zip_bomb(llama_dir):
    with LiveServer(llama_dir, enable_prompt_embeds=True) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        width = server.engine._core.runner.model.input_width
        bomb = base64.b64encode(_recompressed(_saved(torch.zeros(2000, width)))).decode()
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=server.model_name, prompt="", max_tokens=2,
                                      extra_body={"prompt_embeds": bomb})
        assert "compressed" in str(e.value)
        ok = client.completions.create(model=server.model_name, prompt="hi", max_tokens=2)
        assert ok.choices[0].text is not None
