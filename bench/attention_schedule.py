"""How long the causal prefill grid's tail is: a list schedule of unified_attention's programs over a GPU's SMs.

    python bench/attention_schedule.py [--sms 132] [--kv-heads 8] [--group 4]

A GPU starts a grid's programs in id order, each on the first SM with room, so the order decides how idle the
last SMs sit while the longest programs finish. Under the causal mask a q-block's work grows with its position
(its key tiles), so the kernel launches each prompt's last q-blocks first. This replays the launch order (as the
kernel numbers programs) with each program's cost = its key tiles + a fixed half tile (prologue and epilogue), for
the launch shape `attention_config` picks on an H200 (one program per SM: 160 KB of shared memory), and prints
the makespan against the ideal (total work / SMs), with KV heads outermost (before session 34) and fastest (now).
A model of the tail only: it ignores memory contention and per-tile variation. No GPU needed.
"""
from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamer_kernels.aot import _SHARED_MEMORY  # noqa: E402
from streamer_kernels.attention import attention_config  # noqa: E402


def makespan(costs: list[float], slots: int) -> float:
    """Programs started in order, each on the slot that frees first."""
    free = [0.0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def program_costs(prompt_lens: list[int], kv_heads: int, block_q: int, tile_n: int, heads_fastest: bool,
                  ) -> list[float]:
    """Each program's cost in launch order: a prompt's q-blocks last first (as the kernel maps them)."""
    per_q: list[float] = []
    for n in prompt_lens:
        blocks = -(-n // block_q)
        for b in reversed(range(blocks)):
            per_q.append(-(-min((b + 1) * block_q, n) // tile_n) + 0.5)
    if heads_fastest:
        return [c for c in per_q for _ in range(kv_heads)]
    return [c for _ in range(kv_heads) for c in per_q]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    args = ap.parse_args()
    cfg = attention_config(128, args.group, 4096, torch.bfloat16, target=(90, _SHARED_MEMORY[90]))
    block_q = cfg.block_m // args.group
    print(f"{args.kv_heads} KV heads x {args.group} query heads, q-blocks of {block_q} tokens, {cfg.tile_n}-key "
          f"tiles, {args.sms} SMs; makespan / ideal")
    print(f"{'prompts':>24} | {'KV heads outermost':>18} | {'KV heads fastest':>16}")
    for prompts in ([1024], [2048], [4096], [8192], [2048] * 4, [4096] * 4, [512, 1024, 3000, 7000]):
        ideal = sum(program_costs(prompts, args.kv_heads, block_q, cfg.tile_n, True)) / args.sms
        cells = [makespan(program_costs(prompts, args.kv_heads, block_q, cfg.tile_n, fastest), args.sms) / ideal
                 for fastest in (False, True)]
        label = " + ".join(str(n) for n in prompts) if len(set(prompts)) > 1 else f"{len(prompts)} x {prompts[0]}"
        print(f"{label:>24} | {cells[0]:18.3f} | {cells[1]:16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
