"""Speculative decoding with a draft model: a small checkpoint of the target's family and tokenizer proposes the
tokens, the target verifies them in one forward pass (the engine's speculative step, streamer/spec_decode/ngram.py).

The draft runs on the device thread right before the target's step, inside `ModelRunner.launch`: the host plans
it (`plan_drafts`), the draft model fills the target's placeholder tokens on the device, and the proposals come
back with the sampled tokens for the engine to verify. Proposals are the draft's argmax, so the verification rule
(sample from the target, accept while equal) stays exact for sampled requests too.

The draft has its own KV cache with the target's block layout: it shares the target's block tables, so it needs
no allocator of its own. It keeps KV only for the requests it drafts for, computed lazily: `num_draft_computed`
on each request counts the leading positions whose draft KV is valid, and a plan first catches the draft up on
the tokens it has not seen (a whole prompt the first time, then usually nothing or the one accepted draft it
never fed back). Preemption, which frees the blocks, resets the count (Request.reset_computed).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from streamer.config import EngineConfig
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.worker.input_batch import StepInputs, to_device

if TYPE_CHECKING:
    from streamer.worker.model_runner import ModelRunner

logger = logging.getLogger("streamer")


@dataclass
class DraftPlan:
    """One step's drafting, prepared on the host: forward-only catch-up chunks, then one pass per draft position.
    Pass j feeds each request still drafting (j < its count) its previous proposal (pass 0: its last known
    token) and proposes the next token."""

    req_ids: list[str]  # the drafting requests, in the target step's order
    counts: np.ndarray  # int64 [R]: tokens to draft for each
    catch_up: list[StepInputs]  # KV for the tokens the draft has not computed yet (no sampling)
    passes: list[StepInputs]
    members: list[np.ndarray]  # int64: pass j's requests (indices into req_ids); each pass's are a prefix set
    target_idx: np.ndarray  # int64 [sum(counts)]: where proposal (r, j) goes in the target's input_ids, r-major
    source_idx: np.ndarray  # int64 [sum(counts)]: the same proposals' places in the flattened [R, passes] output


def _forward_step(tokens: np.ndarray, positions: np.ndarray, q_lens: np.ndarray, table: np.ndarray,
                  block_size: int, pending_rows: np.ndarray | None = None) -> StepInputs:
    """A forward-only varlen batch: request i has q_lens[i] consecutive tokens ending at its context length.
    `pending_rows`: one token per request, read on the device from those rows of the runner's last tokens."""
    qsl = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    req_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    zeros = np.zeros(len(q_lens), dtype=np.int64)
    pending = pending_rows if pending_rows is not None else np.zeros(0, dtype=np.int64)
    return StepInputs(req_ids=[""] * len(q_lens), rows=zeros, epochs=zeros, input_ids=tokens.astype(np.int64),
                      positions=positions, query_start_loc=qsl, seq_lens=positions[qsl[1:] - 1] + 1,
                      block_table=table, slot_mapping=slots, sample_idx=np.zeros(0, dtype=np.int64),
                      sampling=None,  # type: ignore[arg-type]
                      pending_idx=np.arange(len(pending), dtype=np.int64), pending_rows=pending)


def plan_drafts(step: StepInputs, num_drafts: np.ndarray, tokens: np.ndarray, computed: np.ndarray,
                block_size: int, budget: int) -> DraftPlan:
    """The drafting for a target step. Per scheduled request: `num_drafts` (0: none) and `computed` its
    num_draft_computed; `tokens`: the persistent batch's token rows (read at `step.rows`, up to each one's last
    known token; only the drafting requests' rows are gathered). The catch-up tokens go in chunks of at most
    `budget` tokens."""
    who = np.flatnonzero(num_drafts)
    counts = num_drafts[who]
    qsl = step.query_start_loc
    last = step.seq_lens[who] - counts - 1  # position of each one's last known token (its drafts follow it)
    table = step.block_table[who]
    rows = step.rows[who]
    catch_up = _catch_up(tokens, rows, computed[who], last, table, block_size, budget)
    passes, members = [], []
    for j in range(int(counts.max())):
        m = np.flatnonzero(counts > j)
        fed = tokens[rows[m], last[m]] if j == 0 else np.zeros(len(m), dtype=np.int64)
        passes.append(_forward_step(fed, last[m] + j, np.ones(len(m), dtype=np.int64), table[m], block_size,
                                    None if j == 0 else m))
        members.append(m)
    target_idx, source_idx = placement(qsl, who, counts, len(passes))
    return DraftPlan([step.req_ids[i] for i in who], counts, catch_up, passes, members, target_idx, source_idx)


