"""New weights for a running engine (`update_weights`, SGLang's POST /update_weights_from_disk): a checkpoint of the
same model loads in place, CPU-packed linears and the packed head included, eager and compiled, and the engine then
writes what transformers writes with the new weights; a checkpoint of another shape changes nothing."""
from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from tests.checkpoints import hf_greedy
from tests.int_checkpoints import write_int_checkpoint
from tests.server_utils import LiveServer

PROMPTS = [[5, 9, 200, 3, 17, 88, 120, 7, 7, 31, 64, 2, 90, 14, 15, 16, 300, 301], [40, 41, 42]]
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def old_new(make_ckpt) -> tuple[Path, Path]:
    """Two checkpoints of one model (the same config and tensors, other random weights), untied heads: the LM
    head is packed on its own."""
    return (make_ckpt("upd_a", family="llama", tie_word_embeddings=False),
            make_ckpt("upd_b", family="llama", tie_word_embeddings=False, seed=1))


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_new_weights_write_what_transformers_writes_with_them(old_new, eager):
    old, new = old_new
    want_old, want_new = hf_greedy(old, PROMPTS, NEW), hf_greedy(new, PROMPTS, NEW)
    assert want_old != want_new
    llm = LLM(str(old), dtype="float32", block_size=4, enforce_eager=eager)
    runner = llm.engine.runner
    assert runner.compiled == (not eager)
    assert any(getattr(m, "packed", None) is not None for m in runner.model.modules())  # (CPU-packed linears)
    assert runner.model.packed_head is not None
    assert tokens(llm) == want_old
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_weights(str(new))
    assert tokens(llm) == want_new
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]  # (cached anew after the reset)
    assert out.outputs[0].token_ids == want_new[0]
    llm.update_weights(str(old))  # and back
    assert tokens(llm) == want_old
    assert runner.compiled == (not eager)  # (no fallback to eager on the way)


def test_another_models_checkpoint_changes_nothing(old_new, make_ckpt, tmp_path):
    old, new = old_new
    llm = LLM(str(old), dtype="float32")
    before = tokens(llm)
    wider = make_ckpt("upd_wider", family="llama", tie_word_embeddings=False, intermediate_size=96)
    with pytest.raises(ValueError, match="config differs in intermediate_size"):
        llm.update_weights(str(wider))
    short = tmp_path / "short"
    shutil.copytree(new, short)
    (f,) = short.glob("*.safetensors")
    tensors = load_file(f)
    del tensors["model.norm.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="other tensors than the model's \\(model.norm.weight\\)"):
        llm.update_weights(str(short))
    with pytest.raises(FileNotFoundError):
        llm.update_weights(str(tmp_path / "nowhere"))
    assert tokens(llm) == before


def test_a_quantized_checkpoint_keeps_its_weights(llama_dir, tmp_path):
    """A checkpoint's own 4-bit codes load as stored: a float checkpoint would not give them back."""
    gptq = tmp_path / "gptq"
    write_int_checkpoint(llama_dir, gptq, tmp_path / "ref", "gptq", group_size=32)
    with LLM(str(gptq), dtype="float32") as llm, \
            pytest.raises(ValueError, match="update_weights: not with a quantized checkpoint"):
        llm.update_weights(str(gptq))


def test_server_updates_weights_from_disk(old_new):
    old, new = old_new
    want_new = hf_greedy(new, PROMPTS[:1], NEW)[0]
    with LiveServer(old, allow_weight_updates=True) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="x")

        def complete() -> list[int]:
            return c.completions.create(model=server.model_name, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
        old_tokens = complete()
        r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(new)}, timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True
        assert complete() == want_new != old_tokens
        r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": "/nowhere"}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
        assert complete() == want_new
    with LiveServer(old) as server:  # not allowed: no such route
        assert httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(new)}).status_code == 404


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3", "granitemoehybrid"])
def test_other_families(make_ckpt, family):
    """Stacked experts (their custom op reads the same tensors), Gemma's tied head, a hybrid's recurrent layers."""
    old, new = make_ckpt(f"upd_{family}_a", family=family), make_ckpt(f"upd_{family}_b", family=family, seed=1)
    want = hf_greedy(new, PROMPTS, NEW)
    llm = LLM(str(old), dtype="float32")
    tokens(llm)
    llm.update_weights(str(new))
    assert tokens(llm) == want


