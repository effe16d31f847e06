"""What the prefill attention kernel's hot loops compile to on a GPU target, without a GPU.

    python bench/attention_sass.py [--arch 90] [--head-dim 128] [--dump DIR]

For each launch shape of `unified_attention` at Llama-3-8B's heads (32 query heads over 8 KV heads, bf16) and
the engine's 16-token cache blocks, compiles the prefill kernel for sm_<arch> (streamer_kernels.aot's stand-in
driver), disassembles the cubin with Triton's bundled nvdisasm and prints registers, spills, shared memory and,
per loop, its SASS instruction count and mix: the tensor-core ops (HGMMA on sm_90, HMMA before), the softmax's
exponentials (MUFU), the rest. Instructions per key of the unmasked loop are what a compute-bound prefill pays
besides its matmuls; where the wait for a Q.K^T (WARPGROUP.DEPBAR) sits relative to the exponentials shows
whether the softmax overlaps the tensor cores. A static proxy for the GPU check's timings, for sessions without a
GPU; it says nothing about latency or occupancy. Must run with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamer_kernels import _utils  # noqa: E402
from streamer_kernels.aot import _ptxas_usage, compile_only  # noqa: E402
from streamer_kernels.attention import AttentionConfig, attention_config, unified_attention  # noqa: E402

# (label, config; None = the default for the target)
SHAPES: list[tuple[str, Optional[AttentionConfig]]] = [
    ("default", None),
    ("bm=128 tn=64 w=8 st=3 (default before session 33)", AttentionConfig(128, 64, 8, 3)),
    ("bm=128 tn=128 w=8 st=2", AttentionConfig(128, 128, 8, 2)),
    ("bm=128 tn=64 w=8 st=3 pipe", AttentionConfig(128, 64, 8, 3, True)),
    ("bm=128 tn=128 w=8 st=2 pipe", AttentionConfig(128, 128, 8, 2, True)),
]


def _nvdisasm() -> str:
    from triton.backends.nvidia import compiler
    return str(Path(compiler.__file__).parent / "bin" / "nvdisasm")


def sass_of(cubin: bytes) -> list[str]:
    """The cubin's instructions in order, and label lines as '.L_x_N:'."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    out = []
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        ins = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if label:
            out.append(label.group(1) + ":")
        elif ins:
            out.append(ins.group(1))
    return out


def loops(lines: list[str]) -> list[list[str]]:
    """Bodies of the loops: from a label to the last backward branch to it."""
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for line in lines:
        if line.endswith(":"):
            labels[line[:-1]] = len(instrs)
        else:
            instrs.append(line)
    bodies = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            bodies.append(instrs[labels[m.group(1)]:i + 1])
    return bodies


def opcode(ins: str) -> str:
    words = ins.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def exps_before_wait(body: list[str]) -> tuple[int, int]:
    """(exponentials issued before the first tensor-core wait after a Q.K^T, exponentials in all)."""
    total = sum(opcode(i) == "MUFU" for i in body)
    seen_mma = False
    before = 0
    for ins in body:
        op = opcode(ins)
        if op in ("HGMMA", "HMMA"):
            seen_mma = True
        elif op == "MUFU":
            before += 1
        elif seen_mma and "WARPGROUP.DEPBAR" in ins:
            return before, total
    return before, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dump", default=None, help="write each variant's SASS here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        sys.exit("unset TRITON_INTERPRET: this compiles for a GPU target")
    D, H, HKV, BS = args.head_dim, 32, 8, 16
    kv = torch.empty(2, 64, BS, HKV, D, dtype=torch.bfloat16)
    table = torch.zeros(4, 16, dtype=torch.int32)
    seq_lens = torch.full((4,), 200, dtype=torch.int32)
    q = torch.empty(200, H, D, dtype=torch.bfloat16)
    qsl = torch.arange(5, dtype=torch.int32) * 50
    print(f"unified_attention prefill, bf16, D={D}, {H}/{HKV} heads, {BS}-token blocks, sm_{args.arch}")
    with compile_only(args.arch) as compiled:
        for label, cfg in SHAPES:
            compiled.clear()
            unified_attention(q, kv[0], kv[1], torch.empty_like(q), qsl, seq_lens, table, D ** -0.5, 50, 200,
                              config=cfg)
            ck: Any = compiled[0]
            regs, spills = _ptxas_usage(ck.asm["ptx"], args.arch)
            lines = sass_of(ck.asm["cubin"])
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                (Path(args.dump) / (re.sub(r"\W+", "_", label) + ".sass")).write_text("\n".join(lines))
            md = ck.metadata
            print(f"\n{label}: {md.num_warps} warps, {md.num_stages} stages, {regs} registers, {spills} B spilled, "
                  f"{md.shared // 1024} KB shared")
            tile_n = (cfg or attention_config(D, H // HKV, 50, torch.bfloat16, target=_utils.COMPILE_TARGET)).tile_n
            for body in loops(lines):
                if len(body) < 100:  # (the binary search, the prologue's small loops)
                    continue
                mix = collections.Counter(opcode(i) for i in body)
                masked = mix["FSEL"] > 0
                before, total = exps_before_wait(body)
                top = ", ".join(f"{op} {n}" for op, n in mix.most_common(8))
                keys = f" ({len(body) * 64 / tile_n:.0f} per 64 keys)"
                print(f"  {'masked' if masked else 'unmasked'} loop: {len(body)} instructions{keys}; "
                      f"exponentials before the Q.K^T wait {before}/{total}; {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
