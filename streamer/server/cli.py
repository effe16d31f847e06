"""`streamer serve [MODEL]`: the engine and the HTTP server on one uvloop event loop.

SIGTERM/SIGINT stop accepting connections, let in-flight requests finish (up to --shutdown-timeout), abort the
rest, and exit 0. A second signal stops waiting. uvicorn's own signal capture is replaced because it re-raises
the signal after shutdown, which would end the process with -SIGTERM instead of 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Iterator, Optional

import uvicorn

from streamer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_RESPONSES_STORE_SIZE, CORSConfig, build_app
from streamer.server.audio_api import TranscriptionConfig
from streamer.server.connections import HttpLimits, connections_arg, header_bytes_arg, seconds_arg, uvicorn_config
from streamer.server.reasoning import PARSERS as REASONING_PARSERS
from streamer.server.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.kv_events import KVEventsConfig

logger = logging.getLogger("streamer.server")


LOG_STATS_SECONDS = 10.0
# A lost tensor-parallel rank: the server answers 503 for this long (in-flight requests have failed at once), then
# exits with status 1; whatever still holds it then (a step stuck in a collective) is cut this long after.
RANK_LOST_GRACE_S = 1.5
RANK_LOST_EXIT_S = 4.0
# The waiting queue's default bound: a flood gets 429s (and Retry-After) instead of a queue growing without end.
DEFAULT_MAX_WAITING = 4096


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port; the URL is printed)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on every endpoint "
                        "but /health and /ping (default: $STREAMER_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model ids clients may use; the first is the one reported (default: the folder name)")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="read tool calls in chat output (requests with `tools`) into OpenAI's tool_calls "
                        "(gpt-oss: 'openai', the default for it)")
    g.add_argument("--enforce-strict-tool-calling", action="store_true",
                   help="hold tool calls under tool_choice 'auto' to their tools' schemas as if every tool were "
                        "`strict: true` (hermes, deepseek_v3 / v31, llama3_json, kimi_k2 and mistral formats)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: --tool-call-parser alone turns parsing on")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's command lines: prompts are logged only with --enable-log-requests")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="read <think>...</think> (gpt-oss: its analysis channel, 'openai_gptoss', the default for "
                        "it) in chat output into message.reasoning_content")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="bound on queued requests (each holds its prompt's tokens in memory); past it the server "
                        f"answers 429 with Retry-After (default: {DEFAULT_MAX_WAITING})")
    g.add_argument("--wait-for-compile", action="store_true",
                   help="on CPU, answer only once the model is compiled (default: serve at once, eagerly, while a "
                        "thread compiles it, then switch; the log says when; benchmarks want this flag)")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get 413, refused by their Content-Length before they are read "
                        "(default: for a text-only model, the most a request to it could need: max_model_len x "
                        "its longest token x 12 bytes, between 1 MiB and 8 MiB; for a model that takes media, or "
                        f"with --enable-prompt-embeds, {DEFAULT_MAX_BODY_BYTES >> 20} MiB)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:{id}" (exact where token texts are not); a request\'s '
                        "return_tokens_as_token_ids overrides it")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters (off by default: prompts may be private)")
    g.add_argument("--max-log-len", type=_non_negative_int, default=None, metavar="N",
                   help="with --enable-log-requests: log at most N characters (or token ids) of each prompt")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
    g.add_argument("--header-timeout", type=seconds_arg, default=HttpLimits.header_timeout_s, metavar="S",
                   help="a request's headers must arrive within S seconds of the connection's start (or, kept "
                        "alive, of its next request's first byte): past it 408 and close; a connection that sent "
                        "nothing is closed (default: %(default)g)")
    g.add_argument("--body-timeout", type=seconds_arg, default=HttpLimits.body_timeout_s, metavar="S",
                   help="a request's whole body must arrive within S seconds of its headers: past it 408 and close "
                        "(default: %(default)g)")
    g.add_argument("--max-header-bytes", type=header_bytes_arg, default=HttpLimits.max_header_bytes, metavar="N",
                   help="request line and headers over N bytes get 431 (default: %(default)d)")
    g.add_argument("--max-connections", type=connections_arg, default=HttpLimits.max_connections, metavar="N",
                   help="open connections at most; past them a new one gets 503 and is closed (the soft open-file "
                        "limit is raised to the hard one at start) (default: %(default)d)")
    g.add_argument("--timeout-keep-alive", type=seconds_arg, default=HttpLimits.keep_alive_s, metavar="S",
                   help="an idle kept-alive connection is closed after S seconds (default: %(default)g)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) clients can ask for by name in `model` (implies --enable-lora);"
                        " also '{\"name\": ..., \"path\": ...}'")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (loads folders of this machine)")
    g.add_argument("--allow-weight-updates", action="store_true",
                   help="serve POST /update_weights_from_disk {\"model_path\"}: new weights of the served model, from "
                        "a checkpoint folder of this machine, loaded in place (RL rollouts); and /pause_generation, "
                        "/continue_generation, /is_paused")
    g.add_argument("--responses-store-size", type=int, default=DEFAULT_RESPONSES_STORE_SIZE, metavar="N",
                   help="how many /v1/responses responses to keep in memory for retrieval, previous_response_id and "
                        "background mode (least recently used out first; 0: store none)")
    g.add_argument("--transcription-fallback", default="0.2,0.4,0.6,0.8,1.0", metavar="T,T,...",
                   help="/v1/audio at temperature 0: a piece whose text repeats itself or whose tokens are unlikely "
                        "is decoded again at each of these temperatures in turn (OpenAI's whisper's fallback; "
                        "'' turns it off)")
    g.add_argument("--transcription-compression-ratio-threshold", type=float, default=2.4, metavar="R",
                   help="... a text whose zlib compression ratio is above R repeats itself")
    g.add_argument("--transcription-logprob-threshold", type=float, default=-1.0, metavar="L",
                   help="... tokens whose mean log-probability is below L are unlikely")
    g.add_argument("--transcription-no-speech-threshold", default="0.6", metavar="P",
                   help="/v1/audio: a piece whose <|nospeech|> probability is above P and whose tokens are unlikely "
                        "is silence: no text, no segment (OpenAI's whisper's rule; '' turns it off)")
    g.add_argument("--headless", action="store_true",
                   help="run this node's tensor-parallel ranks only (no engine, no HTTP server): a node of a "
                        "multi-node group, with its --node-rank (1..--nnodes-1) and the head's --master-addr / "
                        "--master-port (docs/multi-node.md)")
    g.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action="store_true", help="also log every HTTP request (uvicorn's access log)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no throughput / queue / KV-usage log line every 10 s while there is work")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), e.g. https://app.example.com or '*' "
                        "(default: none, no CORS headers)")
    g.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD", help="CORS: allowed methods")
    g.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER", help="CORS: allowed headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates against")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish what the prefix cache stores and evicts as vLLM's KV cache events, for KV-aware "
                        "routers (llm-d, Dynamo, vllm-router's kv_aware): vLLM's JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (fields: publisher, endpoint, "
                        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic; see docs/serving.md)")


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True,
                   help="JSONL of requests ({custom_id, method, url, body} a line; - for standard input)")
    g.add_argument("-o", "--output-file", required=True,
                   help="where the answers go, a JSON line each in input order (- for standard output)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once (default: twice --max-num-seqs)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids the lines' bodies may name")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS))
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS))
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def cmd_run_batch(args: argparse.Namespace) -> int:
    from streamer.config import EngineConfig
    from streamer.engine_args import engine_kwargs
    logging.getLogger("streamer").setLevel(args.log_level.upper())
    kwargs = engine_kwargs(args)
    if kwargs.get("enforce_eager") is None:
        kwargs["enforce_eager"] = False  # a batch job runs long: compiled, as `serve`
    try:
        cfg = EngineConfig.from_kwargs(args.model, **kwargs)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        lines = (sys.stdin.readlines() if args.input_file == "-"
                 else Path(args.input_file).read_text(encoding="utf-8").splitlines())
        out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    except (TypeError, ValueError, OSError) as e:
        print(f"streamer run-batch: error: {e}", file=sys.stderr)
        return 2
    concurrency = args.max_concurrency or 2 * cfg.max_num_seqs
    with contextlib.closing(out) if out is not sys.stdout else contextlib.nullcontext():
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_run_batch(args, kwargs, lines, out, concurrency))


async def _run_batch(args: argparse.Namespace, kwargs: dict, lines: list[str], out: IO[str],
                     concurrency: int) -> int:
    from streamer.engine.data_parallel import make_async_engine
    from streamer.server.batch import run_batch
    engine = make_async_engine(args.model, **kwargs)
    try:
        try:
            await engine.start()
        except Exception as e:  # a missing folder, a bad checkpoint
            print(f"streamer run-batch: error: {e}", file=sys.stderr)
            return 1
        app = build_app(engine, served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, responses_store_size=0)
        with frozen_startup_objects():
            summary = await run_batch(app, lines, out, concurrency, progress=sys.stderr.isatty())
    finally:
        await engine.stop()
    where = "standard output" if args.output_file == "-" else args.output_file
    print(f"streamer run-batch: {summary.total} requests, {summary.succeeded} succeeded, {summary.failed} failed; "
          f"answers in {where}", file=sys.stderr)
    return 0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals are handled by `_install_signal_handlers`


def _loop_factory() -> Optional[Callable[[], asyncio.AbstractEventLoop]]:
    try:
        import uvloop
    except ImportError:  # Windows: plain asyncio
        return None
    return uvloop.new_event_loop


def cmd_serve(args: argparse.Namespace) -> int:
    from streamer.config import EngineConfig
    from streamer.engine_args import engine_kwargs
    logging.getLogger("streamer").setLevel(args.log_level.upper())
    api_key = args.api_key or os.environ.get("STREAMER_API_KEY") or None
    kwargs = dict(engine_kwargs(args), max_waiting=args.max_waiting,
                  log_stats_interval=0.0 if args.disable_log_stats else LOG_STATS_SECONDS)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("streamer serve: error: --enable-auto-tool-choice needs --tool-call-parser (as vLLM's)", file=sys.stderr)
        return 2
    launched = _torchrun(args, kwargs)
    if launched is not None:
        return launched
    if args.headless and (kwargs.get("data_parallel_size") or 1) > 1:
        return _serve_dp_headless(args, kwargs)
    if args.headless:
        return _serve_headless(args, kwargs)
    if kwargs.get("data_parallel_start_rank"):
        print("streamer serve: error: --data-parallel-start-rank is for the other nodes, started with --headless "
              "(the head runs replicas 0..--data-parallel-size-local - 1)", file=sys.stderr)
        return 2
    if kwargs.get("node_rank"):
        print(f"streamer serve: error: --node-rank {kwargs['node_rank']} runs no engine: start that node with "
              "--headless (node 0 runs the engine and the server)", file=sys.stderr)
        return 2
    if kwargs.get("enforce_eager") is None:
        # A server runs for long: compile the model on every device (on CPU this costs ~15-60 s at the first
        # start, less from the on-disk cache, and buys 20-30% per decode step; `--enforce-eager` opts out).
        kwargs["enforce_eager"] = False
    # On CPU, answer while compiling (eagerly, then compiled); --wait-for-compile: not before it is done.
    kwargs["compile_in_background"] = not args.wait_for_compile
    for flag, value in (("--max-waiting", args.max_waiting), ("--responses-store-size", args.responses_store_size)):
        if value is not None and value < 0:
            print(f"streamer serve: error: {flag} must be >= 0", file=sys.stderr)
            return 2
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        print("streamer serve: error: --max-body-bytes must be >= 1", file=sys.stderr)
        return 2
    try:
        _check_tls(args)
        args.lora_modules = [parse_lora_module(m) for m in args.lora_modules or []]
        args.transcription = transcription_config(args)
    except ValueError as e:
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 2
    if args.lora_modules or args.allow_runtime_lora_updating:
        kwargs["enable_lora"] = True
    try:
        args.kv_events = _kv_events_config(args, kwargs)
    except (ValueError, ImportError) as e:
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 2
    try:  # bad engine arguments: one line and exit 2, before loading anything (not a traceback at start-up)
        EngineConfig.from_kwargs(args.model, **kwargs)
    except (TypeError, ValueError) as e:
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        code = runner.run(_serve(args, api_key, kwargs))
    if _compiling[0]:
        # The model still compiles in the background (a thread inside Inductor): the interpreter's shutdown would
        # tear that thread's C++ state down under it ("terminate called without an active exception", SIGABRT).
        # Everything is stopped and drained by now: leave at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


_compiling = [False]  # set as `serve` stops while the model still compiles in the background


def _kv_events_config(args: argparse.Namespace, kwargs: dict) -> "Optional[KVEventsConfig]":
    """--kv-events-config, checked (and pyzmq / msgspec found) before anything loads; one that publishes turns the
    engine's KV events on (without a publisher nothing would drain them)."""
    text = getattr(args, "kv_events_config", None)
    if text is None:
        return None
    from streamer.server.kv_events import KVEventsConfig, check_available
    config = KVEventsConfig.parse(text)
    if not config.publishes:
        return None
    check_available()
    if kwargs.get("enable_prefix_caching") is False:
        raise ValueError("--kv-events-config publishes what the prefix cache holds: it needs prefix caching "
                         "(drop --no-enable-prefix-caching)")
    kwargs["kv_events"] = True
    return config


