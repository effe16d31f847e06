"""Vision-language models (LLaVA): images in prompts, against transformers' LlavaForConditionalGeneration on the
same tiny checkpoint, through the engine's whole path (placeholder expansion, chunked prefill across an image,
the prefix cache, the encoder cache, preemption), the chat template and the live server."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from streamer import LLM, PoolingParams, SamplingParams
from tests.checkpoints import hf_llava_greedy, make_llava_checkpoint
from tests.parity import assert_outputs_match, tokens_and_logprobs
from tests.server_utils import LiveServer

TOKENS = 16  # image tokens per image: (32 / 8) ** 2 patches (CLIP's class token dropped; SigLIP has none)
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _dir(root: Path, name: str, **kw) -> Path:
    path = root / name
    if not (path / "config.json").exists():
        make_llava_checkpoint(path, **kw)
    return path


@pytest.fixture(scope="module")
def llava_dir(ckpt_root) -> Path:
    return _dir(ckpt_root, "llava_clip")


@pytest.fixture(scope="module")
def llm(llava_dir) -> LLM:
    return LLM(str(llava_dir), dtype="float32", num_kv_blocks=64)


def images(n: int, seed: int = 0) -> list[Image.Image]:
    """Random RGB images of assorted sizes (the processor resizes and crops them to 32x32)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (30 + 9 * i, 48 - 5 * i, 3), dtype=np.uint8)) for i in range(n)]


def expanded(llm: LLM, text: str) -> list[int]:
    """The prompt's ids with each image token repeated TOKENS times (what transformers' LlavaProcessor feeds)."""
    image_id = llm.engine.model_config.image_token_id
    return [x for t in llm.tokenizer.encode(text) for x in ([t] * TOKENS if t == image_id else [t])]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def check_freed(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_consistency()
    assert kv.pool.num_free == kv.num_blocks


def test_greedy_output_equals_transformers(llava_dir: Path, llm: LLM) -> None:
    ims = images(3)
    two = "USER: <image>\n<image>\nWhich one is brighter? ASSISTANT:"
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims]
    prompts.append({"prompt": two, "multi_modal_data": {"image": ims[:2]}})
    prompts.append({"prompt": "USER: no picture here ASSISTANT:"})
    outs = llm.generate(prompts, GREEDY)
    assert outs[0].prompt_token_ids == expanded(llm, PROMPT)
    want = hf_llava_greedy(llava_dir, [(expanded(llm, PROMPT), [im]) for im in ims]
                           + [(expanded(llm, two), ims[:2]), (expanded(llm, prompts[-1]["prompt"]), [])], 8)
    assert tokens(outs) == want
    assert len({tuple(t) for t in want[:3]}) > 1  # the images steer the output (same text, other tokens)
    check_freed(llm)


def test_an_image_split_over_chunks_and_evicted_features(llava_dir: Path) -> None:
    """Prefill chunks of 8 tokens cut each image in two; an encoder cache too small to keep anything makes every
    chunk encode its image again; few KV blocks preempt requests (recomputed from scratch)."""
    llm = LLM(str(llava_dir), dtype="float32", max_num_batched_tokens=8, encoder_cache_bytes=0, num_kv_blocks=20,
              block_size=4)
    ims = images(4, seed=1)
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims],
                        SamplingParams(max_tokens=12, temperature=0.0))
    want = hf_llava_greedy(llava_dir, [(expanded(llm, PROMPT), [im]) for im in ims], 12)
    assert tokens(outs) == want
    assert llm.engine.runner.encoder_cache.num_encoded > len(ims)  # chunks re-encoded their images
    assert llm.engine.scheduler.num_preemptions > 0
    check_freed(llm)


