"""Gemma 4's images (streamer/models/gemma4_vision.py, streamer/multimodal/processors/gemma4_image_processor.py, models/vlm.py
Gemma4VisionMixin) against transformers' Gemma4ForConditionalGeneration and Gemma4ImageProcessorPil, on tiny random
checkpoints (fp32): 4-pixel patches pooled 2x2, images at their own sizes (so their token counts differ), clipped
linears and standardized features; over the E2B-shaped text model (per-layer embeddings, whose image tokens take the
pad token's) and the 26B-shaped one with `use_bidirectional_attention: "vision"` (image tokens see their whole image
in the sliding layers only). The pixels, the prompt expansion, tokens and logprobs equal transformers', whole and in
chunks; and the bidirectional sliding layers, undone, change the tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.multimodal.processors.gemma4_image_processor import Gemma4ImageProcessor  # noqa: E402
from tests.checkpoints import _hf_greedy_with_logprobs, _vlm_tokenizer  # noqa: E402
from tests.parity import assert_outputs_match, tokens_and_logprobs  # noqa: E402
from tests.test_gemma4 import _dense_config, _moe_config, _randomise  # noqa: E402
from tests.test_multimodal import _data_url  # noqa: E402

SPECIALS = ["<|image>", "<|image|>", "<image|>"]
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|turn>' + message['role'] + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
            "{% if item['type'] == 'image' %}{{ '<|image|>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}"
            "{% endif %}{% endfor %}{% endif %}{{ '<turn|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}")
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=256,
              use_clipped_linears=True, standardize=True)
SIZES = [(30, 48), (64, 64), (20, 90), (50, 31)]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)


def make_gemma4_vlm(out_dir: Path, text: str = "gemma4", seed: int = 0) -> Path:
    """"gemma4": the E2B-shaped text model (tests/test_gemma4.py); "gemma4_moe": the 26B-shaped one, image tokens
    bidirectional in its sliding layers."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, SPECIALS, TEMPLATE)
    make = _dense_config if text == "gemma4" else _moe_config
    text_cfg = make(vocab_size=ids["vocab_size"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.08)
    if text != "gemma4":
        text_cfg.use_bidirectional_attention = "vision"
    text_cfg.bos_token_id, text_cfg.eos_token_id = ids.get("<|begin_of_text|>"), ids.get("<|end_of_text|>")
    cfg = tf.Gemma4Config(text_config=text_cfg.to_dict(), vision_config=VISION, audio_config=None,
                          image_token_id=ids["<|image|>"], boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"])
    torch.manual_seed(seed)
    model = tf.Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        _randomise(model)
        vt = model.model.vision_tower
        vt.patch_embedder.position_embedding_table.normal_(0.0, 0.5)
        vt.std_bias.normal_(0.0, 0.5)
        vt.std_scale.uniform_(0.5, 1.5)
        for name, b in vt.named_buffers():  # clipping bounds that clip some values
            if name.endswith(("input_min", "output_min")):
                b.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5)
        model.model.embed_vision.embedding_projection.weight.normal_(0.0, 0.5)  # features that matter
    model.save_pretrained(out_dir)
    tf.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70).save_pretrained(out_dir)
    return out_dir


def sized(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def hf_gemma4_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new: int):
    import transformers as tf
    model = tf.Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = tf.Gemma4ImageProcessorPil.from_pretrained(model_dir)
    image_id = model.config.image_token_id

    def inputs(t: torch.Tensor, images: list) -> dict:
        px = processor(images=images, return_tensors="pt")
        return {"pixel_values": px["pixel_values"], "image_position_ids": px["image_position_ids"],
                "mm_token_type_ids": (t == image_id).long()}
    return _hf_greedy_with_logprobs(model, prompts, max_new, inputs)


@pytest.fixture(scope="module")
def vlm(ckpt_root):
    def get(text: str) -> Path:
        path = ckpt_root / f"gemma4_vlm_{text}"
        if not (path / "config.json").exists():
            make_gemma4_vlm(path, text)
        return path
    return get


def _prompts(ims: list[Image.Image]) -> tuple[list[dict], list[list]]:
    prompts = [{"prompt": "Look: <|image|> what is it?", "multi_modal_data": {"image": im}} for im in ims[:3]]
    prompts.append({"prompt": "<|image|> and <|image|>", "multi_modal_data": {"image": [ims[3], ims[1]]}})
    prompts.append({"prompt": "no image here"})
    return prompts, [[ims[0]], [ims[1]], [ims[2]], [ims[3], ims[1]], []]


def test_pixels_equal_transformers(vlm) -> None:
    import transformers as tf
    path = vlm("gemma4")
    ours = Gemma4ImageProcessor.from_folder(path)
    theirs = tf.Gemma4ImageProcessorPil.from_pretrained(path)
    for im in sized(SIZES + [(7, 200), (300, 12)], seed=1):
        (patches, n, grid), = ours.process([im])
        want = theirs(images=[im], return_tensors="pt")
        assert n == int(want["num_soft_tokens_per_image"][0])
        assert torch.equal(patches, want["pixel_values"][0, :len(patches)])
        _, rows, cols = grid
        pos = want["image_position_ids"][0, :len(patches)]
        assert pos[:, 0].max() == cols - 1 and pos[:, 1].max() == rows - 1
        assert (want["image_position_ids"][0, len(patches):] == -1).all()  # (the rest is padding)


