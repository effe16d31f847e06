"""reshape_and_cache against the torch reference: exact copies at the mapped slots, nothing else touched."""
from __future__ import annotations

import pytest
import torch

from streamer_kernels.testing import configure_for_tests, max_examples

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.cache import reshape_and_cache  # noqa: E402


@settings(max_examples=max_examples(40, 8), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       num_kv_heads=st.sampled_from([1, 2, 3, 8]), head_dim=st.sampled_from([64, 80, 96, 128, 256]),
       block_size=st.sampled_from([16, 32, 64]), num_tokens=st.integers(1, 40),
       pad_fraction=st.floats(0.0, 0.5), fused=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_reshape_and_cache_random(dtype, num_kv_heads, head_dim, block_size, num_tokens, pad_fraction, fused,
                                  seed) -> None:
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    if fused:  # k and v as strided slices of one qkv projection output, as the model produces them
        qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
        k = qkv[:, 4 * head_dim:(4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, (4 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    else:
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    # Distinct random slots anywhere in the pool (non-contiguous blocks), some of them padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    pad = torch.rand(num_tokens, generator=g) < pad_fraction
    slots[pad] = -1
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                          device=DEVICE)
    expected = kv_cache.clone()
    reference.reshape_and_cache(k, v, expected[0], expected[1], slots.to(DEVICE))
    reshape_and_cache(k, v, kv_cache[0], kv_cache[1], slots.to(DEVICE))
    # Bit-exact: written slots hold the inputs, every other slot is still NaN.
    written = ~expected.isnan()
    assert torch.equal(~kv_cache.isnan(), written)
    assert torch.equal(kv_cache[written], expected[written])


def test_slot_mapping_longer_than_keys_and_empty() -> None:
    """Extra slot_mapping entries (padding beyond the real tokens) and empty inputs are fine."""
    kv = torch.zeros(2, 4, 16, 2, 64, device=DEVICE)
    k = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([5, -1, 17, 40, 41], device=DEVICE)
    reshape_and_cache(k, k, kv[0], kv[1], slots)
    flat = kv[0].reshape(-1, 2, 64)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[17], k[2])
    assert flat[40].abs().sum() == 0 and flat[41].abs().sum() == 0
    reshape_and_cache(k[:0], k[:0], kv[0], kv[1], slots[:0])
