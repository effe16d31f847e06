"""Kernel timings on a GPU, next to the machine's own measured ceilings.

    python bench/gpu_kernels.py [--out results.json] [--no-sweep]
    python bench/gpu_kernels.py --cpu-dry-run      # tiny shapes through the Triton interpreter (CI smoke test)

Measures
- ceilings: a large device-to-device copy (HBM GB/s, read + write) and a large bf16 matmul (TFLOP/s);
- unified_attention decode (Llama-3-8B heads: 32 q / 8 kv / 128, bf16, block size 16, fragmented block tables)
  at several batch x context sizes: achieved GB/s of K/V read, % of the copy ceiling, vs SDPA on contiguous K/V;
- unified_attention prefill (4,096-token prompts, causal): TFLOP/s, % of the matmul ceiling, vs SDPA;
- a small launch-config sweep at the two target shapes (the defaults are untuned heuristics);
- the fused elementwise kernels against their torch references;
- the sampler: torch path vs the Triton top-k/top-p/min-p kernel (sampling_backend), engine-level and bare;
- fused_moe (grouped GEMMs) vs the unfused expert op at decode and prefill token counts.
Every Triton result is also checked against SDPA / the reference (relative error printed).
Targets (H200): decode >= 70% of copy bandwidth at 64 x 4,096; prefill >= 50% of bf16 matmul at 4,096.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRY = "--cpu-dry-run" in sys.argv
if DRY:  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.testing import rel_err  # noqa: E402

ROWS: list[dict[str, Any]] = []


def row(section: str, name: str, ms: float, **fields: Any) -> None:
    r = {"section": section, "name": name, "ms": round(ms, 4), **fields}
    ROWS.append(r)
    print(json.dumps(r), flush=True)


class Timer:
    """Median wall time of a GPU callable, L2 flushed before every repetition (so bandwidth numbers are HBM's)."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device = device
        self.reps = reps
        self.flush = torch.empty(64 << 20 if device.type == "cuda" else 1 << 10, dtype=torch.int32, device=device)

    def __call__(self, fn: Callable[[], Any], reps: Optional[int] = None) -> float:
        reps = reps or self.reps
        fn()  # compile / warm up
        self._sync()
        times = []
        for _ in range(reps):
            self.flush.zero_()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ ceilings

def ceilings(timer: Timer, device: torch.device) -> tuple[float, float]:
    n_bytes = (2 << 30) if not DRY else (4 << 20)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    copy_gbps = 2 * n_bytes / ms / 1e6  # read + write
    row("ceiling", f"device copy {n_bytes >> 20} MiB", ms, gbps=round(copy_gbps, 1))

    n = 8192 if not DRY else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = timer(lambda: a @ b)
    mm_tflops = 2 * n ** 3 / ms / 1e9
    row("ceiling", f"bf16 matmul {n}^3", ms, tflops=round(mm_tflops, 1))
    return copy_gbps, mm_tflops


# ------------------------------------------------------------------------------------------------ attention

def paged_cache(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, block_size: int,
                device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [2, blocks, block_size, Hkv, D] full of random values, and a block table that scatters every
    sequence over the pool in random order (as a long-running server's would be)."""
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    kv = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device).normal_()
    table = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    return kv, table


def contiguous_kv(kv: torch.Tensor, table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, S, D] keys and values gathered through the block table: SDPA's input, same numbers."""
    b = table.shape[0]
    k = kv[0][table.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
    v = kv[1][table.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
    assert k.shape[0] == b
    return k, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def bench_decode(timer: Timer, device: torch.device, copy_gbps: float, batch: int, ctx: int, target: bool,
                 sweep: bool, force_splits: Optional[int] = None, fp8_kv: bool = False) -> None:
    """`fp8_kv`: the cache in float8_e4m3fn (kv_cache_dtype="fp8"): half the bytes to read."""
    from streamer_kernels.attention import AttentionConfig, choose_num_kv_splits, unified_attention

    H, HKV, D, BS = (32, 8, 128, 16) if not DRY else (4, 2, 64, 16)
    dtype = torch.bfloat16
    scale = D ** -0.5
    kv, table = paged_cache(batch, ctx, HKV, D, BS, device, dtype)
    if fp8_kv:
        kv = kv.to(torch.float8_e4m3fn)
    q = torch.randn(batch, H, D, dtype=dtype, device=device)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    splits = force_splits or choose_num_kv_splits(batch, HKV, 1, ctx, D, dtype, device)

    def run(config: Optional[AttentionConfig] = None, num_kv_splits: Optional[int] = splits) -> None:
        unified_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, scale, 1, ctx,
                          num_kv_splits=num_kv_splits, config=config)

    kv_bytes = 2 * batch * ctx * HKV * D * kv.element_size()
    ms = timer(run)
    k, v = contiguous_kv(kv.to(dtype), table, ctx)
    qs = q.view(batch, H, 1, D)
    expected = sdpa(qs, k, v, False, scale).view(batch, H, D)
    err = rel_err(out, expected)
    ms_sdpa = timer(lambda: sdpa(qs, k, v, False, scale))
    gbps = kv_bytes / ms / 1e6
    name = f"decode {batch} x {ctx}" + (", fp8 KV" if fp8_kv else "")
    row("attention", name, ms, gbps=round(gbps, 1), pct_ceiling=round(100 * gbps / copy_gbps, 1),
        sdpa_ms=round(ms_sdpa, 4), vs_sdpa=round(ms_sdpa / ms, 2), splits=splits, rel_err=f"{err:.2e}",
        target=">=70% copy" if target else "", ok=(gbps >= 0.7 * copy_gbps) if target else None)
    if sweep:
        # (16, 128, 8, 3): the default since 2026-12-04; (16, 64, 4, 3): the one before
        for cfg in [AttentionConfig(16, 32, 4, 3), AttentionConfig(16, 64, 4, 3), AttentionConfig(16, 64, 4, 2),
                    AttentionConfig(16, 128, 4, 3), AttentionConfig(16, 128, 8, 3), AttentionConfig(16, 128, 8, 2),
                    AttentionConfig(16, 256, 8, 2)]:
            for s in sorted({1, splits, 2 * splits}):
                try:
                    t = timer(lambda: run(cfg, s), reps=10)
                except Exception as e:  # e.g. out of shared memory for an oversized tile
                    row("sweep", f"{name} {cfg} splits={s}", float("nan"), error=type(e).__name__)
                    continue
                g = kv_bytes / t / 1e6
                row("sweep", f"{name} bm={cfg.block_m} tn={cfg.tile_n} w={cfg.num_warps} st={cfg.num_stages} "
                    f"splits={s}", t, gbps=round(g, 1), pct_ceiling=round(100 * g / copy_gbps, 1))


# Gemma 4's global layers: heads of 512 (its E2B's 8 query heads over 1 kv head). At 64-row tiles (the default)
# the prefill kernel compiles to wgmma on sm_90 but spills 44-80 bytes; 32-row tiles spill nothing but use mma.sync
# (AOT compiles, session 29). Which is faster needs the GPU: the sweep below times both.
GEMMA4_GLOBAL = (8, 1, 512)
WIDE_SWEEP = ((64, 32, 8, 1), (32, 32, 8, 1), (32, 64, 8, 1))


def bench_prefill(timer: Timer, device: torch.device, mm_tflops: float, batch: int, seq: int, target: bool,
                  sweep: bool, heads: Optional[tuple[int, int, int]] = None) -> None:
    from streamer_kernels.attention import AttentionConfig, unified_attention

    H, HKV, D, BS = (*heads, 16) if heads else (32, 8, 128, 16) if not DRY else (4, 2, 64, 16)
    dtype = torch.bfloat16
    scale = D ** -0.5
    kv, table = paged_cache(batch, seq, HKV, D, BS, device, dtype)
    q = torch.randn(batch * seq, H, D, dtype=dtype, device=device)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=device)

    def run(config: Optional[AttentionConfig] = None) -> None:
        unified_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, scale, seq, seq, config=config)

    flops = 4 * batch * H * D * seq * (seq + 1) / 2  # QK^T and PV over the causal half
    ms = timer(run)
    k, v = contiguous_kv(kv, table, seq)
    qs = q.view(batch, seq, H, D).transpose(1, 2).contiguous()
    expected = sdpa(qs, k, v, True, scale).transpose(1, 2).reshape(batch * seq, H, D)
    err = rel_err(out, expected)
    ms_sdpa = timer(lambda: sdpa(qs, k, v, True, scale))
    tflops = flops / ms / 1e9
    name = f"prefill {batch} x {seq}" + (f" D={D} H={H}/{HKV}" if heads else "")
    row("attention", name, ms, tflops=round(tflops, 1), pct_ceiling=round(100 * tflops / mm_tflops, 1),
        sdpa_ms=round(ms_sdpa, 4), vs_sdpa=round(ms_sdpa / ms, 2), sdpa_tflops=round(flops / ms_sdpa / 1e9, 1),
        rel_err=f"{err:.2e}", target=">=50% matmul" if target else "",
        ok=(tflops >= 0.5 * mm_tflops) if target else None)
    if sweep:
        # (128, 128, 8, 2): the default since session 33, (128, 64, 8, 3) the one before. "pipe": the unmasked
        # tiles one Q.K^T ahead of their softmax (FlashAttention-3's overlap; its SASS on sm_90 issues the
        # exponentials between the next tile's wgmmas), not yet timed on a GPU. The 64 x 64 shapes on 4 warps fit
        # two programs an SM on sm_90 (184-208 registers, 80 KB shared, no spills), so one program's softmax can
        # run under the other's wgmmas; (128, 64, 4, 3) and (64, 128, 4, 2), which spill there (264 B, 20 B), left
        # the sweep in session 35.
        configs = [AttentionConfig(*c) for c in WIDE_SWEEP] if D > 256 else [
            AttentionConfig(128, 64, 8, 3), AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 3),
            AttentionConfig(128, 64, 8, 3, True), AttentionConfig(128, 64, 8, 2, True),
            AttentionConfig(64, 64, 4, 3, True), AttentionConfig(64, 64, 4, 2, True)]
        for cfg in configs:
            label = (f"{name} bm={cfg.block_m} tn={cfg.tile_n} w={cfg.num_warps} st={cfg.num_stages}"
                     + (" pipe" if cfg.pipeline_qk else ""))
            try:
                t = timer(lambda: run(cfg), reps=5)
            except Exception as e:
                row("sweep", label, float("nan"), error=type(e).__name__)
                continue
            tf = flops / t / 1e9
            row("sweep", label, t, tflops=round(tf, 1), pct_ceiling=round(100 * tf / mm_tflops, 1))


