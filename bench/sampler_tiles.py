"""How much of a row the Triton sampler reads: its passes replayed in numpy, counting 1,024-entry tiles.

    python bench/sampler_tiles.py [--rows 64] [--vocab 128256]

`streamer_kernels.sampling` finds each filter's threshold by narrowing a key range 16 pivots at a time, one pass
over the row per narrowing; since session 34 a pass skips the tiles whose largest key (recorded by the max pass)
is below the range, and the race reads only tiles that can hold the winner. This replays the same pivots on the
GPU check's rows (randn * 4 logits over Llama 3's vocabulary, temperature 0.8, top-k 50, top-p 0.9, min-p 0.05,
and greedy rows) and prints tiles read per row with and without the skipping. The replay's kept sets are checked
against the reference sampler's, so that the count is of the real search. A model
of work, not a timing: no GPU needed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.sampling import BLOCK_MAX, NUM_PIVOTS  # noqa: E402

KEY_MIN = -(2 ** 31)


def keys(x: np.ndarray) -> np.ndarray:
    b = np.where(x == 0.0, np.float32(0.0), x).astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(b >= 0, b, b ^ 0x7FFFFFFF)


def replay(x: np.ndarray, top_k: int, top_p: float, min_p: float, sampled: bool) -> tuple[np.ndarray, int, int]:
    """(the kept tokens, tiles read with skipping, tiles read without) for one row of scaled logits."""
    tiles = -(-len(x) // BLOCK_MAX)
    k = keys(x)
    padded = np.full(tiles * BLOCK_MAX, KEY_MIN, dtype=np.int64)
    padded[:len(x)] = k
    tile_max = padded.reshape(tiles, BLOCK_MAX).max(axis=1)
    row_max = float(x.max())
    w = np.exp((x - row_max).astype(np.float64))
    read, full = tiles, tiles  # the max pass
    floor = KEY_MIN

    def search(floor: int, target: float, by_mass: bool) -> int:
        nonlocal read, full
        lo, hi = floor, int(keys(np.array([row_max], dtype=np.float32))[0])
        j = np.arange(NUM_PIVOTS)
        need = None if by_mass else target
        while lo < hi:
            piv = lo + ((hi - lo) * j + NUM_PIVOTS - 1) // NUM_PIVOTS
            read += int((tile_max >= lo).sum())
            full += tiles
            hit = k[None, :] >= piv[:, None]
            acc = (hit * w[None, :]).sum(axis=1) if by_mass else hit.sum(axis=1).astype(np.float64)
            if need is None:
                need = target * acc[0]
            best = int(np.max(np.where(acc >= need, j, 0)))
            hi = hi if best == NUM_PIVOTS - 1 else int(piv[best + 1]) - 1
            lo = int(piv[best])
        return lo

    if sampled:
        if 0 < top_k < len(x):
            floor = search(floor, top_k, False)
        if top_p < 1.0:
            floor = search(floor, top_p, True)
    cut = row_max + np.log(min_p) if sampled and min_p > 0 else -np.inf
    race_lo = max(floor, int(keys(np.array([cut], dtype=np.float32))[0])) if sampled else int(k.max())
    read += int((tile_max >= race_lo).sum())
    full += tiles
    return (k >= floor) & (x >= cut), read, full


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=g) * 4
    temp, top_k, top_p, min_p = 0.8, 50, 0.9, 0.05
    scaled = (logits / temp).numpy()
    # The reference's kept set for the same filters: its smallest kept value is the threshold to match.
    B = args.rows
    full = lambda v, dt=torch.float32: torch.full((B,), v, dtype=dt)  # noqa: E731
    masked = reference.top_k_top_p_mask(logits / temp, full(top_k, torch.long), full(top_p))
    probs = masked.softmax(dim=-1)
    kept = torch.isfinite(masked) & (probs >= min_p * probs.max(dim=-1, keepdim=True).values)
    reads, fulls, agree = [], [], 0
    for r in range(B):
        mine, read, full_reads = replay(scaled[r], top_k, top_p, min_p, True)
        agree += bool((mine == kept[r].numpy()).all())
        reads.append(read)
        fulls.append(full_reads)
    g_read, g_full = zip(*[replay(scaled[r], 0, 1.0, 0.0, False)[1:] for r in range(min(B, 8))])
    tiles = -(-args.vocab // BLOCK_MAX)
    print(f"{B} rows x {args.vocab} (tiles of {BLOCK_MAX}: {tiles} a row); rows whose kept set is the reference's: "
          f"{agree}/{B}")
    print(f"{'rows':>28} | {'tiles read, no skipping':>23} | {'with skipping':>13} | ratio")
    print(f"{'top-k 50, top-p 0.9, min-p':>28} | {np.mean(fulls):23.0f} | {np.mean(reads):13.0f} | "
          f"{np.mean(fulls) / np.mean(reads):.1f}x")
    print(f"{'greedy':>28} | {np.mean(g_full):23.0f} | {np.mean(g_read):13.0f} | "
          f"{np.mean(g_full) / np.mean(g_read):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