@pytest.mark.parametrize("text", ["gemma4", "gemma4_moe"])
def test_matches_transformers(vlm, text) -> None:
    """One image per prompt (three sizes), two in one prompt, and text alone, in one batch; then in chunks (of 16
    tokens; of 72 where image tokens see each other both ways, each chunk holding whole images)."""
    path = vlm(text)
    ims = sized(SIZES, seed=0)
    prompts, images = _prompts(ims)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(prompts, PARAMS)
    ids = llm.engine.model_config.multimodal
    boi, image, eoi = ids["boi_token_id"], ids["image_token_id"], ids["eoi_token_id"]
    proc = Gemma4ImageProcessor.from_folder(path)
    for out, im in zip(outs[:3], ims[:3]):
        n = proc.process([im])[0][1]
        run = [boi] + [image] * n + [eoi]
        p = out.prompt_token_ids
        assert any(p[i:i + len(run)] == run for i in range(len(p)))  # <|image|> -> <|image>, n image tokens, <image|>
    assert len({len(o.prompt_token_ids) for o in outs[:3]}) == 3
    want = hf_gemma4_greedy(path, [(o.prompt_token_ids, im) for o, im in zip(outs, images)], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    assert len({tuple(t) for t, _ in want[:3]}) > 1  # the images steer the output
    # (chunks cut images; the bidirectional model's chunks hold whole images, at most the processor's 70 tokens)
    chunked = LLM(str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16 if text == "gemma4" else 72,
                  block_size=8)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    e = chunked.engine
    assert e.kv.pool.num_free == e.kv.num_blocks


def test_bidirectional_sliding_layers_matter(vlm, monkeypatch) -> None:
    """The parity above can fail: with image tokens plainly causal everywhere, the 26B-shaped model's tokens
    change; with them bidirectional in the global layers too (Gemma 3's way), they change as well."""
    path = vlm("gemma4_moe")
    ims = sized(SIZES, seed=0)
    prompts, _ = _prompts(ims)
    want = tokens_and_logprobs(LLM(str(path), dtype="float32", num_kv_blocks=128).generate(prompts[:3], PARAMS))
    causal = LLM(str(path), dtype="float32", num_kv_blocks=128)
    causal.engine.runner.model.bidirectional_images = False
    got = tokens_and_logprobs(causal.generate(prompts[:3], PARAMS))
    assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) > 1e-3
    both = LLM(str(path), dtype="float32", num_kv_blocks=128)
    for layer in both.engine.runner.model.layers:
        layer.self_attn.attn.spec.causal_only = False
    got = tokens_and_logprobs(both.generate(prompts[:3], PARAMS))
    assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) > 1e-3


def test_chat_with_image_and_refusals(vlm) -> None:
    path = vlm("gemma4")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    im = sized([(40, 40)], seed=3)[0]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(im)}},
                                             {"type": "text", "text": "what?"}]}]
    out = llm.chat(messages, PARAMS)[0]
    # (40x40 is scaled up to the budget, 64x64: 16x16 patches, pooled 2x2)
    assert out.prompt_token_ids.count(llm.engine.model_config.multimodal["image_token_id"]) == 64
    bos = llm.tokenizer.decode([out.prompt_token_ids[0]], skip_special_tokens=False)  # (the template writes it)
    want = llm.generate({"prompt": out.prompt.removeprefix(bos), "multi_modal_data": {"image": im}}, PARAMS)[0]
    assert out.prompt_token_ids == want.prompt_token_ids and out.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="takes no audio"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": (np.zeros(1600, dtype=np.float32), 16000)}},
                     PARAMS)
    with pytest.raises(ValueError, match="image placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": im}}, PARAMS)


def test_server_chat_with_an_image(vlm) -> None:
    """A live server on the 26B-shaped checkpoint answers an OpenAI chat request with a base64 image as LLM.chat
    does (the same text and token counts); an audio part gets a 400 with an OpenAI-style error, and the server goes
    on serving."""
    import openai

    from tests.server_utils import LiveServer
    path = vlm("gemma4_moe")
    im = sized([(36, 52)], seed=13)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": im},
                                                  {"type": "text", "text": "What is it?"}]}], params)
    image = {"type": "image_url", "image_url": {"url": _data_url(im)}}
    with LiveServer(path, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        with pytest.raises(openai.BadRequestError, match="audio"):
            client.chat.completions.create(model=server.model_name, max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                             {"type": "text", "text": "hi"}]}])
        r = client.chat.completions.create(model=server.model_name, max_tokens=8, temperature=0.0, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    assert chat[0].outputs[0].text and r.choices[0].message.content == chat[0].outputs[0].text
    assert r.usage.prompt_tokens == len(chat[0].prompt_token_ids) and r.usage.completion_tokens == 8
