"""LLaVA-NeXT (LlavaNextForConditionalGeneration, llava-v1.6): the "anyres" image processor
(streamer/multimodal/processors/llava_next_image_processor.py), the features' layout (models/vlm.py LlavaNextMixin: the base tile, then the
tiles' grid cropped back to the image's aspect ratio with a newline after each row) and the whole engine path
(placeholder expansion to each image's own token count, chunked prefill, the server) against transformers on tiny
random checkpoints: a CLIP tower on 32-pixel tiles of 8-pixel patches (16 features a tile, "default" strategy) over
Llama and Mistral, and a SigLIP one ("full") over Qwen2; pinpoints of 1x2, 2x1, 2x2, 3x1 and 1x3 tiles."""
from __future__ import annotations

import functools
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from streamer import LLM, SamplingParams
from tests.checkpoints import LLAVA_CHAT_TEMPLATE, _hf_greedy_with_logprobs, _vlm_tokenizer, hf_config
from tests.parity import PREFILL_MODES, assert_outputs_match, tokens_and_logprobs
from tests.server_utils import LiveServer
from tests.test_multimodal import _conversation, _data_url, check_freed, tokens

transformers = pytest.importorskip("transformers")
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil  # noqa: E402
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor  # noqa: E402

TILE, PATCH, SIDE = 32, 8, 4  # 4 x 4 features a tile
PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]  # (height, width): llava-v1.6's shapes, in tiles
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH)
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image>\n<image>\nWhich one is brighter? ASSISTANT:"
TEXT_ONLY = "USER: no picture here ASSISTANT:"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
# (height, width): wide (1x3 tiles, rows cropped), tall (3x1, columns cropped), square (2x2, nothing cropped), small
# (1x2, columns cropped), larger than every pinpoint (2x2, columns cropped), 2x2 with rows cropped
IMAGE_SIZES = [(20, 100), (100, 22), (50, 50), (10, 14), (150, 120), (45, 80)]
IMAGE_TOKENS = [42, 52, 88, 44, 72, 52]  # 16 of the base tile + rows * (columns + 1)


def make_llava_next_checkpoint(out_dir: Path, text: str = "llama", vision: str = "clip", seed: int = 0) -> Path:
    """A tiny LlavaNextForConditionalGeneration over a two-layer text model, `<image>` as an added token, the
    PIL image processor's preprocessor_config.json (32-pixel tiles, PINPOINTS) and LLaVA's chat template. The
    projector is scaled and the newline drawn as large as the features, so that both steer the output."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<image>"], LLAVA_CHAT_TEMPLATE)
    text_cfg = hf_config(text, ids["vocab_size"])
    text_cfg.bos_token_id, text_cfg.eos_token_id = ids.get("<|begin_of_text|>"), ids.get("<|end_of_text|>")
    vision_cfg = tf.CLIPVisionConfig(**VISION) if vision == "clip" else tf.SiglipVisionConfig(**VISION)
    cfg = tf.LlavaNextConfig(vision_config=vision_cfg, text_config=text_cfg, image_token_index=ids["<image>"],
                             vision_feature_layer=-2, image_grid_pinpoints=PINPOINTS,
                             vision_feature_select_strategy="default" if vision == "clip" else "full")
    torch.manual_seed(seed)
    model = tf.LlavaNextForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
        model.model.image_newline.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    hf_image_processor().save_pretrained(out_dir)
    return out_dir


def hf_image_processor(**kwargs) -> LlavaNextImageProcessorPil:
    return LlavaNextImageProcessorPil(**{"size": {"shortest_edge": TILE}, "crop_size": {"height": TILE, "width": TILE},
                                         "image_grid_pinpoints": PINPOINTS, **kwargs})


def hf_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new: int = 6,
              ) -> list[tuple[list[int], list[float]]]:
    """transformers' tokens and logprobs (fp32) for (expanded prompt ids, images), its PIL processor's pixels."""
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = hf_image_processor()
    return _hf_greedy_with_logprobs(model, prompts, max_new,
                                    lambda t, images: dict(processor(images=images, return_tensors="pt")))


@functools.cache
def hf_processor(model_dir: Path) -> LlavaNextProcessor:
    clip = json.loads((model_dir / "config.json").read_text())["vision_config"]["model_type"] == "clip_vision_model"
    return LlavaNextProcessor(image_processor=hf_image_processor(),
                              tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), patch_size=PATCH,
                              vision_feature_select_strategy="default" if clip else "full",
                              num_additional_image_tokens=int(clip))


def hf_ids(model_dir: Path, text: str, images: list) -> list[int]:
    """The prompt LlavaNextProcessor makes: each <image> repeated as many times as its image's size asks."""
    return hf_processor(model_dir)(text=text, images=images or None)["input_ids"][0]


