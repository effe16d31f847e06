"""Build a model from a Hugging Face checkpoint folder: sharded safetensors (with an index), PyTorch .bin files
(models/weight_files.py) or dummy weights."""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from streamer.models import registry
from streamer.models.bnb import dequantizing_bnb, is_bnb
from streamer.models.config import ModelConfig, head_from_tokens
from streamer.models.layers import ColumnParallelLinear, PackableLinear
from streamer.models.moe import EXPERT_PROJ, EXPERT_WEIGHT, SparseMoE
from streamer.models.quant import dequantizing
from streamer.models.weight_files import iter_weights, open_weights, tensor_names, weight_files
from streamer.models.woq import IntQuant, group_order, int_weights, parse_int_quant
from streamer.tokenizer.mistral_format import hf_weights as mistral_weights
from streamer.tokenizer.mistral_format import is_mistral_folder
from streamer.tokenizer.mistral_format import weight_files as mistral_weight_files

if TYPE_CHECKING:
    from streamer.models.llama import LlamaForCausalLM

logger = logging.getLogger("streamer")


def model_class(cfg: ModelConfig) -> type:
    """The class a config builds: its registry entry's (models/registry.py; only that model's file is imported),
    as the checkpoint's multi-token-prediction head (models/mtp.py), or with a vision encoder in front
    (models/vlm.py)."""
    cls = registry.model_class(cfg.architecture)
    if cfg.draft_head == "mtp":  # the checkpoint's multi-token-prediction layer, as a speculative head
        from streamer.models.mtp import mtp_class
        cls = mtp_class(cls)
    if cfg.multimodal is not None:  # the text family's model with a vision encoder in front
        from streamer.models.vlm import vlm_class
        cls = vlm_class(cfg.multimodal_architecture, cls)
    return cls


