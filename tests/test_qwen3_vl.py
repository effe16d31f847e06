"""Qwen3-VL (Qwen3VLForConditionalGeneration): its vision tower (streamer/models/qwen_vision.py: learned position
embeddings resampled to each grid, DeepStack taps), interleaved M-RoPE (streamer/models/layers.py), DeepStack in the
text model (streamer/models/vlm.py Qwen3VLMixin) and its image processor settings, against transformers (a test
oracle only), then through the engine on a tiny checkpoint (tests/checkpoints.py make_qwen3_vl_checkpoint)."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import streamer.models.qwen_vision as qv
from streamer import LLM, SamplingParams
from streamer.models.qwen_vision import QWEN_VISION_DEFAULTS, ROPE_THETA, QwenVisionTower
from streamer.multimodal.processors.qwen_image_processor import QwenImageProcessor
from tests.parity import assert_outputs_match, logprob_gap, tokens_and_logprobs

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, Qwen3VLVisionModel

# A tiny tower: patch 4, merge 2, a 4x4 position table; DeepStack taps listed out of block order (transformers
# collects them in block order, each through the merger at its place in the list).
CONFIG = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=40, num_heads=4, patch_size=4,
              num_position_embeddings=16, deepstack_visual_indexes=[2, 0])
# Grids smaller and larger than the table, one the table's size, a 2-frame video.
GRID = [[1, 10, 14], [1, 12, 12], [1, 2, 2], [1, 16, 6], [1, 4, 4], [2, 6, 8]]


def _reference(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**CONFIG))
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for p in model.parameters():  # every weight random, norms' and the position table's too
            p.normal_(0.0, 0.3)
    return model.to(dtype).eval()


def _expected(ref: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = ref(pixels, grid_thw=grid)
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, QwenVisionTower, torch.Tensor, torch.Tensor]:
    ref = _reference()
    tower = QwenVisionTower(CONFIG, "qwen3_vl")
    assert tower.load_weights(ref.state_dict().items()) == {name for name, _ in tower.named_parameters()}
    grid = torch.tensor(GRID)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    return ref, tower, pixels, _expected(ref, pixels, grid)


@torch.no_grad()
def test_tower_bit_exact_with_transformers(pair) -> None:
    """The merged embeddings, then the DeepStack features (in block order), on each row: transformers' bits."""
    _, tower, pixels, expected = pair
    out = tower(pixels, torch.tensor(GRID))
    assert tower.num_deepstack == 2
    assert out.shape == (sum(t * h * w for t, h, w in GRID) // 4, 40 * 3)
    assert torch.equal(out, expected)


@torch.no_grad()
def test_tower_linear_patch_embed_and_images_alone(pair) -> None:
    _, tower, pixels, expected = pair
    tower.patch_embed.conv = False  # the GPU path: the Conv3d (with its bias) as a linear
    try:
        out = tower(pixels, torch.tensor(GRID))
    finally:
        tower.patch_embed.conv = None
    assert not torch.equal(out, expected) and torch.allclose(out, expected, rtol=1e-5, atol=1e-4)
    start, row = 0, 0
    for t, h, w in GRID:  # each image alone: the same rows (no attention across images)
        alone = tower(pixels[start:start + t * h * w], torch.tensor([[t, h, w]]))
        assert torch.allclose(alone, expected[row:row + len(alone)], rtol=1e-5, atol=1e-4)
        start, row = start + t * h * w, row + len(alone)


def test_tower_bf16_bit_exact_with_transformers() -> None:
    ref32 = _reference()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref = Qwen3VLVisionModel(Qwen3VLVisionConfig(**CONFIG)).eval()
        tower = QwenVisionTower(CONFIG, "qwen3_vl")
    finally:
        torch.set_default_dtype(default)
    ref.config._attn_implementation = "sdpa"
    ref.load_state_dict(ref32.state_dict())
    tower.load_weights(ref32.state_dict().items())
    assert tower.pos_embed.weight.dtype == torch.bfloat16
    grid = torch.tensor(GRID)
    pixels = torch.randn(int(grid.prod(-1).sum()), 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = tower(pixels, grid)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _expected(ref, pixels.to(torch.bfloat16), grid))


def _no_interpolation(self, grid, device):  # the table's rows by clamped index: no resampling
    idx, weights = _REAL_TAPS(self, grid, device)
    return idx[:, :1], torch.ones_like(weights[:, :1])


_REAL_TAPS = QwenVisionTower._position_taps
WRONG = {
    "no position embedding": lambda self, grid, device: (torch.zeros(sum(t * h * w for t, h, w in grid), 1,
                                                                      dtype=torch.int64),
                                                         torch.zeros(sum(t * h * w for t, h, w in grid), 1)),
    "nearest position": _no_interpolation,
}


@pytest.mark.parametrize("wrong", sorted(WRONG))
@torch.no_grad()
def test_wrong_position_embeddings_fail(pair, wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, tower, pixels, expected = pair
    monkeypatch.setattr(QwenVisionTower, "_position_taps", WRONG[wrong])
    assert not torch.allclose(tower(pixels, torch.tensor(GRID)), expected, rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_deepstack_mergers_in_list_order(pair) -> None:
    """Block 0's tap goes through merger 1 (its place in deepstack_visual_indexes [2, 0]) and comes first; the
    mergers swapped change only the DeepStack columns."""
    _, tower, pixels, expected = pair
    mergers = tower.deepstack_merger_list
    tower.deepstack_merger_list = torch.nn.ModuleList(list(mergers)[::-1])
    try:
        out = tower(pixels, torch.tensor(GRID))
    finally:
        tower.deepstack_merger_list = mergers
    assert torch.equal(out[:, :40], expected[:, :40])
    assert not torch.allclose(out[:, 40:], expected[:, 40:], rtol=1e-3, atol=1e-3)


def test_vision_config_defaults_match_transformers() -> None:
    theirs = Qwen3VLVisionConfig().to_dict()
    for key, value in QWEN_VISION_DEFAULTS["qwen3_vl"].items():
        assert (tuple(theirs[key]) == value) if isinstance(value, tuple) else theirs[key] == value, key
    assert theirs["rope_parameters"] == {"rope_theta": ROPE_THETA, "rope_type": "axial"}
    spec = qv.QwenVisionSpec.from_config({}, "qwen3_vl")
    assert (spec.width, spec.out_hidden, spec.mlp_hidden, spec.patch_size, spec.deepstack, spec.fullatt_blocks) == \
        (1152, 3584, 4304, 16, (8, 16, 24), frozenset())
    # An index past the last block (transformers' default (8, 16, 24) on a shallow tower) has a merger, never used
    config = {**CONFIG, "deepstack_visual_indexes": [5, 1]}
    torch.manual_seed(3)
    ref = Qwen3VLVisionModel(Qwen3VLVisionConfig(**config)).eval()
    ref.config._attn_implementation = "sdpa"
    tower = QwenVisionTower(config, "qwen3_vl")
    tower.load_weights(ref.state_dict().items())
    assert len(tower.deepstack_merger_list) == 2 and tower.num_deepstack == 1
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, 96, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(tower(pixels, grid), _expected(ref, pixels, grid))
    with pytest.raises(ValueError, match="square"):
        QwenVisionTower({**CONFIG, "num_position_embeddings": 15}, "qwen3_vl")


# ---- interleaved M-RoPE ----

def test_interleaved_mrope_matches_transformers() -> None:
    """Each frequency's angle from the row transformers' Qwen3VLTextRotaryEmbedding takes it from (t, h, w
    interleaved); the plain sectioned layout (Qwen2-VL's) is different."""
    from streamer.models.layers import RotaryEmbedding
    section, head_dim = [24, 20, 20], 128
    config = Qwen3VLTextConfig(head_dim=head_dim, hidden_size=512, num_attention_heads=4,
                               rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": section,
                                                "mrope_interleaved": True})
    theirs = Qwen3VLTextRotaryEmbedding(config)
    positions = torch.from_numpy(np.random.default_rng(0).integers(0, 400, (3, 50)))
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None])  # [1, T, head_dim]
    ours = RotaryEmbedding(head_dim, 512, 5e6, None)
    ours.use_mrope(section, interleaved=True)
    c, s = ours._mrope_cos_sin(positions)  # [T, head_dim / 2]
    assert torch.allclose(c, cos[0, :, :head_dim // 2], atol=1e-6) and torch.allclose(s, sin[0, :, :head_dim // 2],
                                                                                         atol=1e-6)
    ours.use_mrope(section)
    assert not torch.allclose(ours._mrope_cos_sin(positions)[0], cos[0, :, :head_dim // 2], atol=1e-3)


# ---- image processor: Qwen2-VL's class with Qwen3-VL's settings ----

# Qwen/Qwen3-VL-*'s preprocessor_config.json settings: 16-pixel patches (32 x 32 pixels a token), mean / std 0.5,
# 256^2 to 4096^2 pixels.
QWEN3_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                   "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "size": {"longest_edge": 16777216, "shortest_edge": 65536}}


def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    array = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(array, "RGBA").convert(mode)


def test_processor_with_qwen3_settings_bit_exact(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_PROCESSOR))
    theirs = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    ours = QwenImageProcessor.from_folder(tmp_path)
    assert (ours.patch_size, ours.factor, ours.min_pixels, ours.image_mean) == (16, 32, 65536, (0.5, 0.5, 0.5))
    images = [_image(w, h, ("RGB", "RGBA", "L")[i % 3], i) for i, (w, h) in
              enumerate([(50, 30), (300, 200), (641, 479), (20, 700), (520, 260)])]
    pixels, grid = ours(images)
    expected = theirs(images, return_tensors="pt")
    assert torch.equal(grid, expected["image_grid_thw"]) and torch.equal(pixels, expected["pixel_values"])
    assert pixels.shape[1] == 3 * 2 * 16 * 16
    assert all(h * 16 * w * 16 >= 65536 for _, h, w in grid.tolist())  # small images scaled up to min_pixels


# ---- the whole model through the engine ----

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
          "<|im_start|>assistant\n")
TWO = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|>"
       "<|vision_end|>Which?<|im_end|>\n<|im_start|>assistant\n")
