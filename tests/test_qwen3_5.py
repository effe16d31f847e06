"""Qwen3.5 (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM and the Qwen3_5(Moe)ForConditionalGeneration checkpoints
every release ships): Qwen3-Next's hybrid with separate Gated DeltaNet projections, interleaved M-RoPE and
Qwen3-VL's vision tower without DeepStack (streamer/models/qwen3_5.py, models/vlm.py). Greedy tokens (and, with
images, logprobs) equal transformers' on tiny checkpoints, whatever the batching; the state slots and KV blocks
all back in their pools at the end."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from streamer.models.config import ModelConfig
from tests.checkpoints import hf_greedy
from tests.parity import (
    assert_outputs_match,
    assert_state_freed,
    greedy,
    logprob_gap,
    prompts_of_lengths,
    tokens_and_logprobs,
)

transformers = pytest.importorskip("transformers")

MAX_NEW = 8
LENGTHS = (1, 2, 5, 9, 17, 33, 70, 130)  # one token, under the conv window, one 64-token delta-rule chunk, several


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=3)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def text_case(request, make_ckpt, prompts):
    path = make_ckpt(request.param, family=request.param)
    return path, hf_greedy(path, prompts, MAX_NEW)


def test_text_model_matches_transformers(text_case, prompts) -> None:
    path, ref = text_case
    llm = LLM(str(path), dtype="float32")
    model = llm.engine.runner.model
    assert type(model).__name__ == "Qwen35ForCausalLM"
    assert [c.numel() > 0 for c in llm.engine.runner.kv_caches] == [False, True, False, False]
    assert type(model.layers[0].linear_attn).__name__ == "Qwen35GatedDeltaNet"
    moe = "moe" in path.name
    assert all(type(layer.mlp).__name__ == ("Qwen3NextSparseMoE" if moe else "MLP") for layer in model.layers)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert len({tuple(r) for r in ref}) > 4, "degenerate reference: the test would not discriminate"
    assert_state_freed(llm)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=5),  # prompts over many chunks (state carried), mixed with decodes
    dict(max_num_batched_tokens=40, num_kv_blocks=20, block_size=8),  # chunking + preemption
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_scheduling_variants_match(text_case, prompts, engine_args) -> None:
    path, ref = text_case
    llm = LLM(str(path), dtype="float32", **engine_args)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert_state_freed(llm)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"


def test_swapped_projections_fail(make_ckpt, prompts, tmp_path) -> None:
    """The check above can fail: in_proj_b and in_proj_a swapped (same shapes) change the tokens."""
    path = make_ckpt("qwen3_5", family="qwen3_5")
    ref = hf_greedy(path, prompts[:4], MAX_NEW)
    bad = tmp_path / "swapped"
    shutil.copytree(path, bad)
    weights = load_file(str(bad / "model.safetensors"))
    for i in (0, 2, 3):
        a, b = (f"model.layers.{i}.linear_attn.in_proj_{x}.weight" for x in "ab")
        weights[a], weights[b] = weights[b], weights[a]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert greedy(LLM(str(bad), dtype="float32"), prompts[:4], MAX_NEW) != ref


def test_stacked_experts_and_mtp_weights_load(make_ckpt, prompts, tmp_path) -> None:
    """Experts stacked per layer (transformers 5's layout) read as each expert's; the `mtp.*` head is skipped."""
    path = make_ckpt("qwen3_5_moe", family="qwen3_5_moe")
    ref = hf_greedy(path, prompts[:4], MAX_NEW)
    stacked = tmp_path / "stacked"
    shutil.copytree(path, stacked)
    weights = load_file(str(stacked / "model.safetensors"))
    for i in range(4):
        pre = f"model.layers.{i}.mlp.experts"
        gate_up = [torch.cat([weights.pop(f"{pre}.{e}.gate_proj.weight"), weights.pop(f"{pre}.{e}.up_proj.weight")])
                   for e in range(4)]
        weights[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
        weights[f"{pre}.down_proj"] = torch.stack([weights.pop(f"{pre}.{e}.down_proj.weight") for e in range(4)])
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(weights, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    assert greedy(LLM(str(stacked), dtype="float32"), prompts[:4], MAX_NEW) == ref


def test_transformers_default_configs_read() -> None:
    """transformers' own Qwen3.5 configs (its class defaults: Qwen3.5-9B / 35B-A3B shaped) as the engine reads them."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig
    dense = ModelConfig.from_dict(Qwen3_5Config().to_dict() | {"architectures": ["Qwen3_5ForConditionalGeneration"]})
    assert (dense.architecture, dense.hidden_size, dense.num_layers, dense.head_dim, dense.rotary_dim,
            dense.mrope_section, dense.mrope_interleaved, dense.image_token_id) == \
        ("Qwen3_5ForCausalLM", 4096, 32, 256, 64, [11, 11, 10], True, 248056)
    moe = ModelConfig.from_dict(Qwen3_5MoeConfig().to_dict() | {"architectures": ["Qwen3_5MoeForConditionalGeneration"]})
    assert (moe.architecture, moe.raw["num_experts"], moe.raw["norm_topk_prob"], moe.intermediate_size) == \
        ("Qwen3_5MoeForCausalLM", 256, True, moe.raw["shared_expert_intermediate_size"])


# ---------------------------------------------------------------------------------------------- with images
from tests.test_qwen3_vl import PROMPT, TEXT, TWO  # noqa: E402  (Qwen2-VL's tokens and template)

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)  # (transformers: min_new_tokens)


