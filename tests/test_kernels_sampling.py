"""The Triton top-k/top-p/min-p sampler against its torch reference, on the same exponential noise."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from streamer_kernels.testing import configure_for_tests, max_examples

DEVICE = configure_for_tests()
triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from streamer_kernels import reference  # noqa: E402
from streamer_kernels.sampling import top_k_top_p_sample  # noqa: E402

SETTINGS = settings(max_examples=max_examples(100, 12), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
# fp32 mass sums in a different order than the reference's cumsum: a top-p boundary this close to top_p may
# legitimately fall on either side.
MASS_EPS = 1e-5


def _reference_kept(scaled: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """[B, V] bool: the tokens the reference's filters keep."""
    masked = reference.top_k_top_p_mask(scaled, top_k, top_p)
    kept = torch.isfinite(masked)
    if min_p is not None:
        probs = masked.softmax(dim=-1)
        kept &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return kept


def _near_boundary(scaled_row: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float,
                   value: float) -> bool:
    """Whether keeping or dropping `value` is decided within rounding: its top-p mass sits within MASS_EPS
    of top_p, or it sits within rounding of the min-p cut. A top-k decision never is (counting is exact)."""
    x = scaled_row.double()
    if min_p > 0 and abs(value - float(x.max()) - torch.log(torch.tensor(min_p, dtype=torch.float64))) < 1e-4:
        return True
    if top_p >= 1.0:
        return False
    if top_k is not None and 0 < top_k < len(x):
        x = x.masked_fill(x < x.sort(descending=True).values[top_k - 1], float("-inf"))
    p = x.softmax(dim=-1)
    above, at_or_above = float(p[x > value].sum()), float(p[x >= value].sum())
    return abs(above - top_p) < MASS_EPS or abs(at_or_above - top_p) < MASS_EPS


def _check(logits, temperature, top_k, top_p, min_p, noise) -> None:
    tokens, threshold = top_k_top_p_sample(logits, temperature, top_k, top_p, noise, min_p, return_threshold=True)
    expected = reference.top_k_top_p_sample(logits, temperature, top_k, top_p, noise, min_p)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / temp[:, None]
    want = _reference_kept(scaled, top_k, top_p, min_p)
    for row in range(logits.shape[0]):
        if temperature[row] <= 0:
            assert tokens[row] == expected[row], f"greedy row {row}"
            continue
        k = int(top_k[row]) if top_k is not None else None
        p = float(top_p[row]) if top_p is not None else 1.0
        mp = float(min_p[row]) if min_p is not None else 0.0
        if not ((k is not None and 0 < k < logits.shape[1]) or p < 1.0 or mp > 0):
            assert float(threshold[row]) == float("-inf"), f"row {row}: no filter, yet a threshold"
        got = torch.isfinite(scaled[row]) & (scaled[row] >= threshold[row])
        if not torch.equal(got, want[row]):
            for value in scaled[row][got != want[row]].unique().tolist():
                assert _near_boundary(scaled[row], k, p, mp, value), (
                    f"row {row}: the kernel and the reference disagree on keeping {value}")
            continue  # the race may then differ as well
        if tokens[row] != expected[row]:
            # A race decided by rounding: both tokens' race values agree to fp32 precision.
            race = torch.where(got, (scaled[row] - scaled[row].max()).exp() / noise[row], -1.0)
            a, b = float(race[tokens[row]]), float(race[expected[row]])
            assert got[tokens[row]] and abs(a - b) <= 1e-5 * max(a, b), (
                f"row {row}: token {int(tokens[row])} vs reference {int(expected[row])}")


def _params(draw_k, draw_p, draw_min_p, batch, vocab, g):
    top_k = torch.randint(-1, vocab + 3, (batch,), generator=g) if draw_k else None
    if top_k is not None:  # a few small k, which is how top-k is used
        top_k = torch.where(torch.rand(batch, generator=g) < 0.5, torch.randint(1, 8, (batch,), generator=g), top_k)
    top_p = torch.rand(batch, generator=g).clamp(0.02, 1.0) if draw_p else None
    if top_p is not None:
        top_p = torch.where(torch.rand(batch, generator=g) < 0.2, torch.ones(batch), top_p)
    min_p = torch.where(torch.rand(batch, generator=g) < 0.6, torch.rand(batch, generator=g) * 0.3,
                        torch.zeros(batch)) if draw_min_p else None
    return top_k, top_p, min_p