def bench_mixed(timer: Timer, device: torch.device) -> None:
    """The unified case: one 2,048-token prefill chunk on a 2,048 prefix next to 128 decodes at 4,096."""
    from streamer_kernels.attention import unified_attention

    H, HKV, D, BS = (32, 8, 128, 16) if not DRY else (4, 2, 64, 16)
    chunk, ctx, decodes = (2048, 4096, 128) if not DRY else (20, 40, 3)
    num = decodes + 1
    kv, table = paged_cache(num, ctx, HKV, D, BS, device, torch.bfloat16)
    q_lens = torch.tensor([chunk] + [1] * decodes)
    qsl = torch.zeros(num + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    q = torch.randn(int(qsl[-1]), H, D, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    seq_lens = torch.full((num,), ctx, dtype=torch.int32, device=device)
    qsl = qsl.to(device)
    one = timer(lambda: unified_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, D ** -0.5, chunk, ctx))
    lens = q_lens.tolist()
    ms = timer(lambda: unified_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, D ** -0.5, chunk, ctx,
                                         query_lens=lens))
    # As the engine launches it (the decodes apart, given the host's query lengths), against one launch shaped
    # for the chunk (what every mixed step ran before session 34).
    row("attention", f"mixed 1x{chunk} chunk + {decodes} decodes @ {ctx}", ms, one_launch_ms=round(one, 4),
        vs_one_launch=round(one / ms, 2))


