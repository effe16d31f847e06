"""Fused RMSNorm, rotary embedding and SiLU-and-mul against their torch references."""
from __future__ import annotations

import pytest
import torch

from streamer_kernels.testing import TOLERANCE, configure_for_tests, max_examples, rel_err

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.activation import silu_and_mul  # noqa: E402
from streamer_kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from streamer_kernels.reference import build_cos_sin_cache  # noqa: E402
from streamer_kernels.rotary import rotary_embedding  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=max_examples(60, 6), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
# Elementwise kernels round once more than nothing: bound them like attention outputs.
TOL = TOLERANCE


def _randn(shape, dtype, g, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 12), hidden=st.sampled_from([64, 96, 1000, 4096]),
       lead=st.sampled_from([(), (2,)]), strided=st.booleans(), eps=st.sampled_from([1e-5, 1e-6]),
       seed=st.integers(0, 2**31 - 1))
def test_rms_norm(dtype, rows, hidden, lead, strided, eps, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    base = _randn((*lead, rows, hidden + (32 if strided else 0)), dtype, g, scale=3.0)
    x = base[..., :hidden]  # rows with a stride larger than the row (a slice)
    w = _randn((hidden,), dtype, g)
    r = _randn((*lead, rows, hidden), dtype, g)
    x_before = x.clone()
    out = rms_norm(x, w, eps)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, reference.rms_norm(x, w, eps)) <= TOL[dtype]
    normed, new_res = fused_add_rms_norm(x, r, w, eps)
    exp_normed, exp_res = reference.fused_add_rms_norm(x, r, w, eps)
    assert rel_err(new_res, exp_res) <= TOL[dtype]
    assert rel_err(normed, exp_normed) <= TOL[dtype]
    assert torch.equal(x, x_before), "inputs must not be modified"


def test_rms_norm_fp32_weight_on_half_input() -> None:
    g = torch.Generator().manual_seed(0)
    x = _randn((5, 128), torch.float16, g)
    w = _randn((128,), torch.float32, g)
    assert rel_err(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)) <= TOL[torch.float16]


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), num_tokens=st.integers(1, 9), num_heads=st.sampled_from([1, 4, 6]),
       num_kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([64, 80, 96, 128, 256]),
       partial=st.sampled_from([1.0, 0.5, 0.75]), is_neox=st.booleans(), fused=st.booleans(),
       cache_in_dtype=st.booleans(), scaling=st.sampled_from([None, "llama3", "two_tables"]),
       seed=st.integers(0, 2**31 - 1))
@example(dtype=torch.bfloat16, num_tokens=5, num_heads=6, num_kv_heads=2, head_dim=128, partial=0.75, is_neox=True,
         fused=True, cache_in_dtype=False, scaling="two_tables", seed=0)  # Phi-4-mini's heads (24 / 8 over 4 ranks)
def test_rotary_embedding(dtype, num_tokens, num_heads, num_kv_heads, head_dim, partial, is_neox, fused,
                          cache_in_dtype, scaling, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    rot_dim = int(head_dim * partial)  # partial rotary: 0.75 is Phi-4-mini's (96 of 128)
    max_pos = 300
    rope_scaling = None if scaling != "llama3" else {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cache_dtype = dtype if cache_in_dtype else torch.float32
    cache = build_cos_sin_cache(rot_dim, max_pos, 10000.0, rope_scaling, dtype=cache_dtype)
    if scaling == "two_tables":  # LongRoPE's layout: a second table below the first, read at positions + max_pos
        cache = torch.cat([cache, build_cos_sin_cache(rot_dim, max_pos, 500.0, dtype=cache_dtype)])
    cache = cache.to(DEVICE)
    if fused:  # q and k as slices of one qkv tensor (non-contiguous rows)
        qkv = _randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, g)
        q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                      head_dim)
    else:
        q = _randn((num_tokens, num_heads, head_dim), dtype, g)
        k = _randn((num_tokens, num_kv_heads, head_dim), dtype, g)
    positions = torch.randint(0, cache.shape[0], (num_tokens,), generator=g).to(DEVICE)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = rotary_embedding(positions, q, k, cache, is_neox)
    q_exp, k_exp = reference.rotary_embedding(positions, q, k, cache, is_neox)
    assert rel_err(q_out, q_exp) <= TOL[dtype] and rel_err(k_out, k_exp) <= TOL[dtype]
    # The un-rotated tail is copied exactly; the rotated head is not (all positions 0 aside).
    assert torch.equal(q_out[..., rot_dim:], q[..., rot_dim:]) and torch.equal(k_out[..., rot_dim:], k[..., rot_dim:])
    assert positions.eq(0).all() or not torch.equal(q_out[..., :rot_dim], q[..., :rot_dim])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_rotary_matches_complex_rotation() -> None:
    """Independent check of the neox reference itself: rotate-half == complex multiplication by e^{i m theta}."""
    head_dim, pos = 64, 37
    cache = build_cos_sin_cache(head_dim, 100)
    x = torch.randn(1, 1, head_dim, dtype=torch.float64)
    q, _ = reference.rotary_embedding(torch.tensor([pos]), x.float(), x.float(), cache, True)
    theta = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    z = torch.complex(x[0, 0, :head_dim // 2], x[0, 0, head_dim // 2:]) * torch.exp(1j * pos * theta)
    assert torch.allclose(q[0, 0].double(), torch.cat([z.real, z.imag]), atol=1e-4)


def test_llama3_scaled_frequencies() -> None:
    """Llama-3 scaling keeps high frequencies, divides low ones by `factor`, and interpolates between."""
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
    plain = build_cos_sin_cache(128, 2, 500000.0)
    scaled = build_cos_sin_cache(128, 2, 500000.0, s)
    f_plain = torch.atan2(plain[1, 64:], plain[1, :64])  # angle at position 1 = inv_freq (all < pi)
    f_scaled = torch.atan2(scaled[1, 64:], scaled[1, :64])
    assert torch.allclose(f_scaled[:5], f_plain[:5])  # high frequency: unchanged
    assert torch.allclose(f_scaled[-5:], f_plain[-5:] / 8.0, rtol=1e-4)  # low frequency: / factor
    mid = (f_scaled < f_plain * 0.99) & (f_scaled > f_plain / 8.0 * 1.01)
    assert mid.any()


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 10), d=st.sampled_from([1, 64, 300, 1024, 2500]),
       lead=st.sampled_from([(), (3,)]), seed=st.integers(0, 2**31 - 1))
def test_silu_and_mul(dtype, rows, d, lead, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x = _randn((*lead, rows, 2 * d), dtype, g, scale=3.0)
    out = silu_and_mul(x)
    assert out.shape == (*lead, rows, d)
    assert rel_err(out, reference.silu_and_mul(x)) <= TOL[dtype]


def test_top_k_top_p_reference() -> None:
    """The sampling reference keeps exactly the top-k set, then the smallest head reaching top-p."""
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]]))
    masked = reference.top_k_top_p_mask(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.8]))
    kept = torch.isfinite(masked)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-2
    assert kept[1].tolist() == [False, False, True, True, True]  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    # The exponential race with all noise equal picks the most likely kept token.
    noise = torch.ones(2, 5)
    tokens = reference.top_k_top_p_sample(logits, torch.ones(2), None, None, noise)
    assert tokens.tolist() == [0, 4]
