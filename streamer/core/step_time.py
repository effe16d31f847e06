"""How long a step will take, and how long it may take: stall-free batching sized by time, not by tokens.

A streaming user feels the gap between tokens, and every running stream waits for the whole step, prefill chunks
included. A fixed token budget (vLLM's, SGLang's) makes that gap depend on the hardware: 2,048 prefill tokens are
~20 ms on a GPU and seconds on a CPU. So the scheduler plans each step against a time budget instead (Sarathi-
Serve's stall-free batching, with the budget in seconds): the running decodes first, then prefill chunks only as
far as `StepTimeModel` says they fit (`StepPlan`).

`StepTimeModel` predicts a step's period (scheduling, the forward pass, sampling and processing: what a stream sees
between two tokens) from its shape, linearly in five features:

    1                                   per-step costs: weights read once, launches, Python
    max(tokens - knee, 0)               matmul work; on a GPU the first `knee` tokens ride free (the flat part)
    rows                                per-request costs: sampling, detokenizing, streaming
    decode context (thousands)          keys and values a one-token row reads (memory-bound attention)
    prefill pairs (millions)            query-key pairs of the multi-token chunks (compute-bound attention)

It starts from a short profile taken when the async engine starts (`LLMEngine.enable_stall_free`,
`ModelRunner.profile_steps`) and is refitted every few steps on
the measured periods (non-negative least squares, recent steps weighted most, far misses left out), so it follows
the actual device and load. `ItlPolicy` turns the user's target (`max_itl_ms`) into each step's budget.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

logger = logging.getLogger("streamer")

# Automatic budget (max_itl_ms=None), see `ItlPolicy`: while prompts trickle in, a stream keeps at least half the
# speed it would have with the running batch alone; never less than 50 ms a step (faster gaps go unseen by a reader,
# and prefill gets room on fast devices); a burst of prompts beside few streams, or a prompt that has waited long,
# widens the steps.
AUTO_FACTOR = 2.0
AUTO_MIN_SECONDS = 0.05
AUTO_WAIT_SHARE = 0.1

NUM_FEATURES = 5
_CONTEXT_UNIT = 1e3  # decode context in thousands of tokens, pairs in millions: coefficients of similar size
_PAIRS_UNIT = 1e6


@dataclass
class StepShape:
    """What a step computes, as far as its time goes."""

    tokens: int = 0
    rows: int = 0
    decode_context: int = 0  # sum of the context lengths of one-token rows
    prefill_pairs: int = 0  # query-key pairs of multi-token rows

    def add(self, start: int, n: int) -> None:
        """A row computing n tokens after `start` computed ones."""
        self.tokens += n
        self.rows += 1
        if n == 1:
            self.decode_context += start + 1
        else:
            self.prefill_pairs += chunk_pairs(start, n)

    def copy(self) -> "StepShape":
        return StepShape(self.tokens, self.rows, self.decode_context, self.prefill_pairs)


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs of a causal chunk of n tokens after `start` others: each token sees those and itself."""
    return n * start + n * (n + 1) // 2


def shape_of(rows: Sequence[tuple[int, int]]) -> StepShape:
    """The shape of a step of (start, num_tokens) rows."""
    shape = StepShape()
    for start, n in rows:
        shape.add(start, n)
    return shape


