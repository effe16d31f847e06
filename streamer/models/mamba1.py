"""Pure Mamba (v1) models: MambaForCausalLM (state-spaces/mamba-130m-hf .. mamba-2.8b-hf) and FalconMambaForCausalLM
(tiiuae/falcon-mamba-7b, falcon-mamba-7b-instruct): a stack of `x + mixer(norm(x))` blocks with no attention layer,
so no KV cache at all. As in pure Mamba2 (models/mamba2.py, whose model this subclasses) the state slots alone bound
the running batch, the residual stream stays fp32 with `residual_in_fp32`, and the checkpoint names are
`backbone.{embeddings, layers.N.norm, layers.N.mixer.*, norm_f}` and `lm_head` (tied by default).

The mixer (`Mamba1Mixer`), per token, for d_inner channels and d_state states per channel:
x, z = in_proj(h); x = silu(conv1d(x)) (causal, depthwise, d_conv taps); dt_r, B, C = x_proj(x) (dt_rank, d_state,
d_state wide; Falcon-Mamba RMS-normalises each of the three, without weights, eps `mixer_rms_eps`);
dt = softplus(dt_proj(dt_r)) (with dt_proj's bias); A = -exp(A_log) [d_inner, d_state], one decay per channel and
state (Mamba2 has one per head); state = exp(dt A) * state + (dt x) (outer) B; y = state . C + D x;
out = out_proj(y * silu(z)).

A request's state in its slot (models/mamba.py RecurrentMixer): the conv window [d_inner, d_conv - 1] (model dtype)
and the SSM state [d_inner, d_state] (fp32). Each step, with the runner's `MambaStep`:

- one-token requests (decodes, and a prompt's one-token chunk) advance by one recurrence step, all at once
  (`conv_decode`, then a batched state update);
- the prefill chunks are laid end to end (`PrefillPlan`, built once per step): one depthwise conv over every chunk
  after its carried window, then one scan over all of their tokens (`selective_scan`), each chunk's carried SSM
  state folded into its first token (whose decay is then zeroed, so nothing of the chunk before it leaks in). The
  scan runs over blocks of tokens (`_SCAN_BLOCK_ELEMS` bounds the [tokens, d_inner, d_state] temporaries), each
  block carrying its last state into the next; within a block it takes under 3 sqrt(tokens) vectorised steps.

A preempted request recomputes from scratch into a zeroed slot, as with Mamba2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch, MambaStep
from streamer.models.config import ModelConfig
from streamer.models.family_configs import mamba_inner_size
from streamer.models.layers import RMSNorm, RotaryEmbedding, RowParallelLinear
from streamer.models.llama import require_silu
from streamer.models.mamba import (
    PartsLinear,
    RecurrentMixer,
    _float,
    check_divides,
    from_span,
    over_span,
    per_rank,
    split_conv,
    split_parts,
)
from streamer.models.mamba2 import Mamba2ForCausalLM

FALCON_MAMBA = "FalconMambaForCausalLM"
# Elements of one [tokens, d_inner, d_state] fp32 temporary of the prefill scan (64 MiB): the scan takes this many
# tokens' worth at a time (mamba-130m: 682 tokens; falcon-mamba-7b: 128)
_SCAN_BLOCK_ELEMS = 1 << 24


def dt_rank(c: dict[str, Any]) -> int:
    """x_proj's dt width: `time_step_rank`, "auto" being ceil(hidden_size / 16)."""
    rank = c.get("time_step_rank", "auto")
    return math.ceil(int(c.get("hidden_size", 768)) / 16) if rank in (None, "auto") else int(rank)