def sized(sizes: list[tuple[int, int]], seed: int, mode: str = "RGB") -> list[Image.Image]:
    """Random images of the given (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode) for h, w in sizes]


def _checkpoint(root: Path, name: str, **kw) -> Path:
    path = root / name
    if not (path / "config.json").exists():
        make_llava_next_checkpoint(path, **kw)
    return path


@pytest.fixture(scope="module")
def llava_next_dir(ckpt_root: Path) -> Path:
    return _checkpoint(ckpt_root, "llava_next")


@pytest.fixture(scope="module")
def llm(llava_next_dir: Path) -> LLM:
    return LLM(str(llava_next_dir), dtype="float32", num_kv_blocks=128)


def _prompts(ims: list[Image.Image]) -> tuple[list[dict], list[list]]:
    """One prompt per image, one with the wide and the tall image, and a text-only one."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims]
    prompts.append({"prompt": TWO, "multi_modal_data": {"image": [ims[0], ims[1]]}})
    prompts.append({"prompt": TEXT_ONLY})
    return prompts, [[im] for im in ims] + [[ims[0], ims[1]], []]


@pytest.fixture(scope="module")
def reference(llava_next_dir: Path, llm: LLM) -> tuple[list[dict], list[list[int]], list]:
    """The prompts, their expanded ids (checked against LlavaNextProcessor's) and transformers' outputs."""
    prompts, images = _prompts(sized(IMAGE_SIZES, seed=0))
    ids = [llm.engine.process_prompt(p)[1] for p in prompts]
    for p, im, got in zip(prompts, images, ids):
        assert got == hf_ids(llava_next_dir, p["prompt"], im)
    return prompts, ids, hf_greedy(llava_next_dir, list(zip(ids, images)))


@PREFILL_MODES
def test_greedy_equals_transformers(llava_next_dir: Path, reference, engine_args: dict) -> None:
    """Images of every shape (one larger than every pinpoint), two in a prompt and none, batched and alone, with
    whole and chunked prefill (chunks of 16 cut every image): transformers' prompts, tokens and logprobs."""
    prompts, ids, want = reference
    llm = LLM(str(llava_next_dir), dtype="float32", num_kv_blocks=128, **engine_args)
    base = len(llm.tokenizer.encode(PROMPT)) - 1
    assert [len(i) - base for i in ids[:len(IMAGE_SIZES)]] == IMAGE_TOKENS
    outs = llm.generate(prompts, PARAMS)
    assert [o.prompt_token_ids for o in outs] == ids
    assert_outputs_match(tokens_and_logprobs(outs), want)
    assert len({tuple(t) for t, _ in want[:len(IMAGE_SIZES)]}) > 2  # the images steer the output
    for i in (4, len(IMAGE_SIZES)):  # alone: the image larger than every pinpoint, the two-image prompt
        assert_outputs_match(tokens_and_logprobs(llm.generate(prompts[i:i + 1], PARAMS)), want[i:i + 1])
    check_freed(llm)


@pytest.mark.parametrize("text, vision", [("mistral", "clip"), ("qwen2", "siglip")])
def test_other_backbones_equal_transformers(text: str, vision: str, ckpt_root: Path) -> None:
    """llava-v1.6-mistral's kind, and a SigLIP tower read whole ("full") over Qwen2."""
    folder = _checkpoint(ckpt_root, f"llava_next_{text}", text=text, vision=vision, seed=1)
    ims = sized([(40, 60), (100, 22), (12, 90)], seed=1)
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": ims[:2]}},
               {"prompt": PROMPT, "multi_modal_data": {"image": ims[2]}}, {"prompt": TEXT_ONLY}]
    images = [ims[:2], [ims[2]], []]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, PARAMS)
    for out, p, im in zip(outs, prompts, images):
        assert out.prompt_token_ids == hf_ids(folder, p["prompt"], im)
    want = hf_greedy(folder, [(o.prompt_token_ids, im) for o, im in zip(outs, images)])
    assert_outputs_match(tokens_and_logprobs(outs), want)