class StepTimeModel:
    """Predicts a step's period in seconds from its `StepShape` (see the module's docstring); `observe` feeds it
    measured periods. Unready (`ready` False) until it has profile points or enough observations to fit."""

    def __init__(self, knee: int = 0, window: int = 256, refit_every: int = 8, decay: float = 0.99) -> None:
        self.knee = knee
        self.coef = np.zeros(NUM_FEATURES)
        self.ready = False
        self._profile: list[tuple[np.ndarray, float]] = []
        self._recent: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._decay = decay
        self._since_fit = 0
        # The last prediction error, relative (|predicted - measured| / measured), smoothed: what the metrics show
        self.error = 0.0
        self.observed = 0
        # measured / predicted of recent steps; `margin`, their 90th percentile (1 to 1.5), is the headroom plans
        # leave for the model's misses and the device's noise
        self._ratios: deque[float] = deque(maxlen=window)
        self.margin = 1.0

    # ------------------------------------------------------------------ features and prediction
    def features(self, shape: StepShape) -> np.ndarray:
        return np.array([1.0, max(shape.tokens - self.knee, 0), shape.rows, shape.decode_context / _CONTEXT_UNIT,
                         shape.prefill_pairs / _PAIRS_UNIT])

    def predict(self, shape: StepShape) -> float:
        c = self.coef
        return float(c[0] + c[1] * max(shape.tokens - self.knee, 0) + c[2] * shape.rows
                     + c[3] * shape.decode_context / _CONTEXT_UNIT + c[4] * shape.prefill_pairs / _PAIRS_UNIT)

    # ------------------------------------------------------------------ learning
    def set_profile(self, points: Sequence[tuple[StepShape, float]]) -> None:
        """Warm-up measurements: the knee (the most tokens a row can carry for no more than 1.2x a lone decode's
        time: the flat part of a GPU's curve) and a first fit. They stay in every fit, weighted as one step each,
        so a few hundred live steps outweigh them."""
        lone = [t for s, t in points if s.tokens == 1]
        if lone:
            flat = [s.tokens for s, t in points if s.rows == 1 and t <= 1.2 * min(lone)]
            self.knee = max(flat, default=1)
        self._profile = [(self.features(s), t) for s, t in points]
        self._fit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if self.ready:
            predicted = self.predict(shape)
            err = abs(predicted - seconds) / seconds
            self.error = err if self.observed == 0 else 0.9 * self.error + 0.1 * err
            if predicted > 0:
                self._ratios.append(seconds / predicted)
                # One step far over (a compilation, a collection, a page fault) moves the fit by 4x at most; a
                # lasting change is followed in a refit or two.
                seconds = min(seconds, 4 * predicted)
        self.observed += 1
        self._recent.append((self.features(shape), seconds))
        self._since_fit += 1
        if self._since_fit >= self._refit_every or not self.ready:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        rows = list(self._profile) + list(self._recent)
        if len(rows) < 3:
            return
        x = np.stack([f for f, _ in rows])
        y = np.array([t for _, t in rows])
        n_recent = len(self._recent)
        w = np.ones(len(rows))
        if n_recent:
            w[len(self._profile):] = self._decay ** np.arange(n_recent - 1, -1, -1)
        coef = nonneg_least_squares(x, y, w)
        # Steps the fit misses by far more than it misses the rest (a hiccup of the machine) are left out of it: a
        # lasting change shows in enough of the recent steps to stay in.
        miss = np.abs(y - x @ coef)
        keep = miss <= 4 * max(1.4826 * float(np.median(miss)), 0.02 * float(np.median(y)))
        if not keep.all() and keep.sum() >= 3:
            coef = nonneg_least_squares(x[keep], y[keep], w[keep])
        self.coef = coef
        self.ready = True
        if len(self._ratios) >= 16:
            self.margin = min(max(float(np.quantile(np.fromiter(self._ratios, float), 0.9)), 1.0), 1.5)


