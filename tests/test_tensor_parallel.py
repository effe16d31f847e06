"""Tensor parallelism on CPU: two processes (gloo), each holding half of every layer, against transformers and
against the single-process engine."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("transformers")  # the checkpoints and the oracle

from streamer import LLM, AsyncEngine, SamplingParams  # noqa: E402
from streamer.config import EngineConfig  # noqa: E402
from tests.checkpoints import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, [7], list(range(60, 100))]
MAX_NEW = 10


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", {}),  # qkv bias (sharded with its rows), tied embeddings
    ("qwen3", {"num_key_value_heads": 1}),  # one kv head for two ranks: replicated; per-head q/k norms
    ("phi3", {}),  # q/k/v and gate/up fused in the checkpoint: split, then sharded
    ("gemma3", {}),  # per-layer windows and rotary bases, four norms a layer
    ("qwen3_moe", {}),  # every expert split along its intermediate size, like a dense MLP
    ("mixtral", {}),
    ("gemma2", {}),  # soft-capped attention scores
    ("gpt_oss", {}),  # sinks split with their heads; expert biases, the down one added after the all-reduce
    ("llama4", {}),  # fused experts split along I, the shared expert as a dense MLP; chunked and NoPE layers
    ("glm4", {}),  # fused gate_up_proj split, then sharded; q/k/v biases; partial interleaved rotary
    ("glm4_moe", {}),  # DeepSeek-V3's router (whole on every rank), experts and the shared expert split along I
], ids=["qwen2", "qwen3-mqa", "phi3", "gemma3", "qwen3-moe", "mixtral", "gemma2", "gpt-oss", "llama4", "glm4",
        "glm4-moe"])
def test_tp2_matches_transformers(make_ckpt, family, overrides) -> None:
    path = make_ckpt(f"{family}_tp", family=family, seed=3, **overrides)
    # A small token budget: prompts are prefilled in chunks beside other requests' decodes.
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        runner = llm.engine.runner
        assert runner.tp_workers is not None and len(runner.tp_workers.procs) == 1
        assert runner.model.layers[0].self_attn.num_heads == 2  # this rank's half
        got = _greedy(llm, PROMPTS)
    assert got == hf_greedy(path, PROMPTS, MAX_NEW)


def test_tp2_sampling_matches_one_process_and_workers_stop(llama_dir) -> None:
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in range(3)]
    # Rank 0 alone masks a grammar's tokens: the workers never see it.
    params.append(SamplingParams(max_tokens=40, temperature=0.9, seed=3, structured_outputs={"regex": "[a-z]{3,9}!"}))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(llama_dir), dtype="float32") as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    threads = torch.get_num_threads()
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2)
    procs = llm.engine.runner.tp_workers.procs
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert got[3].outputs[0].finish_reason == "stop" and got[3].outputs[0].text.endswith("!")
    assert all(p.poll() is None for p in procs)
    llm.close()
    assert all(p.poll() == 0 for p in procs), "workers exit cleanly when the engine closes"
    assert torch.get_num_threads() == threads, "rank 0 gives back the threads it left to its workers"
    llm.close()  # idempotent


def test_tp2_speculative_matches_transformers(llama_dir) -> None:
    """Drafts verified across two ranks: every sampled position is broadcast to the workers."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], list(range(20, 30)) * 3]
    with LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, num_speculative_tokens=3,
             prompt_lookup_min=1) as llm:
        assert _greedy(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_NEW)
        assert llm.engine.num_accepted_tokens > 0


def test_tp2_compiled_matches_one_process(llama_dir) -> None:
    """Both ranks compile (their all-reduces inside the graphs); rank 0's warm-up steps compile the workers' too."""
    with LLM(str(llama_dir), dtype="float32") as one:
        want = _greedy(one, PROMPTS)
    with LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, enforce_eager=False) as llm:
        assert llm.engine.runner.compiled
        assert _greedy(llm, PROMPTS) == want


