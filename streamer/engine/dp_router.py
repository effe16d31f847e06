"""The data-parallel router's policy: which replica takes a request (streamer/engine/data_parallel.py runs it).

Pure bookkeeping, no processes and no I/O, so that unit and property tests drive it directly. Each replica's view:
whether it is up, its requests in flight as the router counts them (exact and current: incremented when a request is
sent, decremented when it ends), how many of them its engine last reported running, its KV cache usage, and the block
hashes its prefix cache holds (from its BlockStored / BlockRemoved / AllBlocksCleared events, core/kv_events.py).

Policies (`--dp-routing`):
- ``cache_aware`` (default, SGLang's cache-aware rule): while the replicas are balanced, the one holding the longest
  prefix of the request's block-hash chain takes it (at least `cache_threshold` of its blocks; ties and misses go to
  the least loaded). When the best match is hot (its requests in flight above `balance_rel` x the idlest's +
  `balance_abs`), the least loaded takes it instead: a hot prefix spreads to the other replicas, whose caches then
  hold it too (ties then go to the least loaded), instead of pinning all traffic to one.
- ``least_loaded``: the smallest waiting * 4 + running (vLLM's data-parallel load score), ties to the lowest index.
- ``round_robin``: each up replica in turn.
Any policy: a request with a session key (the affinity header) goes to its key's replica by rendezvous hashing,
stable while that replica is up, and only its keys move when it goes down.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Sequence

from streamer.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

POLICIES = ("cache_aware", "least_loaded", "round_robin")


class NoReplicaError(RuntimeError):
    """Every data-parallel replica is down."""


@dataclasses.dataclass
class ReplicaView:
    index: int
    up: bool = True
    inflight: int = 0  # sequences sent and not finished (the router's own count)
    running: int = 0  # as the replica last reported
    kv_usage: float = 0.0
    blocks: set = dataclasses.field(default_factory=set)  # block hashes its prefix cache holds (or soon will)

    @property
    def waiting(self) -> int:
        return self.inflight - min(self.running, self.inflight)

    @property
    def load(self) -> int:
        """vLLM's score, waiting * 4 + running, from the router's current count of what is in flight."""
        running = min(self.running, self.inflight)
        return 4 * (self.inflight - running) + running

    def match(self, chain: Sequence[bytes]) -> int:
        """How many leading blocks of the chain this replica's cache holds."""
        n = 0
        for h in chain:
            if h not in self.blocks:
                break
            n += 1
        return n


def rendezvous_pick(key: str, candidates: Sequence[int]) -> int:
    """Highest-random-weight hashing: the replica a session key sticks to among `candidates`."""
    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{i}\x00{key}".encode(), digest_size=8).digest()
    return max(candidates, key=weight)


class Router:
    def __init__(self, num_replicas: int, policy: str = "cache_aware", *, cache_threshold: float = 0.5,
                 balance_abs: int = 4, balance_rel: float = 2.0) -> None:
        # (balance_rel 2: at 1.5 a replica holding 6 of 8 requests in flight was hot, and the spill of a cold
        # prefix to the other replica evicted one of that replica's prefixes there: prefix hit rate 0.84 vs 0.94 at
        # 2.0 on bench/data_parallel.py's prefix workload, 400 requests; the hot-prefix balance held either way)
        if policy not in POLICIES:
            raise ValueError(f"dp routing policy must be one of {POLICIES}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.policy = policy
        self.replicas = [ReplicaView(i) for i in range(num_replicas)]
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._rr = 0
        # counters for metrics and benches
        self.routed = [0] * num_replicas
        self.routed_by_cache = 0

    # ------------------------------------------------------------------ what the replicas report
    def up(self) -> list[ReplicaView]:
        return [r for r in self.replicas if r.up]

    def mark_up(self, index: int) -> None:
        """Replica `index` is back (restarted): routable again, with nothing cached and nothing in flight."""
        r = self.replicas[index]
        r.up = True
        r.blocks.clear()
        r.inflight = r.running = 0
        r.kv_usage = 0.0

    def mark_down(self, index: int) -> None:
        r = self.replicas[index]
        r.up = False
        r.blocks.clear()
        r.inflight = r.running = 0

    def report(self, index: int, running: int, kv_usage: float) -> None:
        r = self.replicas[index]
        r.running, r.kv_usage = running, kv_usage

    def apply_events(self, index: int, events: Sequence[KVEvent]) -> None:
        blocks = self.replicas[index].blocks
        for ev in events:
            if isinstance(ev, BlockStored):
                blocks.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                blocks.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()

    def started(self, index: int, seqs: int = 1) -> None:
        self.replicas[index].inflight += seqs

    def finished(self, index: int, seqs: int = 1) -> None:
        r = self.replicas[index]
        r.inflight = max(r.inflight - seqs, 0)

    # ------------------------------------------------------------------ the choice
    def choose(self, chain: Sequence[bytes] = (), session: Optional[str] = None) -> int:
        """The replica for a request whose prompt's block-hash chain is `chain` (NoReplicaError: none is up).
        The chosen replica is assumed to hold the chain from now on (it will once the prompt is scheduled), so
        requests right behind it with the same prefix follow it."""
        up = self.up()
        if not up:
            raise NoReplicaError("no data-parallel replica is up")
        if session is not None:
            pick = rendezvous_pick(session, [r.index for r in up])
        elif self.policy == "round_robin":
            pick = up[self._rr % len(up)].index
            self._rr += 1
        elif self.policy == "least_loaded":
            pick = least_loaded(up).index
        else:
            pick = self._cache_aware(up, chain)
        self.routed[pick] += 1
        if chain and self.policy == "cache_aware":
            self.replicas[pick].blocks.update(chain)
        return pick

    def _cache_aware(self, up: list[ReplicaView], chain: Sequence[bytes]) -> int:
        idlest = least_loaded(up)
        if not chain:
            return idlest.index
        best = max(up, key=lambda r: (r.match(chain), -r.load, -r.index))
        matched = best.match(chain)
        if matched == 0 or matched < self.cache_threshold * len(chain):
            return idlest.index  # (no replica holds enough of it: the least loaded one caches it)
        if self.hot(best, idlest):
            return idlest.index
        self.routed_by_cache += 1
        return best.index

    def hot(self, r: ReplicaView, idlest: ReplicaView) -> bool:
        """Whether `r` is too far ahead of the idlest replica to take more work for its cache's sake (in requests
        in flight: the waiting * 4 weighting would call a replica hot over a report's lag)."""
        return r.inflight > self.balance_rel * idlest.inflight + self.balance_abs


def least_loaded(replicas: Sequence[ReplicaView]) -> ReplicaView:
    return min(replicas, key=lambda r: (r.load, r.index))
