"""OpenAI response shapes for completions and chat, streamed (chunks) and not (one response).

Each engine output becomes a `Piece` of one choice; a stream renders each piece as a chunk, a non-streamed
response folds the pieces into `Choice`s. Both go through the same code, so the joined stream always equals the
non-streamed response.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from streamer.engine.thinking import BEFORE, INSIDE, ThinkingBudget, ThinkTags
from streamer.outputs import Logprob, StreamOutput
from streamer.server.harmony import HarmonyParser
from streamer.server.reasoning import ReasoningMode
from streamer.server.tool_calls import ForcedToolCalls, make_parser

_MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps the same way


def _lp(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _chosen(entry: dict[int, Logprob], token_id: int) -> tuple[int, Logprob]:
    """The scored token's id and entry (the first entry if the token is missing)."""
    if token_id in entry:
        return token_id, entry[token_id]
    return next(iter(entry.items()))


def prompt_logprobs_json(entries: list) -> list[Optional[dict[str, dict[str, Any]]]]:
    """vLLM's shape: per prompt token None (the first) or {"token id": {logprob, rank, decoded_token}}."""
    return [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, best first (the sampled token is among them if ranked <= k)."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k]
    return sorted(ranked, key=lambda x: x[1].rank or 0)


@dataclass
class Piece:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Any  # completions: the legacy dict of lists; chat: a list of content entries; None: not asked
    finish_reason: Optional[str]
    stop_reason: int | str | None
    prompt_logprobs: Any = None  # vLLM's `prompt_logprobs` field, on a choice's first piece
    tool_calls: Optional[list[dict[str, Any]]] = None  # chat, with a tool-call parser: calls completed in this piece
    reasoning: Optional[str] = None  # chat, with a reasoning parser: reasoning text in this piece
    cumulative_logprob: float = 0.0  # of this piece's tokens, when the engine scored them (best_of ranks by it)
    prompt_index: int = 0  # which of the request's prompts the choice answers


@dataclass
class Choice:
    """A choice folded from its pieces, for a non-streamed response (appended in place: linear in the length)."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Any = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    prompt_logprobs: Any = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_pieces: list[str] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_index: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_pieces)

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece.text)
        if piece.reasoning:
            self.reasoning_pieces.append(piece.reasoning)
        self.token_ids += piece.token_ids
        self.cumulative_logprob += piece.cumulative_logprob
        self.prompt_index = piece.prompt_index
        lp = piece.logprobs
        if isinstance(lp, dict):
            self.logprobs = self.logprobs or {k: [] for k in lp}
            for k, v in lp.items():
                self.logprobs[k] += v
        elif isinstance(lp, list):
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += lp
        if piece.finish_reason is not None:
            self.finish_reason, self.stop_reason = piece.finish_reason, piece.stop_reason
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        for call in piece.tool_calls or ():
            # A streamed call's later deltas carry more of its arguments (same index): join them.
            known = next((c for c in self.tool_calls if c.get("index") == call.get("index")), None)
            if known is None:
                self.tool_calls.append({**call, "function": dict(call["function"])})
            else:
                known["function"]["arguments"] += call["function"].get("arguments", "")


class Format:
    object = ""
    chunk_object = ""

    def __init__(self, num_choices: int, top_logprobs: Optional[int], return_token_ids: bool,
                 prompt_logprobs: bool = False) -> None:
        self.num_choices = num_choices
        self.k = top_logprobs  # None: no logprobs
        self.return_token_ids = return_token_ids
        self.want_prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field asked for
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}" (exact where texts are not:
        # partial UTF-8 bytes, tokens that decode alike)
        self.tokens_as_ids = False
        # With return_token_ids: each prompt's token ids, returned as vLLM does (completions: on each choice, in
        # its first chunk; chat: beside the choices, in the first chunk)
        self.prompt_ids: Optional[list[list[int]]] = None
        self.sums_logprobs = False  # each piece's cumulative logprob (best_of ranks choices by it)

    def _name(self, token_id: int, lp: Optional[Logprob]) -> str:
        """A token as logprobs name it."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return _text(lp) if lp is not None else ""

    def piece(self, index: int, prompt_index: int, out: StreamOutput) -> Piece:
        lp = self._logprobs(index, out) if self.k is not None else None
        p = Piece(index, out.text, out.token_ids, lp, out.finish_reason, out.stop_reason, prompt_index=prompt_index)
        if self.sums_logprobs and out.logprobs:
            p.cumulative_logprob = sum(_chosen(e, t)[1].logprob for t, e in zip(out.token_ids, out.logprobs))
        if self.want_prompt_logprobs and out.prompt_logprobs is not None:
            p.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
        return p

    def response_extras(self, choices: list["Choice"]) -> dict[str, Any]:
        """Top-level fields of a non-streamed response beside `choices`."""
        return {}

    def usage(self, gen: Any) -> dict[str, Any]:
        """The response's `usage` (gen: its server.generation.Generation)."""
        return gen.usage()

    def _logprobs(self, index: int, out: StreamOutput) -> Any:
        raise NotImplementedError

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def first_chunk_extras(self) -> dict[str, Any]:
        """Top-level fields of a stream's first chunk beside its choices."""
        return {}

    def chunk_choice(self, p: Piece) -> Optional[dict[str, Any]]:
        """A streamed choice, or None when the piece carries nothing (a token held back mid-character)."""
        raise NotImplementedError

    def final_choice(self, index: int, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def _empty(self, p: Piece) -> bool:
        carries_tokens = (self.return_token_ids or self.k is not None) and p.token_ids
        return not p.text and p.finish_reason is None and not carries_tokens

    def _extras(self, d: dict[str, Any], finish: Optional[str], stop_reason: Any, token_ids: list[int]) -> dict:
        if finish is not None:
            d["stop_reason"] = stop_reason  # vLLM's extension: the stop string or token id that matched
        if self.return_token_ids:
            d["token_ids"] = token_ids
        return d


class CompletionFormat(Format):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, num_choices: int, top_logprobs: Optional[int], return_token_ids: bool,
                 echo_texts: Optional[list[str]] = None, n: int = 1,
                 decode_token: Optional[Callable[[int], str]] = None, prompt_logprobs: bool = False,
                 scored_only: bool = False) -> None:
        """scored_only: echo with max_tokens 0; the engine's one sampled token is left out of the response."""
        super().__init__(num_choices, top_logprobs, return_token_ids, prompt_logprobs)
        self.echo_texts, self.n, self.decode_token = echo_texts, n, decode_token
        self.scored_only = scored_only
        self._echoed: set[int] = set()
        self._ids_sent: set[int] = set()  # choices whose prompt_token_ids went out
        self._offsets = [0] * num_choices

    def piece(self, index: int, prompt_index: int, out: StreamOutput) -> Piece:
        if self.scored_only:
            finish = out.finish_reason if out.finish_reason in (None, "abort") else "length"
            out = replace(out, token_ids=[], text="", logprobs=[] if out.logprobs is not None else None,
                          finish_reason=finish, stop_reason=None)
        echo = self.echo_texts is not None and index not in self._echoed
        # Echo with logprobs: the prompt's tokens come first, the first one without a logprob (as OpenAI's).
        prompt_lp = (self._prompt_logprobs(index, out) if echo and self.k is not None
                     and out.prompt_logprobs is not None else None)
        p = super().piece(index, prompt_index, out)
        if echo:
            self._echoed.add(index)
            p.text = self.echo_texts[prompt_index] + p.text  # type: ignore[index]
            if prompt_lp is not None:
                for key, values in p.logprobs.items():
                    prompt_lp[key] += values
                p.logprobs = prompt_lp
        return p

    def _prompt_logprobs(self, index: int, out: StreamOutput) -> dict[str, list]:
        d: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(out.prompt_token_ids or [], out.prompt_logprobs or []):
            if entry is None:
                text = self.decode_token(tid) if self.decode_token is not None else ""
                self._add(d, index, f"token_id:{tid}" if self.tokens_as_ids else text, None, None)
            else:
                self._add(d, index, *self._scored(entry, tid))
        return d

    def _logprobs(self, index: int, out: StreamOutput) -> dict[str, list]:
        d: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(out.token_ids, out.logprobs or []):
            self._add(d, index, *self._scored(entry, tid))
        return d

    def _scored(self, entry: dict[int, Logprob], tid: int) -> tuple[str, float, dict[str, float]]:
        cid, chosen = _chosen(entry, tid)
        # vLLM's shape: the scored token is always listed. Tokens with the same text (partial UTF-8 bytes)
        # share a key: the likelier one keeps it, so the dict stays best-first.
        top: dict[str, float] = {}
        for t, lp in sorted([*_top(entry, self.k or 0), (cid, chosen)], key=lambda x: -x[1].logprob):
            top.setdefault(self._name(t, lp), _lp(lp.logprob))
        return self._name(cid, chosen), _lp(chosen.logprob), top

    def _add(self, d: dict[str, list], index: int, text: str, logprob: Optional[float],
             top: Optional[dict[str, float]]) -> None:
        d["tokens"].append(text)
        d["token_logprobs"].append(logprob)
        d["top_logprobs"].append(top)
        d["text_offset"].append(self._offsets[index])
        self._offsets[index] += len(text)

    def chunk_choice(self, p: Piece) -> Optional[dict[str, Any]]:
        if self._empty(p) and p.prompt_logprobs is None:
            return None
        d = {"index": p.index, "text": p.text, "logprobs": p.logprobs, "finish_reason": p.finish_reason}
        if p.prompt_logprobs is not None:
            d["prompt_logprobs"] = p.prompt_logprobs
        if self.prompt_ids is not None and p.index not in self._ids_sent:
            self._ids_sent.add(p.index)
            d["prompt_token_ids"] = self.prompt_ids[p.prompt_index]
        return self._extras(d, p.finish_reason, p.stop_reason, p.token_ids)

    def final_choice(self, index: int, c: Choice) -> dict[str, Any]:
        d = {"index": index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        if self.want_prompt_logprobs:
            d["prompt_logprobs"] = c.prompt_logprobs
        if self.prompt_ids is not None:
            d["prompt_token_ids"] = self.prompt_ids[c.prompt_index]
        return self._extras(d, c.finish_reason, c.stop_reason, c.token_ids)


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, num_choices: int, top_logprobs: Optional[int], return_token_ids: bool,
                 prompt_logprobs: bool = False, tool_calls: bool | str = False,
                 forced_tool: Optional[Any] = None, reasoning: Optional[ReasoningMode] = None,
                 tools: Optional[list[dict[str, Any]]] = None, harmony: bool = False) -> None:
        """tool_calls: a tool-call parser's name (True: hermes); reasoning: how to read reasoning out of the
        output (None: the server has no reasoning parser, and messages have no reasoning_content); tools: the
        request's (their schemas type some formats' arguments); harmony: the output is gpt-oss's channels
        (server/harmony.py reads reasoning, content and calls at once; `reasoning` then only says whether to
        include the reasoning)."""
        super().__init__(num_choices, top_logprobs, return_token_ids, prompt_logprobs)
        self._harmony = [HarmonyParser(tools=bool(tool_calls)) for _ in range(num_choices)] \
            if harmony and forced_tool is None else None
        # With a tool-call parser: each choice's text is read for tool calls as it streams. A forced tool call
        # (server/structured.ForcedTool) was generated as JSON and is read whole at the end.
        self._tools: Optional[list[Any]] = None
        if forced_tool is not None:
            self._tools = [ForcedToolCalls(forced_tool.name) for _ in range(num_choices)]
        elif tool_calls and self._harmony is None:
            name = "hermes" if tool_calls is True else str(tool_calls)
            self._tools = [make_parser(name, tools) for _ in range(num_choices)]
        # With a reasoning parser: each choice's text is split into reasoning and content first; tool calls are
        # read from the content only.
        self.reasoning = reasoning
        self._thoughts: Optional[list[ThinkingBudget]] = None  # counting reasoning tokens (count_reasoning)
        self._think = [reasoning.splitter() for _ in range(num_choices)] \
            if reasoning is not None and self._harmony is None else None

    def count_reasoning(self, tags: ThinkTags, inside: bool, split: bool = True) -> None:
        """Count each choice's reasoning tokens (between the parser's tags, as the vocabulary spells them) for
        usage.completion_tokens_details.reasoning_tokens; inside: the prompt opened the reasoning; split: False
        where the output is not read for reasoning (none is counted)."""
        self._thoughts = [ThinkingBudget(tags, None, INSIDE if inside else BEFORE)
                          for _ in range(self.num_choices if split else 0)]
        self._seen: list[list[int]] = [[] for _ in range(self.num_choices)]

    @property
    def reasoning_tokens(self) -> Optional[int]:
        return None if self._thoughts is None else sum(t.used for t in self._thoughts)

    def usage(self, gen: Any) -> dict[str, Any]:
        u = gen.usage()
        if self._thoughts is not None:
            u["completion_tokens_details"] = {**u.get("completion_tokens_details", {}),
                                              "reasoning_tokens": self.reasoning_tokens}
        return u

    def piece(self, index: int, prompt_index: int, out: StreamOutput) -> Piece:
        p = super().piece(index, prompt_index, out)
        if self._thoughts:
            seen, thought = self._seen[index], self._thoughts[index]
            for t in out.token_ids:
                seen.append(t)
                thought.feed(seen)
        if self._harmony is not None:
            parser = self._harmony[index]
            thought, p.text, calls = parser.feed(p.text, final=p.finish_reason is not None)
            if thought and self.reasoning is not None and self.reasoning.include:
                p.reasoning = thought
            p.tool_calls = calls or None
            if p.finish_reason == "stop" and parser.num_calls:
                p.finish_reason = parser.finish_reason
            return p
        if self._think is not None and self._think[index] is not None:
            thought, p.text = self._think[index].feed(p.text, final=p.finish_reason is not None)  # type: ignore
            if thought and self.reasoning is not None and self.reasoning.include:
                p.reasoning = thought
        if self._tools is not None:
            parser = self._tools[index]
            p.text, calls = parser.feed(p.text, final=p.finish_reason is not None)
            p.tool_calls = calls or None
            if p.finish_reason == "stop" and parser.num_calls:
                p.finish_reason = parser.finish_reason
        return p

    def _logprobs(self, index: int, out: StreamOutput) -> list[dict[str, Any]]:
        content = []
        for tid, entry in zip(out.token_ids, out.logprobs or []):
            cid, chosen = _chosen(entry, tid)
            text = self._name(cid, chosen)
            content.append({"token": text, "logprob": _lp(chosen.logprob), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": name, "logprob": _lp(lp.logprob), "bytes": list(name.encode())}
                                             for t, lp in _top(entry, self.k or 0) for name in [self._name(t, lp)]]})
        return content

    def opening_chunks(self) -> list[dict[str, Any]]:
        """OpenAI's first delta of each choice carries the role."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.num_choices)]

    def chunk_choice(self, p: Piece) -> Optional[dict[str, Any]]:
        if self._empty(p) and not p.tool_calls and not p.reasoning:
            return None
        delta: dict[str, Any] = {"reasoning_content": p.reasoning} if p.reasoning else {}
        if p.text:
            delta["content"] = p.text
        if p.tool_calls:
            delta["tool_calls"] = p.tool_calls
        d = {"index": p.index, "delta": delta,
             "logprobs": {"content": p.logprobs} if p.logprobs is not None else None,
             "finish_reason": p.finish_reason}
        return self._extras(d, p.finish_reason, p.stop_reason, p.token_ids)

    def response_extras(self, choices: list[Choice]) -> dict[str, Any]:
        # vLLM's place for them in a chat response: beside the choices, once (every choice has the same prompt).
        extras = self.first_chunk_extras()
        if self.want_prompt_logprobs:
            extras["prompt_logprobs"] = choices[0].prompt_logprobs if choices else None
        return extras

    def first_chunk_extras(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_ids[0]} if self.prompt_ids is not None else {}

    def final_choice(self, index: int, c: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if self.reasoning is not None:  # as vLLM: null when there is none; no content when it was all reasoning
            message["reasoning_content"] = c.reasoning or None
            if not c.text:
                message["content"] = None
        if c.tool_calls:  # OpenAI: the calls without their stream index; no content when only whitespace is left
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in c.tool_calls]
            message["content"] = c.text if c.text.strip() else None
        d = {"index": index, "message": message,
             "logprobs": {"content": c.logprobs or []} if self.k is not None else None,
             "finish_reason": c.finish_reason}
        return self._extras(d, c.finish_reason, c.stop_reason, c.token_ids)
