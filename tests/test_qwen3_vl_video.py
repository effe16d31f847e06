"""Video input for Qwen3-VL (dense and MoE): the prompt expansion (each temporal grid step's "<t seconds>" text,
<|vision_start|>, its tokens, <|vision_end|>) against transformers' Qwen3VLProcessor.replace_video_token and its
tokenizer, the frame sampling / sizing / layout against transformers' Qwen3VLVideoProcessor (its torchvision
resize and normalize cannot run here: compared with them off), the M-RoPE positions against get_rope_index, greedy
tokens and logprobs against transformers' models fed the same input_ids, pixel_values_videos and video_grid_thw
(whole, chunked, from the prefix cache, beside an image), and the server's video_url parts."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from streamer import LLM, SamplingParams
from streamer.multimodal.inputs import VideoData
from streamer.multimodal.processors.qwen_video_processor import (
    QWEN3_VIDEO_DEFAULTS,
    Qwen3VideoProcessor,
    qwen3_smart_resize,
)

transformers = pytest.importorskip("transformers")

from tests.parity import assert_outputs_match, logprob_gap, tokens_and_logprobs  # noqa: E402
from tests.test_qwen_video import QWEN_VL_VIDEO_TEMPLATE, data_url, encode_video, frames, pil  # noqa: E402

# Qwen3-VL's processor settings at a tiny scale: 4-pixel patches (8 x 8 pixels a token), a budget over all frames
VIDEO_CONFIG = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "size": {"shortest_edge": 8 * 8, "longest_edge": 48 * 48 * 4}, "fps": 2, "do_sample_frames": True,
                "min_frames": 4, "max_frames": 16}


def make_qwen3_vl_video_checkpoint(out_dir: Path, moe: bool = False, seed: int = 0) -> Path:
    """tests/checkpoints.py's tiny Qwen3-VL (or Qwen3-VL-MoE) with a <|video_pad|> token (the config's
    video_token_id), a template writing videos and Qwen3-VL's video processor config (4-pixel patches)."""
    import transformers as tf

    from tests.checkpoints import _vlm_tokenizer
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                                   "<|im_start|>", "<|im_end|>"], QWEN_VL_VIDEO_TEMPLATE)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=ids["vocab_size"], max_position_embeddings=512,
                rms_norm_eps=1e-6, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                 "rope_theta": 10000.0})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    if moe:
        text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    cfg_cls, cls = (tf.Qwen3VLMoeConfig, tf.Qwen3VLMoeForConditionalGeneration) if moe else \
        (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration)
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "pos_embed" in name or "deepstack" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    tf.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3,
                             size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48}).save_pretrained(out_dir)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    return out_dir


@pytest.fixture(scope="module")
def video_dir(ckpt_root: Path) -> Path:
    path = ckpt_root / "qwen3_vl_video"
    if not (path / "config.json").exists():
        make_qwen3_vl_video_checkpoint(path)
    return path


VIDEO_PROMPT = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens in it?<|im_end|>\n"
                "<|im_start|>assistant\n")
MIXED_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|video_pad|>"
                "<|vision_end|>or<|vision_start|><|video_pad|><|vision_end|>Which?<|im_end|>\n"
                "<|im_start|>assistant\n")
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)


def _prompts() -> list[dict]:
    # a: 10 frames, no fps -> taken at 24 fps, sampled to min_frames 4 (0, 3, 6, 9) -> 2 steps at 0.1 s and 0.3 s;
    # at 4 fps -> 5 frames (0, 2, 4, 7, 9), padded to 6 -> 3 steps. b: 3 PIL frames sampled already at 2 fps ->
    # padded to 4 -> 0.2 s and 1.0 s. c: 5 frames given with their indices in a 30 fps video -> 3 steps.
    a, b, c = frames(10, 32, 40, 1), frames(3, 24, 24, 2), frames(5, 16, 24, 3)
    return [
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": a}},
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": VideoData(list(map(Image.fromarray, b)), 2.0,
                                                                         sample=False)}},
        {"prompt": MIXED_PROMPT, "multi_modal_data": {"image": pil(30, 48, 3), "video": [
            (a, {"fps": 4.0}), (c, {"fps": 30.0, "frames_indices": [0, 15, 30, 45, 60], "do_sample_frames": False})]}},
    ]


def _media(data: dict) -> list[VideoData]:
    from streamer.multimodal.inputs import as_media
    return as_media(data)[1]


