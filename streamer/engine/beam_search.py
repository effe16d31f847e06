"""Beam search on top of the engine (as vLLM v1 does it): each step asks the engine for one token of every live beam
with its top 2 x width log-probabilities, and keeps the `width` best continuations by cumulative log-probability.
The prefix cache makes each step compute little more than the new token of each beam. Beams that end with an eos
token are set aside; at the end the finished ones and the survivors are ranked by cum_logprob / length **
length_penalty (transformers' score)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamer.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from streamer.engine.llm_engine import LLMEngine


class BeamSearchAborted(RuntimeError):
    """A step's request was aborted (the server shutting down, generation paused with mode "abort"): the search
    has no answer to give."""


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")


@dataclass
class BeamSequence:
    token_ids: list[int]  # the generated tokens (the prompt excluded)
    cum_logprob: float
    text: str = ""
    finished: bool = False  # ended with an eos token

    def score(self, length_penalty: float) -> float:
        """cum_logprob / length ** length_penalty; where length ** length_penalty leaves float range, computed in log
        space, so that no penalty raises: a score whose magnitude is past float range is -inf (+inf), one below it
        -0.0 (+0.0)."""
        c = self.cum_logprob
        if c == 0 or math.isnan(c):
            return c
        try:
            return c / max(len(self.token_ids), 1) ** length_penalty
        except (OverflowError, ZeroDivisionError):  # length ** length_penalty past float range, or below it
            pass
        try:
            return math.copysign(math.exp(self._log_magnitude(length_penalty)), c)
        except OverflowError:
            return math.copysign(math.inf, c)

    def rank(self, length_penalty: float) -> tuple[int, float]:
        """A sort key, larger is better, in the order of the scores computed exactly (where they saturate to the
        same float too): the score's sign, then its log magnitude (smaller is better for a negative score)."""
        c = self.cum_logprob
        if c == 0 or math.isnan(c):
            return 0, 0.0
        magnitude = self._log_magnitude(length_penalty)
        return (1, magnitude) if c > 0 else (-1, -magnitude)

    def _log_magnitude(self, length_penalty: float) -> float:
        """log |score| (cum_logprob not 0)."""
        return math.log(abs(self.cum_logprob)) - length_penalty * math.log(max(len(self.token_ids), 1))


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)  # best first


class BeamSearch:
    """The search's state for a batch of prompts; the caller runs each step's requests (`step_requests`) through
    the engine and hands their outputs to `advance`, in order (the offline API batches them in one generate call,
    the async engine runs them concurrently)."""

    def __init__(self, engine: "LLMEngine", prompt_ids: list[list[int]], params: BeamSearchParams) -> None:
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width,
                                       ignore_eos=True)
        self.live = [[BeamSequence([], 0.0)] for _ in prompt_ids]
        self.done: list[list[BeamSequence]] = [[] for _ in prompt_ids]
        self.steps = 0
        self._flat: list[tuple[int, BeamSequence]] = []

    def step_requests(self) -> list[dict]:
        """The prompts of this step (every live beam that still fits the context), or [] when the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        limit = self.engine.max_model_len
        self._flat = [(i, b) for i, beams in enumerate(self.live) for b in beams
                      if len(self.prompt_ids[i]) + len(b.token_ids) < limit]
        return [{"prompt_token_ids": self.prompt_ids[i] + b.token_ids} for i, b in self._flat]

    def advance(self, outs: list) -> None:
        """outs: one RequestOutput per step request (its one token's top log-probabilities)."""
        eos, width = self.engine.eos_token_ids, self.params.beam_width
        candidates: list[list[BeamSequence]] = [[] for _ in self.prompt_ids]
        for (i, beam), out in zip(self._flat, outs):
            if not out.outputs[0].logprobs:  # aborted before its one token
                raise BeamSearchAborted(f"the beam search was aborted at step {self.steps + 1} "
                                        f"(finish_reason {out.outputs[0].finish_reason!r})")
            for tok, lp in out.outputs[0].logprobs[0].items():
                seq = BeamSequence(beam.token_ids + [tok], beam.cum_logprob + lp.logprob)
                if tok in eos and not self.params.ignore_eos:
                    seq.finished = True
                    self.done[i].append(seq)
                else:
                    candidates[i].append(seq)
        self.live = [sorted(c, key=lambda s: s.cum_logprob, reverse=True)[:width] for c in candidates]
        self.steps += 1

    def results(self) -> list[BeamSearchOutput]:
        results = []
        for i, ids in enumerate(self.prompt_ids):
            ranked = sorted(self.done[i] + self.live[i], key=lambda s: s.rank(self.params.length_penalty),
                            reverse=True)[:self.params.beam_width]
            for s in ranked:
                s.text = self.engine.tokenizer.decode(s.token_ids)
            results.append(BeamSearchOutput(list(ids), ranked))
        return results
