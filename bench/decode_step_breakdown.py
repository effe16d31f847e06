"""Where one CPU decode step's time goes: streamer's torch attention backend (paged KV gathered per step) vs the
model's linear layers, for B decoding requests with L tokens of context each, bf16, ~90M Llama shapes.

    python bench/decode_step_breakdown.py [--batch 64] [--context 320 1088] [--layers 12]

Times one layer's decode attention (TorchAttentionBackend.forward on B single-token queries over a paged
KV cache), the same attention with the KV already contiguous (no gather; the arithmetic alone), and one layer's
linears (qkv, o, gate/up, down at hidden 768 / intermediate 2048) on B tokens, then scales by --layers.
Used to explain the decode cliff in bench/RESULTS.md (2026-11-30); it only reads streamer, it changes nothing.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch


def bench(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[320, 1088])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from streamer.attention.base import AttentionMetadata, AttentionSpec
    from streamer.attention.torch_backend import TorchAttentionBackend

    dt, H, D, hidden, inter, bs = torch.bfloat16, 12, 64, 768, 2048, 16
    B = args.batch
    spec = AttentionSpec(num_heads=H, num_kv_heads=H, head_dim=D, scale=D ** -0.5)
    be = TorchAttentionBackend(spec)
    w = {n: torch.randn(o, i, dtype=dt) * 0.02 for n, (o, i) in
         {"qkv": (3 * hidden, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
          "down": (hidden, inter)}.items()}
    x, xi = torch.randn(B, hidden, dtype=dt), torch.randn(B, inter, dtype=dt)

    def linears():
        torch.nn.functional.linear(x, w["qkv"])
        torch.nn.functional.linear(x, w["o"])
        torch.nn.functional.linear(x, w["gate_up"])
        torch.nn.functional.linear(xi, w["down"])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}, "
          f"batch {B}, bf16, per-step times for {args.layers} layers")
    t_lin = bench(linears, args.reps) * args.layers
    print(f"{'context':>8} {'attention (paged)':>18} {'attention (contiguous KV)':>26} {'linears':>9} "
          f"{'attention share':>16}")
    for L in args.context:
        nb = -(-L // bs)
        num_blocks = B * nb + 1
        kv = torch.randn(2, num_blocks, bs, H, D, dtype=dt)
        perm = torch.randperm(num_blocks - 1)[:B * nb].view(B, nb).to(torch.int32)  # scattered blocks
        q, k, v = (torch.randn(B, H, D, dtype=dt) for _ in range(3))
        slots = (perm[:, (L - 1) // bs].long() * bs + (L - 1) % bs)
        qsl = np.arange(B + 1, dtype=np.int32)
        seq = np.full(B, L, dtype=np.int32)
        meta = AttentionMetadata(num_reqs=B, num_tokens=B, query_start_loc=torch.from_numpy(qsl),
                                 seq_lens=torch.from_numpy(seq), block_table=perm, slot_mapping=slots,
                                 max_query_len=1, max_seq_len=L, query_start_loc_cpu=qsl, seq_lens_cpu=seq)
        t_paged = bench(lambda q=q, k=k, v=v, kv=kv, meta=meta: be.forward(q, k, v, kv, meta), args.reps) * args.layers
        kc, vc = torch.randn(B, H, D, L, dtype=dt), torch.randn(B, H, L, D, dtype=dt)

        def contiguous(q=q, kc=kc, vc=vc):
            s = torch.matmul(q.view(B, H, 1, D), kc).float() * spec.scale
            torch.matmul(s.softmax(-1).to(dt), vc)

        t_cont = bench(contiguous, args.reps) * args.layers
        share = t_paged / (t_paged + t_lin)
        print(f"{L:>8} {t_paged * 1e3:>15.0f} ms {t_cont * 1e3:>23.0f} ms {t_lin * 1e3:>6.0f} ms {100 * share:>15.0f}%")


if __name__ == "__main__":
    main()