def _hf_inputs(llm: LLM, prompt: dict, ids: list[int]) -> dict:
    """What transformers' model takes beside the ids: the pixels streamer's processors made (each video whole, its
    grid with t steps), the image's, and mm_token_type_ids (1: image, 2: video)."""
    mm = llm.engine.image_prompts
    cfg = json.loads((Path(llm.engine.model_dir) / "config.json").read_text())
    data = prompt["multi_modal_data"]
    kw: dict = {}
    if data.get("image") is not None:
        px, grid = mm.processor([data["image"]])
        kw["pixel_values"], kw["image_grid_thw"] = px, grid
    vids = _media(data)
    if vids:
        out = mm.video_processor.process([v.frames for v in vids], [v.fps for v in vids], [v.sample for v in vids],
                                         None, [v.indices for v in vids])
        kw["pixel_values_videos"] = torch.from_numpy(np.concatenate([v.pixels for v in out]))
        kw["video_grid_thw"] = torch.tensor([v.grid for v in out])
    t = torch.tensor([ids])
    kw["mm_token_type_ids"] = (t == cfg["image_token_id"]).int() + 2 * (t == cfg["video_token_id"]).int()
    return kw


def _hf_greedy(model_dir: Path, llm: LLM, prompts: list[dict], outs, max_new_tokens: int = 5):
    import transformers as tf

    from tests.checkpoints import _hf_greedy_with_logprobs
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(tf, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    items = [(o.prompt_token_ids, _hf_inputs(llm, p, o.prompt_token_ids)) for p, o in zip(prompts, outs)]
    return _hf_greedy_with_logprobs(model, items, max_new_tokens, lambda t, kw: kw)


def _run_case(path: Path):
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(prompts, PARAMS)
    return llm, prompts, outs, _hf_greedy(path, llm, prompts, outs)


@pytest.fixture(scope="module")
def case(video_dir: Path):
    return _run_case(video_dir)


def test_video_equals_transformers(video_dir: Path, case) -> None:
    """A video of unknown rate, one of PIL frames sampled already, and two videos beside an image: tokens and
    logprobs equal transformers', whole, chunked (chunks of 8 tokens split the steps) and from the prefix cache."""
    llm, prompts, outs, want = case
    inputs = llm.engine.process_prompt(prompts[0])[2]
    assert [(im.grid, im.length, im.video) for im in inputs] == [((1, 8, 10), 20, True)] * 2  # 4 frames: 2 steps
    assert_outputs_match(tokens_and_logprobs(outs), want)
    chunked = LLM(str(video_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, block_size=4)
    assert_outputs_match(tokens_and_logprobs(chunked.generate(prompts, PARAMS)), want)
    again = chunked.generate(prompts[2:3], PARAMS)
    assert again[0].num_cached_tokens > 0
    assert_outputs_match(tokens_and_logprobs(again), want[2:3])
    other = chunked.generate([{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(10, 32, 40, 7)}}],
                             PARAMS)
    # another video at the same times: the text up to its first step's tokens is shared, nothing from them on
    assert 0 < other[0].num_cached_tokens <= inputs[0].offset
    kv = chunked.engine.kv
    kv.check_consistency()
    assert kv.pool.num_free == kv.num_blocks


def test_wrong_positions_timestamps_or_deepstack_fail(video_dir: Path, case, monkeypatch) -> None:
    """The checks above can fail: 1-D positions for the video tokens, other timestamps in the prompt, or no
    DeepStack on video tokens are measurably off transformers."""
    import streamer.multimodal.inputs as mm
    from streamer.models import vlm
    _, prompts, _, want = case
    real_place = mm._place_mrope
    with monkeypatch.context() as m:
        def flat_videos(inputs, merge):
            real_place(inputs, merge)
            for im in inputs:
                if im.video:
                    im.mrope = np.repeat(np.arange(im.offset, im.end)[None], 3, axis=0) + (im.mrope.min() - im.offset)
        m.setattr(mm, "_place_mrope", flat_videos)
        off = tokens_and_logprobs(LLM(str(video_dir), dtype="float32", num_kv_blocks=128).generate(prompts, PARAMS))
    assert logprob_gap(off, want) > 5e-3, logprob_gap(off, want)  # (0.17 here; tokens differ)
    real_times = Qwen3VideoProcessor.timestamps
    with monkeypatch.context() as m:
        m.setattr(Qwen3VideoProcessor, "timestamps", lambda self, v: [t + 1.0 for t in real_times(self, v)])
        off = tokens_and_logprobs(LLM(str(video_dir), dtype="float32", num_kv_blocks=128).generate(prompts, PARAMS))
    assert logprob_gap(off, want) > 5e-3, logprob_gap(off, want)  # (0.019 here)
    real_ds = vlm.Qwen3VLMixin.place_image_features
    with monkeypatch.context() as m:
        def no_deepstack(self, embeds, idx, feats):
            real_ds(self, embeds, idx, feats)
            return {}
        m.setattr(vlm.Qwen3VLMixin, "place_image_features", no_deepstack)
        off = tokens_and_logprobs(LLM(str(video_dir), dtype="float32", num_kv_blocks=128).generate(prompts[:2], PARAMS))
    assert logprob_gap(off, want[:2]) > 5e-3, logprob_gap(off, want[:2])  # (0.14 here; tokens differ)


def test_qwen3_vl_moe_video_equals_transformers(ckpt_root: Path) -> None:
    path = make_qwen3_vl_video_checkpoint(ckpt_root / "qwen3_vl_moe_video", moe=True)
    _, _, outs, want = _run_case(path)
    assert_outputs_match(tokens_and_logprobs(outs), want)


# ---------------------------------------------------------------------------------------------- the prompt
def _transformers_expansion(video_dir: Path, prompt: dict, tokenizer) -> list[int]:
    """The prompt as transformers' Qwen3VLProcessor writes it: each video token replaced by replace_video_token
    (its own code, on the grids and metadata transformers' video processor makes of the same frames), each image
    token by its tokens, then tokenized by transformers' tokenizer."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    text = prompt["prompt"]
    data = prompt["multi_modal_data"]
    vids = _media(data)
    metas, grids = [], []
    theirs = _their_video_processor()
    for v in vids:
        video = np.stack([np.asarray(f) for f in v.frames]) if isinstance(v.frames, list) else v.frames
        meta = {"total_num_frames": len(video), "fps": v.fps,
                "frames_indices": v.indices if v.indices is not None else list(range(len(video)))}
        sample = v.sample if v.sample is not None else True
        out = theirs(videos=[video], return_metadata=True, video_metadata=[meta], do_sample_frames=sample)
        metas.append(out["video_metadata"][0])
        # (its sizes unresized: the spatial grid is the one our processor resizes to, checked on its own below)
        h, w = Qwen3VideoProcessor.from_config(VIDEO_CONFIG).output_size(video.shape[1], video.shape[2],
                                                                          len(metas[-1].frames_indices))
        grids.append([int(out["video_grid_thw"][0, 0]), h // 4, w // 4])
    me = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                         vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                         video_token="<|video_pad|>",
                         _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    parts = text.split("<|video_pad|>")
    inputs = {"video_grid_thw": torch.tensor(grids), "video_metadata": metas}
    text = parts[0] + "".join(Qwen3VLProcessor.replace_video_token(me, inputs, i) + part
                              for i, part in enumerate(parts[1:]))
    if data.get("image") is not None:
        from streamer.multimodal.processors.qwen_image_processor import QwenImageProcessor
        _, grid = QwenImageProcessor.from_folder(video_dir)([data["image"]])
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4))
    return tokenizer(text)["input_ids"]


def _their_video_processor():
    """transformers' Qwen3VLVideoProcessor with what needs torchvision (resize, normalize, RGB conversion) off."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    settings = {k: v for k, v in VIDEO_CONFIG.items() if k != "video_processor_type"}
    return Qwen3VLVideoProcessor(**settings, do_resize=False, do_rescale=False, do_normalize=False,
                                 do_convert_rgb=False, cap_pixels_per_frame=False)


def test_prompt_is_qwen3vl_processors(video_dir: Path) -> None:
    """Each video's expansion ("<t seconds>" per step from the sampled frames' indices and rate, the steps' tokens
    wrapped in <|vision_start|> / <|vision_end|>, inside the template's own pair) is transformers' token for token;
    the expanded prompt given back as ids (with the media) reads the same."""
    tok = transformers.AutoTokenizer.from_pretrained(video_dir)
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=128)
    for prompt in _prompts():
        _, ids, inputs = llm.engine.process_prompt(prompt)
        assert ids == _transformers_expansion(video_dir, prompt, tok)
        again = llm.engine.process_prompt({"prompt_token_ids": ids, "multi_modal_data": prompt["multi_modal_data"]})
        assert again[1] == ids and [(i.offset, i.hash) for i in again[2]] == [(i.offset, i.hash) for i in inputs]
    text = tok.decode(llm.engine.process_prompt(_prompts()[0])[1])
    assert "<|vision_start|><0.1 seconds><|vision_start|><|video_pad|>" in text
    assert "<|vision_end|><0.3 seconds><|vision_start|>" in text and text.count("<|video_pad|>") == 40
    bad = list(ids)
    bad[bad.index(llm.engine.image_prompts.video_token_id) - 3] += 1  # a timestamp token changed
    with pytest.raises(ValueError, match="expanded video does not match"):
        llm.engine.process_prompt({"prompt_token_ids": bad, "multi_modal_data": _prompts()[2]["multi_modal_data"]})