def derived_tensors(llm: LLM) -> list[torch.Tensor]:
    """Every tensor the model derived from its float weights at load (rounded, FP8, absorbed)."""
    out: list[torch.Tensor] = []
    for m in llm.engine.runner.model.modules():
        q = getattr(m, "qweight", None)
        if q is not None:
            out += [t for t in vars(q).values() if isinstance(t, torch.Tensor)]
        if getattr(m, "fp8", None) is not None:
            out += list(m.fp8)
        if getattr(m, "int4", None) is not None:
            out += [t for ws in m.int4 for w in ws for t in vars(w).values() if isinstance(t, torch.Tensor)]
        if getattr(m, "w_uk", None) is not None:
            out += [m.w_uk, m.w_uv]
    return out


@pytest.mark.parametrize("family,quantization", [("llama", "int8"), ("llama", "int4"), ("llama", "fp8"),
                                                 ("qwen3_moe", "int4"), ("deepseek_v3", None)])
def test_weights_derived_at_load_are_derived_again_in_place(make_ckpt, family, quantization):
    """Weights rounded at load (4-bit linears and experts, 8-bit, FP8) and DeepSeek's absorbed latent projections
    are computed again from the new float weights, into the tensors the model already reads: the engine then
    writes what a fresh engine on the new checkpoint writes."""
    old = make_ckpt(f"upd_{family}_a", family=family)
    new = make_ckpt(f"upd_{family}_b", family=family, seed=1)
    args = dict(dtype="float32", quantization=quantization, block_size=4)
    with LLM(str(new), **args) as fresh:
        want = tokens(fresh)
    with LLM(str(old), **args) as llm:
        before = tokens(llm)
        assert before != want
        derived = derived_tensors(llm)
        assert derived, "nothing derived at load: the case tests nothing"
        ptrs = [t.data_ptr() for t in derived]
        llm.update_weights(str(new))
        assert tokens(llm) == want
        assert [t.data_ptr() for t in derived_tensors(llm)] == ptrs  # (the same memory, new values)
        llm.update_weights(str(old))
        assert tokens(llm) == before


def test_tensor_parallel_ranks_load_their_shards(old_new, make_ckpt):
    """Under tensor parallelism every rank loads its shard of the new checkpoint between the same two steps."""
    old, new = old_new
    want_old, want_new = hf_greedy(old, PROMPTS, NEW), hf_greedy(new, PROMPTS, NEW)
    with LLM(str(old), dtype="float32", tensor_parallel_size=2, block_size=4) as llm:
        assert tokens(llm) == want_old
        llm.update_weights(str(new))
        assert tokens(llm) == want_new
        wider = make_ckpt("upd_wider", family="llama", tie_word_embeddings=False, intermediate_size=96)
        with pytest.raises(ValueError, match="config differs in intermediate_size"):
            llm.update_weights(str(wider))
        llm.update_weights(str(old))
        assert tokens(llm) == want_old
        llm.update_weights(state_dict(new))  # (tensors: sent to the workers with the command)
        assert tokens(llm) == want_new
        sd = state_dict(old)  # back again in two buckets (partial: the workers too load only what is given)
        llm.update_weights({n: t for n, t in sd.items() if ".layers.0." in n}, partial=True)
        llm.update_weights({n: t for n, t in sd.items() if ".layers.0." not in n}, partial=True)
        assert tokens(llm) == want_old


def state_dict(folder: Path) -> dict[str, torch.Tensor]:
    (f,) = folder.glob("*.safetensors")
    return load_file(f)


def test_tensors_by_checkpoint_name(old_new, make_ckpt):
    """A trainer's weights, in memory: a state dict (transformers' own, with its tied head listed twice) or
    (name, tensor) pairs, in any float dtype."""
    old, new = old_new
    want_old, want_new = hf_greedy(old, PROMPTS, NEW), hf_greedy(new, PROMPTS, NEW)
    with LLM(str(old), dtype="float32") as llm:
        llm.update_weights(state_dict(new))
        assert tokens(llm) == want_new
        llm.update_weights((name, t.double()) for name, t in state_dict(old).items())  # (a generator of pairs)
        assert tokens(llm) == want_old
    tied_old, tied_new = make_ckpt("upd_tied_a", family="llama"), make_ckpt("upd_tied_b", family="llama", seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tied_new, dtype=torch.float32)
    assert "lm_head.weight" in hf.state_dict()  # (the tied head, listed beside the embeddings)
    with LLM(str(tied_old), dtype="float32") as llm:
        llm.update_weights(hf.state_dict())
        assert tokens(llm) == hf_greedy(tied_new, PROMPTS, NEW)