def test_prefix_cache_keys_on_the_image(llava_dir: Path, llm: LLM) -> None:
    """The same text with another image must not reuse the first image's KV; the same image does."""
    a, b = images(2, seed=2)
    text = "USER: a long shared preamble before the picture, long enough for some blocks <image>\nAnd? ASSISTANT:"
    run = lambda im: llm.generate({"prompt": text, "multi_modal_data": {"image": im}}, GREEDY)[0]  # noqa: E731
    first, same, other = run(a), run(a), run(b)
    before_image = expanded(llm, text).index(llm.engine.model_config.image_token_id)
    assert same.num_cached_tokens > before_image  # blocks holding the image are reused for the same image
    assert other.num_cached_tokens <= before_image  # ... but not for another one
    assert tokens([same]) == tokens([first])
    assert tokens([first, other]) == hf_llava_greedy(llava_dir, [(expanded(llm, text), [a]),
                                                                 (expanded(llm, text), [b])], 8)


def test_an_image_is_encoded_once(llm: LLM) -> None:
    cache = llm.engine.runner.encoder_cache
    before = cache.num_encoded
    im = images(1, seed=3)[0]
    outs = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, SamplingParams(n=3, max_tokens=4))
    assert len(outs[0].outputs) == 3
    assert cache.num_encoded == before + 1  # three sequences, one encoding


def test_an_expanded_prompt_is_taken_as_is(llm: LLM) -> None:
    im = images(1)[0]
    ids = expanded(llm, PROMPT)
    a = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": im}}, GREEDY)
    b = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, GREEDY)
    assert a[0].prompt_token_ids == ids and tokens(a) == tokens(b)


@pytest.mark.parametrize("prompt, data, message", [
    (PROMPT, {"image": []}, "1 image placeholder"),
    ("USER: no placeholder ASSISTANT:", {"image": "img"}, "PIL images"),
    (PROMPT, {"video": []}, "multi_modal_data must be"),
    ("USER: <image><image> two in a row ASSISTANT:", {"image": "2"}, "a run of 2 image tokens"),
    (PROMPT, None, r"but 0 image\(s\)"),  # a placeholder typed into the text, no image given
])
def test_bad_image_prompts_are_clear_errors(llm: LLM, prompt: str, data, message: str) -> None:
    if data == {"image": "2"}:
        data = {"image": images(1)}
    p = {"prompt": prompt} if data is None else {"prompt": prompt, "multi_modal_data": data}
    with pytest.raises(ValueError, match=message):
        llm.generate(p, GREEDY)
    assert tokens(llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": images(1)[0]}}, GREEDY))
    check_freed(llm)


def test_limits_and_truncation(llava_dir: Path) -> None:
    llm = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64, limit_images_per_prompt=1)
    two = "USER: <image>\n<image>\nWhich? ASSISTANT:"
    with pytest.raises(ValueError, match="at most 1 images"):
        llm.generate({"prompt": two, "multi_modal_data": {"image": images(2)}}, GREEDY)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": images(1)}},
                     SamplingParams(max_tokens=4, truncate_prompt_tokens=10))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed({"prompt": PROMPT, "multi_modal_data": {"image": images(1)}},
                  PoolingParams(truncate_prompt_tokens=10))


def test_embeddings_of_image_prompts(llm: LLM) -> None:
    """A VLM embeds prompts with images (last-token pooling sees the image through attention): other images,
    other embeddings; the same image, the same one; LLM and AsyncEngine agree."""
    import asyncio

    from streamer import AsyncEngine
    a, b = images(2, seed=14)
    outs = llm.embed([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in (a, b, a)])
    assert len(outs[0].prompt_token_ids) == len(expanded(llm, PROMPT))
    assert np.allclose(outs[0].embedding, outs[2].embedding, atol=1e-6)
    assert not np.allclose(outs[0].embedding, outs[1].embedding, atol=1e-3)

    async def run() -> list[float]:
        async with AsyncEngine(llm.engine.config.model, dtype="float32", num_kv_blocks=64) as engine:
            return (await engine.embed({"prompt": PROMPT, "multi_modal_data": {"image": b}})).embedding
    assert np.allclose(asyncio.run(run()), outs[1].embedding, atol=1e-5)
    check_freed(llm)