def _dummy_init(model: torch.nn.Module, seed: int) -> None:
    """Random weights at real sizes, small enough that activations stay finite in bf16/fp16. Filled on the
    parameters' own device (an 8B model filled on the host would take minutes)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.uniform_(-0.05, 0.05, generator=gen)


def load_model(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend_cls: type,
               max_positions: int, load_format: str = "auto", seed: int = 0, keep_int4: bool = True,
               ) -> LlamaForCausalLM:
    """keep_int4: a 4-bit (or channel-wise 8-bit) checkpoint's linears keep their codes (their layers'
    `finish_int4` packs them once anything else that takes their shapes, LoRA, is attached); otherwise they are
    dequantized as they load."""
    from_tokens = cfg.num_labels is not None and cfg.raw.get("classifier_from_token") is not None
    if (cfg.tie_word_embeddings and load_format != "dummy" and not from_tokens
            and _stores_own_head(weight_files(folder, load_format))):
        logger.warning("%s: config.json ties the LM head to the embeddings, but the checkpoint stores a different "
                       "lm_head.weight: using that (as transformers does)", folder)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    model_cls = model_class(cfg)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg, backend_cls, max_positions)
    finally:
        torch.set_default_dtype(old_dtype)
    if hasattr(model, "keep_stage"):  # (pipeline stages: a family that builds its layers itself keeps its own now)
        model.keep_stage()
    model.kv_scales = None  # [(k_scale, v_scale)] per layer, for an FP8 KV cache, if the checkpoint has them
    if load_format == "dummy":
        _dummy_init(model, seed)
    else:
        mistral = is_mistral_folder(folder)
        files = mistral_weight_files(folder) if mistral else weight_files(folder, load_format)
        kv_scales: dict[tuple[int, str], float] = {}
        weights = iter_weights(files, _not_this_ranks(model))
        if mistral:  # Mistral's tensor names and rotary layout -> transformers' (streamer/tokenizer/mistral_format.py)
            weights = mistral_weights(weights, cfg.num_heads, cfg.num_kv_heads)
        if is_bnb(cfg.quantization):  # (before renames: a model that splits fused tensors needs them whole)
            weights = dequantizing_bnb(weights, cfg.quantization)
        weights = _taking_kv_scales(model.rename_weights(weights), kv_scales)
        head = HeadFromTokens(model, folder) if from_tokens else None
        if head is not None:
            weights = head.taking(weights)
        iq = parse_int_quant(cfg.quantization) if cfg.quantization is not None else None
        if iq is not None:
            keep = _prepare_int4(model, iq, files) if keep_int4 else set()
            weights = int_weights(_without_zero_biases(weights, model), iq, dtype, keep.__contains__)
        elif cfg.quantization is not None and not is_bnb(cfg.quantization):
            weights = dequantizing(weights, cfg.quantization)
        loaded = model.load_weights(weights)
        if head is not None:
            loaded.add(head.finish())
        missing = model.expected_weights() - loaded
        if missing:
            names = sorted(model.checkpoint_name(m) for m in missing)
            head = (f"; no LM head ({model.checkpoint_name('lm_head.weight')}), and config.json does not tie it to "
                    "the embeddings (tie_word_embeddings is false): set tie_word_embeddings: true if the model "
                    "shares them" if "lm_head.weight" in missing else "")
            raise ValueError(f"checkpoint {folder} is missing {len(names)} tensor(s): {', '.join(names[:8])}"
                             + (" ..." if len(names) > 8 else "") + head)
        model.kv_scales = _per_layer(kv_scales, cfg.num_layers)
    return model.eval()


NamedTensors = list[tuple[str, torch.Tensor]]


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor, in any family's spelling


def _not_this_ranks(model: torch.nn.Module) -> Optional[Callable[[str], bool]]:
    """Checkpoint tensors to skip unread: other pipeline stages' layers (`LlamaForCausalLM.holds`), other ranks'
    experts (`_other_ranks_experts`); None: none."""
    experts = _other_ranks_experts(model)
    if getattr(model, "pp_layers", None) is None:
        return experts
    holds = model.holds
    return (lambda name: not holds(name)) if experts is None else (lambda name: experts(name) or not holds(name))


def _other_ranks_experts(model: torch.nn.Module) -> Optional[Callable[[str], bool]]:
    """Expert parallelism: whether a checkpoint tensor name is one expert's (`....experts.E.....`) that another
    rank holds, to be skipped unread; None where this rank holds every expert, or where its sparse layers hold
    different ranges (then the layers' loaders drop the others' experts after reading them). Experts stored fused
    (several in one tensor) are read whole and cut by the loaders."""
    ranges = {m.expert_range for m in model.modules() if isinstance(m, SparseMoE) and m.expert_parallel}
    if len(ranges) != 1:
        return None
    mine = ranges.pop()

    def skip(name: str) -> bool:
        m = _EXPERT_INDEX.search(name)
        return m is not None and int(m.group(1)) not in mine
    return skip


def checkpoint_tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of a folder's safetensors files, by name, with its shape (from the files' headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(folder):
        with open_weights(path) as f:
            shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    return shapes


def reload_weights(model: LlamaForCausalLM, source: Path | NamedTensors, partial: bool = False) -> None:
    """A checkpoint's weights (a folder's, or tensors by checkpoint name) copied into a loaded model's tensors, in
    place (compiled graphs and CUDA graphs keep reading the same memory). The caller has checked that they have the
    model's structure and that no weight is derived (packed, quantized, absorbed) at the time."""
    tensors = iter_weights(weight_files(source)) if isinstance(source, Path) else iter(source)
    weights = _taking_kv_scales(model.rename_weights(tensors), {})
    head = HeadFromTokens(model) if getattr(model, "head_token_ids", None) is not None else None
    loaded = model.load_weights(weights if head is None else head.taking(weights))
    if head is not None and (head.rows or not partial):
        loaded.add(head.finish())
    if partial:  # (some of the tensors: the others keep their values)
        return
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"new weights are missing {len(missing)} tensor(s): "
                         f"{', '.join(sorted(model.checkpoint_name(m) for m in missing)[:8])}")


