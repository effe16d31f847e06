"""What the engine hands back: per-request outputs, shaped like vLLM's so its users feel at home."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One entry per generated token: {token_id: Logprob} holding the sampled token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, None for the first (nothing predicts it): {token_id: Logprob}, the prompt's token
# first, then the top-N.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


@dataclass
class StreamOutput:
    """One incremental item of `AsyncEngine.stream()`: what is new for one sequence since the last item."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    usage: Optional[dict] = field(default=None)
    prompt_logprobs: Optional[PromptLogprobs] = None  # with the sequence's first item, when asked for
    prompt_token_ids: Optional[list[int]] = None  # beside prompt_logprobs
    cumulative_logprob: Optional[float] = None  # on a sequence's last item, when logprobs were asked for
    # A pooling request's result, on its only (last) item: the embedding, or a classifier's outputs
    embedding: Optional[list[float]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "StreamOutput") -> None:
        """Append the same sequence's next item (outputs that piled up go out as one)."""
        self.token_ids = self.token_ids + later.token_ids
        self.text += later.text
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs = self.logprobs + later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.cumulative_logprob = later.cumulative_logprob
        if self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_token_ids = later.prompt_logprobs, later.prompt_token_ids


@dataclass
class EmbeddingOutput:
    """An embedding request's result (`LLM.embed`, `AsyncEngine.embed`)."""

    request_id: str
    embedding: list[float]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0


@dataclass
class ClassificationOutput:
    """A classification request's result (`LLM.classify`, `AsyncEngine.classify`): the probability of each label
    (softmax over the labels, a sigmoid for one label; the raw logits with PoolingParams(activation=False)) and
    the most likely label's name (config.json's id2label)."""

    request_id: str
    probs: list[float]
    label: str
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One pair's score (`LLM.score`): a cross-encoder's sigmoid of the pair's logit, or the cosine similarity of
    an embedding model's two embeddings. `prompt_token_ids`: the pair's prompt (a cross-encoder's), or both
    texts' prompts one after the other."""

    request_id: str
    score: float
    prompt_token_ids: list[int]
