"""The LoRA kernel (each token through its own adapter slot) against its torch reference."""
from __future__ import annotations

import pytest
import torch

from streamer_kernels.testing import TOLERANCE, configure_for_tests, max_examples, rel_err

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.lora import lora_add  # noqa: E402

SETTINGS = settings(max_examples=max_examples(25, 8), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), tokens=st.integers(1, 9),
       slots=st.integers(1, 4), rank=st.sampled_from([1, 8, 16, 48, 96]), k=st.sampled_from([16, 100, 768]),
       n=st.sampled_from([8, 200, 640]), row_stride_pad=st.sampled_from([0, 24]), seed=st.integers(0, 2**31 - 1))
def test_lora_add_matches_reference(dtype, tokens, slots, rank, k, n, row_stride_pad, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots + 1, rank, k, generator=g).to(dtype)
    b = (torch.randn(slots + 1, n, rank, generator=g) / rank ** 0.5).to(dtype)
    a[0], b[0] = 0, 0  # slot 0: no adapter (the engine keeps it zero; the kernel skips it)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    which = torch.randint(0, slots + 1, (tokens,), generator=g)
    # y as row slices of a wider buffer: the kernel must honour the row stride.
    y_buf = torch.randn(tokens, n + row_stride_pad, generator=g).to(dtype)
    a, b, x, which, y_buf = (t.to(DEVICE) for t in (a, b, x, which, y_buf))
    y = y_buf[:, :n]
    expected = y.clone()
    reference.lora_add(expected, x, a, b, which)
    before = y_buf.clone()
    lora_add(y, x, a, b, which)
    assert rel_err(y, expected) <= TOLERANCE[dtype]
    untouched = which == 0
    assert torch.equal(y[untouched], before[untouched, :n]), "a row without an adapter changed"
    assert torch.equal(y_buf[:, n:], before[:, n:]), "the kernel wrote past a row"
    if (~untouched).any():
        assert not torch.equal(y[~untouched], before[~untouched, :n])