def test_bad_tensors_change_nothing(old_new):
    old, new = old_new
    with LLM(str(old), dtype="float32") as llm:
        before = tokens(llm)
        good = state_dict(new)
        cases = {
            "missing model.norm.weight": {k: v for k, v in good.items() if k != "model.norm.weight"},
            "not the model's: model.extra": {**good, "model.extra": torch.zeros(3)},
            "model.norm.weight must be a float tensor of shape \\[64\\], not float32 \\[65\\]":
                {**good, "model.norm.weight": torch.zeros(65)},
            "model.norm.weight must be a float tensor of shape \\[64\\], not int64 \\[64\\]":
                {**good, "model.norm.weight": torch.zeros(64, dtype=torch.int64)},
            "model.norm.weight must be a float tensor of shape \\[64\\], not list":
                {**good, "model.norm.weight": [0.0] * 64},
            "given twice": list(good.items()) + [("model.norm.weight", good["model.norm.weight"])],
            "a mapping of tensor names to tensors, or \\(name, tensor\\) pairs": [torch.zeros(3)],
        }
        for weights in (5, None):
            with pytest.raises(ValueError, match="weights must be a checkpoint folder"):
                llm.update_weights(weights)
        for message, weights in cases.items():
            with pytest.raises(ValueError, match=message):
                llm.update_weights(weights)
        assert tokens(llm) == before
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_an_mtp_layer_drafts_with_its_new_weights(make_ckpt, tmp_path):
    """speculative_method="mtp": the checkpoint's own MTP layer (a drafter of its own, sharing the target's
    embeddings) loads its new weights too: its proposals are the new layer's."""
    from tests.test_eagle import assert_proposals_match, spy_proposals
    from tests.test_mtp import MAX_NEW, K, Reference, with_mtp_layer
    from tests.test_mtp import PROMPTS as MTP_PROMPTS
    old = with_mtp_layer(make_ckpt("upd_deepseek_v3_a", family="deepseek_v3"), tmp_path / "a", seed=3)
    new = with_mtp_layer(make_ckpt("upd_deepseek_v3_b", family="deepseek_v3", seed=1), tmp_path / "b", seed=4)
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    with LLM(str(old), dtype="float32", speculative_method="mtp", num_speculative_tokens=K) as llm:
        llm.generate([{"prompt_token_ids": p} for p in MTP_PROMPTS], params, use_tqdm=False)
        llm.update_weights(str(new))
        calls = spy_proposals(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in MTP_PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(new, MTP_PROMPTS, MAX_NEW)
        sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, MTP_PROMPTS)}
        assert assert_proposals_match(Reference(new), calls[:4], sequences) >= 12
        norm = "model.norm.weight"  # (DeepSeek's absorbed attention weights: a partial update is refused)
        with pytest.raises(ValueError, match="partial updates are not supported for this model"):
            llm.update_weights({norm: next(load_file(f)[norm] for f in new.glob("*.safetensors")
                                           if norm in load_file(f))}, partial=True)


async def _streaming(engine, prompt: list[int], params: SamplingParams,
                     started: int) -> tuple["asyncio.Task[list[int]]", list[int]]:
    """A request streaming in the background, once it has `started` tokens: (its task, its tokens so far, growing)."""
    tokens: list[int] = []
    ready = asyncio.Event()

    async def run() -> list[int]:
        async for out in engine.stream({"prompt_token_ids": prompt}, params):
            tokens.extend(out.token_ids)
            if len(tokens) >= started:
                ready.set()
        return tokens

    task = asyncio.create_task(run())
    await ready.wait()
    return task, tokens


