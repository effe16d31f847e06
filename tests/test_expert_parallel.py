"""Expert parallelism (`enable_expert_parallel`, `-ep`; vLLM's meaning) on CPU: two ranks (gloo) where the sparse
MoE layers hold whole experts, half each, and everything else is tensor-parallel as usual. fp32 greedy tokens equal
the single-process engine's (offline, and through `streamer serve` with the openai client, across two "nodes");
each rank reports the expert bytes it holds; a moe_intermediate_size that tensor parallelism cannot split is served;
fewer experts than ranks is refused, naming the field, before any worker starts; a dense model ignores the flag."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # the checkpoints

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.engine_args import add_engine_args, engine_kwargs  # noqa: E402
from streamer.models.layers import ParallelContext  # noqa: E402
from streamer.models.moe import SparseMoE  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, [7], list(range(60, 100))]
MAX_NEW = 10
ENGINE = dict(dtype="float32", max_num_batched_tokens=16)  # prompts prefilled in chunks beside others' decodes


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _one_process(path: Path) -> tuple[list[list[int]], int]:
    """The single-process engine's greedy tokens, and the expert bytes it holds."""
    with LLM(str(path), **ENGINE) as llm:
        return _greedy(llm), llm.engine.runner.parameter_bytes()["experts"]


def _sparse_layers(llm: LLM) -> list[SparseMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]


CASES = {
    "qwen3_moe": lambda make, root: make("qwen3_moe_ep", family="qwen3_moe", seed=3),
    "mixtral": lambda make, root: make("mixtral_ep", family="mixtral", seed=3),
    # hybrids: Gated DeltaNet + a gated shared expert (tensor-parallel as a dense MLP); short convolutions
    "qwen3_next": lambda make, root: make("qwen3_next", family="qwen3_next"),
    "lfm2_moe": lambda make, root: make("recurrent_lfm2_moe", family="lfm2_moe"),
}


@pytest.fixture(scope="module")
def ckpt(make_ckpt, ckpt_root):
    import tests.test_recurrent_families  # noqa: F401  (registers lfm2_moe)
    return lambda name: CASES[name](make_ckpt, ckpt_root)


