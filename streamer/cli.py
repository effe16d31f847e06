"""The `streamer` command: generate, serve, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from streamer.sampling_params import SamplingParams
from streamer.engine.structured_output import StructuredOutputsParams


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
    g.add_argument("--seed", type=int, default=0)
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
                "tensor_parallel_size", "tokenizer", "jump_forward", "num_speculative_tokens", "prompt_lookup_max",
                "prompt_lookup_min", "speculative_max_batch", "speculative_model",
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


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    o = g.add_mutually_exclusive_group()  # structured outputs
    o.add_argument("--json-schema", default=None, help="the output follows this JSON schema (a file or inline JSON)")
    o.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    o.add_argument("--regex", default=None, help="the output matches this regex")
    o.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    o.add_argument("--grammar", default=None, help="the output follows this Lark or GBNF grammar (a file or text)")


def _text_or_file(value: str) -> str:
    path = Path(value)
    try:
        return path.read_text() if len(value) < 4096 and path.is_file() else value
    except OSError:
        return value


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    structured = None
    if args.json_schema or args.json_object or args.regex or args.choice or args.grammar:
        structured = StructuredOutputsParams(
            json=_text_or_file(args.json_schema) if args.json_schema else None, json_object=args.json_object,
            regex=args.regex, choice=args.choice,
            grammar=_text_or_file(args.grammar) if args.grammar else None)
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          structured_outputs=structured)


def _describe_model(model: Optional[str]) -> str:
    if model:
        return model
    from streamer.demo_model import default_model_path
    return f"{default_model_path()} (the embedded demo model)"


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio
    from streamer.engine.async_engine import AsyncEngine
    try:
        params = sampling_params(args)
    except ValueError as e:
        print(f"streamer generate: error: {e}", file=sys.stderr)
        return 2
    print(f"model: {_describe_model(args.model)}", file=sys.stderr)

    kwargs = engine_kwargs(args)
    lora = None
    if args.lora:
        from streamer.engine.lora import LoRARequest
        lora, kwargs["enable_lora"] = LoRARequest(Path(args.lora).name or "adapter", args.lora), True

    async def run() -> None:
        prompt: Any = args.prompt
        data: dict[str, Any] = {}
        if args.image:  # a vision-language model: the prompt holds one image placeholder per --image
            from streamer.multimodal.inputs import decode_image
            data["image"] = [decode_image(Path(path).read_bytes()) for path in args.image]
        if args.audio:  # an audio-language model: one audio placeholder per --audio
            from streamer.multimodal.audio import decode_audio
            data["audio"] = [decode_audio(Path(path).read_bytes()) for path in args.audio]
        if data:
            prompt = {"prompt": args.prompt, "multi_modal_data": data}
        async with AsyncEngine(args.model, **kwargs) as engine:
            echoed = False  # the prompt is echoed once the engine took it (a bad one is only an error)
            async for out in engine.stream(prompt, params, lora_request=lora):
                sys.stdout.write(out.text if echoed else args.prompt + out.text)
                sys.stdout.flush()
                echoed = True
            sys.stdout.write("\n")

    try:
        asyncio.run(run())
    except (ValueError, OSError) as e:
        print(f"streamer generate: error: {e}", file=sys.stderr)
        return 1
    return 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model as `NAME MODEL` or `NAME --model MODEL` (main() merges the two)."""
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint folder or GGUF file (default: the embedded demo model)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the same, as a flag (either spelling)")


def _add_server_command(sub: Any, name: str, help: str, add_args: str, command: str) -> None:
    """A subcommand built on the server (streamer/server/cli.py): the model as `NAME MODEL` or `--model MODEL`,
    the engine's flags, then its own."""
    p = sub.add_parser(name, help=help)
    _add_model_args(p)
    add_engine_args(p)
    try:
        from streamer.server import cli as server_cli
        getattr(server_cli, add_args)(p)
        p.set_defaults(func=lambda args: getattr(server_cli, command)(args))
    except ImportError:
        p.set_defaults(func=lambda a: (print("server not available", file=sys.stderr), 1)[1])


# `streamer chat`'s sampling flags left unset take the model's generation_config.json values, else these.
_CHAT_SAMPLING = {"max_tokens": 512, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                  "repetition_penalty": 1.0}


