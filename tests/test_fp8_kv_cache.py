"""FP8 KV cache (kv_cache_dtype="fp8"): the kernels against their reference on FP8 caches (Triton under
TRITON_INTERPRET=1 on CPU, compiled on a GPU), and the engine: twice the blocks, tokens close to the model-dtype
cache's, the same tokens whatever the batching (chunked, compiled, prefix-cache hits, the Triton backend),
checkpoint scales, nothing leaked."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamer_kernels.testing import configure_for_tests, make_paged_batch, rel_err

DEVICE = configure_for_tests()
pytest.importorskip("triton")

from streamer import LLM, SamplingParams  # noqa: E402
from streamer_kernels import reference  # noqa: E402
from streamer_kernels.attention import unified_attention  # noqa: E402
from streamer_kernels.cache import reshape_and_cache  # noqa: E402

FP8 = torch.float8_e4m3fn
PROMPTS = [list(range(5 + i, 40 + 3 * i)) for i in range(5)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 3.0)])
def test_reshape_and_cache_quantizes_like_the_reference(dtype, scales) -> None:
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(7, 2, 64, generator=g) * 300).to(dtype)  # far past 448 / scale: saturated, never NaN
    v = torch.randn(7, 2, 64, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 31, -1, 8])
    # (the reference writes in place on the host: its caches live there, not in a .cpu() copy of the device's)
    caches = [torch.zeros(2, 4, 16, 2, 64, dtype=FP8, device=d) for d in (DEVICE, "cpu")]
    reshape_and_cache(k.to(DEVICE), v.to(DEVICE), caches[0][0], caches[0][1], slots.to(DEVICE), *scales)
    reference.reshape_and_cache(k, v, caches[1][0], caches[1][1], slots, *scales)
    got, want = caches[0].cpu(), caches[1]
    assert _bits(want).any(), "the reference wrote nothing"
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.isnan(got.float()).any() and got[0].float().abs().max() == 448.0
    assert _bits(got).any(), "nothing was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 4])
def test_unified_attention_reads_fp8_caches(dtype, splits) -> None:
    g = torch.Generator().manual_seed(1)
    batch = make_paged_batch([1, 9, 1], [40, 20, 0], 8, 2, 64, 16, dtype, DEVICE, num_pad_tokens=1, generator=g)
    k_scale, v_scale = 0.25, 2.0
    fp8_k = (batch.key_cache.float() / k_scale).to(FP8)  # (NaN-poisoned spare blocks stay NaN)
    fp8_v = (batch.value_cache.float() / v_scale).to(FP8)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table, 64 ** -0.5, batch.max_query_len,
            batch.max_seq_len)
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, fp8_k, fp8_v, out, *args, num_kv_splits=splits, k_scale=k_scale, v_scale=v_scale)
    want = torch.full_like(batch.q, float("nan"))
    reference.unified_attention(batch.q, fp8_k, fp8_v, want, *args, k_scale=k_scale, v_scale=v_scale)
    exact = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, exact, *args)
    n = batch.num_tokens
    assert rel_err(out[:n], want[:n]) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    # Within FP8's rounding of the full-precision answer (and wrong without the scales).
    assert rel_err(want[:n], exact[:n]) < 0.1
    unscaled = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, fp8_k, fp8_v, unscaled, *args)
    assert rel_err(unscaled[:n], exact[:n]) > 0.5


def test_fp8_cache_with_queries_past_fp16s_range() -> None:
    """Over an FP8 cache the dots run in fp16 (one instruction widens a pair of e4m3 values to fp16, not to bf16):
    bf16 queries beyond fp16's range are clamped into it, so scores stay finite rather than inf - inf = NaN."""
    g = torch.Generator().manual_seed(2)
    batch = make_paged_batch([1, 9], [40, 20], 8, 2, 64, 16, torch.bfloat16, DEVICE, generator=g)
    q = (batch.q.float() * 4e4).to(torch.bfloat16)  # |q| up to ~1.5e5
    assert q.float().abs().max() > 65504
    fp8_k, fp8_v = batch.key_cache.to(FP8), batch.value_cache.to(FP8)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, fp8_k, fp8_v, out, batch.query_start_loc, batch.seq_lens, batch.block_table, 64 ** -0.5,
                      batch.max_query_len, batch.max_seq_len)
    n = batch.num_tokens
    assert torch.isfinite(out[:n].float()).all()
    values = fp8_v.float()
    assert out[:n].float().abs().max() <= values[torch.isfinite(values)].abs().max() * 1.01  # (a convex mix)


