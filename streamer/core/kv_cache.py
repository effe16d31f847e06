"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request block tables, prefix caching.

Blocks are referenced by integer ids into the model runner's KV tensors. A block's `ref_cnt` counts the
requests using it. A free block that holds a full, hashed block of some earlier request stays findable
by its hash until it is evicted: the free list is an LRU (OrderedDict: O(1) removal from the middle when a
cache hit revives a block); blocks without a hash sit at its front and are reused first.
"""
from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from typing import Iterable, Optional

from streamer.core.kv_events import BlockStored, EventLog, KVEvent
from streamer.core.request import Request

logger = logging.getLogger("streamer")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id, for blocks in use or waiting in the LRU
        self.num_evictions = 0
        self.events: Optional[EventLog] = None  # attached to publish what is stored and evicted (kv_events.py)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache-hit blocks, reviving those that were waiting in the free list."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the block's old content is no longer findable
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self.events is not None:
                        self.events.removed(h)
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in eviction order (first released = first evicted)."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} released more often than referenced")
            if self.ref_cnt[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)

    def cache(self, b: int, block_hash: bytes) -> bool:
        """Make block b findable by its hash; False when that content is already cached (in another block)."""
        if block_hash not in self.cached and self.block_hash[b] is None:
            self.cached[block_hash] = b
            self.block_hash[b] = block_hash
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """Nothing cached is findable any more; blocks in use stay their requests' (whose later full blocks are
        cached again as they fill, but a lookup stops at the first block it misses, so never reaches them)."""
        for b in self.cached.values():
            self.block_hash[b] = None
            if self.ref_cnt[b] == 0:
                self.free.move_to_end(b, last=False)  # (reused before the cached blocks that come back later)
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()


class StateSlotPool:
    """Hybrid attention + Mamba models: the slots of the Mamba layers' per-request state tensors (models/mamba.py).
    A request takes one with its first KV blocks and gives it back with them (finish, abort, preemption: a preempted
    request recomputes from scratch, as with its KV). The pool's size bounds how many requests run at once."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # A min-heap: the lowest free slot first, so the running requests' slots stay packed (their decode states
        # are then updated through one view of their span: models/mamba.py)
        self.free_slots: list[int] = list(range(num_slots))
        self.slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self, request_id: str) -> int:
        slot = self.slot_of.get(request_id)
        if slot is None:
            if not self.free_slots:
                raise RuntimeError("no free state slot")
            slot = self.slot_of[request_id] = heapq.heappop(self.free_slots)
        return slot

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self.free_slots, slot)

    def check_consistency(self) -> None:
        held = list(self.slot_of.values())
        if len(set(held)) != len(held):
            raise AssertionError("two requests share a state slot")
        if set(held) & set(self.free_slots) or len(set(self.free_slots)) != len(self.free_slots):
            raise AssertionError("a state slot is both free and held, or free twice")
        if sorted(held + self.free_slots) != list(range(self.num_slots)):
            raise AssertionError("state slots lost or out of range")


