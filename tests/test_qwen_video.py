"""Video input for Qwen2-VL and Qwen2.5-VL: the video processor (streamer/multimodal/processors/qwen_video_processor.py) against a direct
numpy transcription of transformers' Qwen2VLVideoProcessor reshaping (its torchvision resize cannot run here), the
M-RoPE positions against transformers' get_rope_index, greedy tokens and logprobs against transformers' models fed
the same pixel_values_videos / video_grid_thw / second_per_grid_ts (whole, chunked, from the prefix cache, beside
an image), and the server's video_url parts (decoded with PyAV) through the real openai client."""
from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamer import LLM, SamplingParams
from streamer.multimodal.processors.qwen_video_processor import (
    QWEN_VIDEO_DEFAULTS,
    QwenVideoProcessor,
    read_video_processor_config,
)
from tests.parity import assert_outputs_match, logprob_gap, tokens_and_logprobs

transformers = pytest.importorskip("transformers")

# A Qwen2-VL-style template that also writes videos ({"type": "video"} parts)
QWEN_VL_VIDEO_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif content['type'] == 'video' %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VIDEO_CONFIG = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 8 * 8, "longest_edge": 48 * 48}}
TOKENS_PER_SECOND = 2


def make_qwen_vl_video_checkpoint(out_dir: Path, version: str, seed: int = 0) -> Path:
    """tests/checkpoints.py's tiny Qwen2-VL / Qwen2.5-VL with a <|video_pad|> token (the config's video_token_id),
    a template writing videos, a video processor config (4-pixel patches) and Qwen2.5-VL's tokens_per_second 2."""
    import transformers as tf

    from tests.checkpoints import _vlm_tokenizer
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                                   "<|im_start|>", "<|im_end|>"], QWEN_VL_VIDEO_TEMPLATE)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=ids["vocab_size"], max_position_embeddings=512,
                rms_norm_eps=1e-6, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    if version == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=4, mlp_ratio=2)
        cls, cfg_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4,
                      window_size=16, fullatt_block_indexes=[1], tokens_per_second=TOKENS_PER_SECOND)
        cls, cfg_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(out_dir)
    tf.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48}).save_pretrained(out_dir)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    return out_dir


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def video_dir(request, ckpt_root: Path) -> Path:
    path = ckpt_root / f"{request.param}_video"
    if not (path / "config.json").exists():
        make_qwen_vl_video_checkpoint(path, request.param)
    return path


def frames(n: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, 3), dtype=np.uint8)


def pil(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


VIDEO_PROMPT = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens in it?<|im_end|>\n"
                "<|im_start|>assistant\n")
MIXED_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|video_pad|>"
                "<|vision_end|>or<|vision_start|><|video_pad|><|vision_end|>Which?<|im_end|>\n"
                "<|im_start|>assistant\n")


