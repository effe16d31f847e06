"""Priority scheduling: lower value first, preemption of the lowest-priority request, aging against starvation."""
from __future__ import annotations

import pytest

from streamer import LLM, SamplingParams

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _run(engine, max_steps=10_000):
    finished_at: dict[str, int] = {}
    first_token_at: dict[str, int] = {}
    for step in range(max_steps):
        if not engine.has_unfinished():
            break
        for u in engine.step():
            rid = u.req.request_id
            first_token_at.setdefault(rid, step)
            if u.finished:
                finished_at[rid] = step
    return first_token_at, finished_at


@pytest.mark.parametrize("limit", ["seats", "blocks"])
def test_high_priority_preempts_and_finishes_first(llama_dir, limit):
    args = dict(max_num_seqs=2) if limit == "seats" else dict(num_kv_blocks=4, block_size=8)
    llm = LLM(str(llama_dir), dtype="float32", scheduling_policy="priority", **args)
    e = llm.engine
    for i in range(6):
        e.add_request(f"low{i}", [5 + i] * 12, P, priority=5)
    e.step()
    e.step()
    assert e.scheduler.num_running >= 1 and e.scheduler.num_waiting >= 1  # full: a queue of low priority
    e.add_request("high", [99] * 12, P, priority=0)
    first, done = _run(e)
    assert first["high"] == 0, "the high-priority request must start at the very next step"
    assert all(done["high"] < done[f"low{i}"] for i in range(2, 6))
    assert len(done) == 7  # everyone finishes
    assert e.scheduler.num_preemptions >= 1
    assert e.kv.pool.num_free == e.kv.num_blocks


def test_fcfs_ignores_priority(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_num_seqs=1)
    e = llm.engine
    e.add_request("a", [5] * 4, P, priority=9)
    e.add_request("b", [6] * 4, P, priority=0)
    _, done = _run(e)
    assert done["a"] < done["b"]


def test_offline_priority_argument(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate([[5] * 4, [6] * 4, [7] * 4], P, priority=[3, 1, 2])
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("aging", [None, 4.0])
def test_aging_bounds_the_wait(llama_dir, monkeypatch, aging):
    """A steady stream of priority-0 requests (one every 2 steps, as fast as they are served); one priority-3
    request. Without aging it starves for as long as the stream lasts; with aging (1 level per 4 s, 1 s per
    step) it counts as arriving 3 * 4 s later, so it is served soon after that."""
    clock = FakeClock()
    import streamer.core.scheduler as sched_mod
    import streamer.engine.input_processor as engine_mod  # (it stamps arrival times)
    monkeypatch.setattr(engine_mod.time, "monotonic", clock)
    monkeypatch.setattr(sched_mod.time, "monotonic", clock)
    llm = LLM(str(llama_dir), dtype="float32", scheduling_policy="priority", max_num_seqs=1,
              priority_aging=aging)
    e = llm.engine
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    e.add_request("high-0", [5] * 4, short, priority=0)
    e.add_request("low", [6] * 4, short, priority=3)
    served_at = None
    for step in range(40):
        clock.t += 1.0
        if step % 2 == 0:
            e.add_request(f"high-{step + 1}", [7] * 4, short, priority=0)
        for u in e.step():
            if u.req.request_id == "low" and served_at is None:
                served_at = step
    if aging is None:
        assert served_at is None, "without aging the low-priority request starves under the stream"
    else:
        assert served_at is not None and served_at <= 3 * aging + 4
