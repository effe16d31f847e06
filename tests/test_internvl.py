"""InternVL 3 / 3.5 (InternVLForConditionalGeneration, the transformers-format "-hf" checkpoints): InternViT and the
pixel-shuffle projector (streamer/models/internvl.py), the dynamic-tiling image processor
(streamer/multimodal/processors/internvl_image_processor.py) and the whole engine path (each image expanded to <img>, its tiles' image
tokens and </img>; chunked prefill; the chat template; the server) against transformers on tiny random
checkpoints: a Qwen2 text model under a LayerNorm tower with q/k/v biases, a Qwen3 one under an RMSNorm tower
with q/k norms and the final LayerNorm (use_mean_pooling false), and a Qwen3-MoE one (InternVL3.5's MoE models)."""
from __future__ import annotations

import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamer import LLM, SamplingParams
from tests.checkpoints import _hf_greedy_with_logprobs, _vlm_tokenizer, hf_config
from tests.parity import assert_outputs_match, tokens_and_logprobs
from tests.server_utils import LiveServer
from tests.test_multimodal import _conversation, _data_url, check_freed, tokens

transformers = pytest.importorskip("transformers")
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (  # noqa: E402
    GotOcr2ImageProcessorPil,
    get_optimal_tiled_canvas,
)
from transformers.models.internvl.processing_internvl import InternVLProcessor  # noqa: E402

TILE, PATCH, MAX_PATCHES = 32, 4, 6  # 8 x 8 patches a tile, pixel-shuffled to 4 x 4: 16 image tokens a tile
TILE_TOKENS = 16
SPECIALS = ["<img>", "</img>", "<IMG_CONTEXT>", "<|im_start|>", "<|im_end|>"]
# InternVL3-hf's chat template, in short: ChatML, each image part as "<IMG_CONTEXT>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPT = "<|im_start|>user\n<IMG_CONTEXT>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<IMG_CONTEXT>\n<IMG_CONTEXT>\nCompare them.<|im_end|>\n<|im_start|>assistant\n"
TEXT_ONLY = "<|im_start|>user\nno picture here<|im_end|>\n<|im_start|>assistant\n"
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH)
# The towers by text model: InternViT-300M's kind (InternVL3 1B-78B's but the 6B's) and InternViT-6B's kind
VARIANTS = {"qwen2": dict(attention_bias=True, norm_type="layer_norm"), "qwen3_moe": dict(attention_bias=True),
            "qwen3": dict(attention_bias=False, norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False)}


