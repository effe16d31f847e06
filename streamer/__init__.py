"""streamer: an asyncio-first LLM inference and serving engine."""
from __future__ import annotations

from typing import TYPE_CHECKING

from streamer.engine.beam_search import BeamSearchParams
from streamer.engine.lora import LoRARequest
from streamer.engine.pooling import PoolingParams
from streamer.engine.structured_output import StructuredOutputsParams
from streamer.outputs import (
    ClassificationOutput,
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    StreamOutput,
)
from streamer.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "PoolingParams",
           "RequestOutput", "CompletionOutput", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "Logprob",
           "StreamOutput", "EngineConfig", "BeamSearchParams"]

if TYPE_CHECKING:
    from streamer.config import EngineConfig
    from streamer.engine.async_engine import AsyncEngine
    from streamer.llm import LLM


def __getattr__(name: str):
    # Imported lazily: `import streamer` stays cheap for the CLI and the bench client (no torch import).
    if name == "LLM":
        from streamer.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from streamer.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "EngineConfig":
        from streamer.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