@SETTINGS
@given(batch=st.integers(1, 5), vocab=st.sampled_from([1, 7, 300, 1024, 2500]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), scale=st.sampled_from([0.5, 3.0, 12.0]),
       use_k=st.booleans(), use_p=st.booleans(), use_min_p=st.booleans(), ties=st.booleans(),
       banned=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_sampler_matches_reference(batch, vocab, dtype, scale, use_k, use_p, use_min_p, ties, banned, strided,
                                   seed) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab + (5 if strided else 0), generator=g) * scale
    if ties:  # coarse values: many tokens share the boundary value
        logits = (logits * 2).round() / 2
    if banned and vocab > 1:
        # Masked tokens (min_tokens bans eos this way): at most a quarter, so every row keeps finite ones.
        logits[:, torch.randint(0, vocab, (max(1, vocab // 4),), generator=g)] = float("-inf")
    logits = logits.to(dtype)[:, :vocab]
    temperature = torch.rand(batch, generator=g) * 1.5 + 0.2
    temperature = torch.where(torch.rand(batch, generator=g) < 0.2, torch.zeros(batch), temperature)
    top_k, top_p, min_p = _params(use_k, use_p, use_min_p, batch, vocab, g)
    noise = torch.empty(batch, vocab).exponential_(generator=g)

    def to(t):
        return None if t is None else t.to(DEVICE)
    _check(logits.to(DEVICE), temperature.to(DEVICE), to(top_k), to(top_p), to(min_p), noise.to(DEVICE))


def test_sampler_boundary_ties_are_kept() -> None:
    # Four tokens tie for second place: top_k=2 keeps all five, as the reference does.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, 0.0, -2.0]], device=DEVICE)
    noise = torch.ones(1, 7, device=DEVICE)
    noise[0, 4] = 1e-6  # the last tied token wins the race when it is kept
    one = torch.ones(1, device=DEVICE)
    tokens, thr = top_k_top_p_sample(logits, one, torch.tensor([2], device=DEVICE), None, noise,
                                     return_threshold=True)
    assert float(thr[0]) == 1.0 and int(tokens[0]) == 4
    # top_p=0.5: the 3.0 token alone holds ~72% of the mass, so only it survives.
    tokens, thr = top_k_top_p_sample(logits, one, None, torch.tensor([0.5], device=DEVICE), noise,
                                     return_threshold=True)
    assert float(thr[0]) == 3.0 and int(tokens[0]) == 0


def test_greedy_rows_take_the_first_of_tied_maxima_across_tiles() -> None:
    # The kernel walks 1,024-wide tiles, each lane keeping its own best: ties within a lane (columns 1,024 apart),
    # across lanes of one tile, and across both must all resolve to the first column, as torch's argmax does.
    vocab = 2100
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    for row, cols in enumerate(([7, 7 + 1024, 7 + 2048], [476, 1500], [300, 900], [1000, 1030, 2060])):
        logits[row, cols] = 50.0
    zero = torch.zeros(4, device=DEVICE)
    tokens = top_k_top_p_sample(logits.to(DEVICE), zero, None, None, torch.ones(4, vocab, device=DEVICE))
    assert tokens.tolist() == [7, 476, 300, 1000]


def test_sampler_draws_from_the_distribution() -> None:
    # Fresh noise per draw: the empirical frequencies follow the top-k/top-p renormalised probabilities.
    g = torch.Generator().manual_seed(1)
    n = 400  # rows are programs: the interpreter runs ~25 per second
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).repeat(n, 1)
    top_p = torch.full((n,), 0.8)
    noise = torch.empty(n, 6).exponential_(generator=g)
    tokens = top_k_top_p_sample(logits.to(DEVICE), torch.ones(n, device=DEVICE), None, top_p.to(DEVICE),
                                noise.to(DEVICE)).cpu()
    probs = torch.tensor([2.0, 1.5, 1.0]).softmax(dim=0)  # the nucleus at 0.8: three tokens
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], probs, atol=0.07), (freq, probs)  # ~3 standard errors at n = 400


# ------------------------------------------------------------------------------------------------ whole engine

def _seeded_outputs(model_dir, monkeypatch, **engine_args) -> list[list[int]]:
    from streamer import LLM, SamplingParams

    # Eager on a GPU: the sampler is under test, and compiling twice there would eat the check's time budget.
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE.type,
              enforce_eager=True if DEVICE.type == "cuda" else None, **engine_args)
    want = 0 if engine_args.get("sampling_backend") == "triton" else None  # (0: every step)
    assert llm.engine.runner.sampler.kernel_min_rows == want
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.2, top_k=20, min_p=0.05, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.7, top_k=50, top_p=0.8, seed=3, ignore_eos=True)]
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9]} for i in range(len(params))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_engine_triton_sampler_matches_torch_sampler(request, monkeypatch) -> None:
    """Seeded rows draw the same noise on both backends, so they sample the same tokens, in a batch that mixes
    greedy rows and every filter."""
    pytest.importorskip("transformers")  # the checkpoint fixtures are built with it
    llama_dir = request.getfixturevalue("llama_dir")
    import streamer.worker.sampler

    # The torch path's CPU shortcuts draw other numbers (heads, inverse CDF); compare with its full path.
    monkeypatch.setattr(streamer.worker.sampler, "sample_cpu_fast", lambda scaled, batch: None)
    torch_out = _seeded_outputs(llama_dir, monkeypatch, sampling_backend="torch")
    triton_out = _seeded_outputs(llama_dir, monkeypatch, sampling_backend="triton")
    assert triton_out == torch_out
    assert len({tuple(t) for t in torch_out}) == len(torch_out)  # the rows really differ


