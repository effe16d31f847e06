"""The CPU expert loop of the sparse MLPs (streamer/models/moe.py): a lone token (single-stream decode) skips the
sort and the scatter, and must give exactly what the general path gives it."""
from __future__ import annotations

import pytest
import torch

from streamer.models.moe import _expert_loop, _scattered


@pytest.mark.parametrize("dtype,weights_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float32)])
@pytest.mark.parametrize("seed", range(4))
def test_lone_token_matches_the_scattered_path(dtype, weights_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    experts, k, hidden = 8, 3, 32
    mats = torch.randn(experts, hidden, hidden, generator=g).to(dtype)
    x = torch.randn(1, hidden, generator=g).to(dtype)
    ids = torch.randperm(experts, generator=g)[:k][None]  # (not in expert order: the loop sorts them)
    weights = torch.rand(1, k, generator=g).to(weights_dtype)
    calls: list[int] = []

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append(e)
        return rows @ mats[e].T

    lone = _expert_loop(x, weights, ids, experts, expert)
    assert calls == sorted(ids[0].tolist()), "the lone path did not call each chosen expert once, in order"
    assert torch.equal(lone, _scattered(x, weights, ids, experts, expert))
    assert lone.dtype == dtype and lone.shape == x.shape
    # and the sum is what it should be (up to rounding)
    want = sum(weights[0, j].float() * (x.float() @ mats[e].float().T) for j, e in enumerate(ids[0].tolist()))
    torch.testing.assert_close(lone.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