# (the tiny model picks no end-of-text token within 5 tokens here: transformers' min_new_tokens forbids it)
TEXT = "<|im_start|>user\nno picture today<|im_end|>\n<|im_start|>assistant\n"
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)  # (transformers: min_new_tokens)


@pytest.fixture(scope="module")
def qwen3_vl_dir(ckpt_root: Path) -> Path:
    from tests.checkpoints import make_qwen3_vl_checkpoint
    path = ckpt_root / "qwen3_vl"
    if not (path / "config.json").exists():
        make_qwen3_vl_checkpoint(path)
    return path


def _sized(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _run_case(path: Path) -> tuple[LLM, list[dict], list, list]:
    """Prompts with one image (two sizes), two images of different sizes, and none, in one batch: the engine's
    outputs, and transformers' greedy tokens and logprobs for them."""
    from tests.checkpoints import hf_qwen_vl_greedy
    ims = _sized([(30, 48), (40, 40), (20, 64)], seed=12)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims[:2]]
    prompts.append({"prompt": TWO, "multi_modal_data": {"image": [ims[2], ims[0]]}})
    prompts.append({"prompt": TEXT})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, PARAMS)
    assert len({len(o.prompt_token_ids) for o in outs[:2]}) == 2  # two image sizes, two token counts
    want = hf_qwen_vl_greedy(path, [(o.prompt_token_ids, [im]) for o, im in zip(outs, ims[:2])]
                             + [(outs[2].prompt_token_ids, [ims[2], ims[0]]), (outs[3].prompt_token_ids, [])], 5)
    return llm, prompts, outs, want


