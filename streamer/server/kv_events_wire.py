"""vLLM's KV cache event wire types (vllm/distributed/kv_events.py), field for field: a `KVEventBatch` is a msgpack
array [ts, events, data_parallel_rank]; each event is a msgpack map tagged by its class name under "type"
(vLLM dropped `array_like` from the events in vllm-project/vllm#42892; llm-d and Dynamo decode both shapes).

Imported only when `--kv-events-config` turns the publisher on: msgspec is needed by nothing else. Subscribers may
decode with these types (`msgspec.msgpack.Decoder(KVEventBatch)`), as vLLM's example subscriber does with its own.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

# vLLM's ExternalBlockHash: bytes | int. Ours are the prefix cache's 16-byte chained hashes (core/request.py).
ExternalBlockHash = Union[bytes, int]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the events (tagged: {"type": "<class name>", ...})."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