def make_internvl_checkpoint(out_dir: Path, text: str = "qwen2", seed: int = 0) -> Path:
    """A tiny InternVLForConditionalGeneration: InternViT on 32-pixel tiles of 4-pixel patches (hidden 32, 3
    layers; VARIANTS[text]), 16 tokens a tile, over a two-layer Qwen2, Qwen3 or Qwen3-MoE; InternVL's image tokens
    as added tokens, GotOcr2's image processor config (32-pixel tiles, at most 6 an image), processor_config.json's
    image_seq_length and a ChatML template writing <IMG_CONTEXT> for an image."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, SPECIALS, CHAT_TEMPLATE)
    text_cfg = hf_config(text, ids["vocab_size"])
    text_cfg.bos_token_id, text_cfg.eos_token_id = ids.get("<|begin_of_text|>"), ids.get("<|end_of_text|>")
    cfg = tf.InternVLConfig(text_config=text_cfg, vision_config=tf.InternVLVisionConfig(**VISION, **VARIANTS[text]),
                            image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=TILE_TOKENS,
                            tie_word_embeddings=text != "qwen3")
    torch.manual_seed(seed)
    model = tf.InternVLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "lambda" in name:  # (norms start at one, lambdas at 0.1: random ones show each)
                p.normal_(1.0, 0.3)
            elif "vision_tower" in name:  # (the class token and position table start at zero)
                p.normal_(0.0, 0.25)
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)  # features that steer the output
    model.save_pretrained(out_dir)
    _hf_processor().save_pretrained(out_dir)
    (out_dir / "processor_config.json").write_text(
        '{"image_seq_length": %d, "processor_class": "InternVLProcessor"}' % TILE_TOKENS)
    return out_dir


def _hf_processor(**kwargs) -> GotOcr2ImageProcessorPil:
    return GotOcr2ImageProcessorPil(**{"size": {"height": TILE, "width": TILE}, "max_patches": MAX_PATCHES,
                                       "crop_to_patches": True, **kwargs})


def _hf_pixels(images: list, **kwargs) -> dict:
    """What InternVLProcessor has its image processor make (crop_to_patches, whatever the config says)."""
    return _hf_processor(**kwargs)(images=images, crop_to_patches=True, return_tensors="pt")


def hf_internvl_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                       ) -> list[tuple[list[int], list[float]]]:
    model = transformers.InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _hf_greedy_with_logprobs(model, prompts, max_new_tokens,
                                    lambda t, images: {"pixel_values": _hf_pixels(images)["pixel_values"]})


def hf_expanded(text: str, images: list) -> str:
    """The text InternVLProcessor feeds the model: each <IMG_CONTEXT> replaced (by its own replace_image_token)
    with <img>, its image's tiles' tokens and </img>, the tiles counted by transformers' image processor."""
    num_patches = _hf_pixels(images)["num_patches"].tolist() if images else []
    processor = types.SimpleNamespace(start_image_token="<img>", end_image_token="</img>",
                                      image_token="<IMG_CONTEXT>", image_seq_length=TILE_TOKENS)
    parts = text.split("<IMG_CONTEXT>")
    assert len(parts) == len(images) + 1
    return parts[0] + "".join(InternVLProcessor.replace_image_token(processor, {"num_patches": num_patches}, i)
                              + part for i, part in enumerate(parts[1:]))


def sized(sizes: list[tuple[int, int]], seed: int, mode: str = "RGB") -> list[Image.Image]:
    """Random images of the given (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode) for h, w in sizes]


@pytest.fixture(scope="module")
def internvl_dir(ckpt_root: Path) -> Path:
    path = ckpt_root / "internvl"
    if not (path / "config.json").exists():
        make_internvl_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def internvl3_dir(ckpt_root: Path) -> Path:
    path = ckpt_root / "internvl_qwen3"
    if not (path / "config.json").exists():
        make_internvl_checkpoint(path, text="qwen3", seed=1)
    return path


@pytest.fixture(scope="module")
def llm(internvl_dir: Path) -> LLM:
    return LLM(str(internvl_dir), dtype="float32", num_kv_blocks=128)


# (height, width) -> tiles: 40x100 -> 3 x 1 + a thumbnail; 60x60 -> 2 x 2 (the tie with 1 x 1 goes to the larger
# grid: the image covers over half of it) + a thumbnail; 20x20 -> 1 (no thumbnail); 90x30 -> 1 x 3 + a thumbnail
IMAGE_SIZES = [(40, 100), (60, 60), (20, 20), (90, 30)]
TILES = [4, 5, 1, 4]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)


def _prompts(ims: list[Image.Image]) -> tuple[list[dict], list[list]]:
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims[:3]]
    prompts.append({"prompt": TWO, "multi_modal_data": {"image": [ims[3], ims[1]]}})  # two aspect ratios
    prompts.append({"prompt": TEXT_ONLY})
    return prompts, [[ims[0]], [ims[1]], [ims[2]], [ims[3], ims[1]], []]


def test_greedy_equals_transformers(internvl_dir: Path, llm: LLM) -> None:
    """Images of 4, 5 and 1 tiles, two images of other aspect ratios in one prompt and a text-only prompt in one
    batch: the prompts are what InternVLProcessor makes, the tokens and logprobs transformers'."""
    ims = sized(IMAGE_SIZES, seed=0)
    assert _hf_pixels(ims)["num_patches"].tolist() == TILES
    prompts, images = _prompts(ims)
    outs = llm.generate(prompts, PARAMS)
    for out, p, im in zip(outs, prompts, images):
        assert out.prompt_token_ids == llm.tokenizer.encode(hf_expanded(p["prompt"], im))
    base = len(llm.tokenizer.encode(PROMPT)) - 1
    assert [len(o.prompt_token_ids) - base for o in outs[:3]] == [2 + t * TILE_TOKENS for t in TILES[:3]]
    want = hf_internvl_greedy(internvl_dir, [(o.prompt_token_ids, im) for o, im in zip(outs, images)], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    assert len({tuple(t) for t, _ in want[:3]}) > 1  # the images steer the output
    check_freed(llm)


@pytest.mark.parametrize("text", ["qwen3", "qwen3_moe"])
def test_other_text_models_equal_transformers(text: str, internvl3_dir: Path, ckpt_root: Path) -> None:
    """The other tower (RMSNorm, q/k norms, no q/k/v biases, the final LayerNorm) over Qwen3 with an untied head;
    and InternVL3.5's MoE kind: the first tower over Qwen3-MoE."""
    folder = internvl3_dir
    if text == "qwen3_moe":
        folder = ckpt_root / "internvl_qwen3_moe"
        if not (folder / "config.json").exists():
            make_internvl_checkpoint(folder, text="qwen3_moe", seed=2)
    ims = sized([(50, 110), (70, 40)], seed=1)
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": ims}}, {"prompt": PROMPT, "multi_modal_data":
                                                                     {"image": ims[1]}}, {"prompt": TEXT_ONLY}]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.tie_word_embeddings) == \
        (("Qwen3ForCausalLM", False) if text == "qwen3" else ("Qwen3MoeForCausalLM", True))
    outs = llm.generate(prompts, PARAMS)
    images = [ims, [ims[1]], []]
    for out, p, im in zip(outs, prompts, images):
        assert out.prompt_token_ids == llm.tokenizer.encode(hf_expanded(p["prompt"], im))
    want = hf_internvl_greedy(folder, [(o.prompt_token_ids, im) for o, im in zip(outs, images)], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)


