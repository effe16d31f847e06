"""Ministral 3 (Ministral3ForCausalLM, and Mistral3ForConditionalGeneration over a "ministral3" text model):
Mistral with YaRN and Llama 4's query scale past the original length (streamer/models/ministral.py). Greedy tokens
equal transformers' on tiny checkpoints whose original length (16) the prompts pass several times over."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamer import LLM
from streamer.models import ministral
from tests.checkpoints import hf_greedy
from tests.parity import assert_outputs_match, greedy, prompts_of_lengths, tokens_and_logprobs

transformers = pytest.importorskip("transformers")

MAX_NEW = 8


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths((1, 5, 15, 16, 17, 33, 70, 130), seed=5)  # (scale steps at 16, 32, 48, ...)


@pytest.fixture(scope="module")
def case(make_ckpt, prompts):
    path = make_ckpt("ministral3", family="ministral3")
    return path, hf_greedy(path, prompts, MAX_NEW)


def test_matches_transformers(case, prompts) -> None:
    path, ref = case
    llm = LLM(str(path), dtype="float32")
    attn = llm.engine.runner.model.layers[0].self_attn
    assert type(attn).__name__ == "Ministral3Attention" and attn.scaling == (0.5, 16.0)
    assert llm.engine.model_config.rope_scaling["rope_type"] == "yarn"
    assert greedy(llm, prompts, MAX_NEW) == ref
    chunked = LLM(str(path), dtype="float32", max_num_batched_tokens=7)  # chunks start at other positions
    assert greedy(chunked, prompts, MAX_NEW) == ref
    assert len({tuple(r) for r in ref}) > 4, "degenerate reference"


def test_without_the_query_scale_it_differs(case, prompts, monkeypatch) -> None:
    """The check above can fail: Mistral's plain attention (no query scale) changes long prompts' tokens, not the
    shortest ones' (within 16 positions the scale is 1)."""
    path, ref = case
    monkeypatch.setattr(ministral, "llama4_scaling", lambda raw: None)
    got = greedy(LLM(str(path), dtype="float32"), prompts, MAX_NEW)
    assert got[:2] == ref[:2] and got[-3:] != ref[-3:]


def test_bad_scaling_config_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ministral.llama4_scaling({"rope_parameters": {"llama_4_scaling_beta": 0.1}})


def test_vision_language_checkpoint(ckpt_root: Path) -> None:
    """Mistral3ForConditionalGeneration over Ministral 3's text model: images and text equal transformers'."""
    from tests.test_mistral3 import IMAGE_SIZES, PARAMS, _prompts, hf_mistral3_greedy, make_mistral3_checkpoint, sized
    path = ckpt_root / "mistral3_ministral3"
    if not (path / "config.json").exists():
        make_mistral3_checkpoint(path, text="ministral3")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.model_config.architecture == "Ministral3ForCausalLM"
    ims = sized(IMAGE_SIZES, seed=0)
    prompts = _prompts(ims)
    outs = llm.generate(prompts, PARAMS)
    images = [[ims[0]], [ims[1]], [ims[2]], [ims[3], ims[1]], []]
    want = hf_mistral3_greedy(path, [(o.prompt_token_ids, im) for o, im in zip(outs, images)], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
