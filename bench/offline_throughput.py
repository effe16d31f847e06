"""Offline throughput: streamer's LLM.generate vs transformers' generate, same model, same prompts, one run.

    python bench/offline_throughput.py                      # ~90M-param Llama, dummy weights, bf16
    python bench/offline_throughput.py --model DIR --num-prompts 64 --input-len 256 --output-len 128
    python bench/offline_throughput.py --preset mamba2-130m     # a pure Mamba2 of mamba2-130m's shape, dummy weights

Without --model, a Llama config of ~90M parameters (or --preset's) is written to a temp folder (with the demo model's
tokenizer) and both engines use random weights. Prompts are random token ids of exactly --input-len tokens;
every request generates exactly --output-len tokens (EOS ignored) in both engines.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

LLAMA_90M = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12, vocab_size=8192,
                 max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                 torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)

# mamba2-130m's shape (transformers' Mamba2Config names), with the benchmark's 8192-id vocabulary
MAMBA2_130M = dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2", hidden_size=768, num_hidden_layers=24,
                   state_size=128, expand=2, n_groups=1, num_heads=24, head_dim=64, conv_kernel=4, vocab_size=8192,
                   chunk_size=256, residual_in_fp32=True, tie_word_embeddings=True, torch_dtype="bfloat16",
                   layer_norm_epsilon=1e-5, rms_norm=True, use_bias=False, use_conv_bias=True, bos_token_id=1,
                   eos_token_id=2, pad_token_id=0)
PRESETS = {"llama-90m": LLAMA_90M, "mamba2-130m": MAMBA2_130M}


def make_dummy_model(folder: Path, dtype: str, preset: str = "llama-90m") -> Path:
    """A preset's config (no weights: both engines initialise randomly) with a tokenizer beside it."""
    from streamer.demo_model import default_model_path
    src = default_model_path()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    cfg = dict(PRESETS[preset], torch_dtype=dtype)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run_streamer(model: Path, ps: list[list[int]], out_len: int, dtype: str, dummy: bool, **engine_args) -> dict:
    from streamer import LLM, SamplingParams
    llm = LLM(str(model), dtype=dtype, load_format="dummy" if dummy else "auto", **engine_args)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ps[0][:16]}], params.clone(max_tokens=2))  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "streamer", "seconds": dt, "output_tokens": n_out, "steps": llm.engine.num_steps}


def run_transformers(model: Path, ps: list[list[int]], out_len: int, dtype: str, dummy: bool,
                     batch_size: int) -> dict:
    import transformers as tf
    torch_dtype = getattr(torch, dtype)
    if dummy:
        cfg = tf.AutoConfig.from_pretrained(model)
        m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    else:
        m = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    m.eval()
    n_out = 0
    with torch.inference_mode():
        m.generate(torch.tensor([ps[0][:16]]), max_new_tokens=2, do_sample=False)  # warm-up
        t = time.perf_counter()
        for i in range(0, len(ps), batch_size):
            ids = torch.tensor(ps[i:i + batch_size])  # equal lengths: no padding needed
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
            n_out += (out.shape[1] - ids.shape[1]) * out.shape[0]
        dt = time.perf_counter() - t
    return {"engine": f"transformers {tf.__version__} (batch {batch_size})", "seconds": dt, "output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint folder (default: --preset, dummy weights)")
    ap.add_argument("--preset", default="llama-90m", choices=sorted(PRESETS), help="the model without --model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: all prompts)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--dummy", action="store_true", help="random weights for --model too (config only)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    dummy = args.model is None or args.dummy
    if args.model is None:
        tmp = Path(tempfile.mkdtemp())
        model = make_dummy_model(tmp / args.preset, args.dtype, args.preset)
    else:
        model = args.model
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ps = prompts(args.num_prompts, args.input_len, vocab, args.seed)
    rows = [run_streamer(model, ps, args.output_len, args.dtype, dummy,
                         max_num_batched_tokens=args.max_num_batched_tokens)]
    if not args.skip_transformers:
        rows.append(run_transformers(model, ps, args.output_len, args.dtype, dummy,
                                     args.hf_batch_size or args.num_prompts))
    total_in = args.num_prompts * args.input_len
    print(f"\nmodel: {model} ({'dummy weights' if dummy else 'checkpoint'}), {args.dtype}, "
          f"{args.num_prompts} requests x {args.input_len} in x {args.output_len} out, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'engine':<40} {'seconds':>9} {'out tok/s':>10} {'total tok/s':>12} {'vs transformers':>16}")
    base = rows[-1]["output_tokens"] / rows[-1]["seconds"]
    for r in rows:
        out_tps = r["output_tokens"] / r["seconds"]
        print(f"{r['engine']:<40} {r['seconds']:>9.2f} {out_tps:>10.1f} "
              f"{(r['output_tokens'] + total_in) / r['seconds']:>12.1f} {out_tps / base:>15.2f}x")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
