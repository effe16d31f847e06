"""The narrow interface between the model and an attention backend.

The model runner builds one `AttentionMetadata` per step; every attention layer hands its q/k/v and its slice
of the paged KV cache to the backend, which (1) writes the new k/v into the cache at `slot_mapping` and
(2) attends each query token over its request's cached context through `block_table`.

KV cache layout, per layer: `kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`;
`kv_cache[0]` holds keys, `kv_cache[1]` values. A token at position p of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Attention sinks (gpt-oss) are the layer's learned per-head logits, so they travel with each call (`sinks=`), not
in the static `AttentionSpec`.

FP8 KV cache (`kv_cache_dtype="fp8"`): the cache tensors are float8_e4m3fn; a backend stores k / k_scale and
v / v_scale (saturated at +-448) and reads them back times the scale. The scales are per layer, set on the
backend after loading (`KVScales`: the checkpoint's calibrated k_scale / v_scale, else 1.0).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int  # real tokens; rows beyond it (padding) have slot -1 and their output is ignored
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [num_reqs]: context length after this step (cached + scheduled)
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens (+ padding)]; -1 = do not write
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray  # host copies, for backends that plan on the CPU
    seq_lens_cpu: np.ndarray
    # What a backend derives from this step's metadata once and reuses in every layer (see torch_backend).
    backend_cache: dict = field(default_factory=dict)
    # The last position each query token sees, int32 [num_tokens] (host copy beside it), where some see past
    # themselves: Gemma 3's image tokens see their whole image. None: every query is plainly causal.
    causal_limit: Optional[torch.Tensor] = None
    causal_limit_cpu: Optional[np.ndarray] = None
    # Two-sided windows (AttentionSpec.two_sided_window): the causal limit cut to each token's window, same layout
    window_limit: Optional[torch.Tensor] = None
    window_limit_cpu: Optional[np.ndarray] = None
    # A relative position bias shared by every layer (MPNet's), float32 [num_heads, 2R + 1]: entry R + d of a head's
    # row is added to its scaled score of a key d positions after the query (d clamped to [-R, R]). The model
    # computes it from its weights each step (`position_bias_table`); None: no bias.
    position_bias: Optional[torch.Tensor] = None
    # Hybrid attention + Mamba models: what each Mamba layer needs of the step (None for other models)
    mamba: Optional["MambaStep"] = None
    # Encoder-decoder models (Whisper): what the cross-attention layers need of the step (None for other models)
    cross: Optional["CrossStep"] = None


@dataclass
class PrefillBatch:
    """A step's short prefill chunks padded at their ends to one length L, for recurrent layers to convolve and scan
    together (one call instead of one per chunk)."""

    rows: torch.Tensor  # int64 [N, L]: each chunk's tokens' rows in the step (past its end: its last row again)
    valid: torch.Tensor  # bool [N, L]: within the chunk
    lens: torch.Tensor  # int64 [N]
    slots: torch.Tensor  # int64 [N]: their state slots


@dataclass
class CrossStep:
    """A step's requests as an encoder-decoder model's cross-attention layers see them (models/whisper.py): each
    request's encoder output, projected to every layer's K and V, lives in its state slot."""

    rows: torch.Tensor  # int64 [R, L]: each request's query rows in the step, padded with its last row
    valid: Optional[torch.Tensor]  # bool [R, L]: its own rows (None: every request has L)
    slots: torch.Tensor  # int64 [R]
    # The slots' span [lo, hi) where they fill most of it: K / V read through a view, each request at span_pos
    # (its slot - lo). None: gather the slots.
    span: Optional[tuple[int, int]]
    span_pos: Optional[torch.Tensor]
    fresh_slots: Optional[torch.Tensor]  # int64 [F]: the requests computing their first token, filled first
    encoded: Optional[torch.Tensor]  # [F, positions, width]: their encoder outputs (the runner's: cached by audio)


@dataclass
class MambaStep:
    """A step's requests as the Mamba layers see them (models/mamba.py): each request's recurrent state lives in a
    slot of the layers' state tensors."""

    fresh_slots: Optional[torch.Tensor]  # int64 [F]: slots of requests computing their first token (zeroed first)
    # int64 [R1]: the token of each request that computes exactly one (`slice(None)`: every row, a decode-only step)
    decode_tokens: Optional[torch.Tensor | slice]
    decode_slots: Optional[torch.Tensor]  # int64 [R1]: their slots
    prefills: list[tuple[int, int, int]]  # (slot, first token, end) of each request computing several tokens
    # The decode slots' span [lo, hi) where they fill most of it: the layers then update the states in place through
    # a view of the span (no gathered copy written back), each request's row at `decode_pos` (its slot - lo) and the
    # span's other slots left as they are. None: gather the slots. (decode_pos None with a span: the rows are the
    # span's slots in order, nothing to lay out.)
    decode_span: Optional[tuple[int, int]] = None
    decode_pos: Optional[torch.Tensor] = None
    # The prefill chunks again, split for layers that batch them: the short ones (`PrefillBatch`), the others
    prefill_batch: Optional[PrefillBatch] = None
    long_prefills: list[tuple[int, int, int]] = field(default_factory=list)
    # States copied between slots before the step, batch after batch (int64 [2, N] each: from slots, to slots):
    # prefix caching's checkpoints (kv_cache.StateCheckpoints) and speculative decoding's snapshots (StateSnapshots),
    # in the order kv_cache.KVCacheManager.take_state_copies gives
    copies: tuple[torch.Tensor, ...] = ()

    @classmethod
    def decoding(cls, slots: torch.Tensor) -> "MambaStep":
        """A decode-only step inside a compiled graph (`DecodeBatch.state_slots`): every row one request's token.
        Its copies and fresh slots were dealt with before the graph ran (`HybridModel.prepare_states`)."""
        return cls(fresh_slots=None, decode_tokens=slice(None), decode_slots=slots, prefills=[])


