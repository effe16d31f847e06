"""The Mamba2 (SSD) mixer of hybrid attention + Mamba models (IBM Granite 4.0-H: models/granite_hybrid.py;
NVIDIA Nemotron-H: models/nemotron_h.py; Falcon-H1: models/falcon_h1.py) and of pure Mamba2 (models/mamba2.py),
and the slot-held recurrent state they share with other recurrent layers (Gated DeltaNet: models/qwen3_next.py;
LFM2's short convolution, a conv window and no SSM state: models/lfm2.py).

A Mamba layer keeps no KV cache: each running request holds a fixed-size recurrent state in a slot of the layer's
state tensors (the slot pool is the KV cache manager's, `streamer/core/kv_cache.py StateSlotPool`):

- `conv_state[slot]` [conv_dim, d_conv - 1]: the last d_conv - 1 inputs of the causal depthwise conv1d;
- `ssm_state[slot]` [nheads, head_dim, d_state] (fp32): the SSM recurrence's state.

Each step the runner publishes, through the forward context (`AttentionMetadata.mamba`, a `MambaStep`), which slots
start fresh (a request's first chunk: zeroed first), the decode requests (one token each; one recurrence step,
vectorised over them) and the prefill chunks (slot, token range in the flattened batch): conv over the chunk after
the carried conv state, then the chunked SSD scan (as transformers' torch_forward) from the carried SSM state.
Rows past the pool (`slot == num_slots`) are a scratch slot for the warm-up steps.

Under tensor parallelism every recurrent layer splits by heads (channels), as vLLM splits them: each rank computes
its heads from its share of the input projection and conv, keeps their state in its own slots (so a slot is about
1 / tp of the whole), and the output projection all-reduces (`Parts` below).

The math (per token t, head h): x, B, C = silu(conv1d(xBC)); dt = clamp(softplus(dt + dt_bias), limits);
state = exp(dt * A) * state + dt * x (outer) B; y = state . C + D * x; out = out_proj(rmsnorm_grouped(y * silu(z))).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import DecodeBatch, MambaStep, PrefillBatch, current_metadata
from streamer.models.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    _check_shape,
    rank_rows_loader,
    tp_all_reduce,
)

if TYPE_CHECKING:
    from streamer.models.config import ModelConfig


def _float(v: Any) -> float:
    """A config number; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(v, dict):
        v = v.get("__float__", v)
    return float(v)


# Tensor parallelism (as vLLM splits these layers): each rank holds whole heads, with the conv channels and state that
# belong to them; a projection whose output concatenates parts (Mamba2's in_proj: z, x, B, C, dt) splits each part
# on its own. Parts: (rows in the checkpoint, rows on each rank); a part with fewer rows in the checkpoint than all
# ranks hold together (B/C groups fewer than the ranks) is replicated, consecutive ranks sharing one chunk.
Parts = Sequence[tuple[int, int]]


