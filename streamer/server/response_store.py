"""The Responses API's store: responses kept in memory for GET / DELETE / input_items / cancel and for
`previous_response_id`, least recently used out first, bounded by count and by (serialized) size.

Each entry holds its whole conversation (earlier turns' items, then its own input), so a chain of responses
survives the eviction of its older links. The items are shared by reference between the entries of a chain (one
list of pointers each, never copied); the size bound counts them once per entry, which overestimates and so
errs on the safe side.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from streamer.server.protocol import dumps

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as GET returns it (a background one's is replaced as it runs)
    input_items: list[dict[str, Any]]  # earlier turns' items + this request's input, instructions excluded
    task: Optional[asyncio.Task] = None  # a background response's generation, while it runs
    size: int = 0  # bytes, as last measured

    @property
    def id(self) -> str:
        return self.response["id"]

    def measure(self) -> int:
        self.size = len(dumps(self.response)) + len(dumps(self.input_items))
        return self.size


class ResponseStore:
    """max_count 0 stores nothing. An entry evicted or deleted while its background generation runs has that
    generation cancelled: no one could read its result."""

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must be >= 0, got {max_count} responses, {max_bytes} bytes")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_count > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        """Store (or re-measure) an entry as the most recently used, then evict down to the bounds."""
        if not self.enabled:
            return
        old = self._entries.pop(entry.id, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[entry.id] = entry
        self.bytes += entry.measure()
        while len(self._entries) > self.max_count or (self.bytes > self.max_bytes and self._entries):
            self._drop(next(iter(self._entries)))

    def refresh(self, entry: StoredResponse) -> None:
        """A stored entry changed (a background response ended): re-measure it, unless it is gone already."""
        if self._entries.get(entry.id) is entry:
            self.put(entry)

    def pop(self, response_id: str) -> Optional[StoredResponse]:
        return self._drop(response_id) if response_id in self._entries else None

    def _drop(self, response_id: str) -> StoredResponse:
        entry = self._entries.pop(response_id)
        self.bytes -= entry.size
        if entry.task is not None:
            entry.task.cancel()
        return entry