def placement(qsl: np.ndarray, who: np.ndarray, counts: np.ndarray, num_passes: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each proposal (r, j), r-major, goes in the target's input_ids (after request who[r]'s last known
    token), and where it is in the flattened [R, num_passes] proposals."""
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # j of each proposal
    return (np.repeat(qsl[1:][who] - counts, counts) + within,
            np.repeat(np.arange(len(who)) * num_passes, counts) + within)


def _catch_up(tokens: np.ndarray, rows: np.ndarray, computed: np.ndarray, last: np.ndarray, table: np.ndarray,
              block_size: int, budget: int) -> list[StepInputs]:
    """Forward-only chunks over positions computed..last-1 of each request (its tokens: row rows[r] of
    `tokens`), at most `budget` tokens each."""
    spans = [(r, int(c), int(e)) for r, (c, e) in enumerate(zip(computed, last)) if c < e]
    chunks: list[StepInputs] = []
    while spans:
        room, picked, rest = budget, [], []
        for r, lo, hi in spans:
            take = min(hi - lo, room)
            if take:
                picked.append((r, lo, lo + take))
                room -= take
            if lo + take < hi:
                rest.append((r, lo + take, hi))
        reqs = np.array([r for r, _, _ in picked], dtype=np.int64)
        positions = np.concatenate([np.arange(lo, hi) for _, lo, hi in picked]).astype(np.int64)
        ids = np.concatenate([tokens[rows[r], lo:hi] for r, lo, hi in picked])
        q_lens = np.array([hi - lo for _, lo, hi in picked], dtype=np.int64)
        chunks.append(_forward_step(ids, positions, q_lens, table[reqs], block_size))
        spans = rest
    return chunks


class DraftModel:
    """The draft checkpoint on a ModelRunner of its own (same device, dtype and KV block count as the target)."""

    def __init__(self, config: EngineConfig, target: "ModelRunner",
                 make_runner: Callable[..., "ModelRunner"]) -> None:
        # make_runner: ModelRunner, handed in by the target runner that builds this drafter (model_runner.py imports
        # the drafters, so they do not import it back)
        from streamer.models.gguf import (
            hf_folder,  # a GGUF draft (file, folder or first shard): its converted HF folder
        )
        path = hf_folder(Path(config.speculative_model).expanduser())  # type: ignore[arg-type]
        if not path.is_dir():
            raise FileNotFoundError(f"speculative_model not found: {config.speculative_model} (a Hugging Face "
                                    "checkpoint folder or a GGUF file)")
        cfg = ModelConfig.from_dir(path)
        _check_compatible(path, cfg, config, target)
        draft_config = dataclasses.replace(
            config, model=str(path), tokenizer=None, dtype=str(target.dtype).replace("torch.", ""),
            num_kv_blocks=target.num_blocks, enable_lora=False, quantization=None, cuda_graph_max_batch=0,
            speculative_model=None, num_speculative_tokens=0, tensor_parallel_size=1)
        self.runner = make_runner(draft_config, path, cfg, target.max_model_len)
        logger.info("draft model %s: %d layers, proposes %d tokens a step", path, cfg.num_layers,
                    config.num_speculative_tokens)

    @torch.inference_mode()
    def propose(self, plan: DraftPlan) -> torch.Tensor:
        """Run the plan: [R, max count] proposed tokens on the device (-1 past a request's count)."""
        runner = self.runner
        dev = runner.device
        for chunk in plan.catch_up:
            runner.hidden_states(chunk)
        out = torch.full((len(plan.req_ids), len(plan.passes)), -1, dtype=torch.int64, device=dev)
        for j, (step, members) in enumerate(zip(plan.passes, plan.members)):
            proposed = runner.model.compute_logits(runner.hidden_states(step)).argmax(dim=-1)
            runner.keep_last_tokens(members, proposed)  # the next pass's input, read on the device
            out[to_device(members, dev), j] = proposed
        return out

    def close(self) -> None:
        self.runner.close()


def _check_compatible(path: Path, cfg: ModelConfig, config: EngineConfig, target: "ModelRunner") -> None:
    """The draft must speak the target's tokens: a vocabulary no larger than the target's (embedding tables are
    often padded, e.g. Qwen2.5-0.5B's 151,936 rows for 7B's 152,064) and, where both ship one, the same one."""
    if registry.entry(cfg.architecture).recurrent_state:
        raise ValueError(f"speculative_model {path}: {cfg.architecture} (a hybrid attention + Mamba model) cannot "
                         "draft: its recurrent state would go through the proposals the target rejects")
    if cfg.vocab_size > target.model_cfg.vocab_size:
        raise ValueError(f"speculative_model {path}: its vocabulary ({cfg.vocab_size}) is larger than the target "
                         f"model's ({target.model_cfg.vocab_size}); the draft must use the target's tokenizer")
    theirs = path / "tokenizer.json"
    ours = Path(config.tokenizer or target.model_dir) / "tokenizer.json"
    if theirs.is_file() and ours.is_file() and _vocab(theirs) != _vocab(ours):
        raise ValueError(f"speculative_model {path}: its tokenizer differs from the target's")


def _vocab(tokenizer_json: Path) -> dict:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    return {"vocab": (data.get("model") or {}).get("vocab"),
            "added": sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])}