def test_default_sampler_takes_the_kernel_for_large_steps_on_cuda(monkeypatch) -> None:
    """sampling_backend None: on CUDA the kernel serves steps of >= AUTO_KERNEL_MIN_ROWS rows (where the GPU check
    measured it winning), torch's path the smaller ones; on CPU torch's path always."""
    import streamer_kernels
    from streamer.worker.model_runner import AUTO_KERNEL_MIN_ROWS, resolve_sampling_backend
    from streamer.worker.sampler import Sampler, SamplingBatch

    assert resolve_sampling_backend(None, torch.device("cuda")) == AUTO_KERNEL_MIN_ROWS
    assert resolve_sampling_backend("triton", torch.device("cuda")) == 0
    calls = []
    kernel = streamer_kernels.top_k_top_p_sample
    monkeypatch.setattr(streamer_kernels, "top_k_top_p_sample", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    sampler = Sampler(kernel_min_rows=3)
    for rows, kernel_calls in ((2, 0), (3, 1)):
        batch = SamplingBatch(temperature=torch.full((rows,), 0.7, device=DEVICE), top_k=None,
                              top_p=torch.full((rows,), 0.9, device=DEVICE), min_p=None, generators=[None] * rows,
                              all_greedy=False, any_seeded=False, banned=None, penalties=None, max_logprobs=-1)
        calls.clear()
        out = sampler(torch.randn(rows, 50, device=DEVICE), batch)
        assert out.token_ids.shape == (rows,) and len(calls) == kernel_calls


def test_triton_sampler_needs_a_gpu_or_the_interpreter(monkeypatch) -> None:
    from streamer.config import EngineConfig
    from streamer.worker.model_runner import resolve_sampling_backend

    with pytest.raises(ValueError, match="sampling_backend"):
        EngineConfig(sampling_backend="cuda")
    assert resolve_sampling_backend(None, torch.device("cpu")) is None  # the torch path, always
    assert resolve_sampling_backend("torch", torch.device("cpu")) is None
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs a CUDA device"):
            resolve_sampling_backend("triton", torch.device("cpu"))
