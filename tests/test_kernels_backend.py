"""TritonAttentionBackend: against the kernel references and the engine's torch backend on the same metadata,
then the whole engine with attention_backend="triton" against attention_backend="torch" (on CPU through the
Triton interpreter)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from streamer_kernels.testing import TOLERANCE, configure_for_tests, make_paged_batch, rel_err

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from streamer.attention.base import AttentionMetadata, AttentionSpec  # noqa: E402
from streamer.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from streamer.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from streamer_kernels import reference  # noqa: E402


def _meta(batch, num_reqs: int) -> AttentionMetadata:
    return AttentionMetadata(
        num_reqs=num_reqs, num_tokens=batch.num_tokens, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table, slot_mapping=batch.slot_mapping,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        query_start_loc_cpu=batch.query_start_loc.cpu().numpy().astype(np.int64),
        seq_lens_cpu=batch.seq_lens.cpu().numpy().astype(np.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    # (q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, pad)
    ([1, 1, 1], [30, 0, 77], 8, 2, 64, 16, None, 2),  # decode only (+ padding rows)
    ([9, 1, 40, 1], [0, 12, 7, 100], 4, 4, 128, 32, None, 0),  # mixed prefill chunks and decodes, MHA
    ([17, 1], [20, 64], 8, 1, 96, 16, 24, 3),  # MQA, sliding window, head_dim 96
    ([5, 3], [3, 0], 4, 2, 32, 8, None, 0),  # small heads (Qwen3-style 32), block size 8
], ids=["decode", "mixed", "mqa-window", "small"])
def test_backend_matches_reference_and_torch_backend(case, dtype) -> None:
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, window, pad = case
    seed = 7
    # The same random draws with and without this step's k/v already in the cache.
    before = make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE,
                              num_pad_tokens=pad, write_new=False, generator=torch.Generator().manual_seed(seed))
    after = make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE,
                             num_pad_tokens=pad, write_new=True, generator=torch.Generator().manual_seed(seed))
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window)
    meta = _meta(before, len(q_lens))

    kv_triton = before.kv_cache.clone()
    out = TritonAttentionBackend(spec).forward(before.q, before.new_k, before.new_v, kv_triton, meta)
    # The cache now holds exactly the reference's contents (NaN where nothing was ever written).
    assert torch.equal(kv_triton.isnan(), after.kv_cache.isnan())
    written = ~after.kv_cache.isnan()
    assert torch.equal(kv_triton[written], after.kv_cache[written])

    n = before.num_tokens
    expected = torch.empty_like(before.q)
    reference.unified_attention(after.q, after.key_cache, after.value_cache, expected, after.query_start_loc,
                                after.seq_lens, after.block_table, spec.scale, 0, 0, window)
    assert rel_err(out[:n], expected[:n]) <= TOLERANCE[dtype]
    assert (out[n:] == 0).all(), "padding rows are zeroed"

    # The engine's own torch backend agrees (on a cache without NaN poison, which it would multiply by zero).
    kv_torch = torch.nan_to_num(before.kv_cache, nan=0.0)
    out_torch = TorchAttentionBackend(spec).forward(before.q, before.new_k, before.new_v, kv_torch, meta)
    assert rel_err(out[:n], out_torch[:n]) <= 2 * TOLERANCE[dtype]


def test_backend_rejects_cpu_without_interpreter(monkeypatch) -> None:
    if DEVICE.type != "cpu":
        pytest.skip("CPU-only check")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_paged_batch([1], [3], 2, 1, 64, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        TritonAttentionBackend(AttentionSpec(2, 1, 64, 0.125)).forward(batch.q, batch.new_k, batch.new_v,
                                                                       batch.kv_cache, _meta(batch, 1))


# ------------------------------------------------------------------------------------------------ whole engine

def _prompts(n: int, seed: int, vocab: int = 500, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


def _greedy(model_dir, prompts, **engine_args) -> list[list[int]]:
    from streamer import LLM, SamplingParams
    from streamer.models.layers import KernelSwitch
    from streamer.models.moe import SparseMoE

    # Eager on a GPU (as on CPU): the backends are under test, and on a GPU compiling each engine would eat the GPU
    # check's time budget (tests/test_cuda_graphs.py runs the compiled, captured path).
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE.type,
              enforce_eager=True if DEVICE.type == "cuda" else None, **engine_args)
    runner = llm.engine.runner
    assert runner.attention_backend == engine_args["attention_backend"]
    # Uncompiled on the Triton backend, norms, rotary and SiLU-and-mul run streamer_kernels' kernels too.
    switches = [m for m in runner.model.modules() if isinstance(m, KernelSwitch)]
    assert switches and all(m.use_kernel == (runner.attention_backend == "triton" and not runner.compiled)
                            for m in switches)
    # MoE layers take the grouped GEMM kernels on the Triton backend, compiled or not.
    assert all(m.fused_kernel == (runner.attention_backend == "triton")
               for m in runner.model.modules() if isinstance(m, SparseMoE))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _assert_backends_agree(path, prompts, **engine_args) -> None:
    """The Triton backend's greedy tokens are the torch backend's."""
    assert (_greedy(path, prompts, attention_backend="triton", **engine_args)
            == _greedy(path, prompts, attention_backend="torch", **engine_args))


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(max_num_batched_tokens=7, block_size=8),  # chunked prefill mixed with decodes, small blocks
], ids=["default", "chunked"])
def test_engine_triton_backend_matches_torch_backend(request, engine_args) -> None:
    pytest.importorskip("transformers")  # the checkpoint fixtures are built with it
    llama_dir = request.getfixturevalue("llama_dir")
    prompts = _prompts(6, seed=11)
    torch_out = _greedy(llama_dir, prompts, attention_backend="torch", **engine_args)
    triton_out = _greedy(llama_dir, prompts, attention_backend="triton", **engine_args)
    assert triton_out == torch_out


def test_engine_mixed_steps_attend_decodes_apart(request, monkeypatch) -> None:
    """Steps mixing decodes with prefill chunks longer than a decode program holds run the decodes as a launch of
    their own (unified_attention's SUBSET short) and still give the torch backend's tokens."""
    pytest.importorskip("transformers")
    import streamer_kernels.attention as attn_mod

    kernel, subsets = attn_mod._unified_attention_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                subsets.append(kwargs["SUBSET"])
                return kernel[grid](*args, **kwargs)
            return run

    llama_dir = request.getfixturevalue("llama_dir")
    prompts = _prompts(6, seed=12, max_len=60)
    args = dict(max_num_batched_tokens=32, block_size=8)
    torch_out = _greedy(llama_dir, prompts, attention_backend="torch", **args)
    monkeypatch.setattr(attn_mod, "_unified_attention_kernel", Recorder())
    # (the split needs the decodes' programs to fill the SMs: as on the CPU, one SM, so a GPU takes it too)
    monkeypatch.setattr(attn_mod, "device_sm_count", lambda device: 1)
    assert _greedy(llama_dir, prompts, attention_backend="triton", **args) == torch_out
    assert attn_mod._SHORT.value in subsets and attn_mod._LONG.value in subsets


def test_engine_triton_backend_sliding_window(request) -> None:
    pytest.importorskip("transformers")
    make_ckpt = request.getfixturevalue("make_ckpt")
    path = make_ckpt("mistral_sw", family="mistral", sliding_window=8)
    prompts = _prompts(3, seed=12, max_len=30)
    args = dict(max_num_batched_tokens=4, block_size=4)
    _assert_backends_agree(path, prompts, **args)


def test_engine_triton_backend_bloom_alibi(request) -> None:
    """BLOOM's ALiBi (models/bloom.py: the relative-bias table) in the kernel's prefill chunks and decode rows, and in
    its split-KV path (a lone request), gives the torch backend's tokens (which tests/test_alibi.py holds to
    transformers')."""
    pytest.importorskip("transformers")
    import tests.test_alibi  # noqa: F401  (registers the family)
    path = request.getfixturevalue("make_ckpt")("bloom", family="bloom", tie=False)
    prompts = _prompts(3, seed=14, max_len=40)
    args = dict(max_num_batched_tokens=16, block_size=8)
    _assert_backends_agree(path, prompts, **args)
    _assert_backends_agree(path, prompts[:1], **args)


def test_engine_triton_backend_gemma2_softcap(request) -> None:
    """Gemma 2: soft-capped scores through the Triton kernel (local and global layers, chunked prefill, decode)
    give the torch backend's tokens (which tests/test_engine_hf_parity.py holds to transformers')."""
    pytest.importorskip("transformers")
    path = request.getfixturevalue("make_ckpt")("gemma2", family="gemma2")
    prompts = _prompts(3, seed=13, max_len=30)
    args = dict(max_num_batched_tokens=8, block_size=8)
    _assert_backends_agree(path, prompts, **args)


def test_engine_triton_backend_llama4_chunked_attention(request) -> None:
    """Llama 4's chunked local attention (chunks of 8 on its rope layers; a NoPE layer attends fully) through the
    Triton kernel, with prefill chunks crossing attention chunks beside decodes, gives the torch backend's tokens
    (which tests/test_llama4.py holds to transformers'); its interleaved rotary runs the GPT-J kernel."""
    pytest.importorskip("transformers")
    path = request.getfixturevalue("make_ckpt")("llama4_base", family="llama4")
    prompts = _prompts(3, seed=14, max_len=36)
    args = dict(max_num_batched_tokens=6, block_size=4)
    _assert_backends_agree(path, prompts, **args)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_engine_triton_backend_moe_grouped_gemms(request, family) -> None:
    """MoE layers on the Triton backend run streamer_kernels.fused_moe (gpt-oss: expert biases, clamped SwiGLU,
    fp32 routing weights; Mixtral: every layer sparse) and give the torch backend's tokens, which
    tests/test_engine_hf_parity.py holds to transformers'; prefill chunks put many pairs on one expert."""
    pytest.importorskip("transformers")
    path = request.getfixturevalue("make_ckpt")(family, family=family)
    prompts = _prompts(3, seed=16, max_len=30)
    args = dict(max_num_batched_tokens=16, block_size=8)
    _assert_backends_agree(path, prompts, **args)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_engine_triton_backend_gemma4(request, family) -> None:
    """Gemma 4 (tests/test_gemma4.py holds the torch backend to transformers'): per-layer cache geometries (global
    heads twice as wide), KV-shared layers attending over their source layers' caches, k = v, through the Triton
    kernel, chunked prefill beside decodes."""
    pytest.importorskip("transformers")
    import tests.test_gemma4  # noqa: F401  (registers the families)
    path = request.getfixturevalue("make_ckpt")(family, family=family)
    prompts = _prompts(3, seed=15, max_len=30)
    args = dict(max_num_batched_tokens=8, block_size=8)
    _assert_backends_agree(path, prompts, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_limit_on_both_backends(dtype) -> None:
    """Query spans that see themselves both ways (a causal limit past their own positions) attend alike on the
    Triton backend, the torch backend and the reference; decode rows stay plainly causal."""
    q_lens, ctx_lens = [20, 1, 13], [5, 30, 0]
    batch = make_paged_batch(q_lens, ctx_lens, 4, 2, 64, 16, dtype, DEVICE, write_new=True,
                             generator=torch.Generator().manual_seed(3))
    spec = AttentionSpec(4, 2, 64, 0.125, None)
    positions = np.concatenate([np.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)])
    limit = positions.astype(np.int32)
    limit[3:11] = 5 + 10  # request 0: positions 8..15 see up to 15
    limit[21:30] = 12  # request 2: positions 0..8 see up to 12
    meta = _meta(batch, 3)
    meta.causal_limit, meta.causal_limit_cpu = torch.from_numpy(limit).to(DEVICE), limit
    expected = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, spec.scale, 0, 0, None,
                                causal_limit=meta.causal_limit)
    kv = batch.kv_cache.clone()
    out = TritonAttentionBackend(spec).forward(batch.q, batch.new_k, batch.new_v, kv, meta)
    n = batch.num_tokens
    assert rel_err(out[:n], expected[:n]) <= TOLERANCE[dtype]
    meta.backend_cache.clear()
    out_torch = TorchAttentionBackend(spec).forward(batch.q, batch.new_k, batch.new_v,
                                                    torch.nan_to_num(batch.kv_cache, nan=0.0), meta)
    assert rel_err(out_torch[:n], expected[:n]) <= 2 * TOLERANCE[dtype]
    plain = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, plain, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, spec.scale, 0, 0, None)
    assert not torch.allclose(expected[3:11], plain[3:11]) and torch.equal(expected[11:21], plain[11:21])
    # A causal-only layer (Gemma 4's global layers) ignores the limit on both backends
    causal = AttentionSpec(4, 2, 64, 0.125, None, causal_only=True)
    meta.backend_cache.clear()
    out = TritonAttentionBackend(causal).forward(batch.q, batch.new_k, batch.new_v, batch.kv_cache.clone(), meta)
    assert rel_err(out[:n], plain[:n]) <= TOLERANCE[dtype]
    meta.backend_cache.clear()
    out_torch = TorchAttentionBackend(causal).forward(batch.q, batch.new_k, batch.new_v,
                                                      torch.nan_to_num(batch.kv_cache, nan=0.0), meta)
    assert rel_err(out_torch[:n], plain[:n]) <= 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("whole", [False, True])
