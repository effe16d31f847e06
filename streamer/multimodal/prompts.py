"""Which prompts a multimodal model takes: `image_prompts_for` picks, for the model's architecture, the
`ImagePrompts` (streamer/multimodal/inputs.py) or, for an audio-language model, the `AudioPrompts`
(streamer/multimodal/audio_prompts.py) that expand its placeholders. It sits above both modules (audio_prompts builds
on inputs), so neither imports the other for it."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from streamer.multimodal.audio_prompts import AudioPrompts
from streamer.multimodal.inputs import ImagePrompts

if TYPE_CHECKING:
    from streamer.config import EngineConfig
    from streamer.models.config import ModelConfig


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Text's ids without special tokens (Qwen3-VL's frame times; a function, not a lambda: the prompts object
    pickles, for data parallelism's front)."""
    return tokenizer.encode(text, add_special_tokens=False)


def image_prompts_for(cfg: "ModelConfig", model: Any, tokenizer: Any, model_dir: Path,
                      config: "EngineConfig") -> Optional["ImagePrompts | AudioPrompts"]:
    """How a model takes images (None: a text model): its placeholder tokens, as its processor expands them; for
    an audio-language model, how it takes audio clips."""
    if cfg.multimodal is None:
        return None
    mm, arch, image = cfg.multimodal, cfg.multimodal_architecture, cfg.image_token_id
    assert image is not None
    folder = model_dir
    if not any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        folder = Path(config.tokenizer or folder)  # (processor files often sit with the tokenizer's)
    n = model.tokens_per_image
    if arch == "Gemma4ForConditionalGeneration":  # (each image's own count, at most the processor's budget)
        from streamer.multimodal.processors.gemma4_image_processor import Gemma4ImageProcessor
        gemma4 = Gemma4ImageProcessor.from_folder(folder)
        n = gemma4.max_soft_tokens
    if model.bidirectional_images and n > config.max_num_batched_tokens:
        raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must hold a whole image ({n} "
                         f"tokens): this model's images are computed in one piece")

    def text_of(token_id: int) -> str:
        text = tokenizer.id_to_token(token_id)
        if text is None:
            raise ValueError(f"the model's image token id {token_id} is not in its tokenizer")
        return text
    limit = config.limit_images_per_prompt
    if arch == "Qwen2AudioForConditionalGeneration":  # (clips, not images: streamer/multimodal/audio_prompts.py)
        around = [tokenizer.token_to_id(t) for t in ("<|audio_bos|>", "<|audio_eos|>")]
        placeholder = text_of(image) if None in around else \
            f"{text_of(around[0])}{text_of(image)}{text_of(around[1])}"  # type: ignore[arg-type]
        return AudioPrompts(folder, image, placeholder, limit)
    if arch in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        start, end = int(mm.get("vision_start_token_id", 151652)), int(mm.get("vision_end_token_id", 151653))
        video: dict[str, Any] = {}
        video_id = int(mm.get("video_token_id", 151656))
        if tokenizer.id_to_token(video_id) is None:
            video["no_video"] = f"the model's video token id {video_id} is not in its tokenizer"
        else:
            vision = mm.get("vision_config") or {}
            tps = vision.get("tokens_per_second", 4) if arch.startswith("Qwen2_5") else None  # (its config default)
            context = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
            video = dict(video_token_id=video_id, tokens_per_second=tps, max_tokens=context,
                         video_placeholder=f"{text_of(start)}{text_of(video_id)}{text_of(end)}")
            if arch.startswith("Qwen3"):  # each grid step after its time as text, between start and end
                video.update(frame_wrap=(start, end),
                             encode_text=functools.partial(_encode_plain, tokenizer))
        return ImagePrompts(folder, image, None, f"{text_of(start)}{text_of(image)}{text_of(end)}", limit,
                            merge=model.vision_tower.spatial_merge_size, **video)
    if arch == "Mistral3ForConditionalGeneration":
        names = _pixtral_token_names(folder)
        ids = [tokenizer.token_to_id(t) for t in names]
        for name, i in zip(names, ids):
            if i is None:
                raise ValueError(f"the tokenizer has no {name} token (Mistral 3's images need it)")
        return ImagePrompts(folder, image, None, text_of(image), limit, row_breaks=(ids[0], ids[1]),
                            patch=model.image_patch)
    if arch == "LlavaNextForConditionalGeneration":
        return ImagePrompts(folder, image, None, text_of(image), limit,
                            anyres=(model.tile_size, model.side, model.grid_pinpoints))
    if arch == "InternVLForConditionalGeneration":
        names = _internvl_token_names(Path(config.tokenizer or model_dir))
        ids = [tokenizer.token_to_id(t) for t in names]
        for name, i in zip(names, ids):
            if i is None:
                raise ValueError(f"the tokenizer has no {name} token (InternVL's images need it)")
        _check_image_seq_length(folder, model.tile_tokens)
        return ImagePrompts(folder, image, None, text_of(image), limit, wrap=([ids[0]], [ids[1]]),
                            tile_tokens=model.tile_tokens, tile=model.tile_size)
    if arch == "Gemma4ForConditionalGeneration":  # <|image|> -> <|image> and as many <|image|> as it pools to <image|>
        boi, eoi = int(mm.get("boi_token_id", 255_999)), int(mm.get("eoi_token_id", 258_882))
        return ImagePrompts(folder, image, None, text_of(image), limit, wrap=([boi], [eoi]), processor=gemma4)
    if arch == "Gemma3ForConditionalGeneration":
        boi, eoi = int(mm.get("boi_token_index", 255999)), int(mm.get("eoi_token_index", 256000))
        nl = tokenizer.encode("\n\n", add_special_tokens=False)
        full = f"\n\n{text_of(boi)}{text_of(image) * n}{text_of(eoi)}\n\n"
        return ImagePrompts(folder, image, n, text_of(boi), limit, placeholder_id=boi, full_text=full,
                            wrap=(nl + [boi], [eoi] + nl))
    return ImagePrompts(folder, image, n, text_of(image), limit)


def _pixtral_token_names(folder: Path) -> tuple[str, str]:
    """The row-break and image-end tokens PixtralProcessor writes (processor_config.json may rename them)."""
    names = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    path = folder / "processor_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        names.update({k: config[k] for k in names if isinstance(config.get(k), str)})
    return names["image_break_token"], names["image_end_token"]


def _internvl_token_names(folder: Path) -> tuple[str, str]:
    """The tokens InternVLProcessor puts around an image's tokens: the tokenizer's start_image_token and
    end_image_token (tokenizer_config.json, at the top level or under extra_special_tokens), <img> and </img>
    by default."""
    names = {"start_image_token": "<img>", "end_image_token": "</img>"}
    path = folder / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        extra = config.get("extra_special_tokens")
        for source in (extra if isinstance(extra, dict) else {}, config):
            names.update({k: source[k] for k in names if isinstance(source.get(k), str)})
    return names["start_image_token"], names["end_image_token"]


def _check_image_seq_length(folder: Path, tile_tokens: int) -> None:
    """InternVL: processor_config.json's image_seq_length (the image tokens per tile InternVLProcessor writes)
    must be what the model makes of a tile, or transformers itself would refuse the prompt."""
    path = folder / "processor_config.json"
    if not path.is_file():
        return
    n = json.loads(path.read_text()).get("image_seq_length")
    if isinstance(n, int) and n != tile_tokens:
        raise ValueError(f"processor_config.json's image_seq_length {n} is not the {tile_tokens} tokens the model "
                         "makes of a tile")
