"""Speculative decoding with an EAGLE head (streamer/models/eagle.py): drafts from the target's own features.

Each step, inside `ModelRunner.launch`:
1. **Propose** (a step with drafts, before the target's forward): request r, whose last known token t sits at
   position p + 1, drafts with pass 0 at position p on (embedding of t, the target's feature of p), kept from the
   step before; pass j > 0 at p + j on (its previous proposal, the head's own output feature). The target then
   verifies the proposals as any draft's (streamer/spec_decode/ngram.py: greedy output unchanged, sampled output keeps
   the target's distribution).
2. **Fill** (every step, after the target's forward and sampling): the head runs once over all of the step's
   tokens, position i reading (the token at i + 1, the target's feature of i), so that its KV cache holds every
   position the target has computed. The token at i + 1 is the prompt's where the host knows it, else the one
   the target sampled at i: for a verified draft that is the draft itself while accepted, and at the first
   rejection the correction. Positions past a rejection get stale entries, which the next step's fill rewrites
   (they are that step's positions again).
3. **Keep** each request's last `S = k + 1` features by position mod S (a batch row's slots), where the next
   step's pass 0 finds the feature of its last accepted position.

The head's KV cache has the target's block layout and follows its block tables, so it needs no allocator; prefix
caching shares it with the target's blocks. (A shared block's last entry was filled with the token that followed
it in the request that computed it: a different continuation drafts from a slightly stale entry there, which can
cost acceptance, never correctness.)
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from streamer.attention.base import forward_context
from streamer.config import EngineConfig
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.models.eagle import EAGLE1, EAGLE3, EagleDraftModel, default_aux_layers
from streamer.models.llama import LlamaForCausalLM
from streamer.spec_decode.draft_model import DraftPlan, _forward_step, placement
from streamer.worker.input_batch import StepInputs, to_device

if TYPE_CHECKING:
    from streamer.worker.model_runner import ModelRunner

logger = logging.getLogger("streamer")


@dataclass
class EagleFill:
    """A step's fill and keep (see the module docstring), prepared on the host."""

    next_ids: np.ndarray  # int64 [T]: the token after each of the step's tokens where the host knows it, else 0
    keep_idx: np.ndarray  # int64: the step's tokens whose features are kept (each request's last S positions)
    keep_rows: np.ndarray  # int64: their batch rows
    keep_slots: np.ndarray  # int64: position mod S


def is_eagle_checkpoint(path: Path) -> bool:
    """An EAGLE head: an EAGLE-3 architecture name, or (EAGLE-1) an `fc` fusing layer in its weights."""
    raw = _read_config(path)
    if _eagle_version(raw) is not None:
        return True
    from streamer.models.weight_files import tensor_names, weight_files
    try:
        names = {n for f in weight_files(path) for n in tensor_names(f)}
    except (FileNotFoundError, ValueError):
        return False
    return "fc.weight" in names or "model.fc.weight" in names


def eagle_config(path: Path) -> ModelConfig:
    """The head's config, as one of our two EAGLE architectures."""
    raw = _read_config(path)
    version = _eagle_version(raw) or EAGLE1
    cfg = ModelConfig.from_dict(dict(raw, architectures=["LlamaForCausalLM"], tie_word_embeddings=False))
    return dataclasses.replace(cfg, architecture=version)