def _positions(ids: list[int], inputs) -> np.ndarray:
    from streamer.multimodal.inputs import rope_shifts
    pos = np.arange(len(ids))
    out = np.repeat((pos + rope_shifts(SimpleNamespace(images=list(inputs)), pos))[None], 3, axis=0)
    for im in inputs:
        out[:, im.offset:im.end] = im.mrope
    return out


def test_mrope_positions_equal_get_rope_index(video_dir: Path) -> None:
    """Each step's tokens as a one-step grid, the timestamp text between steps continuing from it: transformers'
    get_rope_index, position for position, and its decode shift."""
    import transformers as tf
    cfg = tf.Qwen3VLConfig.from_pretrained(video_dir)
    with torch.device("meta"):
        model = tf.Qwen3VLForConditionalGeneration(cfg).model
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=128)
    for prompt in _prompts():
        _, ids, inputs = llm.engine.process_prompt(prompt)
        kw = _hf_inputs(llm, prompt, ids)
        kw = {k: v for k, v in kw.items() if k in ("image_grid_thw", "video_grid_thw", "mm_token_type_ids")}
        want, delta = model.get_rope_index(torch.tensor([ids]), **kw)
        got = _positions(ids, inputs)
        assert np.array_equal(got, want[:, 0].numpy())
        assert got.max() + 1 - len(ids) == int(delta)


