"""Mistral 3 (Mistral3ForConditionalGeneration: Mistral-Small-3.1 / 3.2): the Pixtral encoder and Mistral 3's
projector (streamer/models/pixtral.py), the image processor (streamer/multimodal/processors/pixtral_image_processor.py) and the whole
engine path (placeholders expanded into rows closed by [IMG_BREAK] / [IMG_END], chunked prefill, the prefix and
encoder caches, the chat template, the server) against transformers on a tiny random checkpoint."""
from __future__ import annotations

import ast
import json
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

PATCH, MERGE, LONGEST = 4, 2, 48  # 8-pixel merged tokens; images fitted into 48 x 48 (at most 6 x 6 tokens)
SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
# Mistral-Small-3.1's chat template, in short: string or parts, each image part as [IMG].
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST]' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '[IMG]' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '[/INST]' }}{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
PROMPT = "[INST][IMG]What is in the picture?[/INST]"
TWO = "[INST]Compare [IMG] and [IMG]. Which?[/INST]"
TEXT_ONLY = "[INST]no picture here[/INST]"
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=LONGEST,
              patch_size=PATCH, hidden_act="silu")


def make_mistral3_checkpoint(out_dir: Path, seed: int = 0, text: str = "mistral") -> Path:
    """A tiny Mistral3ForConditionalGeneration: Pixtral with 4-pixel patches (hidden 32, 3 layers), 2x2 merged
    into one token, over a two-layer Mistral with an untied head; the special tokens as added tokens, Pixtral's
    image processor config (longest edge 48) and processor_config.json as Mistral-Small-3.1's, and a short
    Mistral-style chat template."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, SPECIALS, CHAT_TEMPLATE)
    text_cfg = hf_config(text, ids["vocab_size"])  # ("ministral3": Ministral 3's, tests/test_ministral3.py)
    text_cfg.bos_token_id, text_cfg.eos_token_id = ids.get("<|begin_of_text|>"), ids.get("<|end_of_text|>")
    cfg = tf.Mistral3Config(text_config=text_cfg, vision_config=tf.PixtralVisionConfig(**VISION),
                            image_token_index=ids["[IMG]"], spatial_merge_size=MERGE, tie_word_embeddings=False,
                            vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = tf.Mistral3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_pre" in name:  # (transformers starts them at one: random ones show each)
                p.normal_(1.0, 0.3)
            elif "vision_tower" in name:  # (at 0.02, attention is about uniform: the rotary would hardly show)
                p.normal_(0.0, 0.25)
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)  # features that steer the output
    model.save_pretrained(out_dir)
    tf.PixtralImageProcessorPil(size={"longest_edge": LONGEST}, patch_size={"height": PATCH, "width": PATCH}) \
        .save_pretrained(out_dir)
    (out_dir / "processor_config.json").write_text(json.dumps({
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
        "patch_size": PATCH, "processor_class": "PixtralProcessor", "spatial_merge_size": MERGE}))
    return out_dir


def _hf_processor():
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    return PixtralImageProcessorPil(size={"longest_edge": LONGEST}, patch_size={"height": PATCH, "width": PATCH})


def hf_mistral3_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                       ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation (and logprobs) of each (expanded prompt ids, PIL images), fp32, with the
    pixels its image processor makes at PixtralProcessor's patch (patch_size * spatial_merge_size)."""
    import transformers as tf
    model = tf.Mistral3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = tf.AutoImageProcessor.from_pretrained(model_dir)

    def inputs(t: torch.Tensor, images: list) -> dict:
        px = processor(images=images, patch_size=PATCH * MERGE, return_tensors="pt")
        return {"pixel_values": px["pixel_values"], "image_sizes": px["image_sizes"]}
    return _hf_greedy_with_logprobs(model, prompts, max_new_tokens, inputs)


def _replace_image_token():
    """transformers' own PixtralProcessor.replace_image_token, lifted from its source: processing_pixtral.py
    cannot be imported without torchvision, which this environment lacks."""
    src = Path(transformers.__file__).parent / "models" / "pixtral" / "processing_pixtral.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PixtralProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "replace_image_token")
    scope: dict = {}
    exec(compile(ast.Module([fn], []), str(src), "exec"), scope)
    return scope["replace_image_token"]


