"""The fused MoE kernels (grouped GEMMs over (token, expert) pairs sorted by expert) against the pair-by-pair
reference, and the alignment that groups the pairs."""
from __future__ import annotations

import pytest
import torch

from streamer_kernels.testing import TOLERANCE, configure_for_tests, max_examples, rel_err

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.moe import (  # noqa: E402
    ALIGN_KERNEL_MAX_PAIRS,
    MoeConfig,
    fused_moe,
    max_padded_pairs,
    moe_align,
    moe_align_torch,
)

SETTINGS = settings(max_examples=max_examples(20, 12), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _routing(tokens: int, experts: int, top_k: int, g: torch.Generator, skew: bool) -> tuple[torch.Tensor, ...]:
    """Each token's top_k distinct experts (skew: most tokens on the first two, as real routers often do)."""
    scores = torch.rand(tokens, experts, generator=g)
    if skew:
        scores[:, :2] += 1.0
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return weights, ids


@SETTINGS
@given(tokens=st.integers(1, 40), experts=st.integers(1, 9), top_k=st.integers(1, 4),
       block_m=st.sampled_from([16, 32, 64]), skew=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_alignment_groups_every_pair_once(tokens, experts, top_k, block_m, skew, seed):
    top_k = min(top_k, experts)
    _, ids = _routing(tokens, experts, top_k, torch.Generator().manual_seed(seed), skew)
    align = moe_align(ids.to(DEVICE), experts, block_m)
    pairs = tokens * top_k
    sorted_ids = align.sorted_ids.cpu()
    assert sorted_ids.numel() == max_padded_pairs(pairs, experts, block_m)
    padded = int(align.num_padded)
    assert padded % block_m == 0 and padded <= sorted_ids.numel()
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs)), "every pair exactly once"
    assert bool((sorted_ids[padded:] == pairs).all()), "nothing past the padded length"
    flat = ids.reshape(-1)
    for b in range(padded // block_m):
        tile = sorted_ids[b * block_m:(b + 1) * block_m]
        tile = tile[tile < pairs]
        assert tile.numel() > 0, "no empty tile below the padded length"
        assert bool((flat[tile] == int(align.block_expert[b])).all()), "a tile holds one expert's pairs"
        assert torch.equal(tile, tile.sort().values), "pairs keep their order within an expert"


@SETTINGS
@given(tokens=st.integers(1, 80), experts=st.integers(1, 300), top_k=st.integers(1, 8),
       block_m=st.sampled_from([16, 32, 64]), skew=st.booleans(), int32=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_alignment_kernel_is_the_torch_ops_bit_for_bit(tokens, experts, top_k, block_m, skew, int32, seed):
    """The one-launch alignment (decode-sized batches) gives exactly the torch ops' layout, over chunk and
    expert-count boundaries (up to 300 experts: wider than one power-of-two block of lanes)."""
    top_k = min(top_k, experts)
    _, ids = _routing(tokens, experts, top_k, torch.Generator().manual_seed(seed), skew)
    ids = (ids.to(torch.int32) if int32 else ids).to(DEVICE)
    assert ids.numel() <= ALIGN_KERNEL_MAX_PAIRS  # (the kernel's range)
    got, want = moe_align(ids, experts, block_m), moe_align_torch(ids, experts, block_m)
    assert torch.equal(got.sorted_ids, want.sorted_ids)
    assert torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.num_padded, want.num_padded)


@SETTINGS
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), tokens=st.integers(1, 24),
       experts=st.integers(1, 8), top_k=st.integers(1, 3), hidden=st.sampled_from([16, 48, 96]),
       inter=st.sampled_from([16, 40, 64]), bias=st.booleans(),
       activation=st.sampled_from(["silu", "gelu_tanh", "swiglu_oai", "relu2"]), fp32_weights=st.booleans(),
       skew=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_moe_matches_reference(dtype, tokens, experts, top_k, hidden, inter, bias, activation, fp32_weights,
                                     skew, seed):
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    first = inter if activation == "relu2" else 2 * inter  # (relu2 is ungated: an up projection alone)
    w13 = (torch.randn(experts, first, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    b13 = (torch.randn(experts, first, generator=g) * 0.1).to(dtype) if bias else None
    weights, ids = _routing(tokens, experts, top_k, g, skew)
    weights = weights if fp32_weights else weights.to(dtype)
    args = [t.to(DEVICE) if t is not None else None for t in (x, w13, w2, weights, ids, b13)]
    out = fused_moe(*args, activation=activation, alpha=1.702, limit=7.0)
    expected = reference.fused_moe(*args, activation=activation, alpha=1.702, limit=7.0)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, expected) <= 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("configs", [(MoeConfig(32, 32, 16, 8, 2), MoeConfig(32, 16, 32, 4, 4)),
                                     (MoeConfig(64, 128, 128), MoeConfig(64, 128, 128))])
def test_fused_moe_launch_configs(configs) -> None:
    """The sweep's launch shapes (tiles wider or deeper than the matrices, the two GEMMs' differing) give the
    reference's result; a block_m other than the alignment's is refused."""
    g = torch.Generator().manual_seed(5)
    tokens, experts, hidden, inter, top_k = 13, 4, 96, 40, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = _routing(tokens, experts, top_k, g, False)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    out = fused_moe(*args, configs=configs)
    assert rel_err(out, reference.fused_moe(*args)) <= 2 * TOLERANCE[torch.float32]
    with pytest.raises(AssertionError, match="block_m"):
        fused_moe(*args, configs=(configs[0], MoeConfig(16)))


def test_fused_moe_rows_reach_their_own_experts() -> None:
    """Each expert a distinct scaling of the identity: a token's output says which experts it was sent to."""
    experts, hidden = 6, 16
    eye = torch.eye(hidden)
    w13 = torch.stack([torch.cat([eye * 10, eye * (e + 1)]) for e in range(experts)])  # silu(10x) ~ 10x for x >> 0
    w2 = torch.stack([eye for _ in range(experts)])
    ids = torch.tensor([[5, 0], [2, 3], [0, 5], [1, 4]])
    weights = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [1.0, 0.0]])
    x = torch.ones(4, hidden)
    out = fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids))).cpu()
    silu10 = torch.nn.functional.silu(torch.tensor(10.0)).item()
    expected = torch.tensor([6.0, (3 + 4) / 2, 6.0, 2.0]) * silu10
    assert torch.allclose(out[:, 0], expected, rtol=1e-5), out[:, 0]


