"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet linear attention + gated full attention + MoE with a shared
expert. Greedy tokens identical to transformers (fp32) whatever the batching (chunked prefill carrying the conv and
delta-rule state across chunks, requests arriving while others decode, preemption), the state slots all back in their
pool at the end, the `mtp.*` weights skipped, and the chunked delta rule against the recurrent one."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from streamer import LLM
from streamer.models.qwen3_next import (
    chunk_gated_delta_rule,
    l2norm,
    qwen3_next_layer_types,
    recurrent_gated_delta_step,
)
from tests.checkpoints import hf_greedy
from tests.parity import assert_state_freed, greedy, greedy_params, prompts_of_lengths

MAX_NEW = 8

# A single token (the recurrent path from a fresh state), fewer than the conv window, one 64-token delta-rule chunk,
# several (70, 130)
LENGTHS = (1, 2, 5, 9, 17, 33, 70, 130)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("qwen3_next", family="qwen3_next")


@pytest.fixture(scope="module")
def ref(ckpt, prompts):
    return hf_greedy(ckpt, prompts, MAX_NEW)


@pytest.mark.parametrize("variant", ["moe", "interval_sparse_step"])
def test_matches_transformers(make_ckpt, ckpt, ref, prompts, variant):
    if variant == "moe":
        path, expected = ckpt, ref
    else:  # the default layer pattern (full attention at layer 3), MoE every 2nd layer, as many key as value heads
        path = make_ckpt("qwen3_next_interval", family="qwen3_next", layer_types=None, decoder_sparse_step=2,
                         mlp_only_layers=[], linear_num_key_heads=4, linear_value_head_dim=16, seed=1)
        expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.prefix_caching is True  # (from state checkpoints: test_hybrid_prefix_caching.py)
    attention_at = 1 if variant == "moe" else 3  # KV caches for the full-attention layer only
    assert [c.numel() > 0 for c in llm.engine.runner.kv_caches] == [i == attention_at for i in range(4)]
    assert greedy(llm, prompts, MAX_NEW) == expected
    assert greedy(llm, prompts[:1], MAX_NEW) == expected[:1]  # alone, after the batch: its slot starts fresh
    assert len({tuple(r) for r in expected}) > 4, "degenerate reference: the test would not discriminate"
    assert sum(len(set(r)) for r in expected) > 2 * len(expected), "degenerate reference: continuations repeat"
    assert_state_freed(llm)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=5),  # prompts over many chunks (state carried), mixed with decodes
    dict(max_num_batched_tokens=40, num_kv_blocks=20, block_size=8),  # chunking + preemption
    dict(max_num_seqs=3),  # few seats: slots reused by later requests
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_scheduling_variants_match(ckpt, ref, prompts, engine_args):
    llm = LLM(str(ckpt), dtype="float32", **engine_args)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert_state_freed(llm)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"


def test_requests_arriving_while_others_decode(ckpt, ref, prompts):
    """Continuous batching: new prompts (chunked) join steps where earlier requests decode."""
    llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=12)
    engine = llm.engine
    out: dict[str, list[int]] = {}
    arrivals = {0: [7, 1], 3: [2, 5], 5: [4], 9: [0, 6], 14: [3]}
    mixed_steps = 0
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy_params(MAX_NEW))
        sched = engine.scheduler
        before = {r.request_id: r.num_computed_tokens for r in sched.running}
        for u in engine.step():
            out.setdefault(u.req.request_id, []).extend(u.new_token_ids)
        decoding = [r for r in sched.running if r.request_id in before and r.num_computed_tokens - before[
            r.request_id] == 1 and r.num_output_tokens > 1]
        mixed_steps += bool(decoding) and any(r.request_id not in before for r in sched.running)
        step += 1
    assert [out[str(i)] for i in range(len(prompts))] == ref
    assert mixed_steps > 0, "no step mixed a new request's prefill with decodes"
    assert_state_freed(llm)


def test_mtp_weights_skipped(ckpt, ref, prompts, tmp_path):
    """Released checkpoints carry a multi-token-prediction head (`mtp.*`): loaded past, not used."""
    path = tmp_path / "with_mtp"
    shutil.copytree(ckpt, path)
    save_file({"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64)},
              str(path / "mtp.safetensors"))
    llm = LLM(str(path), dtype="float32")
    assert greedy(llm, prompts[:3], MAX_NEW) == ref[:3]


def test_layer_types():
    assert qwen3_next_layer_types({}, 8) == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert qwen3_next_layer_types({"full_attention_interval": 2}, 2) == ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="without a full_attention layer"):
        qwen3_next_layer_types({"layer_types": ["linear_attention"] * 2}, 2)
    with pytest.raises(ValueError, match="unsupported layer type"):
        qwen3_next_layer_types({"layer_types": ["sliding_attention", "full_attention"]}, 2)


def _inputs(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, dk, dv = 3, 8, 5
    q, k = (l2norm(torch.randn(length, h, dk, generator=g, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(length, h, dv, generator=g, dtype=torch.float64)
    gate = -torch.rand(length, h, generator=g, dtype=torch.float64) * 2  # log decay <= 0
    beta = torch.rand(length, h, generator=g, dtype=torch.float64)
    state = torch.randn(h, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (20, 64), (70, 64)])
def test_chunk_rule_matches_recurrence(length, chunk):
    q, k, v, gate, beta, state = _inputs(length, length * 31 + chunk)
    out, final = chunk_gated_delta_rule(q, k, v, gate, beta, chunk, state)
    s = state[None].float()  # (fp32, as the engine keeps it: updated in place)
    ys = []
    for t in range(length):
        y, s = recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], gate[t:t + 1], beta[t:t + 1], s)
        ys.append(y[0])
    # (the chunk rule computes in fp32, as transformers': compare at fp32 precision)
    torch.testing.assert_close(out.double(), torch.stack(ys).float().double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.double(), s[0].float().double(), rtol=1e-4, atol=1e-4)
    assert final.abs().max() > 0.1  # (a state that matters)


def test_chunk_rule_matches_transformers():
    """Against transformers' own torch_chunk_gated_delta_rule (grouped heads, an initial state, 2 chunks)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    fn = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    q, k, v, gate, beta, state = (t.float() for t in _inputs(70, 5))
    out, final = chunk_gated_delta_rule(q, k, v, gate, beta, 64, state)
    ref_out, ref_final = fn(q[None], k[None], v[None], g=gate[None], beta=beta[None], chunk_size=64,
                            initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref_out[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final[0], rtol=1e-5, atol=1e-5)