def _greedy(path: Path, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", device=DEVICE.type, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


def _pool_whole(llm: LLM) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.seqs


@pytest.fixture(scope="module")
def fp8_tokens(llama_dir) -> list[list[int]]:
    tokens, llm = _greedy(llama_dir, kv_cache_dtype="fp8", enforce_eager=True)
    _pool_whole(llm)
    return tokens


def test_fp8_cache_holds_twice_the_blocks_and_stays_close(llama_dir, fp8_tokens) -> None:
    budget = {"kv_cache_memory": 1 << 20, "max_num_seqs": 256}
    full = LLM(str(llama_dir), dtype="bfloat16", device=DEVICE.type, enforce_eager=True, **budget)
    half = LLM(str(llama_dir), dtype="bfloat16", device=DEVICE.type, enforce_eager=True, kv_cache_dtype="fp8",
               **budget)
    assert half.engine.runner.kv_caches[0].dtype == FP8
    assert half.engine.runner.num_blocks == 2 * full.engine.runner.num_blocks
    exact, _ = _greedy(llama_dir, enforce_eager=True)
    # Rounding K/V to 3 mantissa bits moves the logits a little: the first tokens agree, later ones may part.
    assert all(a[:5] == b[:5] for a, b in zip(fp8_tokens, exact))


@pytest.mark.parametrize("engine_args", [
    {"enforce_eager": True, "max_num_batched_tokens": 8, "block_size": 8},  # chunks read what earlier ones stored
    {"enforce_eager": False},  # the compiled model: decode attention inside its graph, the write through bytes
    {"enforce_eager": True, "num_kv_blocks": 10, "block_size": 8},  # preemption: recomputed into FP8 again
], ids=["chunked", "compiled", "preempting"])
def test_fp8_tokens_do_not_depend_on_batching(llama_dir, fp8_tokens, engine_args) -> None:
    tokens, llm = _greedy(llama_dir, kv_cache_dtype="fp8", **engine_args)
    assert tokens == fp8_tokens
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    _pool_whole(llm)


def test_prefix_cache_hits_give_the_tokens_of_misses(llama_dir) -> None:
    """A hit reads the prefix's FP8 KV; a cold prefill must read the same stored values, not its exact k/v."""
    shared = list(range(200, 248))
    prompts = [{"prompt_token_ids": shared + [7, 8, 9]}, {"prompt_token_ids": shared + [10, 11]}]
    cold = LLM(str(llama_dir), dtype="float32", device=DEVICE.type, kv_cache_dtype="fp8", enforce_eager=True,
               enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)]
    warm = LLM(str(llama_dir), dtype="float32", device=DEVICE.type, kv_cache_dtype="fp8", enforce_eager=True)
    warm.generate(prompts[:1], GREEDY)
    got = [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)]
    assert got == want
    assert warm.engine.kv.prefix_hits >= 2 * 48 - 16  # both prompts found the shared blocks
    _pool_whole(warm)


def test_triton_backend_gives_the_torch_backend_tokens(llama_dir, fp8_tokens) -> None:
    tokens, llm = _greedy(llama_dir, kv_cache_dtype="fp8", attention_backend="triton", enforce_eager=True,
                          max_num_batched_tokens=16, block_size=8)
    assert tokens == fp8_tokens
    _pool_whole(llm)


def _with_kv_scales(src: Path, dst: Path, k_scale: float, v_scale: float) -> Path:
    """A copy of the checkpoint with llm-compressor's per-layer k_scale / v_scale tensors."""
    shutil.copytree(src, dst)
    num_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(dst / "model.safetensors")
    for i in range(num_layers):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales_are_used(llama_dir, fp8_tokens, tmp_path) -> None:
    calibrated = _with_kv_scales(llama_dir, tmp_path / "scaled", 0.5, 0.25)
    tokens, llm = _greedy(calibrated, kv_cache_dtype="fp8", enforce_eager=True)
    attn = llm.engine.runner.model.layers[1].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == (0.5, 0.25)
    assert all(a[:5] == b[:5] for a, b in zip(tokens, fp8_tokens))  # scaled back on reading
    # A scale far too small saturates every stored value: the output is no longer the model's.
    crushed = _with_kv_scales(llama_dir, tmp_path / "crushed", 1e-4, 1e-4)
    bad, _ = _greedy(crushed, kv_cache_dtype="fp8", enforce_eager=True)
    assert bad != fp8_tokens
    # Without an FP8 cache the scales are read and ignored.
    plain, _ = _greedy(crushed, enforce_eager=True)
    assert plain == _greedy(llama_dir, enforce_eager=True)[0]


def test_bad_kv_cache_dtype_is_refused(llama_dir) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(llama_dir), kv_cache_dtype="int4")
