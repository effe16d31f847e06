"""The LLaVA vision side against transformers as the oracle: CLIP/SigLIP towers (hidden states LLaVA reads, after
the feature-select strategy) and the CLIP/SigLIP image processors (PIL backend), on tiny shapes."""
from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
import torch
from PIL import Image

from streamer.models.vision import VISION_DEFAULTS, VisionTower
from streamer.multimodal.processors.image_processor import ImageProcessor

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
            patch_size=8)
FAMILIES = {"clip": ("CLIPVisionConfig", "CLIPVisionModel"), "siglip": ("SiglipVisionConfig", "SiglipVisionModel")}


@cache
def hf_tower(family: str, act: str | None = None) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor, tuple]:
    """(vision_config dict, state_dict, pixel_values, hidden_states) of a tiny random transformers tower. Every
    parameter is perturbed, so LayerNorm weights/biases are not their trivial ones/zeros."""
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(0)
    config = config_cls(**TINY, **({"hidden_act": act} if act else {}))
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        pixels = torch.randn(2, 3, 32, 32)
        hidden = model(pixels, output_hidden_states=True).hidden_states
    state = {k.removeprefix("vision_model."): v for k, v in model.state_dict().items()}
    return config.to_dict(), state, pixels, hidden


def reference(hidden: tuple, layers: int | list[int], strategy: str) -> torch.Tensor:
    """transformers' LlavaModel.get_image_features, before the projector."""
    picked = [hidden[i] for i in (layers if isinstance(layers, list) else [layers])]
    if strategy == "default":
        picked = [h[:, 1:] for h in picked]
    return torch.cat(picked, dim=-1)


def loaded_tower(family: str, layers: int | list[int], strategy: str, act: str | None = None) -> VisionTower:
    config, state, _, _ = hf_tower(family, act)
    tower = VisionTower(config, layers, strategy)
    loaded = tower.load_weights(state.items())
    assert set(dict(tower.named_parameters())) - loaded == set()
    return tower


@pytest.mark.parametrize("family", ["clip", "siglip"])
@pytest.mark.parametrize("layers", [-1, -2, [-2, -1], 0])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_tower_matches_transformers(family, layers, strategy):
    _, _, pixels, hidden = hf_tower(family)
    tower = loaded_tower(family, layers, strategy)
    out = tower(pixels)
    ref = reference(hidden, layers, strategy)
    assert out.shape == (2, tower.num_tokens, tower.hidden_size) == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "quick_gelu", "gelu_pytorch_tanh"])
def test_activations(act):
    _, _, pixels, hidden = hf_tower("clip", act)
    torch.testing.assert_close(loaded_tower("clip", -1, "full", act)(pixels), hidden[-1], rtol=0, atol=1e-5)


