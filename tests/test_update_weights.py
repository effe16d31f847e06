"""New weights for a running engine (`update_weights`, SGLang's POST /update_weights_from_disk): a checkpoint of the
same model loads in place, CPU-packed linears and the packed head included, eager and compiled, and the engine then
writes what transformers writes with the new weights; a checkpoint of another shape changes nothing."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from tests.checkpoints import hf_greedy
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
    with pytest.raises(ValueError, match="update_weights: not with quantized weights"):
        LLM(str(old), dtype="float32", quantization="int8").update_weights(str(new))


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