def selective_scan(dA: torch.Tensor, dBx: torch.Tensor) -> torch.Tensor:
    """h[t] = dA[t] * h[t-1] + dBx[t] from h[-1] = 0, over the leading (token) axis of two [T, ...] fp32 tensors;
    returns h, in dBx's storage (both are overwritten). The first n x q tokens (q = floor(sqrt(T))) as n chunks of q:
    every chunk at once, a token at a time from a zero state (q - 1 steps), its decays multiplied up meanwhile; then
    chunk by chunk, the previous chunk's last state times the decays since the chunk's start (n - 1 steps); then the
    last T - n q (< q) tokens one by one. A zero decay cuts the recurrence (nothing before it reaches past it),
    which the products keep exactly. (Without padding copies, temporaries or addcmul_, all slow on CPU.)"""
    t = dA.shape[0]
    q = max(1, math.isqrt(t))
    n = t // q
    a = dA[:n * q].view(n, q, *dA.shape[1:])
    h = dBx[:n * q].view(n, q, *dBx.shape[1:])
    buf = torch.empty_like(h[:, 0])
    for i in range(1, q):
        h[:, i].add_(torch.mul(a[:, i], h[:, i - 1], out=buf))
        a[:, i].mul_(a[:, i - 1])  # (a[:, i] used: now the decay since the chunk's start)
    buf = torch.empty_like(h[0])
    for j in range(1, n):
        h[j].add_(torch.mul(a[j], h[j - 1, -1], out=buf))
    for i in range(n * q, t):
        dBx[i].add_(dA[i] * dBx[i - 1])
    return dBx


@dataclass
class PrefillPlan:
    """A step's prefill chunks (several tokens each) laid end to end on one "P" axis, chunk after chunk, with what
    every layer needs to convolve and scan them all at once. Built on the host once per step (`StepPlans`)."""

    tokens: torch.Tensor  # int64 [P]: each P row's row in the step
    slots: torch.Tensor  # int64 [R]: each chunk's state slot
    starts: torch.Tensor  # int64 [R]: each chunk's first P row
    ends: torch.Tensor  # int64 [R]: and its last
    conv_rows: torch.Tensor  # int64 [P + R (d_conv - 1)]: rows of [inputs; windows], each chunk after its window
    conv_out: torch.Tensor  # int64 [P]: the conv output row of each P row
    conv_keep: torch.Tensor  # int64 [R, d_conv - 1]: the conv_rows rows that become each chunk's window
    starts_cpu: np.ndarray  # (starts and ends on the host: which chunks start or end in a block of the scan)
    ends_cpu: np.ndarray
    span: Optional[tuple[int, int]] = None  # the rows `tokens` names when they are consecutive (no gathers then)

    @classmethod
    def build(cls, prefills: list[tuple[int, int, int]], d_conv: int, device: torch.device) -> "PrefillPlan":
        slot, lo, hi = (np.array(v, dtype=np.int64) for v in zip(*prefills))
        lens = hi - lo
        r, p, w = len(lens), int(lens.sum()), d_conv - 1
        starts = np.cumsum(lens) - lens
        ends = starts + lens - 1
        pos = np.arange(p) - np.repeat(starts, lens)  # each P row's position in its chunk
        base = starts + np.arange(r) * w  # each chunk's first row (its window's first) in conv order
        conv_rows = np.empty(p + r * w, dtype=np.int64)
        conv_rows[(base[:, None] + np.arange(w)).ravel()] = p + np.arange(r * w)  # windows: after the inputs
        conv_rows[np.repeat(base + w, lens) + pos] = np.arange(p)
        parts = [np.repeat(lo, lens) + pos, slot, starts, ends, conv_rows, np.repeat(base, lens) + pos,
                 ((base + lens)[:, None] + np.arange(w)).ravel()]
        dev = torch.from_numpy(np.concatenate(parts)).to(device).split([len(x) for x in parts])
        span = (int(lo[0]), int(hi[-1])) if bool((lo[1:] == hi[:-1]).all()) else None
        return cls(*dev[:6], dev[6].view(r, w), starts, ends, span)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The P rows of a [step tokens, ...] tensor."""
        return t[self.tokens] if self.span is None else t[self.span[0]:self.span[1]]

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst's P rows = src."""
        if self.span is None:
            dst[self.tokens] = src
        else:
            dst[self.span[0]:self.span[1]] = src

    def chunks_in(self, lo: int, hi: int, at: np.ndarray) -> tuple[int, int]:
        """The range of chunks whose row in `at` (starts_cpu or ends_cpu, ascending) lies in [lo, hi)."""
        return int(np.searchsorted(at, lo)), int(np.searchsorted(at, hi))


class StepPlans:
    """The step's PrefillPlan, built by the first layer that asks and reused by the others (the runner gives every
    layer the same MambaStep)."""

    def __init__(self) -> None:
        self._step: Optional[MambaStep] = None
        self._plan: Optional[PrefillPlan] = None

    def get(self, step: MambaStep, d_conv: int, device: torch.device) -> PrefillPlan:
        if step is not self._step or self._plan is None:
            self._plan = PrefillPlan.build(step.prefills, d_conv, device)
            self._step = step
        return self._plan