def split_parts(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Parts split evenly over the ranks; ValueError where one does not divide."""
    tp = ParallelContext.size
    for n in sizes:
        if n % tp:
            raise ValueError(f"a recurrent layer's width {n} is not divisible by tensor_parallel_size {tp}")
    return [(n, n // tp) for n in sizes]


def rank_parts(loaded: torch.Tensor, parts: Parts, name: str = "") -> torch.Tensor:
    """This rank's rows of a checkpoint tensor whose rows are `parts` laid end to end."""
    rank, tp = ParallelContext.rank, ParallelContext.size
    total = sum(n for n, _ in parts)
    if loaded.shape[0] != total:
        raise ValueError(f"tensor {name!r} has {loaded.shape[0]} rows, expected {total}")
    rows, start = [], 0
    for n, local in parts:
        sharing = tp * local // n  # ranks that hold the same chunk (1 unless replicated)
        lo = start + rank // sharing * local
        rows.append(loaded[lo:lo + local])
        start += n
    return torch.cat(rows)


def parts_loader(parts: Parts):
    """A weight loader that copies this rank's `rank_parts` of a checkpoint tensor."""
    def load(param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
        rows = rank_parts(loaded, parts, name)
        _check_shape(name, param, rows)
        param.data.copy_(rows)
    return load


class PartsLinear(ColumnParallelLinear):
    """A column-parallel linear whose checkpoint weight (and bias) concatenates `parts`, each split on its own."""

    def __init__(self, input_size: int, parts: Parts, bias: bool = False) -> None:
        super().__init__(input_size, [sum(local for _, local in parts) * ParallelContext.size], bias)
        self.load_parts = parts_loader(parts)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
        self.load_parts(param, loaded, name)


def split_conv(conv: nn.Conv1d, parts: Parts) -> nn.Conv1d:
    """A depthwise conv over this rank's channels (`parts`), its weight and bias loaded as theirs."""
    load = parts_loader(parts)
    for p in conv.parameters():
        p.weight_loader = load  # type: ignore[attr-defined]
    return conv


def per_rank(*params: nn.Parameter) -> None:
    """Per-head (or per-channel) parameters: this rank's rows."""
    for p in params:
        p.weight_loader = rank_rows_loader  # type: ignore[attr-defined]


def check_divides(tp: int, **counts: int) -> None:
    """ValueError naming the first config field whose count `tp` ranks cannot split evenly."""
    for field, n in counts.items():
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {field} ({n}): the recurrent layers' "
                             "heads are split over the ranks")


def check_groups(tp: int, field: str, groups: int) -> None:
    """B/C groups either split over the ranks or are shared by consecutive ranks (replicated, as vLLM does)."""
    if groups % tp and tp % groups:
        raise ValueError(f"tensor_parallel_size {tp} and {field} ({groups}): neither divides the other, so the B/C "
                         "groups can neither be split over the ranks nor shared by them")


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above the diagonal."""
    n = x.size(-1)
    x = x[..., None].expand(*x.shape, n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0), -torch.inf)


def _above_diagonal(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan of one sequence (fp32), from `state`. x [L, h, p]; dt [L, h] (discretised); A [h];
    B, C [L, g, n] per group (head h reads group h // (h / g)); state [h, p, n]. Returns y [L, h, p] (without the
    D skip) and the final state. The result does not depend on the chunk size (up to rounding): a sequence shorter
    than `chunk` is one chunk of its own length, not padded. B and C stay per group, so their products are computed
    once for the group's heads."""
    y, final = ssd_scan_batch(x[None], dt[None], A, B[None], C[None], chunk, state[None])
    return y[0], final[0]


def ssd_scan_batch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan` of N sequences of one length at once: x [N, L, h, p]; dt [N, L, h]; B, C [N, L, g, n]; state
    [N, h, p, n]. A shorter sequence padded at its end with dt = 0 (no decay and no input) ends in its own final
    state."""
    nb, length, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g  # heads per group
    chunk = min(chunk, length)
    pad = (-length) % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [N, L, ...] -> [N, c, chunk, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(nb, -1, chunk, *t.shape[2:])

    x = chunks(x * dt[..., None])  # [N, c, l, h, p]
    c = x.shape[1]
    a = chunks(A * dt).permute(0, 3, 1, 2)  # [N, h, c, l]  (padding: dt = 0, so no decay and no input)
    B, C = chunks(B), chunks(C)  # [N, c, l, g, n]
    a_cum = torch.cumsum(a, dim=-1)
    xg = x.view(nb, c, chunk, g, r, p)
    # within each chunk: attention-like, masked by the decays between positions, exp(a_cum[l] - a_cum[s]) for s <= l
    # (differences of the cumulative sums, as mamba_ssm's kernels take them: fp32 keeps them exact enough)
    cum = a_cum.permute(0, 2, 1, 3).reshape(nb, c, g, r, chunk)
    decays = (cum[..., :, None] - cum[..., None, :]).masked_fill_(_above_diagonal(chunk, x.device), -torch.inf)
    scores = decays.exp_().mul_(torch.einsum("bclgn,bcsgn->bcgls", C, B)[:, :, :, None])  # [N, c, g, r, l, s]
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores, xg)
    # each chunk's contribution to the state at its end
    decay = torch.exp(a_cum[..., -1:] - a_cum).permute(0, 2, 3, 1).reshape(nb, c, chunk, g, r, 1)
    states = torch.einsum("bclgn,bclgrp->bcgrpn", B, xg * decay).reshape(nb, c, h, p, n)
    if c == 1:  # one chunk: the state enters it as it is and leaves decayed by all of it, plus the chunk's part
        entering = state[:, None].to(states.dtype)
        final = states[:, 0].add_(entering[:, 0] * torch.exp(a_cum[:, :, 0, -1])[..., None, None])
    else:  # the recurrence across chunks: the state entering each chunk (and the final one)
        states = torch.cat([state[:, None].to(states.dtype), states], dim=1)  # [N, c + 1, h, p, n]
        chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [N, h, c + 1, c + 1]
        states = torch.einsum("bhij,bjhpn->bihpn", chunk_decay, states)
        entering, final = states[:, :-1], states[:, -1]
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", C, entering.view(nb, c, g, r, p, n)) \
        * torch.exp(a_cum).permute(0, 2, 3, 1).reshape(nb, c, chunk, g, r, 1)
    return y.reshape(nb, c * chunk, h, p)[:, :length], final


class RecurrentMixer(nn.Module):
    """A layer whose per-request state lives in slots (kv_cache.StateSlotPool) instead of a KV cache: its causal
    depthwise conv's last d_conv - 1 inputs (`conv_state` [slots, conv_dim, d_conv - 1], the model's dtype) and a
    recurrent state (`ssm_state` [slots, *state_shape], fp32). Mamba2 here; Qwen3-Next's Gated DeltaNet
    (models/qwen3_next.py). Subclasses set `conv_dim`, `d_conv`, `conv1d` and `state_shape`."""

    conv_dim: int
    d_conv: int
    conv1d: nn.Conv1d
    state_shape: tuple[int, ...]
    # The per-request states (not parameters: `allocate_state`, by the model runner)
    conv_state: Optional[torch.Tensor] = None
    ssm_state: Optional[torch.Tensor] = None

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state in this layer."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.conv_dim * (self.d_conv - 1) * elem + 4 * int(torch.Size(self.state_shape).numel())

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.conv_state = torch.zeros(num_slots, self.conv_dim, self.d_conv - 1, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(num_slots, *self.state_shape, dtype=torch.float32, device=device)

    def begin_step(self, decode: Optional[DecodeBatch] = None) -> MambaStep:
        """The step's MambaStep (from the forward context), its states prepared (`prepare_states`); or, inside a
        compiled decode-only step, the one `decode` describes (its states prepared before the graph ran)."""
        if decode is not None and decode.state_slots is not None:
            return MambaStep.decoding(decode.state_slots)
        step: Optional[MambaStep] = current_metadata().mamba
        if step is None or self.conv_state is None or self.ssm_state is None:
            raise RuntimeError(f"a {type(self).__name__} layer ran without its state (MambaStep / allocate_state)")
        self.prepare_states(step.copies, step.fresh_slots)
        return step

    def prepare_states(self, copies: Sequence[torch.Tensor], fresh_slots: Optional[torch.Tensor]) -> None:
        """Before a step: MambaStep.copies made (int64 [2, N] each: from slots, to slots; in order, as a batch may
        read what the one before wrote), then the fresh slots zeroed (first chunks start from zero)."""
        assert self.conv_state is not None and self.ssm_state is not None
        for pairs in copies:
            self.conv_state[pairs[1]] = self.conv_state[pairs[0]]
            self.ssm_state[pairs[1]] = self.ssm_state[pairs[0]]
        if fresh_slots is not None:
            self.conv_state[fresh_slots] = 0
            self.ssm_state[fresh_slots] = 0

    def decode_states(self, step: MambaStep) -> torch.Tensor:
        """The one-token requests' recurrent states, for the caller to update in place: a view of their slots' span
        where the runner found them packed (`MambaStep.decode_span`: rows laid out as `over_span` lays inputs,
        other slots' rows left as they are by zero inputs), else a gathered copy that `store_states` writes back."""
        assert self.ssm_state is not None
        if step.decode_span is not None:
            lo, hi = step.decode_span
            return self.ssm_state[lo:hi]
        return self.ssm_state[step.decode_slots]

    def store_states(self, step: MambaStep, states: torch.Tensor) -> None:
        if step.decode_span is None:  # (a view was updated in place)
            self.ssm_state[step.decode_slots] = states  # type: ignore[index]

    def conv_decode(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One new input per request [R, conv_dim] -> the conv's output (before its activation), the windows
        shifted along."""
        assert self.conv_state is not None
        window = torch.cat([self.conv_state[slots], x.to(self.conv_state.dtype).unsqueeze(-1)], dim=-1)
        self.conv_state[slots] = window[:, :, 1:]
        weight = self.conv1d.weight  # [conv_dim, 1, d_conv]
        h = (window.to(weight.dtype) * weight[:, 0]).sum(-1)
        return h if self.conv1d.bias is None else h + self.conv1d.bias

    def conv_prefill_batch(self, x: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
        """`conv_prefill` of a step's short chunks at once (x [N, L, conv_dim], padded at their ends): the conv's
        outputs [N, L, conv_dim] (past a chunk's end: not meaningful), each window then holding its chunk's last
        inputs."""
        assert self.conv_state is not None
        windows = self.conv_state[batch.slots]  # [N, conv_dim, K - 1]
        seq = torch.cat([windows, x.transpose(1, 2).to(windows.dtype)], dim=2)  # [N, conv_dim, K - 1 + L]
        keep = batch.lens[:, None] + torch.arange(self.d_conv - 1, device=x.device)  # its last K - 1 inputs
        self.conv_state[batch.slots] = seq.gather(2, keep[:, None, :].expand(-1, self.conv_dim, -1))
        weight = self.conv1d.weight
        return F.conv1d(seq.to(weight.dtype), weight, self.conv1d.bias, groups=self.conv_dim).transpose(1, 2)

    def conv_prefill(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """A chunk of one request's inputs [L, conv_dim] -> the conv's output over them (before its activation),
        after the carried window, which then holds the chunk's last inputs."""
        assert self.conv_state is not None
        seq = torch.cat([self.conv_state[slot], x.T.to(self.conv_state.dtype)], dim=1)  # [conv_dim, K-1+L]
        self.conv_state[slot] = seq[:, seq.shape[1] - (self.d_conv - 1):]
        weight = self.conv1d.weight
        return F.conv1d(seq[None].to(weight.dtype), weight, self.conv1d.bias, groups=self.conv_dim)[0].T


def over_span(step: MambaStep, t: torch.Tensor) -> torch.Tensor:
    """A one-token request's inputs [R, ...] laid out as `RecurrentMixer.decode_states` lays the states: over the
    span's slots (zeros for the slots of no one-token request: a step with zero dt, gate or beta leaves a state as
    it is), or as they are."""
    if step.decode_span is None or step.decode_pos is None:  # (no span, or its rows in order)
        return t
    lo, hi = step.decode_span
    out = t.new_zeros(hi - lo, *t.shape[1:])
    out[step.decode_pos] = t
    return out


def from_span(step: MambaStep, t: torch.Tensor) -> torch.Tensor:
    """Outputs computed over `decode_states`' rows -> the one-token requests' [R, ...]."""
    return t if step.decode_span is None or step.decode_pos is None else t[step.decode_pos]


class HybridModel:
    """A model mixin for hybrid models: the runner gives their recurrent layers (every `RecurrentMixer` inside)
    state slots and no KV cache, and runs them eagerly."""

    is_hybrid = True
    has_attention = True  # (pure recurrent models: no attention heads to split)

    @classmethod
    def check_tensor_parallel(cls, cfg: "ModelConfig", tp: int) -> None:
        """Refuse, before any worker starts, a config whose layers do not split over `tp` ranks (ValueError naming
        the config field): the attention heads (kv heads may be replicated), then the recurrent layers'."""
        if cls.has_attention:
            check_divides(tp, num_attention_heads=cfg.num_heads)
            if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
                raise ValueError(f"tensor_parallel_size {tp} and num_key_value_heads ({cfg.num_kv_heads}): neither "
                                 "divides the other")
        cls.check_mixers(cfg, tp)

    @classmethod
    def check_mixers(cls, cfg: "ModelConfig", tp: int) -> None:
        """The recurrent layers' part of `check_tensor_parallel` (each family's own fields)."""
        raise NotImplementedError

    def recurrent_layers(self) -> list[RecurrentMixer]:
        """Every `RecurrentMixer` inside, found once (a walk of the module tree costs ~0.5 ms: not per step)."""
        found = self.__dict__.get("_recurrent_layers")
        if found is None:
            found = self.__dict__["_recurrent_layers"] = [m for m in self.modules()  # type: ignore[attr-defined]
                                                          if isinstance(m, RecurrentMixer)]
        return found

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(m.state_bytes(dtype) for m in self.recurrent_layers())

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        for m in self.recurrent_layers():
            m.allocate_state(num_slots, dtype, device)

    def prepare_states(self, copies: Sequence[torch.Tensor], fresh_slots: Optional[torch.Tensor]) -> None:
        """Every recurrent layer's `RecurrentMixer.prepare_states`: before a compiled or captured decode-only step,
        whose layers prepare none."""
        for m in self.recurrent_layers():
            m.prepare_states(copies, fresh_slots)


class MambaMixer(RecurrentMixer):
    """Mamba2's mixer; parameter names as in the checkpoints (`mamba.in_proj`, `mamba.conv1d`, `mamba.dt_bias`,
    `mamba.A_log`, `mamba.D`, `mamba.norm`, `mamba.out_proj`).

    With tensor parallelism each rank holds heads / tp heads (`num_heads`, `inner`, `conv_dim` are this rank's) and
    the B/C groups they read: groups / tp of them, or, with fewer groups than ranks, the one its heads belong to
    (shared by tp / groups consecutive ranks). in_proj is column-parallel by parts (z, x, B, C, dt), out_proj
    row-parallel; a norm group split over ranks sums its mean square over them."""

    def __init__(self, hidden_size: int, raw: dict[str, Any], eps: float, inner: Optional[int] = None,
                 norm: str = "gated", out_bias: Optional[bool] = None) -> None:
        """`inner`: the SSM's width (heads x head_dim), when it is not `mamba_expand` x hidden_size (Nemotron-H
        gives heads and head_dim: models/nemotron_h.py). `norm`: "gated" (RMSNorm per group of y * silu(z), as
        Mamba2), "before_gate" (RMSNorm per group of y, then times silu(z)) or "none" (y * silu(z), no norm; both
        Falcon-H1's, models/falcon_h1.py). `out_bias`: out_proj's bias when it differs from in_proj's."""
        super().__init__()
        if norm not in ("gated", "before_gate", "none"):
            raise ValueError(f"unknown Mamba norm {norm!r}")
        self.norm_mode = norm
        expand = int(raw.get("mamba_expand", 2))
        heads = int(raw.get("mamba_n_heads", 128))
        width = expand * hidden_size if inner is None else inner
        d_head = raw.get("mamba_d_head", "auto")
        self.head_dim = width // heads if d_head in (None, "auto") else int(d_head)
        if self.head_dim * heads != width:
            raise ValueError(f"mamba_n_heads ({heads}) x mamba_d_head ({self.head_dim}) != mamba_expand x "
                             f"hidden_size ({width})")
        groups = int(raw.get("mamba_n_groups", 1))
        self.d_state = int(raw.get("mamba_d_state", 256))
        self.d_conv = int(raw.get("mamba_d_conv", 4))
        self.chunk_size = int(raw.get("mamba_chunk_size", 256))
        if heads % groups:
            raise ValueError(f"mamba_n_groups ({groups}) does not divide mamba_n_heads ({heads})")
        tp = ParallelContext.size
        check_divides(tp, mamba_n_heads=heads)
        check_groups(tp, "mamba_n_groups", groups)
        limit = raw.get("time_step_limit") or (0.0, float("inf"))
        self.dt_min, self.dt_max = _float(limit[0]), _float(limit[1])
        self.eps = eps
        # this rank's share
        self.num_heads, self.inner, self.n_groups = heads // tp, width // tp, max(1, groups // tp)
        self.group_ranks = max(1, tp // groups)  # ranks sharing each group (its norm spans them)
        self.total_groups, self.group_index = groups, ParallelContext.rank // self.group_ranks
        gs = (groups * self.d_state, self.n_groups * self.d_state)
        x_part = (width, self.inner)
        self.conv_dim = self.inner + 2 * gs[1]
        bias = bool(raw.get("mamba_proj_bias", False))
        self.in_proj = PartsLinear(hidden_size, [x_part, x_part, gs, gs, (heads, self.num_heads)], bias=bias)
        self.conv1d = split_conv(nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim,
                                           bias=bool(raw.get("mamba_conv_bias", True))), [x_part, gs, gs])
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        per_rank(self.dt_bias, self.A_log, self.D)
        self.norm: Optional[nn.Module] = None
        if norm != "none":
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(self.inner))
            per_rank(self.norm.weight)
        self.out_proj = RowParallelLinear(width, hidden_size, bias=bias if out_bias is None else out_bias)
        for p in self.parameters():
            p.requires_grad_(False)
        self.state_shape = (self.num_heads, self.head_dim, self.d_state)

    @staticmethod
    def check_split(tp: int, heads_field: str, heads: int, groups_field: str, groups: int) -> None:
        """The mixer's part of a model's `check_tensor_parallel` (under the family's names for the fields)."""
        check_divides(tp, **{heads_field: heads})
        check_groups(tp, groups_field, groups)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)

    def _groups(self, t: torch.Tensor) -> torch.Tensor:
        """B or C [..., groups * d_state] -> [..., groups, d_state] (fp32)."""
        return t.float().unflatten(-1, (self.n_groups, self.d_state))

    def _per_head(self, t: torch.Tensor) -> torch.Tensor:
        """B or C [T, groups * d_state] -> [T, heads, d_state] (head h reads group h // (heads / groups))."""
        return t.float().view(-1, self.n_groups, self.d_state).repeat_interleave(
            self.num_heads // self.n_groups, dim=1)

    def forward(self, x: torch.Tensor, decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        step = self.begin_step(decode)
        ssm_state = self.ssm_state
        assert ssm_state is not None
        gate, xbc, dt = self.project(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        y = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        inner, gn = self.inner, self.n_groups * self.d_state
        if step.decode_tokens is not None:  # one token each: a recurrence step, all of them at once
            idx, slots = step.decode_tokens, step.decode_slots
            xs, B, C = F.silu(self.conv_decode(xbc[idx], slots)).split([inner, gn, gn], dim=-1)
            xs = xs.float().view(-1, self.num_heads, self.head_dim)
            y[idx] = self._decode(step, self._dt(dt[idx]), xs, A, B, C) + D[:, None] * xs
        batch = step.prefill_batch
        if batch is not None:  # short chunks, padded to one length: conv after the carried windows, then SSD
            xs, B, C = F.silu(self.conv_prefill_batch(xbc[batch.rows], batch)).split([inner, gn, gn], dim=-1)
            xs = xs.float().unflatten(-1, (self.num_heads, self.head_dim))
            dtr = self._dt(dt[batch.rows]) * batch.valid[..., None]  # (padding: dt = 0 leaves the state)
            out, final = ssd_scan_batch(xs, dtr, A, self._groups(B), self._groups(C), self.chunk_size,
                                        ssm_state[batch.slots])
            ssm_state[batch.slots] = final
            y[batch.rows[batch.valid]] = (out + D[:, None] * xs)[batch.valid]
        for slot, a, b in step.long_prefills:  # longer chunks, one by one
            xs, B, C = F.silu(self.conv_prefill(xbc[a:b], slot)).split([inner, gn, gn], dim=-1)
            xs = xs.float().view(-1, self.num_heads, self.head_dim)
            out, final = ssd_scan(xs, self._dt(dt[a:b]), A, self._groups(B), self._groups(C), self.chunk_size,
                                  ssm_state[slot])
            ssm_state[slot] = final
            y[a:b] = out + D[:, None] * xs
        return self.out_proj(self.gate_and_norm(y.view(x.shape[0], inner), gate, x.dtype))

    def _decode(self, step: MambaStep, dt: torch.Tensor, xs: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor) -> torch.Tensor:
        """One recurrence step of each one-token request (dt [R, heads], xs [R, heads, head_dim], B, C [R, groups *
        d_state]), the states updated in place: y [R, heads, head_dim] without the D skip."""
        state = self.decode_states(step)
        rows, hd, n = state.shape[0] * self.num_heads, self.head_dim, self.d_state
        dt, xs = over_span(step, dt), over_span(step, xs)
        state.mul_(torch.exp(dt * A)[..., None, None])
        # state += (dt x) outer B, per head, with no temporary
        state.view(rows, hd, n).baddbmm_((dt[..., None] * xs).reshape(rows, hd, 1),
                                         over_span(step, self._per_head(B)).reshape(rows, 1, n))
        self.store_states(step, state)
        y = torch.bmm(state.view(rows, hd, n), over_span(step, self._per_head(C)).reshape(rows, n, 1))
        return from_span(step, y.view(-1, self.num_heads, hd))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[z; xBC; dt] of each token (Falcon-H1 scales them)."""
        return self.in_proj(x)

    def gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The SSM's output y [T, inner] (fp32) gated by silu(z), RMS-normed per group of channels (`norm_mode`),
        in `dtype`."""
        if self.norm_mode == "gated":  # gated RMSNorm (norm after the gate)
            g = self._rms_per_group(y * F.silu(gate.float()))
            return self.norm.weight * g.to(dtype)  # type: ignore[union-attr]
        if self.norm_mode == "none":
            return (y * F.silu(gate)).to(dtype)
        # norm, then the gate (all in fp32)
        g = self.norm.weight.float() * self._rms_per_group(y)  # type: ignore[union-attr]
        return (g * F.silu(gate.float())).to(dtype)

    def _rms_per_group(self, g: torch.Tensor) -> torch.Tensor:
        """[T, inner] fp32 divided by its RMS per group of channels. A group this rank holds part of (fewer groups
        than ranks): the mean squares of the ranks sharing it, averaged (a [T, groups] all-reduce, zero elsewhere)."""
        t = g.shape[0]
        g = g.view(t, self.n_groups, -1)
        ms = g.pow(2).mean(-1, keepdim=True)
        if self.group_ranks > 1:
            shares = ms.new_zeros(t, self.total_groups)
            shares[:, self.group_index] = ms[:, 0, 0]
            tp_all_reduce(shares)
            ms = shares[:, self.group_index, None, None] / self.group_ranks
        return (g * torch.rsqrt(ms + self.eps)).view(t, -1)