def test_text_models_refuse_images(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "hello", "multi_modal_data": {"image": images(1)}}, GREEDY)
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images(1)[0]},
                                               {"type": "text", "text": "hi"}]}], GREEDY)


def _data_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _conversation(image_part: dict) -> list[dict]:
    return [{"role": "user", "content": [image_part, {"type": "text", "text": "What is in the picture?"}]}]


def test_chat_renders_images_through_the_template(llm: LLM) -> None:
    im = images(1, seed=4)[0]
    by_pil = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), GREEDY)
    by_url = llm.chat(_conversation({"type": "image_url", "image_url": {"url": _data_url(im)}}), GREEDY)
    text = "<|begin_of_text|>USER: <image>\nWhat is in the picture?\nASSISTANT:"  # (the template writes the bos)
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"image": im}}, GREEDY)
    assert by_pil[0].prompt_token_ids == direct[0].prompt_token_ids
    assert tokens(by_pil) == tokens(by_url) == tokens(direct)


def test_string_templates_get_the_placeholder(ckpt_root: Path) -> None:
    """A template that prints content as a string gets "<image>\\n" before the text for each image."""
    llm = LLM(str(_dir(ckpt_root, "llava_string_template", chat_template=None)), dtype="float32", num_kv_blocks=32)
    out = llm.chat(_conversation({"type": "image_pil", "image_pil": images(1)[0]}), GREEDY)
    text = llm.tokenizer.decode(out[0].prompt_token_ids, skip_special_tokens=False)
    assert "<|user|>\n" + "<image>" * TOKENS + "\nWhat is in the picture?" in text


def test_siglip_encoder_equals_transformers(ckpt_root: Path) -> None:
    path = _dir(ckpt_root, "llava_siglip", vision="siglip", text="qwen2")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    ims = images(2, seed=5)
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims], GREEDY)
    assert len(outs[0].prompt_token_ids) == len(expanded(llm, PROMPT))
    assert tokens(outs) == hf_llava_greedy(path, [(expanded(llm, PROMPT), [im]) for im in ims], 8)


def test_compiled_runner_equals_eager(llava_dir: Path, llm: LLM) -> None:
    compiled = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64, enforce_eager=False)
    assert compiled.engine.runner.compiled
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images(2, seed=6)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    assert tokens(compiled.generate(prompts, params)) == tokens(llm.generate(prompts, params))


def test_server_chat_with_images(llava_dir: Path, llm: LLM) -> None:
    import openai
    im = images(1, seed=7)[0]
    want = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), GREEDY)[0].outputs[0].text
    with LiveServer(llava_dir, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        msgs = _conversation({"type": "image_url", "image_url": {"url": _data_url(im)}})
        r = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=8, temperature=0.0)
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(llm.chat(_conversation({"type": "image_pil", "image_pil": im}),
                                                     GREEDY)[0].prompt_token_ids)
        stream = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=8,
                                                temperature=0.0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
        bad = [("data:image/png;base64,!!!", "not valid base64"),
               ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable image"),
               ("http://127.0.0.1:1/cat.png", "does not fetch image URLs"),
               ("file:///etc/passwd", "data: URL or an http")]
        for url, message in bad:
            with pytest.raises(openai.BadRequestError, match=message) as e:
                client.chat.completions.create(model=server.model_name, max_tokens=4, messages=_conversation(
                    {"type": "image_url", "image_url": {"url": url}}))
            assert e.value.status_code == 400
        with pytest.raises(openai.BadRequestError, match="image_url"):
            client.chat.completions.create(model=server.model_name, max_tokens=4, messages=_conversation(
                {"type": "image_url", "image_url": {"link": "x"}}))
        r = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=8, temperature=0.0)
        assert r.choices[0].message.content == want  # still serving
        import httpx
        counted = httpx.post(server.url + "/tokenize", json={"model": server.model_name, "messages": msgs}).json()
        assert counted["count"] == r.usage.prompt_tokens  # the image's tokens counted as the model reads them