def _chat_params(args: argparse.Namespace, model_defaults: dict[str, Any]) -> SamplingParams:
    filled = argparse.Namespace(**vars(args))
    for name, fallback in _CHAT_SAMPLING.items():
        if getattr(args, name) is None:
            setattr(filled, name, model_defaults.get(name, fallback))
    return sampling_params(filled)


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal: each line is a user message, the model's reply streams back; the history is
    rendered with the model's chat template on every turn. `/reset` starts over, `/exit` (or end of input) quits.
    Sampling as a chat client gets it: the model's recommended values (generation_config.json) where no flag says."""
    import asyncio
    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.chat_template import ChatTemplate
    from streamer.server.protocol import APIError
    try:
        _chat_params(args, {})  # (the flags checked before anything loads)
    except ValueError as e:
        print(f"streamer chat: error: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    print(f"model: {_describe_model(args.model)}", file=sys.stderr)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        async with AsyncEngine(args.model, **engine_kwargs(args)) as engine:
            params = _chat_params(args, engine.sampling_defaults)
            template = ChatTemplate.from_tokenizer(engine.tokenizer)
            system = [{"role": "system", "content": args.system}] if args.system else []
            messages = list(system)
            if interactive:
                print("streamer chat: a line is a message; /reset starts over, /exit quits", file=sys.stderr)
            while True:
                if interactive:
                    print("> ", end="", flush=True, file=sys.stderr)
                line = await loop.run_in_executor(None, sys.stdin.readline)
                text = line.rstrip("\n")
                if not line or text.strip() == "/exit":
                    return
                if text.strip() == "/reset":
                    messages = list(system)
                    continue
                if not text.strip():
                    continue
                turn = [*messages, {"role": "user", "content": text}]
                try:
                    rendered = template.render(turn)
                except APIError as e:
                    print(f"streamer chat: error: {e.message}", file=sys.stderr)
                    continue
                ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
                reply = []
                try:
                    async for out in engine.stream({"prompt": rendered, "prompt_token_ids": ids}, params):
                        sys.stdout.write(out.text)
                        sys.stdout.flush()
                        reply.append(out.text)
                except ValueError as e:  # this turn refused (the history outgrew max_model_len, ...): the
                    # conversation goes on without it, so the user can /reset or say something else
                    if reply:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                    print(f"streamer chat: error: {e} (message dropped; /reset starts over)", file=sys.stderr)
                    continue
                sys.stdout.write("\n")
                sys.stdout.flush()
                messages = [*turn, {"role": "assistant", "content": "".join(reply)}]

    try:
        asyncio.run(run())
    except (ValueError, OSError) as e:
        print(f"streamer chat: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamer", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    gen.add_argument("--model", default=None, help="HF checkpoint folder or GGUF file (default: the embedded demo model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--lora", default=None, metavar="PATH", help="run with this PEFT LoRA adapter folder")
    gen.add_argument("--image", action="append", default=None, metavar="FILE",
                     help="an image for a vision-language model (repeatable), in the order of the prompt's image "
                          "placeholders (e.g. LLaVA's <image>)")
    gen.add_argument("--audio", action="append", default=None, metavar="FILE",
                     help="an audio file for an audio-language model (repeatable), in the order of the prompt's "
                          "audio placeholders (Qwen2-Audio's <|AUDIO|>); WAV, or mp3 / flac / ... with PyAV")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="talk to a model on the terminal (its chat template, the history kept)")
    _add_model_args(chat)
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, **{name: None for name in _CHAT_SAMPLING})
    _add_server_command(sub, "serve", "run the OpenAI-compatible HTTP server", "add_serve_args", "cmd_serve")
    _add_server_command(sub, "run-batch", "answer an OpenAI Batch API file (JSONL requests) offline",
                        "add_run_batch_args", "cmd_run_batch")
    sub.add_parser("bench", help="load-test an OpenAI-compatible server (streamer bench --help)", add_help=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from streamer.bench.cli import main as bench_main
        return bench_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    flag = getattr(args, "model_flag", None)
    if flag is not None:  # `serve --model M`, as `serve M` (chat too)
        if args.model is not None and args.model != flag:
            parser.error(f"two models given: {args.model!r} and --model {flag!r}")
        args.model = flag
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