def test_tp2_async_scheduling_matches_one_process(llama_dir) -> None:
    """Step N+1 is sent to the workers before step N's tokens reach the host: every rank fills those pending
    tokens from its own copy of the last sampled ones, which rank 0 broadcasts after sampling."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    with LLM(str(llama_dir), dtype="float32") as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, async_scheduling=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.num_overlapped_steps > 0, "no step was ever queued behind a running one"
    assert got == want


def test_tp2_async_engine_streams(llama_dir) -> None:
    async def run() -> list[int]:
        async with AsyncEngine(str(llama_dir), dtype="float32", tensor_parallel_size=2) as engine:
            assert engine.engine.runner.tp_workers is not None
            tokens: list[int] = []
            async for out in engine.stream({"prompt_token_ids": PROMPTS[0]},
                                           SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)):
                tokens += out.token_ids
            procs = engine.engine.runner.tp_workers.procs
        assert all(p.poll() == 0 for p in procs), "stopping the engine stops its workers"
        return tokens

    with LLM(str(llama_dir), dtype="float32") as one:
        assert asyncio.run(run()) == _greedy(one, PROMPTS[:1])[0]


def test_tp_worker_lost_while_serving_fails_the_step(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2)
    worker = llm.engine.runner.tp_workers.procs[0]
    worker.kill()
    worker.wait()
    with pytest.raises(RuntimeError, match="rank 1 has exited"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=3, temperature=0.0))
    llm.close()


def test_tp_worker_that_dies_early_is_reported(llama_dir, monkeypatch) -> None:
    import torch.distributed

    import streamer.worker.parallel

    monkeypatch.setattr(streamer.worker.parallel.sys, "executable", "/bin/false")  # "workers" that exit at once
    with pytest.raises(RuntimeError, match=r"worker exited \(code 1\) before connecting"):
        LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_tp_bad_arguments(llama_dir) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=True)
    # 4 attention heads do not split over 3 ranks: refused before any worker starts.
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        LLM(str(llama_dir), dtype="float32", tensor_parallel_size=3)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_5_vl", "qwen2_audio"])
def test_tp2_vision_language_matches_one_process(ckpt_root, kind) -> None:
    """Images (and audio clips) under tensor parallelism: every rank encodes the step's images with its replicated
    encoder and places the features itself (Gemma 3: attending both ways, chunked; Qwen2.5-VL: M-RoPE positions;
    Qwen2-Audio: clips cut by the chunks); tokens and logprobs equal the single-process engine's."""
    import numpy as np
    from PIL import Image

    from tests.checkpoints import make_gemma3_vlm_checkpoint, make_qwen2_audio_checkpoint, make_qwen_vl_checkpoint
    rng = np.random.default_rng(21)
    if kind == "qwen2_audio":
        path = ckpt_root / kind
        build = make_qwen2_audio_checkpoint
        prompt = ("<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is it?<|im_end|>\n"
                  "<|im_start|>assistant\n")
        media = [{"audio": (rng.standard_normal(n) * 0.1).astype(np.float32)} for n in (8_000, 20_000)]
    elif kind == "gemma3":
        path = ckpt_root / "gemma3_vlm"
        build = make_gemma3_vlm_checkpoint
        prompt = "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n<start_of_turn>model\n"
    else:
        path = ckpt_root / kind
        build = lambda p: make_qwen_vl_checkpoint(p, kind)  # noqa: E731
        prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
                  "<|im_start|>assistant\n")
    if not (path / "config.json").exists():
        build(path)
    if kind != "qwen2_audio":
        media = [{"image": Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))}
                 for h, w in ((30, 48), (40, 40))]
    prompts = [{"prompt": prompt, "multi_modal_data": m} for m in media]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)

    def run(**kw) -> list[tuple[list[int], list[float]]]:
        with LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24, **kw) as llm:
            outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                          o.outputs[0].logprobs)]) for o in outs]
    one, two = run(), run(tensor_parallel_size=2)
    assert [t for t, _ in two] == [t for t, _ in one]
    assert np.allclose([x for _, lp in two for x in lp], [x for _, lp in one for x in lp], atol=1e-4)
