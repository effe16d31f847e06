"""The model runner: owns the model, the KV cache tensors and the sampler, and executes one step.

`execute()` runs on the engine's device thread. It turns a SchedulerOutput into the flattened varlen
batch (input_ids, positions, query_start_loc, seq_lens, block_table, slot_mapping), runs the model,
projects logits only at each sampling request's last scheduled token, and samples.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from streamer.attention.base import AttentionMetadata, forward_context
from streamer.config import EngineConfig
from streamer.kv_cache import cdiv
from streamer.models.config import ModelConfig
from streamer.models.layers import PackableLinear, cpu_packing_supported
from streamer.models.loader import load_model
from streamer.request import Request
from streamer.sampler import Sampler, SamplerOutput, SamplingBatch, build_penalties
from streamer.scheduler import SchedulerOutput

logger = logging.getLogger("streamer")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_KV_DEFAULT = 2 << 30  # 2 GiB


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(model_cfg.torch_dtype.replace("torch.", ""), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32  # fp16 matmuls are slow or missing on CPUs
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


@dataclass
class RunnerOutput:
    """Host-side results of one step, one entry per request that sampled (in scheduled order)."""

    req_ids: list[str]
    token_ids: list[int]
    logprobs: Optional[list[list[float]]] = None  # [sampled, top-1, ..., top-N]
    logprob_token_ids: Optional[list[list[int]]] = None
    ranks: Optional[list[int]] = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        self.block_size = config.block_size
        backend_cls = resolve_backend(config.attention_backend, self.device)
        self.attention_backend = backend_cls.name
        if backend_cls.name == "torch":  # its CPU decode kernel is compiled unless the user forbids compiling
            backend_cls = functools.partial(backend_cls, compile=config.enforce_eager is not True)
        torch.manual_seed(config.seed)
        self.model = load_model(model_dir, model_cfg, self.dtype, self.device, backend_cls, max_model_len,
                                config.load_format, config.seed)
        self.sampler = Sampler()
        self.forward = self.model
        self.compiled = self._should_compile()
        self.generators: dict[str, torch.Generator] = {}
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, self.block_size, self.model.layers[0].self_attn.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(model_cfg.num_layers)]
        logger.info("KV cache: %d blocks = %d tokens (block_size %d, %s, %s)", self.num_blocks,
                    self.num_blocks * self.block_size, self.block_size, str(self.dtype).replace("torch.", ""),
                    self.device)
        if self.compiled:
            self.forward = self._compile()
            try:
                self.warmup()
            except Exception as e:  # no C++ toolchain, or an Inductor bug: serve eagerly rather than not at all
                logger.warning("torch.compile failed (%s: %s); running the model eagerly", type(e).__name__,
                               str(e).splitlines()[0] if str(e) else "")
                self._use_eager()
                self.warmup()
            return
        self._use_eager()
        self.warmup()

    def _use_eager(self) -> None:
        self.compiled, self.forward = False, self.model
        for layer in self.model.layers:
            layer.self_attn.use_op = False
        if self.device.type == "cpu" and self.config.cpu_weight_packing and cpu_packing_supported(self.dtype):
            for module in self.model.modules():
                if isinstance(module, PackableLinear) and module.packed is None:
                    module.pack_for_cpu()

    # ------------------------------------------------------------------ set-up
    def _should_compile(self) -> bool:
        if self.config.enforce_eager is not None:
            return not self.config.enforce_eager
        return self.device.type == "cuda"

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every graph the engine will need before serving, so no request pays for compilation: the model's
        (1 token, then a dynamic token dimension) and the CPU decode attention's (a lone request, a batch).
        Writes nothing (slots -1)."""
        import time
        import torch._inductor.config as inductor_config
        t = time.perf_counter()
        # Freezing (CPU): weights become constants, so Inductor prepacks them for oneDNN (as PackableLinear does
        # in eager mode) and folds what depends only on them. Graphs are built here, so patching here suffices.
        # (torch.compile(options={"freezing": True}) does not reach the CPU linears: checked in the output code.)
        with inductor_config.patch(freezing=self.compiled and self.device.type == "cpu"):
            self._warmup_steps()
        logger.info("%s in %.1f s", "compiled and warmed up" if self.compiled else "warmed up",
                    time.perf_counter() - t)

    def _warmup_steps(self) -> None:
        bs, dev = self.block_size, self.device
        # (query tokens per request, context length per request): a lone decode over a long context (the CPU
        # decode kernel splits it across threads), a decode batch, and a prefill chunk.
        steps = [([1], [min(4 * bs, self.max_model_len)]), ([1, 1], [1, 1]), ([16], [16])]
        for q_lens, seq_lens in steps:
            q_lens = [min(n, self.max_model_len) for n in q_lens]
            seq_lens = [max(s, q) for s, q in zip(seq_lens, q_lens)]
            qsl = np.concatenate([[0], np.cumsum(q_lens)])
            n = int(qsl[-1])
            width = cdiv(max(seq_lens), bs)
            meta = AttentionMetadata(
                num_reqs=len(q_lens), num_tokens=n,
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_table=torch.zeros(len(q_lens), width, dtype=torch.int32, device=dev),
                slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
                max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl.astype(np.int64),
                seq_lens_cpu=np.array(seq_lens, dtype=np.int64))
            positions = torch.from_numpy(np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]))
            with forward_context(meta):
                self.forward(torch.zeros(n, dtype=torch.int64, device=dev), positions.to(dev), self.kv_caches)

    def _compile(self):
        """torch.compile the whole model with attention as an opaque custom op and a dynamic token dimension."""
        for layer in self.model.layers:
            layer.self_attn.use_op = True
        return torch.compile(self.model, dynamic=True, fullgraph=True)

    def kv_bytes_per_block(self) -> int:
        attn = self.model.layers[0].self_attn
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.model_cfg.num_layers * self.block_size * attn.num_kv_heads * attn.head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Leave room for activations of the largest step: a few hidden-size buffers per token plus logits.
            act = self.config.max_num_batched_tokens * (self.model_cfg.hidden_size * 16
                                                        + self.model_cfg.intermediate_size * 6)
            act += self.config.max_num_seqs * self.model_cfg.vocab_size * 8
            budget = int(total * self.config.gpu_memory_utilization) - used - act
        else:
            budget = self.config.kv_cache_memory or _CPU_KV_DEFAULT
        # More blocks than every sequence slot can fill would only waste memory.
        useful = self.config.max_num_seqs * self.max_blocks_per_req
        n = min(budget // per_block, useful)
        if n < self.max_blocks_per_req and n < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) does not hold a single block of {per_block} bytes")
        return max(int(n), 1)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    # ------------------------------------------------------------------ one step
    def prepare(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     AttentionMetadata]:
        num_reqs = len(sched.scheduled)
        q_lens = np.fromiter((s.num_tokens for s in sched.scheduled), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.start for s in sched.scheduled), dtype=np.int64, count=num_reqs)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        ids = [s.req.all_token_ids[s.start:s.start + s.num_tokens] for s in sched.scheduled]
        input_ids = np.fromiter((t for chunk in ids for t in chunk), dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        seq_lens = starts + q_lens
        width = max(len(b) for b in block_tables)
        table = np.zeros((num_reqs, width), dtype=np.int32)
        for i, blocks in enumerate(block_tables):
            table[i, :len(blocks)] = blocks
        row = np.repeat(np.arange(num_reqs), q_lens)
        bs = self.block_size
        slots = table[row, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        n = len(reqs)
        vocab = self.model_cfg.vocab_size
        params = [r.params for r in reqs]
        temps = [0.0 if p.greedy else float(p.temperature) for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        dev = self.device
        gens: list[Optional[torch.Generator]] = [None] * n
        for i, r in enumerate(reqs):
            if r.params.seed is not None and not params[i].greedy:
                gens[i] = self._generator(r)
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=dev)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([float(p.top_p) for p in params], device=dev)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([float(p.min_p) for p in params], device=dev)
        restricted = None
        if top_k is not None or top_p is not None:
            restricted = torch.tensor([p.top_k > 0 or p.top_p < 1.0 for p in params], device=dev)
        pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        penalties = (build_penalties([reqs[i] for i in pen_rows], pen_rows, n, vocab, dev) if pen_rows else None)
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                stop_ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                stop_ids = {t for t in stop_ids if t < vocab}
                banned_rows += [i] * len(stop_ids)
                banned_ids += sorted(stop_ids)
        banned = ((torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev))
                  if banned_rows else None)
        wants = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev), top_k=top_k, top_p=top_p,
            min_p=min_p, generators=gens, all_greedy=all_greedy, any_seeded=any(g is not None for g in gens),
            banned=banned, penalties=penalties, max_logprobs=max(wants) if wants else -1, restricted=restricted)

    def _generator(self, req: Request) -> torch.Generator:
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            self.generators[req.request_id] = gen
        return gen

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> RunnerOutput:
        input_ids, positions, meta = self.prepare(sched, block_tables)
        with forward_context(meta):
            hidden = self.forward(input_ids, positions, self.kv_caches)
        sampling = [i for i, s in enumerate(sched.scheduled) if s.samples]
        if not sampling:
            return RunnerOutput([], [])
        reqs = [sched.scheduled[i].req for i in sampling]
        last = torch.as_tensor(meta.query_start_loc_cpu[1:][sampling] - 1, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        out: SamplerOutput = self.sampler(logits, self._sampling_batch(reqs))
        result = RunnerOutput([r.request_id for r in reqs], out.token_ids.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
            result.logprob_token_ids = out.logprob_token_ids.tolist()
            result.ranks = out.ranks.tolist()
        return result