def test_text_server_refuses_images(llama_dir: Path) -> None:
    import openai
    with LiveServer(llama_dir) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model=server.model_name, max_tokens=4, messages=_conversation(
                {"type": "image_url", "image_url": {"url": _data_url(images(1)[0])}}))


def test_responses_api_takes_input_images(llava_dir: Path, llm: LLM) -> None:
    import openai
    im = images(1, seed=8)[0]
    want = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), GREEDY)[0].outputs[0].text
    with LiveServer(llava_dir) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        r = client.responses.create(model=server.model_name, max_output_tokens=8, temperature=0.0, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(im)},
                                         {"type": "input_text", "text": "What is in the picture?"}]}])
        assert r.output_text == want


# llava-hf/llava-1.5-7b-hf's config.json (transformers 4 era): the text model's sizes are left to LlamaConfig's
# defaults, the vision encoder's partly to CLIPVisionConfig's.
LLAVA_15_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "vision_config": {
        "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
        "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}


def test_a_real_llava_config_reads_with_the_defaults() -> None:
    import torch

    from streamer.models.config import ModelConfig
    from streamer.models.vision import VisionTower
    cfg = ModelConfig.from_dict(LLAVA_15_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.torch_dtype) == \
        ("LlamaForCausalLM", 4096, 11008, 32, 32, 32, 32064, 4096, 1e-05, "float16")
    assert cfg.image_token_id == 32000
    with torch.device("meta"):
        tower = VisionTower(LLAVA_15_CONFIG["vision_config"], -2, "default")
    assert tower.num_tokens == 576 and tower.hidden_size == 1024  # (336 / 14)^2 patches, CLS dropped
    assert len(tower.encoder.layers) == 23  # the last layer is never read
    with pytest.raises(ValueError, match="unsupported text model"):
        ModelConfig.from_dict({**LLAVA_15_CONFIG, "text_config": {"model_type": "mamba"}})


# ------------------------------------------------------------------------------------------------ Gemma 3
GEMMA_PROMPT = "<start_of_turn>user\n<start_of_image>What is in the picture?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma3_dir(ckpt_root) -> Path:
    from tests.checkpoints import make_gemma3_vlm_checkpoint
    path = ckpt_root / "gemma3_vlm"
    if not (path / "config.json").exists():
        make_gemma3_vlm_checkpoint(path)
    return path


def test_gemma3_images_attend_both_ways_as_in_transformers(gemma3_dir: Path, monkeypatch) -> None:
    """Gemma 3's image tokens see their whole image (transformers' token_type_ids mask): tokens and logprobs equal
    transformers', with whole and chunked prefill (a chunk never ends inside an image) and a prefix-cache hit; the
    same engine with plain causal attention over the images is measurably off, so the check can fail."""
    from tests.checkpoints import hf_gemma3_greedy
    ims = images(3, seed=9)
    prompts = [{"prompt": GEMMA_PROMPT, "multi_modal_data": {"image": im}} for im in ims]
    prompts.append({"prompt": "<start_of_turn>user\nno picture<end_of_turn>\n<start_of_turn>model\n"})
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    llm = LLM(str(gemma3_dir), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, params)
    text = GEMMA_PROMPT.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS
                                + "<end_of_image>\n\n")  # what Gemma3Processor feeds the model
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(text)
    want = hf_gemma3_greedy(gemma3_dir, [(o.prompt_token_ids, [im]) for o, im in zip(outs, ims)]
                            + [(outs[-1].prompt_token_ids, [])], 4)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    chunked = LLM(str(gemma3_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=TOKENS + 4,
                  block_size=4)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, params)), want)
    again = chunked.generate(prompts[:1], params)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[:1])
    check_freed(chunked)
    from streamer.models.vlm import Gemma3VisionMixin
    monkeypatch.setattr(Gemma3VisionMixin, "bidirectional_images", False)
    causal = tokens_and_logprobs(LLM(str(gemma3_dir), dtype="float32", num_kv_blocks=64).generate(prompts[:3], params))
    assert any(not np.allclose(lp, w, atol=2e-3) for (_, lp), (_, w) in zip(causal, want))