# ------------------------------------------------------------------------------------ token counts and pixels
def _hf_count(height: int, width: int, pinpoints: list, tile: int, patch: int) -> int:
    """LlavaNextProcessor's count for a CLIP tower with the "default" strategy (the class token added, then
    dropped), on a stand-in holding only what _get_number_of_features reads."""
    ns = types.SimpleNamespace(image_processor=types.SimpleNamespace(image_grid_pinpoints=pinpoints),
                               patch_size=patch, num_additional_image_tokens=1)
    ns._get_unpadded_features = functools.partial(LlavaNextProcessor._get_unpadded_features, ns)
    return LlavaNextProcessor._get_number_of_features(ns, height, width, tile, tile) - 1


REAL_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-v1.6's
# llava-v1.6-34b's / llava-next-72b's longer list (up to 3x3 tiles)
WIDE_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008], [1008, 672], [672, 1008],
                  [1008, 1008], [336, 1344], [1344, 336]]


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.sampled_from(["tiny", "real", "wide"]))
def test_token_counts_equal_transformers(height: int, width: int, kind: str) -> None:
    """Our count of an image's tokens is LlavaNextProcessor's, for any size (the tiny test model's tiles, and
    llava-v1.6's 336-pixel tiles of 14-pixel patches under both pinpoint lists)."""
    from streamer.multimodal.processors.llava_next_image_processor import as_pinpoints, num_image_tokens
    pinpoints, tile, patch = {"tiny": (PINPOINTS, TILE, PATCH), "real": (REAL_PINPOINTS, 336, 14),
                              "wide": (WIDE_PINPOINTS, 336, 14)}[kind]
    assert num_image_tokens(height, width, as_pinpoints(pinpoints, tile), tile, tile // patch) == \
        _hf_count(height, width, pinpoints, tile, patch)


@pytest.mark.parametrize("size", [(32, 64), (64, 32), (64, 64), (33, 97), (1, 40), (7, 300), (300, 7), (500, 499),
                                  (31, 31), (96, 33), (1, 500)])
def test_expansion_equals_the_processors(llava_next_dir: Path, llm: LLM, size: tuple[int, int]) -> None:
    """The engine's expanded prompt is LlavaNextProcessor's (the whole processor, real images; 1 x 500 pixels
    keep no feature row of their grid, only the base tile's 16)."""
    im = sized([size], seed=sum(size))[0]
    assert llm.engine.process_prompt({"prompt": PROMPT, "multi_modal_data": {"image": im}})[1] == \
        hf_ids(llava_next_dir, PROMPT, [im])


@pytest.mark.parametrize("kwargs", [{}, {"resample": 2}, {"do_center_crop": False},
                                    {"size": {"height": TILE, "width": TILE}}, {"size": {"shortest_edge": 40}},
                                    {"do_normalize": False},
                                    {"do_rescale": False, "image_mean": [100.0, 120.0, 90.0],
                                     "image_std": [50.0, 60.0, 70.0]}])
def test_pixels_bit_exact_with_transformers(kwargs: dict, tmp_path: Path) -> None:
    """Every tile of every image (RGB, RGBA, greyscale; all pinpoints; some upscaled, some downscaled) is
    transformers' PIL backend's, bit for bit, under the config variants (a 40-pixel `size` resizes and crops each
    tile, the base image squashed to 40 x 40 first)."""
    from streamer.multimodal.processors.llava_next_image_processor import LlavaNextImageProcessor, as_pinpoints
    theirs = hf_image_processor(**kwargs)
    theirs.save_pretrained(tmp_path)
    ours = LlavaNextImageProcessor.from_folder(tmp_path, TILE, SIDE, as_pinpoints(PINPOINTS, TILE))
    sizes = IMAGE_SIZES + [(33, 97), (64, 64), (1000, 700), (5, 7), (64, 20)]
    ims = [sized([s], seed=i, mode=("RGB", "RGBA", "L")[i % 3])[0] for i, s in enumerate(sizes)]
    want = theirs(images=ims, return_tensors="pt")
    got = ours(ims)
    assert [s for _, s in got] == [tuple(s) for s in want["image_sizes"].tolist()]
    assert {len(px) for px, _ in got} == {3, 4, 5}  # the base image and 1x2 / 2x1, 1x3 / 3x1, 2x2 tiles
    for (px, _), hf_px in zip(got, want["pixel_values"]):
        assert torch.equal(px, hf_px[:len(px)])
        assert not hf_px[len(px):].any()  # (transformers' batch padding, past the image's tiles)


# ------------------------------------------------------------------------------------ the features' layout
@torch.no_grad()
def test_features_equal_transformers_and_every_part_counts(llava_next_dir: Path, llm: LLM, monkeypatch) -> None:
    """Our encoder, projector and layout give transformers' pack_image_features output, image by image; that
    check fails with the newline zeroed, with the grid left padded (no unpadding), and with the base tile last."""
    import streamer.multimodal.processors.llava_next_image_processor as lnp
    model = llm.engine.runner.model
    ims = sized(IMAGE_SIZES, seed=2)
    _, inputs = llm.engine.image_prompts.expand(llm.tokenizer.encode(TWO.replace("<image>\n", "<image>\n" * 3)), ims)
    hf_model = transformers.LlavaNextForConditionalGeneration.from_pretrained(llava_next_dir, dtype=torch.float32)
    px = hf_image_processor()(images=ims, return_tensors="pt")
    want = hf_model.eval().model.get_image_features(px["pixel_values"], px["image_sizes"]).pooler_output

    def matches() -> bool:
        got = model.encode(inputs, torch.device("cpu"))
        return all(g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-5) for g, w in zip(got, want))

    assert [len(w) for w in want] == IMAGE_TOKENS and matches()
    newline = model.image_newline.weight.clone()
    try:
        model.image_newline.weight.zero_()
        assert not matches()
    finally:
        model.image_newline.weight.copy_(newline)
    with monkeypatch.context() as m:
        m.setattr(lnp, "unpadded", lambda h, w, rows, cols: ((0, rows), (0, cols)))
        assert not matches()
    with monkeypatch.context() as m:
        pack = type(model).pack
        m.setattr(type(model), "pack", lambda self, f, size: torch.roll(pack(self, f, size), -SIDE * SIDE, 0))
        assert not matches()
    assert matches()