class HeadFromTokens:
    """`classifier_from_token` (vLLM's, through hf_overrides: config.head_from_tokens): a causal LM's checkpoint
    served as a sequence classifier, its score head made of the LM head's rows for the labels' tokens (the
    embeddings' rows where the head is tied). The rows are taken whole as the weights stream by, before the model
    shards or skips them (it has no LM head)."""

    def __init__(self, model: LlamaForCausalLM, folder: Optional[Path] = None) -> None:
        self.model = model
        if folder is not None:  # (first load: the tokens' ids, kept for reloads)
            from streamer.tokenizer.tokenizer import Tokenizer
            tok = Tokenizer.from_pretrained(folder)
            names = model.cfg.raw["classifier_from_token"]
            ids = [tok.token_to_id(t) for t in names]
            if None in ids:
                raise ValueError(f"classifier_from_token: {names[ids.index(None)]!r} is not a token of the "
                                 f"tokenizer in {folder}")
            model.head_token_ids = ids
        self.rows: dict[str, torch.Tensor] = {}

    def taking(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        ids = self.model.head_token_ids
        for name, t in weights:
            if name in ("lm_head.weight", "model.embed_tokens.weight"):
                self.rows[name] = t[ids].float()
            yield name, t

    @torch.no_grad()
    def finish(self) -> str:
        """Fill the score head; returns its parameter's name (loaded)."""
        rows = self.rows.get("lm_head.weight", self.rows.get("model.embed_tokens.weight"))
        if rows is None:
            raise ValueError("classifier_from_token: the checkpoint holds neither an LM head nor embeddings")
        _, method = head_from_tokens(self.model.cfg.raw)
        weight = rows[1:2] - rows[:1] if method == "from_2_way_softmax" else rows
        self.model.score.weight.copy_(weight)  # type: ignore[union-attr]
        return "score.weight"


def _prepare_int4(model: LlamaForCausalLM, iq: IntQuant, files: list[Path]) -> set[str]:
    """Make every linear whose checkpoint weight is 4-bit, or 8-bit with one scale per output channel (all its
    parts, for a layer that packs several), take the codes; returns their checkpoint names. Read from the files'
    headers: what a config says it left unquantized (`ignore`, `modules_to_not_convert`) is simply what is stored
    in full precision. (Grouped 8-bit weights, and 8-bit experts, are dequantized as they load.)"""
    if iq.bits not in (4, 8) or iq.bits == 8 and iq.group_size != -1:
        return set()
    where = {name: path for path in files for name in tensor_names(path)}
    original = dict(model.rename_weights((n, n) for n in where))  # our spelling -> the checkpoint's
    codes = iq.parts()[0][0]
    by_module: dict[str, list[tuple[str, object]]] = {}
    for base in (n[:-len(codes)] for n in original if n.endswith(codes)):
        expert = EXPERT_WEIGHT.match(f"{base}.weight".removeprefix("model."))
        if expert is not None:  # one expert's matrix: the layer's whole sparse MLP goes 4-bit, or none of it
            prefix, e, proj, _ = expert.groups()
            by_module.setdefault(f"{prefix}.mlp", []).append((base, f"{e}.{EXPERT_PROJ.get(proj, proj)}"))
            continue
        name, shard = model.param_name(f"{base}.weight")
        by_module.setdefault(name.removesuffix(".weight"), []).append((base, shard))
    modules = dict(model.named_modules())
    keep: set[str] = set()
    for name, parts in by_module.items():
        m = modules.get(name)
        if isinstance(m, SparseMoE):
            if iq.bits != 4:
                continue
            pieces = {shard for _, shard in parts}
            expected = {p for ps in m.expected_shards().values() for p in ps}
            # (with expert parallelism the checkpoint holds more experts than this rank's)
            if not iq.act_order and expected <= pieces and m.prepare_int4(iq.group_size):
                keep.update(base for base, _ in parts)
            continue
        if not isinstance(m, PackableLinear):
            continue  # (vision encoders, the LM head: dequantized)
        whole = any(shard is None for _, shard in parts) or not isinstance(m, ColumnParallelLinear) \
            or len(parts) == len(m.shard_names)
        g_idx = [_read(where, original, f"{base}{iq.parts()[1][0]}") for base, _ in parts] if iq.act_order else []
        order = _act_order(g_idx, iq.group_size, name)
        if whole and order is not False and m.prepare_int4(iq.group_size, order, iq.bits):
            keep.update(base for base, _ in parts)
    if by_module and not keep:
        logger.info("no layer of this checkpoint can keep its %d-bit codes: its weights are dequantized", iq.bits)
    return keep


def _without_zero_biases(weights: Iterator[tuple[str, torch.Tensor]], model: LlamaForCausalLM,
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Older GPTQ writers stored a bias for every quantized linear, zeros where the model has none: those are
    dropped (a non-zero bias the model has no place for still fails the load)."""
    params = {name for name, _ in model.named_parameters()}
    for name, t in weights:
        if name.endswith(".bias") and model.param_name(name)[0] not in params and not bool(t.any()):
            continue
        yield name, t


def _act_order(g_idx: list[Optional[torch.Tensor]], group_size: int, name: str,
               ) -> "Optional[torch.Tensor] | bool":
    """The input-column order of a layer whose parts share one act-order grouping (None: contiguous groups);
    False when its parts group their columns differently (one input order cannot serve them all)."""
    found = [g.long() for g in g_idx if g is not None]
    if not found or group_size == -1:
        return None
    if any(not torch.equal(g, found[0]) for g in found[1:]) or len(found) != len(g_idx):
        return False
    if torch.equal(found[0], torch.arange(found[0].numel()) // group_size):
        return None
    return group_order(found[0], -(-found[0].numel() // group_size), name)


def _read(where: dict[str, Path], original: dict[str, str], name: str) -> Optional[torch.Tensor]:
    if name not in original:
        return None
    with open_weights(where[original[name]]) as f:
        return f.get_tensor(original[name])


# The checkpoint names (their ends) of the token embeddings and of the LM head: Llama's, and the classic families'
# (GPT-NeoX's embed_in / embed_out, Falcon's word_embeddings, GPT-2's, GPTBigCode's and GPT-J's wte; OPT and Phi
# spell them as Llama does).
_EMBEDDING_NAMES = ("embed_tokens.weight", "embed_in.weight", "word_embeddings.weight", "wte.weight")
_HEAD_NAMES = ("lm_head.weight", "embed_out.weight")


def _stores_own_head(files: list[Path]) -> bool:
    """Whether a checkpoint whose config ties the LM head holds a head weight that is not the embedding matrix
    (transformers 5 writes tie_word_embeddings: true into configs of models it does not tie, Mistral 3's)."""
    where = {name: path for path in files for name in tensor_names(path)}
    heads = [n for n in where if n.endswith(_HEAD_NAMES)]
    embeds = [n for n in where if n.endswith(_EMBEDDING_NAMES) and "vision" not in n]
    if len(heads) != 1 or len(embeds) != 1:
        return False
    tensors = []
    for name in (heads[0], embeds[0]):
        with open_weights(where[name]) as f:
            tensors.append(f.get_tensor(name))
    return tensors[0].shape != tensors[1].shape or not torch.equal(tensors[0], tensors[1])


# An FP8 KV cache's calibrated scales, as llm-compressor (self_attn.k_scale / v_scale), older AutoFP8
# (self_attn.kv_scale, both) and older compressed-tensors (k_proj / v_proj.output_scale) write them.
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


def _taking_kv_scales(weights: Iterator[tuple[str, torch.Tensor]], found: dict[tuple[int, str], float],
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights without the KV-cache scales, which go into `found` by (layer, "k" | "v"). A per-head scale
    is taken at its largest: a coarser scale never saturates what a finer one would not."""
    for name, t in weights:
        m = _KV_SCALE.match(name)
        if m is None:
            yield name, t
            continue
        layer, kind = int(m.group(1)), m.group(2) or m.group(3)
        for k in ("k", "v") if kind == "kv" else (kind,):
            found[(layer, k)] = float(t.float().abs().max())


def _per_layer(found: dict[tuple[int, str], float], num_layers: int) -> Optional[list[tuple[float, float]]]:
    """[(k_scale, v_scale)] per layer, or None when the checkpoint has none (a missing one is 1.0)."""
    if not found:
        return None
    return [(found.get((i, "k"), 1.0), found.get((i, "v"), 1.0)) for i in range(num_layers)]