# ------------------------------------------------------------------------------------------------ fused ops

def bench_fused(timer: Timer, device: torch.device) -> None:
    import streamer_kernels.activation as act
    import streamer_kernels.norm as norm
    import streamer_kernels.rotary as rot

    T, HID, INTER, H, HKV, D = (4096, 4096, 14336, 32, 8, 128) if not DRY else (8, 64, 96, 4, 2, 64)
    dt = torch.bfloat16
    x = torch.randn(T, HID, dtype=dt, device=device)
    r = torch.randn(T, HID, dtype=dt, device=device)
    w = torch.randn(HID, dtype=dt, device=device)
    gate_up = torch.randn(T, 2 * INTER, dtype=dt, device=device)
    q = torch.randn(T, H, D, dtype=dt, device=device)
    k = torch.randn(T, HKV, D, dtype=dt, device=device)
    pos = torch.randint(0, 8192, (T,), device=device)
    cache = reference.build_cos_sin_cache(D, 8192, 500000.0, device=device)
    cases = [
        ("rms_norm", lambda: norm.rms_norm(x, w, 1e-5), lambda: reference.rms_norm(x, w, 1e-5)),
        ("fused_add_rms_norm", lambda: norm.fused_add_rms_norm(x, r, w, 1e-5)[0],
         lambda: reference.fused_add_rms_norm(x, r, w, 1e-5)[0]),
        ("rotary_embedding (neox)", lambda: rot.rotary_embedding(pos, q, k, cache, True)[0],
         lambda: reference.rotary_embedding(pos, q, k, cache, True)[0]),
        ("silu_and_mul", lambda: act.silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up)),
    ]
    for name, fn, ref_fn in cases:
        err = rel_err(fn(), ref_fn())
        ms = timer(fn)
        ms_ref = timer(ref_fn)
        row("fused", f"{name} [{T} tokens]", ms, torch_ms=round(ms_ref, 4), speedup=round(ms_ref / ms, 2),
            rel_err=f"{err:.2e}")