def _images(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def vl_case(request, ckpt_root: Path):
    """Prompts with one image (two sizes), two images, and none, in one batch; transformers' greedy tokens and
    logprobs for them."""
    from tests.checkpoints import hf_qwen_vl_greedy, make_qwen3_5_vl_checkpoint
    path = ckpt_root / ("qwen3_5_vl_moe" if request.param else "qwen3_5_vl")
    if not (path / "config.json").exists():
        make_qwen3_5_vl_checkpoint(path, moe=request.param)
    ims = _images([(30, 48), (40, 40), (20, 64)], seed=12)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims[:2]]
    prompts.append({"prompt": TWO, "multi_modal_data": {"image": [ims[2], ims[0]]}})
    prompts.append({"prompt": TEXT})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, PARAMS)
    want = hf_qwen_vl_greedy(path, [(o.prompt_token_ids, [im]) for o, im in zip(outs, ims[:2])]
                             + [(outs[2].prompt_token_ids, [ims[2], ims[0]]), (outs[3].prompt_token_ids, [])], 5)
    return path, llm, prompts, outs, want


def test_images_match_transformers(vl_case) -> None:
    """Tokens and logprobs equal transformers', whole, chunked (chunks split images and carry the recurrent state
    through them) and from the prefix cache (a state checkpoint past the image)."""
    path, llm, prompts, outs, want = vl_case
    assert llm.engine.runner.model.vision_tower.num_deepstack == 0
    assert_outputs_match(tokens_and_logprobs(outs), want)
    chunked = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, block_size=4)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    assert chunked.engine.runner.encoder_cache.num_encoded == 3  # three distinct images, each encoded once
    assert_state_freed(chunked)
    kv = chunked.engine.kv
    kv.check_consistency()
    assert kv.pool.num_free == kv.num_blocks


def test_sectioned_mrope_differs(vl_case, monkeypatch) -> None:
    """The check above can fail: Qwen2-VL's sectioned M-RoPE in place of the interleaved one is measurably off
    transformers for prompts with images, while the text-only prompt stays equal."""
    from streamer.models.layers import RotaryEmbedding
    path, _, prompts, _, want = vl_case
    plain = RotaryEmbedding.use_mrope
    monkeypatch.setattr(RotaryEmbedding, "use_mrope", lambda self, section, interleaved=False: plain(self, section))
    off = tokens_and_logprobs(LLM(str(path), dtype="float32", num_kv_blocks=64).generate(prompts, PARAMS))
    assert logprob_gap(off[:3], want[:3]) > 1e-2, logprob_gap(off[:3], want[:3])  # (0.05 dense, 0.14 MoE here)
    assert_outputs_match(off[3:], want[3:])