def test_pause_update_resume(old_new):
    """The RL weight sync: pause (no step runs, running requests keep their place), load new weights, resume. A
    request that arrives while paused waits and then runs wholly on the new weights; "abort" ends the requests in
    flight instead."""
    from streamer import AsyncEngine
    old, new = old_new
    want_b = hf_greedy(new, PROMPTS[1:], NEW)[0]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        async with AsyncEngine(str(old), dtype="float32") as engine:
            launches = []
            inner = engine._core.runner.launch
            engine._core.runner.launch = lambda step: (launches.append(1), inner(step))[1]
            a, first = await _streaming(engine, PROMPTS[0], long, 3)
            assert await engine.pause_generation() == 1 and engine.is_paused
            steps, got = len(launches), len(first)
            b = asyncio.create_task(engine.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY))
            await engine.update_weights(str(new))
            await asyncio.sleep(0.3)
            assert len(launches) == steps and len(first) == got and not b.done()  # (nothing ran while paused)
            await engine.resume_generation()
            assert (await b).outputs[0].token_ids == want_b
            assert len(await a) == 200
            c = asyncio.create_task(engine.generate({"prompt_token_ids": PROMPTS[0]}, long))
            while not launches or len(launches) == steps:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert await engine.pause_generation("abort") == 1
            assert (await c).outputs[0].finish_reason == "abort"
            await engine.resume_generation()
            assert engine._core.kv.pool.num_free == engine._core.kv.num_blocks
            with pytest.raises(ValueError, match="mode must be 'keep', 'abort' or 'retract'"):
                await engine.pause_generation("later")
            # "retract": the running request gives its KV back while paused, is recomputed on resume, and its
            # output goes on as if nothing happened
            want_d = hf_greedy(new, PROMPTS[:1], 24)[0]
            d, got_d = await _streaming(engine, PROMPTS[0],
                                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), 4)
            assert await engine.pause_generation("retract") == 1
            kv = engine._core.kv
            assert kv.pool.num_free == kv.num_blocks and not engine._core.scheduler.running
            assert len(got_d) < 24 and not d.done()
            await engine.resume_generation()
            assert await d == want_d

    asyncio.run(asyncio.wait_for(main(), 300))


def test_server_pause_and_continue(old_new):
    old, _ = old_new
    with LiveServer(old, allow_weight_updates=True) as server:
        r = httpx.post(server.url + "/pause_generation", json={"mode": "keep"})
        assert r.status_code == 200 and r.json() == {"paused": True, "mode": "keep", "requests": 0}
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
        c = openai.OpenAI(base_url=server.base_url, api_key="x")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(c.completions.create, model=server.model_name, prompt=PROMPTS[0], max_tokens=NEW,
                                  temperature=0)
            time.sleep(0.5)
            assert not pending.done()  # (it waits for the resume)
            assert httpx.post(server.url + "/continue_generation").json() == {"paused": False}
            assert pending.result(timeout=60).usage.completion_tokens == NEW
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}
        r = httpx.post(server.url + "/pause_generation", json={"mode": "later"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    with LiveServer(old) as server:
        assert httpx.post(server.url + "/pause_generation").status_code == 404


def _mixed_checkpoint(old: Path, new: Path, names: list[str], out: Path) -> Path:
    """`old` with the tensors `names` taken from `new`: what a partial update of those tensors must give."""
    shutil.copytree(old, out)
    (f,) = out.glob("*.safetensors")
    tensors, fresh = load_file(f), load_file(next(new.glob("*.safetensors")))
    tensors.update({n: fresh[n] for n in names})
    save_file(tensors, f, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_partial_update_changes_those_tensors_alone(old_new, tmp_path, quantization):
    """Some tensors by name (a trainer's bucket), CPU-packed (and with int8, rounded) linears among them: the engine
    then writes what a fresh engine on the old checkpoint with those tensors swapped writes. A packed or rounded
    projection given in part (q without k and v) is refused before anything changes."""
    old, new = old_new
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + ["model.layers.1.mlp.down_proj.weight",
                                                                             "lm_head.weight", "model.norm.weight"]
    mixed = _mixed_checkpoint(old, new, names, tmp_path / "mixed")
    fresh = load_file(next(new.glob("*.safetensors")))
    with LLM(str(mixed), dtype="float32", quantization=quantization) as ref:
        want = tokens(ref)
    llm = LLM(str(old), dtype="float32", quantization=quantization)
    before = tokens(llm)
    assert before != want
    for bad, match in (([names[0]], "derived .* give them together"), ([("model.nope.weight")], "not the model's"),
                       ([], "no tensor given")):
        with pytest.raises(ValueError, match=match):
            llm.update_weights([(n, fresh[n]) for n in bad] if bad != ["model.nope.weight"]
                               else [("model.nope.weight", fresh[names[0]])], partial=True)
    with pytest.raises(ValueError, match="a checkpoint folder loads whole"):
        llm.update_weights(str(new), partial=True)
    assert tokens(llm) == before  # (refused: nothing changed)
    for bucket in (names[:3], names[3:]):  # in two buckets, as a trainer sends them
        llm.update_weights({n: fresh[n] for n in bucket}, partial=True)
    assert tokens(llm) == want
    with pytest.raises(ValueError, match="every tensor of the model's checkpoint"):
        llm.update_weights({n: fresh[n] for n in names})  # (not partial: all or nothing, as before)