def bench_sampling(timer: Timer, device: torch.device) -> None:
    """The engine's sampler, torch path (full sort over the vocabulary on GPU) vs the Triton threshold-search
    kernel, both including the exponential noise they draw, on Llama-3-vocab rows with top-k 50 / top-p 0.9 /
    min-p 0.05, at a small and a large batch; and the bare kernel against the bare reference. Decides
    `sampling_backend`'s default: the kernel earns it only where it wins here."""
    from streamer.worker.sampler import Sampler, SamplingBatch
    from streamer_kernels.sampling import top_k_top_p_sample

    V = 128256 if not DRY else 512
    for B in ((8, 256) if not DRY else (3,)):
        logits = torch.randn(B, V, device=device) * 4
        full = lambda t, dt=torch.float32: torch.full((B,), t, device=device, dtype=dt)  # noqa: E731
        batch = SamplingBatch(temperature=full(0.8), top_k=full(50, torch.long), top_p=full(0.9),
                              min_p=full(0.05), generators=[None] * B, all_greedy=False, any_seeded=False,
                              banned=None, penalties=None, max_logprobs=-1)
        torch_sampler, kernel_sampler = Sampler(None), Sampler(0)
        ms_torch = timer(lambda: torch_sampler(logits, batch))
        ms_kernel = timer(lambda: kernel_sampler(logits, batch))
        row("sampling", f"engine sampler: triton vs torch, top-k/p + min-p [{B} x {V}]", ms_kernel,
            torch_ms=round(ms_torch, 4), speedup=round(ms_torch / ms_kernel, 2))
        noise = torch.empty(B, V, device=device).exponential_()
        args = (logits, batch.temperature, batch.top_k, batch.top_p, noise, batch.min_p)
        agree = (top_k_top_p_sample(*args) == reference.top_k_top_p_sample(*args)).float().mean().item()
        ms = timer(lambda: top_k_top_p_sample(*args))
        ms_ref = timer(lambda: reference.top_k_top_p_sample(*args))
        row("sampling", f"kernel vs reference, same noise [{B} x {V}]", ms, torch_ms=round(ms_ref, 4),
            speedup=round(ms_ref / ms, 2), agree=f"{agree:.3f}")


