"""What the Triton sampler's loops compile to on a GPU target, without a GPU.

    python bench/sampler_sass.py [--arch 90] [--vocab 128256]

Compiles `streamer_kernels.top_k_top_p_sample` (top-k, top-p and min-p on, as the engine's sampler launches it)
for sm_<arch> with streamer_kernels.aot's stand-in driver and prints registers, spills and, per loop, its SASS
instruction count and mix, and instructions per vocabulary entry for the loops over one BLOCK-wide tile (a
threshold search runs ~9 passes of such a loop per filter, so they dominate a row's cost). An outer loop's count
includes the loops nested in it. A static proxy for sessions without a GPU: it says nothing about latency.
Must run with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sass import loops, opcode, sass_of  # noqa: E402

from streamer_kernels.aot import _ptxas_usage, compile_only  # noqa: E402
from streamer_kernels.sampling import BLOCK_MAX, top_k_top_p_sample  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        sys.exit("unset TRITON_INTERPRET: this compiles for a GPU target")
    B, V = 8, args.vocab
    ones = torch.ones(B)
    with compile_only(args.arch) as compiled:
        top_k_top_p_sample(torch.empty(B, V), ones, torch.full((B,), 50), ones * 0.9, torch.empty(B, V), ones * 0.1)
    ck: Any = compiled[0]
    regs, spills = _ptxas_usage(ck.asm["ptx"], args.arch)
    md = ck.metadata
    threads = md.num_warps * 32
    block = min(BLOCK_MAX, 1 << (V - 1).bit_length())
    print(f"top_k_top_p_sample (top-k, top-p, min-p), vocab {V}, sm_{args.arch}: {md.num_warps} warps, {regs} "
          f"registers, {spills} B spilled; tiles of {block} entries, {block // threads} per thread")
    bodies = [b for b in loops(sass_of(ck.asm["cubin"])) if len(b) >= 50]
    texts = ["\n".join(b) for b in bodies]
    for body, text in zip(bodies, texts):
        mix = collections.Counter(opcode(i) for i in body)
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(6))
        if any(t != text and t in text for t in texts):
            print(f"  a pass: {len(body)} instructions with the tile loop above: {top}")
        else:
            print(f"  tile loop: {len(body)} instructions, {len(body) * threads / block:.0f} per entry: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