def test_videos_match_transformers(ckpt_root: Path) -> None:
    """Videos as Qwen3-VL's (each temporal grid step after its time as text; Qwen3VLProcessor is Qwen3.5's too):
    tokens and logprobs equal transformers' for the video cases of tests/test_qwen3_vl_video.py."""
    import json

    from tests.checkpoints import make_qwen3_5_vl_checkpoint
    from tests.test_qwen3_vl_video import VIDEO_CONFIG, _prompts, _run_case
    from tests.test_qwen_video import QWEN_VL_VIDEO_TEMPLATE
    path = ckpt_root / "qwen3_5_vl_video"
    make_qwen3_5_vl_checkpoint(path, chat_template=QWEN_VL_VIDEO_TEMPLATE)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    llm, _, outs, want = _run_case(path)
    assert all(im.video for im in llm.engine.process_prompt(_prompts()[0])[2])
    assert_outputs_match(tokens_and_logprobs(outs), want)
    assert_state_freed(llm)


def test_mtp_drafts_with_images(vl_case, tmp_path) -> None:
    """Qwen3.5 releases are vision-language checkpoints: their `mtp.*` layer drafts for image prompts too (reading
    placeholder embeddings and 1-D positions: fewer drafts accepted at images, never other tokens). Greedy output
    equals the same engine's without drafts; everything is freed."""
    import json
    path, llm, prompts, outs, _ = vl_case
    mtp_path = tmp_path / "with_mtp"
    shutil.copytree(path, mtp_path)
    h = json.loads((path / "config.json").read_text())["text_config"]["hidden_size"]
    g = torch.Generator().manual_seed(5)
    mtp = {"mtp.layers.0." + n[len("model.language_model.layers.1."):]: t + 0.05 * torch.randn(t.shape, generator=g)
           for n, t in load_file(str(path / "model.safetensors")).items()
           if n.startswith("model.language_model.layers.1.")}  # (the tiny model's full-attention layer, with noise)
    mtp.update({"mtp.fc.weight": 0.15 * torch.randn(h, 2 * h, generator=g), "mtp.norm.weight": torch.zeros(h),
                "mtp.pre_fc_norm_embedding.weight": torch.zeros(h), "mtp.pre_fc_norm_hidden.weight": torch.zeros(h)})
    save_file(mtp, str(mtp_path / "model-mtp.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = LLM(str(mtp_path), dtype="float32", num_kv_blocks=64, speculative_method="mtp", num_speculative_tokens=2)
    assert type(spec.engine.runner.drafter.model).__name__ == "Qwen3NextMTP"
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.num_draft_tokens > 0
    assert_state_freed(spec)
    with pytest.raises(ValueError, match="a checkpoint's own MTP layer does"):  # (a separate draft model: not yet)
        LLM(str(path), dtype="float32", speculative_model=str(path), num_speculative_tokens=2)


def test_server_chat_with_an_image(vl_case) -> None:
    """A live server on the Qwen3.5 checkpoint answers an OpenAI chat request with a base64 image as LLM.chat does
    (the same tokens), and leaves every state slot and KV block free."""
    import base64
    import io

    import openai

    from tests.server_utils import LiveServer
    path, llm, _, _, _ = vl_case
    im = _images([(36, 52)], seed=13)[0]
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    greedy_params = SamplingParams(max_tokens=8, temperature=0.0)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": im},
                                                  {"type": "text", "text": "What is it?"}]}], greedy_params)
    with LiveServer(path, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        r = client.chat.completions.create(model=server.model_name, max_tokens=8, temperature=0.0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}])
    assert chat[0].outputs[0].text and r.choices[0].message.content == chat[0].outputs[0].text
    assert r.usage.prompt_tokens == len(chat[0].prompt_token_ids) and r.usage.completion_tokens == 8
    assert_state_freed(llm)
