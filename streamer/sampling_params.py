"""Per-request sampling parameters, validated up front so that a bad value never reaches the device."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from streamer.engine.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +-100 bans or forces a token
MAX_SEED = 2 ** 63 - 1
_F32_MAX = 3.0e38  # floats travel to the device as float32


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_real(name: str, value: object, lo: float, hi: float, lo_open: bool = False,
                hi_open: bool = False) -> None:
    lo_s = "(" if lo_open else "["
    hi_s = ")" if hi_open else "]"
    if not _is_real(value) or not math.isfinite(value) or abs(value) > _F32_MAX:
        raise ValueError(f"{name} must be a finite number in {lo_s}{lo}, {hi}{hi_s}, got {value!r}")
    bad = (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi)
    if bad:
        raise ValueError(f"{name} must be in {lo_s}{lo}, {hi}{hi_s}, got {value!r}")


@dataclass
class SamplingParams:
    """What to generate and how. Field names and defaults follow vLLM's SamplingParams."""

    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # per prompt token: its logprob and the top-N (vLLM's field)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit (OpenAI's logit_bias)
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled (vLLM's extension)
    # Words never generated (vLLM's field): a token that would complete one, with or without a leading space,
    # is banned at that point of the output.
    bad_words: Optional[list[str]] = None
    # The output must match a JSON schema, regex, choice list or grammar (vLLM's field; a dict is converted).
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Keep only the prompt's last N tokens (vLLM's field: an explicit opt-in; prompts are never cut silently).
    truncate_prompt_tokens: Optional[int] = None
    # At most this many tokens of reasoning, then the closing think tag is forced (vLLM's field; needs the
    # engine's reasoning_parser, whose tags it counts between: streamer/engine/thinking.py).
    thinking_token_budget: Optional[int] = None
    # The output as it is expected to read (OpenAI's Predicted Outputs, e.g. a file about to be edited): with n-gram
    # speculative decoding on, its tokens are drafted where the output lines up with them.
    prediction: Optional[str] = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes, dict)) or not hasattr(self.allowed_token_ids,
                                                                                     "__iter__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, (str, bytes, dict)) or not hasattr(self.bad_words, "__iter__"):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words) or None
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields: {', '.join(sorted(unknown))}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= _F32_MAX:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= _F32_MAX:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        # Any 64-bit seed (as vLLM and torch take them); sequence i of n is seeded with seed + i.
        if self.seed is not None and (not _is_int(self.seed) or not -MAX_SEED - 1 <= self.seed <= MAX_SEED - self.n):
            raise ValueError(f"seed must be an integer in [{-MAX_SEED - 1}, {MAX_SEED - self.n}], got {self.seed!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {k!r}")
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise ValueError(f"prediction must be a string, got {self.prediction!r}")
        b = self.thinking_token_budget
        if b is not None and (not _is_int(b) or b < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {b!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            _check_real(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    # ------------------------------------------------------------------ helpers
    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        from dataclasses import replace
        return replace(self, **changes)
