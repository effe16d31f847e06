"""The model runner: owns the model, the KV cache tensors and the sampler, and executes one step.

`execute()` runs on the engine's device thread. It takes one step's flattened varlen batch, prepared on the
host by the persistent `InputBatch` (input_ids, positions, query_start_loc, seq_lens, block_table,
slot_mapping, per-row sampling parameters), moves it to the device, runs the model, projects logits only at
each sampling request's last scheduled token, and samples.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from streamer.attention.base import (
    FP8_KV_DTYPE,
    AttentionMetadata,
    CrossStep,
    DecodeBatch,
    MambaStep,
    PrefillBatch,
    forward_context,
)
from streamer.attention.torch_backend import decode_table, thread_splits
from streamer.config import EngineConfig
from streamer.core.kv_cache import cdiv
from streamer.core.request import Request
from streamer.core.step_time import StepShape, shape_of
from streamer.engine.lora import LoRAAdapter
from streamer.models import lora, registry
from streamer.models.config import ModelConfig
from streamer.models.layers import PackableLinear, ParallelContext, cpu_packing_supported
from streamer.models.loader import NamedTensors, checkpoint_tensor_shapes, load_model, reload_weights
from streamer.models.moe import EXPERT_PROJ, EXPERT_WEIGHT, SparseMoE
from streamer.models.quant import fp8_supported
from streamer.models.woq import parse_int_quant
from streamer.multimodal.inputs import EncoderCache, ImageStep
from streamer.worker.compile_cache import claim_compiles, healing, hold_compiles, release_compiles
from streamer.worker.cpu_malloc import keep_freed_memory
from streamer.worker.cuda_graphs import DecodeGraphs, capture_sizes
from streamer.worker.input_batch import PoolTokens, PromptLogprobTokens, SamplingRows, StepInputs, to_device
from streamer.worker.parallel import TensorParallelWorkers, layout_of, serve_steps
from streamer.worker.pipeline import PipelineLinks
from streamer.worker.rendezvous import RankGroup, init_process_group, pin, rank_cpu_shares, rank_threads
from streamer.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SpeechMasks,
    bad_word_bans,
    build_penalties,
    score_tokens,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from streamer.spec_decode.draft_model import DraftModel
    from streamer.spec_decode.eagle import EagleDrafter

logger = logging.getLogger("streamer")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_KV_DEFAULT = 2 << 30  # 2 GiB


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rank_device(name: str, rank: int) -> torch.device:
    """A tensor-parallel rank's device: on CUDA rank r takes GPU r; a CPU is shared."""
    device = resolve_device(name)
    return torch.device("cuda", rank) if device.type == "cuda" else device


# The /proc/cpuinfo flags under which torch computes a half-precision dtype natively on CPU (oneDNN's bf16 and fp16
# matmul kernels, AVX512-BF16/AMX and AVX512-FP16/AMX-FP16 on x86; BFMMLA, the `bf16` feature, on aarch64, where
# torch also sends bf16 matmuls to oneDNN; not measured here). Without them torch emulates the dtype: a bf16 matmul
# on an AVX2-only CPU ran at 0.1 GFLOP/s against 50 in fp32, and LLM.generate at 23.9 output tok/s against 119
# (issue 45). With them the half dtypes are no slower: on a Xeon with AMX-BF16 and AVX512-FP16 (no AMX-FP16), the
# demo model's LLM.generate on one thread ran 269 (bf16) and 313 (fp16) tok/s against 248 (fp32) at batch 1, and
# 1548 / 1304 against 1276 at batch 8, in half the weight memory.
_NATIVE_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
                     torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.lru_cache(maxsize=1)
def cpu_native_dtypes() -> frozenset[torch.dtype]:
    """The half-precision dtypes this CPU computes natively (float32 always is, and is not listed), from the
    feature flags in /proc/cpuinfo (Linux). Elsewhere (macOS, Windows) or where the file cannot be read: none, the
    conservative answer. torch.backends.cpu.get_cpu_capability() is no substitute: it names the vector ISA torch
    dispatches to ("AVX2", "AVX512", "DEFAULT"), and "AVX512" includes CPUs without AVX512-BF16, where bf16 is
    emulated. The two mistakes are not alike: float32 where bf16 was native costs twice the weight memory and some
    speed; bf16 where it is emulated runs several times slower (the numbers above). An explicit dtype overrides
    this. (Tests monkeypatch this function.)"""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return native_dtypes_from_cpuinfo(f.read())
    except OSError:
        return frozenset()


def native_dtypes_from_cpuinfo(text: str) -> frozenset[torch.dtype]:
    """The dtypes _NATIVE_CPU_FLAGS finds in /proc/cpuinfo's first `flags` (x86) or `Features` (aarch64) line
    (every core lists the same)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags = set(value.split())
            return frozenset(d for d, names in _NATIVE_CPU_FLAGS.items() if flags.intersection(names))
    return frozenset()


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: an explicit `name` as given; "auto" the checkpoint's torch_dtype (float32 when it names
    none we run), except on CPU, where a bf16 or fp16 checkpoint runs in float32 unless the CPU computes that
    dtype natively (cpu_native_dtypes), saying so in one log line."""
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(model_cfg.torch_dtype.replace("torch.", ""), torch.float32)
    if device.type == "cpu" and dtype != torch.float32 and dtype not in cpu_native_dtypes():
        short = str(dtype).removeprefix("torch.")
        logger.info("dtype auto: the checkpoint is %s but this CPU has no native %s; running in float32 "
                    "(dtype=%r runs it as stored)", short, {"bfloat16": "bf16", "float16": "fp16"}[short], short)
        return torch.float32
    return dtype


def resolve_backend(name: Optional[str], device: torch.device) -> type:
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        from streamer.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend
    from streamer.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend


# On CUDA by default the Triton sampler serves steps sampling at least this many rows: on the H200 (bench/RESULTS.md,
# 2026-12-04) it beat the torch path at 256 rows (1.24x; a decode step 3% faster) and lost at 8.
AUTO_KERNEL_MIN_ROWS = 256