def test_chunked_prefill_splits_images(internvl_dir: Path) -> None:
    """Chunks of 16 tokens cut every image (and its tiles) over several steps; with no encoder cache each chunk
    encodes its image again; the same tokens as whole prefill, and a prefix-cache hit gives them too."""
    ims = sized(IMAGE_SIZES, seed=0)
    prompts, _ = _prompts(ims)
    whole = LLM(str(internvl_dir), dtype="float32", num_kv_blocks=128)
    want = tokens_and_logprobs(whole.generate(prompts, PARAMS))  # (== transformers': the test above)
    chunked = LLM(str(internvl_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16, block_size=4,
                  encoder_cache_bytes=0)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    assert chunked.engine.runner.encoder_cache.num_encoded > 10  # each chunk re-encoded its image
    again = chunked.generate(prompts[3:4], PARAMS)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[3:4])
    check_freed(chunked)


def test_chunked_prefill_equals_transformers(internvl_dir: Path) -> None:
    ims = sized([(30, 70), (80, 50)], seed=3)
    chunked = LLM(str(internvl_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24, block_size=4)
    outs = chunked.generate([{"prompt": TWO, "multi_modal_data": {"image": ims}}], PARAMS)
    assert_outputs_match(tokens_and_logprobs(outs), hf_internvl_greedy(internvl_dir, [(outs[0].prompt_token_ids, ims)], 5))


def test_expanded_prompts_and_errors(llm: LLM) -> None:
    im = sized([(32, 70)], seed=6)[0]
    direct = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, PARAMS)
    ids = direct[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": im}}, PARAMS)
    assert again[0].prompt_token_ids == ids and tokens(again) == tokens(direct)  # an expanded prompt is kept
    ctx = llm.tokenizer.token_to_id("<IMG_CONTEXT>")
    short = list(ids)
    short.remove(ctx)  # one image token too few
    with pytest.raises(ValueError, match="a run of"):
        llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": im}}, PARAMS)
    with pytest.raises(ValueError, match="2 image placeholder"):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": [im]}}, PARAMS)
    check_freed(llm)


def test_chat_with_two_images(llm: LLM) -> None:
    a, b = sized([(24, 80), (64, 16)], seed=7)
    conv = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "image_pil", "image_pil": b},
                                         {"type": "text", "text": "Which?"}]}]
    chat = llm.chat(conv, PARAMS)
    text = "<|im_start|>user\n<IMG_CONTEXT>\n<IMG_CONTEXT>\nWhich?<|im_end|>\n<|im_start|>assistant\n"
    assert chat[0].prompt_token_ids == llm.tokenizer.encode(hf_expanded(text, [a, b]), add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"image": [a, b]}}, PARAMS)
    assert tokens(chat) == tokens(direct)