def bench_fp8_and_lora(timer: Timer, device: torch.device) -> None:
    """FP8 linear (per-token activation quantization + _scaled_mm) vs the bf16 matmul at Llama-3-8B's gate_up shape;
    the LoRA decode kernel vs the per-token gather it replaces (rank 16, packed qkv, 4 adapters)."""
    from streamer.models.quant import fp8_linear, quantize_weight_fp8
    from streamer_kernels import lora_add
    K, N = (4096, 28672) if device.type == "cuda" else (64, 128)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
    wt, sw = quantize_weight_fp8(w)
    for M in ((1, 32, 256) if device.type == "cuda" else (4,)):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        ms_bf16 = timer(lambda: F.linear(x, w))
        ms_fp8 = timer(lambda: fp8_linear(x, wt, sw))
        err = rel_err(fp8_linear(x, wt, sw).float(), F.linear(x, w).float())
        row("fp8", f"fp8 linear vs bf16, M={M} [{K} -> {N}]", ms_fp8, torch_ms=round(ms_bf16, 4),
            speedup=round(ms_bf16 / ms_fp8, 2), rel_err=f"{err:.3f}")
    H, R = (4096, 48) if device.type == "cuda" else (64, 12)
    out_dim = 6144 if device.type == "cuda" else 96
    a = torch.randn(5, R, H, device=device, dtype=torch.bfloat16) * 0.02
    b = torch.randn(5, out_dim, R, device=device, dtype=torch.bfloat16) * 0.02
    a[0], b[0] = 0, 0
    for B in ((1, 64, 256) if device.type == "cuda" else (4,)):
        x = torch.randn(B, H, device=device, dtype=torch.bfloat16)
        slots = torch.randint(0, 5, (B,), device=device)
        y = torch.zeros(B, out_dim, device=device, dtype=torch.bfloat16)
        ms_k = timer(lambda: lora_add(y, x, a, b, slots))
        ms_ref = timer(lambda: reference.lora_add(y, x, a, b, slots))
        row("lora", f"LoRA decode kernel vs gather, {B} tokens [{H} -> {R} -> {out_dim}]", ms_k,
            torch_ms=round(ms_ref, 4), speedup=round(ms_ref / ms_k, 2))


def graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """fn captured in a CUDA graph (as the engine's decode steps run): its replay, without Python's launches. On CPU
    (the dry run) fn itself."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# MoE launch shapes the sweep times against the default (block_m follows the pairs per expert, as moe_config's).
MOE_SWEEP = ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4))


def bench_moe(timer: Timer, device: torch.device, copy_gbps: float, sweep: bool) -> None:
    """streamer_kernels.fused_moe (two grouped GEMM launches, no host sync) vs the engine's unfused op on the same
    device (a gather-and-bmm at <= E pairs, else a loop over experts with a host sync), Qwen3-30B-A3B's experts
    (128 of 2,048 -> 768, top 8, bf16). GB/s: the touched experts' weights over the time (decode is weight-bound).
    "graphed": replayed from a CUDA graph, as a decode step runs it (eager timings of small batches are bound by
    the ~20 launches). The sweep: (block_n, block_k, warps, stages) at decode and prefill sizes, graphed."""
    from streamer.models.moe import moe_experts
    from streamer_kernels.moe import (
        ALIGN_KERNEL_MAX_PAIRS,
        MoeConfig,
        fused_moe,
        moe_align,
        moe_align_torch,
        moe_config,
    )

    E, K, H, INTER = (128, 8, 2048, 768) if not DRY else (8, 2, 64, 32)
    dt = torch.bfloat16
    w13 = torch.randn(E, 2 * INTER, H, dtype=dt, device=device) * H ** -0.5
    w2 = torch.randn(E, H, INTER, dtype=dt, device=device) * INTER ** -0.5
    for T in ((1, 16, 64, 256, 4096) if not DRY else (1, 12)):
        x = torch.randn(T, H, dtype=dt, device=device)
        weights, ids = torch.randn(T, E, device=device).softmax(-1).topk(K, dim=-1)
        weights = weights.to(dt)
        fused = lambda: fused_moe(x, w13, w2, weights, ids)  # noqa: E731
        unfused = lambda: moe_experts(x, w13, w2, weights, ids)  # noqa: E731
        err = rel_err(fused().float(), unfused().float())
        ms, ms_ref = timer(fused), timer(unfused)
        touched = ids.unique().numel() * 3 * H * INTER * w13.element_size()
        shape = f"{T} tokens [E={E} k={K} {H} -> {INTER}]"

        def report(name: str, t: float, **extra: Any) -> None:
            g = touched / t / 1e6
            row("moe", name, t, gbps=round(g, 1), pct_ceiling=round(100 * g / (copy_gbps / 2), 1), **extra)

        report(f"fused_moe vs unfused op, {shape}", ms, torch_ms=round(ms_ref, 4), speedup=round(ms_ref / ms, 2),
               rel_err=f"{err:.2e}")
        if T > 64 and not sweep:
            continue
        try:
            ms_graph = timer(graphed(fused, device))
        except Exception as e:  # (a capture failure is a finding: the engine graphs this call)
            row("moe", f"fused_moe graphed, {shape}", float("nan"), error=f"{type(e).__name__}: {e}"[:200])
            continue
        report(f"fused_moe graphed, {shape}", ms_graph, vs_eager=round(ms / ms_graph, 2))
        if T * K <= ALIGN_KERNEL_MAX_PAIRS:
            # The pairs' alignment alone, graphed: its one kernel against the ~15 torch ops it replaced.
            bm = moe_config(T * K, E).block_m
            t_k = timer(graphed(lambda: moe_align(ids, E, bm), device))
            t_t = timer(graphed(lambda: moe_align_torch(ids, E, bm), device))
            row("moe", f"moe_align graphed, one kernel vs torch ops, {T * K} pairs", t_k, torch_ms=round(t_t, 4),
                speedup=round(t_t / t_k, 2))
        if not sweep or T not in (1, 64, 4096):
            continue
        block_m = moe_config(T * K, E).block_m
        for bn, bk, w, st in MOE_SWEEP:
            cfg = MoeConfig(block_m, bn, bk, w, st)
            try:
                t = timer(graphed(lambda: fused_moe(x, w13, w2, weights, ids, configs=(cfg, cfg)), device), reps=10)
            except Exception as e:  # e.g. out of shared memory for an oversized tile
                row("sweep", f"moe {T} tokens {cfg}", float("nan"), error=type(e).__name__)
                continue
            g = touched / t / 1e6
            row("sweep", f"moe {T} tokens bm={block_m} bn={bn} bk={bk} w={w} st={st} (graphed)", t,
                gbps=round(g, 1), pct_ceiling=round(100 * g / (copy_gbps / 2), 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", type=Path, default=None, help="write the result rows as JSON here")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    args = ap.parse_args()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    timer = Timer(device, reps=20 if not args.cpu_dry_run else 1)
    sweep = not args.no_sweep
    torch.manual_seed(0)
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)

    copy_gbps, mm_tflops = ceilings(timer, device)
    steps: list[tuple[str, Callable[[], None]]] = []
    if not args.cpu_dry_run:
        steps += [
            ("decode 64x4096", lambda: bench_decode(timer, device, copy_gbps, 64, 4096, True, sweep)),
            ("decode 1x32768", lambda: bench_decode(timer, device, copy_gbps, 1, 32768, False, False)),
            ("decode 8x8192", lambda: bench_decode(timer, device, copy_gbps, 8, 8192, False, False)),
            ("decode 256x1024", lambda: bench_decode(timer, device, copy_gbps, 256, 1024, False, False)),
            ("decode 64x4096 fp8 KV", lambda: bench_decode(timer, device, copy_gbps, 64, 4096, False, False,
                                                           fp8_kv=True)),
            ("prefill 1x4096", lambda: bench_prefill(timer, device, mm_tflops, 1, 4096, True, sweep)),
            ("prefill 4x4096", lambda: bench_prefill(timer, device, mm_tflops, 4, 4096, False, False)),
            ("prefill 1x4096 D=512", lambda: bench_prefill(timer, device, mm_tflops, 1, 4096, False, sweep,
                                                           GEMMA4_GLOBAL)),
        ]
    else:
        steps += [
            ("decode", lambda: bench_decode(timer, device, copy_gbps, 2, 40, True, sweep)),
            ("decode split", lambda: bench_decode(timer, device, copy_gbps, 1, 300, False, False, 4)),
            ("decode fp8 KV", lambda: bench_decode(timer, device, copy_gbps, 2, 40, False, False, fp8_kv=True)),
            ("prefill", lambda: bench_prefill(timer, device, mm_tflops, 1, 40, True, False)),
        ]
    steps += [("mixed", lambda: bench_mixed(timer, device)), ("fused", lambda: bench_fused(timer, device)),
              ("sampling", lambda: bench_sampling(timer, device)),
              ("fp8 and lora", lambda: bench_fp8_and_lora(timer, device)),
              ("moe", lambda: bench_moe(timer, device, copy_gbps, sweep))]
    failures = 0
    for name, step in steps:
        try:
            step()
        except Exception as e:  # keep going: one failing shape must not hide the rest of the table
            failures += 1
            row("error", name, float("nan"), error=f"{type(e).__name__}: {str(e)[:200]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # after every step: a timeout still leaves the finished rows for the report
            args.out.write_text(json.dumps({"copy_gbps": copy_gbps, "matmul_tflops": mm_tflops, "rows": ROWS}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
