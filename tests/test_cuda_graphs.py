"""Decode steps through `DecodeGraphs` (persistent buffers, padded batch sizes, metadata fixed at capture) give the
same tokens as plain steps. On CPU the graphs are not captured (`capture=False`: the same buffers and the same
metadata object every call, through the Triton backend under the interpreter); on CUDA they are, by the engine."""
from __future__ import annotations

import random

import pytest

from streamer_kernels.testing import configure_for_tests

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.worker.cuda_graphs import capture_sizes  # noqa: E402


def test_capture_sizes_ladder():
    assert capture_sizes(0) == []
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


def _run(llama_dir, backend: str, graphs: bool, async_scheduling: bool):
    rng = random.Random(21)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]} for _ in range(6)]
    # Different lengths: the decode batch shrinks 6 -> 1, through sizes with and without padding, and past the
    # largest graph.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 4, 6, 9, 9)]
    llm = LLM(str(llama_dir), dtype="float32", device=DEVICE.type, attention_backend=backend,
              async_scheduling=async_scheduling, cuda_graph_max_batch=4 if graphs else 0)
    runner = llm.engine.runner
    if graphs and DEVICE.type == "cpu":
        runner.enable_decode_graphs(capture_sizes(4), capture=False)
    assert (runner.graphs is not None) == graphs
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return outs, runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graphs_match_plain_steps(request, async_scheduling):
    pytest.importorskip("transformers")  # the checkpoint fixtures are built with it
    llama_dir = request.getfixturevalue("llama_dir")
    ref, _ = _run(llama_dir, "torch", False, async_scheduling)
    outs, runner = _run(llama_dir, "triton", True, async_scheduling)
    assert outs == ref
    assert runner.graphs.sizes == [1, 2, 4]
    # Decode steps run 6, 5, 4, 3 (padded to 4), 2, 2, 2, 2 requests: the last six through graphs.
    assert runner.graphs.num_replays == 6
    assert all(g is None for g in runner.graphs.graphs.values()) == (DEVICE.type == "cpu")
    # Padding rows wrote only the scratch block: the pool's blocks hold nothing but the requests' K/V, which
    # the equal outputs vouch for; the scratch block was written.
    assert runner.kv_caches[0][:, runner.scratch_block].abs().sum() > 0


def test_decode_graphs_with_lora_adapters_match_plain_steps(request, tmp_path):
    """With LoRA on, the graphs read each row's adapter slot from a persistent buffer and gather its weights: a
    batch mixing two adapters and the base model decodes as plain steps do (one slot each, swapped as needed)."""
    pytest.importorskip("peft")
    from streamer import LoRARequest
    from tests.lora_adapters import ALL_LINEARS, make_adapter
    llama_dir = request.getfixturevalue("llama_dir")
    folders = {n: make_adapter(llama_dir, tmp_path / n, seed, r=4, alpha=8, targets=ALL_LINEARS)
               for n, seed in (("a", 5), ("b", 6))}
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))]} for _ in range(6)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 4, 6, 6, 7, 7)]
    loras = [None if n is None else LoRARequest(n, str(folders[n])) for n in ("a", None, "b", "a", None, "b")]

    def run(backend: str, graphs: bool):
        llm = LLM(str(llama_dir), dtype="float32", device=DEVICE.type, attention_backend=backend,
                  cuda_graph_max_batch=4 if graphs else 0, enable_lora=True, max_loras=2, max_lora_rank=4)
        if graphs and DEVICE.type == "cpu":
            llm.engine.runner.enable_decode_graphs(capture_sizes(4), capture=False)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        return outs, llm.engine.runner

    ref, _ = run("torch", False)
    outs, runner = run("triton", True)
    assert outs == ref
    assert runner.graphs.num_replays > 0 and runner.graphs.lora_slots is not None
    base = [o.outputs[0].token_ids for o in LLM(str(llama_dir), dtype="float32").generate(prompts, params)]
    assert [o for o, lo in zip(ref, loras) if lo is None] == [o for o, lo in zip(base, loras) if lo is None]
    assert [o for o, lo in zip(ref, loras) if lo] != [o for o, lo in zip(base, loras) if lo]


def test_decode_graphs_for_a_hybrid_model_match_transformers(make_ckpt):
    """A hybrid model (Gated DeltaNet + attention) decodes through the graphs: each row's state slot from a
    persistent buffer, the padding rows in the scratch slot, the state checkpoints of prefix caching (block 8) and
    a 1-token prompt's fresh state made before the replay. Its greedy tokens are transformers'. (Compiling is
    refused: the Triton backend has no inline decode graph for a hybrid.)"""
    from streamer.worker.cuda_graphs import DecodeGraphs
    from tests.checkpoints import hf_greedy
    from tests.parity import assert_state_freed, greedy, prompts_of_lengths
    path = make_ckpt("graphs_qwen3_next", family="qwen3_next")
    prompts = prompts_of_lengths((3, 9, 30), seed=7)
    lone = prompts_of_lengths((1,), seed=8)
    ref = hf_greedy(path, prompts + lone, 10)
    llm = LLM(str(path), dtype="float32", device=DEVICE.type, attention_backend="triton", block_size=8,
              cuda_graph_max_batch=4, num_kv_blocks=64, enforce_eager=False)
    runner = llm.engine.runner
    assert not runner.compiled  # (no inline decode graph on the Triton backend: the graphs run the eager model)
    if DEVICE.type == "cpu":
        runner.enable_decode_graphs(capture_sizes(4), capture=False)
    assert isinstance(runner.graphs, DecodeGraphs) and runner.graphs.state_slots is not None
    prepared = []
    real = runner.model.prepare_states
    runner.model.prepare_states = lambda pairs, fresh: prepared.append((len(pairs), fresh is not None)) \
        or real(pairs, fresh)
    assert greedy(llm, prompts, 10) == ref[:3]  # 3 requests: padded to 4
    replays = runner.graphs.num_replays
    assert replays > 0 and any(n for n, _ in prepared), "no graph replay, or no checkpoint copied before one"
    assert greedy(llm, lone, 10) == ref[3:]  # a 1-token prompt: its first step is a decode-only one, fresh
    assert runner.graphs.num_replays == replays + 10 and any(f for _, f in prepared)
    assert_state_freed(llm)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_decode_graphs_for_a_moe_model_match_transformers(make_ckpt, family):
    """MoE decode batches replay as graphs: the experts run as streamer_kernels.fused_moe (the pairs sorted by expert
    on the device, launch shapes fixed by the batch size, no host sync), so a batch of 4 with 8 (token, expert)
    pairs over 4 experts is captured too. Greedy tokens are transformers'."""
    from streamer.models.moe import SparseMoE
    from tests.checkpoints import hf_greedy
    from tests.parity import greedy, prompts_of_lengths
    path = make_ckpt(family, family=family)
    prompts = prompts_of_lengths((3, 9, 17, 30), seed=9)
    ref = hf_greedy(path, prompts, 8)
    llm = LLM(str(path), dtype="float32", device=DEVICE.type, attention_backend="triton", cuda_graph_max_batch=4)
    runner = llm.engine.runner
    if DEVICE.type == "cpu":
        runner.enable_decode_graphs(capture_sizes(4), capture=False)
    assert all(m.fused_kernel for m in runner.model.modules() if isinstance(m, SparseMoE))
    assert greedy(llm, prompts, 8) == ref
    assert runner.graphs.num_replays >= 7  # every decode step of the batch of 4