def hf_expanded(text: str, images: list) -> str:
    """The text PixtralProcessor feeds the model: each [IMG] replaced by its image's rows, sized by transformers'
    image processor."""
    sizes = _hf_processor()(images=images, patch_size=PATCH * MERGE)["image_sizes"] if images else []
    processor = types.SimpleNamespace(patch_size=PATCH, spatial_merge_size=MERGE, image_token="[IMG]",
                                      image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
    replace, parts = _replace_image_token(), text.split("[IMG]")
    assert len(parts) == len(images) + 1
    return parts[0] + "".join(replace(processor, {"image_sizes": sizes}, i) + part
                              for i, part in enumerate(parts[1:]))


def sized(sizes: list[tuple[int, int]], seed: int, mode: str = "RGB") -> list[Image.Image]:
    """Random images of the given (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode) for h, w in sizes]


@pytest.fixture(scope="module")
def mistral3_dir(ckpt_root: Path) -> Path:
    path = ckpt_root / "mistral3"
    if not (path / "config.json").exists():
        make_mistral3_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def llm(mistral3_dir: Path) -> LLM:
    return LLM(str(mistral3_dir), dtype="float32", num_kv_blocks=64)


# (height, width): 32x48 -> 4 x 6 tokens; 40x40 -> 5 x 5; 20x64 -> fitted to 15x48 -> 16x48: 2 x 6; 60x30 -> 48x24
IMAGE_SIZES = [(30, 48), (40, 40), (20, 64), (60, 30)]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)


def _prompts(ims: list[Image.Image]) -> list[dict]:
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims[:3]]
    prompts.append({"prompt": TWO, "multi_modal_data": {"image": [ims[3], ims[1]]}})  # two sizes in one prompt
    prompts.append({"prompt": TEXT_ONLY})
    return prompts


def test_greedy_equals_transformers(mistral3_dir: Path, llm: LLM) -> None:
    """One image per prompt (three sizes), two images of different sizes in one prompt and a text-only prompt in one
    batch: the prompts are what PixtralProcessor makes, the tokens and logprobs transformers'."""
    ims = sized(IMAGE_SIZES, seed=0)
    prompts = _prompts(ims)
    outs = llm.generate(prompts, PARAMS)
    images = [[ims[0]], [ims[1]], [ims[2]], [ims[3], ims[1]], []]
    for out, p, im in zip(outs, prompts, images):
        assert out.prompt_token_ids == llm.tokenizer.encode(hf_expanded(p["prompt"], im))
    assert len({len(o.prompt_token_ids) for o in outs[:3]}) == 3  # three sizes, three token counts
    want = hf_mistral3_greedy(mistral3_dir, [(o.prompt_token_ids, im) for o, im in zip(outs, images)], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    assert len({tuple(t) for t, _ in want[:3]}) > 1  # the images steer the output
    check_freed(llm)


def test_chunked_prefill_splits_images(mistral3_dir: Path) -> None:
    """Chunks of 8 tokens cut every image (rows and row breaks alike) over several steps; with no encoder cache
    each chunk encodes its image again; the same tokens as transformers, and a prefix-cache hit gives them too."""
    ims = sized(IMAGE_SIZES, seed=0)
    prompts = _prompts(ims)
    whole = LLM(str(mistral3_dir), dtype="float32", num_kv_blocks=64)
    want = tokens_and_logprobs(whole.generate(prompts, PARAMS))  # (== transformers': the test above)
    chunked = LLM(str(mistral3_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, block_size=4,
                  encoder_cache_bytes=0)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    assert chunked.engine.runner.encoder_cache.num_encoded > 5  # each chunk re-encoded its image
    again = chunked.generate(prompts[3:4], PARAMS)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[3:4])
    check_freed(chunked)


def test_chunked_prefill_equals_transformers(mistral3_dir: Path) -> None:
    ims = sized([(56, 40), (24, 16)], seed=3)
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": ims}}]
    chunked = LLM(str(mistral3_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, block_size=4)
    outs = chunked.generate(prompts, PARAMS)
    want = hf_mistral3_greedy(mistral3_dir, [(outs[0].prompt_token_ids, ims)], 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)


def test_image_step_maps_only_image_tokens() -> None:
    """A chunk that cuts an image reads the feature rows of its own [IMG] positions; the row breaks in it take
    none, and a chunk holding only a break encodes nothing."""
    from streamer.multimodal.inputs import ImageInput, image_step
    mask = np.array([1, 1, 0, 1, 1, 0], dtype=bool)  # 2 x 2 tokens: [IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]
    img = ImageInput(3, 6, torch.zeros(1), b"a", feature_mask=mask)
    req = types.SimpleNamespace(images=[img])
    # positions 4..7 of the prompt at rows 10..13 of the step: image positions 1, 2 (break), 3, 4
    step = image_step([req], np.array([10]), np.array([4]), np.array([4]))
    assert step.token_idx.tolist() == [10, 12, 13] and step.rows.tolist() == [1, 2, 3]
    assert step.last_pos.tolist() == [8, 8, 8] and img.num_features == 4
    assert image_step([req], np.array([0]), np.array([8]), np.array([1])) is None  # only [IMG_END]
    whole = image_step([req, req], np.array([0, 20]), np.array([0, 0]), np.array([12, 12]))
    assert whole.token_idx.tolist() == [3, 4, 6, 7, 23, 24, 26, 27] and whole.rows.tolist() == [0, 1, 2, 3] * 2
    assert len(whole.images) == 1  # one image, encoded once


def test_expanded_prompts_and_errors(llm: LLM) -> None:
    im = sized([(32, 24)], seed=6)[0]
    direct = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, PARAMS)
    ids = direct[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": im}}, PARAMS)
    assert again[0].prompt_token_ids == ids and tokens(again) == tokens(direct)
    brk = llm.tokenizer.token_to_id("[IMG_BREAK]")
    img = llm.tokenizer.token_to_id("[IMG]")
    wrong = list(ids)
    wrong[wrong.index(brk)] = img  # a row one token too long, no break
    with pytest.raises(ValueError, match="does not match"):
        llm.generate({"prompt_token_ids": wrong, "multi_modal_data": {"image": im}}, PARAMS)
    cut = [t for t in ids if t != llm.tokenizer.token_to_id("[IMG_END]")]
    with pytest.raises(ValueError, match="no \\[IMG_END\\]"):
        llm.generate({"prompt_token_ids": cut, "multi_modal_data": {"image": im}}, PARAMS)
    with pytest.raises(ValueError, match="2 image placeholder"):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": [im]}}, PARAMS)
    check_freed(llm)


def test_chat_with_two_images(llm: LLM) -> None:
    """Two image parts in a row render as "[IMG][IMG]": two placeholders, each expanded to its own image."""
    a, b = sized([(24, 40), (48, 16)], seed=7)
    conv = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "image_pil", "image_pil": b},
                                         {"type": "text", "text": "Which?"}]}]
    chat = llm.chat(conv, PARAMS)
    text = "<|begin_of_text|>[INST][IMG][IMG]Which?[/INST]"
    assert chat[0].prompt_token_ids == llm.tokenizer.encode(hf_expanded(text, [a, b]), add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"image": [a, b]}}, PARAMS)
    assert tokens(chat) == tokens(direct)