# ------------------------------------------------------------------------------------ prompts, weights, server
def test_expanded_prompts_and_errors(llm: LLM) -> None:
    im = sized([(40, 60)], seed=6)[0]
    direct = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, PARAMS)
    ids = direct[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": im}}, PARAMS)
    assert again[0].prompt_token_ids == ids and tokens(again) == tokens(direct)  # an expanded prompt is kept
    short = list(ids)
    short.remove(llm.engine.model_config.image_token_id)
    with pytest.raises(ValueError, match="a run of 69 image tokens"):
        llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": im}}, PARAMS)
    with pytest.raises(ValueError, match="2 image placeholder"):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": [im]}}, PARAMS)
    check_freed(llm)


def test_same_pixels_other_size_are_other_images(llm: LLM) -> None:
    """Two sizes can make the same pixels (a flat image) but other unpadded grids: they are other encoder-cache
    and prefix-cache entries."""
    sizes = [(3, 8), (4, 11)]  # both fitted into 24 x 64 pixels of a 1 x 2 grid; 2 and 1 unpadded feature rows
    ins = [llm.engine.image_prompts.expand(llm.tokenizer.encode(PROMPT), [Image.new("RGB", (w, h), (200, 30, 90))])
           [1][0] for h, w in sizes]
    assert torch.equal(ins[0].pixel_values, ins[1].pixel_values)
    assert [im.length for im in ins] == [_hf_count(*s, PINPOINTS, TILE, PATCH) for s in sizes] == [52, 34]
    assert ins[0].hash != ins[1].hash


def test_transformers_5_weight_names(llava_next_dir: Path, llm: LLM, tmp_path: Path) -> None:
    """The same weights under transformers 5's in-memory names (model.language_model., model.vision_tower.,
    model.multi_modal_projector., model.image_newline) load to the same model."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "v5"
    shutil.copytree(llava_next_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    assert "image_newline" in weights and "language_model.model.embed_tokens.weight" in weights
    renamed = {("model.language_model." + n.removeprefix("language_model.model.")) if n.startswith("language_model.m")
               else ("lm_head.weight" if n == "language_model.lm_head.weight" else "model." + n): t
               for n, t in weights.items()}
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": sized([(40, 24)], seed=9)[0]}}
    v5 = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    assert_outputs_match(tokens_and_logprobs(v5.generate(prompt, PARAMS)),
                         tokens_and_logprobs(llm.generate(prompt, PARAMS)), 1e-6)
    del renamed["model.image_newline"]
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 tensor.*image_newline"):
        LLM(str(folder), dtype="float32", num_kv_blocks=32)


def test_server_chat_with_an_image(llava_next_dir: Path, llm: LLM) -> None:
    import openai
    im = sized([(36, 90)], seed=8)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    local = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), greedy)[0]
    with LiveServer(llava_next_dir, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        msgs = _conversation({"type": "image_url", "image_url": {"url": _data_url(im)}})
        r = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=8, temperature=0.0)
        assert r.choices[0].message.content == local.outputs[0].text
        assert r.usage.prompt_tokens == len(local.prompt_token_ids)


# ------------------------------------------------------------------------------------------------ configs
# llava-hf/llava-v1.6-mistral-7b-hf's config.json in shape (transformers 4 era): the vision encoder's sizes partly
# left to CLIPVisionConfig's defaults.
LLAVA_NEXT_MISTRAL_CONFIG = {
    "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
    "image_grid_pinpoints": REAL_PINPOINTS, "image_token_index": 32000, "model_type": "llava_next",
    "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2", "architectures": ["MistralForCausalLM"],
                    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                    "torch_dtype": "bfloat16", "vocab_size": 32064},
    "torch_dtype": "float16", "use_image_newline_parameter": True,
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}


def test_a_real_config_reads() -> None:
    from streamer.models.config import ModelConfig
    from streamer.multimodal.processors.llava_next_image_processor import as_pinpoints, num_image_tokens
    cfg = ModelConfig.from_dict(LLAVA_NEXT_MISTRAL_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.sliding_window, cfg.vocab_size,
            cfg.rope_theta, cfg.torch_dtype) == ("MistralForCausalLM", 4096, 32, 8, None, 32064, 1e6, "float16")
    assert cfg.image_token_id == 32000 and cfg.multimodal_architecture == "LlavaNextForConditionalGeneration"
    # (a 640x480 photo: 2x2 tiles, a 48x48 grid cropped to 36 rows: 576 + 36 * 49; transformers' count too)
    assert num_image_tokens(480, 640, as_pinpoints(REAL_PINPOINTS, 336), 336, 24) == 576 + 36 * 49 == \
        _hf_count(480, 640, REAL_PINPOINTS, 336, 14)
    bare = ModelConfig.from_dict({"architectures": ["LlavaNextForConditionalGeneration"]})  # all defaults
    assert (bare.architecture, bare.image_token_id, bare.tie_word_embeddings) == ("LlamaForCausalLM", 32000, False)
    with pytest.raises(ValueError, match="unsupported vision encoder"):
        ModelConfig.from_dict({**LLAVA_NEXT_MISTRAL_CONFIG, "vision_config": {"model_type": "pixtral"}})


def test_defaults_match_transformers() -> None:
    from streamer.models.vlm import DEFAULT_GRID_PINPOINTS, DEFAULT_VISION_CONFIG
    from streamer.multimodal.processors.llava_next_image_processor import LLAVA_NEXT_DEFAULTS
    default = transformers.LlavaNextConfig()
    assert default.image_grid_pinpoints == DEFAULT_GRID_PINPOINTS
    assert (default.image_token_index, default.vision_feature_layer, default.vision_feature_select_strategy,
            default.multimodal_projector_bias, default.text_config.model_type) == (32000, -2, "default", True, "llama")
    vision = default.vision_config.to_dict()
    assert all(vision[k] == v for k, v in DEFAULT_VISION_CONFIG.items())
    proc = LlavaNextImageProcessorPil().to_dict()
    for key, value in LLAVA_NEXT_DEFAULTS.items():
        got = proc.get(key)
        assert (tuple(got) if isinstance(got, list) and key != "image_grid_pinpoints" else got) == value, key


def _with(folder: Path, tmp_path: Path, config: dict | None = None, processor: dict | None = None) -> Path:
    """A copy of the checkpoint with config.json and preprocessor_config.json updated."""
    out = tmp_path / "variant"
    shutil.copytree(folder, out)
    for name, changes in (("config.json", config), ("preprocessor_config.json", processor)):
        path = out / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **(changes or {})}))
    return out


@pytest.mark.parametrize("config, processor, message", [
    ({"vision_feature_select_strategy": "full"}, None, "leaves 17 features a tile"),  # (CLIP's class token kept)
    ({"image_grid_pinpoints": [[32, 64], [64, 48]]}, None, "not a whole number of 32-pixel tiles"),
    (None, {"image_grid_pinpoints": [[32, 64], [64, 32]]}, "image_grid_pinpoints .* are not the model's"),
    (None, {"crop_size": {"height": 48, "width": 48}}, "cuts 48-pixel tiles"),
])
def test_inconsistent_checkpoints_are_refused(llava_next_dir: Path, tmp_path: Path, config, processor,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(_with(llava_next_dir, tmp_path, config, processor)), dtype="float32", num_kv_blocks=16)