@pytest.fixture(scope="module")
def case(qwen3_vl_dir: Path):
    return _run_case(qwen3_vl_dir)[1:]


def test_qwen3_vl_equals_transformers(qwen3_vl_dir: Path, case) -> None:
    """Tokens and logprobs equal transformers', whole, chunked (max_num_batched_tokens 8: chunks split images, each
    reading its rows of the DeepStack features too) and from the prefix cache."""
    prompts, outs, want = case
    assert_outputs_match(tokens_and_logprobs(outs), want)
    chunked = LLM(str(qwen3_vl_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, block_size=4)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    assert chunked.engine.runner.encoder_cache.num_encoded == 3  # three distinct images, each encoded once
    again = chunked.generate(prompts[2:3], PARAMS)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[2:3])
    kv = chunked.engine.kv
    kv.check_consistency()
    assert kv.pool.num_free == kv.num_blocks


def test_without_deepstack_or_interleaving_it_differs(qwen3_vl_dir: Path, case, monkeypatch) -> None:
    """The checks above can fail: the same engine without the DeepStack additions, or with Qwen2-VL's sectioned
    M-RoPE, is measurably off transformers (well past the tolerance), while text-only prompts stay equal."""
    from streamer.models import vlm
    prompts, _, want = case
    real = vlm.Qwen3VLMixin.place_image_features

    def no_deepstack(self, embeds, idx, feats):
        real(self, embeds, idx, feats)
        return {}
    with monkeypatch.context() as m:
        m.setattr(vlm.Qwen3VLMixin, "place_image_features", no_deepstack)
        off = tokens_and_logprobs(LLM(str(qwen3_vl_dir), dtype="float32", num_kv_blocks=64).generate(prompts, PARAMS))
    assert logprob_gap(off[:3], want[:3]) > 1e-2, logprob_gap(off[:3], want[:3])  # (0.16 here)
    assert_outputs_match(off[3:], want[3:])
    from streamer.models.layers import RotaryEmbedding
    plain = RotaryEmbedding.use_mrope
    monkeypatch.setattr(RotaryEmbedding, "use_mrope", lambda self, section, interleaved=False: plain(self, section))
    off = tokens_and_logprobs(LLM(str(qwen3_vl_dir), dtype="float32", num_kv_blocks=64).generate(prompts, PARAMS))
    assert logprob_gap(off[:3], want[:3]) > 1e-2, logprob_gap(off[:3], want[:3])  # (0.15 here)


