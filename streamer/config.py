"""Engine configuration: one dataclass the user fills (EngineArgs), validated once at start-up."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from streamer.sampling_params import _is_int, _is_real

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DEVICES = ("auto", "cpu", "cuda", "cuda:N")
# torch.manual_seed's range (a 64-bit integer, signed or unsigned)
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def _is_number(v: Any) -> bool:
    """A finite real number (int or float), not a bool."""
    return _is_real(v) and math.isfinite(v)


def check_device(device: Any) -> None:
    """ValueError unless `device` is "auto", "cpu", "cuda" or "cuda:N", and a CUDA one is there to use. torch is
    imported (and CUDA asked) only for a device that names CUDA."""
    kind, colon, index = device.partition(":") if isinstance(device, str) else (None, "", "")
    if kind not in ("auto", "cpu", "cuda") or (colon and (kind != "cuda" or not (index.isascii() and index.isdigit()))):
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
    if kind != "cuda":
        return
    import torch
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch finds no CUDA GPU"
        raise ValueError(f"device={device!r}, but CUDA is not available ({why}); use device='cpu' or 'auto'")
    if colon and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but torch finds {torch.cuda.device_count()} CUDA device(s)")


@dataclass
class EngineConfig:
    model: Optional[str] = None  # HF checkpoint folder; None = the embedded default model
    tokenizer: Optional[str] = None  # defaults to `model`
    # auto = the checkpoint's torch_dtype, except on a CPU that does not compute it natively (bf16 without
    # avx512_bf16/amx_bf16, fp16 without avx512_fp16/amx_fp16): float32 there (model_runner.resolve_dtype)
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda if available else cpu
    # "auto" (safetensors, else pytorch_model*.bin) | "safetensors" | "pt" (.bin only) | "dummy" (random weights at
    # real sizes)
    load_format: str = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None  # defaults to the model's max_position_embeddings
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits beyond it)
    # Inter-token latency target of streamed requests, in milliseconds: while one decodes, each step's prefill
    # chunks are sized so that the step-time model (streamer/core/step_time.py, fitted online on this device) predicts
    # the step within it. None: automatic (the largest of 2x the running decodes' own step, that step x (1 + prompts
    # waiting / requests decoding), a tenth of the oldest prompt's wait, and 50 ms; step_time.ItlPolicy). 0: off (the
    # token budget alone, as vLLM and SGLang schedule).
    max_itl_ms: Optional[float] = None
    max_num_seqs: int = 256  # running-sequence cap
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes for the KV pool (default: 2 GiB on CPU; on a GPU what
    # gpu_memory_utilization leaves after the weights and activations)
    # "auto": the KV cache in the model's dtype; "fp8" (or "fp8_e4m3"): float8_e4m3fn, half the bytes of bf16, so
    # twice the tokens in the same memory. Stored k / k_scale and v / v_scale with the checkpoint's calibrated
    # scales where it has them (llm-compressor's k_scale / v_scale), else 1.0.
    kv_cache_dtype: str = "auto"
    # DeepSeek-V2 / V3 (multi-head latent attention): cache the shared latent, one kv head of kv_lora_rank +
    # qk_rope_head_dim (kv_b_proj absorbed into queries and output); False: every head's K and V, plain MHA
    # (5.3x (V2-Lite) to 42.7x (V3) the latent cache's bytes a token). Other models ignore it.
    mla_latent_cache: bool = True
    gpu_memory_utilization: float = 0.9  # fraction of total GPU memory the engine may use
    num_kv_blocks: Optional[int] = None  # override the computed pool size (tests, benchmarks)
    enable_prefix_caching: bool = True
    # Log what the prefix cache stores and evicts (core/kv_events.py) for a router: the data-parallel one, or
    # subscribers of --kv-events-config. Off: no cost.
    kv_events: bool = False
    # Hybrid / recurrent models' prefix caching: slots for checkpoints of the recurrent state at block boundaries
    # (kv_cache.StateCheckpoints); None: one per max_num_seqs, within half the memory budget with the requests'.
    state_checkpoints: Optional[int] = None
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    priority_aging: Optional[float] = None  # seconds of waiting that count as one priority level
    attention_backend: Optional[str] = None  # "torch" | "triton"; None = triton on CUDA, torch on CPU
    # "torch" | "triton": the Triton sampler filters top-k/top-p/min-p by threshold search instead of sorting the
    # vocabulary (CUDA, or TRITON_INTERPRET=1). None = on CUDA the kernel for steps of >= 256 sampled rows (where
    # the GPU check measured it winning), torch below and on CPU.
    sampling_backend: Optional[str] = None
    enforce_eager: Optional[bool] = None  # None: compile on CUDA, eager on CPU; True/False forces it
    # A compiled model on CPU: serve at once, eagerly, while a thread compiles it (a cold compile is ~1 min on a
    # 2-core box), then switch (`streamer serve`'s default; not for TP, hybrid, quantized or speculative models).
    compile_in_background: bool = False
    cpu_weight_packing: bool = True  # eager CPU: linear weights in oneDNN's prepacked layout (20-40% faster)
    max_waiting: Optional[int] = None  # bound on the waiting queue (server returns 429 past it)
    # Schedule and prepare step N+1 while step N runs (its sampled tokens are read on the device), and detokenize
    # and stream step N while step N+1 runs. Steps with penalties (which need step N's tokens on the host) wait.
    # None = on for CUDA; off on CPU, where host and model share the cores (measured: no gain compiled, a few
    # percent lost eager; bench/RESULTS.md).
    async_scheduling: Optional[bool] = None
    # CUDA graphs for decode-only steps of up to this many requests (CUDA, Triton backend, not enforce_eager);
    # 0 = off. Capped at max_num_seqs.
    cuda_graph_max_batch: int = 256
    # Ranks of tensor parallelism: one process (and on CUDA one GPU) per rank, each holding 1/N of every layer
    # (streamer/worker/parallel.py). Compiled as usual, async scheduling as usual; for now without CUDA graphs.
    tensor_parallel_size: int = 1
    # Pipeline stages (docs/multi-node.md): the decoder layers split into this many contiguous stages, each stage a
    # tensor-parallel group of its own ranks (world = tensor_parallel_size * pipeline_parallel_size, rank =
    # stage * T + its place in the stage); hidden states pass from stage to stage and back to rank 0, which samples,
    # with up to this many batches (of different requests) in flight.
    pipeline_parallel_size: int = 1
    # Steps in flight at once with pipeline stages (None: one per stage; 1: one at a time, stages idle in turn:
    # bench/pipeline_parallel.py's baseline)
    pipeline_depth: Optional[int] = None
    # vLLM's --enable-expert-parallel: with tensor_parallel_size T > 1, the sparse MoE layers place whole experts on
    # the ranks (rank r: experts [r*E//T, (r+1)*E//T)) instead of a slice of every expert; attention, dense MLPs and
    # shared experts stay tensor-parallel. The ranks are the same processes (and nodes). No effect with T == 1, nor
    # on a dense model (ignored with a warning, as vLLM ignores it).
    enable_expert_parallel: bool = False
    # Tensor parallelism over several machines (docs/multi-node.md; vLLM's flags): node n of `nnodes` runs ranks
    # n*P .. n*P+P-1 (P = `nproc_per_node`; default the GPUs a node has, or tensor_parallel_size / nnodes on CPU).
    # The engine runs on node 0 (the head), which hosts the rendezvous store at master_addr:master_port; the other
    # nodes run `streamer serve --headless`. `dist_host`: this node's routable address, which its step listener and
    # ranks bind to (default: master_addr on the head, the address on the route to it elsewhere). "torchrun" as
    # `distributed_launcher`: torchrun started every rank (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
    # and they meet at its store.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    nproc_per_node: Optional[int] = None
    dist_host: Optional[str] = None
    distributed_launcher: str = "streamer"
    # Data parallelism (docs/data-parallel.md): this many engine replicas, each its own process with its own device
    # (GPU i, each replica's tensor-parallel group its own GPUs; on CPU its own share of the cores) and KV cache,
    # behind one router (streamer/engine/data_parallel.py). `dp_routing`: cache_aware, least_loaded or round_robin
    # (streamer/engine/dp_router.py); `dp_session_header`: a request header whose value keeps a session on one replica.
    data_parallel_size: int = 1
    dp_routing: str = "cache_aware"
    dp_session_header: Optional[str] = "x-session-id"
    # A replica of this machine that dies is started again, at most this many times in all (the k-th after
    # min(2**(k-1), 30) s); a replica of another node rejoins when its node starts it again. Not once the weights were
    # updated at runtime (a new replica would load the checkpoint's). 0: a lost replica stays down.
    dp_max_restarts: int = 3
    # Replicas on several machines (vLLM's flags): this node runs `data_parallel_size_local` of them (default: all),
    # numbered from `data_parallel_start_rank`; the head (start rank 0) serves and routes over all
    # `data_parallel_size`, the others run `serve --headless` and join it at data_parallel_address's rendezvous store
    # (data_parallel_rpc_port), which hands out its replica listener's address and a random key.
    data_parallel_size_local: Optional[int] = None
    data_parallel_start_rank: int = 0
    data_parallel_address: Optional[str] = None
    data_parallel_rpc_port: Optional[int] = None
    # Structured outputs: when the grammar admits only one continuation (a JSON key, `":"`, the rest of an enum
    # value), append its tokens without sampling them; the next step computes them like prompt tokens. Cuts a
    # JSON object's decode steps by about half (bench/structured_output.py). Requests that ask for logprobs skip it.
    jump_forward: bool = True
    # The reasoning model's parser (streamer/engine/thinking.py PARSERS): its think tags are what a request's
    # thinking_token_budget counts between. The server also reads reasoning out of chat output with it.
    reasoning_parser: Optional[str] = None
    # A streamed sequence's outputs after its first token go out every this many tokens (and when it finishes):
    # fewer, larger SSE events and fewer wake-ups on the event loop under heavy streaming load (SGLang's
    # --stream-interval). 1 = every token.
    stream_interval: int = 1
    # Speculative decoding with n-gram drafts (streamer/spec_decode/ngram.py): up to this many tokens proposed per step
    # from the request's own earlier tokens, verified in one forward pass; 0 = off. Needs steps one at a time
    # (no async scheduling). Only while at most `speculative_max_batch` requests run: in a big batch the device
    # is busy anyway, and rejected drafts would only cost compute.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4  # longest n-gram to match
    prompt_lookup_min: int = 2  # shortest n-gram to match
    speculative_max_batch: int = 8
    # A draft model instead of n-gram lookup (streamer/spec_decode/draft_model.py): a small checkpoint with the target's
    # tokenizer (e.g. Llama-3.2-1B for Llama-3.1-8B) proposes `num_speculative_tokens` tokens greedily, on the
    # device thread, just before the step that verifies them. Its KV cache shares the target's block tables.
    speculative_model: Optional[str] = None
    # "mtp": the checkpoint's own multi-token-prediction layer drafts (DeepSeek-V3 / R1, GLM-4.5 / 4.6: the layer
    # past the last, which loading otherwise skips; Qwen3-Next, Nemotron-H: their `mtp.*` modules), applied again
    # for each of `num_speculative_tokens` (streamer/spec_decode/eagle.py, models/mtp.py). "suffix": SuffixDecoding, drafts from
    # earlier requests' outputs as well as the request's own tokens (streamer/spec_decode/ngram.py: SuffixIndex), for agents
    # and other repetitive traffic. None: `speculative_model` if given, else n-gram lookup.
    speculative_method: Optional[str] = None
    # "suffix": the longest suffix of a request's tokens matched; the finished requests whose outputs are kept (0: the
    # request's own tokens only); draft length <= this times the match length; the least estimated probability a
    # draft keeps (vLLM's suffix_decoding_* options, the same defaults but the cache, 10x smaller here)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # LoRA adapters (PEFT folders, streamer/engine/lora.py): each request may name one. The model holds up to `max_loras`
    # adapters at once (a request whose adapter finds no free slot waits), each of rank <= `max_lora_rank`.
    # "fp8": linear weights kept in FP8 (a scale per output channel) and multiplied in FP8 (torch._scaled_mm,
    # activations quantized per token): half the weight memory and bandwidth. Any checkpoint may be quantized this
    # way at load. None: FP8 checkpoints compute in FP8 on GPUs with row-wise scaled FP8 matmuls (compute
    # capability 9.0+), otherwise they are dequantized to the compute dtype. "int4": linear weights rounded to 4 bits
    # (asymmetric, a scale and zero per 128 input columns) and multiplied by torch's int4 kernels: a quarter of
    # bf16's memory; on CPU decode of one or a few sequences is faster and batches of many tokens slower
    # (bench/RESULTS.md). 4-bit GPTQ / AWQ / pack-quantized checkpoints stay 4-bit unless this is "fp8" or "none".
    # "none": always dequantize.
    quantization: Optional[str] = None
    enable_lora: bool = False
    # Prompts given as embeddings (streamer/engine/prompt_embeds.py; the server's prompt_embeds): off by default, since
    # such a request carries a tensor the size of its prompt times the hidden size
    enable_prompt_embeds: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # Where unset request fields take their defaults from (streamer/engine/generation_config.py): "auto" = the model's
    # generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "vllm" =
    # the API's own defaults, or a folder holding a generation_config.json. `override_generation_config` (the
    # file's keys) wins over either.
    generation_config: str = "auto"
    override_generation_config: Optional[dict[str, Any]] = None
    # config.json keys that win over the checkpoint's (vLLM's hf_overrides), e.g. {"max_position_embeddings":
    # 65536, "rope_scaling": {...}} to run a model past its trained length; nested configs (text_config, ...) are
    # amended key by key (models/config.with_overrides)
    hf_overrides: Optional[dict[str, Any]] = None
    # A Jinja chat template, or the path of a file holding one, used in place of the checkpoint's (for checkpoints
    # without one, or to fix one); checked to compile at start-up.
    chat_template: Optional[str] = None
    # Vision- and audio-language models (streamer/multimodal/inputs.py, streamer/multimodal/audio_prompts.py): at most this many
    # images (videos, audio clips) in one prompt; the encoder's output kept for images whose prompts are still being
    # computed (and for repeats), up to this many bytes.
    limit_images_per_prompt: int = 16
    encoder_cache_bytes: int = 512 << 20
    # Whether the server fetches http(s) image (video, audio) URLs in chat messages (data: URLs are always read).
    allow_image_urls: bool = True
    # Hosts (names or IP addresses) whose http(s) media URLs the server fetches, each with its subdomains, trusted at
    # any address, an internal one included (streamer/multimodal/media_fetch.py); None: any host whose addresses are all
    # public (never loopback, private, link-local, ...). As vLLM's --allowed-media-domains.
    allowed_media_domains: Optional[tuple[str, ...]] = None
    # AsyncEngine: seconds between vLLM-style throughput log lines while there is work (0: none; `streamer serve`
    # logs every 10 s unless --disable-log-stats).
    log_stats_interval: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "pt", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors', 'pt' or 'dummy', got {self.load_format!r}")
        for name in ("model", "tokenizer", "speculative_model"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path (a str or os.PathLike), got {v!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be a str (a file's path, or the template), got "
                             f"{self.chat_template!r}")
        check_device(self.device)
        if not _is_int(self.seed) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be None (the model's limit) or a positive integer, got "
                             f"{self.max_model_len!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}")
        if self.sampling_backend not in (None, "torch", "triton"):
            raise ValueError(f"sampling_backend must be 'torch' or 'triton', got {self.sampling_backend!r}")
        if self.kv_cache_memory is not None and (not _is_number(self.kv_cache_memory) or self.kv_cache_memory <= 0):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not _is_number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        for name in ("state_checkpoints", "max_waiting"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {v!r}")
        if self.max_itl_ms is not None and (not _is_number(self.max_itl_ms) or self.max_itl_ms < 0):
            raise ValueError(f"max_itl_ms must be None (automatic), 0 (off) or a positive number of milliseconds, "
                             f"got {self.max_itl_ms!r}")
        if self.priority_aging is not None and (not _is_number(self.priority_aging) or self.priority_aging < 0):
            raise ValueError(f"priority_aging must be None or a number of seconds >= 0, got {self.priority_aging!r}")
        if not _is_number(self.log_stats_interval) or self.log_stats_interval < 0:
            raise ValueError(f"log_stats_interval must be a number of seconds >= 0, got {self.log_stats_interval!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be None, True or False, got {self.enforce_eager!r}")
        if (not isinstance(self.cuda_graph_max_batch, int) or isinstance(self.cuda_graph_max_batch, bool)
                or self.cuda_graph_max_batch < 0):
            raise ValueError(f"cuda_graph_max_batch must be an integer >= 0, got {self.cuda_graph_max_batch!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None, True or False, got {self.async_scheduling!r}")
        if not isinstance(self.cpu_weight_packing, bool):
            raise ValueError(f"cpu_weight_packing must be True or False, got {self.cpu_weight_packing!r}")
        if not isinstance(self.allow_image_urls, bool):
            raise ValueError(f"allow_image_urls must be True or False, got {self.allow_image_urls!r}")
        from streamer.multimodal.media_fetch import normalize_domains
        self.allowed_media_domains = normalize_domains(self.allowed_media_domains, "allowed_media_domains")
        if not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward must be True or False, got {self.jump_forward!r}")
        from streamer.engine.thinking import PARSERS
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {PARSERS}, got {self.reasoning_parser!r}")
        if (not isinstance(self.stream_interval, int) or isinstance(self.stream_interval, bool)
                or self.stream_interval < 1):
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if not isinstance(self.mla_latent_cache, bool):
            raise ValueError(f"mla_latent_cache must be True or False, got {self.mla_latent_cache!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8", "int4", "int8", "none"):
            raise ValueError(f"quantization must be 'fp8', 'int4', 'int8' or 'none', got {self.quantization!r}")
        for name in ("hf_overrides", "override_generation_config"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, dict) or not all(isinstance(k, str) for k in v)):
                raise ValueError(f"{name} must be a dict of config keys to values, got {v!r}")
        for name in ("enable_lora", "enable_prompt_embeds"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("limit_images_per_prompt", "encoder_cache_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max], got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}")
        if not isinstance(self.dp_max_restarts, int) or isinstance(self.dp_max_restarts, bool) \
                or self.dp_max_restarts < 0:
            raise ValueError(f"dp_max_restarts must be an integer >= 0, got {self.dp_max_restarts!r}")
        if self.dp_routing not in ("cache_aware", "least_loaded", "round_robin"):
            raise ValueError(f"dp_routing must be cache_aware, least_loaded or round_robin, got {self.dp_routing!r}")
        if dp > 1 and self.nnodes > 1:
            raise ValueError("data_parallel_size > 1 does not run with nnodes > 1 (each replica on one machine): "
                             "spread the replicas over machines with --data-parallel-size-local, "
                             "--data-parallel-start-rank, --data-parallel-address and --headless instead")
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if local is not None and (not _is_int(local) or not 0 <= local <= dp):
            raise ValueError(f"data_parallel_size_local must be in 0..data_parallel_size ({dp}), got {local!r}")
        if not _is_int(start) or start < 0 or start + (dp if local is None else local) > dp:
            raise ValueError(f"data_parallel_start_rank {start!r} with {dp if local is None else local} local "
                             f"replica(s) does not fit in data_parallel_size {dp}")
        port = self.data_parallel_rpc_port
        if port is not None and (not _is_int(port) or not 1 <= port <= 65535):
            raise ValueError(f"data_parallel_rpc_port must be a TCP port (1-65535), got {port!r}")
        if self.dp_multi_node and not self.data_parallel_address:
            raise ValueError("replicas on several machines (data_parallel_size_local < data_parallel_size) need "
                             "--data-parallel-address: the head's address, routable from every node")
        if self.data_parallel_address in ("0.0.0.0", "::"):
            raise ValueError("--data-parallel-address: give the head's own address, which the other nodes reach")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        pp = self.pipeline_parallel_size
        if not _is_int(pp) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        if self.pipeline_depth is not None and (not _is_int(self.pipeline_depth) or self.pipeline_depth < 1):
            raise ValueError(f"pipeline_depth must be a positive integer or None, got {self.pipeline_depth!r}")
        self._check_nodes()
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}")
        if self.speculative_method not in (None, "mtp", "suffix"):
            raise ValueError(f"speculative_method must be 'mtp', 'suffix' or None, got {self.speculative_method!r}")
        if self.speculative_method is not None and self.speculative_model is not None:
            raise ValueError(f"give speculative_method={self.speculative_method!r} or speculative_model, not both")
        self._check_suffix()
        if self.drafts_with_model:
            what = "speculative_model" if self.speculative_model is not None else "speculative_method"
            if self.num_speculative_tokens < 1:
                raise ValueError(f"{what} needs num_speculative_tokens >= 1 (the tokens it drafts a step)")
            if tp > 1 or pp > 1:
                raise ValueError(f"{what} does not run with tensor_parallel_size or pipeline_parallel_size > 1 yet")
        if self.chat_template is not None:
            from streamer.server.chat_template import load_chat_template
            load_chat_template(self.chat_template)  # a missing file or a broken template fails here, not per request

    def _check_nodes(self) -> None:
        """The multi-node fields (docs/multi-node.md)."""
        for name, least in (("nnodes", 1), ("node_rank", 0), ("nproc_per_node", 1), ("master_port", 1)):
            v = getattr(self, name)
            if not (v is None and name in ("nproc_per_node", "master_port")) and (not _is_int(v) or v < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
        if self.master_port is not None and self.master_port > 65535:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in 0..nnodes-1, got {self.node_rank} of {self.nnodes}")
        for name in ("master_addr", "dist_host"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a host name or address, got {v!r}")
        if self.distributed_launcher not in ("streamer", "torchrun"):
            raise ValueError(f"distributed_launcher must be 'streamer' or 'torchrun', got {self.distributed_launcher!r}")
        if self.nnodes > 1 and self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({self.world_size} ranks) does not split "
                             f"over nnodes {self.nnodes}")

    @property
    def steps_in_flight(self) -> int:
        """Steps that may be in flight at once with pipeline stages (1 without them)."""
        return self.pipeline_depth or self.pipeline_parallel_size if self.pipeline_parallel_size > 1 else 1

    @property
    def dp_multi_node(self) -> bool:
        """Whether some of the data-parallel replicas run on other machines than this one."""
        local = self.data_parallel_size_local
        return local is not None and local < self.data_parallel_size

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_suffix(self) -> None:
        """The suffix_decoding_* fields (checked whatever the method: a bad value is an error, not ignored)."""
        if self.speculative_method == "suffix" and self.num_speculative_tokens < 1:
            raise ValueError("speculative_method='suffix' needs num_speculative_tokens >= 1 (the most tokens it drafts "
                             "a step)")
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            v = getattr(self, name)
            if not _is_int(v) or v < (2 if name.endswith("depth") else 0):
                raise ValueError(f"{name} must be an integer >= {2 if name.endswith('depth') else 0}, got {v!r}")
        if not _is_number(self.suffix_decoding_max_spec_factor) or not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not _is_number(self.suffix_decoding_min_token_prob) \
                or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")

    @property
    def drafts_with_model(self) -> bool:
        """Speculative drafts from a model (a draft checkpoint, an EAGLE head or the MTP layer), not token history."""
        return self.speculative_model is not None or self.speculative_method == "mtp"

    @classmethod
    def from_kwargs(cls, model: Optional[str] = None, **kwargs) -> "EngineConfig":
        """The config from engine arguments, as `LLM(...)` / `AsyncEngine(...)` take them. vLLM's arguments that
        change nothing here are accepted so that vLLM code runs as it is: trust_remote_code (no checkpoint code is
        ever run), disable_log_stats, enable_chunked_prefill=True (prefill is always chunked), tokenizer_mode /
        config_format / load_format "mistral" (the folder's files decide; see `_mistral_mode`)."""
        kwargs.pop("trust_remote_code", None)
        kwargs.pop("disable_log_stats", None)
        _mistral_mode(model, kwargs)
        if kwargs.pop("enable_chunked_prefill", True) is not True:
            raise ValueError("enable_chunked_prefill: prefill is always chunked here (max_num_batched_tokens "
                             "bounds a step's tokens)")
        spec = kwargs.pop("speculative_config", None)
        if spec is not None:
            kwargs = {**kwargs, **speculative_kwargs(spec)}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


# vLLM's speculative_config keys -> ours (the suffix_decoding_* ones are the same)
_SPEC_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "prompt_lookup_max",
              "prompt_lookup_min": "prompt_lookup_min", "model": "speculative_model",
              "suffix_decoding_max_tree_depth": "suffix_decoding_max_tree_depth",
              "suffix_decoding_max_cached_requests": "suffix_decoding_max_cached_requests",
              "suffix_decoding_max_spec_factor": "suffix_decoding_max_spec_factor",
              "suffix_decoding_min_token_prob": "suffix_decoding_min_token_prob"}