def test_gemma3_chat_and_limits(gemma3_dir: Path) -> None:
    llm = LLM(str(gemma3_dir), dtype="float32", num_kv_blocks=64)
    im = images(1, seed=10)[0]
    chat = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), GREEDY)
    direct = llm.generate({"prompt": "<|begin_of_text|>" + GEMMA_PROMPT, "multi_modal_data": {"image": im}}, GREEDY)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids[1:] or \
        chat[0].prompt_token_ids == direct[0].prompt_token_ids  # (the template writes the bos itself)
    assert tokens(chat) == tokens(direct)
    with pytest.raises(ValueError, match="must hold a whole image"):
        LLM(str(gemma3_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=TOKENS - 1)



# google/gemma-3-4b-it's config.json: the text model's heads, vocabulary and layer pattern are left to
# Gemma3TextConfig's defaults.
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16", "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_a_real_gemma3_config_reads_with_the_defaults() -> None:
    import torch

    from streamer.models.config import ModelConfig
    from streamer.models.vision import VisionTower
    from streamer.models.vlm import Gemma3Projector
    cfg = ModelConfig.from_dict(GEMMA3_4B_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.tie_word_embeddings, cfg.eos_token_id, cfg.torch_dtype) == \
        ("Gemma3ForCausalLM", 2560, 34, 8, 4, 256, 262208, True, [1, 106], "bfloat16")
    assert cfg.raw["query_pre_attn_scalar"] == 256 and cfg.raw["sliding_window"] == 1024
    assert cfg.image_token_id == 262144 and cfg.multimodal_architecture == "Gemma3ForConditionalGeneration"
    with torch.device("meta"):
        tower = VisionTower(GEMMA3_4B_CONFIG["vision_config"], -1, "full", post_norm=True)
        projector = Gemma3Projector(1152, 2560, 896 // 14, 256, 1e-6)
    assert tower.num_tokens == 4096 and len(tower.encoder.layers) == 27 and projector.kernel == 4


# ------------------------------------------------------------------------------------------------ Qwen2-VL
QWEN_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
               "<|im_start|>assistant\n")
QWEN_TWO = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|>"
            "<|vision_end|>Which?<|im_end|>\n<|im_start|>assistant\n")


def _qwen_dir(root: Path, version: str) -> Path:
    from tests.checkpoints import make_qwen_vl_checkpoint
    path = root / version
    if not (path / "config.json").exists():
        make_qwen_vl_checkpoint(path, version)
    return path


