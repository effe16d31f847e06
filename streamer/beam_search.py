"""Beam search on top of the engine (as vLLM v1 does it): each step asks the engine for one token of every live beam
with its top 2 x width log-probabilities, and keeps the `width` best continuations by cumulative log-probability.
The prefix cache makes each step compute little more than the new token of each beam. Beams that end with an eos
token are set aside; at the end the finished ones and the survivors are ranked by cum_logprob / length **
length_penalty (transformers' score)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamer.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from streamer.engine import LLMEngine


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


@dataclass
class BeamSequence:
    token_ids: list[int]  # the generated tokens (the prompt excluded)
    cum_logprob: float
    text: str = ""
    finished: bool = False  # ended with an eos token

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(len(self.token_ids), 1) ** length_penalty


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)  # best first


def beam_search(llm_generate, engine: "LLMEngine", prompt_ids: list[list[int]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`llm_generate(prompts, sampling_params)`: LLM.generate (all beams of all prompts go in one call per step)."""
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    eos = engine.eos_token_ids
    live = [[BeamSequence([], 0.0)] for _ in prompt_ids]
    done: list[list[BeamSequence]] = [[] for _ in prompt_ids]
    limit = engine.max_model_len
    for _ in range(params.max_tokens):
        flat = [(i, b) for i, beams in enumerate(live) for b in beams if len(prompt_ids[i]) + len(b.token_ids) < limit]
        if not flat:
            break
        outs = llm_generate([{"prompt_token_ids": prompt_ids[i] + b.token_ids} for i, b in flat], step_params)
        candidates: list[list[BeamSequence]] = [[] for _ in prompt_ids]
        for (i, beam), out in zip(flat, outs):
            for tok, lp in out.outputs[0].logprobs[0].items():  # type: ignore[index]
                seq = BeamSequence(beam.token_ids + [tok], beam.cum_logprob + lp.logprob)
                if tok in eos and not params.ignore_eos:
                    seq.finished = True
                    done[i].append(seq)
                else:
                    candidates[i].append(seq)
        live = [sorted(c, key=lambda s: s.cum_logprob, reverse=True)[:width] for c in candidates]
    results = []
    for i, ids in enumerate(prompt_ids):
        ranked = sorted(done[i] + live[i], key=lambda s: s.score(params.length_penalty), reverse=True)[:width]
        for s in ranked:
            s.text = engine.tokenizer.decode(s.token_ids)
        results.append(BeamSearchOutput(list(ids), ranked))
    return results