@pytest.mark.parametrize("name", list(CASES))
def test_ep2_matches_one_process_and_halves_expert_bytes(ckpt, tmp_path, name) -> None:
    path = ckpt(name)
    want, whole = _one_process(path)
    with LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE) as llm:
        layers = _sparse_layers(llm)
        assert layers and all(m.expert_parallel and m.expert_range == range(0, m.num_experts // 2) for m in layers)
        # whole experts (the intermediate size not split), half of them
        assert all(m.inter_split == 1 and m.expert_shapes[1][0] == m.num_experts // 2 for m in layers)
        got = _greedy(llm)
        ranks = llm.engine.runner.ranks_parameter_bytes(tmp_path)  # each rank's own count
    assert got == want
    assert [r["experts"] for r in ranks] == [whole // 2, whole // 2], (ranks, whole)


def test_ep_serves_what_tp_cannot_split(make_ckpt, tmp_path) -> None:
    """moe_intermediate_size 33 does not divide over 2 ranks: tensor parallelism refuses, expert parallelism keeps
    each expert whole."""
    path = make_ckpt("qwen3_moe_i33", family="qwen3_moe", seed=3, moe_intermediate_size=33)
    want, whole = _one_process(path)
    with pytest.raises((ValueError, RuntimeError), match="moe_intermediate_size 33 is not divisible by 2 ranks"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)
    with LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE) as llm:
        assert _greedy(llm) == want
        ranks = llm.engine.runner.ranks_parameter_bytes(tmp_path)
    assert [r["experts"] for r in ranks] == [whole // 2, whole // 2]


def test_fewer_experts_than_ranks_is_refused_before_workers_start(make_ckpt, tmp_path, monkeypatch) -> None:
    src = make_ckpt("mixtral_ep", family="mixtral", seed=3)
    path = tmp_path / "one_expert"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_local_experts=1, num_experts_per_tok=1)
    (path / "config.json").write_text(json.dumps(cfg))
    import streamer.worker.model_runner as mr

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(mr, "TensorParallelWorkers", no_workers)
    with pytest.raises(ValueError, match="num_local_experts 1 .* less than tensor_parallel_size 2"):
        LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)


def test_dense_model_ignores_the_flag(llama_dir, caplog) -> None:
    """As vLLM: nothing to place, a warning, and every layer tensor-parallel as without the flag."""
    want, _ = _one_process(llama_dir)
    with caplog.at_level(logging.WARNING, logger="streamer"):
        with LLM(str(llama_dir), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE) as llm:
            assert llm.engine.runner.tp_workers is not None and not llm.engine.runner.expert_parallel
            assert _greedy(llm) == want
    assert "not a mixture of experts: enable_expert_parallel is ignored" in caplog.text


def test_flag_without_tensor_parallelism_is_a_no_op(make_ckpt) -> None:
    path = make_ckpt("qwen3_moe_ep", family="qwen3_moe", seed=3)
    with LLM(str(path), enable_expert_parallel=True, **ENGINE) as llm:
        assert llm.engine.runner.tp_workers is None
        assert all(not m.expert_parallel and m.local_experts == m.num_experts for m in _sparse_layers(llm))


def test_cli_flags() -> None:
    import argparse
    for argv, want in (([], False), (["--enable-expert-parallel"], True), (["-ep"], True)):
        p = argparse.ArgumentParser()
        add_engine_args(p)
        assert engine_kwargs(p.parse_args(argv))["enable_expert_parallel"] is want
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False"):
        LLM(None, enable_expert_parallel="yes")


@pytest.mark.parametrize("variant", ["float", "cpu_packed", "int4"])
def test_local_experts_sum_to_the_whole(variant, monkeypatch) -> None:
    """In one process, no collective: each of 2 ranks' layers (3 experts: a 1 / 2 split) loads its experts from the
    same per-expert tensors and runs its part of the routed sum (other ranks' (token, expert) pairs skipped); the
    parts add up to the single-rank layer's output, for each of the experts ops (float, oneDNN-packed, 4-bit)."""
    torch.manual_seed(0)
    hidden, inter, experts = 128, 256, 3
    tensors = {(e, p): torch.randn(inter, hidden) / 8 if p != "down_proj" else torch.randn(hidden, inter) / 8
               for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")}

    def build(rank: int, size: int, ep: bool) -> SparseMoE:
        monkeypatch.setattr(ParallelContext, "rank", rank)
        monkeypatch.setattr(ParallelContext, "size", size)
        monkeypatch.setattr(ParallelContext, "expert_parallel", ep)
        m = SparseMoE(hidden, inter, experts, top_k=2, norm_topk_prob=True)
        for (e, p), t in tensors.items():
            w = m.w2 if p == "down_proj" else m.w13
            w.weight_loader(w, t, f"experts.{e}.{p}", f"{e}.{p}")
        if variant == "cpu_packed":
            if not torch.backends.mkldnn.is_available():
                pytest.skip("no oneDNN")
            m.pack_for_cpu()
            assert m.cpu_packed is not None
        elif variant == "int4":
            if not m.quantize_int4(group_size=64):
                pytest.skip("the int4 kernels refuse this shape here")
        return m

    whole = build(0, 1, False)
    parts = [build(r, 2, True) for r in range(2)]
    assert [list(m.expert_range) for m in parts] == [[0], [1, 2]]
    for tokens in (1, 7):  # a lone token's path, and the grouped one
        x = torch.randn(tokens, hidden)
        weights, ids = whole.route(x)
        want = whole.run_experts(x, weights, ids)
        got = sum(m.run_experts(x, weights, ids) for m in parts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_two_nodes_over_http_match_one_process(make_ckpt) -> None:
    """`streamer serve -tp 2 -ep` as a head and a headless node (two processes on loopback, as
    tests/test_multi_node.py): only the head is given -ep (its config reaches the other node's rank); the openai
    client's greedy tokens equal the single-process engine's."""
    openai = pytest.importorskip("openai")
    from tests.test_multi_node import _free_port, _serve
    path = make_ckpt("qwen3_moe_i33", family="qwen3_moe", seed=3, moe_intermediate_size=33)
    want, _ = _one_process(path)
    meet = ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
    head = _serve(path, *meet, "--enable-expert-parallel", "--node-rank", "0", "--port", "0", "--num-kv-blocks", "64")
    node = _serve(path, *meet, "--node-rank", "1", "--headless")
    try:
        url = head.wait_url(others=(node,))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got = []
        for p in PROMPTS:
            r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0.0, logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            got.append([int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens])
    finally:
        head.kill()
        node.kill()
    assert got == want