def _sized(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_equals_transformers(ckpt_root: Path, version: str, monkeypatch) -> None:
    """Images of several sizes (so several token counts) at M-RoPE positions, the text after them shifted: tokens
    and logprobs equal transformers', whole, chunked and from the prefix cache; without M-RoPE they would not."""
    from tests.checkpoints import hf_qwen_vl_greedy
    path = _qwen_dir(ckpt_root, version)
    ims = _sized([(30, 48), (40, 40), (20, 64)], seed=12)
    prompts = [{"prompt": QWEN_PROMPT, "multi_modal_data": {"image": im}} for im in ims[:2]]
    prompts.append({"prompt": QWEN_TWO, "multi_modal_data": {"image": [ims[2], ims[0]]}})
    prompts.append({"prompt": "<|im_start|>user\nno picture<|im_end|>\n<|im_start|>assistant\n"})
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, params)
    lengths = {len(o.prompt_token_ids) for o in outs[:2]}
    assert len(lengths) == 2  # two image sizes, two token counts
    want = hf_qwen_vl_greedy(path, [(o.prompt_token_ids, [im]) for o, im in zip(outs, ims[:2])]
                             + [(outs[2].prompt_token_ids, [ims[2], ims[0]]), (outs[3].prompt_token_ids, [])], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    chunked = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, block_size=4)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, params)), want)
    again = chunked.generate(prompts[2:3], params)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[2:3])
    check_freed(chunked)
    import streamer.multimodal.inputs as mm

    def plain(inputs, merge):  # positions = indices: no M-RoPE
        for im in inputs:
            im.mrope = np.repeat(np.arange(im.offset, im.end)[None], 3, axis=0)
    monkeypatch.setattr(mm, "_place_mrope", plain)
    off = tokens_and_logprobs(LLM(str(path), dtype="float32", num_kv_blocks=64).generate(prompts[:3], params))
    gap = max(np.abs(np.array(lp) - np.array(w)).max() for (_, lp), (_, w) in zip(off, want))
    assert gap > 5e-4, gap  # (the tiny model's positions matter little, but well past the tolerance above)


def test_qwen_vl_chat(ckpt_root: Path) -> None:
    llm = LLM(str(_qwen_dir(ckpt_root, "qwen2_vl")), dtype="float32", num_kv_blocks=64)
    im = _sized([(36, 36)], seed=13)[0]
    chat = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), GREEDY)
    text = QWEN_PROMPT.replace("What is it?", "What is in the picture?")  # (the template writes no bos)
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"image": im}}, GREEDY)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids and tokens(chat) == tokens(direct)


# Qwen/Qwen2-VL-7B-Instruct's config.json (transformers 4.41 era: the text model's fields at the top level).
QWEN2_VL_7B_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}


def test_a_real_qwen2_vl_config_reads() -> None:
    import torch

    from streamer.models.config import ModelConfig
    from streamer.models.qwen_vision import QwenVisionTower
    cfg = ModelConfig.from_dict(QWEN2_VL_7B_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.sliding_window, cfg.rope_scaling, cfg.mrope_section, cfg.rope_theta) == \
        ("Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 152064, None, None, [16, 24, 24], 1e6)
    assert cfg.image_token_id == 151655 and cfg.attention_bias
    with torch.device("meta"):
        tower = QwenVisionTower(QWEN2_VL_7B_CONFIG["vision_config"], "qwen2_vl")
    assert (tower.spec.width, tower.spec.out_hidden, tower.spec.depth, tower.spatial_merge_size) == (1280, 3584, 32, 2)


def test_bench_sends_images(llava_dir: Path, tmp_path: Path) -> None:
    """`streamer bench --images-per-request` against a live LLaVA server: every request carries its own image as
    an image_url part (chat) or a base64 image block (Anthropic's messages), and the server's usage counts the
    image's tokens."""
    import json

    from streamer.bench import main
    with LiveServer(llava_dir) as server:
        for i, endpoint in enumerate(("chat", "messages")):
            out = tmp_path / f"{endpoint}.json"
            code = main(["--base-url", server.url, "--endpoint", endpoint, "--tokenizer", str(llava_dir),
                         "--input-len", "8", "--output-len", "4", "--num-prompts", "4", "--images-per-request", "1",
                         "--image-size", "40x30", "--seed", str(i), "--save-result", str(out), "--progress", "off"])
            assert code == 0
            encoded = server.engine._core.runner.encoder_cache.num_encoded  # type: ignore[union-attr]
            doc = json.loads(out.read_text())
            assert [r["success"] for r in doc["requests"]] == [True] * 4
            assert all(r["prompt_len"] > 8 + TOKENS for r in doc["requests"])  # text + template + the image's
            assert encoded == 4 * (i + 1)  # four distinct images each time
    assert main(["--base-url", "http://127.0.0.1:9", "--images-per-request", "1"]) == 2  # needs --endpoint chat
