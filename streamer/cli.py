"""The `streamer` command: generate, serve, bench."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from streamer.engine.structured_output import StructuredOutputsParams
from streamer.engine_args import add_engine_args, engine_kwargs  # noqa: F401  (also this module's API)
from streamer.sampling_params import SamplingParams


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