# ---------------------------------------------------------------------------------------------- the processor
def test_defaults_match_transformers() -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as Theirs
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "patch_size", "temporal_patch_size",
                "merge_size", "min_frames", "max_frames", "do_sample_frames", "max_video_tokens", "fps", "size"):
        assert getattr(Theirs, key) == QWEN3_VIDEO_DEFAULTS[key], key
    assert list(Theirs.image_mean) == list(QWEN3_VIDEO_DEFAULTS["image_mean"]) == [0.5] * 3
    assert int(Theirs.resample) == QWEN3_VIDEO_DEFAULTS["resample"] and Theirs.num_frames is None
    ours = Qwen3VideoProcessor.from_config({})
    assert (ours.patch_size, ours.min_pixels, ours.max_pixels, ours.fps, ours.do_sample_frames) == \
        (16, 128 * 32 * 32, 32 * 32 * 768, 2.0, True)
    # Qwen/Qwen3-VL-*'s video_preprocessor_config.json, as published
    real = Qwen3VideoProcessor.from_config({
        "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor"})
    assert (real.min_pixels, real.max_pixels, real.factor, real.fps, real.min_frames) == (4096, 25165824, 32, 2.0, 4)


@pytest.mark.parametrize("total, video_fps, fps, num_frames", [
    (100, 30.0, 2.0, None), (30, 10.0, 2.0, None), (7, 30.0, 2.0, None), (2000, 24.0, 1.0, None),
    (50, 25.0, None, 8), (50, 25.0, None, 7), (9, None, 2.0, None), (3, 3.0, 4.0, None), (40, 8.0, None, None)])
def test_sampling_is_transformers_sample_frames(total: int, video_fps, fps, num_frames) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as Theirs
    ours = dataclasses.replace(Qwen3VideoProcessor.from_config({**VIDEO_CONFIG, "max_frames": 64}), fps=fps)
    me = SimpleNamespace(num_frames=None, fps=fps, min_frames=4, max_frames=64)
    expected = Theirs.sample_frames(me, SimpleNamespace(total_num_frames=total, fps=video_fps), num_frames=num_frames)
    got = ours.sample_indices(total, video_fps or 24.0, None, num_frames)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("n, h, w", [(4, 37, 29), (5, 50, 70), (2, 6, 90), (16, 200, 120), (3, 8, 8)])