def test_position_bias_on_both_backends(whole, window) -> None:
    """A relative position bias (AttentionMetadata.position_bias) on prefill chunks, after a cached context or not,
    causal or seeing the whole request, with a window or not: both backends give the reference's output."""
    q_lens, ctx_lens = [20, 13], [5, 0]
    batch = make_paged_batch(q_lens, ctx_lens, 4, 2, 64, 16, torch.float32, DEVICE, write_new=True,
                             generator=torch.Generator().manual_seed(5))
    spec = AttentionSpec(4, 2, 64, 0.125, window)
    meta = _meta(batch, 2)
    meta.position_bias = torch.randn(4, 2 * 6 + 1, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    if whole:
        limit = np.repeat(meta.seq_lens_cpu - 1, q_lens).astype(np.int32)
        meta.causal_limit, meta.causal_limit_cpu = torch.from_numpy(limit).to(DEVICE), limit
    expected = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, spec.scale, 0, 0, window,
                                causal_limit=meta.causal_limit, position_bias=meta.position_bias)
    n = batch.num_tokens
    out = TritonAttentionBackend(spec).forward(batch.q, batch.new_k, batch.new_v, batch.kv_cache.clone(), meta)
    assert rel_err(out[:n], expected[:n]) <= TOLERANCE[torch.float32]
    meta.backend_cache.clear()
    out_torch = TorchAttentionBackend(spec).forward(batch.q, batch.new_k, batch.new_v,
                                                    torch.nan_to_num(batch.kv_cache, nan=0.0), meta)
    assert rel_err(out_torch[:n], expected[:n]) <= 2 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("q_lens, ctx_lens", [([1, 1, 1], [30, 0, 77]), ([1], [90]), ([1, 9, 1], [12, 7, 40])],
                         ids=["decode-batch", "lone-decode", "mixed"])