def _rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    """Falcon-Mamba's weightless RMSNorm over the last dim (in fp32, back in t's dtype)."""
    tf = t.float()
    return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)


class Mamba1Mixer(RecurrentMixer):
    """Mamba v1's selective-scan mixer (see the module docstring); parameter names as in the checkpoints.

    With tensor parallelism each rank holds d_inner / tp channels (`inner` is this rank's) and their state, as vLLM
    splits it: in_proj column-parallel by parts (x, z), x_proj row-parallel (every rank gets the whole dt, B, C),
    dt_proj, A_log and D by rows, out_proj row-parallel."""

    def __init__(self, hidden_size: int, raw: dict[str, Any], bcdt_eps: Optional[float] = None) -> None:
        """`bcdt_eps`: Falcon-Mamba's RMSNorm eps for B, C and dt (None: Mamba's, no such norm)."""
        super().__init__()
        channels = split_parts([mamba_inner_size(raw)])
        width, self.inner = channels[0]
        self.d_state = int(raw.get("state_size", 16))
        self.d_conv = int(raw.get("conv_kernel", 4))
        self.dt_rank = dt_rank(raw)
        self.bcdt_eps = bcdt_eps
        bias = bool(raw.get("use_bias", False))
        self.in_proj = PartsLinear(hidden_size, channels * 2, bias=bias)
        self.conv1d = split_conv(nn.Conv1d(self.inner, self.inner, self.d_conv, groups=self.inner,
                                           bias=bool(raw.get("use_conv_bias", True))), channels)
        self.x_proj = RowParallelLinear(width, self.dt_rank + 2 * self.d_state)
        self.dt_proj = nn.Linear(self.dt_rank, self.inner, bias=True)  # (its weight read directly: not packed)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.d_state))
        self.D = nn.Parameter(torch.ones(self.inner))
        per_rank(self.dt_proj.weight, self.dt_proj.bias, self.A_log, self.D)
        self.out_proj = RowParallelLinear(width, hidden_size, bias=bias)
        self.requires_grad_(False)
        self.conv_dim, self.state_shape = self.inner, (self.inner, self.d_state)
        self.plans = StepPlans()  # (the model shares one among its layers)

    def forward(self, h: torch.Tensor, decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        step = self.begin_step(decode)
        x, z = self.in_proj(h).chunk(2, dim=-1)
        xc = torch.empty_like(x)
        dec, plan = step.decode_tokens, None
        if dec is not None:
            xc[dec] = self.conv_decode(x[dec], step.decode_slots).to(xc.dtype)
        if step.prefills:
            plan = self.plans.get(step, self.d_conv, h.device)
            plan.put(xc, self._conv_prefills(plan.rows(x), plan).to(xc.dtype))
        xc = F.silu(xc)
        dt, B, C = self._ssm_inputs(xc)
        xf, A = xc.float(), -torch.exp(self.A_log.float())
        y = torch.empty(x.shape[0], self.inner, dtype=torch.float32, device=x.device)
        if dec is not None:
            y[dec] = self._decode(step, dt[dec], xf[dec], B[dec], C[dec], A)
        if plan is not None:
            plan.put(y, self._scan(plan, *map(plan.rows, (dt, xf, B, C)), A))
        y = y + xf * self.D.float()
        return self.out_proj((y * F.silu(z)).to(h.dtype))

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt (discretised: softplus(dt_proj(dt_r) + bias)), B and C of each token, fp32."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.bcdt_eps is not None:
            dt, B, C = (_rms(t, self.bcdt_eps) for t in (dt, B, C))
        dt = F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        return dt, B.float(), C.float()

    def _decode(self, step: MambaStep, dt: torch.Tensor, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                A: torch.Tensor) -> torch.Tensor:
        """One recurrence step of each one-token request (rows of dt, x [R, inner], B, C [R, d_state]), the states
        updated in place: y [R, inner] without the D skip."""
        state = self.decode_states(step)
        dt, x, B, C = (over_span(step, t) for t in (dt, x, B, C))
        state.mul_(torch.exp(dt[..., None] * A))
        state.baddbmm_((dt * x)[..., None], B[:, None, :])  # += (dt x) outer B, with no temporary
        self.store_states(step, state)
        return from_span(step, torch.bmm(state, C[..., None]).squeeze(-1))

    def _conv_prefills(self, x: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
        """Every prefill chunk's conv output [P, inner] (before its activation), each after its carried window;
        the windows then hold each chunk's last inputs."""
        assert self.conv_state is not None
        windows = self.conv_state[plan.slots]  # [R, inner, d_conv - 1]
        rows = torch.cat([x.to(windows.dtype), windows.transpose(1, 2).reshape(-1, self.inner)])[plan.conv_rows]
        self.conv_state[plan.slots] = rows[plan.conv_keep].transpose(1, 2)
        w = self.conv1d.weight
        out = F.conv1d(rows.T[None].to(w.dtype), w, self.conv1d.bias, groups=self.inner)[0].T
        return out[plan.conv_out]

    def _scan(self, plan: PrefillPlan, dt: torch.Tensor, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              A: torch.Tensor) -> torch.Tensor:
        """The prefill chunks' SSM (rows on the P axis): y [P, inner] without the D skip; each chunk starts from
        its slot's state, and its last token's state goes back there."""
        state = self.ssm_state
        assert state is not None
        p = x.shape[0]
        y = torch.empty(p, self.inner, dtype=torch.float32, device=x.device)
        block = min(p, max(1, _SCAN_BLOCK_ELEMS // (self.inner * self.d_state)))
        # (the blocks' temporaries, reused: fresh ones would be paged in again for every block)
        bufs = torch.empty(2, block, self.inner, self.d_state, dtype=torch.float32, device=x.device)
        carry: Optional[torch.Tensor] = None
        for lo in range(0, p, block):
            hi = min(p, lo + block)
            dA = torch.mul(dt[lo:hi, :, None], A, out=bufs[0, :hi - lo]).exp_()  # [t, inner, d_state]
            dBx = torch.mul((dt[lo:hi] * x[lo:hi])[..., None], B[lo:hi, None, :], out=bufs[1, :hi - lo])
            # chunks starting here: their carried state enters at their first token, whose decay then cuts off
            # the chunk before them
            s0, s1 = plan.chunks_in(lo, hi, plan.starts_cpu)
            if s1 > s0:
                first = plan.starts[s0:s1] - lo
                dBx[first] += dA[first] * state[plan.slots[s0:s1]]
                dA[first] = 0
            if carry is not None:  # a chunk running on from the previous block (else dA[0] is 0)
                dBx[0].add_(dA[0] * carry)
            hs = selective_scan(dA, dBx)
            y[lo:hi] = torch.bmm(hs, C[lo:hi, :, None]).squeeze(-1)
            e0, e1 = plan.chunks_in(lo, hi, plan.ends_cpu)
            if e1 > e0:
                state[plan.slots[e0:e1]] = hs[plan.ends[e0:e1] - lo]
            carry = hs[-1].clone()
        return y


class MambaBlock(nn.Module):
    """norm, then the mixer (the residual add is the model's: Mamba2ForCausalLM.run_layers)."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        raw = cfg.raw
        eps = _float(raw.get("mixer_rms_eps", 1e-6)) if cfg.architecture == FALCON_MAMBA else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Mamba1Mixer(cfg.hidden_size, raw, bcdt_eps=eps)

    def forward(self, x: torch.Tensor, decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        return self.mixer(self.norm(x), decode)


class MambaForCausalLM(Mamba2ForCausalLM):
    """Mamba and Falcon-Mamba (by cfg.architecture): Mamba2's model (fp32 residual stream, final norm, checkpoint
    names) over Mamba v1 blocks."""

    decoder_layer = MambaBlock
    # (Falcon-Mamba's B / C / dt norms have placeholder weights in transformers, never saved nor used)
    ignored_suffixes = Mamba2ForCausalLM.ignored_suffixes + ("b_layernorm.weight", "c_layernorm.weight",
                                                             "dt_layernorm.weight")

    @classmethod
    def check_mixers(cls, cfg: ModelConfig, tp: int) -> None:
        check_divides(tp, intermediate_size=mamba_inner_size(cfg.raw))  # (d_inner: the channels and their state)

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        require_silu(cfg.raw, cfg.architecture)
        super().__init__(cfg, backend_cls, max_positions)
        plans = StepPlans()
        for layer in self.layers:
            layer.mixer.plans = plans