def nonneg_least_squares(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0 (an active set: the most negative one is pinned to 0 and
    the rest refitted, at most once per feature). A tiny ridge term keeps unused features (no chunk seen yet) at 0
    instead of making the system singular."""
    sw = np.sqrt(w)[:, None]
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    while free:
        a = (x[:, free] / scale[free]) * sw
        b = y * sw[:, 0]
        ridge = 1e-9 * np.eye(len(free))
        sol = np.linalg.solve(a.T @ a + ridge, a.T @ b) / scale[free]
        worst = int(np.argmin(sol))
        if sol[worst] >= 0:
            coef[free] = sol
            return coef
        free.pop(worst)
    return coef


class ItlPolicy:
    """Each step's time budget. With a target (seconds): that target, always. Automatic (None): the largest of
    - AUTO_FACTOR x the decodes' own step (a stream keeps at least half its speed while prompts trickle in);
    - (1 + prompts / decodes) x the decodes' own step: processor sharing, where the decode step gives each decoding
      request its row and each prompt waiting for its first token (running or queued) gets as much in prefill, so
      a burst of prompts beside few streams widens the steps instead of drip-feeding the prompts;
    - AUTO_WAIT_SHARE x the time the oldest of those prompts has waited (no stream is held up for more than a tenth
      of the longest wait for a first token; a backlog drains instead of starving);
    - AUTO_MIN_SECONDS.
    A budget is only applied while a streamed request decodes (nobody else sees the gap between tokens)."""

    def __init__(self, target: Optional[float]) -> None:
        self.target = target
        self.unmet_steps = 0  # steps whose decodes alone were predicted over the target
        self._warned = False

    def budget(self, decode_time: float, prompts: int, decodes: int, gap: float = 0.0, wait: float = 0.0) -> float:
        """The step's budget (its period's), given the decodes' predicted period, the prompts waiting for their first
        token, the decoding requests, the loop's own time between steps (`gap`: delivery; part of every inter-token
        gap, so taken off the budget) and the oldest prompt's wait in seconds."""
        step = decode_time + gap
        if self.target is not None:
            if step > self.target:
                self.unmet_steps += 1
                if not self._warned:
                    self._warned = True
                    logger.warning("the inter-token latency target (max_itl_ms=%.0f) cannot be met: a step of the "
                                   "running decodes alone takes ~%.0f ms; prefill gets one block a step meanwhile "
                                   "(counted in streamer:itl_target_unmet_steps_total)", self.target * 1e3,
                                   step * 1e3)
            return self.target - gap
        share = 1.0 + prompts / max(decodes, 1)
        return max(step * max(AUTO_FACTOR, share), AUTO_MIN_SECONDS, AUTO_WAIT_SHARE * wait) - gap


class StepPlan:
    """One step's time as the scheduler fills it: the decodes' share first (`reserve`), then chunks sized to fit
    what is left (`chunk`, `take`). Without a budget (None) chunks are limited by tokens only.

    The starvation rule: a step with prefill work carries at least one block of it (`block_size` tokens of the first
    chunk, or all its prompt has left) whatever the budget, so a prompt with Q tokens of prefill ahead of it in line
    gets its first chunk within ceil(Q / block_size) + 1 steps (the automatic budget leaves prefill at least the
    decodes' own time besides)."""

    def __init__(self, model: StepTimeModel, budget: Optional[float], block_size: int) -> None:
        self.model, self.budget, self.block_size = model, budget, block_size
        self.shape = StepShape()
        self.prefill_tokens = 0

    def chunk(self, start: int, want: int) -> int:
        """How many of `want` tokens after `start` fit this step."""
        if self.budget is None or want <= 0:
            return want
        n = self._fitting(start, want)
        if n < want:
            end = start + n
            # Cut on a block boundary: whole blocks get cached (and a sliver short of one is not worth a row)
            n = max(end - end % self.block_size - start, 0)
        if self.prefill_tokens == 0:
            n = max(n, min(want, self.block_size))
        return n

    def _fitting(self, start: int, want: int) -> int:
        """The most tokens (<= want) whose chunk keeps the step's predicted time, with the model's margin, within the
        budget (binary search: the prediction grows with n)."""
        model, base = self.model, self.shape
        budget = self.budget / model.margin  # type: ignore[operator]
        lo, hi = 0, want
        while lo < hi:
            mid = (lo + hi + 1) // 2
            s = base.copy()
            s.add(start, mid)
            if model.predict(s) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def take(self, start: int, n: int) -> None:
        """A prefill chunk of n tokens after `start` is in the step."""
        self.shape.add(start, n)
        self.prefill_tokens += n
