"""Prompt embeddings: a prompt given as the vectors the model's input embedding layer would make, not as tokens
(vLLM's `prompt_embeds`; soft prompts, or text embedded by the client that never sends it).

The contract: `prompt_embeds[i]` stands where the embedding layer's output for a token would (what transformers'
`model.get_input_embeddings()(token_ids)` returns); the model does with it whatever it does after that layer
(Granite's and Falcon-H1's embedding multiplier, OPT's project_in, GPT-2's learned positions), so the embeddings
of a prompt's tokens give the same output as the tokens (`LlamaForCausalLM.from_input_embeddings`).

Such a prompt rides the images' machinery (streamer/multimodal/inputs.py): the request holds placeholder tokens (id 0),
one per row, and one `ImageInput` whose `features` are the rows themselves (no encoder runs). So its blocks'
prefix-cache hashes cover the rows, chunked prefill reads each chunk's rows, a preempted request recomputes from
them, and tensor-parallel workers get them with the step. The placeholders are nobody's tokens: they are not the
detokenizer's context, the repetition penalty's seen tokens, or prompt logprobs' targets (refused).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import zipfile
from typing import Any, Optional, Sequence

import torch

from streamer.multimodal.inputs import ImageInput

PLACEHOLDER_ID = 0  # the token id a prompt embedding's position holds (vLLM's choice too)


def is_embeds_prompt(prompt: Any) -> bool:
    return isinstance(prompt, dict) and "prompt_embeds" in prompt


def decode_base64(data: Any, index: Optional[int] = None) -> torch.Tensor:
    """A tensor sent as base64 of `torch.save(tensor)` (how vLLM's clients send prompt_embeds). Loaded with
    `weights_only=True`: the pickle may build tensors and nothing else (no code runs)."""
    name = "prompt_embeds" if index is None else f"prompt_embeds[{index}]"
    if not isinstance(data, str) or not data:
        raise ValueError(f"{name} must be a non-empty base64 string (of torch.save(tensor)), got "
                         f"{type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not valid base64") from None
    _check_archive(raw, name)
    try:
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # (pickle errors, unsupported types, truncated data: all the client's)
        raise ValueError(f"{name} is not a tensor saved with torch.save: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must hold one tensor, got {type(t).__name__}")
    return t


def _check_archive(raw: bytes, name: str) -> None:
    """Refuse a zip bomb before torch.load inflates it: torch.save's archive stores its entries uncompressed, so a
    compressed entry, or entries adding up to more than the archive holds (overlapping), were made to blow up
    (a 1.36 MB body inflated to 2.7 GB). The legacy format has its data in `raw` itself."""
    if not raw.startswith(b"PK"):
        return
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise ValueError(f"{name} is not a tensor saved with torch.save: a damaged archive") from None
    if any(e.compress_type != zipfile.ZIP_STORED for e in entries):
        raise ValueError(f"{name} holds compressed entries: send torch.save's archive as it writes it "
                         "(uncompressed)")
    if sum(e.file_size for e in entries) > len(raw):
        raise ValueError(f"{name}'s archive claims more data than it holds")


def check_embeds(t: Any, width: int, dtype: torch.dtype, max_rows: Optional[int] = None) -> torch.Tensor:
    """The prompt's rows as the model reads them: a float tensor [length, width] (or [1, length, width]),
    finite once in the model's dtype; ValueError naming prompt_embeds otherwise. `max_rows` (max_model_len) is
    checked before the rows are copied: a view can claim far more rows than its storage holds (stride 0)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or not t.dtype.is_floating_point or t.is_complex():
        raise ValueError(f"prompt_embeds must be a dense floating-point tensor, got {t.dtype} ({t.layout})")
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"prompt_embeds must have shape [sequence length, {width}] (the model's embedding "
                         f"width), got {list(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError("prompt_embeds must not be empty")
    if max_rows is not None and t.shape[0] > max_rows:
        raise ValueError(f"prompt_embeds has {t.shape[0]} rows, but max_model_len is {max_rows}")
    t = t.detach().to("cpu", dtype).contiguous()
    if not torch.isfinite(t).all():
        raise ValueError(f"prompt_embeds holds non-finite values (in the model's dtype, {dtype})")
    return t


def hash_embeds(rows: torch.Tensor) -> bytes:
    h = hashlib.blake2b(b"prompt embeds", digest_size=16)
    h.update(str(rows.dtype).encode() + repr(tuple(rows.shape)).encode())
    h.update(rows.view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def embeds_input(rows: torch.Tensor) -> tuple[list[int], tuple[ImageInput, ...]]:
    """(placeholder token ids, the one input covering them) for checked rows (`check_embeds`)."""
    n = len(rows)
    return [PLACEHOLDER_ID] * n, (ImageInput(0, n, torch.empty(0), hash_embeds(rows), features=rows),)


def truncate_inputs(ids: list[int], images: Sequence[ImageInput], keep: int,
                    ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's last `keep` tokens (truncate_prompt_tokens). Images' placeholders would be cut apart:
    refused; a prompt of embeddings keeps its last rows."""
    if not images:
        return ids[-keep:], ()
    if len(images) == 1 and images[0].features is not None:
        return embeds_input(images[0].features[-keep:])
    raise ValueError("truncate_prompt_tokens cannot be used with a prompt that holds images")