def test_qwen3_vl_moe_equals_transformers(ckpt_root: Path) -> None:
    """Qwen3-VL-MoE: the same over a Qwen3-MoE text model (experts stacked per layer in the checkpoint, the router
    always renormalising); the original release's transposed expert tensors read the same."""
    from tests.checkpoints import make_qwen3_vl_checkpoint
    path = make_qwen3_vl_checkpoint(ckpt_root / "qwen3_vl_moe", moe=True)
    llm, _, outs, want = _run_case(path)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    model = llm.engine.runner.model
    assert llm.engine.model_config.architecture == "Qwen3MoeForCausalLM"
    assert type(model.layers[0].mlp).__name__ == "SparseMoE" and model.layers[0].mlp.norm_topk_prob
    stacked = [("model.language_model.layers.0.mlp.experts.gate_up_proj", torch.randn(4, 48, 64)),
               ("model.language_model.layers.0.mlp.experts.down_proj", torch.randn(4, 64, 24))]
    ours = list(model.rename_weights(iter(stacked)))
    original = list(model.rename_weights((n, t.transpose(1, 2)) for n, t in stacked))
    assert [n for n, _ in ours] == [n for n, _ in original] and len(ours) == 4 * 3
    assert ours[0][0] == "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, original))
    assert torch.equal(ours[1][1], stacked[0][1][0, 24:])  # expert 0's up_proj: the second half
    with pytest.raises(ValueError, match="expected"):
        list(model.rename_weights(iter([(stacked[1][0], torch.zeros(4, 64, 25))])))


def _data_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_and_server_take_images(qwen3_vl_dir: Path) -> None:
    """LLM.chat renders the image through the template as a direct prompt does; the OpenAI server takes it as a
    base64 data URL and answers the same."""
    import openai

    from tests.server_utils import LiveServer
    llm = LLM(str(qwen3_vl_dir), dtype="float32", num_kv_blocks=64)
    im = _sized([(36, 52)], seed=13)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    conversation = [{"role": "user", "content": [{"type": "image_pil", "image_pil": im},
                                                 {"type": "text", "text": "What is it?"}]}]
    chat = llm.chat(conversation, greedy)
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(PROMPT, add_special_tokens=False),
                           "multi_modal_data": {"image": im}}, greedy)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    with LiveServer(qwen3_vl_dir, allow_image_urls=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        r = client.chat.completions.create(model=server.model_name, max_tokens=8, temperature=0.0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(im)}},
                                         {"type": "text", "text": "What is it?"}]}])
    assert r.choices[0].message.content == chat[0].outputs[0].text
    assert r.usage.prompt_tokens == len(chat[0].prompt_token_ids)


# Qwen/Qwen3-VL-4B-Instruct's config.json, as published (transformers 4.57 spelling).
QWEN3_VL_4B_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
        "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                                "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": True, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}


def test_a_real_qwen3_vl_config_reads() -> None:
    from streamer.models.config import ModelConfig
    cfg = ModelConfig.from_dict(QWEN3_VL_4B_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.rope_theta, cfg.rope_scaling, cfg.mrope_section, cfg.tie_word_embeddings, cfg.qk_norm,
            cfg.attention_bias, cfg.torch_dtype) == \
        ("Qwen3ForCausalLM", 2560, 36, 32, 8, 128, 5e6, None, [24, 20, 20], True, True, False, "bfloat16")
    assert cfg.image_token_id == 151655 and cfg.multimodal_architecture == "Qwen3VLForConditionalGeneration"
    with torch.device("meta"):
        tower = QwenVisionTower(QWEN3_VL_4B_CONFIG["vision_config"], "qwen3_vl")
    assert (tower.spec.width, tower.spec.out_hidden, tower.spec.depth, tower.spec.patch_size, tower.num_deepstack,
            tower.pos_embed.weight.shape) == (1024, 2560, 24, 16, 3, (2304, 1024))
