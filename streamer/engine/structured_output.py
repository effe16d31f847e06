"""Structured outputs: generation constrained to a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (Microsoft's guidance-ai; the backend vLLM and SGLang also ship): it compiles a
grammar against the tokenizer's vocabulary and, at each step, computes which tokens may come next as a bitmask
(one bit per token), lazily and in tens of microseconds, with no per-vocabulary precompilation. Writing our own
Earley parser with token-trie masks would be a project of its own, for no gain.

Who does what:
- `StructuredOutputsParams` (on `SamplingParams.structured_outputs`) says what the output must match.
- `GrammarCompiler` (one per engine) turns it into an llguidance grammar, checks it and compiles it, keeping the
  last 64 compiled grammars: a request gets a fresh matcher (`Grammar.matcher()`) copied from the cached one.
- `fill_bitmasks` computes the rows' masks on the host when a step is prepared; the sampler sets every token
  whose bit is 0 to -inf (`apply_bitmask`). The engine feeds each sampled token to its request's matcher and
  finishes the request when the grammar is complete.
"""
from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

if TYPE_CHECKING:  # imported where used: SamplingParams (and so `import streamer`) must not pull in torch
    import numpy as np
    import torch

assert sys.byteorder == "little", "the token bitmask is unpacked as little-endian bytes"
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_CACHE_SIZE = 64


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (`json`, a dict or its JSON text), a regex (Rust `regex` syntax), a list of
    `choice` strings, a `grammar` (Lark, as llguidance reads it, or GBNF), `json_object=True` (any JSON
    object), or a `structural_tag` (free text in which each trigger starts a tagged JSON segment: see
    `structural_tag_grammar`). Field names follow vLLM's StructuredOutputsParams."""

    json: Union[None, str, dict] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Union[None, str, dict] = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if (isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple))
                    or not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if self.structural_tag is not None:
            _structural_tags(self.structural_tag)  # its shape is checked now: a 400, not a failed request later

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def to_grammar(self, special_triggers: bool = True) -> str:
        """The llguidance grammar (its JSON form, or Lark). Raises ValueError for a schema that is not JSON.
        special_triggers: a structural tag's triggers spelled <...> are the vocabulary's special tokens."""
        import llguidance

        def from_schema(schema: Any) -> str:
            # JSON whitespace is compact unless the schema's "x-guidance" asks otherwise: free whitespace lets a
            # weak or unsure model write newlines until max_tokens (a common complaint about guided JSON).
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})

        if self.json_object:
            return from_schema({"type": "object"})
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
            return from_schema(schema)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        if self.structural_tag is not None:
            return llguidance.StructTag.to_grammar(_structural_tags(self.structural_tag),
                                                   assume_special=special_triggers)
        assert self.grammar is not None
        if "::=" in self.grammar:  # GBNF (llama.cpp's, xgrammar's): llguidance translates it to Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(self.grammar))
            except Exception as e:
                raise ValueError(f"structured_outputs.grammar: not a valid GBNF grammar: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


def _structural_tags(spec: Union[str, dict]) -> list[Any]:
    """vLLM's structural tag, {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}, as llguidance's
    StructTags: the output is free text until it writes a trigger; from there it must go on with the `begin` of a
    structure that starts with that trigger, a JSON value that fits its `schema` (or text its Lark `grammar` takes:
    ours), then its `end` (tool calls written in a model's own tags, e.g. begin "<function=get_weather>", end
    "</function>", trigger "<function=")."""
    import llguidance

    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    structures, triggers = (spec.get("structures"), spec.get("triggers")) if isinstance(spec, dict) else (None, None)
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers \
            or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_outputs.structural_tag must be {\"structures\": [{\"begin\", \"schema\", "
                         "\"end\"}, ...], \"triggers\": [non-empty strings]}")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or not isinstance(s.get("schema", {}), (dict, bool)) or not isinstance(s.get("grammar", ""), str):
            raise ValueError(f"structured_outputs.structural_tag.structures[{i}] must have a string begin and end "
                             "and a JSON schema object (or a Lark grammar string as `grammar`)")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structured_outputs.structural_tag.structures[{i}].begin {s['begin']!r} starts with "
                             f"none of the triggers {triggers}")
        if s.get("grammar"):  # (ours: a Lark grammar with a start rule, e.g. an XML call's parameters)
            body: Any = s["grammar"]
        else:
            schema = s.get("schema", {})
            body = {"x-guidance": {"whitespace_flexible": False}, **(schema if isinstance(schema, dict) else {})}
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], end=s["end"], grammar=body))
    return tags


class Grammar:
    """A compiled grammar; `matcher()` gives each sequence its own parser state."""

    def __init__(self, template: Any) -> None:
        self._template = template

    def matcher(self) -> Any:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles structured-output requests against one tokenizer's vocabulary (thread-safe: the async engine
    compiles off its event loop)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's logit width (it may pad the tokenizer's vocabulary)
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        # Built on first use: ~1 s for a 128k vocabulary, and most servers never see a structured request.
        if self._tokenizer is None:
            import llguidance
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """Raises ValueError naming structured_outputs when the grammar is invalid."""
        import llguidance

        source = params.to_grammar()
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
            tokenizer = self._llg_tokenizer()
        template = llguidance.LLMatcher(tokenizer, source, log_level=0)  # drops the GIL while compiling
        if template.is_error() and params.structural_tag is not None and "unknown special token" in \
                template.get_error():  # its <...> triggers are plain text in this vocabulary
            template = llguidance.LLMatcher(tokenizer, params.to_grammar(special_triggers=False), log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {_one_line(template.get_error())}")
        grammar = Grammar(template)
        with self._lock:
            self._cache[source] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _one_line(msg: str) -> str:
    """llguidance's error in one line: its first line and any "error: ..." detail (not the source excerpt)."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    if not lines:
        return "error"
    details = [ln[len("error:"):].strip() for ln in lines[1:] if ln.startswith("error:")]
    return lines[0].rstrip(":") + (": " + "; ".join(details) if details else "")


_EXECUTOR: Any = None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(matchers: list[Any], vocab_size: int) -> np.ndarray:
    """Each matcher's allowed next tokens as an int32 [R, ceil(V / 32)] bitmask (bit t % 32 of word t // 32),
    computed by llguidance's thread pool with the GIL released."""
    global _EXECUTOR
    import llguidance
    import numpy as np

    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    words = bitmask_words(vocab_size)
    out = np.empty((len(matchers), words), dtype=np.int32)
    _EXECUTOR.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.ctypes.data, words * 4,
                                      len(matchers))
    return out


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set each listed row's disallowed tokens (bit 0 in its [W] int32 mask) to -inf, in place; returns `logits`.
    `rows` ascending (as `np.flatnonzero` gives them)."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(bitmask, vocab, on_host=bitmask.device.type == "cpu")
    if len(rows) == logits.shape[0]:  # every row follows a grammar (rows are then 0..B-1)
        return logits.masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, on_host: bool) -> torch.Tensor:
    """int32 [R, W] bitmask -> bool [R, vocab]. On the host numpy's unpackbits (~2 ms for 256 x 128k tokens,
    100x torch's shifts there); on a device, shifts: bit t % 32 of word t // 32 is bit t % 8 of byte t // 8
    (little-endian), so bytes are unpacked, one byte per token in the intermediate rather than four."""
    import numpy as np
    import torch

    if on_host:
        bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_)).to(bitmask.device)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    return ((bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(len(bitmask), -1)[:, :vocab].bool()