def _hf_greedy(model_dir: Path, llm: LLM, prompts: list[dict], outs, max_new_tokens: int):
    """transformers' greedy tokens and logprobs of each prompt (as streamer expanded it), given the pixels streamer's
    processors made: pixel_values(_videos), image/video_grid_thw, second_per_grid_ts, mm_token_type_ids."""
    import transformers as tf

    from tests.checkpoints import _hf_greedy_with_logprobs
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(tf, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    mm = llm.engine.image_prompts
    items = []
    for prompt, out in zip(prompts, outs):
        ids = out.prompt_token_ids
        _, _, inputs = llm.engine.process_prompt(prompt)
        kw: dict = {}
        ims = [im for im in inputs if not im.video]
        vids = [im for im in inputs if im.video]
        if ims:
            kw["pixel_values"] = torch.cat([im.pixel_values for im in ims])
            kw["image_grid_thw"] = torch.tensor([im.grid for im in ims])
        if vids:
            kw["pixel_values_videos"] = torch.cat([im.pixel_values for im in vids])
            kw["video_grid_thw"] = torch.tensor([im.grid for im in vids])
            if arch.startswith("Qwen2_5"):
                data = prompt["multi_modal_data"]["video"]
                data = data if isinstance(data, list) else [data]
                _, _, seconds = mm.video_processor([d[0] if isinstance(d, tuple) else d for d in data],
                                                   [d[1]["fps"] if isinstance(d, tuple) else None for d in data])
                kw["second_per_grid_ts"] = torch.tensor(seconds)
        t = torch.tensor([ids])
        kw["mm_token_type_ids"] = ((t == cfg.image_token_id).int() + 2 * (t == cfg.video_token_id).int())
        items.append((ids, kw))
    return _hf_greedy_with_logprobs(model, items, max_new_tokens, lambda t, kw: kw)


def _prompts() -> list[dict]:
    # 5 frames -> padded to 6 -> 3 temporal steps of 4x5 merged tokens (32x40 pixels): 60 video tokens. Qwen2.5-VL:
    # no fps given -> 2 fps -> second_per_grid 1 -> temporal steps 0, 2, 4; the second video at 4 fps -> 0, 1, 2
    # (both within the spatial extent, where transformers 5's text positions after a video agree with the original)
    a, b = frames(5, 32, 40, 1), frames(4, 24, 24, 2)
    return [
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": a}},
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [list(map(Image.fromarray, b))]}},
        {"prompt": MIXED_PROMPT, "multi_modal_data": {"image": pil(30, 48, 3), "video": [(a, {"fps": 4.0}), b]}},
    ]


PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)


def test_video_equals_transformers(video_dir: Path, monkeypatch) -> None:
    """A video, another as PIL frames, and a video beside an image and another video: tokens and logprobs equal
    transformers', whole, chunked (chunks of 8 tokens split the videos) and from the prefix cache; with the temporal
    positions wrong (no temporal step), they do not."""
    prompts = _prompts()
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=96)
    outs = llm.generate(prompts, PARAMS)
    inputs = llm.engine.process_prompt(prompts[0])[2]
    assert len(inputs) == 1 and inputs[0].video and inputs[0].grid == (3, 8, 10) and inputs[0].length == 60
    want = _hf_greedy(video_dir, llm, prompts, outs, 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    chunked = LLM(str(video_dir), dtype="float32", num_kv_blocks=96, max_num_batched_tokens=8, block_size=4)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    again = chunked.generate(prompts[2:3], PARAMS)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[2:3])
    other = chunked.generate([{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(5, 32, 40, 7)}}], PARAMS)
    assert other[0].num_cached_tokens <= 8  # another video: nothing cached from the video on
    kv = chunked.engine.kv
    kv.check_consistency()
    assert kv.pool.num_free == kv.num_blocks
    import streamer.multimodal.inputs as mm
    real = mm._place_mrope

    def flat_time(inputs, merge):  # every temporal step at 0: the frames in time lose their order
        for im in inputs:
            im.time_interval = 0.0
        real(inputs, merge)
    monkeypatch.setattr(mm, "_place_mrope", flat_time)
    off = tokens_and_logprobs(LLM(str(video_dir), dtype="float32", num_kv_blocks=96).generate(prompts, PARAMS))
    assert logprob_gap(off, want) > 5e-4


def test_qwen2_5_temporal_step_matters(ckpt_root: Path, monkeypatch) -> None:
    """Qwen2.5-VL's videos step tokens_per_second * second_per_grid_t per temporal grid step: Qwen2-VL's step of 1
    there is measurably off transformers (so the test above checks the scaling)."""
    path = ckpt_root / "qwen2_5_vl_video"
    if not (path / "config.json").exists():
        make_qwen_vl_video_checkpoint(path, "qwen2_5_vl")
    prompts = _prompts()[:1]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=96)
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.process_prompt(prompts[0])[2][0].time_interval == 2.0
    want = _hf_greedy(path, llm, prompts, outs, 5)
    assert_outputs_match(tokens_and_logprobs(outs), want)
    monkeypatch.setattr(llm.engine.image_prompts, "tokens_per_second", None)  # Qwen2-VL's step
    assert logprob_gap(tokens_and_logprobs(llm.generate(prompts, PARAMS)), want) > 5e-4


