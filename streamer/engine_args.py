"""The engine's command-line flags, shared by the `streamer` command (generate, chat) and the server's CLI
(serve, run-batch): `add_engine_args` adds them to a parser, `engine_kwargs` turns the parsed flags into
LLMEngine / AsyncEngine keyword arguments. Both CLIs import this module; neither imports the other for it."""
from __future__ import annotations

import argparse
import json
from typing import Any, Optional


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "pt", "dummy", "mistral"],
                   help="mistral: (vLLM's) a Mistral-format folder, which 'auto' also reads")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-itl-ms", type=_itl_target, default=None, metavar="MS",
                   help="inter-token latency target for streamed requests: prefill chunks are sized so that each "
                        "step stays within it (the step time is modelled on this device as it runs). Default: auto "
                        "(the largest of 2x the running decodes' own step time, that step x (1 + prompts waiting / "
                        "requests decoding), a tenth of the oldest prompt's wait, and 50 ms); "
                        "0: off (token budget only)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: the KV cache in float8_e4m3fn, twice the tokens in the same memory")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--state-checkpoints", type=int, default=None,
                   help="hybrid / recurrent models: recurrent-state checkpoints kept for prefix caching "
                        "(default: max-num-seqs, within the memory budget)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--priority-aging", type=float, default=None,
                   help="seconds of waiting that count as one priority level")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    g.add_argument("--no-jump-forward", dest="jump_forward", action="store_false",
                   help="structured outputs: sample every token, even those the grammar forces")
    g.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding: draft up to this many tokens per step by n-gram lookup in the "
                        "request's own tokens (0 = off)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram the drafts match")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram the drafts match")
    g.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="speculative decoding with this draft model (a checkpoint folder or GGUF file with the "
                        "model's tokenizer, or an EAGLE-1 / EAGLE-3 head) "
                        "instead of n-gram lookup; drafts --num-speculative-tokens tokens a step")
    g.add_argument("--speculative-method", default=None, choices=["mtp", "suffix"],
                   help="mtp: the checkpoint's own multi-token-prediction layer drafts (DeepSeek-V3 / R1, GLM-4.5, "
                        "Qwen3-Next, Nemotron-H); suffix: SuffixDecoding, n-gram drafts from earlier requests' "
                        "outputs too (agents, repeated queries); "
                        "drafts up to --num-speculative-tokens tokens a step")
    g.add_argument("--suffix-decoding-max-tree-depth", type=int, default=24,
                   help="suffix: the longest suffix of a request's tokens matched")
    g.add_argument("--suffix-decoding-max-cached-requests", type=int, default=1000,
                   help="suffix: finished requests whose outputs are kept to draft from (0: own tokens only)")
    g.add_argument("--suffix-decoding-max-spec-factor", type=float, default=1.0,
                   help="suffix: drafts up to this many times the match length")
    g.add_argument("--suffix-decoding-min-token-prob", type=float, default=0.1,
                   help="suffix: drafts stop where their estimated probability falls below this")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="vLLM's form of the above, e.g. '{\"method\": \"suffix\", \"num_speculative_tokens\": 8}' "
                        "(methods ngram, suffix, mtp, or a draft / EAGLE \"model\"); its keys win")
    g.add_argument("--speculative-max-batch", type=int, default=8,
                   help="draft only while at most this many requests run")
    g.add_argument("--sampling-backend", default=None, choices=["torch", "triton"],
                   help="triton: top-k/top-p/min-p without sorting the vocabulary (default: on CUDA the Triton "
                        "kernel for steps sampling >= 256 rows, torch otherwise)")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--enforce-eager", dest="enforce_eager", action="store_const", const=True, default=None,
                   help="never torch.compile the model")
    c.add_argument("--compile", dest="enforce_eager", action="store_const", const=False,
                   help="torch.compile the model also on CPU (default: `serve` compiles on every device, "
                        "`generate` on CUDA only)")
    g.add_argument("--cuda-graph-max-batch", type=int, default=256,
                   help="capture CUDA graphs for decode batches of up to this many requests (0 = off)")
    a = g.add_mutually_exclusive_group()
    a.add_argument("--async-scheduling", dest="async_scheduling", action="store_const", const=True, default=None,
                   help="schedule step N+1 while step N runs (default: on CUDA only)")
    a.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False,
                   help="schedule each step only after the previous one finished")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="streamed outputs go out every this many tokens after the first (fewer SSE events under "
                        "heavy load)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer over this many processes (one GPU each on CUDA)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into this many stages, each its own tensor-parallel group of processes, "
                        "with as many batches in flight (docs/multi-node.md)")
    g.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="MoE models: place whole experts on the --tensor-parallel-size ranks (each holds 1/T of "
                        "the experts) instead of a slice of every expert; attention, dense and shared-expert "
                        "layers stay tensor-parallel. No effect without -tp > 1, nor on a dense model")
    g.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data parallelism (docs/data-parallel.md)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="this many engine replicas, each its own process, device (GPU, or its share of the CPU "
                        "cores) and KV cache, behind one router (each a tensor-parallel group with -tp)")
    d.add_argument("--dp-routing", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"],
                   help="which replica takes a request: cache_aware (the longest cached prefix unless that replica "
                        "runs hot, then the least loaded), least_loaded (waiting*4+running) or round_robin")
    d.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None, metavar="K",
                   help="replicas on this machine (default: all of them); the others run on other nodes, started "
                        "with --headless (docs/data-parallel.md)")
    d.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0, metavar="S",
                   help="the first of this node's replicas (a --headless node: S..S+K-1; the head's are 0..K-1)")
    d.add_argument("--data-parallel-address", "-dpa", default=None, metavar="HOST",
                   help="the head's address, routable from every node (its rendezvous store and replica listener)")
    d.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None, metavar="PORT",
                   help="the head's rendezvous store's port, the same on every node (default: 29550)")
    d.add_argument("--dp-session-header", default="x-session-id", metavar="HEADER",
                   help="requests with this header go to one replica per value (session affinity; '' turns it off)")
    d.add_argument("--dp-max-restarts", type=int, default=3, metavar="N",
                   help="start a replica of this machine that died again, at most N times in all (0: never); not "
                        "once the weights were updated at runtime")
    n = p.add_argument_group("tensor parallelism over several machines (docs/multi-node.md)")
    n.add_argument("--nnodes", type=int, default=1, help="machines the tensor-parallel ranks span")
    n.add_argument("--node-rank", type=int, default=0,
                   help="this machine's place among them: 0 runs the engine and the server (the head); the others "
                        "run with --headless")
    n.add_argument("--master-addr", default=None, metavar="HOST",
                   help="the head's address, routable from every node (its rendezvous store and step listener)")
    n.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="the head's rendezvous store's port (default: 29501)")
    n.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="ranks on each node (default: the GPUs it has; on CPU, --tensor-parallel-size / --nnodes)")
    n.add_argument("--dist-host", default=None, metavar="HOST",
                   help="this node's routable address, which its ranks bind to (default: --master-addr on the head, "
                        "the address on the route to it elsewhere)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of the checkpoint's")
    g.add_argument("--quantization", default=None, choices=["fp8", "int4", "int8", "none"],
                   help="fp8: weights in FP8, FP8 matmuls (default for FP8 checkpoints on GPUs that have them); "
                        "int4: weights rounded to 4 bits, int4 kernels; int8 (CPU): weights rounded to 8 bits per "
                        "channel (GPTQ/AWQ/compressed-tensors 4-bit and channel-wise 8-bit checkpoints keep their "
                        "codes unless fp8 or none); none: dequantize any quantized checkpoint")
    g.add_argument("--no-mla-latent-cache", dest="mla_latent_cache", action="store_false",
                   help="DeepSeek-V2/V3: cache full per-head K/V instead of the compressed latent (~40x the bytes "
                        "per token for V3; faster where attention is compute-bound)")
    g.add_argument("--generation-config", default="auto",
                   help="where unset request fields take defaults from: auto (the model's generation_config.json: "
                        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (the API's "
                        "own defaults) or a folder holding a generation_config.json")
    g.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='generation_config.json keys that win over the file, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help='config.json keys that win over the checkpoint\'s, e.g. \'{"max_position_embeddings": 65536, '
                        '"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": '
                        '32768}}\' (nested configs such as text_config are amended key by key)')
    im = p.add_argument_group("images, videos and audio clips (vision- and audio-language models)")
    im.add_argument("--limit-images-per-prompt", type=int, default=16,
                    help="most images (videos, audio clips) one prompt may hold")
    im.add_argument("--encoder-cache-bytes", type=int, default=512 << 20,
                    help="bytes of image (audio) features kept for prompts still being computed (and repeats)")
    im.add_argument("--no-image-urls", dest="allow_image_urls", action="store_false",
                    help="the server reads images, videos and audio only from data: URLs, never fetching http(s) ones")
    im.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                    help="fetch http(s) image, video and audio URLs only from these hosts (names or IP addresses) "
                         "and their subdomains, trusted at any address, internal ones included (default: any host "
                         "whose addresses are all public, never loopback, private or link-local ones)")
    p.add_argument("--enable-prompt-embeds", action="store_true",
                   help="let requests give their prompt as embeddings (completions' prompt_embeds: base64 of "
                        "torch.save(tensor [length, hidden]))")
    v = p.add_argument_group("vLLM's spellings", "accepted so that vLLM command lines run as they are")
    v.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="(the default)")
    v.add_argument("--enable-chunked-prefill", action="store_true", help="(always on)")
    v.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf", "slow", "mistral"],
                   help="(the folder's files decide: tokenizer.json, a slow tokenizer's, or Mistral's tekken.json)")
    v.add_argument("--config-format", default="auto", choices=["auto", "hf", "mistral"],
                   help="(the folder decides: config.json, or Mistral's params.json where it has no config.json)")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="(ignored: streamer never runs code from a checkpoint; its architectures are built in)")
    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument("--enable-lora", action="store_true", help="let requests run with LoRA adapters")
    lo.add_argument("--max-loras", type=int, default=4, help="adapters the model holds at once")
    lo.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")


