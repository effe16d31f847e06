"""AsyncEngine: streaming equals offline generation, early exit aborts, failures reach every caller."""
from __future__ import annotations

import asyncio
import threading

import pytest

from streamer import LLM, AsyncEngine, SamplingParams
from streamer.engine.async_engine import EngineDeadError, QueueFullError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [f"def f{i}(x): return x * {i}" for i in range(12)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def _collect(engine, prompt, params=GREEDY, **kw):
    ids, text, last = [], "", None
    async for out in engine.stream(prompt, params, **kw):
        ids += out.token_ids
        text += out.text
        last = out
    return ids, text, last


def _pool_whole(engine: AsyncEngine) -> bool:
    core = engine.engine
    return core.kv.pool.num_free == core.kv.num_blocks and not core.scheduler.has_work()


def test_concurrent_streams_match_offline(llama_dir):
    offline = LLM(str(llama_dir), dtype="float32").generate(PROMPTS, GREEDY)

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32", max_num_batched_tokens=32) as engine:
            results = await asyncio.gather(*[_collect(engine, p) for p in PROMPTS])
            assert _pool_whole(engine)
            return results

    results = run(main())
    for (ids, text, last), ref in zip(results, offline):
        assert ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert last.finish_reason == "length"
        assert last.usage["completion_tokens"] == 10
        assert last.usage["prompt_tokens"] == len(ref.prompt_token_ids)


def test_generate_n_and_request_id(llama_dir):
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            out = await engine.generate("hello", SamplingParams(n=2, max_tokens=5, seed=1, ignore_eos=True),
                                        request_id="abc")
            assert out.request_id == "abc" and len(out.outputs) == 2
            assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out.outputs)
            assert out.prompt_token_ids == engine.tokenizer.encode("hello")

    run(main())


def test_generate_returns_what_llm_generate_does(llama_dir):
    """The awaited RequestOutput carries what the offline one does: the prompt's text, the summed logprob of each
    sequence and the prompt's logprobs."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    want = LLM(str(llama_dir), dtype="float32").generate([{"prompt": "hello there"}], params)[0]

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            return await engine.generate({"prompt": "hello there"}, params)

    got = run(main())
    assert got.prompt == want.prompt == "hello there"
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].cumulative_logprob is not None
    assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
    assert got.prompt_logprobs[0] is None and set(got.prompt_logprobs[1]) == set(want.prompt_logprobs[1])


def test_break_and_cancel_abort_within_a_step(llama_dir):
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            agen = engine.stream("abc", long)
            async for _ in agen:
                break
            await agen.aclose()
            assert _pool_whole(engine)

            async def consume():
                async for _ in engine.stream("xyz", long):
                    pass

            task = asyncio.create_task(consume())
            for _ in range(100):
                await asyncio.sleep(0.01)
                if engine.engine.scheduler.num_running:
                    break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert _pool_whole(engine)
            # Explicit abort by id.
            stream = await engine.add_request("q", long, request_id="r1")
            await engine.abort("r1")
            items = [o async for o in stream]
            assert items and items[-1].finish_reason == "abort"
            assert _pool_whole(engine)
            # Still serving.
            ids, _, _ = await _collect(engine, "hello")
            assert len(ids) == 10

    run(main())


def test_validation_errors_raise_before_output(llama_dir):
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32", max_waiting=1) as engine:
            with pytest.raises(ValueError, match="empty"):
                await engine.add_request([], GREEDY)
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.add_request("x", SamplingParams(max_tokens=10 ** 6))
            first = await engine.add_request("a", GREEDY)  # waits until the loop schedules it
            with pytest.raises(QueueFullError):
                await engine.add_request("b", GREEDY)
            assert len([o async for o in first]) == 10
            ids, _, _ = await _collect(engine, "c")
            assert len(ids) == 10

    run(main())


def test_model_runs_on_device_thread(llama_dir):
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            runner = engine.engine.runner
            names = set()
            original = runner.launch

            def spy(*a, **kw):
                names.add(threading.current_thread().name)
                return original(*a, **kw)

            runner.launch = spy
            await _collect(engine, "hi")
            assert names and all(n.startswith("streamer-device") for n in names)
            assert threading.current_thread().name not in names

    run(main())


def test_device_failure_fails_every_caller(llama_dir):
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            await _collect(engine, "warm")

            def boom(*a, **kw):
                raise RuntimeError("device lost")

            engine.engine.runner.launch = boom
            results = await asyncio.gather(*[_collect(engine, p) for p in PROMPTS[:4]], return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) for r in results)
            assert not engine.is_alive
            with pytest.raises(EngineDeadError):
                await engine.add_request("more", GREEDY)

    run(main())


def test_final_only_outputs_come_whole_and_once(llama_dir):
    """A non-streamed request (`stream=False`; generate() uses it) gets one output per sequence, when it finishes,
    holding what the streamed one gets piece by piece: tokens, text (a stop string ends it), logprobs and prompt
    logprobs. Its TTFT is the engine's first-token time, and its inter-token gaps still reach the ITL histogram."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, stop=["x"], ignore_eos=True)]

    async def pieces(engine, p, stream):
        s = await engine.add_request("def g(x): return x", p, stream=stream)
        return [item async for item in s]

    def whole(items):
        by_seq: dict[int, list] = {}
        for it in items:
            by_seq.setdefault(it.index, []).append(it)
        return {i: (sum((it.token_ids for it in its), []), "".join(it.text for it in its),
                    sum((it.logprobs or [] for it in its), []), its[-1].finish_reason, its[-1].stop_reason,
                    next((it.prompt_logprobs for it in its if it.prompt_logprobs), None))
                for i, its in by_seq.items()}

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            itl = engine.metrics.itl
            for p in params:
                streamed = await pieces(engine, p, True)
                count, ttft_count = itl.count, engine.metrics.ttft.count
                final = await pieces(engine, p, False)
                assert len(final) == p.n and all(it.finished for it in final)
                assert len(streamed) > len(final)
                assert whole(final) == whole(streamed)
                tokens = sum(len(it.token_ids) for it in final)
                assert itl.count - count == tokens - p.n  # one gap between each two tokens of each sequence
                assert engine.metrics.ttft.count - ttft_count == p.n
            assert _pool_whole(engine)

    run(main())