# ---------------------------------------------------------------------------------------------- the processor
def _transformers_method(name: str):
    """A function of transformers' video_processing_qwen2_vl.py (a Qwen2VLVideoProcessor method, or a module
    function), compiled from its source alone: the module imports torchvision, which cannot be installed here, but
    these functions need only torch and math."""
    import ast
    import inspect

    import transformers.models.qwen2_vl as pkg
    path = Path(inspect.getfile(pkg)).parent / "video_processing_qwen2_vl.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.decorator_list = []
            module = ast.Module(body=[node], type_ignores=[])
            namespace: dict = {"torch": torch, "math": math, "SizeDict": dict, "VideoMetadata": object}
            exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)
            return namespace[name]
    raise LookupError(name)


def _transformers_defaults() -> dict:
    """Qwen2VLVideoProcessor's class attributes, read from its source."""
    import ast
    import inspect

    import transformers.models.qwen2_vl as pkg
    tree = ast.parse((Path(inspect.getfile(pkg)).parent / "video_processing_qwen2_vl.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:  # (constants and arithmetic on them; names stay as their source text)
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<attr>", "eval"),
                                               {"__builtins__": {}})
            except NameError:
                out[node.targets[0].id] = ast.unparse(node.value)
    return out


def test_defaults_match_transformers() -> None:
    theirs = _transformers_defaults()
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "patch_size", "temporal_patch_size",
                "merge_size", "min_frames", "max_frames", "do_sample_frames", "max_video_tokens"):
        assert theirs[key] == QWEN_VIDEO_DEFAULTS[key], key
    assert theirs["size"] == {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768} == \
        QWEN_VIDEO_DEFAULTS["size"]
    assert theirs["resample"] == "PILImageResampling.BICUBIC" and QWEN_VIDEO_DEFAULTS["resample"] == 3
    assert theirs["image_mean"] == "OPENAI_CLIP_MEAN" and theirs["image_std"] == "OPENAI_CLIP_STD"


@pytest.mark.parametrize("n, tp, merge, patch", [(4, 2, 2, 4), (5, 2, 2, 4), (1, 2, 2, 4), (7, 3, 2, 2),
                                                  (3, 2, 1, 4)])
