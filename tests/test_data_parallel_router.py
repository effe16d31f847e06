"""The data-parallel router's policies (streamer/engine/dp_router.py), driven without processes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from streamer.core.request import Request
from streamer.engine.data_parallel import cpu_shares, merge_metrics
from streamer.engine.dp_router import NoReplicaError, ReplicaView, Router, rendezvous_pick
from streamer.sampling_params import SamplingParams


def chain(ids: list[int], salt=None) -> list[bytes]:
    return Request("r", ids, SamplingParams(max_tokens=1), 1, cache_salt=salt, block_size=16).block_hashes


def test_load_is_waiting_times_four_plus_running():
    r = ReplicaView(0, inflight=10, running=3)
    assert (r.waiting, r.load) == (7, 7 * 4 + 3)
    assert ReplicaView(0, inflight=2, running=5).load == 2  # (a stale report of more running than in flight)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=8))
def test_least_loaded_picks_the_min_of_waiting4_plus_running(loads):
    router = Router(len(loads), "least_loaded")
    for i, (inflight, running) in enumerate(loads):
        router.started(i, inflight)
        router.report(i, running, 0.0)
    pick = router.choose()
    scores = [4 * (f - min(r, f)) + min(r, f) for f, r in loads]
    assert scores[pick] == min(scores)
    assert pick == scores.index(min(scores))  # (ties: the lowest index)


def test_round_robin_cycles_over_up_replicas():
    router = Router(3, "round_robin")
    assert [router.choose() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.mark_down(1)
    assert set(router.choose() for _ in range(4)) == {0, 2}


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=20), st.integers(3, 6), st.data())
def test_affinity_header_sticks(key, n, data):
    """A session key goes to one replica whatever the policy and load; when that replica goes down only its keys
    move, and they come back when it is up again (rendezvous hashing)."""
    router = Router(n, data.draw(st.sampled_from(["cache_aware", "least_loaded", "round_robin"])))
    first = router.choose(session=key)
    for _ in range(5):
        router.started(first, 3)
        assert router.choose(chain(list(range(64))), session=key) == first
    others = [i for i in range(n) if i != first]
    down = data.draw(st.sampled_from(others))
    router.mark_down(down)
    assert router.choose(session=key) == first  # (another replica going down does not move it)
    router.mark_down(first)
    moved = router.choose(session=key)
    assert moved not in (first, down)
    assert moved == rendezvous_pick(key, [i for i in range(n) if i not in (first, down)])


def test_cache_aware_follows_the_cached_prefix():
    router = Router(2, "cache_aware")
    a, b = chain(list(range(64)) + [1, 2]), chain(list(range(100, 164)))
    router.apply_events(1, [BlockStored(a, None, [], 16)])
    assert router.choose(a) == 1
    assert router.routed_by_cache == 1
    assert router.choose(b) == 0  # (no replica holds it: the least loaded)
    router.started(1)
    router.started(0)
    assert router.choose(b) == 0  # (the router assumes the chosen replica caches what it was sent)
    router.apply_events(0, [BlockRemoved(b[2:])])
    assert router.replicas[0].match(b) == 2
    router.apply_events(1, [AllBlocksCleared()])
    assert router.replicas[1].match(a) == 0


def test_cache_aware_spills_a_hot_prefix_to_the_idlest():
    router = Router(2, "cache_aware")
    hot = chain(list(range(256)))
    router.apply_events(0, [BlockStored(hot, None, [], 16)])
    picks = []
    for _ in range(40):
        i = router.choose(hot)
        router.started(i)
        picks.append(i)
    loads = [r.inflight for r in router.replicas]
    assert max(loads) <= 2 * min(loads)
    assert picks[0] == 0 and 1 in picks


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5), st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.booleans()), min_size=20,
                                   max_size=200))
def test_a_hot_prefix_does_not_pin_all_traffic(n, ops):
    """However requests start and finish, with most traffic on one prefix the busiest replica stays within the
    balance rule of the idlest (cache_aware never sends to a replica that is hot)."""
    router = Router(n, "cache_aware")
    hot = chain(list(range(128)))
    cold = [chain(list(range(1000 * (k + 1), 1000 * (k + 1) + 64))) for k in range(4)]
    for is_hot, k, finish in ops:
        if finish:
            busiest = max(router.replicas, key=lambda r: r.inflight)
            router.finished(busiest.index)
            continue
        loads = [r.inflight for r in router.replicas]
        i = router.choose(hot if is_hot else cold[k])
        assert loads[i] <= router.balance_rel * min(loads) + router.balance_abs
        router.started(i)


def test_no_replica_up():
    router = Router(2)
    router.mark_down(0)
    router.mark_down(1)
    with pytest.raises(NoReplicaError):
        router.choose()


def test_bad_policy():
    with pytest.raises(ValueError, match="cache_aware"):
        Router(2, "random")


def test_chain_matches_the_engines_hashing_with_salt():
    ids = list(range(40))
    assert chain(ids) != chain(ids, salt="tenant")
    assert len(chain(ids)) == 2  # (full blocks only)


def test_cpu_shares():
    assert cpu_shares(2, [0, 1]) == [[0], [1]]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert cpu_shares(3, [0, 1]) == [[0, 1]] * 3


def test_merge_metrics_labels_each_engine():
    text = ('# HELP a A.\n# TYPE a gauge\na{model_name="m"} 1.0\n# HELP b B.\n# TYPE b counter\nb 2\n')
    merged = merge_metrics([("0", text), ("1", text.replace("1.0", "3.0"))])
    lines = merged.splitlines()
    assert lines.count("# HELP a A.") == 1
    assert 'a{engine="0",model_name="m"} 1.0' in lines and 'a{engine="1",model_name="m"} 3.0' in lines
    assert 'b{engine="1"} 2' in lines
    assert lines.index('a{engine="1",model_name="m"} 3.0') < lines.index("# HELP b B.")