_SPEC_METHODS = {"ngram": None, "suffix": "suffix", "mtp": "mtp", "deepseek_mtp": "mtp", "eagle": None,
                 "eagle3": None, "draft_model": None}


def speculative_kwargs(spec: Any) -> dict[str, Any]:
    """vLLM's `speculative_config` (a dict, or its JSON as `--speculative-config` gives it) as engine arguments:
    method "ngram" (prompt lookup), "suffix", "mtp", or a draft model / EAGLE head by its `model` path."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"speculative_config: not JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS) - {"method"})
    if unknown:
        raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)} (supported: method, "
                         f"{', '.join(_SPEC_KEYS)})")
    method = spec.get("method", "draft_model" if spec.get("model") else "ngram")
    if method not in _SPEC_METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(_SPEC_METHODS)}, got {method!r}")
    if method in ("eagle", "eagle3", "draft_model") and not spec.get("model"):
        raise ValueError(f"speculative_config: method {method!r} needs a model (the draft checkpoint or head)")
    out = {_SPEC_KEYS[k]: v for k, v in spec.items() if k != "method"}
    out["speculative_method"] = _SPEC_METHODS[method]
    if out.get("num_speculative_tokens") is None:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    return out


def _mistral_mode(model: Optional[str], kwargs: dict[str, Any]) -> None:
    """vLLM's switches to Mistral's format (tokenizer_mode, config_format, load_format "mistral"), taken out of
    kwargs: the folder's files decide here (streamer/tokenizer/mistral_format.py reads a folder with params.json and no
    config.json; one with both reads transformers' files, the same weights). A switch to "mistral" for a folder
    without params.json is a ValueError."""
    named = []
    for key, allowed in (("tokenizer_mode", ("auto", "hf", "slow", "mistral")),
                         ("config_format", ("auto", "hf", "mistral"))):
        value = kwargs.pop(key, "auto")
        if value not in allowed:
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
        if value == "mistral":
            named.append(key)
    if kwargs.get("load_format") == "mistral":
        kwargs["load_format"] = "auto"
        named.append("load_format")
    if named and model is not None and not (Path(model).expanduser() / "params.json").is_file():
        raise ValueError(f"{' / '.join(named)} 'mistral' needs a folder in Mistral's format (params.json); "
                         f"{model} has none")