def test_patches_are_transformers_patchify(n: int, tp: int, merge: int, patch: int) -> None:
    """Frame padding (the last frame repeated) and the (grid_t, merge blocks, C, T, P, P) layout: transformers'
    own patchify (its source, run on torch) on the frames our processor resized and normalized."""
    processor = QwenVideoProcessor.from_config({"patch_size": patch, "merge_size": merge, "temporal_patch_size": tp,
                                                "min_pixels": 64, "max_pixels": 40 * 40})
    video = frames(n, 37, 29, seed=n)
    pixels, grid, seconds = processor([video])
    h, w = processor.output_size(37, 29, n)
    assert (h % (patch * merge), w % (patch * merge)) == (0, 0)
    resized = processor._resize(video)
    assert resized.shape == (n, h, w, 3)
    normalized = np.stack([processor._table[c][resized[..., c]] for c in range(3)], axis=1)  # [T, C, H, W]
    patchify = _transformers_method("patchify")
    expected, gt, gh, gw = patchify(None, torch.from_numpy(normalized)[None], patch, merge, tp)
    assert grid.tolist() == [[gt, gh, gw]] == [[-(-n // tp), h // patch, w // patch]]
    assert torch.equal(pixels, expected[0])
    assert seconds == [tp / 2.0]  # no fps given: 2 frames a second assumed
    # the padding repeats the last frame: the last temporal slot of the last step is the last frame
    last = pixels.view(gt, gh * gw, 3, tp, patch * patch)[-1]
    if n % tp:
        assert torch.equal(last[:, :, -1], last[:, :, n % tp - 1])


def test_numpy_transcription_of_the_layout() -> None:
    """The same layout, written out in numpy from transformers' view / permute (independently of its source)."""
    processor = QwenVideoProcessor.from_config({"patch_size": 2, "merge_size": 2, "temporal_patch_size": 2,
                                                "do_resize": False, "do_normalize": False, "do_rescale": False})
    video = frames(3, 8, 12, seed=5)
    pixels, grid, _ = processor([video])
    x = np.concatenate([video, video[-1:]]).astype(np.float32).transpose(0, 3, 1, 2)  # [T, C, H, W]
    x = x.reshape(1, 2, 2, 3, 2, 2, 2, 3, 2, 2).transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(48, 24)
    assert grid.tolist() == [[2, 4, 6]] and np.array_equal(pixels.numpy(), x)
    # row 0: temporal step 0, the first merge block's first patch; its values run (C, T, P, P)
    assert np.array_equal(pixels[0].view(3, 2, 2, 2).numpy(), video[:2, :2, :2].transpose(3, 0, 1, 2))


def test_resize_is_pil_bicubic_at_smart_resize() -> None:
    from streamer.multimodal.processors.qwen_image_processor import smart_resize
    processor = QwenVideoProcessor.from_config(VIDEO_CONFIG)
    video = frames(2, 50, 70, seed=3)
    h, w = smart_resize(50, 70, 8, 64, 48 * 48)
    resized = processor._resize(video)
    assert resized.shape == (2, h, w, 3)
    assert np.array_equal(resized[1], np.asarray(Image.fromarray(video[1]).resize((w, h), Image.BICUBIC)))
    # cap_pixels_per_frame: each frame's share of max_video_tokens' pixels (transformers' formula)
    capped = QwenVideoProcessor.from_config({**VIDEO_CONFIG, "cap_pixels_per_frame": True, "max_video_tokens": 20})
    total = int(20 * 8 * 8 * 0.9)
    assert capped.output_size(200, 200, 8) == smart_resize(200, 200, 8, 64, max(min(48 * 48, total * 2 // 8),
                                                                                int(64 * 1.05)))


@pytest.mark.parametrize("total, video_fps, fps, num_frames", [
    (100, 30.0, 2.0, None), (30, 10.0, 2.0, None), (7, 30.0, 2.0, None), (2000, 24.0, 1.0, None),
    (50, 25.0, None, 8), (50, 25.0, None, 7), (9, 3.0, 4.0, None)])
def test_sampling_is_transformers_sample_frames(total: int, video_fps: float, fps, num_frames) -> None:
    from types import SimpleNamespace
    processor = QwenVideoProcessor.from_config({**VIDEO_CONFIG, "max_frames": 64})
    theirs = _transformers_method("sample_frames")
    me = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=64)
    meta = SimpleNamespace(total_num_frames=total, fps=video_fps)
    try:
        expected = theirs(me, meta, num_frames=num_frames, fps=fps).numpy()
    except ValueError:
        with pytest.raises(ValueError):
            processor.sample_indices(total, video_fps, fps, num_frames)
        return
    assert processor.sample_indices(total, video_fps, fps, num_frames).tolist() == expected.tolist()


def test_sampling_in_the_processor_and_second_per_grid() -> None:
    processor = QwenVideoProcessor.from_config({**VIDEO_CONFIG, "do_sample_frames": True, "fps": 2.0})
    video = frames(30, 16, 16, seed=1)  # 3 s at 10 fps -> 6 frames at 2 fps
    _, grid, seconds = processor([video, video, video], [10.0, None, 10.0], [None, None, False])
    assert grid[:, 0].tolist() == [3, 15, 15]  # sampled; unknown fps: taken as is; sampled already: as is
    assert seconds == pytest.approx([2 / 2.0, 2 / 2.0, 2 / 10.0])
    with pytest.raises(ValueError, match="mutually exclusive"):
        QwenVideoProcessor.from_config({**VIDEO_CONFIG, "fps": 2.0, "num_frames": 8})


def test_config_files_as_transformers_reads_them(tmp_path: Path) -> None:
    """processor_config.json's video_processor, else video_preprocessor_config.json, else preprocessor_config.json
    (whose min/max pixels then size video frames); min_pixels / max_pixels override size."""
    assert read_video_processor_config(tmp_path) == {}
    assert QwenVideoProcessor.from_folder(tmp_path) == QwenVideoProcessor.from_config({})
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056}))
    assert (QwenVideoProcessor.from_folder(tmp_path).min_pixels,
            QwenVideoProcessor.from_folder(tmp_path).max_pixels) == (3136, 12845056)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    assert QwenVideoProcessor.from_folder(tmp_path).max_pixels == 48 * 48
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {**VIDEO_CONFIG,
                                                                                    "max_pixels": 32 * 32}}))
    got = QwenVideoProcessor.from_folder(tmp_path)
    assert (got.min_pixels, got.max_pixels, got.patch_size) == (64, 32 * 32, 4)
    with pytest.raises(ValueError, match="min_pixels"):
        QwenVideoProcessor.from_config({"min_pixels": 5000, "max_pixels": 4000})