def test_server_chat_with_an_image(mistral3_dir: Path, llm: LLM) -> None:
    import openai
    im = sized([(36, 44)], seed=8)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    local = llm.chat(_conversation({"type": "image_pil", "image_pil": im}), greedy)[0]
    with LiveServer(mistral3_dir, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        msgs = _conversation({"type": "image_url", "image_url": {"url": _data_url(im)}})
        r = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=8, temperature=0.0)
        assert r.choices[0].message.content == local.outputs[0].text
        assert r.usage.prompt_tokens == len(local.prompt_token_ids)


def test_transformers_5_weight_names(mistral3_dir: Path, llm: LLM, tmp_path: Path) -> None:
    """The same weights under transformers 5's names (model.language_model., model.vision_tower.,
    model.multi_modal_projector., lm_head.) load to the same model."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "v5"
    shutil.copytree(mistral3_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    assert "language_model.lm_head.weight" in weights  # (transformers saves the older names)
    renamed = {}
    for name, t in weights.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        else:
            name = "model." + name
        renamed[name] = t
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    im = sized([(40, 24)], seed=9)[0]
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": im}}
    v5 = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    assert_outputs_match(tokens_and_logprobs(v5.generate(prompt, PARAMS)), tokens_and_logprobs(llm.generate(prompt, PARAMS)), 1e-6)


# ------------------------------------------------------------------------------------ the encoder and projector
@pytest.fixture(scope="module")
def hf_model(mistral3_dir: Path):
    return transformers.Mistral3ForConditionalGeneration.from_pretrained(mistral3_dir, dtype=torch.float32).eval()


def _ours(hf_model, feature_layer: int = -1):
    from streamer.models.pixtral import Mistral3Projector, PixtralVisionTower
    cfg = hf_model.config
    tower = PixtralVisionTower(cfg.vision_config.to_dict(), feature_layer)
    projector = Mistral3Projector(32, cfg.text_config.hidden_size, MERGE, "gelu", False, cfg.text_config.rms_norm_eps)
    state = hf_model.model.vision_tower.state_dict()
    loaded = tower.load_weights(state.items())
    assert loaded == {n for n, _ in tower.named_parameters()}
    projector.load_state_dict(hf_model.model.multi_modal_projector.state_dict())
    return tower, projector


@pytest.mark.parametrize("feature_layer", [-1, 1])
@torch.no_grad()
def test_encoder_and_projector_equal_transformers(hf_model, feature_layer: int) -> None:
    """Images of several sizes in one call (each attending to itself only) give transformers' features, one image
    alone bit for bit; an earlier feature layer reads that layer's states (and builds no layer past it)."""
    from streamer.multimodal.processors.pixtral_image_processor import PixtralImageProcessor
    tower, projector = _ours(hf_model, feature_layer)
    assert len(tower.transformer.layers) == (3 if feature_layer == -1 else 1)
    ims = sized([(30, 48), (40, 40), (64, 20), (8, 8)], seed=10)
    ours_px = PixtralImageProcessor.from_config(_hf_processor().to_dict(), PATCH * MERGE)(ims)
    hf_px = _hf_processor()(images=ims, patch_size=PATCH * MERGE, return_tensors="pt")
    want = hf_model.model.get_image_features(hf_px["pixel_values"], hf_px["image_sizes"],
                                             vision_feature_layer=feature_layer).pooler_output
    states, grids = tower(ours_px)
    got = projector(states, grids).split([(h // MERGE) * (w // MERGE) for h, w in grids])
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)
    one = hf_model.model.get_image_features(hf_px["pixel_values"][:1, :, :32, :48], hf_px["image_sizes"][:1],
                                            vision_feature_layer=feature_layer).pooler_output[0]
    states, grids = tower(ours_px[:1])
    assert torch.equal(projector(states, grids), one)


@torch.no_grad()
def test_swapped_rotary_axes_fail(hf_model) -> None:
    """The check above can fail: rows and columns swapped in the rotary embedding give other features."""
    tower, projector = _ours(hf_model)
    ims = sized([(32, 48)], seed=11)
    hf_px = _hf_processor()(images=ims, patch_size=PATCH * MERGE, return_tensors="pt")
    want = hf_model.model.get_image_features(hf_px["pixel_values"], hf_px["image_sizes"]).pooler_output[0]
    tower._inv_freq = tower._inv_freq[::-1]
    states, grids = tower([hf_px["pixel_values"][0]])
    assert not torch.allclose(projector(states, grids), want, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------- image processor
@pytest.mark.parametrize("kwargs", [{}, {"size": {"longest_edge": 100}, "resample": 2},
                                    {"size": {"height": 40, "width": 64}, "do_normalize": False},
                                    {"do_rescale": False, "image_mean": [100.0, 120.0, 90.0],
                                     "image_std": [50.0, 60.0, 70.0]}])
def test_processor_bit_exact_with_transformers(kwargs: dict, tmp_path: Path) -> None:
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from streamer.multimodal.processors.pixtral_image_processor import PixtralImageProcessor
    theirs = PixtralImageProcessorPil(**{"size": {"longest_edge": LONGEST}, **kwargs})
    theirs.save_pretrained(tmp_path)
    ours = PixtralImageProcessor.from_folder(tmp_path, 14 * 2)
    sizes = [(30, 48), (56, 56), (57, 29), (200, 13), (13, 300), (1000, 700), (5, 7)]
    ims = [sized([s], seed=i, mode=("RGB", "RGBA", "L")[i % 3])[0] for i, s in enumerate(sizes)]
    expected = theirs(images=ims, patch_size=28, return_tensors="pt")
    got = ours(ims)
    for px, (h, w), padded in zip(got, expected["image_sizes"].tolist(), expected["pixel_values"]):
        assert px.dtype == torch.float32 and tuple(px.shape) == (3, h, w) and h % 28 == 0 and w % 28 == 0
        assert torch.equal(px, padded[:, :h, :w])


def test_processor_errors() -> None:
    from streamer.multimodal.processors.pixtral_image_processor import PixtralImageProcessor
    ok = {"image_processor_type": "PixtralImageProcessor"}
    with pytest.raises(ValueError, match="unsupported image processor"):
        PixtralImageProcessor.from_config({"image_processor_type": "CLIPImageProcessor"}, 28)
    with pytest.raises(ValueError, match="do_center_crop"):
        PixtralImageProcessor.from_config({**ok, "do_center_crop": True}, 28)
    with pytest.raises(ValueError, match="size"):
        PixtralImageProcessor.from_config({**ok, "size": {"shortest_edge": 10}}, 28)
    processor = PixtralImageProcessor.from_config(ok, 28)
    with pytest.raises(ValueError, match="no pixels"):
        processor(sized([(1, 3000)], seed=0))
    with pytest.raises(ValueError, match="at least"):
        PixtralImageProcessor.from_config({**ok, "do_resize": False}, 28)(sized([(20, 40)], seed=0))


# ------------------------------------------------------------------------------------------------ configs
# mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json (transformers 4.50).
MISTRAL_SMALL_31_CONFIG = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                    "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                    "sliding_window": None, "use_cache": True, "vocab_size": 131072},
    "torch_dtype": "bfloat16", "vision_config": {
        "attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
        "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
        "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
    "vision_feature_layer": -1}


def test_a_real_config_reads() -> None:
    from streamer.models.config import ModelConfig
    from streamer.models.pixtral import PixtralVisionTower
    cfg = ModelConfig.from_dict(MISTRAL_SMALL_31_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.sliding_window, cfg.rope_theta, cfg.tie_word_embeddings, cfg.torch_dtype) == \
        ("MistralForCausalLM", 5120, 40, 32, 8, 128, 131072, None, 1e9, False, "bfloat16")
    assert cfg.image_token_id == 10 and cfg.multimodal_architecture == "Mistral3ForConditionalGeneration"
    with torch.device("meta"):
        tower = PixtralVisionTower(MISTRAL_SMALL_31_CONFIG["vision_config"], -1)
    assert (tower.spec.head_dim, tower.spec.act, tower.spec.rope_theta, len(tower.transformer.layers)) == \
        (64, "silu", 10000.0, 24)
    bare = ModelConfig.from_dict({"architectures": ["Mistral3ForConditionalGeneration"]})  # all defaults
    assert (bare.architecture, bare.hidden_size, bare.head_dim, bare.rope_theta, bare.sliding_window) == \
        ("MistralForCausalLM", 5120, 128, 1e9, None)
    with pytest.raises(ValueError, match="unsupported vision encoder"):
        ModelConfig.from_dict({**MISTRAL_SMALL_31_CONFIG, "vision_config": {"model_type": "siglip_vision_model"}})
    with pytest.raises(ValueError, match="one layer"):
        PixtralVisionTower(MISTRAL_SMALL_31_CONFIG["vision_config"], [-1, -2])


def test_defaults_match_transformers() -> None:
    from streamer.models.pixtral import MISTRAL3_VISION_CONFIG, PIXTRAL_DEFAULTS, ROPE_THETA
    from streamer.models.registry import VISION_LANGUAGE
    from streamer.multimodal.processors.pixtral_image_processor import PIXTRAL_IMAGE_DEFAULTS
    theirs = transformers.PixtralVisionConfig().to_dict()
    assert {k: theirs[k] for k in PIXTRAL_DEFAULTS} == PIXTRAL_DEFAULTS
    assert theirs["rope_parameters"] == {"rope_theta": ROPE_THETA, "rope_type": "axial"}
    default = transformers.Mistral3Config()
    vision = default.vision_config.to_dict()
    assert {k: vision[k] for k in MISTRAL3_VISION_CONFIG} == MISTRAL3_VISION_CONFIG
    text = default.text_config.to_dict()
    mine = dict(VISION_LANGUAGE["Mistral3ForConditionalGeneration"].default_text_config)
    assert {k: text.get(k, text.get("rope_parameters", {}).get(k)) for k in mine} == mine
    assert default.image_token_index == 10
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    proc = PixtralImageProcessorPil().to_dict()
    for key, value in PIXTRAL_IMAGE_DEFAULTS.items():
        got = proc.get(key)
        got = tuple(got) if isinstance(got, list) else got
        assert got == (tuple(value) if isinstance(value, list) else value) or (key == "do_center_crop" and not got), key
