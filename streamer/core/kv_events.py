"""What the prefix cache stores and forgets, as events (vLLM's KV cache events: BlockStored, BlockRemoved,
AllBlocksCleared), for whoever routes by cache contents: the data-parallel router and KV-aware routers outside
(`--kv-events-config`, streamer/server/kv_events.py).

The block pool appends to an `EventLog` only when one is attached (off by default: no cost to the step); the engine
drains it once a step (`KVCacheManager.take_events`). A block's hash is the prefix cache's own chained hash
(core/request.py `hash_block`): equal hashes mean equal prefixes (tokens, LoRA, salt, images).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one request became findable: `block_hashes` in order, the first one's parent
    (None: it starts a sequence), and the tokens they hold (block_size per block)."""

    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None  # the LoRA adapter the blocks were computed with (None: the base model)
    lora_name: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer findable (evicted for reuse)."""

    block_hashes: list[bytes]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block forgotten (a prefix cache reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventLog:
    """The events since the last `take()`, evictions batched into one BlockRemoved per take."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self._removed: list[bytes] = []

    def stored(self, event: BlockStored) -> None:
        self._flush_removed()
        self.events.append(event)

    def removed(self, block_hash: bytes) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        self._removed.clear()
        self.events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        if self._removed:
            self.events.append(BlockRemoved(self._removed))
            self._removed = []

    def take(self) -> list[KVEvent]:
        """The events in the order they happened (a removal before a store of the same hash stays before it)."""
        self._flush_removed()
        out, self.events = self.events, []
        return out