def test_bad_frames_are_clear_errors() -> None:
    processor = QwenVideoProcessor.from_config(VIDEO_CONFIG)
    with pytest.raises(ValueError, match="uint8"):
        processor([np.zeros((2, 16, 16, 3), dtype=np.float32)])
    with pytest.raises(ValueError, match="shape"):
        processor([np.zeros((16, 16), dtype=np.uint8)])
    with pytest.raises(ValueError, match="differ in size"):
        processor([[pil(16, 16, 0), pil(8, 16, 1)]])
    with pytest.raises(ValueError, match="no videos"):
        processor([])
    # grey frames and RGBA frames become RGB
    _, grid, _ = processor([np.zeros((2, 16, 16), dtype=np.uint8), np.zeros((2, 16, 16, 4), dtype=np.uint8)])
    assert grid.tolist() == [[1, 4, 4]] * 2


# ---------------------------------------------------------------------------------------------- M-RoPE
def _positions(ids: list[int], inputs) -> np.ndarray:
    """[3, len(ids)]: each prompt token's M-RoPE position as streamer computes it."""
    from types import SimpleNamespace

    from streamer.multimodal.inputs import rope_shifts
    pos = np.arange(len(ids))
    out = np.repeat((pos + rope_shifts(SimpleNamespace(images=list(inputs)), pos))[None], 3, axis=0)
    for im in inputs:
        out[:, im.offset:im.end] = im.mrope
    return out


def test_mrope_positions_equal_get_rope_index(video_dir: Path) -> None:
    """The prompt positions of images and videos (Qwen2.5-VL's scaled temporal steps included) equal transformers'
    get_rope_index where its text-after-video rule agrees with the original one; where a video's temporal extent
    passes its spatial one, the text after it continues past the largest position (transformers 4 / vLLM), which
    transformers 5 keeps for its decode steps only."""
    import transformers as tf
    arch = json.loads((video_dir / "config.json").read_text())["architectures"][0]
    cfg = getattr(tf, arch.replace("ForConditionalGeneration", "Config")).from_pretrained(video_dir)
    with torch.device("meta"):
        model = getattr(tf, arch)(cfg).model
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=96)
    for prompt in _prompts():
        _, ids, inputs = llm.engine.process_prompt(prompt)
        t = torch.tensor([ids])
        kw = {"mm_token_type_ids": (t == cfg.image_token_id).int() + 2 * (t == cfg.video_token_id).int()}
        ims, vids = [im for im in inputs if not im.video], [im for im in inputs if im.video]
        if ims:
            kw["image_grid_thw"] = torch.tensor([im.grid for im in ims])
        if vids:
            kw["video_grid_thw"] = torch.tensor([im.grid for im in vids])
            kw["second_per_grid_ts"] = torch.tensor([im.time_interval / TOKENS_PER_SECOND for im in vids])
        want, delta = model.get_rope_index(t, **kw)
        got = _positions(ids, inputs)
        assert np.array_equal(got, want[:, 0].numpy())
        assert got.max() + 1 - len(ids) == int(delta)  # the decode steps' shift
    # a long video (8 temporal steps over 2 x 2 tokens): the text after it starts past its last temporal step
    prompt = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(16, 16, 16, 4)}}
    _, ids, inputs = llm.engine.process_prompt(prompt)
    got = _positions(ids, inputs)
    (im,) = inputs
    assert got[:, im.end].tolist() == [int(im.mrope.max()) + 1] * 3 and im.mrope[0].max() > im.mrope[1:].max()