def _itl_target(text: str) -> Optional[float]:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds or 'auto': {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 milliseconds (0: off), got {text}")
    return value


_ENGINE_KEYS = ("dtype", "device", "load_format", "max_model_len", "max_num_batched_tokens", "max_itl_ms",
                "max_num_seqs",
                "block_size", "kv_cache_memory", "kv_cache_dtype", "gpu_memory_utilization", "num_kv_blocks",
                "enable_prefix_caching", "state_checkpoints", "scheduling_policy", "priority_aging", "attention_backend",
                "sampling_backend", "seed", "enforce_eager", "async_scheduling", "cuda_graph_max_batch",
                "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel", "nnodes", "node_rank",
                "master_addr", "master_port", "nproc_per_node", "dist_host", "data_parallel_size", "dp_routing",
                "dp_max_restarts", "dp_session_header", "data_parallel_size_local", "data_parallel_start_rank",
                "data_parallel_address", "data_parallel_rpc_port", "tokenizer", "jump_forward", "num_speculative_tokens",
                "prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch", "speculative_model",
                "speculative_method", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "speculative_config", "enable_lora", "max_loras", "max_lora_rank",
                "quantization", "generation_config", "override_generation_config", "hf_overrides", "tokenizer_mode",
                "config_format",
                "limit_images_per_prompt",
                "encoder_cache_bytes", "allow_image_urls", "allowed_media_domains", "mla_latent_cache",
                "stream_interval",
                "chat_template", "reasoning_parser", "enable_prompt_embeds")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _ENGINE_KEYS if hasattr(args, k)}