def test_position_bias_in_decode(q_lens, ctx_lens, compile) -> None:
    """Decode rows take the bias too (ALiBi's decoders need it): the torch backend's compiled and eager decode
    kernels, a lone request split across threads, and the Triton kernel, against the reference."""
    batch = make_paged_batch(q_lens, ctx_lens, 8, 2, 64, 16, torch.float32, DEVICE, write_new=True,
                             generator=torch.Generator().manual_seed(7))
    spec = AttentionSpec(8, 2, 64, 0.125, None)
    meta = _meta(batch, len(q_lens))
    meta.position_bias = torch.randn(8, 2 * 100 + 1, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    expected = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, expected, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, spec.scale, 0, 0, None,
                                position_bias=meta.position_bias)
    unbiased = torch.empty_like(batch.q)
    reference.unified_attention(batch.q, batch.key_cache, batch.value_cache, unbiased, batch.query_start_loc,
                                batch.seq_lens, batch.block_table, spec.scale, 0, 0, None)
    n = batch.num_tokens
    assert not torch.allclose(expected[:n], unbiased[:n], atol=1e-3)
    if not compile:
        out = TritonAttentionBackend(spec).forward(batch.q, batch.new_k, batch.new_v, batch.kv_cache.clone(), meta)
        assert rel_err(out[:n], expected[:n]) <= TOLERANCE[torch.float32]
        meta.backend_cache.clear()
    out_torch = TorchAttentionBackend(spec, compile=compile).forward(
        batch.q, batch.new_k, batch.new_v, torch.nan_to_num(batch.kv_cache, nan=0.0), meta)
    assert rel_err(out_torch[:n], expected[:n]) <= 2 * TOLERANCE[torch.float32]
    if compile:
        import streamer.attention.torch_backend as tb
        assert not tb._compile_failed  # (the compiled kernel ran, not its eager fallback)