# ---------------------------------------------------------------------------------------------- errors
def test_models_without_video_refuse_it(ckpt_root: Path, video_dir: Path) -> None:
    from tests.checkpoints import make_qwen_vl_checkpoint
    path = ckpt_root / "qwen2_vl_no_video_token"
    if not (path / "config.json").exists():
        make_qwen_vl_checkpoint(path, "qwen2_vl")  # (its tokenizer has no <|video_pad|>)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"multi_modal_data\['video'\].*video token id"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"video": frames(2, 16, 16, 0)}}, PARAMS)
    with pytest.raises(ValueError, match="takes no video"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"}},
                                               {"type": "text", "text": "hi"}]}], PARAMS)
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=96)
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\).*but 2 video"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [frames(2, 16, 16, 0)] * 2}}, PARAMS)
    with pytest.raises(ValueError, match=r"multi_modal_data\['video'\] must be"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": "clip.mp4"}}, PARAMS)
    with pytest.raises(ValueError, match="fps must be a positive number"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": (frames(2, 16, 16, 0), {"fps": 0})}},
                     PARAMS)
    with pytest.raises(ValueError, match="would take 720 tokens, more than the model's context"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(40, 48, 48, 0)}}, PARAMS)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(2, 16, 16, 0)}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=10))


def test_text_models_refuse_video(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="takes no video"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"video": frames(2, 16, 16, 0)}}, PARAMS)


