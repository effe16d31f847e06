"""Qwen2-VL / Qwen2.5-VL vision: the tower (streamer/models/qwen_vision.py) and the image processor
(streamer/multimodal/processors/qwen_image_processor.py) against transformers, which is only a test oracle here."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from PIL import Image

import streamer.models.qwen_vision as qv
from streamer.models.qwen_vision import QWEN_VISION_DEFAULTS, ROPE_THETA, QwenVisionTower
from streamer.multimodal.processors.qwen_image_processor import QWEN_IMAGE_DEFAULTS, QwenImageProcessor, smart_resize

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

# Tiny towers: patch 4, merge 2. Qwen2.5's window is 24 px = 3 x 3 merge blocks, so the images below span several
# windows, partial ones included (and the 12 x 12 grid divides evenly: transformers pads a whole empty window).
CONFIGS = {
    "qwen2_vl": dict(depth=3, embed_dim=64, hidden_size=48, mlp_ratio=2, num_heads=4, patch_size=4,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=4, hidden_size=64, intermediate_size=96, out_hidden_size=48, num_heads=4, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=24, fullatt_block_indexes=[1, 3]),
}
# Several images of different grids in one call, and a 2-frame video (frames attend to themselves only).
GRID = [[1, 10, 14], [1, 12, 12], [1, 2, 2], [1, 16, 6], [2, 6, 8]]


def _reference(version: str, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    if version == "qwen2_vl":
        model = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**CONFIGS[version]))
    else:
        model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**CONFIGS[version]))
    model.config._attn_implementation = attn
    with torch.no_grad():
        for p in model.parameters():  # every weight random, norms' too, so each one shows in the output
            p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, QwenVisionTower, torch.Tensor, torch.Tensor]:
    version = request.param
    ref = _reference(version)
    tower = QwenVisionTower(CONFIGS[version], version)
    loaded = tower.load_weights(ref.state_dict().items())
    assert loaded == {name for name, _ in tower.named_parameters()}
    grid = torch.tensor(GRID)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(pixels, grid_thw=grid).pooler_output
    return version, ref, tower, pixels, expected


@torch.no_grad()
def test_tower_bit_exact_with_transformers(pair) -> None:
    _, _, tower, pixels, expected = pair
    out = tower(pixels, torch.tensor(GRID))
    assert out.shape == (sum(t * h * w for t, h, w in GRID) // 4, 48)
    assert torch.equal(out, expected)  # fp32 on the CPU: the same bits as transformers' SDPA path


@torch.no_grad()
def test_tower_close_to_eager_and_linear_patch_embed(pair) -> None:
    version, _, tower, pixels, expected = pair
    eager = _reference(version, "eager")
    assert torch.allclose(tower(pixels, torch.tensor(GRID)), eager(pixels, grid_thw=torch.tensor(GRID)).pooler_output,
                          rtol=1e-5, atol=1e-4)
    tower.patch_embed.conv = False  # the GPU path: the Conv3d as a linear over the flattened patch
    try:
        out = tower(pixels, torch.tensor(GRID))
    finally:
        tower.patch_embed.conv = None
    assert not torch.equal(out, expected) and torch.allclose(out, expected, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_images_never_attend_to_each_other(pair) -> None:
    _, _, tower, pixels, expected = pair
    start, row = 0, 0
    for t, h, w in GRID:
        alone = tower(pixels[start:start + t * h * w], torch.tensor([[t, h, w]]))
        assert torch.allclose(alone, expected[row:row + len(alone)], rtol=1e-5, atol=1e-4)
        start, row = start + t * h * w, row + len(alone)


def test_windows_really_used() -> None:
    tower = QwenVisionTower(CONFIGS["qwen2_5_vl"], "qwen2_5_vl")
    index, cu = tower._window_index([tuple(g) for g in GRID])
    assert sorted(index.tolist()) == list(range(sum(t * h * w for t, h, w in GRID) // 4))
    assert index.tolist() != sorted(index.tolist())  # a real permutation
    assert len(cu) - 1 > sum(t for t, _, _ in GRID)  # more windows than frames
    assert len({b - a for a, b in itertools.pairwise(cu)}) > 1  # partial windows at the edges too


def _swapped_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x1, x2), dim=-1)


def _no_window_permutation(self: QwenVisionTower, grid: list) -> tuple[torch.Tensor, list[int]]:
    index, cu = _REAL_WINDOW_INDEX(self, grid)
    return torch.arange(len(index)), cu


_REAL_WINDOW_INDEX = QwenVisionTower._window_index
WRONG = {
    "swapped rotary halves": ("_rotate_half", _swapped_rotate_half),
    "no window permutation": ("QwenVisionTower._window_index", _no_window_permutation),
    "full attention everywhere": ("QwenVisionTower._window_index",
                                  lambda self, grid: (torch.arange(sum(t * h * w for t, h, w in grid) // 4),
                                                      qv._cumsum([h * w for t, h, w in grid for _ in range(t)]))),
}


@pytest.mark.parametrize("wrong", sorted(WRONG))
@torch.no_grad()
def test_wrong_variants_fail(pair, wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    version, _, tower, pixels, expected = pair
    target, replacement = WRONG[wrong]
    if target.startswith("QwenVisionTower.") and version == "qwen2_vl":
        pytest.skip("Qwen2-VL has no windows")
    if "." in target:
        monkeypatch.setattr(QwenVisionTower, target.split(".")[1], replacement)
    else:
        monkeypatch.setattr(qv, target, replacement)
    assert not torch.allclose(tower(pixels, torch.tensor(GRID)), expected, rtol=1e-3, atol=1e-3)


def test_config_defaults_match_transformers() -> None:
    for version, cls in (("qwen2_vl", Qwen2VLVisionConfig), ("qwen2_5_vl", Qwen2_5_VLVisionConfig)):
        theirs = cls().to_dict()
        for key, value in QWEN_VISION_DEFAULTS[version].items():
            assert tuple(theirs[key]) == value if isinstance(value, tuple) else theirs[key] == value, (version, key)
        assert theirs["rope_parameters"] == {"rope_theta": ROPE_THETA, "rope_type": "axial"}
    spec = qv.QwenVisionSpec.from_config({}, "qwen2_5_vl")  # a config leaving everything out
    assert (spec.width, spec.out_hidden, spec.mlp_hidden, spec.fullatt_blocks) == (3584, 3584, 3420,
                                                                                   frozenset({7, 15, 23, 31}))
    spec = qv.QwenVisionSpec.from_config({"embed_dim": 1280, "num_attention_heads": 16}, "qwen2_vl")
    assert (spec.width, spec.out_hidden, spec.mlp_hidden, spec.num_heads) == (1280, 3584, 5120, 16)


def test_tower_errors() -> None:
    with pytest.raises(ValueError, match="version"):
        QwenVisionTower(CONFIGS["qwen2_vl"], "qwen4_vl")
    with pytest.raises(ValueError, match="hidden_act"):
        QwenVisionTower({**CONFIGS["qwen2_vl"], "hidden_act": "relu6"}, "qwen2_vl")
    tower = QwenVisionTower(CONFIGS["qwen2_vl"], "qwen2_vl")
    with pytest.raises(ValueError, match="unexpected vision tower tensor 'blocks.9.norm1.weight'"):
        tower.load_weights([("blocks.9.norm1.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match="merger.mlp.2.weight"):
        tower.load_weights([("merger.mlp.2.weight", torch.zeros(48, 255))])
    with pytest.raises(ValueError, match="grid_thw"):
        tower(torch.zeros(4, 96), torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="spatial_merge_size"):
        tower(torch.zeros(6, 96), torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="needs"):
        tower(torch.zeros(5, 96), torch.tensor([[1, 2, 2]]))


def test_bf16_bit_exact_with_transformers() -> None:
    """Both built under default dtype bf16, as from_pretrained(dtype=torch.bfloat16) builds transformers' (whose
    rotary inv_freq stays fp32 then); our load casts the fp32 checkpoint to bf16."""
    ref32 = _reference("qwen2_5_vl")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**CONFIGS["qwen2_5_vl"])).eval()
        tower = QwenVisionTower(CONFIGS["qwen2_5_vl"], "qwen2_5_vl")
    finally:
        torch.set_default_dtype(default)
    ref.config._attn_implementation = "sdpa"
    ref.load_state_dict(ref32.state_dict())
    assert ref.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert tower.load_weights(ref32.state_dict().items()) == {n for n, _ in tower.named_parameters()}
    assert tower.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    grid = torch.tensor(GRID)
    pixels = torch.randn(int(grid.prod(-1).sum()), 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = tower(pixels, grid)
        expected = ref(pixels.to(torch.bfloat16), grid_thw=grid).pooler_output
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


# ---- image processor ----

def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    array = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(array, "RGBA").convert(mode)


# (width, height): ordinary ones; sides where round() goes to even (42 / 28 = 1.5 -> 56, 70 / 28 = 2.5 -> 56);
# tiny ones below min_pixels; long thin ones; big ones above max_pixels.
SIZES = [(50, 30), (42, 70), (98, 42), (300, 200), (641, 479), (5, 7), (20, 700), (1000, 13), (1200, 900)]
MODES = ["RGB", "RGBA", "L"]
PROCESSOR_KWARGS = {
    "defaults": {},
    "small max_pixels": dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
    "patch 4, temporal 3": dict(size={"shortest_edge": 10000, "longest_edge": 40000}, patch_size=4, merge_size=2,
                                temporal_patch_size=3),
    "no rescale, own mean": dict(do_rescale=False, image_mean=[100.0, 120.0, 90.0], image_std=[50.0, 60.0, 70.0],
                                 max_pixels=100000),
    "bilinear, no normalize": dict(resample=2, do_normalize=False, max_pixels=60000),
}


@pytest.mark.parametrize("name", sorted(PROCESSOR_KWARGS))
def test_processor_bit_exact_with_transformers(name: str, tmp_path) -> None:
    theirs = Qwen2VLImageProcessorPil(**PROCESSOR_KWARGS[name])
    theirs.save_pretrained(tmp_path)
    ours = QwenImageProcessor.from_config(json.loads((tmp_path / "preprocessor_config.json").read_text()))
    images = [_image(w, h, MODES[i % 3], i) for i, (w, h) in enumerate(SIZES)]
    expected = theirs(images, return_tensors="pt")
    pixels, grid = ours(images)
    assert torch.equal(grid, expected["image_grid_thw"]) and grid.dtype == torch.int64
    assert pixels.dtype == torch.float32 and torch.equal(pixels, expected["pixel_values"])
    assert ours.num_tokens(grid) == (grid.prod(-1) // ours.merge_size ** 2).tolist()
    assert sum(ours.num_tokens(grid)) * ours.merge_size ** 2 == len(pixels)


def test_processor_older_config_spellings(tmp_path) -> None:
    """min_pixels / max_pixels at the top level (Qwen2-VL's and Qwen2.5-VL's own preprocessor_config.json)
    override size, read by transformers from the same file."""
    config = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
              "min_pixels": 3136, "max_pixels": 20000, "size": {"shortest_edge": 1, "longest_edge": 2},
              "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    theirs = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    ours = QwenImageProcessor.from_folder(tmp_path)
    assert (ours.min_pixels, ours.max_pixels) == (3136, 20000)
    images = [_image(w, h, "RGB", i) for i, (w, h) in enumerate(SIZES)]
    pixels, grid = ours(images)
    expected = theirs(images, return_tensors="pt")
    assert torch.equal(grid, expected["image_grid_thw"]) and torch.equal(pixels, expected["pixel_values"])
    # A null field takes the class default here, as in streamer/multimodal/processors/image_processor.py (transformers 5.24 keeps
    # the None instead: a null do_rescale turns rescaling off there, a null image_mean fails).
    nulls = QwenImageProcessor.from_config({**config, "image_mean": None, "do_rescale": None, "min_pixels": None})
    assert nulls == QwenImageProcessor.from_config({**config, "min_pixels": 1})


def test_processor_without_resize() -> None:
    kwargs = dict(do_resize=False, patch_size=4, merge_size=2)
    theirs = Qwen2VLImageProcessorPil(**kwargs)
    ours = QwenImageProcessor.from_config({"image_processor_type": "Qwen2VLImageProcessorPil", **kwargs})
    images = [_image(16, 24, "RGB", 0), _image(40, 8, "RGBA", 1)]
    pixels, grid = ours(images)
    expected = theirs(images, return_tensors="pt")
    assert grid.tolist() == [[1, 6, 4], [1, 2, 10]]
    assert torch.equal(pixels, expected["pixel_values"])
    with pytest.raises(ValueError, match="multiples"):
        ours([_image(18, 24, "RGB", 2)])


def test_processor_defaults_match_transformers() -> None:
    theirs = Qwen2VLImageProcessorPil().to_dict()
    for key, value in QWEN_IMAGE_DEFAULTS.items():
        mine = tuple(value) if isinstance(value, (list, tuple)) else value
        got = tuple(theirs[key]) if isinstance(theirs[key], (list, tuple)) else theirs[key]
        assert got == mine, key


def test_smart_resize_matches_transformers() -> None:
    rng = np.random.default_rng(0)
    for h, w in rng.integers(1, 3000, (300, 2)).tolist():
        if max(h, w) / min(h, w) <= 200:
            assert smart_resize(h, w, 28, 3136, 1003520) == hf_smart_resize(h, w, 28, 3136, 1003520)
            assert smart_resize(h, w, 8, 1000, 30000) == hf_smart_resize(h, w, 8, 1000, 30000)


def test_processor_errors() -> None:
    ok = {"image_processor_type": "Qwen2VLImageProcessor"}
    with pytest.raises(ValueError, match="unsupported image processor"):
        QwenImageProcessor.from_config({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ValueError, match="unsupported image processor"):
        QwenImageProcessor.from_config({})
    with pytest.raises(ValueError, match="shortest_edge"):
        QwenImageProcessor.from_config({**ok, "size": {"height": 224, "width": 224}})
    with pytest.raises(ValueError, match="min_pixels"):
        QwenImageProcessor.from_config({**ok, "min_pixels": 5000, "max_pixels": 4000})
    with pytest.raises(ValueError, match="image_mean"):
        QwenImageProcessor.from_config({**ok, "image_mean": [0.5, 0.5]})
    processor = QwenImageProcessor.from_config(ok)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor([_image(1000, 4, "RGB", 0)])
    with pytest.raises(ValueError, match="no images"):
        processor([])
    no_rgb = QwenImageProcessor.from_config({**ok, "do_convert_rgb": False})
    with pytest.raises(ValueError, match="RGBA"):
        no_rgb([_image(56, 56, "RGBA", 0)])


def test_processor_feeds_the_tower() -> None:
    """The processor's layout is what the tower reads: the same patches through transformers' tower give the
    same tokens, one row per num_tokens."""
    processor = QwenImageProcessor.from_config({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4,
                                                "min_pixels": 256, "max_pixels": 4096})
    pixels, grid = processor([_image(60, 40, "RGB", 0), _image(33, 70, "L", 1)])
    ref = _reference("qwen2_5_vl")
    tower = QwenVisionTower(CONFIGS["qwen2_5_vl"], "qwen2_5_vl")
    tower.load_weights(ref.state_dict().items())
    with torch.no_grad():
        out = tower(pixels, grid)
        assert torch.equal(out, ref(pixels, grid_thw=grid).pooler_output)
    assert len(out) == sum(processor.num_tokens(grid))