class DecodeBatch(NamedTuple):
    """A decode-only step (one query token per request) as graph inputs, for a backend that attends inside the
    compiled model (`forward_decode`): the per-layer opaque op call, its Python and its guard checks go away."""

    write_slots: torch.Tensor  # int64 [2T]: each token's key slot, then its value slot (offset by the key half)
    block_table: torch.Tensor  # int32 [T * splits, W >= 2]: row t * splits + s = part s of request t's blocks
    seq_lens: torch.Tensor  # int64 [T]
    splits: int  # parts a lone request's context is split into (static: one graph per value)
    position_bias: Optional[torch.Tensor] = None  # AttentionMetadata.position_bias's (BLOOM's ALiBi table)
    # A hybrid model's recurrent layers: each request's state slot, int64 [T] (`MambaStep.decoding`)
    state_slots: Optional[torch.Tensor] = None


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
        sinks: float32 [num_heads] (gpt-oss): per head, one more logit in the softmax's denominator, with no value
        (the head may attend "nowhere"); None = off."""
        ...


FP8_KV_DTYPE = torch.float8_e4m3fn


class KVScales:
    """A backend's per-layer FP8 cache scales (plain floats: constants to a compiled graph). Set before the
    first step; without calibrated ones from the checkpoint they stay 1.0, which suits activations of the usual
    magnitude (|k|, |v| < 448)."""

    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: Optional[int] = None  # attend to at most this many most recent positions (incl. self)
    logit_softcap: Optional[float] = None  # scores -> tanh(scores / cap) * cap before the softmax; None/0 = off
    # Chunked local attention (Llama 4's rope layers): positions form chunks of this many, and a query at position p
    # attends only to keys in its own chunk, [(p // chunk) * chunk, p]; None = off
    attention_chunk: Optional[int] = None
    # The sliding window reaches both ways (an encoder's local layers, ModernBERT's): a query at p also sees keys up
    # to p + sliding_window - 1, within its prompt. The metadata's `window_limit` holds that last position per token.
    two_sided_window: bool = False
    # Plainly causal whatever the metadata's `causal_limit` says (Gemma 4's global layers, where image tokens do not
    # see each other both ways as in its sliding layers)
    causal_only: bool = False
    # The cache is an earlier layer's, which already stored this step's k / v (Gemma 4's KV sharing): read, never
    # write (a second store of the same values would make a compiled graph mutate the cache twice, which Inductor
    # does not do in place: it copied the whole cache every decode step)
    kv_shared: bool = False


# --------------------------------------------------------------------------------------------- forward context
# The runner publishes each step's metadata here instead of passing it through the model: the model's
# signature stays (input_ids, positions, kv_caches), so a compiled graph never guards on per-step ints. Per
# thread: a background compile's warm-up steps run beside the device thread's (ModelRunner).
class _Current(threading.local):
    meta: Optional[AttentionMetadata] = None


_current = _Current()


class forward_context:
    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def __enter__(self) -> AttentionMetadata:
        self._prev, _current.meta = _current.meta, self.meta
        return self.meta

    def __exit__(self, *exc) -> None:
        _current.meta = self._prev


def current_metadata() -> AttentionMetadata:
    meta = _current.meta
    if meta is None:
        raise RuntimeError("attention called outside a forward_context")
    return meta
