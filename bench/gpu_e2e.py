"""End-to-end decode throughput of a dummy-weight model with Llama-3-8B's shapes, through the public API.

    python bench/gpu_e2e.py [--batches 1,32,256] [--prompt-len 128] [--gen 64] [--copy-gbps 4000] [--out r.json]
    python bench/gpu_e2e.py --cpu-dry-run      # a tiny model on CPU, Triton backend under the interpreter

The model folder is built in a temp dir: config.json (Llama-3.1-8B shapes, bf16) and a word-level tokenizer
whose vocabulary covers every id the random weights can emit. Prompts are random token ids, distinct per run,
and prefix caching is off, so every run pays the same prefill.

Decode step time = (t(gen + 1 tokens) - t(1 token)) / gen for the same batch shape: the prefill and the first
token cancel out. After the default rows, batches <= 32 run again without CUDA graphs and without async
scheduling (toggled on the same engine), so each one's gain shows side by side; last, the largest batch samples
with top-k/top-p/min-p on the torch sampler and then on the Triton one (`sampling_backend`); then, eager and
without graphs, bf16 against 4-bit weights (tinygemm, quantization="int4") at batch 1 and 4-bit at 32, and bf16
against FP8 weights at batch 32. Tokens/s = batch * gen / that difference. With --copy-gbps (the measured copy
bandwidth) each row also shows the roofline of a step: the weights it multiplies by (the input embedding's rows are
gathered, not read whole) and the batch's KV cache read once; with --matmul-tflops (the measured bf16 matmul rate)
too, the larger of that and the step's matmul FLOPs at that rate (a batch of 256 on an 8B model is compute-bound:
2 x 7.5e9 x 256 FLOPs take longer than reading 15 GB).

The engine's token budget lets the largest batch prefill in one step (up to 32,768 tokens), so every request
decodes from the same step on and the decode steps timed are all full-batch: with a smaller budget the batch
enters in waves and the timed steps include partial ones.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRY = "--cpu-dry-run" in sys.argv
if DRY:  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
}
TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, torch_dtype="float32")


def make_model_dir(root: Path, config: dict[str, Any]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))
    return root


def _fast_dummy_init() -> None:
    """The loader fills dummy weights on the CPU, about a minute for 8B parameters; fill them on the device
    instead (same distribution), which keeps the check inside its time budget. Bench-only."""
    import torch

    from streamer.models import loader

    if not hasattr(loader, "_dummy_init"):
        return

    def init(model: torch.nn.Module, seed: int) -> None:
        gen = None
        for name, p in model.named_parameters():
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.uniform_(-0.05, 0.05, generator=gen)

    loader._dummy_init = init


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32,256)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--gen", type=int, default=None, help="decode steps measured per run")
    ap.add_argument("--copy-gbps", type=float, default=None, help="measured copy bandwidth, for the roofline")
    ap.add_argument("--matmul-tflops", type=float, default=None,
                    help="measured bf16 matmul rate, for the roofline's compute bound")
    ap.add_argument("--attention-backend", default=None, help="torch | triton (default: the engine's choice)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="last, an FP8-weight engine with the defaults (compiled, CUDA graphs) at batch 1 and 32, "
                         "if this many seconds since the start leave ~100 s for it")
    args = ap.parse_args()
    started = time.perf_counter()

    import torch

    from streamer import LLM

    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-dry-run", file=sys.stderr)
        return 2
    batches = [int(b) for b in (args.batches or ("1,3" if dry else "1,32,256")).split(",")]
    prompt_len = args.prompt_len or (8 if dry else 128)
    gen = args.gen or (3 if dry else 64)
    config = TINY if dry else LLAMA3_8B
    backend = args.attention_backend or ("triton" if dry else None)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "llama3-8b-dummy", config)
        if not dry:
            _fast_dummy_init()
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), load_format="dummy", dtype="float32" if dry else "bfloat16",
                  device="cpu" if dry else "cuda", max_num_seqs=max(batches), max_model_len=prompt_len + gen + 16,
                  max_num_batched_tokens=prefill_budget(batches, prompt_len), enable_prefix_caching=False,
                  attention_backend=backend, async_scheduling=True if dry else None)  # dry: as on the GPU
        runner = llm.engine.runner
        load_s = time.perf_counter() - t0
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        read_bytes, matmul_params = step_weights(runner.model)
        kv_bytes_per_token = runner.kv_bytes_per_block() / runner.block_size
        print(f"# model loaded in {load_s:.1f}s: {weight_bytes / 1e9:.2f} GB of weights, attention backend "
              f"{runner.attention_backend}, {runner.num_blocks} KV blocks", flush=True)
        rows.append({"section": "e2e", "name": "start-up: dummy weights, compile, warm-up, CUDA graphs",
                     "ms": round(load_s * 1e3, 1), "note": f"{load_s:.1f} s to ready"})
        rng = random.Random(0)

        def run(batch: int, max_tokens: int, sampled: bool = False) -> float:
            return timed_generate(llm, random_prompts(rng, batch, prompt_len, config), max_tokens, sampled)

        run(min(batches), 2)  # compile the kernels, warm the allocator
        graphs, overlap = runner.graphs, llm.engine.async_scheduling
        # Every batch with the engine's defaults (CUDA graphs, async scheduling), then the small ones again without
        # graphs and without async scheduling (same engine, same compiled model): each one's gain, side by side.
        small = [b for b in batches if b <= 32]
        # Last, the largest batch sampling with top-k/top-p/min-p: the torch sampler, then the Triton one.
        plan = ([(b, graphs, overlap, None) for b in batches]
                + ([(b, None, overlap, None) for b in small] if graphs else [])
                + ([(b, graphs, False, None) for b in small] if overlap else [])
                + [(max(batches), graphs, overlap, kernel) for kernel in (False, True)])
        default_rows = runner.sampler.kernel_min_rows
        for batch, use, async_on, kernel in plan:
            runner.graphs, llm.engine.async_scheduling = use, async_on
            sampled = kernel is not None
            runner.sampler.kernel_min_rows = default_rows if kernel is None else 0 if kernel else None
            run(batch, 2, sampled)  # shape-specific warm-up (the kernels specialise on a few integer arguments)
            t_first = run(batch, 1, sampled)
            t_all = run(batch, gen + 1, sampled)
            step_s = max(t_all - t_first, 1e-9) / gen
            name = (f"decode batch {batch}" + ("" if use is not None or graphs is None else " (no CUDA graphs)")
                    + ("" if async_on or not overlap else " (no async scheduling)")
                    + ("" if not sampled else f", top-k/p sampling, {'triton' if kernel else 'torch'} sampler"))
            r: dict[str, Any] = {"section": "e2e", "name": name, "ms": round(step_s * 1e3, 3),
                                 "tok_per_s": round(batch / step_s, 1), "prefill_s": round(t_first, 3)}
            if args.copy_gbps:
                # Every step reads the weights plus the batch's KV (mean context ~ prompt + gen / 2) ...
                kv = batch * (prompt_len + gen / 2) * kv_bytes_per_token
                roof_ms = (read_bytes + kv) / (args.copy_gbps * 1e9) * 1e3
                bound = "memory"
                if args.matmul_tflops:  # ... and multiplies each of its tokens by them: 2 FLOPs a weight
                    compute_ms = 2 * matmul_params * batch / (args.matmul_tflops * 1e12) * 1e3
                    if compute_ms > roof_ms:
                        roof_ms, bound = compute_ms, "compute"
                r.update(roofline_ms=round(roof_ms, 3), pct_roofline=round(100 * roof_ms / (step_s * 1e3), 1),
                         bound=bound)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if args.out:  # after every row: a timeout still leaves the finished ones for the report
                args.out.write_text(json.dumps({"rows": rows}))
        runner.graphs, llm.engine.async_scheduling = graphs, overlap
        runner.sampler.kernel_min_rows = default_rows
        rows.append(step_time_row(llm.engine, run, batches))
        print(json.dumps(rows[-1]), flush=True)
        # Last, FP8 weights (per-channel scales, torch._scaled_mm) against bf16 on the same engine, both eager and
        # without graphs (the graphs and the compiled model hold the bf16 weights): the weights are quantized in
        # place between the two rows, which also frees the bf16 copies.
        from streamer.models.layers import PackableLinear
        from streamer.models.woq import kernel_group, pack_int4, quantize_rtn
        runner._use_eager()
        runner.graphs = None
        batch = min(32, max(batches))
        linears = [m for m in runner.model.modules()
                   if isinstance(m, PackableLinear) and m.fp8 is None and m.packed is None]  # (CPU dry run: packed)
        # 4-bit weights (quantization="int4": tinygemm) beside the bf16 ones, kept for the FP8 rows after.
        for b, label in ((min(batches), "bf16"), (min(batches), "int4"), (batch, "int4")):
            for m in linears:
                w = m.weight.detach()
                m.qweight = None if label == "bf16" else pack_int4(quantize_rtn(w, kernel_group(w.shape[1], 128)),
                                                                 w.dtype, w.device)
                m.out_features = w.shape[0]
            run(b, 2)
            t_first = run(b, 1)
            step_s = max(run(b, gen + 1) - t_first, 1e-9) / gen
            r = {"section": "e2e", "name": f"decode batch {b}, eager, no graphs, {label} weights"
                 + (f" ({len(linears)} layers)" if label == "int4" else ""),
                 "ms": round(step_s * 1e3, 3), "tok_per_s": round(b / step_s, 1), "prefill_s": round(t_first, 3)}
            rows.append(r)
            print(json.dumps(r), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"rows": rows}))
        for m in linears:
            m.qweight = None
        for label in ("bf16", "fp8"):
            if label == "fp8":
                for m in runner.model.modules():
                    if isinstance(m, PackableLinear) and m.fp8 is None and m.packed is None:  # (CPU dry run: packed)
                        m.quantize_fp8()
            run(batch, 2)
            t_first = run(batch, 1)
            step_s = max(run(batch, gen + 1) - t_first, 1e-9) / gen
            r = {"section": "e2e", "name": f"decode batch {batch}, eager, no graphs, {label} weights",
                 "ms": round(step_s * 1e3, 3), "tok_per_s": round(batch / step_s, 1), "prefill_s": round(t_first, 3)}
            rows.append(r)
            print(json.dumps(r), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"rows": rows}))
        llm.close()
        llm = runner = None  # (the FP8 engine below needs the memory)
        linears.clear()
        if args.budget_s is not None:
            fp8_graphs(args, model_dir, batches, prompt_len, gen, backend, dry, rows, started, config)
    return 0


def step_time_row(engine: Any, run: Any, batches: list[int]) -> dict[str, Any]:
    """The step-time model's error (streamer/core/step_time.py: it plans stall-free steps), on the steps of fresh runs
    (prompts whole, then decodes, at two batch sizes) after it has been fitted on every step before: the median and
    90th percentile of |predicted - measured| / measured."""
    errors: list[float] = []
    observe = engine.core.observe_step

    def watched(sched: Any) -> None:
        predicted = sched.predicted
        observe(sched)
        if predicted > 0:
            errors.append(abs(predicted - engine.last_step[1]) / max(engine.last_step[1], 1e-9))

    engine.core.observe_step = watched
    try:
        for batch in (min(batches), min(32, max(batches))):
            run(batch, 16)
    finally:
        engine.core.observe_step = observe
    model = engine.scheduler.step_model
    err = sorted(errors)
    med = err[len(err) // 2] if err else float("nan")
    p90 = err[int(0.9 * (len(err) - 1))] if err else float("nan")
    return {"section": "e2e", "name": "step-time model: prediction error per step",
            "rel_err": f"median {100 * med:.1f}%, p90 {100 * p90:.1f}% over {len(err)} steps",
            "note": f"knee {model.knee} tokens, coef {[float(f'{c:.3g}') for c in model.coef]}"}


def prefill_budget(batches: list[int], prompt_len: int) -> int:
    """Tokens a step may take: the largest batch's prompts at once (so its decode steps are all full), within
    [2,048, 32,768]."""
    return min(max(2048, max(batches) * prompt_len), max(32768, prompt_len))


def step_weights(model: Any) -> tuple[int, int]:
    """(bytes a decode step reads, weights it multiplies by): every parameter but the input embedding's table,
    of which a step gathers a row a token (a tied table is read whole, as the output head)."""
    untied = getattr(model, "lm_head", None) is not None  # (lm_head None: the table is the output head too)
    skip = model.embed_tokens.weight if untied else None
    read = matmul = 0
    for p in model.parameters():
        if p is skip:
            continue
        read += p.numel() * p.element_size()
        matmul += p.numel() if p.dim() >= 2 else 0
    return read, matmul


def random_prompts(rng: random.Random, batch: int, prompt_len: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": [rng.randrange(3, config["vocab_size"]) for _ in range(prompt_len)]}
            for _ in range(batch)]


def timed_generate(llm: Any, prompts: list[dict[str, Any]], max_tokens: int, sampled: bool = False) -> float:
    """Seconds for llm.generate (greedy, or top-k/top-p/min-p sampling), the device synchronised around it."""
    import torch

    from streamer import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(
        dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05) if sampled else dict(temperature=0.0)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def fp8_graphs(args: argparse.Namespace, model_dir: Path, batches: list[int], prompt_len: int, gen: int,
               backend: Optional[str], dry: bool, rows: list[dict[str, Any]], started: float,
               config: dict[str, Any]) -> None:
    """quantization="fp8" as a user runs it (compiled, CUDA graphs, async scheduling): the rows to set beside
    "decode batch 1 / 32" above. The eager rows only show that FP8's per-token activation quantization costs
    launches; this is what a served FP8 model gets."""
    import gc

    import torch

    from streamer import LLM

    left = args.budget_s - (time.perf_counter() - started)
    if left < 100:
        print(f"# FP8 engine skipped: {left:.0f} s of the budget left", flush=True)
        return
    gc.collect()
    if not dry:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype="float32" if dry else "bfloat16",
              device="cpu" if dry else "cuda", max_num_seqs=32, max_model_len=prompt_len + gen + 16,
              max_num_batched_tokens=prefill_budget([32], prompt_len), enable_prefix_caching=False,
              attention_backend=backend, quantization="fp8")
    load_s = time.perf_counter() - t0
    rows.append({"section": "e2e", "name": "start-up, fp8 weights (the Inductor cache now warm for bf16's graphs)",
                 "ms": round(load_s * 1e3, 1), "note": f"{load_s:.1f} s to ready"})
    rng = random.Random(1)
    for batch in sorted({min(batches), min(32, max(batches))}):
        prompts = random_prompts(rng, batch, prompt_len, config)
        # warm-up, then prefill + first token, then the whole run
        times = {n: timed_generate(llm, prompts, n) for n in (2, 1, gen + 1)}
        step_s = max(times[gen + 1] - times[1], 1e-9) / gen
        r = {"section": "e2e", "name": f"decode batch {batch}, fp8 weights (compiled, graphs)",
             "ms": round(step_s * 1e3, 3), "tok_per_s": round(batch / step_s, 1), "prefill_s": round(times[1], 3)}
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"rows": rows}))
    llm.close()


if __name__ == "__main__":
    sys.exit(main())