def test_fused_moe_on_a_model_layer_matches_the_cpu_op() -> None:
    """The engine's MoE op dispatches here under Triton: its output equals the op's CPU loop path."""
    from streamer.models import moe as moe_mod

    g = torch.Generator().manual_seed(3)
    tokens, experts, hidden, inter, top_k = 11, 5, 32, 24, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = _routing(tokens, experts, top_k, g, skew=True)
    loop = moe_mod._expert_loop(x, weights, ids, experts, lambda e, rows: torch.nn.functional.linear(
        reference.expert_activation(torch.nn.functional.linear(rows, w13[e])), w2[e]))
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    fused = torch.ops.streamer.moe_experts(*args, fused=True).cpu()
    assert rel_err(fused, loop) <= TOLERANCE[torch.float32]
    assert not torch.equal(fused, torch.ops.streamer.moe_experts(*args).cpu()), "fused=True took the loop too"


def test_an_unbuildable_kernel_falls_back_to_the_torch_path(monkeypatch, caplog) -> None:
    """Triton failing to build the kernels (an old compiler, too little shared memory) costs speed, not service:
    the op warns once and runs the experts one at a time; any other error still surfaces."""
    from triton.runtime.errors import OutOfResources

    import streamer_kernels
    from streamer.models import moe as moe_mod

    g = torch.Generator().manual_seed(5)
    x, w13 = torch.randn(6, 16, generator=g), torch.randn(3, 24, 16, generator=g)
    w2 = torch.randn(3, 16, 12, generator=g)
    weights, ids = _routing(6, 3, 2, g, skew=False)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    expected = torch.ops.streamer.moe_experts(*args)

    def unbuildable(*a, **k):
        raise OutOfResources(required=300000, limit=232448, name="shared memory")
    monkeypatch.setattr(streamer_kernels, "fused_moe", unbuildable)
    monkeypatch.setattr(moe_mod, "_fused_moe_unbuildable", False)
    with caplog.at_level("WARNING", logger="streamer"):
        out = torch.ops.streamer.moe_experts(*args, fused=True)
    assert torch.equal(out, expected) and moe_mod._fused_moe_unbuildable
    assert "fused MoE kernels unavailable" in caplog.text

    def broken(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(streamer_kernels, "fused_moe", broken)
    monkeypatch.setattr(moe_mod, "_fused_moe_unbuildable", False)
    with pytest.raises(RuntimeError, match="a bug"):
        torch.ops.streamer.moe_experts(*args, fused=True)