def resolve_sampling_backend(name: Optional[str], device: torch.device) -> Optional[int]:
    """The fewest rows a step must sample for the sampler to run the Triton kernel (None: never)."""
    if name == "torch":
        return None
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("sampling_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        return 0
    from streamer_kernels import HAS_TRITON
    return AUTO_KERNEL_MIN_ROWS if device.type == "cuda" and HAS_TRITON else None


@dataclass
class RunnerOutput:
    """Host-side results of one step, one entry per sampled token (in scheduled order; a request with
    speculative drafts has one per draft and one more, consecutive)."""

    req_ids: list[str]
    token_ids: list[int]
    logprobs: Optional[list[list[float]]] = None  # [sampled, top-1, ..., top-N]
    logprob_token_ids: Optional[list[list[int]]] = None
    ranks: Optional[list[int]] = None
    # Where the sampled tokens go in the persistent batch: row, position (= context length before the token).
    rows: Optional[np.ndarray] = None
    epochs: Optional[np.ndarray] = None
    positions: Optional[np.ndarray] = None
    token_array: Optional[np.ndarray] = None
    prompt_logprobs: Optional["PromptLogprobsOut"] = None
    has_drafts: bool = False  # speculative: some request has several consecutive entries
    drafts: Optional[dict[str, list[int]]] = None  # a draft model's proposals, by request (n-gram: the engine's)
    # Pooling requests: (their PoolTokens.owners, the summed hidden states, float64 [owners, hidden]; a sequence
    # classifier's logits of them, [owners, labels])
    pooled: Optional[tuple[list, np.ndarray]] = None


@dataclass
class PromptLogprobsOut:
    """Logprobs of the prompt tokens a step scored (see PromptLogprobTokens), on the host."""

    owners: list[tuple[str, int, int]]  # (request id, position of its first target, how many), in row order
    target_ids: np.ndarray  # int64 [K]
    logprobs: np.ndarray  # float32 [K]: each target's logprob
    ranks: np.ndarray  # int64 [K]: its rank (1 = most likely)
    top_ids: np.ndarray  # int64 [K, N]
    top_logprobs: np.ndarray  # float32 [K, N]


# Hybrid models: prefill chunks of at most this many tokens are convolved and scanned together (PrefillBatch)
_BATCHED_CHUNK = 64


def _chunks(slots: np.ndarray, qsl: np.ndarray, reqs: np.ndarray) -> list[tuple[int, int, int]]:
    """(state slot, first token, end) of each of the step's requests `reqs`."""
    return [(int(slots[i]), int(qsl[i]), int(qsl[i + 1])) for i in reqs]


def _dense_span(slots: np.ndarray, fewest: int = 2) -> Optional[tuple[int, int]]:
    """[lo, hi) of the decode requests' state slots where they fill at least two thirds of it (the slot pool hands
    out its lowest free slot, so running requests' slots stay packed): updating the span's states in place through a
    view reads and writes each once, where gathering them and scattering them back costs about twice that. None for
    fewer than `fewest` slots."""
    if len(slots) < fewest:
        return None
    lo, hi = int(slots.min()), int(slots.max()) + 1
    return (lo, hi) if 3 * len(slots) >= 2 * (hi - lo) else None


def cross_rows(q_lens: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Each request's query rows in the step's flat batch, [R, L] padded with its last row (L: the longest), and
    which are its own ([R, L] bool; None when every request has L rows)."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    width = int(q_lens.max())
    if (q_lens == width).all():
        return (qsl[:-1, None] + np.arange(width)).astype(np.int64), None
    valid = np.arange(width) < q_lens[:, None]
    rows = qsl[:-1, None] + np.minimum(np.arange(width), q_lens[:, None] - 1)
    return rows.astype(np.int64), valid


def attention_layers(model: torch.nn.Module) -> list:
    """The decoder layers' attention modules (a hybrid model's recurrent layers have none)."""
    return [layer.self_attn for layer in model.layers if getattr(layer, "self_attn", None) is not None]


def kv_cache_geometry(model: torch.nn.Module) -> list[Optional[tuple[int, int]]]:
    """Per decoder layer, (kv heads, head_dim) of the KV cache it owns; None where it owns none: a recurrent layer,
    or one that attends over an earlier layer's cache (Gemma 4's KV sharing: the model's `kv_source`). Layers may
    differ (Gemma 4's global layers have wider heads)."""
    source = getattr(model, "kv_source", None)
    out: list[Optional[tuple[int, int]]] = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        own = attn is not None and (source is None or source[i] == i)
        out.append((attn.num_kv_heads, attn.head_dim) if own else None)
    return out


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int,
                 tp_rank: int = 0, local_rank: Optional[int] = None) -> None:
        """tp_rank > 0: another rank's shard (streamer/worker/parallel.py; its rank among all, every stage's), which
        only runs forwards; local_rank: its place among its node's ranks (its GPU), when they span several nodes."""
        self.config = config
        # (DeepSeek: the KV cache's geometry follows the latent-or-MHA switch; every rank applies it alike)
        self.model_cfg = model_cfg = model_cfg.with_mla_cache(config.mla_latent_cache)
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        # tp_rank: this process's rank among all (stage * T + its place in the stage); world: T x P processes
        self.tp_size, self.tp_rank = config.tensor_parallel_size, tp_rank
        self.pp_size, self.world_size = config.pipeline_parallel_size, config.world_size
        # (vLLM's --enable-expert-parallel: whole experts per rank (models/moe.py); meaningless without tensor
        # parallelism, and on a dense model (rank 0's `_check_tp` warns). Every rank decides alike, from the config.)
        self.expert_parallel = (config.enable_expert_parallel and self.tp_size > 1
                                and registry.entry(model_cfg.architecture).routed_experts(model_cfg) is not None)
        ParallelContext.expert_parallel = self.expert_parallel  # (the models' own split checks read it too)
        self.device = (rank_device(config.device, tp_rank if local_rank is None else local_rank)
                       if self.world_size > 1 else resolve_device(config.device))
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's large temporaries are reused, not page-faulted in afresh
        self.tp_workers: Optional[TensorParallelWorkers] = None
        self._threads_before = 0
        self._affinity_before: Optional[set[int]] = None
        self._warming_up = False
        self.pp: Optional[PipelineLinks] = None
        if self.world_size > 1 and tp_rank == 0:
            local_ranks = layout_of(config).nproc_per_node  # (ValueError for flags that do not fit)
            self._check_tp(local_ranks)
            # On CPU this node's ranks share this process's cores (its affinity, not the machine's: a data-parallel
            # replica's share), each its part; inside a replica each rank is pinned to its own run of them (workers
            # do the same); close() restores the threads and the affinity.
            shares = rank_cpu_shares(local_ranks) if self.device.type == "cpu" else None
            if self.device.type == "cpu":
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(rank_threads(local_ranks, shares[0] if shares else None))
            else:  # NCCL binds each rank to the current device
                torch.cuda.set_device(self.device)
            self.tp_workers = TensorParallelWorkers(config, model_dir, model_cfg, max_model_len, self.device,
                                                    run_tensor_parallel_rank, shares)
            if shares:  # (after the workers started: they would inherit it)
                self._affinity_before = os.sched_getaffinity(0)
                pin(shares[0])
        if self.pp_size > 1:  # (every rank alike, once the process group started)
            self.pp = PipelineLinks.build(tp_rank, self.tp_size, self.pp_size)
        self.drafter: Optional["DraftModel | EagleDrafter"] = None
        # Vision-language models: image features by image, kept across a prompt's chunks (streamer/multimodal/inputs.py)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes)
        try:
            self._build(model_dir)
            if config.drafts_with_model and tp_rank == 0:
                from streamer.spec_decode.draft_model import DraftModel
                from streamer.spec_decode.eagle import EagleDrafter
                self.drafter = (EagleDrafter if self.eagle else DraftModel)(config, self, ModelRunner)
        except BaseException as e:
            failure = self.tp_workers.failure() if self.tp_workers else None
            self.close()  # the workers and the process group go with the engine that failed to start
            if failure:  # a worker's own error says more than the collective that lost it
                raise RuntimeError(failure) from e
            raise

    def _build(self, model_dir: Path) -> None:
        config, model_cfg, max_model_len = self.config, self.model_cfg, self.max_model_len
        # read while the layers are built: the place in the stage, the stage (PipelineLinks.enter)
        ParallelContext.rank, ParallelContext.size = self.tp_rank % self.tp_size, self.tp_size
        ParallelContext.expert_parallel = self.expert_parallel
        if self.pp is not None:
            self.pp.enter()
        else:
            PipelineLinks.leave()
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        self.block_size = config.block_size
        backend_cls = resolve_backend(config.attention_backend, self.device)
        self.attention_backend = backend_cls.name
        if backend_cls.name == "torch":  # its CPU decode kernel is compiled unless the user forbids compiling
            backend_cls = functools.partial(backend_cls, compile=config.enforce_eager is not True)
        if config.quantization == "int8" and self.device.type != "cpu":
            raise ValueError("quantization='int8' runs on CPU only (torch's int8 weight kernel); on a GPU use "
                             "'fp8' or 'int4'")
        torch.manual_seed(config.seed)
        self.model = load_model(model_dir, model_cfg, self.dtype, self.device, backend_cls, max_model_len,
                                config.load_format, config.seed, keep_int4=config.quantization in (None, "int4", "int8"))
        self._use_eagle()
        if hasattr(self.model, "sep_token_id"):  # BERT reads a pair's token types from its separator (models/bert.py)
            from streamer.models.bert import sep_token_id
            self.model.sep_token_id = sep_token_id(model_dir)
            if self.model.sep_token_id is None and model_cfg.raw.get("type_vocab_size", 1) > 1:
                logger.warning("no separator token found in %s: every token is read as type 0 (a pair's second "
                               "text too)", model_dir)
        # LoRA: every adaptable linear gets its adapter slots now, before its weights are packed.
        self.lora_layers = (lora.attach(self.model, config.max_loras + 1, config.max_lora_rank)
                            if config.enable_lora else {})
        # A model's own steps on its loaded float weights, before anything is rounded or packed (DeepSeek: kv_b_proj
        # absorbed into the latent cache's query and output weights)
        post_load = getattr(self.model, "post_load", None)
        if post_load is not None:
            post_load()
        self._use_int4()
        self.fp8 = self._use_fp8()
        if self.fp8:  # (after LoRA, whose slots take the layers' shapes and compute dtype)
            for module in self.model.modules():
                if isinstance(module, PackableLinear):
                    module.quantize_fp8()
            logger.info("linear weights in FP8 (per-channel scales), activations quantized per token")
        self.sampler = Sampler(resolve_sampling_backend(config.sampling_backend, self.device))
        # Hybrid attention + Mamba models: KV caches for the attention layers only, Mamba state slots per request
        self.hybrid = bool(getattr(self.model, "is_hybrid", False))
        self.cross = bool(getattr(self.model, "cross_attention", False))  # an encoder-decoder model (Whisper)
        self.forward = self.model
        self.compiled = self._should_compile()
        # Each batch row's last sampled token, on the device: async scheduling's next step reads its inputs here.
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.kv_dtype = self._kv_dtype()
        self.num_state_slots, self.num_checkpoint_slots = self._num_state_slots()
        # Speculative decoding on a hybrid model: a snapshot slot per request that may verify drafts in one step
        self.num_snapshot_slots = min(config.speculative_max_batch, self.num_state_slots) \
            if self.hybrid and config.num_speculative_tokens else 0
        self.num_blocks = self._num_kv_blocks()
        # One block past the pool's: a scratch block that padding tokens write to and read from (never allocated).
        self.scratch_block = self.num_blocks
        # Each layer's cache in its attention's geometry (DeepSeek's latent cache is one kv head on every rank); a
        # layer without one of its own (a hybrid model's Mamba layers, whose state is in slots: `allocate_state`;
        # Gemma 4's KV-shared layers; every layer of a pure Mamba2 model) gets an empty placeholder.
        self.kv_caches = [torch.zeros((2, self.num_blocks + 1, self.block_size, *g) if g else (0,),
                                      dtype=self.kv_dtype, device=self.device)
                          for g in kv_cache_geometry(self.model)]
        if self.hybrid:  # one slot past the pool's: the warm-up steps' scratch slot; then the checkpoints', snapshots'
            self.model.allocate_state(self.num_state_slots + 1 + self.num_checkpoint_slots + self.num_snapshot_slots,
                                      self.dtype, self.device)
            logger.info("%s: %d slots (and %d checkpoints, %d snapshots) of %.1f MiB", self._state_name(),
                        self.num_state_slots, self.num_checkpoint_slots, self.num_snapshot_slots,
                        self.model.state_bytes_per_slot(self.dtype) / 2 ** 20)
        logger.info("KV cache: %d blocks = %d tokens (block_size %d, %s, %s)", self.num_blocks,
                    self.num_blocks * self.block_size, self.block_size, str(self.kv_dtype).replace("torch.", ""),
                    self.device)
        if self._cpu_packing() and not self.model.bidirectional and getattr(self.model, "pp_first", True):
            # (an encoder only pools: no LM head to run; a later pipeline stage has none)
            self.model.pack_head_for_cpu()
        self.graphs: Optional[DecodeGraphs] = None
        if self.tp_workers is not None:
            self.tp_workers.wait_ready()
        self._set_up_forward()
        if self._use_cuda_graphs():
            self.enable_decode_graphs(capture_sizes(min(config.cuda_graph_max_batch, config.max_num_seqs)))

    def _use_eagle(self) -> None:
        """With an EAGLE head for a draft model: the target's forward also returns the features it reads (EAGLE-3:
        three layers' input streams; EAGLE-1 reads the final hidden states), before anything is compiled."""
        from streamer.spec_decode.eagle import check_target, is_eagle_checkpoint, target_aux_layers
        self.eagle = self.config.speculative_method == "mtp"  # (the head reads the final hidden states)
        path = self.config.speculative_model
        if path is None:
            return
        path = Path(path).expanduser()
        if path.is_dir() and (path / "config.json").is_file() and is_eagle_checkpoint(path):
            self.eagle = True
            check_target(self.model, self.model_cfg.architecture)
            self.model.aux_layers = target_aux_layers(path, self.model_cfg)

    def _split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's (final hidden states, the EAGLE head's features): see `_use_eagle`."""
        if not self.model.aux_layers:
            return out, out
        width = self.model_cfg.hidden_size
        return out[:, :width], out[:, width:]

    def _set_up_forward(self) -> None:
        """Compile (or not), then warm up: warm-up steps compile every graph, and a compilation that fails
        there turns the model eager (`_run_model`). A tensor-parallel worker compiles as rank 0 does and runs
        the warm-up steps rank 0 sends it."""
        for module in self.model.modules():  # (an opaque op compiled or not: the GPU's grouped GEMMs either way)
            if isinstance(module, SparseMoE):
                module.fused_kernel = self.attention_backend == "triton"
        # Set when the model's compiled graphs are all ready (at once unless it compiles in the background).
        self.compile_done = threading.Event()
        background = self.compiled and self._compiles_in_background()
        if background:  # serve eagerly now, on the compiled path's layers (their ops run eagerly too)
            self._prepare_compiled_path()
            self.compiled = False
            hold_compiles()  # (the eager warm-up below compiles no kernel: the background thread will)
        elif self.compiled:
            self.forward = self._compile()
        else:
            self._use_eager()
        if self.tp_rank == 0:
            self._warming_up = True
            try:
                self.warmup()
            except BaseException:
                if background:  # (no thread will claim the hold)
                    release_compiles()
                raise
            finally:
                self._warming_up = False
        if background:
            threading.Thread(target=self._compile_in_background, name="streamer-compile", daemon=True).start()
        else:
            self.compile_done.set()

    def _compiles_in_background(self) -> bool:
        """CPU serving (`compile_in_background`): answer at once, eagerly, while a thread compiles the model (a cold
        compile is ~1 min on a 2-core box), then switch. Not for what has more than the plain model's graphs to
        build or keep in step (tensor-parallel ranks, hybrid and encoder-decoder models, quantized weights, a
        draft model)."""
        c = self.config
        return (c.compile_in_background and self.device.type == "cpu" and self.world_size == 1 and not self.hybrid
                and not self.cross and c.quantization is None and not self.fp8 and not c.speculative_model
                and not c.num_speculative_tokens)

    def _compile_in_background(self) -> None:
        """The model compiled and its warm-up shapes run through it, on the scratch block, beside the device
        thread's eager steps; then the device thread's next step runs compiled. A failure leaves it eager."""
        import time

        import torch._inductor.config as inductor_config
        claim_compiles()
        t = time.perf_counter()
        # Tracing and code generation hold the GIL for long stretches, and each torch op of the device thread's
        # eager step waits up to the switch interval to get it back: 5 ms by default, ~seconds a step.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.0002))
        try:
            compiled = torch.compile(self.model, dynamic=True, fullgraph=True)
            with torch.inference_mode(), inductor_config.patch(freezing=False):
                shapes = self._warmup_shapes()
                for i, (q_lens, seq_lens) in enumerate(shapes):
                    logger.info("compiling in the background (serving eagerly meanwhile): shape %d of %d, %.0f s",
                                i + 1, len(shapes), time.perf_counter() - t)
                    step = self._scratch_step(q_lens, seq_lens)
                    healing(lambda: self._forward_with(compiled, step, compiled=True), "torch.compile")
        except Exception as e:
            logger.warning("background compile failed (%s: %s); serving eagerly", type(e).__name__,
                           str(e).splitlines()[0] if str(e) else "")
            return
        finally:
            sys.setswitchinterval(switch)
            release_compiles()
        self.forward = compiled  # (before `compiled`: a step that reads the flag then runs the graph)
        self.compiled = True
        logger.info("compiled in the background in %.1f s: serving compiled", time.perf_counter() - t)
        self.compile_done.set()

    def _use_eager(self) -> None:
        self.compiled, self.forward = False, self.model
        self.model.use_kernels(self.attention_backend == "triton")
        for attn in attention_layers(self.model):
            attn.use_op = False
        packing = self._cpu_packing()
        for module in self.model.modules():
            if isinstance(module, PackableLinear):
                module.op_id = None  # a direct call: the op only exists for the compiler's sake
                module.lora_op = False
                if packing and module.packed is None:
                    module.pack_for_cpu()
            elif isinstance(module, SparseMoE) and packing and not module.fused_kernel:  # (their own packed op)
                module.pack_for_cpu()

    # ------------------------------------------------------------------ set-up
    def _check_tp(self, local_ranks: int) -> None:
        tp = self.tp_size
        model = registry.entry(self.model_cfg.architecture)
        if model.no_tensor_parallel and tp > 1:
            raise ValueError(f"{model.architecture} does not support tensor parallelism: {model.no_tensor_parallel}")
        if self.device.type == "cuda" and local_ranks > torch.cuda.device_count():
            raise ValueError(f"{local_ranks} tensor-parallel ranks on this node need {local_ranks} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        if self.config.enable_expert_parallel and not model.check_expert_parallel(self.model_cfg, tp):
            logger.warning("%s is not a mixture of experts: enable_expert_parallel is ignored (every layer is "
                           "tensor-parallel), as vLLM ignores it", model.architecture)
        # (the registry entry's rule: the attention heads, or the model's own check, hybrids' recurrent layers too)
        if tp > 1:
            model.check_tensor_parallel(self.model_cfg, tp)
        if self.pp_size > 1:
            model.check_pipeline_parallel(self.model_cfg, self.pp_size)

    def _use_cuda_graphs(self) -> bool:
        # The Triton backend reads every per-step value from device memory; the torch backend plans on the host.
        # (Tensor-parallel workers would have to replay the same graphs: not yet.)
        return (self.device.type == "cuda" and self.attention_backend == "triton" and self.world_size == 1
                and not self.cross and self.config.enforce_eager is not True and self.config.cuda_graph_max_batch > 0)

    def enable_decode_graphs(self, sizes: list[int], capture: bool = True) -> None:
        """Decode-only steps of up to max(sizes) requests replay captured graphs (`capture=False`: the same
        persistent buffers and fixed metadata, called without a graph, to check the logic on a CPU)."""
        import time
        t = time.perf_counter()
        self.graphs = DecodeGraphs(self.forward, self.kv_caches, sizes, self.max_blocks_per_req, self.block_size,
                                   self.scratch_block, self.max_model_len, self.device, capture,
                                   lora=bool(self.lora_layers),
                                   state_scratch=self.num_state_slots if self.hybrid else None)
        self.graphs.capture()
        logger.info("%s decode steps of %d batch sizes (up to %d) in %.1f s",
                    "captured CUDA graphs for" if capture else "set up graph buffers for", len(sizes), max(sizes),
                    time.perf_counter() - t)

    def _use_int4(self) -> None:
        """Pack a 4-/8-bit checkpoint's linears for the int4 / int8 kernels; with quantization="int4" ("int8"),
        round every other linear's weight first (and, for int4, every sparse MLP's experts)."""
        linears = [m for m in self.model.modules() if isinstance(m, (PackableLinear, SparseMoE))]
        for m in linears:
            if m.compute_dtype is not None:
                m.finish_int4()
        q = self.config.quantization
        if q in ("int4", "int8"):
            for m in linears:
                if isinstance(m, PackableLinear):
                    m.quantize_int4(bits=int(q[3:]))
                elif q == "int4":
                    m.quantize_int4()
        weights = [w for m in linears for w in (
            ([m.qweight] if m.qweight else []) if isinstance(m, PackableLinear) else
            ([*m.int4[0], *m.int4[1]] if m.int4 else []))]
        compile = self.config.enforce_eager is not True  # (as the CPU decode kernel: prefill's dequantization)
        for w in weights:
            w.compile = compile
        n = sum((m.qweight if isinstance(m, PackableLinear) else m.int4) is not None for m in linears)
        if n:
            logger.info("%d of %d linear layers (sparse MLPs counted as one) compute with 4- or 8-bit weights",
                        n, len(linears))

    def _use_fp8(self) -> bool:
        q = self.config.quantization
        if q == "fp8" and self.device.type == "cuda" and not fp8_supported(self.device):
            raise ValueError("quantization='fp8' needs a GPU with row-wise scaled FP8 matmuls (compute capability "
                             f"9.0+); this one is {torch.cuda.get_device_capability(self.device)}")
        if q is not None:
            return q == "fp8"
        # FP8 checkpoints compute in FP8 where the GPU can; MXFP4 ones (gpt-oss's experts) are dequantized, and
        # their bf16 attention weights stay bf16.
        qc = self.model_cfg.quantization
        return (qc is not None and qc.get("quant_method") in ("fp8", "compressed-tensors")
                and parse_int_quant(qc) is None and fp8_supported(self.device))

    def _cpu_packing(self) -> bool:
        return self.device.type == "cpu" and self.config.cpu_weight_packing and cpu_packing_supported(self.dtype)

    def _should_compile(self) -> bool:
        # A hybrid model's recurrent layers loop over the step's prefill chunks in Python: only its lone decode
        # steps run compiled (`_decode_inputs`), so only where that graph exists (the torch attention backend).
        # An encoder-decoder model runs eagerly, always.
        if self.cross or (self.hybrid and self.attention_backend != "torch"):
            if self.config.enforce_eager is False:
                logger.info("%s: running eagerly (enforce_eager=False ignored)", "encoder-decoder model" if self.cross
                            else "hybrid model on the Triton attention backend")
            return False
        if self.config.enforce_eager is not None:
            return not self.config.enforce_eager
        return self.device.type == "cuda"

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every graph the engine will need before serving, so no request pays for compilation: the model's
        (1 token, then a dynamic token dimension; decode-only steps) and the CPU decode attention's (a lone
        request, a batch)."""
        import time

        import torch._inductor.config as inductor_config
        t = time.perf_counter()
        # No freezing: on CPU the linears are opaque ops over oneDNN-prepacked weights (`_compile`), so no weight is
        # a graph constant and Inductor's on-disk caches serve a second start (freezing made it skip them).
        with inductor_config.patch(freezing=False):
            self._warmup_steps()
        logger.info("%s in %.1f s", "compiled and warmed up" if self.compiled else "warmed up",
                    time.perf_counter() - t)

    def _warmup_steps(self) -> None:
        for q_lens, seq_lens in self._warmup_shapes():
            self._run_model(self._scratch_step(q_lens, seq_lens))

    def _warmup_shapes(self) -> list[tuple[list[int], list[int]]]:
        """(query tokens per request, context length per request): a lone request's decode (inline in the model's
        graph), a decode batch and prefill chunks (the general graph; decode rows go through the separately
        compiled kernel: a lone one, split across threads, and a batch). Sizes are pairwise distinct (3 requests,
        5 blocks, ...): Dynamo would otherwise assume that sizes equal at tracing time stay equal, and recompile
        when they are not."""
        bs = self.block_size
        return [([1], [10 * bs]), ([1, 1, 1], [1, 5 * bs, 1]), ([16], [16]), ([16, 1], [16, 10 * bs])]

    def _scratch_step(self, q_lens: list[int], seq_lens: list[int]) -> StepInputs:
        """A step of rows computing q_lens[i] tokens with seq_lens[i] tokens of context (capped at max_model_len),
        every KV write and read on the scratch block: no request's cache is touched."""
        bs, cap = self.block_size, self.max_model_len
        q_lens = [min(n, cap) for n in q_lens]
        seq_lens = [min(max(s, q), cap) for s, q in zip(seq_lens, q_lens)]
        if self.model.bidirectional:  # an encoder's steps hold whole prompts only: no context before them
            seq_lens = q_lens
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
        lens = np.array(seq_lens, dtype=np.int64)
        n = int(qsl[-1])
        positions = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]).astype(np.int64)
        scratch = self.scratch_block
        slots = scratch * bs + positions % bs
        table = np.full((len(q_lens), cdiv(int(lens.max()), bs)), scratch, dtype=np.int32)
        zeros = np.zeros(len(q_lens), dtype=np.int64)
        return StepInputs(req_ids=[""] * len(q_lens), rows=zeros, epochs=zeros,
                          input_ids=np.zeros(n, dtype=np.int64), positions=positions, query_start_loc=qsl,
                          seq_lens=lens, block_table=table, slot_mapping=slots,
                          sample_idx=np.zeros(0, dtype=np.int64), sampling=None)  # type: ignore[arg-type]

    @torch.inference_mode()
    def profile_steps(self, max_tokens: int, max_seconds: float = 0.25) -> list[tuple[StepShape, float]]:
        """Forward passes timed for the step-time model's first fit (streamer/core/step_time.py): a lone decode, decode
        batches, and lone prompt chunks of 16, 64, 256, ... tokens up to `max_tokens`, stopping after one that takes
        over `max_seconds` (a big model on a CPU). Each shape runs twice and keeps the faster time (the first may
        pay for a new shape's kernels). Warm-up steps only: no request's cache is touched; decode graphs are set
        aside meanwhile (their persistent inputs belong to real steps), so decode rows are timed eager, a little
        slow, which the live fit soon corrects."""
        graphs, self.graphs = self.graphs, None
        try:
            return self._profile_steps(max_tokens, max_seconds)
        finally:
            self.graphs = graphs

    def _profile_steps(self, max_tokens: int, max_seconds: float) -> list[tuple[StepShape, float]]:
        import time
        cap = self.max_model_len
        shapes: list[tuple[list[int], list[int]]] = [([1], [min(256, cap)]), ([1] * 8, [min(64, cap)] * 8),
                                                     ([1] * 8, [min(512, cap)] * 8)]
        n = 16
        while n <= min(max_tokens, cap):
            shapes.append(([n], [n]))
            n *= 4
        points = []
        for q_lens, seq_lens in shapes:
            step = self._scratch_step(q_lens, seq_lens)
            best = float("inf")
            for _ in range(2):
                t = time.perf_counter()
                self._run_model(step)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                best = min(best, time.perf_counter() - t)
            q = np.diff(step.query_start_loc)
            points.append((shape_of(list(zip((step.seq_lens - q).tolist(), q.tolist()))), best))
            if best > max_seconds and len(q_lens) == 1 and q_lens[0] > 1:
                break
        return points

    def _compile(self):
        """torch.compile the whole model with attention as an opaque custom op and a dynamic token dimension;
        a lone request's decode on the torch backend attends inside the graph instead (see `_decode_inputs`)."""
        self._prepare_compiled_path()
        return torch.compile(self.model, dynamic=True, fullgraph=True)

    def _prepare_compiled_path(self) -> None:
        """The layers as the compiled model has them: attention and (on CPU) the linears as opaque ops."""
        for attn in attention_layers(self.model):
            attn.use_op = True
        packing = self._cpu_packing()
        for module in self.model.modules():
            # CPU: the linears run on oneDNN-prepacked weights through an opaque op. Inductor can only use packed
            # weights by freezing the graph (weights as constants), and a frozen graph never goes in its on-disk
            # cache: a second start took as long as the first (~50 s for the 90M model; now ~14 s), for the
            # same decode speed (bench/RESULTS.md, 2026-11-30 session 4). 4-bit weights go through the op too:
            # their kernel depends on the number of rows, which must not become a guard of the graph (8-bit too).
            if isinstance(module, PackableLinear) and (packing or module.qweight is not None
                                                       and self.device.type == "cpu"):
                module.pack_for_cpu(as_op=True)
            elif isinstance(module, SparseMoE) and packing and not module.fused_kernel:  # (an opaque op already)
                module.pack_for_cpu()
        for module in self.model.modules():  # (a packed layer's op adds its LoRA output itself)
            if isinstance(module, PackableLinear) and module.op_id is None:
                module.lora_op = True
        # Two graphs per engine (a lone decode, everything else), and the cache is per code object: a process
        # that builds several engines (tests, benchmarks) outgrows the default limit of 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def _kv_dtype(self) -> torch.dtype:
        if self.config.kv_cache_dtype == "auto":
            return self.dtype
        if (self.attention_backend == "triton" and self.device.type == "cuda"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError("kv_cache_dtype='fp8' with the Triton attention backend needs a GPU with FP8 "
                             f"conversions (compute capability 8.9+); this one is "
                             f"{torch.cuda.get_device_capability(self.device)}")
        self._set_kv_scales()
        return FP8_KV_DTYPE

    def _set_kv_scales(self) -> None:
        """Each layer's FP8 cache scales on its backend: the checkpoint's calibrated ones, else 1.0."""
        scales = self.model.kv_scales
        for layer, (k_scale, v_scale) in zip(self.model.layers, scales or []):
            if getattr(layer, "self_attn", None) is not None:
                layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale = k_scale, v_scale
        logger.info("FP8 KV cache (float8_e4m3fn), %s", "the checkpoint's k/v scales" if scales else
                    "scales 1.0 (the checkpoint has no calibrated k_scale / v_scale)")

    def kv_bytes_per_block(self) -> int:
        # (a model without attention layers, Mamba2, stores no KV)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(2 * self.block_size * heads * dim * elem for heads, dim in filter(None, kv_cache_geometry(self.model)))

    def _num_state_slots(self) -> tuple[int, int]:
        """A hybrid model's Mamba state slots, one per running sequence (max_num_seqs), and with prefix caching its
        state checkpoints' (`state_checkpoints`, default as many again), all within half the memory budget. Where
        that half is short, the checkpoints get a fifth of it and the sequences the rest (their slots then bound
        how many sequences run at once)."""
        if not self.hybrid:
            return 0, 0
        n, checkpoints = self.config.max_num_seqs, self.config.state_checkpoints
        # (an encoder-decoder model's state depends on its audio, not on a token prefix: nothing to checkpoint)
        caching = self.config.enable_prefix_caching and getattr(self.model, "checkpointable_state", True)
        if not caching:
            checkpoints = 0
        if self.config.num_kv_blocks is not None:  # (tests and benchmarks: exact sizes, no budget)
            return n, n if checkpoints is None else checkpoints
        per_slot = self.model.state_bytes_per_slot(self.dtype)
        total = max(self._memory_budget() // (2 if attention_layers(self.model) else 1) // per_slot, 1)
        if checkpoints is None:
            checkpoints = n if 2 * n <= total else total // 5
        if n + checkpoints > total:
            checkpoints = min(checkpoints, total - 1)
            n = total - checkpoints
            logger.warning("%s for max_num_seqs=%d sequences (%.1f MiB each) exceeds half the memory "
                           "budget: %d slots, so at most %d sequences run at once", self._state_name(),
                           self.config.max_num_seqs, per_slot / 2 ** 20, n, n)
        if self.world_size > 1:  # every rank must hold the same slots: the smallest budget decides
            counts = torch.tensor([n, checkpoints], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MIN)
            n, checkpoints = (int(c) for c in counts.tolist())
        if caching and not checkpoints:
            logger.warning("no memory left for Mamba state checkpoints: prefix caching is off")
        return int(n), int(checkpoints)

    def _state_name(self) -> str:
        return "cross-attention K/V" if getattr(self.model, "cross_attention", False) else "Mamba state"

    def _memory_budget(self) -> int:
        """Bytes for the KV cache (and a hybrid model's Mamba state)."""
        if self.config.kv_cache_memory is not None:  # an explicit size wins on every device
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Leave room for activations of the largest step: a few hidden-size buffers per token plus logits.
            act = self.config.max_num_batched_tokens * (self.model_cfg.hidden_size * 16
                                                        + self.model_cfg.intermediate_size * 6)
            act += self.config.max_num_seqs * self.model_cfg.vocab_size * 8 + self._encoder_bytes()
            return int(total * self.config.gpu_memory_utilization) - used - act
        return _CPU_KV_DEFAULT

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        budget = self._memory_budget()
        if self.hybrid:  # the Mamba state comes out of the same budget
            budget -= (self.num_state_slots + self.num_checkpoint_slots + self.num_snapshot_slots) \
                * self.model.state_bytes_per_slot(self.dtype)
        # More blocks than every sequence slot can fill would only waste memory.
        useful = self.config.max_num_seqs * self.max_blocks_per_req
        # (no KV per block, a model without attention layers: as many as the sequences can fill, up to 256K)
        n = min(budget // per_block, useful) if per_block else min(useful, 1 << 18)
        if self.world_size > 1:  # every rank must hold the same blocks: the smallest budget decides
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            n = int(t.item())
        if n < self.max_blocks_per_req and n < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) does not hold a single block of {per_block} bytes")
        return max(int(n), 1)

    def _encoder_bytes(self) -> int:
        """Vision- and audio-language models: the encoder cache's budget, plus the encoder's activations for the most
        images one step can touch (its token budget's worth, and one more cut by a chunk boundary)."""
        from streamer.models.vlm import VisionLanguageMixin
        if getattr(self.model, "cross_attention", False):  # (Whisper: encoder outputs by audio, `encoded_audio`)
            return self.config.encoder_cache_bytes + self.model.encoder_bytes(self.config.max_num_batched_tokens)
        if not isinstance(self.model, VisionLanguageMixin):
            return 0
        return self.config.encoder_cache_bytes + self.model.encoder_bytes(self.config.max_num_batched_tokens)

    # ------------------------------------------------------------------ one step
    def _metadata(self, step: StepInputs) -> AttentionMetadata:
        dev = self.device
        limit = window = None
        if self.model.bidirectional:  # an encoder's prompts are whole in the step: each token sees all of its own
            limit = np.repeat(step.seq_lens.astype(np.int32) - 1, np.diff(step.query_start_loc))
            if self.model.two_sided_window:  # (its local layers: as far ahead as their window reaches)
                window = np.minimum(limit, step.positions + self.model.two_sided_window - 1).astype(np.int32)
        elif step.images is not None and self.model.bidirectional_images:
            limit = step.positions.astype(np.int32)  # each image token sees up to its image's end
            limit[step.images.token_idx] = step.images.last_pos
        return AttentionMetadata(
            num_reqs=step.num_reqs, num_tokens=step.num_tokens,
            query_start_loc=to_device(step.query_start_loc.astype(np.int32), dev),
            seq_lens=to_device(step.seq_lens.astype(np.int32), dev),
            block_table=to_device(step.block_table, dev), slot_mapping=to_device(step.slot_mapping, dev),
            max_query_len=int(np.diff(step.query_start_loc).max()), max_seq_len=int(step.seq_lens.max()),
            query_start_loc_cpu=step.query_start_loc, seq_lens_cpu=step.seq_lens,
            causal_limit=None if limit is None else to_device(limit, dev), causal_limit_cpu=limit,
            window_limit=None if window is None else to_device(window, dev), window_limit_cpu=window,
            mamba=self._mamba_step(step) if self.hybrid and not self.cross else None,
            cross=self._cross_step(step) if self.cross else None,
            position_bias=self.model.position_bias_table() if self.model.relative_bias else None)

    def _mamba_step(self, step: StepInputs) -> MambaStep:
        """What the Mamba layers need of the step: each request's state slot (the warm-up steps': the scratch
        slot), which start fresh (at position 0: one resumed from a prefix-cache checkpoint starts past it, its
        state restored by a copy), the one-token requests and the prefill chunks."""
        qsl, dev = step.query_start_loc, self.device
        slots = self._state_slots(step)
        first = qsl[:-1]
        fresh = np.flatnonzero(step.positions[first] == 0)
        q_lens = np.diff(qsl)
        one = np.flatnonzero(q_lens == 1)
        many = np.flatnonzero(q_lens > 1)
        span = _dense_span(slots[one])
        pos = slots[one] - span[0] if span else None
        if pos is not None and len(pos) == span[1] - span[0] and (pos == np.arange(len(pos))).all():
            pos = None  # (the rows are the span's, in order: inputs and outputs need no laying out)
        return MambaStep(
            fresh_slots=to_device(slots[fresh].astype(np.int64), dev) if len(fresh) else None,
            decode_tokens=to_device(first[one].astype(np.int64), dev) if len(one) else None,
            decode_slots=to_device(slots[one].astype(np.int64), dev) if len(one) else None,
            decode_span=span, decode_pos=to_device(pos, dev) if pos is not None else None,
            prefills=_chunks(slots, qsl, many), **self._prefill_batch(slots, qsl, many),
            copies=tuple(self._slot_pairs(pairs) for pairs in step.state_copies or () if pairs))

    def _cross_step(self, step: StepInputs) -> CrossStep:
        """What an encoder-decoder model's cross-attention needs of the step: each request's query rows and state
        slot, and the encoder inputs of those computing their first token (the warm-up steps': silence)."""
        qsl, dev = step.query_start_loc, self.device
        n = step.num_reqs
        slots = step.state_slots if step.state_slots is not None else np.full(n, self.num_state_slots, np.int64)
        if (slots < 0).any():
            raise RuntimeError("a request of an encoder-decoder model has no state slot")
        rows, valid = cross_rows(np.diff(qsl))
        fresh = np.flatnonzero(step.positions[qsl[:-1]] == 0)
        encoded = None
        if len(fresh):
            given = step.encoder_inputs
            if given is None:  # (warm-up: silence, never cached)
                encoded = self.model.encode(torch.stack([self.model.silence()] * len(fresh)).to(dev))
            elif len(given) != len(fresh):
                raise RuntimeError(f"{len(fresh)} requests start this step but {len(given)} encoder inputs came")
            else:
                encoded = torch.stack(self.encoded_audio(given))
        # (a request whose slot is reused while another keeps it would be a pool bug; the span is for speed only)
        span = _dense_span(slots, fewest=1)  # (a lone request's slot too: a view, not a 1500-position gather)
        return CrossStep(rows=to_device(rows, dev), valid=None if valid is None else to_device(valid, dev),
                         slots=to_device(slots.astype(np.int64), dev), span=span,
                         span_pos=to_device(slots - span[0], dev) if span else None,
                         fresh_slots=to_device(slots[fresh].astype(np.int64), dev) if len(fresh) else None,
                         encoded=encoded)

    def encoded_audio(self, inputs: list[Any]) -> list[torch.Tensor]:
        """An encoder-decoder model's encoder output [positions, width] for each input (speech.SpeechInput), from
        the encoder cache by the input's key where it is there, else encoded now (each distinct input once) and
        kept: language detection, the temperature fallback's retries, the no-speech probe and word timestamps read
        the same audio as the transcription does, and a preempted request reads it again."""
        cache = self.encoder_cache
        found = {x.key: cache.get(x.key) for x in inputs}
        missing = {x.key: x for x in inputs if found[x.key] is None}
        if missing:
            features = torch.stack([x.features for x in missing.values()]).to(self.device, non_blocking=True)
            for key, out in zip(missing, self.model.encode(features)):
                found[key] = out
                cache.put(key, out)
        return [found[x.key] for x in inputs]  # type: ignore[misc]

    def _prefill_batch(self, slots: np.ndarray, qsl: np.ndarray, many: np.ndarray) -> dict[str, Any]:
        """MambaStep's `prefill_batch` (the chunks of at most _BATCHED_CHUNK tokens, where there are several:
        padding them to the longest costs little next to one call per chunk and layer) and `long_prefills`."""
        lens = qsl[many + 1] - qsl[many]
        short = lens <= _BATCHED_CHUNK
        if short.sum() < 2:
            return dict(long_prefills=_chunks(slots, qsl, many))
        rows, lens = many[short], lens[short]
        pos = np.minimum(np.arange(lens.max()), lens[:, None] - 1)  # (past a chunk's end: its last token again)
        dev = self.device
        batch = PrefillBatch(rows=to_device((qsl[rows][:, None] + pos).astype(np.int64), dev),
                             valid=to_device(np.arange(lens.max()) < lens[:, None], dev),
                             lens=to_device(lens.astype(np.int64), dev),
                             slots=to_device(slots[rows].astype(np.int64), dev))
        return dict(prefill_batch=batch,
                    long_prefills=_chunks(slots, qsl, many[~short]))

    def _slot_pairs(self, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """[(from slot, to slot)] -> int64 [2, N] on the device."""
        return to_device(np.asarray(pairs, dtype=np.int64).T.copy(), self.device)

    def _sampling_batch(self, rows: SamplingRows) -> SamplingBatch:
        n = len(rows.temperature)
        dev = self.device
        temps = rows.temperature
        gens: list[Optional[torch.Generator]] = [None] * n
        for i, req in rows.seeded:
            gens[i] = self._generator(req)
        top_k = top_p = min_p = None
        use_k, use_p = rows.top_k > 0, rows.top_p < 1.0
        if use_k.any():
            top_k = to_device(np.where(use_k, rows.top_k, self.model_cfg.vocab_size), dev)
        if use_p.any():
            top_p = to_device(rows.top_p, dev)
        if (rows.min_p > 0.0).any():
            min_p = to_device(rows.min_p, dev)
        penalties = None
        if rows.penalized:
            idx = [i for i, _ in rows.penalized]
            penalties = build_penalties([r for _, r in rows.penalized], idx, n, self.model_cfg.vocab_size, dev)
        adjust = None
        if rows.adjusted:
            idx = to_device(np.array([i for i, _ in rows.adjusted], dtype=np.int64), dev)
            adjust = (idx, torch.stack([self._logit_adjust(r) for _, r in rows.adjusted]))
        grammar = None
        if rows.grammar is not None:
            grammar = (to_device(rows.grammar[0], dev), to_device(rows.grammar[1], dev))
        return SamplingBatch(
            temperature=to_device(temps, dev), top_k=top_k, top_p=top_p, min_p=min_p, generators=gens,
            all_greedy=not temps.any(), any_seeded=bool(rows.seeded), banned=self._banned(rows.banned, rows.worded),
            penalties=penalties, max_logprobs=rows.max_logprobs, adjust=adjust,
            grammar=grammar, forced=self._forced(rows.thinking), speech=self._speech_masks(rows.speech))

    def _logit_adjust(self, req: Request) -> torch.Tensor:
        """The request's logit_bias / allowed_token_ids as one row added to its logits (built once)."""
        if req.logit_adjust is None:
            p, vocab = req.params, self.model_cfg.vocab_size
            row = torch.zeros(vocab)
            if p.allowed_token_ids is not None:
                row.fill_(float("-inf"))
                row[torch.tensor(p.allowed_token_ids, dtype=torch.int64)] = 0.0
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
                row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            req.logit_adjust = to_device(row, self.device)
        return req.logit_adjust  # type: ignore[return-value]

    def _banned(self, banned: list[tuple[int, Request]], worded: list[tuple[int, Request]],
                ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """min_tokens: the stop tokens (eos unless ignored, stop_token_ids) of rows still short of it; bad_words:
        the tokens that would complete one of the row's words (its output so far is known: the engine does not
        schedule ahead of such rows)."""
        rows: list[int] = []
        ids: list[int] = []
        for i, r in banned:
            stop_ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
            stop_ids = sorted(t for t in stop_ids if t < self.model_cfg.vocab_size)
            rows += [i] * len(stop_ids)
            ids += stop_ids
        for i, r in worded:
            bans = bad_word_bans(r.bad_words_ids, r.output_token_ids)  # type: ignore[arg-type]
            rows += [i] * len(bans)
            ids += bans
        if not rows:
            return None
        return (to_device(np.array(rows, dtype=np.int64), self.device),
                to_device(np.array(ids, dtype=np.int64), self.device))

    def _speech_masks(self, speech: list[tuple[int, Request]]) -> Optional[SpeechMasks]:
        """Whisper's decoding rules for its rows (the engine does not schedule ahead of such rows, so their output
        so far is known)."""
        if not speech:
            return None
        vocab = self.model_cfg.vocab_size
        owners, lo, hi = [], [], []
        for i, r in speech:
            for a, b in r.speech_rules.bans(r.output_token_ids, vocab):  # type: ignore[union-attr]
                owners.append(i)
                lo.append(a)
                hi.append(b)
        stamped = [i for i, r in speech if r.speech_rules.timestamps]  # type: ignore[union-attr]
        dev = self.device
        ids = lambda xs: to_device(np.array(xs, dtype=np.int64), dev)  # noqa: E731
        return SpeechMasks(ids(stamped), ids(owners), ids(lo), ids(hi),
                           speech[0][1].speech_rules.timestamp_begin)  # type: ignore[union-attr]

    def _forced(self, thinking: list[tuple[int, Request]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Rows whose thinking_token_budget is spent: the closing tag's next token (the engine does not schedule
        ahead of such rows, so their output so far is known)."""
        pairs = [(i, t) for i, r in thinking for t in [r.think.forced(r.output_token_ids)]  # type: ignore
                 if t is not None]
        if not pairs:
            return None
        return (to_device(np.array([i for i, _ in pairs], dtype=np.int64), self.device),
                to_device(np.array([t for _, t in pairs], dtype=np.int64), self.device))

    def _generator(self, req: Request) -> torch.Generator:
        gen = req.generator
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            req.generator = gen
        return gen  # type: ignore[return-value]

    def _decode_inputs(self, step: StepInputs) -> Optional[DecodeBatch]:
        return self._decode_batch(step, self.compiled)

    def _decode_batch(self, step: StepInputs, compiled: bool) -> Optional[DecodeBatch]:
        """A lone request's decode step, for a compiled model that attends inline (torch backend): the attention
        metadata become graph inputs, so there is no per-layer op call, Python or guard check, and the decode maths
        fuses with the model's (single stream: 63 -> ~88 tok/s on the 90M bench model). Its context is split
        across the threads. Batches go through the general graph: its per-layer op call (~0.3 ms) is small next
        to a batch's step, and one more decode graph would add a minute of compile time on the 2-core box."""
        if not (compiled and self.attention_backend == "torch") or step.num_tokens != 1:
            return None
        dev = self.device
        state_slots = None
        if self.hybrid:  # (only this step is compiled; its recurrent layers step inline too)
            slots = self._state_slots(step)
            self._prepare_states(step, slots)
            state_slots = to_device(slots, dev)
        splits = thread_splits()
        table = decode_table(step.block_table, step.seq_lens, self.block_size, splits)
        slots = step.slot_mapping
        half = (self.num_blocks + 1) * self.block_size  # key slots (scratch block included); values follow
        return DecodeBatch(to_device(np.concatenate([slots, slots + half]), dev), to_device(table, dev),
                           to_device(step.seq_lens, dev), splits,
                           self.model.position_bias_table() if self.model.relative_bias else None, state_slots)

    def _state_slots(self, step: StepInputs) -> np.ndarray:
        """A hybrid model's step: each request's state slot, int64 (the warm-up steps': the scratch slot)."""
        slots = step.state_slots if step.state_slots is not None else np.full(step.num_reqs, self.num_state_slots)
        if (slots < 0).any():
            raise RuntimeError("a request of a hybrid model has no Mamba state slot")
        return slots.astype(np.int64)

    def _prepare_states(self, step: StepInputs, slots: np.ndarray) -> None:
        """A decode-only step of a hybrid model that runs as a graph (compiled or captured): its state copies made
        and its fresh slots zeroed now, eagerly (the graph's layers do neither: `MambaStep.decoding`)."""
        fresh = slots[step.positions[step.query_start_loc[:-1]] == 0]
        copies = [pairs for pairs in step.state_copies or () if pairs]  # (prefix caching's checkpoints)
        if copies or len(fresh):  # (fresh: 1-token prompts)
            self.model.prepare_states([self._slot_pairs(pairs) for pairs in copies],
                                      to_device(fresh, self.device) if len(fresh) else None)

    def _input_ids(self, step: StepInputs, drafts: Optional[torch.Tensor]) -> torch.Tensor:
        input_ids = to_device(step.input_ids, self.device)
        if len(step.pending_idx):  # tokens the previous step sampled: read on the device, no host round trip
            idx = to_device(step.pending_idx, self.device)
            rows = to_device(step.pending_rows, self.device)
            input_ids[idx] = self.last_tokens[rows]
        if drafts is not None:  # the draft model's proposals, in place of the step's placeholders
            plan, dev = step.draft, self.device
            input_ids[to_device(plan.target_idx, dev)] = drafts.view(-1)[to_device(plan.source_idx, dev)]
        return input_ids

    def _run_model(self, step: StepInputs, drafts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's final hidden states (on rank 0 of several pipeline stages: once they came back, perhaps only the
        sampled rows: `_rows_back`); on another rank its stage's output."""
        out = self._run_stage(step, drafts)
        if self.pp is not None and self.tp_rank == 0:
            out = self._pipeline_result(step)[0]
        return out

    @staticmethod
    def _rows_back(step: StepInputs) -> Optional[np.ndarray]:
        """With pipeline stages, the rows of the final hidden states that come back to rank 0: only the sampled
        tokens' (a prefill chunk's thousands of rows are not sent for its one), unless the step scores prompt
        tokens or pools (None: every row). At least one row: gloo sends no empty tensor."""
        if step.prompt_logprobs or step.pool is not None:
            return None
        rows = step.sample_tokens
        return rows if rows is not None and len(rows) else np.zeros(1, dtype=np.int64)

    def _pipeline_result(self, step: StepInputs) -> tuple[torch.Tensor, bool]:
        """Rank 0: the last stage's final hidden states of `step` (steps come back in the order they were sent),
        and whether they are only the sampled tokens' rows (`_rows_back`)."""
        rows = self._rows_back(step)
        hidden = self.pp.recv_back(step.num_tokens if rows is None else len(rows),  # type: ignore[union-attr]
                                   self.model_cfg.hidden_size, self.dtype, self.device)
        return hidden, rows is not None

    def _run_stage(self, step: StepInputs, drafts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's part of the step's forward: the whole model, or its pipeline stage's layers (their output
        sent on to the next stage, or from the last back to rank 0)."""
        out = self._run_stage_model(step, drafts)
        if self.pp is not None:
            if self.pp.last:
                rows = self._rows_back(step)
                self.pp.send_back(out if rows is None else out.index_select(0, to_device(rows, self.device)))
            else:
                self.pp.send_next(out)
        return out

    def _run_stage_model(self, step: StepInputs, drafts: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.tp_workers is not None:  # the other ranks run the same forward, meeting ours at each all-reduce
            self.tp_workers.send(step)
        for slot, adapter in step.lora_loads:  # queued in order behind the steps that still use the slot
            self.place_lora(slot, adapter)
        if self.graphs is not None and step.images is None and self.graphs.size_for(step) is not None:
            if self.hybrid:
                self._prepare_states(step, self._state_slots(step))
            return self.graphs.run(step, self.last_tokens, self._rope_positions(step))  # type: ignore[return-value]
        def run() -> torch.Tensor:
            with lora.lora_context(self._lora_step(step)):
                return self._forward(step, drafts)
        try:
            # (a rank alone may retry a step: a tensor-parallel one would meet the others at its collectives twice)
            return healing(run, "torch.compile") if self.compiled and self.world_size == 1 else run()
        except Exception as e:
            # No C++ toolchain, or an Inductor bug: serve eagerly rather than not at all. Compilation fails before
            # the graph runs, so running the same step eagerly keeps every rank's collectives in step. (A worker
            # only meets rank 0's warm-up shapes first, so it fails, if at all, at the same step.)
            if not self.compiled or not (self._warming_up or self.tp_rank > 0):
                raise
            logger.warning("torch.compile failed (%s: %s); running the model eagerly", type(e).__name__,
                           str(e).splitlines()[0] if str(e) else "")
            self._use_eager()
            return run()

    def place_lora(self, slot: Optional[int], adapter: LoRAAdapter) -> None:
        """Copy an adapter into `slot` of every layer (None: only check that it fits the model; ValueError)."""
        lora.place_adapter(self.model, self.lora_layers, slot, adapter.modules())

    def _lora_step(self, step: StepInputs) -> Optional[lora.LoRAStep]:
        """The step's token -> adapter map, with each adapter's tokens (None: all of them)."""
        slots = step.lora_slots
        if slots is None:
            return None
        dev = self.device
        groups = []
        for s in np.unique(slots):
            if s > 0:
                mine = slots == s
                groups.append((int(s), None if mine.all() else to_device(np.flatnonzero(mine), dev)))
        return lora.LoRAStep(to_device(slots, dev), groups)

    def _rope_positions(self, step: StepInputs) -> np.ndarray:
        """The positions the rotary embedding reads: M-RoPE shifts those after a prompt's images (InputBatch);
        LongRoPE moves those of sequences longer than the pretraining length to its long table
        (RotaryEmbedding); for everything else, the positions."""
        if step.rope_positions is not None:  # M-RoPE: shifted by the images before them
            return step.rope_positions
        long = self.model.long_rope
        if long is None or step.num_known is None:
            return step.positions
        threshold, offset = long
        shift = (step.num_known > threshold).astype(np.int64) * offset
        if not shift.any():
            return step.positions
        return step.positions + np.repeat(shift, np.diff(step.query_start_loc))

    def _forward(self, step: StepInputs, drafts: Optional[torch.Tensor]) -> torch.Tensor:
        dev = self.device
        if self.pp is not None and not self.pp.first:  # a later pipeline stage: from the stage before's output
            hidden = self.pp.recv_prev(step.num_tokens, self.model_cfg.hidden_size, self.dtype, dev)
            return self._forward_with(self.forward, step, inputs_embeds=hidden)
        input_ids, positions = self._input_ids(step, drafts), to_device(self._rope_positions(step), dev)
        if step.images is not None:  # eagerly: a prefill chunk's matmuls dominate, and no graph takes embeddings
            embeds, extra = self._embeds_with_images(input_ids, step.images)
            if step.images.mrope is not None:  # M-RoPE: [3, T], the image tokens at their (t, h, w) positions
                rows = np.repeat(self._rope_positions(step)[None], 3, axis=0)
                rows[:, step.images.token_idx] = step.images.mrope
                positions = to_device(rows, dev)
            with forward_context(self._metadata(step)):
                return self.model(input_ids, positions, self.kv_caches, inputs_embeds=embeds, **extra)
        return self._forward_with(self.forward, step, input_ids=input_ids, positions=positions)

    def _forward_with(self, forward: Any, step: StepInputs, compiled: Optional[bool] = None,
                      input_ids: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                      inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A text step through `forward` (the model, or its compiled graphs; `compiled`: which, None: the
        runner's own). A background compile's warm-up steps come here with their own inputs; a later pipeline
        stage with the stage before's output (`inputs_embeds`: the graphs then start from it, not the tokens)."""
        dev = self.device
        if input_ids is None and inputs_embeds is None:
            input_ids = to_device(step.input_ids, dev)
        if positions is None:
            positions = to_device(self._rope_positions(step), dev)
        decode = self._decode_inputs(step) if compiled is None else self._decode_batch(step, compiled)
        extra = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        if decode is not None:
            return forward(input_ids, positions, self.kv_caches, decode, **extra)
        with forward_context(self._metadata(step)):  # (a hybrid model's other steps: eagerly)
            return (self.model if self.hybrid else forward)(input_ids, positions, self.kv_caches, **extra)

    def _embeds_with_images(self, input_ids: torch.Tensor, images: ImageStep) -> tuple[torch.Tensor, dict[str, Any]]:
        """The tokens' embeddings, with the image placeholders' replaced by the images' features (encoded now
        unless the encoder cache holds them), and what else the model's forward takes for them (Qwen3-VL's
        DeepStack features: `place_image_features`); or a prompt's placeholders by its given embeddings."""
        cache, dev = self.encoder_cache, self.device
        x = self.model.embed(input_ids)
        if images.images[0].features is not None:  # prompt embeddings (a text model's: no images among them)
            given = [im.features for im in images.images]  # (one per prompt: no copy of a lone prompt's rows)
            rows = (given[0] if len(given) == 1 else torch.cat(given))[torch.from_numpy(images.rows)]
            x[to_device(images.token_idx, dev)] = self.model.from_input_embeddings(rows.to(dev, non_blocking=True))
            return x, {}
        found = {im.hash: cache.get(im.hash) for im in images.images}
        missing = [im for im in images.images if found[im.hash] is None]
        if missing:
            for im, feats in zip(missing, self.model.encode(missing, dev)):
                found[im.hash] = feats
                cache.put(im.hash, feats)
        feats = torch.cat([found[im.hash] for im in images.images])  # type: ignore[misc]
        extra = self.model.place_image_features(x, to_device(images.token_idx, dev), feats[to_device(images.rows, dev)])
        return x, extra

    def keep_last_tokens(self, rows: np.ndarray, tokens: torch.Tensor) -> None:
        top = int(rows.max()) + 1
        if top > len(self.last_tokens):  # the batch grew past max_num_seqs rows (preempted requests' rows)
            grown = torch.zeros(max(top, 2 * len(self.last_tokens)), dtype=torch.int64, device=self.device)
            grown[:len(self.last_tokens)] = self.last_tokens
            self.last_tokens = grown
        self.last_tokens[to_device(rows, self.device)] = tokens

    @torch.inference_mode()
    def hidden_states(self, step: StepInputs) -> torch.Tensor:
        """The model's final hidden states for a forward-only step (the draft model's passes)."""
        return self._run_model(step)

    def execute(self, step: StepInputs) -> RunnerOutput:
        return self.launch(step).result()

    @torch.inference_mode()
    def run_worker_step(self, step: StepInputs) -> None:
        """A tensor-parallel worker's part of a step: the forward (its collectives pair with rank 0's), then the
        tokens rank 0 sampled, kept per row as rank 0 keeps them (a pending token of the next step reads them)."""
        self._run_model(step)
        idx = step.sample_idx
        if len(idx) and self.pp is None:
            tokens = torch.empty(len(idx), dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(tokens, src=0)
            self.keep_last_tokens(step.rows[idx], tokens)

    def why_weights_fixed(self) -> Optional[str]:
        """Why new weights cannot be loaded in place (None: they can): what this engine loaded from the checkpoint
        as it is stored, not as a float checkpoint of the model would give it (quantized codes, calibrated FP8
        KV-cache scales)."""
        if self.model_cfg.quantization is not None:
            return "not with a quantized checkpoint (its codes load as they are stored)"
        if self.model.kv_scales is not None:
            return "not with a checkpoint's FP8 KV-cache scales"
        from streamer.tokenizer.mistral_format import is_mistral_folder
        if is_mistral_folder(self.model_dir):
            return "not with a checkpoint in Mistral's format (its tensors are renamed and permuted at load)"
        return None

    def update_weights(self, source: Path | NamedTensors, partial: bool = False) -> None:
        """Load new weights of the same model into the running model's tensors, in place (`load_weights_in_place`),
        on every tensor-parallel rank at once, on the device thread between steps: a checkpoint folder of the model
        (the same config and tensor names; e.g. the next step of RL training), or every one of its tensors by
        checkpoint name (a trainer's state dict). `partial`: tensors by name may be some of them (a trainer sending
        its weights in buckets), the others keep their values. ValueError (nothing changed) for weights of another
        shape."""
        why = self.why_weights_fixed()
        if why is not None:
            raise ValueError(f"update_weights: {why}")
        if isinstance(source, Path):
            if partial:
                raise ValueError("update_weights: partial is for tensors by name; a checkpoint folder loads whole")
            self._check_checkpoint(source)
        else:
            source = self._checked_tensors(source, partial)
            if partial:
                self._check_partial(source)
                if self.config.speculative_method == "mtp" and self.drafter is not None:  # (its layer's too)
                    self.drafter.runner._check_partial(source)
        if self.tp_workers is not None:  # the workers load their shards while we load ours
            self.tp_workers.command("load_weights_in_place", source if isinstance(source, Path) else
                                    [(name, _sendable(t)) for name, t in source], partial)
        try:
            self.load_weights_in_place(source, partial)
            if self.config.speculative_method == "mtp" and self.drafter is not None:  # (the checkpoint's own layer)
                self.drafter.runner.load_weights_in_place(source, partial)
        finally:
            failed = self.tp_workers.replies() if self.tp_workers is not None else []
        failed = [f"rank {rank}: {why}" for rank, why in enumerate(failed, start=1) if why is not None]
        if failed:
            raise RuntimeError(f"update_weights failed on {', '.join(failed)}: the ranks' weights are now mixed; "
                               "load a complete checkpoint of the model again")
        logger.info("weights updated in place from %s", source if isinstance(source, Path) else
                    f"{len(source)} tensors")

    def _check_checkpoint(self, folder: Path) -> None:
        from streamer.models.config import ModelConfig
        new = ModelConfig.from_dir(folder, self.config.hf_overrides).with_mla_cache(self.config.mla_latent_cache)
        if _structure(new) != _structure(self.model_cfg):
            diff = sorted(k for k, v in _structure(new).items() if _structure(self.model_cfg).get(k) != v)
            raise ValueError(f"update_weights: {folder} is not a checkpoint of this model (config differs in "
                             f"{', '.join(diff)})")
        names, ours = set(checkpoint_tensor_shapes(folder)), set(checkpoint_tensor_shapes(self.model_dir))
        if names != ours:
            raise ValueError(f"update_weights: {folder} holds other tensors than the model's ({_some(names ^ ours)})")

    def _checked_tensors(self, tensors: NamedTensors, partial: bool = False) -> NamedTensors:
        """New weights by checkpoint name: every tensor of the model's checkpoint (`partial`: some of them), each of
        its shape, in float (a tied LM head, which transformers' state dicts list beside the embeddings, is
        dropped)."""
        shapes = checkpoint_tensor_shapes(self.model_dir)
        if self.model_cfg.tie_word_embeddings and "lm_head.weight" not in shapes:
            tensors = [(name, t) for name, t in tensors if name != "lm_head.weight"]
        given = {name for name, _ in tensors}
        if len(given) != len(tensors):
            raise ValueError("update_weights: a tensor name is given twice")
        if partial and not tensors:
            raise ValueError("update_weights: no tensor given")
        if partial and not given <= set(shapes):
            raise ValueError(f"update_weights: not the model's tensors: {_some(given - set(shapes))}")
        if not partial and given != set(shapes):
            missing, odd = set(shapes) - given, given - set(shapes)
            raise ValueError("update_weights: the weights must be every tensor of the model's checkpoint, by its "
                             "names" + (f"; missing {_some(missing)}" if missing else "")
                             + (f"; not the model's: {_some(odd)}" if odd else ""))
        for name, t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shapes[name]:
                what = (type(t).__name__ if not isinstance(t, torch.Tensor)
                        else f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
                raise ValueError(f"update_weights: {name} must be a float tensor of shape {list(shapes[name])}, "
                                 f"not {what}")
        return tensors

    def _touched(self, tensors: NamedTensors) -> dict[str, set[Optional[str]]]:
        """The modules whose weight matrices some of `tensors` (by checkpoint name) write, each with the parts it
        gets (a fused q/k/v or gate/up projection's shards, a sparse MLP's experts; None: the whole matrix)."""
        out: dict[str, set[Optional[str]]] = {}
        for name, t in self.model.rename_weights(iter(tensors)):
            expert = EXPERT_WEIGHT.match(name.removeprefix("model."))
            if expert is not None:
                prefix, e, proj, _ = expert.groups()
                out.setdefault(f"{prefix}.mlp", set()).add(f"{e}.{EXPERT_PROJ.get(proj, proj)}")
                continue
            pname, shard = self.model.param_name(name)
            module, _, attr = pname.rpartition(".")
            if attr == "weight":
                fused = self.model._fused_parts(pname, t) if shard is None else None
                out.setdefault(module, set()).update({s for s, _ in fused} if fused else {shard})
        return out

    def _check_partial(self, tensors: NamedTensors) -> None:
        """Some of the weights: a matrix the model keeps derived (packed for the CPU, rounded to fewer bits) is
        derived again from its new float values, which must then be given whole (all of a fused projection's parts,
        all of a sparse MLP's experts). DeepSeek's absorbed kv_b_proj takes every tensor."""
        if getattr(self.model, "pre_reload", None) is not None:
            raise ValueError("update_weights: partial updates are not supported for this model (its absorbed "
                             "weights are derived from several tensors): give every tensor")
        modules = dict(self.model.named_modules())
        for name, parts in self._touched(tensors).items():
            m = modules.get(name)
            if isinstance(m, PackableLinear) and (m.packed is not None or m.qweight is not None or m.fp8 is not None):
                need = set(m.shard_names) if len(getattr(m, "shard_names", ())) > 1 else {None}
            elif isinstance(m, SparseMoE) and (m.int4 is not None or m.cpu_packed is not None):
                need = {p for ps in m.expected_shards().values() for p in ps}
            else:
                continue
            if not need <= parts:
                raise ValueError(f"update_weights: {name}'s weight is derived (packed or rounded) from all of its "
                                 f"parts: give them together (missing: {_some({str(s) for s in need - parts})})")

    def parameter_bytes(self) -> dict[str, int]:
        """The bytes this rank's model holds: "experts", its sparse layers' routed experts (float, packed for the
        CPU or 4-bit, and their per-expert biases), and "total", every parameter and buffer with those experts. Read
        from the tensors themselves (what the rank holds, not what its shapes should hold)."""
        def nbytes(t: object) -> int:
            if isinstance(t, torch.Tensor):
                return t.numel() * t.element_size()
            if dataclasses.is_dataclass(t):  # (a 4-bit weight: its packed codes, scales and zeros)
                return sum(nbytes(getattr(t, f.name)) for f in dataclasses.fields(t))
            return 0
        experts, counted = 0, set()
        for m in self.model.modules():
            if isinstance(m, SparseMoE):
                held: list[Any] = [m.w13, m.w2, m.w13_bias]
                for parts in (m.cpu_packed, m.int4):
                    if parts is not None:
                        held.extend(w for ws in parts for w in ws)
                experts += sum(nbytes(t) for t in held)
                counted.update(id(t) for t in held)
        rest = sum(nbytes(t) for t in (*self.model.parameters(), *self.model.buffers()) if id(t) not in counted)
        return {"experts": experts, "total": experts + rest}

    def write_parameter_bytes(self, path: str) -> None:
        """`parameter_bytes()` as JSON to `path` with {rank} filled in: a command every rank runs
        (`TensorParallelWorkers.command`; see `ranks_parameter_bytes`)."""
        Path(path.format(rank=self.tp_rank)).write_text(json.dumps(self.parameter_bytes()))

    def ranks_parameter_bytes(self, folder: Path) -> list[dict[str, int]]:
        """Every rank's `parameter_bytes()`, by rank, each reported by that rank (written to files in `folder`, which
        every rank can reach: one machine)."""
        pattern = str(Path(folder) / "parameter_bytes.{rank}.json")
        if self.tp_workers is not None:
            self.tp_workers.command("write_parameter_bytes", pattern)
            errors = [e for e in self.tp_workers.replies() if e]
            if errors:
                raise RuntimeError(f"a rank could not report its parameter bytes: {errors[0]}")
        self.write_parameter_bytes(pattern)
        return [json.loads(Path(pattern.format(rank=r)).read_text()) for r in range(self.tp_size)]

    @torch.inference_mode()
    def load_weights_in_place(self, source: Path | NamedTensors, partial: bool = False) -> None:
        """This rank's shard of new weights (checked by `update_weights`) copied into the model's tensors:
        compiled graphs and CUDA graphs keep reading them. Weights derived after loading are set aside and derived
        again from the new ones, into the same tensors: CPU-packed linears and head, weights rounded at load
        (quantization="int4" / "int8" / "fp8"), DeepSeek's absorbed kv_b_proj. `partial`: only the modules the
        tensors write are derived again (`_check_partial` made sure they come whole)."""
        pre_reload = getattr(self.model, "pre_reload", None)
        if pre_reload is not None:
            pre_reload()
        touched = self._touched(source) if partial and not isinstance(source, Path) else None
        derived = [m for name, m in self.model.named_modules()
                   if isinstance(m, (PackableLinear, SparseMoE)) and (touched is None or name in touched)
                   and m.unpack_for_load()]
        repack_head = self.model.packed_head is not None and (
            touched is None or ("lm_head" if self.model.lm_head is not None else "embed_tokens") in touched)
        head = self.model.lm_head if repack_head else None
        if head is not None:
            head.weight.data = head.weight.data.new_empty(self.model.packed_head.shape)
        try:
            reload_weights(self.model, source, partial)
        except Exception as e:  # (I/O or a corrupt file, after the checks): some tensors are already the new ones
            raise RuntimeError(f"update_weights failed part-way ({e!r}): the model's weights are now mixed; load a "
                               "complete checkpoint of the model again") from e
        post_load = getattr(self.model, "post_load", None)  # (as at load: before anything is rounded or packed)
        if post_load is not None:
            post_load()
        for m in derived:
            m.repack()
        if repack_head:
            self.model.pack_head_for_cpu()
        if isinstance(source, Path):
            self.model_dir = source
        self.encoder_cache = EncoderCache(self.config.encoder_cache_bytes)  # (images' features: the old encoder's)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.tp_workers is not None:
            self.tp_workers.close()
            self.tp_workers = None
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = 0
        if self._affinity_before is not None:
            pin(sorted(self._affinity_before))
            self._affinity_before = None

    @torch.inference_mode()
    def launch(self, step: StepInputs) -> "PendingStep":
        """Queue the step's work on the device and start copying its sampled tokens back; `result()` waits for
        them. On CPU the work is done when this returns; on CUDA the device thread can go on to queue the next
        step (async scheduling) while this one runs."""
        try:
            return self._launch(step)
        except Exception as e:
            # A rank lost mid-step fails a collective with the transport's words: say which rank it was.
            why = self.tp_workers.lost(2.0) if self.tp_workers is not None else None
            if why is None:
                raise
            raise RuntimeError(why) from e

    def _launch(self, step: StepInputs) -> "PendingStep":
        if self.pp is not None:  # the first stage now; the rest when its hidden states come back (`result()`)
            self._run_stage(step)
            return PipelinedStep(self, step)
        drafts = self.drafter.propose(step.draft) if step.draft is not None else None  # type: ignore[union-attr]
        hidden, features = self._split(self._run_model(step, drafts))
        return self._sample(step, hidden, features, drafts)

    def _sample(self, step: StepInputs, hidden: torch.Tensor, features: torch.Tensor,
                drafts: Optional[torch.Tensor], sampled_rows_only: bool = False) -> "PendingStep":
        """The step's final hidden states -> prompt logprobs, pooled sums, logits and sampled tokens (on their way
        to the host). sampled_rows_only: `hidden` holds just the sampled tokens' rows, in order."""
        dev = self.device
        prompt_lp = self._prompt_logprobs(hidden, step.prompt_logprobs) if step.prompt_logprobs else None
        pooled = self._pool(hidden, step.pool) if step.pool is not None else None
        idx = step.sample_idx
        if len(idx) == 0:
            if step.eagle is not None:
                self.drafter.fill(step, step.eagle, features, None)  # type: ignore[union-attr]
            return PendingStep(step, idx, [], prompt_logprobs=prompt_lp, pooled=pooled)
        if sampled_rows_only:
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, to_device(step.sample_tokens, dev)))
        out: SamplerOutput = self.sampler(logits, self._sampling_batch(step.sampling))
        if step.eagle is not None:  # the head's KV over this step's tokens, the sampled ones included
            self.drafter.fill(step, step.eagle, features, out.token_ids)  # type: ignore[union-attr]
        if self.tp_workers is not None and self.pp is None:  # workers keep the sampled tokens too: async
            # scheduling's next step reads them (not with pipeline stages: a request's next step waits for its token)
            torch.distributed.broadcast(out.token_ids, src=0)
        self.keep_last_tokens(step.rows[idx], out.token_ids)
        tensors = [out.token_ids] + ([out.logprobs, out.logprob_token_ids, out.ranks]
                                     if out.logprobs is not None else [])
        if drafts is not None:  # the engine verifies the proposals against the sampled tokens
            tensors.append(drafts)
        if dev.type != "cuda":
            return PendingStep(step, idx, tensors, prompt_logprobs=prompt_lp, pooled=pooled)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingStep(step, idx, host, event, prompt_lp, pooled)

    def _pool(self, hidden: torch.Tensor, pool: PoolTokens) -> tuple[list, np.ndarray]:
        """Each embedding request's sum of the hidden states it pools in this step (waits for the device, as
        prompt logprobs do: embedding requests have no token to overlap). A sequence classifier's requests get its
        score head's logits of that sum instead, in fp32: the head has no bias, so a chunk that pools nothing
        still adds nothing."""
        idx, seg = to_device(pool.token_idx, self.device), to_device(pool.segment, self.device)
        sums = torch.zeros(len(pool.owners), hidden.shape[-1], dtype=torch.float32, device=self.device)
        sums.index_add_(0, seg, hidden.index_select(0, idx).float())
        if getattr(self.model, "score", None) is not None:  # (a family class that builds no LlamaForCausalLM has none)
            if self.model.classifier_pooling == "mean":  # (an encoder's head is not linear: it reads the mean,
                # and the prompt is whole in this step)
                sums /= torch.bincount(seg, minlength=len(pool.owners)).clamp(min=1).unsqueeze(1)
            sums = self.model.classify(sums)
        return pool.owners, sums.cpu().numpy().astype(np.float64)

    # Rows of prompt logits made at once: a long prompt's [tokens, vocab] logits would not fit in memory.
    PROMPT_LOGPROB_CHUNK = 512

    def _prompt_logprobs(self, hidden: torch.Tensor, want: PromptLogprobTokens) -> PromptLogprobsOut:
        """Score prompt tokens (a rare request option: this waits for the device, unlike the sampled path)."""
        dev = self.device
        idx, targets = to_device(want.token_idx, dev), to_device(want.target_ids, dev)
        parts = []
        for lo in range(0, len(idx), self.PROMPT_LOGPROB_CHUNK):
            sl = slice(lo, lo + self.PROMPT_LOGPROB_CHUNK)
            lp = self.model.compute_logits(hidden.index_select(0, idx[sl])).log_softmax(dim=-1)
            parts.append(score_tokens(lp, targets[sl], want.top_n))
        chosen, ranks, top_lps, top_ids = (torch.cat(p).cpu().numpy() for p in zip(*parts))
        chosen = chosen[:, 0]
        return PromptLogprobsOut(want.owners, want.target_ids, chosen, ranks, top_ids, top_lps)


class PipelinedStep:
    """A step launched on rank 0's pipeline stage: `result()` waits for its final hidden states to come back from
    the last stage (off the device thread, which meanwhile launches the next step), then samples."""

    ready = False

    def __init__(self, runner: ModelRunner, step: StepInputs) -> None:
        self.runner, self.step = runner, step

    @torch.inference_mode()
    def result(self) -> RunnerOutput:
        runner, step = self.runner, self.step
        try:
            hidden, sampled_rows_only = runner._pipeline_result(step)
        except Exception as e:  # a rank lost: say which
            why = runner.tp_workers.lost(2.0) if runner.tp_workers is not None else None
            if why is None:
                raise
            raise RuntimeError(why) from e
        return runner._sample(step, hidden, hidden, None, sampled_rows_only).result()


class PendingStep:
    """A launched step: its sampled tokens (and logprobs) on their way to host memory."""

    def __init__(self, step: StepInputs, idx: np.ndarray, host: list[torch.Tensor],
                 event: Optional["torch.cuda.Event"] = None,
                 prompt_logprobs: Optional[PromptLogprobsOut] = None, pooled: Optional[tuple] = None) -> None:
        self.step, self.idx, self.host, self.event = step, idx, host, event
        self.prompt_logprobs, self.pooled = prompt_logprobs, pooled

    @property
    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> RunnerOutput:
        if self.event is not None:
            self.event.synchronize()
        step, idx = self.step, self.idx
        if len(idx) == 0:
            return RunnerOutput([], [], prompt_logprobs=self.prompt_logprobs, pooled=self.pooled)
        tokens = self.host[0].numpy()
        result = RunnerOutput([step.req_ids[i] for i in idx], tokens.tolist(), rows=step.rows[idx],
                              epochs=step.epochs[idx], positions=step.positions[step.sample_tokens] + 1,
                              token_array=tokens, prompt_logprobs=self.prompt_logprobs,
                              has_drafts=step.has_drafts, pooled=self.pooled)
        host = self.host[1:]
        if step.draft is not None:
            proposed, host = host[-1].numpy(), host[:-1]
            result.drafts = {rid: row[:n].tolist()
                             for rid, row, n in zip(step.draft.req_ids, proposed, step.draft.counts)}
        if host:
            logprobs, ids, ranks = host
            result.logprobs, result.logprob_token_ids, result.ranks = logprobs.tolist(), ids.tolist(), ranks.tolist()
        return result


def _structure(cfg: ModelConfig) -> dict[str, Any]:
    """What a checkpoint must share with the running model for its weights to load in place."""
    return {k: v for k, v in vars(cfg).items() if k not in ("raw", "torch_dtype", "bos_token_id", "eos_token_id")}


def _some(names: set[str], most: int = 4) -> str:
    """A few of `names`, for an error message."""
    some = sorted(names)
    return ", ".join(some[:most]) + (" ..." if len(some) > most else "")


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """A tensor to pickle for another process: on the host, and holding only its own elements (a pickled view
    carries its whole storage)."""
    t = t.detach().cpu()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def run_tensor_parallel_rank(conn: Connection, group: RankGroup, config: EngineConfig, model_dir: Path,
                             model_cfg: ModelConfig, max_model_len: int) -> bool:
    """What a tensor-parallel worker process runs once connected to rank 0 (streamer/worker/parallel.py starts it:
    rank 0's runner hands this function to TensorParallelWorkers): build this rank's shard, then serve steps.
    True once rank 0 stopped it (False: it failed, or rank 0 went away)."""
    device = rank_device(config.device, group.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the node's ranks share its cores: each takes its share (or the cores it is pinned to), not all of them
        torch.set_num_threads(rank_threads(group.local_world, group.cpus))
    init_process_group(group, device)
    try:
        runner = ModelRunner(config, model_dir, model_cfg, max_model_len, tp_rank=group.rank,
                             local_rank=group.local_rank)
    except Exception as e:  # tell rank 0 why, rather than leaving it waiting
        conn.send(f"{type(e).__name__}: {e}")
        return False
    return serve_steps(conn, runner)