def test_server_chat_with_an_image(internvl_dir: Path, llm: LLM) -> None:
    import openai
    im = sized([(36, 90)], seed=8)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    local = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), greedy)[0]
    with LiveServer(internvl_dir, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        msgs = _conversation({"type": "image_url", "image_url": {"url": _data_url(im)}})
        r = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=8, temperature=0.0)
        assert r.choices[0].message.content == local.outputs[0].text
        assert r.usage.prompt_tokens == len(local.prompt_token_ids)


def test_transformers_5_weight_names(internvl_dir: Path, llm: LLM, tmp_path: Path) -> None:
    """The same weights under transformers 5's in-memory names (model.language_model., model.vision_tower.,
    model.multi_modal_projector.) load to the same model."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "v5"
    shutil.copytree(internvl_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in weights  # (transformers saves the older names)
    renamed = {("model.language_model." + n.removeprefix("language_model.model.")) if n.startswith("language_model.")
               else "model." + n: t for n, t in weights.items()}
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": sized([(40, 24)], seed=9)[0]}}
    v5 = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    assert_outputs_match(tokens_and_logprobs(v5.generate(prompt, PARAMS)), tokens_and_logprobs(llm.generate(prompt, PARAMS)), 1e-6)


# ------------------------------------------------------------------------------------ the encoder and projector
def _hf_model(folder: Path):
    return transformers.InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def _ours(hf_model, feature_layer: int = -1):
    from streamer.models.internvl import InternVisionTower, InternVLProjector
    cfg = hf_model.config
    tower = InternVisionTower(cfg.vision_config.to_dict(), feature_layer)
    projector = InternVLProjector(32, cfg.text_config.hidden_size, TILE // PATCH, 0.5, "gelu")
    loaded = tower.load_weights(hf_model.model.vision_tower.state_dict().items())
    assert loaded == {n for n, _ in tower.named_parameters()}
    projector.load_state_dict(hf_model.model.multi_modal_projector.state_dict())
    return tower, projector


@pytest.mark.parametrize("feature_layer", [-1, 1, -2, 0])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
@torch.no_grad()
def test_encoder_and_projector_equal_transformers(variant: str, feature_layer: int, request) -> None:
    """Several images' tiles in one batch give transformers' features for every feature layer (the last one
    through the final norm where the tower has one, 0 the embeddings), and only the layers read are built."""
    from streamer.multimodal.processors.internvl_image_processor import InternVLImageProcessor
    hf_model = _hf_model(request.getfixturevalue("internvl_dir" if variant == "qwen2" else "internvl3_dir"))
    tower, projector = _ours(hf_model, feature_layer)
    assert len(tower.encoder.layer) == {-1: 3, 1: 1, -2: 2, 0: 0}[feature_layer]
    assert (tower.layernorm is not None) == (variant == "qwen3" and feature_layer == -1)
    ims = sized([(40, 100), (60, 60), (20, 20)], seed=10)
    ours_px = torch.cat(InternVLImageProcessor(_hf_processor().to_dict(), TILE)(ims))
    hf_px = _hf_pixels(ims)["pixel_values"]
    assert torch.equal(ours_px, hf_px)
    # (asked for outright: transformers itself reads vision_feature_layer 0 as "no hidden states")
    want = hf_model.model.get_image_features(hf_px, vision_feature_layer=feature_layer,
                                             output_hidden_states=feature_layer != -1).pooler_output
    got = projector(tower(ours_px))
    assert got.shape == want.shape == (10, TILE_TOKENS, hf_model.config.text_config.hidden_size)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_changed_pixel_shuffle_fails(internvl_dir: Path) -> None:
    """The check above can fail: the pixel shuffle without its last transpose gives other features."""
    import streamer.models.internvl as iv
    tower, projector = _ours(_hf_model(internvl_dir))
    px = _hf_pixels(sized([(40, 100)], seed=11))["pixel_values"]
    right = projector(tower(px))
    shuffle = iv.pixel_shuffle
    try:
        iv.pixel_shuffle = lambda x, s: shuffle(x, s).permute(0, 2, 1, 3)
        assert not torch.allclose(projector(tower(px)), right, rtol=1e-3, atol=1e-3)
    finally:
        iv.pixel_shuffle = shuffle


# ------------------------------------------------------------------------------------------- image processor
@pytest.mark.parametrize("kwargs", [{}, {"max_patches": 12, "min_patches": 2, "resample": 2},
                                    {"max_patches": 1}, {"do_normalize": False},
                                    {"do_rescale": False, "image_mean": [100.0, 120.0, 90.0],
                                     "image_std": [50.0, 60.0, 70.0], "size": {"height": 48, "width": 48}}])
def test_processor_bit_exact_with_transformers(kwargs: dict, tmp_path: Path) -> None:
    from streamer.multimodal.processors.internvl_image_processor import InternVLImageProcessor
    theirs = _hf_processor(**kwargs)
    theirs.save_pretrained(tmp_path)
    ours = InternVLImageProcessor.from_folder(tmp_path, kwargs.get("size", {}).get("height", TILE))
    sizes = [(30, 48), (56, 56), (57, 29), (200, 13), (13, 300), (1000, 700), (5, 7), (64, 64), (33, 100)]
    ims = [sized([s], seed=i, mode=("RGB", "RGBA", "L")[i % 3])[0] for i, s in enumerate(sizes)]
    expected = theirs(images=ims, crop_to_patches=True, return_tensors="pt")
    got = ours(ims)
    assert [len(px) for px in got] == expected["num_patches"].tolist()
    assert [ours.num_tiles(im.height, im.width) for im in ims] == expected["num_patches"].tolist()
    assert len(set(expected["num_patches"].tolist())) > (1 if kwargs.get("max_patches") != 1 else 0)
    assert torch.equal(torch.cat(got), expected["pixel_values"])


def test_tile_grid_equals_transformers() -> None:
    from streamer.multimodal.processors.internvl_image_processor import tile_grid
    rng = np.random.default_rng(0)
    for _ in range(400):
        h, w = (int(x) for x in rng.integers(1, 3000, 2))
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 13))
        tile = int(rng.choice([32, 448]))
        assert tile_grid(h, w, tile, lo, hi) == get_optimal_tiled_canvas((h, w), (tile, tile), lo, hi)


def test_processor_errors() -> None:
    from streamer.multimodal.processors.internvl_image_processor import InternVLImageProcessor
    ok = {"image_processor_type": "GotOcr2ImageProcessorFast", "size": {"height": 448, "width": 448}}
    with pytest.raises(ValueError, match="unsupported image processor"):
        InternVLImageProcessor({"image_processor_type": "CLIPImageProcessor"}, 448)
    with pytest.raises(ValueError, match="image_size 336"):
        InternVLImageProcessor(ok, 336)
    with pytest.raises(ValueError, match="min_patches"):
        InternVLImageProcessor({**ok, "min_patches": 5, "max_patches": 4}, 448)
    assert InternVLImageProcessor(ok, 448).num_tiles(448, 896) == 3


# ------------------------------------------------------------------------------------------------ configs
# The vision_config InternVL's own conversion script (internvl_custom2hf) writes for InternViT-300M, under an
# InternVL3-1B-hf-shaped outer config (Qwen2.5-0.5B's text model).
INTERNVL3_1B_CONFIG = {
    "architectures": ["InternVLForConditionalGeneration"], "model_type": "internvl", "downsample_ratio": 0.5,
    "image_seq_length": 256, "image_token_id": 151667, "projector_hidden_act": "gelu", "torch_dtype": "bfloat16",
    "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
    "text_config": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                    "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
                    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                    "max_position_embeddings": 32768, "vocab_size": 151674, "tie_word_embeddings": True},
    "vision_config": {"architectures": ["InternVisionModel"], "attention_bias": True, "attention_dropout": 0.0,
                      "dropout": 0.0, "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "hidden_size": 1024,
                      "image_size": [448, 448], "initializer_factor": 0.1, "initializer_range": 1e-10,
                      "intermediate_size": 4096, "layer_norm_eps": 1e-06, "layer_scale_init_value": 0.1,
                      "model_type": "internvl_vision", "norm_type": "layer_norm", "num_attention_heads": 16,
                      "num_channels": 3, "num_hidden_layers": 24, "patch_size": [14, 14], "projection_dropout": 0.0,
                      "torch_dtype": "bfloat16", "use_absolute_position_embeddings": True, "use_mask_token": False,
                      "use_mean_pooling": True, "use_qk_norm": False}}


def test_a_real_config_reads() -> None:
    from streamer.models.config import ModelConfig
    from streamer.models.internvl import InternVisionTower, InternVLProjector
    cfg = ModelConfig.from_dict(INTERNVL3_1B_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.tie_word_embeddings, cfg.torch_dtype) == ("Qwen2ForCausalLM", 896, 24, 14, 2, 64, True, "bfloat16")
    assert cfg.image_token_id == 151667 and cfg.multimodal_architecture == "InternVLForConditionalGeneration"
    with torch.device("meta"):
        tower = InternVisionTower(INTERNVL3_1B_CONFIG["vision_config"])
        projector = InternVLProjector(1024, 896, tower.spec.side, 0.5, "gelu")
    assert (tower.spec.image_size, tower.spec.side, len(tower.encoder.layer), tower.layernorm, projector.tokens,
            tuple(projector.linear_1.weight.shape)) == (448, 32, 24, None, 256, (896, 4096))
    assert tower.encoder.layer[0].attention.q_proj.bias is not None and tower.encoder.layer[0].attention.q_norm is None
    llama = {**INTERNVL3_1B_CONFIG, "text_config": {**INTERNVL3_1B_CONFIG["text_config"], "model_type": "llama"}}
    assert ModelConfig.from_dict(llama).architecture == "LlamaForCausalLM"
    bare = ModelConfig.from_dict({"architectures": ["InternVLForConditionalGeneration"]})  # all defaults
    assert (bare.architecture, bare.tie_word_embeddings, bare.image_token_id) == ("Qwen2ForCausalLM", True, 151667)
    with pytest.raises(ValueError, match="unsupported vision encoder"):
        ModelConfig.from_dict({**INTERNVL3_1B_CONFIG, "vision_config": {"model_type": "siglip_vision_model"}})
    with pytest.raises(ValueError, match="select_strategy"):
        InternVisionTower(INTERNVL3_1B_CONFIG["vision_config"], -1, "full")
    with pytest.raises(ValueError, match="not a list"):
        InternVisionTower(INTERNVL3_1B_CONFIG["vision_config"], [-1, -2])  # type: ignore[arg-type]


def test_defaults_match_transformers() -> None:
    from streamer.models.internvl import INTERNVL_VISION_DEFAULTS
    from streamer.multimodal.processors.internvl_image_processor import GOT_OCR2_DEFAULTS
    theirs = transformers.InternVLVisionConfig().to_dict()
    for key, value in INTERNVL_VISION_DEFAULTS.items():
        got = theirs[key]
        assert (got == [value, value] or got == (value, value)) if key in ("image_size", "patch_size") \
            else got == value, key
    default = transformers.InternVLConfig()
    assert (default.image_token_id, default.downsample_ratio, default.vision_feature_layer,
            default.text_config.model_type, default.tie_word_embeddings) == (151667, 0.5, -1, "qwen2", True)
    proc = GotOcr2ImageProcessorPil().to_dict()
    for key, value in GOT_OCR2_DEFAULTS.items():
        got = proc.get(key)
        assert (tuple(got) if isinstance(got, list) else got) == \
            (tuple(value) if isinstance(value, list) else value), key