def test_sizing_is_transformers_smart_resize(n: int, h: int, w: int) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    ours = Qwen3VideoProcessor.from_config(VIDEO_CONFIG)
    assert ours.output_size(h, w, n) == smart_resize(n, h, w, 2, 8, 64, 48 * 48 * 4)
    capped = Qwen3VideoProcessor.from_config({**VIDEO_CONFIG, "cap_pixels_per_frame": True, "max_video_tokens": 6})
    per_frame = max(min(6 * 64, 48 * 48 * 4 // n), int(64 * 1.05))
    assert capped.output_size(h, w, n) == smart_resize(n, h, w, 2, 8, 64, per_frame * n)
    with pytest.raises(ValueError, match="at least temporal_patch_size"):
        qwen3_smart_resize(1, 32, 32, 2, 8, 64, 4096)


@pytest.mark.parametrize("n, fps, sample", [(10, None, True), (9, 10.0, True), (5, 3.0, False), (40, 30.0, True)])
def test_layout_and_metadata_are_transformers(n: int, fps, sample: bool) -> None:
    """Sampling, the last frame's padding and the patch layout (resize and normalize off, which need torchvision
    there): transformers' pixel_values_videos, video_grid_thw and frame indices / rate."""
    video = frames(n, 16, 24, seed=n)
    out = _their_video_processor()(videos=[video], return_metadata=True, do_sample_frames=sample,
                                   video_metadata=[{"total_num_frames": n, "fps": fps,
                                                    "frames_indices": list(range(n))}])
    ours = Qwen3VideoProcessor.from_config({**VIDEO_CONFIG, "do_resize": False, "do_rescale": False,
                                            "do_normalize": False})
    (got,) = ours.process([video], [fps], [sample])
    assert list(got.grid) == out["video_grid_thw"][0].tolist()
    assert np.array_equal(got.pixels, out["pixel_values_videos"].float().numpy())
    meta = out["video_metadata"][0]
    assert got.indices.tolist() == list(meta.frames_indices) and (got.fps or 24) == meta.fps


# ---------------------------------------------------------------------------------------------- errors, server
def test_clear_errors(video_dir: Path, ckpt_root: Path) -> None:
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=128)
    with pytest.raises(ValueError, match="at least temporal_patch_size"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": VideoData(frames(1, 16, 16, 0),
                                                                                      sample=False)}}, PARAMS)
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\).*but 2 video"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [frames(4, 16, 16, 0)] * 2}}, PARAMS)
    with pytest.raises(ValueError, match="frames_indices"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": (frames(4, 16, 16, 0),
                                                                             {"frames_indices": "x"})}}, PARAMS)
    from tests.checkpoints import make_qwen3_vl_checkpoint
    path = ckpt_root / "qwen3_vl_no_video_token"
    if not (path / "config.json").exists():
        make_qwen3_vl_checkpoint(path)  # (its tokenizer has no <|video_pad|>)
    with pytest.raises(ValueError, match="video token id"):
        LLM(str(path), dtype="float32", num_kv_blocks=32).generate(
            {"prompt": "hi", "multi_modal_data": {"video": frames(4, 16, 16, 0)}}, PARAMS)


def test_server_takes_video_urls(video_dir: Path) -> None:
    """An mp4 as a data: URL through the real openai client: the answer and the prompt are LLM.chat's, which
    reads the frames decoded at the processor's 2 fps (timestamps from that rate)."""
    openai = pytest.importorskip("openai")
    import streamer.multimodal.inputs as mm
    from tests.server_utils import LiveServer
    clip = encode_video(12, 40, 32, rate=8, seed=3)  # 1.5 s at 8 fps -> 3 frames at 2 fps
    content = [{"type": "video_url", "video_url": {"url": data_url(clip)}}, {"type": "text", "text": "What?"}]
    llm = LLM(str(video_dir), dtype="float32", num_kv_blocks=128)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    chat = llm.chat([{"role": "user", "content": content}], greedy)
    video = mm.decode_video(clip, 2.0)
    text = VIDEO_PROMPT.replace("What happens in it?", "What?")
    direct = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"video": video}}, greedy)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert "<1.0 seconds>" in llm.tokenizer.decode(chat[0].prompt_token_ids, skip_special_tokens=False)
    with LiveServer(video_dir, allow_image_urls=False, num_kv_blocks=128) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        r = client.chat.completions.create(model=server.model_name, max_tokens=6, temperature=0.0,
                                           messages=[{"role": "user", "content": content}])
    assert r.choices[0].message.content == chat[0].outputs[0].text
    assert r.usage.prompt_tokens == len(chat[0].prompt_token_ids)
