"""Build a model from a Hugging Face checkpoint folder: sharded safetensors (with an index) or dummy weights."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from streamer.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from streamer.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from streamer.models.gpt_oss import GptOssForCausalLM
from streamer.models.llama import LlamaForCausalLM
from streamer.models.quant import dequantizing

logger = logging.getLogger("streamer")

# Every supported family is a Llama with options (qkv bias, q/k norms, a sliding window, fused checkpoint tensors).
_MODEL_CLASSES: dict[str, type] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
_MODEL_CLASSES["Gemma3ForCausalLM"] = Gemma3ForCausalLM
_MODEL_CLASSES["Gemma2ForCausalLM"] = Gemma2ForCausalLM
_MODEL_CLASSES["GptOssForCausalLM"] = GptOssForCausalLM


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in model folder {folder} "
                                f"(use load_format='dummy' for random weights)")
    return files


def iter_safetensors(files: list[Path], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _dummy_init(model: torch.nn.Module, seed: int) -> None:
    """Random weights at real sizes, small enough that activations stay finite in bf16/fp16. Filled on the
    parameters' own device (an 8B model filled on the host would take minutes)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.uniform_(-0.05, 0.05, generator=gen)


def load_model(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend_cls: type,
               max_positions: int, load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    model_cls = _MODEL_CLASSES[cfg.architecture]
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg, backend_cls, max_positions)
    finally:
        torch.set_default_dtype(old_dtype)
    if load_format == "dummy":
        _dummy_init(model, seed)
    else:
        files = safetensors_files(folder)
        weights = iter_safetensors(files, "cpu")
        if cfg.quantization is not None:
            weights = dequantizing(weights, cfg.quantization)
        loaded = model.load_weights(weights)
        missing = model.expected_weights() - loaded
        if missing:
            names = sorted(model.checkpoint_name(m) for m in missing)
            raise ValueError(f"checkpoint {folder} is missing {len(names)} tensor(s): {', '.join(names[:8])}"
                             + (" ..." if len(names) > 8 else ""))
    return model.eval()