def test_num_tokens():
    patches = (32 // 8) ** 2
    assert loaded_tower("clip", -2, "default").num_tokens == patches
    assert loaded_tower("clip", -2, "full").num_tokens == patches + 1  # the class token
    assert loaded_tower("siglip", -2, "full").num_tokens == patches
    assert loaded_tower("clip", [-2, -1], "default").hidden_size == 64


def test_breakage_is_caught():
    """The comparison is sharp enough to see a wrong strategy, a wrong layer and swapped q/k."""
    _, state, pixels, hidden = hf_tower("clip")
    ref = reference(hidden, -2, "default")
    full = loaded_tower("clip", -2, "full")(pixels)
    assert full.shape != ref.shape
    torch.testing.assert_close(full[:, 1:], ref, rtol=0, atol=1e-5)
    assert not torch.allclose(loaded_tower("clip", -1, "default")(pixels), ref, atol=1e-3)
    swapped = {k.replace("q_proj", "@").replace("k_proj", "q_proj").replace("@", "k_proj"): v
               for k, v in state.items()}
    tower = VisionTower(hf_tower("clip")[0], -2, "default")
    tower.load_weights(swapped.items())
    assert not torch.allclose(tower(pixels), ref, atol=1e-3)


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_unread_parts_not_built(family):
    """hidden_states[-2] of 3 layers: layer 2, post_layernorm and SigLIP's head are neither built nor loaded."""
    config, state, _, _ = hf_tower(family)
    tower = VisionTower(config, -2, "default")
    assert len(tower.encoder.layers) == 2
    unused = ("encoder.layers.2.", "post_layernorm.", "head.", "embeddings.position_ids")
    expected = sum(v.numel() for k, v in state.items() if not k.startswith(unused))
    assert sum(p.numel() for p in tower.parameters()) == expected
    assert len(tower.load_weights(state.items())) == len(dict(tower.named_parameters()))


def test_load_casts_to_parameter_dtype():
    config, state, pixels, hidden = hf_tower("siglip")
    tower = VisionTower(config, -1, "full")
    tower.load_weights((k, v.half()) for k, v in state.items())
    assert tower.embeddings.patch_embedding.weight.dtype == torch.float32
    torch.testing.assert_close(tower.embeddings.patch_embedding.weight,
                               state["embeddings.patch_embedding.weight"].half().float(), rtol=0, atol=0)
    torch.testing.assert_close(tower(pixels.half()), hidden[-1], rtol=0, atol=5e-2)  # fp16 weights and pixels


def test_built_in_default_dtype():
    config = hf_tower("clip")[0]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        tower = VisionTower(config, -2, "default")
    finally:
        torch.set_default_dtype(old)
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    tower.load_weights(hf_tower("clip")[1].items())
    assert tower(hf_tower("clip")[2]).dtype == torch.bfloat16  # fp32 pixels are cast to the weights' dtype


def test_errors():
    config = hf_tower("clip")[0]
    with pytest.raises(ValueError, match="dinov2"):
        VisionTower({**config, "model_type": "dinov2"}, -2, "default")
    with pytest.raises(ValueError, match="strategy.*'cls'"):
        VisionTower(config, -2, "cls")
    with pytest.raises(ValueError, match="out of range"):
        VisionTower(config, -5, "default")
    tower = VisionTower(config, -2, "default")
    with pytest.raises(ValueError, match="image_size 32"):
        tower(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match="encoder.layers.0.mlp.fc3.weight"):
        tower.load_weights([("encoder.layers.0.mlp.fc3.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="pre_layrnorm.weight.*expected"):
        tower.load_weights([("pre_layrnorm.weight", torch.zeros(3))])


def test_vision_defaults_match_transformers():
    for model_type, cls in (("clip_vision_model", transformers.CLIPVisionConfig),
                            ("siglip_vision_model", transformers.SiglipVisionConfig)):
        config = cls()
        assert config.model_type == model_type
        assert VISION_DEFAULTS[model_type] == {k: getattr(config, k) for k in VISION_DEFAULTS[model_type]}


def test_defaults_fill_a_sparse_config():
    """llava-1.5's vision_config leaves hidden_act, layer_norm_eps and num_channels out."""
    tower = VisionTower({"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4}, -1, "full")
    assert tower.num_tokens == (224 // 16) ** 2
    assert tower.spec.act == "gelu_pytorch_tanh" and tower.spec.eps == 1e-6


# ------------------------------------------------------------------------------------------- image processor
def _images() -> list[Image.Image]:
    """Wider, taller, square, tiny and odd sizes, in RGB, RGBA, L, LA, P and P with a transparent index."""
    rng = np.random.default_rng(0)
    out = []
    sizes = [(64, 40), (40, 64), (30, 30), (31, 77), (77, 31), (3, 5), (1, 1), (45, 45)]
    for i, (w, h) in enumerate(sizes):
        rgba = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
        for mode in ("RGB", "RGBA", "L", "LA", "P"):
            out.append(rgba if mode == "RGBA" else rgba.convert(mode))
        p = rgba.convert("P")
        p.info["transparency"] = i  # composited onto white like an alpha channel
        out.append(p)
    return out


PROCESSORS = {
    "clip": ("CLIPImageProcessorPil", dict(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})),
    "clip-bilinear-pad": ("CLIPImageProcessorPil", dict(size={"shortest_edge": 31}, resample=2,
                                                         crop_size={"height": 29, "width": 33})),
    "clip-longest-edge": ("CLIPImageProcessorPil", dict(size={"shortest_edge": 20, "longest_edge": 30},
                                                         crop_size={"height": 24, "width": 24})),
    "clip-custom": ("CLIPImageProcessorPil", dict(size={"shortest_edge": 26}, crop_size={"height": 26, "width": 26},
                                                  rescale_factor=1 / 127.5, image_mean=[0.1, 0.2, 0.3],
                                                  image_std=[0.9, 0.8, 0.7])),
    "clip-no-normalize": ("CLIPImageProcessorPil", dict(size={"shortest_edge": 20}, do_normalize=False,
                                                        crop_size={"height": 20, "width": 20})),
    "siglip": ("SiglipImageProcessorPil", dict(size={"height": 30, "width": 28})),
    "siglip-bilinear": ("SiglipImageProcessorPil", dict(size={"height": 17, "width": 17}, resample=2)),
}


@pytest.mark.parametrize("name", PROCESSORS)
def test_processor_matches_transformers(name, tmp_path):
    cls_name, kwargs = PROCESSORS[name]
    ref = getattr(transformers, cls_name)(**kwargs)
    ref.save_pretrained(tmp_path)
    ours = ImageProcessor.from_folder(tmp_path)
    images = _images()
    expected = ref(images, return_tensors="pt")["pixel_values"]
    got = ours(images)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert got.shape[-2:] == ours.output_size
    # Bit-for-bit: same PIL calls, and a lookup table computed with transformers' own numpy dtypes.
    assert torch.equal(got, expected)


def test_processor_older_config_spelling(tmp_path):
    """openai/clip-vit-large-patch14-336: ints for size/crop_size, only a feature_extractor_type."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"feature_extractor_type": "CLIPFeatureExtractor", "size": 30, "crop_size": 30, "do_convert_rgb": None}))
    ours = ImageProcessor.from_folder(tmp_path)
    ref = transformers.CLIPImageProcessorPil(size=30, crop_size=30)
    images = _images()
    assert torch.equal(ours(images), ref(images, return_tensors="pt")["pixel_values"])


def test_processor_from_processor_config(tmp_path):
    ref = transformers.SiglipImageProcessorPil(size={"height": 20, "width": 20})
    entry = json.loads(ref.to_json_string())
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": entry,
                                                                "processor_class": "LlavaProcessor"}))
    ours = ImageProcessor.from_folder(tmp_path)
    assert ours.output_size == (20, 20)
    images = _images()[:6]
    assert torch.equal(ours(images), ref(images, return_tensors="pt")["pixel_values"])
    assert ours([]).shape == (0, 3, 20, 20)


def test_processor_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    with pytest.raises(ValueError, match="no image_processor entry"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "LlavaNextImageProcessor"}))
    with pytest.raises(ValueError, match="LlavaNextImageProcessor"):
        ImageProcessor.from_folder(tmp_path)
    with pytest.raises(ValueError, match="depend on each image"):
        ImageProcessor.from_config({"image_processor_type": "SiglipImageProcessor", "size": {"shortest_edge": 20}})
    with pytest.raises(ValueError, match="max_height"):
        ImageProcessor.from_config({"image_processor_type": "CLIPImageProcessor",
                                    "size": {"max_height": 20, "max_width": 20}})
    no_rgb = ImageProcessor.from_config({"image_processor_type": "CLIPImageProcessor", "do_convert_rgb": False})
    with pytest.raises(ValueError, match="'L'"):
        no_rgb([Image.new("L", (8, 8))])