def test_stream_interval_batches_streamed_tokens(llama_dir):
    """stream_interval=4: a streamed sequence's first token goes out alone, then 4 at a time, the rest with the
    finish; the whole is what every-token streaming gives. An abort hands out the held tokens with it. Latency
    metrics still count every token."""
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=1)

    async def collect(engine, **kw):
        return [it async for it in await engine.add_request("def h(y):", params, **kw)]

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            every = await collect(engine)
        async with AsyncEngine(str(llama_dir), dtype="float32", stream_interval=4) as engine:
            count = engine.metrics.itl.count
            sizes: list[int] = []
            dispatch = engine._dispatch

            def spy(updates):  # (what the engine hands out; a lagging consumer may get several merged)
                sizes.extend(len(u.new_token_ids) for u in updates)
                dispatch(updates)

            engine._dispatch = spy
            items = await collect(engine)
            assert sizes == [1, 4, 4, 4, 1]
            assert engine.metrics.itl.count - count == 13
            # An abort mid-way: what arrives is exactly what the engine generated.
            stream = await engine.add_request("def h(y):", params.clone(max_tokens=200))
            state = engine.engine.seqs[stream.request_id]
            while state.req.num_output_tokens < 7 or state.held is None:  # (e.g. 1 handed out, 4 more, 2 held)
                await asyncio.sleep(0.001)
            generated = list(state.req.output_token_ids)
            engine.abort_now(stream.request_id)
            got = []
            async for it in stream:
                got += it.token_ids
            assert got == generated and it.finish_reason == "abort"
            assert _pool_whole(engine)
        return every, items

    every, items = run(main())
    assert sum((it.token_ids for it in items), []) == sum((it.token_ids for it in every), [])
    assert "".join(it.text for it in items) == "".join(it.text for it in every)
    assert sum((it.logprobs for it in items), []) == sum((it.logprobs for it in every), [])
    assert items[-1].finish_reason == "length" and len(every) == 14


def test_stream_interval_must_be_positive():
    from streamer.config import EngineConfig
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineConfig(stream_interval=bad)


