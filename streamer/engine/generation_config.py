"""Default sampling parameters from the checkpoint's generation_config.json, as vLLM applies them.

Model authors ship the sampling they recommend there (Qwen3: temperature 0.6, top_p 0.95, top_k 20; Llama-3.1:
temperature 0.6, top_p 0.9). A request that leaves a field unset gets the checkpoint's value instead of the
API's neutral default (temperature 1, no top-p/top-k), so a bare `{"messages": [...]}` samples the way the model
was tuned to. `EngineConfig.generation_config` picks the source: "auto" (the model's folder), "vllm" (none: the
API's own defaults, as vLLM spells it) or another folder holding a generation_config.json.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("streamer")

# generation_config.json key -> SamplingParams field (the keys vLLM reads; `do_sample` is not among them).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: str, model_dir: Path, overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The SamplingParams fields that replace the API's defaults. `overrides` (generation_config.json keys, e.g.
    {"temperature": 0.5}) win over the file. Raises ValueError for a value SamplingParams refuses."""
    folder = model_dir if source == "auto" else None if source == "vllm" else Path(source)
    if folder is not None and source != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
    unknown = set(overrides or {}) - set(FIELDS)
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {sorted(unknown)} (known: {sorted(FIELDS)})")
    found = _read(folder / "generation_config.json") if folder is not None else {}
    found.update(overrides or {})
    defaults = {name: found[key] for key, name in FIELDS.items() if found.get(key) is not None}
    if defaults.get("top_k") == 0:  # transformers' (and the API's) "no top-k"
        defaults["top_k"] = -1
    _check(defaults, source)
    if defaults:
        logger.info("default sampling parameters from %s: %s",
                    "the model's generation_config.json" if source == "auto" else source, defaults)
    return defaults


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _check(defaults: dict[str, Any], source: str) -> None:
    from streamer.sampling_params import SamplingParams
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config ({source}): {e}") from None
