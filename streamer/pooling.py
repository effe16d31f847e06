"""Embeddings: a request that pools the model's final hidden states over its prompt instead of generating.

The prompt is computed like any other (chunked, batched with generating requests, prefix-cached where that cannot
change the result); the runner sums, per request and per chunk, the hidden states the pooling method takes (the
last prompt token's, the first one's, or all of them), and the engine adds the chunks up and finishes the request
with the embedding once its prompt is done. No token is sampled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

POOLING = ("last", "mean", "cls")
POOL_CODE = {"last": 1, "mean": 2, "cls": 3}  # InputBatch's per-row code (0: not pooling)


@dataclass
class PoolingParams:
    """pooling: "last" (the last prompt token's hidden state), "mean" (over all prompt tokens) or "cls" (the first
    token's); None = the model's own (sentence-transformers' pooling config, else "last"). normalize: L2-normalise
    the result. dimensions: keep the first N components (Matryoshka embeddings), normalised after cutting."""

    pooling: Optional[str] = None
    normalize: bool = True
    dimensions: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None  # keep only the prompt's last N tokens (as SamplingParams')

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {POOLING}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            d = getattr(self, name)
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
                raise ValueError(f"{name} must be a positive integer, got {d!r}")


def default_pooling(model_dir: Path) -> str:
    """The pooling a sentence-transformers checkpoint declares (`modules.json` -> its Pooling module's config),
    else "last" (what decoder embedding models such as Qwen3-Embedding use)."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
        for m in modules:
            if m.get("type", "").endswith("Pooling"):
                cfg = json.loads((model_dir / m.get("path", "") / "config.json").read_text())
                for key, name in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                  ("pooling_mode_cls_token", "cls")):
                    if cfg.get(key):
                        return name
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return "last"


def finish_embedding(total: Any, count: int, params: PoolingParams) -> list[float]:
    """The pooled vector from the summed hidden states (numpy float64 [H]): averaged, cut to `dimensions`,
    normalised. (numpy is imported here: `import streamer` stays light.)"""
    import numpy as np
    vec = total / max(count, 1)
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if params.normalize:
        vec = vec / (np.linalg.norm(vec) or 1.0)
    return vec.tolist()


def truncate_prompt(token_ids: list[int], options: object) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens, if the request's SamplingParams / PoolingParams ask."""
    k = getattr(options, "truncate_prompt_tokens", None)
    return token_ids[-k:] if k is not None and len(token_ids) > k else token_ids
