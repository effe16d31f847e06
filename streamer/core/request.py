"""A request as the scheduler sees it: token ids, progress (`num_computed_tokens`) and status.

One `Request` is one sequence. A prompt asked for with n > 1 becomes n requests that share the prompt
(and, through the prefix cache, its KV blocks)."""
from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from streamer.engine.thinking import ThinkingBudget
from streamer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


# (A tuple: `in` compares by identity in C, where a set would call Enum.__hash__, a Python function.)
_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


def hash_block(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """128+-bit chained hash of one full block: equal hashes mean equal prefixes (collisions negligible)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what fits in max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: Optional[str] = None
    block_size: int = 16
    hash_blocks: bool = True
    seq_index: int = 0  # which of the parent's n sequences this is
    parent_id: Optional[str] = None
    lora: Optional[Any] = None  # the LoRAAdapter it runs with (streamer/engine/lora.py)
    pooling: Optional[Any] = None  # PoolingParams (streamer/engine/pooling.py): an embedding request, it samples nothing
    # LongRoPE models: sequences longer than this rotate with the long factors (computed so from the start when the
    # prompt already is; see Scheduler)
    long_rope_threshold: Optional[int] = None
    # Images in the prompt (streamer/multimodal/inputs.py ImageInput): their placeholders' positions and pixels' hashes
    images: tuple = ()
    # The images attend to themselves both ways (Gemma 3): a prefill chunk may not end inside one (its later
    # tokens' keys would be missing).
    whole_images: bool = False
    whole_prompt: bool = False  # an encoder's: the prompt in one chunk, or not this step (see fit_chunk)
    # A client reads its tokens as they come (a stream): its decode steps are kept within the inter-token budget
    # (streamer/core/step_time.py); nobody waits on the gaps of a final-only one (offline, non-streamed responses).
    streamed: bool = False
    # An encoder-decoder model's encoder input (Whisper: speech.SpeechInput, the audio's log-mel features and their
    # hash), encoded by the step that computes the first token (read from the runner's encoder cache after that)
    encoder_input: Optional[Any] = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens that a step in flight will sample (async scheduling): the next step may already compute them,
    # reading them on the device. `append_token` (the token arriving) settles one.
    num_pending: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1 until admitted)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: Optional[float] = None

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[bytes] = []
        # Seeded sampling's generator: made by the runner on first use, dies with the request (nothing to free).
        self.generator: Optional[object] = None
        # logit_bias / allowed_token_ids as one [vocab] row added to the logits: built by the runner once.
        self.logit_adjust: Optional[object] = None
        # bad_words as token-id sequences (the engine encodes them): the last token of each is banned where the
        # output ends with the others.
        self.bad_words_ids: Optional[list[list[int]]] = None
        # A Whisper request's decoding rules (streamer/multimodal/speech.py DecodeRules: timestamps, begin_suppress_tokens)
        self.speech_rules: Optional[Any] = None
        # thinking_token_budget: where the sequence is in its reasoning and what is left of the budget.
        self.think: Optional[ThinkingBudget] = None
        # Structured outputs: this sequence's llguidance matcher (parser state), fed each token it samples.
        self.matcher: Optional[object] = None
        # Predicted Outputs: the prediction's tokens (drafted from where the output lines up with them), where the
        # last alignment ended, whether the pending drafts came from it, and how many of its tokens were accepted.
        self.prediction: Optional[np.ndarray] = None
        self.prediction_cursor = 0
        self.drafts_predicted = False
        self.prediction_accepted = 0
        # Speculative decoding: tokens proposed to follow (not yet known), verified by the next step.
        self.draft_token_ids: list[int] = []
        # A draft model's KV: how many leading positions of this sequence it holds (streamer/spec_decode/draft_model.py).
        self.num_draft_computed = 0
        # Hybrid models: verify steps in a row that accepted no draft, and steps left to decode without drafts
        # (EngineCore._settle_backoff)
        self.draft_misses = 0
        self.draft_backoff = 0
        # LongRoPE models: the sequence's KV is computed with the long factors (see Scheduler). Part of the blocks'
        # hashes: a block's KV depends on which factors rotated it.
        self.long_rope = self.long_rope_threshold is not None and len(self.prompt_token_ids) > self.long_rope_threshold
        self.lora_slot = 0  # the model's slot holding its adapter while it runs (0: none)
        # Hybrid models with prefix caching: where a prefill chunk should end (0: nowhere in particular), for the
        # recurrent state to be checkpointed there (kv_cache.KVCacheManager.chunk_stop; set at admission)
        self.chunk_stop = 0
        self._extend_hashes()

    # ------------------------------------------------------------------ state
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def embedded_prompt(self) -> bool:
        """The prompt is embeddings (streamer/engine/prompt_embeds.py): its placeholder ids stand for no tokens."""
        return bool(self.images) and self.images[0].features is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED  # (asked of every running request every step)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus those still in flight: what the scheduler may compute."""
        return len(self.all_token_ids) + self.num_pending

    def append_token(self, token_id: int) -> None:
        if self.num_pending:
            self.num_pending -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        if not self.hash_blocks:
            return
        bs = self.block_size
        for i in range(len(self.block_hashes), len(self.all_token_ids) // bs):
            parent = self.block_hashes[-1] if self.block_hashes else b""
            extra = self._first_block_extra() if i == 0 else b""
            if self.images:  # a block's KV depends on the images whose features it holds
                extra += b"".join(b"\x00img:" + im.hash for im in self.images
                                  if im.offset < (i + 1) * bs and im.end > i * bs)
            self.block_hashes.append(hash_block(parent, self.all_token_ids[i * bs:(i + 1) * bs], extra))

    def fit_chunk(self, start: int, n: int) -> int:
        """How many of n tokens from `start` one chunk may compute: all, or (with `whole_images`) up to the start
        of an image it would end inside, or (with `whole_prompt`) all only if they finish the prompt (0: not this
        step)."""
        if self.whole_prompt and start + n < self.num_tokens:
            return 0
        if self.whole_images:
            end = start + n
            for im in self.images:
                if im.offset < end < im.end:
                    return max(im.offset - start, 0)
        return n

    def reset_computed(self) -> None:
        """The KV is gone (preempted, or to be recomputed in fresh blocks): everything is computed again, by
        the model and by a draft model alike."""
        self.num_computed_tokens = 0
        self.num_draft_computed = 0

    def set_long_rope(self) -> None:
        """The sequence outgrew the short factors: its KV is recomputed with the long ones, under other hashes."""
        self.long_rope = True
        self.block_hashes = []
        self._extend_hashes()

    def _first_block_extra(self) -> bytes:
        """What else the KV depends on, mixed into the first block's hash (so into every later one): the tenant's
        salt and the LoRA adapter."""
        extra = self.cache_salt.encode() if self.cache_salt else b""
        if self.lora is not None:
            extra += b"\x00lora:%d" % self.lora.uid
        if self.long_rope:
            extra += b"\x00longrope"
        return extra