class StateCheckpoints:
    """Prefix caching for hybrid / recurrent models: a cached block's KV is not enough to resume from, the recurrent
    state after it is needed too. Copies of request states taken at block boundaries ("checkpoints") live in slots of
    their own in the layers' state tensors, found by the hash of the block they end. A checkpoint slot is filled by a
    save (copied from a request's slot before the step's forward) and read by restores (copied into a request's
    slot); the model's layers do both copies (models/mamba.py `RecurrentMixer.begin_step`), saves first.

    Eviction is LRU, with one twist: a request that saves a checkpoint while it decodes pushes its previous
    decode-time checkpoint to the front (only the latest serves a follow-up turn of the conversation), so a long
    generation holds one slot, not one per block. Slots a step copies from or to are pinned until the step's copies
    are taken (`take`): a later save of the same step may not overwrite them."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        self.slots: list[int] = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # free; pop(): low first
        self.num_slots = num_slots
        self.first_slot = first_slot
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot; front = first evicted
        self.latest: dict[str, bytes] = {}  # request id -> its last decode-time checkpoint
        self.pinned: set[int] = set()
        self.saves: list[tuple[int, int]] = []  # (request slot, checkpoint slot)
        self.restores: list[tuple[int, int]] = []  # (checkpoint slot, request slot)
        self.num_saves = 0
        self.num_restores = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.lru

    def save(self, block_hash: bytes, src_slot: int, request_id: str, decoding: bool) -> None:
        """Checkpoint a request's state (its slot's content once the steps so far have run) as the state after the
        block `block_hash` ends."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return
        if decoding:  # (before a slot is taken: the superseded one is the first choice)
            prev = self.latest.get(request_id)
            if prev is not None and prev in self.lru:
                self.lru.move_to_end(prev, last=False)
            self.latest[request_id] = block_hash
        slot = self._take_slot()
        if slot is None:  # every slot is in this step's copies
            return
        self.lru[block_hash] = slot
        self.pinned.add(slot)
        self.saves.append((src_slot, slot))
        self.num_saves += 1

    def restore(self, block_hash: bytes, dst_slot: int) -> None:
        """Start a request (its slot) from the state after the block `block_hash` (which must be checkpointed)."""
        slot = self.lru[block_hash]
        self.lru.move_to_end(block_hash)
        self.pinned.add(slot)
        self.restores.append((slot, dst_slot))
        self.num_restores += 1

    def _take_slot(self) -> Optional[int]:
        if self.slots:
            return self.slots.pop()
        for h, slot in self.lru.items():  # least recently used first
            if slot not in self.pinned:
                del self.lru[h]
                return slot
        return None

    def forget(self, request_id: str) -> None:
        self.latest.pop(request_id, None)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies to run before the next step: (saves, restores)."""
        saves, restores = self.saves, self.restores
        self.saves, self.restores, self.pinned = [], [], set()
        return saves, restores

    def clear(self) -> None:
        self.slots.extend(self.lru.values())
        self.lru.clear()
        self.latest.clear()

    def check_consistency(self) -> None:
        held = list(self.lru.values())
        every = held + self.slots
        if sorted(every) != list(range(self.first_slot, self.first_slot + self.num_slots)):
            raise AssertionError("checkpoint slots lost, shared or out of range")


class StateSnapshots:
    """Speculative decoding on hybrid / recurrent models: a verify step runs the last known token and the drafts
    through the recurrent layers, so the state it leaves includes every draft, accepted or not. Before such a step
    each verifying request's state is copied into a snapshot slot (after the checkpoint slots); when a draft is
    rejected the state is copied back (`rollback`) and the request recomputes from where that step started: its
    known tokens since then, and new drafts, form its next chunk. Snapshots live for one step: slot j is the step's
    j-th verifying request's, and a rollback's copy runs before the next step's snapshots overwrite the slots."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        self.first_slot = first_slot
        self.num_slots = num_slots
        self.taken: dict[str, tuple[int, int]] = {}  # request id -> (snapshot slot, its computed tokens then)
        self.saves: list[tuple[int, int]] = []  # (request slot, snapshot slot)
        self.rollbacks: list[tuple[int, int]] = []  # (snapshot slot, request slot)
        self.num_rollbacks = 0

    def snapshot(self, verifying: list[tuple[str, int, int]]) -> None:
        """This step's verifying requests: (request id, state slot, computed tokens before the step)."""
        if len(verifying) > self.num_slots:
            raise RuntimeError(f"{len(verifying)} requests verify drafts, with {self.num_slots} snapshot slots")
        self.taken = {}
        for j, (rid, slot, computed) in enumerate(verifying):
            self.taken[rid] = (self.first_slot + j, computed)
            self.saves.append((slot, self.first_slot + j))

    def rollback(self, request_id: str, slot: int) -> int:
        """Restore the request's state (into `slot`) from before its verify step; returns that step's start."""
        snap, computed = self.taken.pop(request_id)
        self.rollbacks.append((snap, slot))
        self.num_rollbacks += 1
        return computed

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies to run before the next step: (rollbacks, snapshot saves)."""
        rollbacks, saves = self.rollbacks, self.saves
        self.rollbacks, self.saves = [], []
        return rollbacks, saves


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_slots: int = 0, checkpoint_slots: int = 0, snapshot_slots: int = 0,
                 kv_events: bool = False) -> None:
        """kv_events: log what the prefix cache stores and evicts, for `take_events` (core/kv_events.py).
        state_slots > 0: a hybrid model's Mamba state slots, held by requests beside their blocks. With prefix
        caching, checkpoint_slots more follow them (after one scratch slot): `StateCheckpoints`; with speculative
        decoding, snapshot_slots after those: `StateSnapshots`."""
        self.state = StateSlotPool(state_slots) if state_slots > 0 else None
        # (a hybrid model caches prefixes only where it has a checkpoint of the state)
        self.checkpoints = StateCheckpoints(state_slots + 1, checkpoint_slots) \
            if state_slots > 0 and checkpoint_slots > 0 and enable_prefix_caching else None
        if state_slots > 0 and self.checkpoints is None:
            enable_prefix_caching = False
        self.snapshots = StateSnapshots(state_slots + 1 + checkpoint_slots, snapshot_slots) \
            if state_slots > 0 and snapshot_slots > 0 else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        if kv_events and enable_prefix_caching:
            self.pool.events = EventLog()
        self.req_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a request registered in the cache
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        # Block tables changed since the last `take_changes()`: request id -> (request, first changed index;
        # 0 after a free). The persistent input batch mirrors the tables by replaying only these.
        self.changes: dict[str, tuple[Request, int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (new weights, a benchmark's cold start): later requests compute their whole
        prompt. Safe between steps: nothing a scheduled step reads is touched (a hybrid model's checkpoint copies
        are taken with the step). Returns how many cached blocks were forgotten."""
        n = len(self.pool.cached)
        self.pool.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        return n

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, in whole blocks, always leaving its last token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        hits = self._cached_chain(req)
        if self.checkpoints is not None:  # resume only where the recurrent state was checkpointed
            while hits and req.block_hashes[len(hits) - 1] not in self.checkpoints:
                hits.pop()
        return hits, len(hits) * self.block_size

    def _cached_chain(self, req: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix (not its last token's block)."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def chunk_stop(self, req: Request, num_hit: int) -> int:
        """Where a hybrid model's request admitted with `num_hit` cached tokens should end a prefill chunk (0: no
        stop), so that
        its state is checkpointed there (saves happen at chunk ends on block boundaries): where the cached KV chain
        ends, past the hit. Its prefix is shared with an earlier request, so likely with later ones, which then
        resume there. (Only sharing seen pays the extra step a stop costs: a first prompt has none.)"""
        if self.checkpoints is None:
            return 0
        end = len(self._cached_chain(req)) * self.block_size
        return end if end > num_hit else 0

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's prefix-cache lookup (for /metrics)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def can_fit(self, num_tokens: int, hit_blocks: list[int]) -> bool:
        if self.state is not None and not self.state.num_free:
            return False
        need = cdiv(num_tokens, self.block_size) - len(hit_blocks)
        revived = sum(1 for b in hit_blocks if self.pool.ref_cnt[b] == 0)
        return need <= self.pool.num_free - revived

    def allocate_slots(self, req: Request, num_new_tokens: int, hit_blocks: Optional[list[int]] = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the cache hits).
        Returns False, changing nothing, when the pool is short."""
        blocks = self.req_blocks.get(req.request_id, [])
        if not hit_blocks:  # the common decode case: usually the last block still has room
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size:
                if self.checkpoints is not None:
                    self._checkpoint(req)
                if self.enable_prefix_caching and total % self.block_size == 0:
                    self._cache_full_blocks(req, blocks, total)
                return True
        hit_blocks = hit_blocks or []
        num_computed = req.num_computed_tokens + len(hit_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(hit_blocks)
        revived = sum(1 for b in hit_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - revived:
            return False
        if self.state is not None and req.request_id not in self.state.slot_of:
            if not self.state.num_free:
                return False
            self.state.allocate(req.request_id)
        elif self.checkpoints is not None:
            self._checkpoint(req)
        if hit_blocks:
            if self.checkpoints is not None:
                self.checkpoints.restore(req.block_hashes[len(hit_blocks) - 1], self.state_slot(req.request_id))
            self.pool.touch(hit_blocks)
            blocks = blocks + hit_blocks
            self._num_cached_blocks[req.request_id] = len(blocks)
        if need > 0:
            blocks = blocks + self.pool.allocate(need)
        self._note_change(req, len(self.req_blocks.get(req.request_id, ())))
        self.req_blocks[req.request_id] = blocks
        # Register blocks that this step fills. Another request admitted in the same step may hit them:
        # the runner writes every token's K/V of a layer before any of that layer's attention reads.
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, total)
        return True

    def _cache_full_blocks(self, req: Request, blocks: list[int], num_tokens: int) -> None:
        done = self._num_cached_blocks.get(req.request_id, 0)
        full = min(num_tokens // self.block_size, len(req.block_hashes))
        stored = [i for i in range(done, full) if self.pool.cache(blocks[i], req.block_hashes[i])]
        if stored and self.pool.events is not None:
            self._log_stored(req, stored)
        if full > done:
            self._num_cached_blocks[req.request_id] = full

    def _log_stored(self, req: Request, stored: list[int]) -> None:
        """One BlockStored per run of consecutive block indices newly stored for `req`."""
        bs, hashes, tokens = self.block_size, req.block_hashes, req.all_token_ids
        lora, name = (req.lora.uid, req.lora.name) if req.lora is not None else (None, None)
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.pool.events.stored(BlockStored(  # type: ignore[union-attr]
                hashes[first:last + 1], hashes[first - 1] if first else None,
                list(tokens[first * bs:(last + 1) * bs]), bs, lora, name))

    def take_events(self) -> list[KVEvent]:
        """What the prefix cache stored and evicted since the last call ([] unless built with kv_events)."""
        return self.pool.events.take() if self.pool.events is not None else []

    def _checkpoint(self, req: Request) -> None:
        """A running request whose computed tokens end a block: its state (after the steps so far) is the state
        after that block. (A block whose last token is still in flight has no hash yet: no checkpoint.)"""
        done = req.num_computed_tokens
        k = done // self.block_size
        if done % self.block_size or k == 0 or k > len(req.block_hashes):
            return
        slot = self.state_slot(req.request_id)
        if slot >= 0:
            self.checkpoints.save(req.block_hashes[k - 1], slot, req.request_id,  # type: ignore[union-attr]
                                  decoding=done > req.num_prompt_tokens)

    def take_state_copies(self) -> Optional[list[list[tuple[int, int]]]]:
        """The state copies to run before the next step, [(from slot, to slot)] batches in order: rollbacks (a
        checkpoint taken now must see the state restored), checkpoint saves, checkpoint restores, snapshots (of the
        states the step starts from). None: no copies kinds at all (not a hybrid model)."""
        if self.checkpoints is None and self.snapshots is None:
            return None
        saves, restores = self.checkpoints.take() if self.checkpoints is not None else ([], [])
        rollbacks, snapshots = self.snapshots.take() if self.snapshots is not None else ([], [])
        return [rollbacks, saves, restores, snapshots]

    def snapshot_states(self, verifying: list[tuple[Request, int]]) -> None:
        """Speculative decoding on a hybrid model: this step's requests that verify drafts, each with its computed
        tokens before the step; their states are copied aside first (`StateSnapshots`)."""
        if self.snapshots is not None:
            self.snapshots.snapshot([(req.request_id, self.state_slot(req.request_id), start)
                                     for req, start in verifying])

    def reject_drafts(self, req: Request) -> None:
        """A speculative step rejected some of the request's drafts. Attention's KV past the accepted ones is simply
        overwritten later, but a recurrent state went through all of them: it goes back to its snapshot, and the
        request's computed tokens to where that step started. (Before the step's tokens are appended: a request
        they finish checkpoints its state as it leaves.)"""
        if self.snapshots is not None and req.request_id in self.snapshots.taken:
            req.num_computed_tokens = self.snapshots.rollback(req.request_id, self.state_slot(req.request_id))

    def _note_change(self, req: Request, first: int) -> None:
        prev = self.changes.get(req.request_id)
        self.changes[req.request_id] = (req, first if prev is None else min(first, prev[1]))

    def take_changes(self) -> dict[str, tuple[Request, int]]:
        changes, self.changes = self.changes, {}
        return changes

    def state_slot(self, request_id: str) -> int:
        """The request's Mamba state slot (-1: none, or not a hybrid model)."""
        return -1 if self.state is None else self.state.slot_of.get(request_id, -1)

    def free(self, req: Request) -> None:
        if self.checkpoints is not None:  # its state as it leaves (read before anything reuses the slot)
            self._checkpoint(req)
            self.checkpoints.forget(req.request_id)
        if self.state is not None:
            self.state.free(req.request_id)
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks is not None:
            self._note_change(req, 0)
            if self.enable_prefix_caching:  # blocks that accepted drafts filled, hashed only once verified
                self._cache_full_blocks(req, blocks, min(req.num_computed_tokens, len(req.all_token_ids) - 1))
        self._num_cached_blocks.pop(req.request_id, None)
        if blocks:
            # Tail first: when evicting, the end of a prefix chain goes before its (more shareable) start.
            self.pool.release(reversed(blocks))

    def check_consistency(self) -> None:
        """Invariants, for tests: ref counts match the block tables and free blocks have no references."""
        counts = [0] * self.pool.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b] += 1
        if counts != self.pool.ref_cnt:
            raise AssertionError("block ref counts do not match the block tables")
        for b in self.pool.free:
            if self.pool.ref_cnt[b] != 0:
                raise AssertionError(f"free block {b} is referenced")
        if len(self.pool.free) + sum(1 for c in counts if c > 0) != self.pool.num_blocks:
            raise AssertionError("blocks lost: neither free nor referenced")
        for h, b in self.pool.cached.items():
            if self.pool.block_hash[b] != h:
                raise AssertionError(f"cache map and block {b}'s hash disagree")
        if self.checkpoints is not None:
            self.checkpoints.check_consistency()
        if self.state is not None:
            self.state.check_consistency()
            if set(self.state.slot_of) != set(self.req_blocks):
                raise AssertionError("requests holding state slots != requests holding blocks")