def _torchrun(args: argparse.Namespace, kwargs: dict) -> Optional[int]:
    """Under torchrun (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, WORLD_SIZE > 1), every
    process it started runs `serve` alike: rank 0 goes on to serve (the engine meets the others at torchrun's store),
    the others become its tensor-parallel ranks here (the exit status returned). None: rank 0, or no torchrun."""
    from streamer.worker.rendezvous import torchrun_env
    placement = torchrun_env()
    if placement is None or placement["world"] == 1:
        return None
    if kwargs.get("tensor_parallel_size", 1) == 1:  # (the stages take the rest)
        kwargs["tensor_parallel_size"] = max(placement["world"] // kwargs.get("pipeline_parallel_size", 1), 1)
    kwargs["distributed_launcher"] = "torchrun"
    if placement["rank"] == 0:
        return None
    from streamer.config import EngineConfig
    from streamer.engine.llm_engine import resolve_model_dir
    from streamer.worker.model_runner import run_tensor_parallel_rank
    from streamer.worker.parallel import entry_of, layout_of, run_rank_process
    from streamer.worker.rendezvous import route_source
    try:
        layout = layout_of(EngineConfig.from_kwargs(args.model, **kwargs))
        model_dir = str(resolve_model_dir(args.model)) if args.model else None
    except (TypeError, ValueError, OSError) as e:
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 2
    env = os.environ
    spec = {"rank": placement["rank"], "world": layout.world, "local_rank": placement["local_rank"],
            "local_world": layout.nproc_per_node, "master": [layout.master_addr, layout.master_port],
            "host": layout.dist_host or route_source(env["MASTER_ADDR"], int(env["MASTER_PORT"])),
            "torchrun": True, "model_dir": model_dir}
    return run_rank_process(entry_of(run_tensor_parallel_rank), spec)


def _serve_headless(args: argparse.Namespace, kwargs: dict) -> int:
    """`serve --headless`: this node's tensor-parallel ranks, for the head's engine (no HTTP server)."""
    from streamer.config import EngineConfig
    from streamer.engine.llm_engine import resolve_model_dir
    from streamer.worker.model_runner import run_tensor_parallel_rank
    from streamer.worker.parallel import entry_of, layout_of
    from streamer.worker.rendezvous import run_node
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        layout = layout_of(EngineConfig.from_kwargs(args.model, **kwargs))
        if layout.nnodes == 1 or layout.node_rank == 0:
            raise ValueError("--headless runs the ranks of another node than the head: give it --nnodes > 1 and "
                             "its --node-rank (1..nnodes-1); node 0 runs the engine and the server")
        model_dir = str(resolve_model_dir(args.model)) if args.model else None
    except (TypeError, ValueError, OSError) as e:
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 2
    return run_node(layout, entry_of(run_tensor_parallel_rank), model_dir)


def _serve_dp_headless(args: argparse.Namespace, kwargs: dict) -> int:
    """`serve -dp N --data-parallel-size-local K --data-parallel-start-rank S --data-parallel-address HEAD
    --headless`: this node's data-parallel replicas, which join the head's router (docs/data-parallel.md)."""
    from streamer.config import EngineConfig
    from streamer.engine.data_parallel import run_headless_node
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_kwargs(args.model, **kwargs)
        if not config.dp_multi_node or not config.data_parallel_size_local or not config.data_parallel_start_rank:
            raise ValueError("--headless with --data-parallel-size runs some of the replicas of another node than "
                             "the head: give it --data-parallel-size-local K (1..N-1), --data-parallel-start-rank S "
                             "(>= 1: the head runs replicas 0..) and the head's --data-parallel-address")
    except (TypeError, ValueError, OSError) as e:
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 2
    try:
        return run_headless_node(config, args.model)
    except (RuntimeError, OSError) as e:  # (the head never came: the store's wait timed out)
        print(f"streamer serve: error: {e}", file=sys.stderr)
        return 1


def transcription_config(args: argparse.Namespace) -> TranscriptionConfig:
    """--transcription-fallback, its thresholds and the no-speech threshold (ValueError naming the flag)."""
    text = args.transcription_fallback.strip()
    try:
        temperatures = tuple(float(t) for t in text.split(",")) if text else ()
    except ValueError as e:
        raise ValueError(f"--transcription-fallback: {e}") from None
    silence = str(getattr(args, "transcription_no_speech_threshold", "0.6")).strip()
    try:
        no_speech = float(silence) if silence else None
        TranscriptionConfig(no_speech_threshold=no_speech)
    except ValueError as e:
        raise ValueError(f"--transcription-no-speech-threshold: {e}") from None
    try:
        return TranscriptionConfig(temperatures, args.transcription_compression_ratio_threshold,
                                   args.transcription_logprob_threshold, no_speech)
    except ValueError as e:
        raise ValueError(f"--transcription-fallback: {e}") from None


def _check_tls(args: argparse.Namespace) -> None:
    """--ssl-keyfile and --ssl-certfile together, loadable: checked before the model loads, not after."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_certfile is None:
        if args.ssl_ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            ssl.create_default_context(cafile=args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load the TLS key and certificate: {e}") from None


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
            name, path = d["name"], d["path"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules: {spec!r} is not a JSON object with 'name' and 'path'") from None
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
    if not name or not path:
        raise ValueError(f"--lora-modules: {spec!r} needs a name and a path")
    return name, path


async def _serve(args: argparse.Namespace, api_key: Optional[str], kwargs: dict) -> int:
    from sse_starlette.sse import AppStatus

    from streamer.engine.data_parallel import make_async_engine
    AppStatus.disable_automatic_graceful_drain()  # we drain: streams must finish, not be cut at SIGTERM
    shutdown = _Shutdown(args.shutdown_timeout)
    shutdown.install()  # before loading: a signal during start-up still exits 0
    engine = shutdown.engine = make_async_engine(args.model, **kwargs)  # (DataParallelEngine with -dp N)
    publisher = None
    try:
        try:
            events = getattr(args, "kv_events", None)
            if events is not None and not hasattr(engine, "kv_event_sinks"):  # -dp N: each replica its own
                engine.kv_events_config = events  # (port + rank)
            elif events is not None:  # (a port in use fails before the model loads)
                from streamer.server.kv_events import make_publisher
                publisher = make_publisher(args.kv_events)
                if publisher is not None:
                    engine.kv_event_sinks.append(publisher.sink)
            await engine.start()
            for name, path in args.lora_modules:
                await engine.add_lora(name, path)
        except Exception as e:  # a missing folder, a bad checkpoint or adapter, bad engine arguments
            print(f"streamer serve: error: {e}", file=sys.stderr)
            return 1
        if shutdown.requested:
            return 0
        if engine.config.world_size > 1 and engine.config.data_parallel_size == 1:
            asyncio.ensure_future(_exit_on_rank_loss(engine, shutdown))
        cors = (CORSConfig(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                           args.allow_credentials) if args.allowed_origins else None)
        app = build_app(engine, api_key=api_key, served_model_name=args.served_model_name,
                        max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        allow_lora_updates=args.allow_runtime_lora_updating,
                        allow_weight_updates=args.allow_weight_updates,
                        responses_store_size=args.responses_store_size, cors=cors,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                        enforce_strict_tool_calling=args.enforce_strict_tool_calling,
                        transcription=args.transcription)
        # The loop is ours already (uvloop via asyncio.Runner): uvicorn only reads `loop` in Server.run().
        limits = HttpLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                            max_header_bytes=args.max_header_bytes, max_connections=args.max_connections,
                            keep_alive_s=args.timeout_keep_alive)
        config = uvicorn_config(app, host=args.host, port=args.port, limits=limits,
                                loop="uvloop" if _loop_factory() else "asyncio", lifespan="off",
                                log_level=args.log_level, access_log=args.access_log,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                ssl_ca_certs=args.ssl_ca_certs,
                                # CAs given: clients must show a certificate one of them signed (mutual TLS)
                                ssl_cert_reqs=ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5.0)  # a backstop only
        server = shutdown.server = _Server(config)
        scheme = "https" if args.ssl_certfile else "http"
        announce = asyncio.ensure_future(_announce(server, app.state.server.model_name, scheme))
        try:
            with frozen_startup_objects():
                await server.serve()
        except SystemExit as e:  # uvicorn exits this way when it cannot bind
            return int(e.code or 1)
        finally:
            announce.cancel()
        return 1 if engine.rank_lost is not None else 0
    finally:
        await engine.stop()  # whatever outlived the drain is aborted here
        logger.info("engine stopped")
        done = getattr(getattr(getattr(engine, "engine", None), "runner", None), "compile_done", None)
        _compiling[0] = done is not None and not done.is_set()
        if publisher is not None:
            publisher.close()
        if shutdown.server is not None:
            await _let_requests_end(shutdown.server)


async def _exit_on_rank_loss(engine: "AsyncEngine", shutdown: "_Shutdown") -> None:
    """A lost tensor-parallel rank ends the server: the engine has failed the in-flight requests and /health
    answers 503; after RANK_LOST_GRACE_S the server stops and the process exits 1 (cut RANK_LOST_EXIT_S after the
    loss if something still holds it), leaving restarts to whatever supervises it."""
    procs = list(engine.engine.runner.tp_workers.procs) if engine.engine.runner.tp_workers else []
    why = await engine.wait_rank_lost()
    logger.error("%s: in-flight requests failed; /health answers 503; exiting", why)
    threading.Thread(target=_exit_after, args=(RANK_LOST_EXIT_S, procs), name="streamer-exit", daemon=True).start()
    await asyncio.sleep(RANK_LOST_GRACE_S)
    if shutdown.server is not None:
        shutdown.server.should_exit = True
        await asyncio.sleep(1.0)
        shutdown.server.force_exit = True


def _exit_after(seconds: float, procs: list) -> None:
    time.sleep(seconds)
    for p in procs:  # (this node's other ranks: no orphans)
        if p.poll() is None:
            p.kill()
    print("streamer serve: exiting after the loss of a tensor-parallel rank", file=sys.stderr, flush=True)
    os._exit(1)


@contextlib.contextmanager
def frozen_startup_objects() -> Iterator[None]:
    """Move every object alive now (the model, compiled graphs, imported modules: ~420k on the demo model) out of
    the cyclic garbage collector's reach until the server stops. A full collection walks them all, and one comes
    whenever enough new objects have survived: a ~220 ms pause of the event loop and the steps, in the middle of
    serving (bench/RESULTS.md, session 16). vLLM and SGLang freeze theirs too. Undone on the way out, so that
    teardown sees them."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Shutdown:
    """First SIGTERM/SIGINT: uvicorn stops accepting and waits for open responses, while the engine gets
    `timeout` seconds to finish what it runs and then aborts the rest, so those streams end with
    finish_reason "abort" and [DONE] rather than being cut. A second signal stops waiting."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.requested = False
        self.server: Optional[uvicorn.Server] = None
        self.engine: Optional["AsyncEngine"] = None
        self._drain: Optional[asyncio.Future] = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # Windows' loops cannot
                loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        if self.requested:
            logger.warning("%s again: exiting without waiting for in-flight requests", sig.name)
            if self.server is not None:
                self.server.force_exit = True
            return
        self.requested = True
        logger.info("%s: not accepting new connections; waiting up to %gs for in-flight requests", sig.name,
                    self.timeout)
        if self.server is not None:
            self.server.should_exit = True
        if self.engine is not None and self.engine.is_alive:
            self._drain = asyncio.ensure_future(self.engine.stop(drain_timeout=self.timeout))


async def _let_requests_end(server: uvicorn.Server, timeout: float = 1.0) -> None:
    """After a forced exit (a second signal) the requests still open were aborted with the engine: a moment for
    their responses to say so (a stream's last chunk, finish_reason "abort", and [DONE]). Those that still run are
    then cancelled with the loop, and end where they are (app.py's `_Unhandled`)."""
    tasks = set(server.server_state.tasks)
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


async def _announce(server: uvicorn.Server, model_name: str, scheme: str = "http") -> None:
    while not server.started:
        await asyncio.sleep(0.02)
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
            if ":" in host:
                host = f"[{host}]"
            print(f"streamer: serving {model_name} at {scheme}://{host}:{port}/v1 (health: /health, metrics: /metrics)",
                  flush=True)
            return