def test_outputs_that_pile_up_go_out_merged():
    """A consumer that fell behind gets one item per sequence for what piled up, in order; another sequence's item,
    or an error, stops the merge and comes next."""
    from streamer.engine.async_engine import RequestStream
    from streamer.outputs import StreamOutput

    class Engine:
        aborted: list[str] = []

        def abort_now(self, rid):
            self.aborted.append(rid)

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(Engine(), "r", 2, [1, 2], queue)
        for item in (StreamOutput("r", 0, [5], "a", [{}]), StreamOutput("r", 0, [6, 7], "bc", [{}, {}]),
                     StreamOutput("r", 1, [8], "x"), StreamOutput("r", 1, [9], "y", finish_reason="length"),
                     StreamOutput("r", 0, [3], "d", [{}], finish_reason="stop", stop_reason="d")):
            queue.put_nowait(item)
        got = [(o.index, o.token_ids, o.text, o.finish_reason) async for o in stream]
        assert got == [(0, [5, 6, 7], "abc", None), (1, [8, 9], "xy", "length"), (0, [3], "d", "stop")]
        assert stream.completion_tokens == 6 and stream.finished

        queue = asyncio.Queue()
        stream = RequestStream(Engine(), "s", 1, [1], queue)
        queue.put_nowait(StreamOutput("s", 0, [5], "a"))
        queue.put_nowait(RuntimeError("engine died"))
        assert (await stream.__anext__()).token_ids == [5]
        with pytest.raises(RuntimeError, match="engine died"):
            await stream.__anext__()
        assert Engine.aborted == ["s"]

    run(main())


def test_aborted_non_streamed_request_gets_what_it_generated(llama_dir):
    """An abort hands a non-streamed sequence what it generated so far (it had not been handed anything)."""
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            stream = await engine.add_request("def k(z):", SamplingParams(max_tokens=200, ignore_eos=True),
                                              stream=False)
            state = engine.engine.seqs[stream.request_id]
            while state.req.num_output_tokens < 3:
                await asyncio.sleep(0.001)
            generated = list(state.req.output_token_ids)
            engine.abort_now(stream.request_id)
            items = [it async for it in stream]
            assert len(items) == 1 and items[0].finish_reason == "abort"
            assert items[0].token_ids == generated and items[0].text == state.text != ""
            assert _pool_whole(engine)

    run(main())


def test_stats_log_line_while_busy_and_quiet_when_idle(llama_dir, caplog):
    """log_stats_interval: vLLM's periodic line (throughputs, queue, KV usage, prefix-cache hit rate) while there is
    work; none while the engine idles; none at all by default."""
    import logging

    from streamer.engine.metrics import StatsLogger

    def lines():
        return [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32", log_stats_interval=0.05) as engine:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            await asyncio.gather(*[engine.generate(p, params) for p in [*PROMPTS[:3], " ".join(PROMPTS)]])
            await asyncio.sleep(0.3)  # the interval that saw the end, then idle ones
            busy = len(lines())
            await asyncio.sleep(0.3)
            assert len(lines()) == busy  # idle: quiet
            # The line's numbers: one more request, with a prompt seen before (its blocks hit the cache).
            stats = StatsLogger(engine.metrics, engine.stats)
            await engine.generate(" ".join(PROMPTS), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
            return busy, stats.line()

    with caplog.at_level(logging.INFO, logger="streamer"):
        busy, line = run(main())
    assert busy >= 1 and "Running:" in lines()[0] and "KV cache usage:" in lines()[0]
    assert any(not line.startswith("Avg prompt throughput: 0.0") for line in lines())
    assert line is not None and "Avg generation throughput: 0.0 tokens/s" not in line
    assert not line.endswith("Prefix cache hit rate: 0.0%")  # the prompt's full blocks came from the cache
    caplog.clear()

    async def quiet():
        async with AsyncEngine(str(llama_dir), dtype="float32") as engine:
            await engine.generate(PROMPTS[1], SamplingParams(max_tokens=3))
            await asyncio.sleep(0.1)
    with caplog.at_level(logging.INFO, logger="streamer"):
        run(quiet())
    assert lines() == []
