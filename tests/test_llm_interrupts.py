"""An `LLM` call that fails part-way (Ctrl-C, a failed step, a request refused after others were added) takes its
requests with it: the engine is left idle and whole, and the next call runs as on a fresh object."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamer import LLM, SamplingParams
from streamer.sampling_params import StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.seqs and not engine.groups
    engine.kv.check_consistency()
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(request, llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", async_scheduling=request.param, num_kv_blocks=64)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_step_failing_part_way_leaves_the_engine_whole(llm: LLM, error: type, monkeypatch) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    runner = llm.engine.runner
    calls = {"n": 0}

    def failing(real):
        def run(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:  # a few steps in: every request has pending tokens and KV blocks
                raise error("interrupted")
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(runner, "execute", failing(runner.execute))
    monkeypatch.setattr(runner, "launch", failing(runner.launch))
    with pytest.raises(error):
        llm.generate(prompts, GREEDY)
    assert calls["n"] == 4
    assert_idle(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert_idle(llm)


def test_a_request_refused_after_others_were_added_adds_nothing(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="("))  # (refused on adding)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [8, 9]], [GREEDY, bad])
    assert_idle(llm)
    out = llm.generate([[5, 6, 7]], GREEDY)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 12