def test_engine_triton_backend_gemma3_images(request) -> None:
    """Gemma 3's images (attending both ways: the kernel's causal limit) through the engine on the Triton backend
    give the torch backend's tokens and logprobs (which tests/test_multimodal.py holds to transformers')."""
    pytest.importorskip("transformers")
    import numpy as np
    from PIL import Image

    from streamer import LLM, SamplingParams
    from tests.checkpoints import make_gemma3_vlm_checkpoint
    path = request.getfixturevalue("ckpt_root") / "gemma3_vlm"
    if not (path / "config.json").exists():
        make_gemma3_vlm_checkpoint(path)
    image = Image.fromarray(np.random.default_rng(11).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    prompt = {"prompt": "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n<start_of_turn>model\n",
              "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0)
    kw = dict(dtype="float32", num_kv_blocks=32, max_num_batched_tokens=20, block_size=16)
    outs = [LLM(str(path), attention_backend=b, **kw).generate(prompt, params)[0].outputs[0]
            for b in ("torch", "triton")]
    assert outs[0].token_ids == outs[1].token_ids
    lps = [[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)] for o in outs]
    assert np.allclose(lps[0], lps[1], atol=1e-4)


@pytest.mark.parametrize("family", ["bert", "modernbert", "mpnet", "t5"])
def test_engine_triton_backend_encoder(request, family) -> None:
    """Encoders (models/bert.py): every token attends to its whole prompt through the kernel's causal limit,
    ModernBERT's local layers to a window either way (the limit cut to the window, the window's lower side), and
    MPNet's and T5's scores take their relative position bias (a prompt past the bias's last bucket, 128 away);
    several prompts in one step give the torch backend's embeddings."""
    pytest.importorskip("transformers")
    from streamer import LLM, PoolingParams
    from tests.encoder_checkpoints import make_encoder_checkpoint
    path = request.getfixturevalue("ckpt_root") / f"{family}-triton"
    if not (path / "config.json").exists():
        make_encoder_checkpoint(path, family=family)
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello, world!", "a"]
    if family in ("mpnet", "t5"):
        texts.append(" ".join(["the quick brown fox jumps over the lazy dog."] * 6))
    got = {}
    for backend in ("torch", "triton"):
        with LLM(str(path), dtype="float32", attention_backend=backend,
                 enforce_eager=True if DEVICE.type == "cuda" else None) as llm:  # (no compile time on the GPU check)
            got[backend] = [o.embedding for o in llm.embed(texts, PoolingParams(pooling="mean"))]
    assert np.allclose(got["triton"], got["torch"], atol=1e-5)