def target_aux_layers(path: Path, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers whose input streams an EAGLE-3 head reads (empty for EAGLE-1)."""
    raw = _read_config(path)
    if _eagle_version(raw) != EAGLE3:
        return ()
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else default_aux_layers(target_cfg.num_layers)
    if len(set(layers)) != 3 or not all(0 <= i < target_cfg.num_layers for i in layers):
        raise ValueError(f"speculative_model {path}: EAGLE-3 reads 3 distinct target layers in [0, "
                         f"{target_cfg.num_layers}); got {list(layers)}" + ("" if ids else " (its default for a "
                         f"{target_cfg.num_layers}-layer target: set eagle_aux_hidden_state_layer_ids)"))
    return layers


def mtp_config(path: Path, target_cfg: ModelConfig) -> ModelConfig:
    """The MTP head's config: the target's, as its family's head; ValueError if the checkpoint has no MTP layer."""
    from streamer.models.weight_files import tensor_names, weight_files
    arch = target_cfg.architecture
    marker = registry.entry(arch).mtp  # (the registry's: a tensor only a checkpoint with the MTP layer has)
    if marker is None:
        families = [name for name, model in registry.MODELS.items() if model.mtp is not None]
        raise ValueError(f"speculative_method='mtp' drafts with the MTP layer of {', '.join(families)} "
                         f"checkpoints; {arch} has none")
    wanted = marker.format(n=target_cfg.num_layers)
    if not any(wanted in tensor_names(f) for f in weight_files(path)):
        raise ValueError(f"speculative_method='mtp': checkpoint {path} has no multi-token-prediction layer "
                         f"({wanted} not found)")
    return dataclasses.replace(target_cfg, draft_head="mtp", multimodal=None)  # (a vision model's: its text side)


def _eagle_version(raw: dict) -> Optional[str]:
    """The EAGLE architecture (EAGLE1 or EAGLE3: a registry draft head) a config.json names; None if none."""
    for name in raw.get("architectures") or []:
        hit = registry.served(name)
        if hit is not None and hit[1].task == registry.DRAFT:
            return hit[0].architecture
    return None


def _read_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        return json.load(f)


def plan_fill(step: StepInputs, tokens: np.ndarray, num_tokens: np.ndarray, keep: int) -> EagleFill:
    """The fill and keep of a target step; `tokens` / `num_tokens`: the persistent batch's rows (InputBatch)."""
    q_lens = np.diff(step.query_start_loc)
    rows = np.repeat(step.rows, q_lens)
    nxt = step.positions + 1
    known = nxt < num_tokens[rows]
    next_ids = np.where(known, tokens[rows, np.minimum(nxt, tokens.shape[1] - 1)], 0).astype(np.int64)
    kept = np.flatnonzero(step.positions >= np.repeat(step.seq_lens - keep, q_lens))
    return EagleFill(next_ids, kept, rows[kept], step.positions[kept] % keep)


def plan_passes(step: StepInputs, num_drafts: np.ndarray, tokens: np.ndarray, block_size: int) -> DraftPlan:
    """The proposing passes before a target step: request r (num_drafts[r] > 0) drafts from position p (its last
    known token's, minus one) on; pass 0 feeds its last known token, pass j its pass j - 1 proposal."""
    who = np.flatnonzero(num_drafts)
    counts = num_drafts[who]
    known = step.seq_lens[who] - counts - 1  # the last known token's position
    start = known - 1
    table, rows = step.block_table[who], step.rows[who]
    passes, members = [], []
    for j in range(int(counts.max())):
        m = np.flatnonzero(counts > j)
        fed = tokens[rows[m], known[m]].astype(np.int64) if j == 0 else np.zeros(len(m), dtype=np.int64)
        passes.append(_forward_step(fed, start[m] + j, np.ones(len(m), dtype=np.int64), table[m], block_size))
        members.append(m)
    passes[0].rows = rows
    target_idx, source_idx = placement(step.query_start_loc, who, counts, len(passes))
    return DraftPlan([step.req_ids[i] for i in who], counts, [], passes, members, target_idx, source_idx)


class EagleDrafter:
    """The EAGLE head on a ModelRunner of its own (eager; same device, dtype and KV block count as the target),
    with the kept features: [rows, S, hidden] on the device."""

    def __init__(self, config: EngineConfig, target: "ModelRunner",
                 make_runner: Callable[..., "ModelRunner"]) -> None:
        # make_runner: ModelRunner, handed in by the target runner that builds this drafter (model_runner.py imports
        # the drafters, so they do not import it back)
        if config.speculative_method == "mtp":  # the target checkpoint's own extra layer
            path, cfg = Path(target.model_dir), mtp_config(target.model_dir, target.model_cfg)
        else:
            path = Path(config.speculative_model).expanduser()  # type: ignore[arg-type]
            cfg = eagle_config(path)
            _check_target(path, cfg, target)
        draft_config = dataclasses.replace(
            config, model=str(path), tokenizer=None, dtype=str(target.dtype).replace("torch.", ""),
            num_kv_blocks=target.num_blocks, enable_lora=False, quantization=None, cuda_graph_max_batch=0,
            speculative_model=None, speculative_method=None, num_speculative_tokens=0, tensor_parallel_size=1,
            enforce_eager=True,
            kv_cache_dtype="auto")
        self.runner = make_runner(draft_config, path, cfg, target.max_model_len)
        self.model: EagleDraftModel = self.runner.model  # type: ignore[assignment]
        self.model.share_target(target.model)
        self.keep = config.num_speculative_tokens + 1
        self.kept = torch.zeros(config.max_num_seqs, self.keep, cfg.hidden_size, dtype=target.dtype,
                                device=target.device)
        logger.info("%s %s proposes %d tokens a step", "MTP layer of" if config.speculative_method else
                    f"EAGLE-{self.model.version} head", path, config.num_speculative_tokens)

    def _run(self, step: StepInputs, input_ids: torch.Tensor, feature: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        positions = to_device(step.positions, r.device)
        with forward_context(r._metadata(step)):
            return self.model(input_ids, positions, r.kv_caches, None, feature)

    @torch.inference_mode()
    def propose(self, plan: DraftPlan) -> torch.Tensor:
        """[R, max count] proposed tokens on the device (-1 past a request's count)."""
        dev = self.runner.device
        out = torch.full((len(plan.req_ids), len(plan.passes)), -1, dtype=torch.int64, device=dev)
        first = plan.passes[0]  # (its rows: the requests' batch rows, where their features are kept)
        ids = to_device(first.input_ids, dev)
        feature = self.kept[to_device(first.rows, dev), to_device(first.positions % self.keep, dev)]
        proposed = ids
        for j, (step, members) in enumerate(zip(plan.passes, plan.members)):
            if j:  # the requests still drafting: a subset of the previous pass's
                still = to_device(np.searchsorted(plan.members[j - 1], members), dev)
                ids, feature = proposed[still], feature[still]
            hidden, feature = self._run(step, ids, feature)
            proposed = self.model.propose(hidden)
            out[to_device(members, dev), j] = proposed
        return out

    @torch.inference_mode()
    def fill(self, step: StepInputs, fill: EagleFill, target_features: torch.Tensor,
             sampled: Optional[torch.Tensor]) -> None:
        """After the target's step: the head's KV over the step's tokens, and the features kept for the next."""
        dev = self.runner.device
        ids = to_device(fill.next_ids, dev)
        if sampled is not None:
            ids[to_device(step.sample_tokens, dev)] = sampled
        feature = self.model.combine(target_features)
        self._run(step, ids, feature)
        rows = to_device(fill.keep_rows, dev)
        top = int(fill.keep_rows.max()) + 1 if len(fill.keep_rows) else 0
        if top > len(self.kept):  # the batch grew past max_num_seqs rows (preempted requests' rows)
            grown = self.kept.new_zeros(max(top, 2 * len(self.kept)), *self.kept.shape[1:])
            grown[:len(self.kept)] = self.kept
            self.kept = grown
        self.kept[rows, to_device(fill.keep_slots, dev)] = feature[to_device(fill.keep_idx, dev)]

    def close(self) -> None:
        self.runner.close()


def check_target(model: torch.nn.Module, architecture: str) -> None:
    """EAGLE reads the features of a model built on LlamaForCausalLM's layer loop (`aux_layers`): most families
    are (Llama, Mistral, Qwen, Gemma, DeepSeek, gpt-oss, ...); GPT-2, GPTBigCode and Mamba2 are not."""
    if type(model).run_layers is not LlamaForCausalLM.run_layers or type(model).forward is not LlamaForCausalLM.forward:
        raise ValueError(f"EAGLE heads run over targets built on the Llama layer loop; {architecture} is not")


def _check_target(path: Path, cfg: ModelConfig, target: "ModelRunner") -> None:
    check_target(target.model, target.model_cfg.architecture)
    if cfg.vocab_size != target.model_cfg.vocab_size:
        raise ValueError(f"speculative_model {path}: an EAGLE head for a vocabulary of {cfg.vocab_size}, the target "
                         f"has {target.model_cfg.vocab_size}")