# ---------------------------------------------------------------------------------------------- decoding, server
def encode_video(n: int, width: int, height: int, rate: int = 10, seed: int = 0) -> bytes:
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(n):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def test_decode_video_samples_and_limits(monkeypatch) -> None:
    import streamer.multimodal.inputs as mm
    clip = encode_video(20, 32, 24)  # 2 s at 10 fps
    video = mm.load_video(data_url(clip), fps=2.0)
    assert video.frames.shape == (4, 24, 32, 3) and video.frames.dtype == np.uint8
    assert video.fps == 2.0 and video.sample is False
    few = mm.decode_video(clip, 2.0, max_frames=3)  # spread over the whole video: 1.5 frames a second
    assert few.frames.shape[0] == 3 and few.fps == pytest.approx(1.5)
    with pytest.raises(ValueError, match="not a readable video"):
        mm.decode_video(b"\x00\x01not a video" * 50)
    with pytest.raises(ValueError, match="not a readable video"):
        mm.decode_video(clip[: len(clip) // 3])
    with pytest.raises(ValueError, match="base64"):
        mm.load_video("data:video/mp4;base64,@@@")
    with pytest.raises(ValueError, match="does not fetch"):
        mm.load_video("http://example.invalid/a.mp4", mm.FetchPolicy(allow_remote=False))
    monkeypatch.setattr(mm, "MAX_VIDEO_DECODED_FRAMES", 5)
    with pytest.raises(ValueError, match="too long"):
        mm.decode_video(clip, 100.0, 64)
    monkeypatch.setattr(mm, "MAX_VIDEO_FRAME_PIXELS", 100)
    with pytest.raises(ValueError, match="larger than 100 pixels"):
        mm.decode_video(clip)
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    with pytest.raises(mm.VideoBackendMissing, match="pip install av"):
        mm.decode_video(clip)


def test_server_takes_video_urls(ckpt_root: Path, monkeypatch) -> None:
    """The real openai client sends a generated mp4 as a data: URL: the answer is the offline engine's for the
    same decoded frames; a bad video, a model-less feature (no PyAV) are 400s and the server keeps serving."""
    openai = pytest.importorskip("openai")
    import streamer.multimodal.inputs as mm
    from tests.server_utils import LiveServer
    path = ckpt_root / "qwen2_5_vl_video"
    if not (path / "config.json").exists():
        make_qwen_vl_video_checkpoint(path, "qwen2_5_vl")
    clip = encode_video(12, 40, 32, rate=8, seed=3)  # 1.5 s at 8 fps -> 3 frames at 2 fps
    content = [{"type": "video_url", "video_url": {"url": data_url(clip)}}, {"type": "text", "text": "What?"}]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=96)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    chat = llm.chat([{"role": "user", "content": content}], greedy)
    video = mm.decode_video(clip, 2.0)
    assert video.frames.shape[0] == 3
    text = VIDEO_PROMPT.replace("What happens in it?", "What?")  # (the template writes no bos)
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"video": video}}, greedy)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    with LiveServer(path, allow_image_urls=False, num_kv_blocks=96) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        r = client.chat.completions.create(model=server.model_name, max_tokens=6, temperature=0.0,
                                           messages=[{"role": "user", "content": content}])
        assert r.choices[0].message.content == chat[0].outputs[0].text
        assert r.usage.prompt_tokens == len(chat[0].prompt_token_ids)
        bad = [{"type": "video_url", "video_url": {"url": data_url(b"not a video at all" * 20)}}]
        with pytest.raises(openai.BadRequestError, match="not a readable video") as e:
            client.chat.completions.create(model=server.model_name, max_tokens=2,
                                           messages=[{"role": "user", "content": bad}])
        assert e.value.body["code"] == "invalid_video"
        with pytest.raises(openai.BadRequestError, match="does not fetch video URLs"):
            client.chat.completions.create(model=server.model_name, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x.invalid/a.mp4"}}]}])
        monkeypatch.setitem(__import__("sys").modules, "av", None)  # PyAV not installed
        with pytest.raises(openai.BadRequestError, match="pip install av"):
            client.chat.completions.create(model=server.model_name, max_tokens=2,
                                           messages=[{"role": "user", "content": content}])
        monkeypatch.undo()
        again = client.chat.completions.create(model=server.model_name, max_tokens=6, temperature=0.0,
                                               messages=[{"role": "user", "content": content}])
        assert again.choices[0].message.content == r.choices[0].message.content
        import requests
        tok = requests.post(server.url + "/tokenize", json={"model": server.model_name, "messages": [
            {"role": "user", "content": content}]}).json()
        assert tok["tokens"] == chat[0].prompt_token_ids


def test_server_refuses_video_for_image_only_models(ckpt_root: Path) -> None:
    openai = pytest.importorskip("openai")
    from tests.checkpoints import make_llava_checkpoint
    from tests.server_utils import LiveServer
    path = ckpt_root / "llava_for_video"
    if not (path / "config.json").exists():
        make_llava_checkpoint(path)
    with LiveServer(path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        with pytest.raises(openai.BadRequestError, match="takes no video") as e:
            client.chat.completions.create(model=server.model_name, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(b"x")}},
                                             {"type": "text", "text": "hi"}]}])
        assert e.value.body["code"] == "videos_not_supported"
        ok = client.chat.completions.create(model=server.model_name, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content is not None
