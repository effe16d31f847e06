"""`streamer bench ...` and `streamer bench compare A.json B.json` (argv given here excludes the word "bench")."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Coroutine, Optional, Sequence, TypeVar
from urllib.parse import urlsplit

from tokenizers import Tokenizer

from streamer.bench import report
from streamer.bench.client import HttpClient
from streamer.bench.datasets import (
    AUDIO_RATE,
    AnyTokenizer,
    SampleRequest,
    add_audio,
    add_images,
    audio_requests,
    file_requests,
    load_tokenizer,
    synthetic_requests,
)
from streamer.bench.metrics import summarize
from streamer.bench.remote_tokenizer import RemoteTokenizer, RemoteTokenizerError
from streamer.bench.runner import BenchError, RunConfig, RunOutput, ServedModel, list_models, run

T = TypeVar("T")
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 1024, 128
DEFAULT_AUDIO_SECONDS, DEFAULT_LANGUAGE = 10.0, "en"
MAX_UPLOAD_BYTES = 25 * 2**20  # OpenAI's limit on a transcription upload (streamer's server keeps it too)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


# --- argument types: each raises ArgumentTypeError, which argparse turns into a usage error (exit 2) ------
def _int_at_least(low: int):  # type: ignore[no-untyped-def]
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0 or math.isnan(v):
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _ratio(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


def _percentiles(s: str) -> list[float]:
    try:
        ps = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 50,90,99, got {s!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {s!r}")
    return ps


def _goodput_item(s: str) -> tuple[str, float]:
    key, sep, val = s.partition(":")
    if not sep or key not in GOODPUT_KEYS:
        raise argparse.ArgumentTypeError(f"expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}, got {s!r}")
    return key, _positive_float(val)


def _json_object(s: str) -> dict[str, Any]:
    try:
        v = json.loads(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {s!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamer bench", description="Load-test an OpenAI-compatible streaming server. "
        "`streamer bench compare A.json B.json` compares two saved runs.")
    a = p.add_argument
    a("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is optional)")
    a("--model", help="model name sent to the server (default: first of GET /v1/models); a local folder also "
                      "serves as --tokenizer")
    a("--served-model-name", help="name sent in requests when it differs from --model")
    a("--tokenizer", help="folder with tokenizer.json (default: --model when it is a folder, else the model's `root` "
                          "folder in GET /v1/models when it is on this machine, else the server's own through its "
                          "POST /tokenize and /detokenize)")
    a("--endpoint", choices=("completions", "chat", "messages", "embeddings", "transcriptions"),
      default="completions",
      help="/v1/completions, /v1/chat/completions, Anthropic's /v1/messages, /v1/embeddings (an embedding "
           "model: one prompt a request; throughput in input tokens, latency end to end), or "
           "/v1/audio/transcriptions (a speech model: each request uploads its own synthetic WAV clip)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "file", "prefix"),
                   help="random prompts, a JSON/JSONL/ShareGPT file, or prefix-sharing groups "
                        "(default: file when --dataset-path is given, else random)")
    g.add_argument("--dataset-path", help="JSON list or JSONL of prompts, or a ShareGPT file")
    g.add_argument("--num-prompts", type=_int_at_least(1), default=1000)
    g.add_argument("--input-len", type=_int_at_least(1), default=None,
                   help=f"random tokens per prompt, after any shared prefix (default {DEFAULT_INPUT_LEN}, or less "
                        "where the server's max_model_len would not hold it)")
    g.add_argument("--output-len", type=_int_at_least(1), default=None,
                   help="max_tokens per request (default 128; for files: the file's, else 128)")
    g.add_argument("--range-ratio", type=_ratio, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=_int_at_least(0), default=0, help="tokens of shared prefix")
    g.add_argument("--num-prefixes", type=_int_at_least(1), default=10,
                   help="groups (distinct prefixes) of the prefix dataset")
    g.add_argument("--no-shuffle", action="store_true", help="keep the order of a prompt file")
    g.add_argument("--images-per-request", type=_int_at_least(0), default=0,
                   help="random-pixel images sent with each request as image_url parts (vision-language models; "
                        "needs --endpoint chat or messages); each request gets its own")
    g.add_argument("--image-size", type=_image_size, default=(512, 512), metavar="WxH",
                   help="the images' size in pixels (default 512x512)")
    g.add_argument("--audio-per-request", type=_int_at_least(0), default=0,
                   help="synthetic audio clips sent with each chat request as input_audio parts (audio-language "
                        "models; needs --endpoint chat); each request gets its own")
    g.add_argument("--audio-seconds", type=_positive_float, default=None,
                   help=f"--endpoint transcriptions (or --audio-per-request): length of each clip, 16 kHz mono "
                        f"16-bit WAV (default {DEFAULT_AUDIO_SECONDS:g}); every request gets its own synthetic sound")
    g.add_argument("--language", default=None,
                   help=f"--endpoint transcriptions: the `language` form field (default {DEFAULT_LANGUAGE}; \"\" "
                        "sends none, so that the server detects it)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="requests/s (default inf: all at once); arrivals form a gamma process")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the arrivals: 1 = Poisson, < 1 burstier, > 1 more uniform")
    g.add_argument("--max-concurrency", type=_int_at_least(1), default=None)
    g.add_argument("--num-warmups", type=_int_at_least(0), default=0, help="untimed requests sent first")
    g.add_argument("--reset-prefix-cache", action="store_true",
                   help="POST /reset_prefix_cache before the timed run (after the warm-ups), so that it starts with "
                        "a cold prefix cache (streamer; vLLM with VLLM_SERVER_DEV_MODE=1)")
    g.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos: true")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=_json_object, default={}, help="JSON object merged into every request")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=_positive_float, default=3600.0, help="seconds per request")
    g = p.add_argument_group("output")
    g.add_argument("--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], help="e.g. 50,90,99")
    g.add_argument("--goodput", type=_goodput_item, nargs="+", metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--save-result", metavar="FILE.json", help="summary plus every request's timings")
    g.add_argument("--plot", metavar="FILE.png", help="TTFT/ITL histograms and throughput (needs matplotlib)")
    g.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="live progress bar on stderr (auto: when stderr is a terminal)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-argument checks; parser.error exits 2 with the usage line."""
    u = urlsplit(args.base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        p.error(f"--base-url must look like http://HOST:PORT, got {args.base_url!r}")
    args.dataset = args.dataset or ("file" if args.dataset_path else "random")
    if args.dataset == "file":
        if not args.dataset_path:
            p.error("--dataset file needs --dataset-path")
        if not Path(args.dataset_path).is_file():
            p.error(f"--dataset-path {args.dataset_path!r} is not a file")
    elif args.dataset_path:
        p.error(f"--dataset-path is only for --dataset file, not {args.dataset}")
    if args.dataset == "prefix" and args.prefix_len < 1:
        p.error("--dataset prefix needs --prefix-len >= 1")
    if args.endpoint == "embeddings":
        for flag, given in (("--images-per-request", args.images_per_request), ("--ignore-eos", args.ignore_eos),
                            ("--goodput ttft / tpot", any(k != "e2el" for k, _ in args.goodput or ()))):
            if given:
                p.error(f"{flag} does not apply to --endpoint embeddings (nothing is generated)")
    if args.endpoint == "transcriptions":
        for flag, given in (("--dataset-path", args.dataset_path), ("--dataset", args.dataset != "random"),
                            ("--input-len", args.input_len is not None), ("--output-len", args.output_len is not None),
                            ("--prefix-len", args.prefix_len), ("--images-per-request", args.images_per_request),
                            ("--audio-per-request", args.audio_per_request), ("--ignore-eos", args.ignore_eos)):
            if given:
                p.error(f"{flag} does not apply to --endpoint transcriptions (each request sends a synthetic "
                        "audio clip; its transcript is as long as the model makes it)")
        args.audio_seconds = args.audio_seconds or DEFAULT_AUDIO_SECONDS
        args.language = DEFAULT_LANGUAGE if args.language is None else args.language.strip() or None
    else:
        for flag, given in (("--audio-seconds", None if args.audio_per_request else args.audio_seconds),
                            ("--language", args.language)):
            if given is not None:
                p.error(f"{flag} needs --endpoint transcriptions" + (" or --audio-per-request" if "audio" in flag
                                                                      else ""))
        if args.audio_per_request:
            if args.endpoint != "chat":
                p.error("--audio-per-request needs --endpoint chat (clips travel as input_audio content parts)")
            args.audio_seconds = args.audio_seconds or DEFAULT_AUDIO_SECONDS
    if args.images_per_request and args.endpoint == "completions":
        p.error("--images-per-request needs --endpoint chat or messages (images travel as content parts)")
    if args.plot and not report.plot_available():
        p.error("--plot needs matplotlib: pip install 'streamer[plot]'")
    for f in (args.save_result, args.plot):
        if f and not Path(f).resolve().parent.is_dir():
            p.error(f"cannot write {f!r}: no such folder")


def _tokenizer(p: argparse.ArgumentParser, args: argparse.Namespace, served: Optional[ServedModel],
               answered: bool = True) -> Optional[AnyTokenizer]:
    """The tokenizer the workload is built and counted with: --tokenizer, --model as a local folder, the demo
    model's (shipped with streamer), the folder the server's GET /v1/models names as the model's `root` when it is on
    this machine, else the server's own through POST /tokenize and /detokenize. The random and prefix datasets need
    one (a usage error names what was tried); a prompt file and transcriptions do without."""
    path = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if path is not None:
        try:
            return load_tokenizer(path)
        except Exception as e:  # any load failure is the user's path, not a crash
            p.error(f"cannot load a tokenizer from {path!r}: {e}")
    if args.endpoint == "transcriptions":
        return None
    builds = args.dataset in ("random", "prefix")  # (a prompt file only counts tokens with it)
    demo = _demo_tokenizer_if_served(served)
    if demo is not None:
        return load_tokenizer(demo)
    root = served.root if served is not None else None
    local = _root_tokenizer(root)
    if local is not None:
        print(f"streamer bench: tokenizer from {root} (the model's root in GET /v1/models)", file=sys.stderr)
        return local
    if not answered:  # (the likelier cause: nothing is listening there)
        if builds:
            p.error(f"no server answered GET {args.base_url.rstrip('/')}/v1/models: is it running? (Against a "
                    "server that does, the random and prefix datasets still need the model's tokenizer: "
                    "--tokenizer PATH, or --model as a local model folder, unless it serves the demo model.)")
        return None
    name = args.served_model_name or args.model or (served.id if served is not None else None)
    remote = RemoteTokenizer(args.base_url, model=name, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                             timeout=min(args.timeout, 60.0))
    here = (f"the model's root {root!r} is no folder with a tokenizer on this machine" if root
            else "GET /v1/models names no model folder")
    try:
        remote.check(decode=builds)
    except RemoteTokenizerError as e:
        remote.close()
        if builds:
            p.error(f"the {args.dataset} dataset builds prompts with the model's tokenizer: pass --tokenizer PATH "
                    f"(a folder with tokenizer.json) or --model as a local model folder. ({here}, and the server's "
                    f"own is not usable: {e})")
        return None
    print(f"streamer bench: tokenizing through the server's POST /tokenize and /detokenize ({here}; "
          "--tokenizer PATH tokenizes here)", file=sys.stderr)
    return remote


def _root_tokenizer(root: Optional[str]) -> Optional[Tokenizer]:
    """The tokenizer in the served model's folder when `root` names one on this machine (a server started from a
    local folder reports it so), else None."""
    if not root or not Path(root).is_dir():
        return None
    try:
        return load_tokenizer(root)
    except Exception:  # not a tokenizer's folder (e.g. an adapter's): the server's own comes next
        return None


def _served_model(args: argparse.Namespace) -> tuple[bool, Optional[ServedModel]]:
    """(whether the server answered GET /v1/models, the benchmarked model as it lists it: the one asked for, else
    the first; None when it does not answer or lists no such model: the run itself then reports why)."""
    async def query() -> tuple[bool, Optional[ServedModel]]:
        client = HttpClient(args.base_url, timeout=min(args.timeout, 10.0),
                            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"))
        try:
            models = await list_models(client)
        except BenchError:
            return False, None
        finally:
            await client.close()
        name = args.served_model_name or args.model
        return True, next((m for m in models if m.id == name), None if name else models[0])
    return run_loop(query())


def _demo_tokenizer_if_served(served: Optional[ServedModel]) -> Optional[str]:
    """`streamer serve` with no model serves the embedded demo model, whose tokenizer ships with this package:
    against such a server the bench needs no --tokenizer."""
    from streamer.demo_model import DEFAULT_MODEL_NAME, default_model_path

    return str(default_model_path()) if served is not None and served.id == DEFAULT_MODEL_NAME else None


def _fit_input_len(args: argparse.Namespace, served: Optional[ServedModel]) -> None:
    """The default prompt length, shortened where the server's context would not hold it: at most half of what
    max_model_len leaves after the output and any shared prefix (room for a chat template and --range-ratio)."""
    if args.input_len is not None or args.endpoint == "transcriptions":
        return
    args.input_len = DEFAULT_INPUT_LEN
    limit = served.max_model_len if served is not None else None
    if limit is None or args.dataset == "file":
        return
    fit = max(1, (limit - _output_len(args) - args.prefix_len) // 2)
    if fit < args.input_len:
        args.input_len = fit
        print(f"streamer bench: --input-len {fit} (not {DEFAULT_INPUT_LEN}): the server's max_model_len is {limit}",
              file=sys.stderr)


def _output_len(args: argparse.Namespace) -> int:
    """Tokens each request asks to generate: --output-len, its default, or none for embeddings (and for
    transcriptions, which ask for no length)."""
    return 0 if args.endpoint in ("embeddings", "transcriptions") else args.output_len or DEFAULT_OUTPUT_LEN


def _warn_if_too_long(requests: Sequence[SampleRequest], served: Optional[ServedModel]) -> None:
    limit = served.max_model_len if served is not None else None
    if limit is None:
        return
    over = sum(r.prompt_len + r.output_len > limit for r in requests)
    if over:
        print(f"streamer bench: warning: {over} of {len(requests)} requests need more than the server's "
              f"max_model_len ({limit}) tokens for prompt and output: the server will refuse them",
              file=sys.stderr)


def make_requests(args: argparse.Namespace, tok: Optional[AnyTokenizer]) -> list[SampleRequest]:
    if args.endpoint == "transcriptions":
        size = 44 + 2 * round(args.audio_seconds * AUDIO_RATE)
        if size > MAX_UPLOAD_BYTES:
            print(f"streamer bench: warning: each clip is {size / 2**20:.1f} MiB, more than the "
                  f"{MAX_UPLOAD_BYTES >> 20} MiB upload limit of OpenAI's API (and streamer's server): such a server "
                  "will refuse them",
                  file=sys.stderr)
        return audio_requests(args.num_prompts, args.audio_seconds, seed=args.seed)
    if args.dataset == "file":
        requests = file_requests(args.dataset_path, args.num_prompts, tok=tok, output_len=args.output_len,
                                 seed=args.seed, shuffle=not args.no_shuffle)
    else:
        assert tok is not None
        grouped = args.dataset == "prefix"
        requests = synthetic_requests(tok, args.num_prompts, input_len=args.input_len,
                                      output_len=_output_len(args), range_ratio=args.range_ratio,
                                      prefix_len=args.prefix_len, num_prefixes=args.num_prefixes if grouped else 1,
                                      seed=args.seed, shuffle=grouped)
    if args.images_per_request:
        add_images(requests, args.images_per_request, *args.image_size, seed=args.seed)
    if args.audio_per_request:
        add_audio(requests, args.audio_per_request, args.audio_seconds, seed=args.seed)
    return requests


def _image_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be WIDTHxHEIGHT, e.g. 512x384, got {text!r}") from None
    if not (0 < w <= 8192 and 0 < h <= 8192):
        raise argparse.ArgumentTypeError(f"each side must be in [1, 8192], got {text!r}")
    return w, h


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Runs the clients on one uvloop event loop (asyncio's when uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(coro)
    return uvloop.run(coro)


def _raise_fd_limit() -> None:
    """Many concurrent clients need many sockets: lift the soft open-files limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - best effort
        pass


def _config_record(args: argparse.Namespace, out: RunOutput) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k != "api_key"}  # never write secrets to disk
    cfg["model"] = out.model
    cfg["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    return cfg


def bench_main(argv: Sequence[str]) -> int:
    p = build_parser()
    try:
        args = p.parse_args(list(argv))
        _check(p, args)
        answered, served = _served_model(args)
        tok = _tokenizer(p, args, served, answered)
    except SystemExit as e:
        return int(e.code or 0)
    _fit_input_len(args, served)
    try:
        requests = make_requests(args, tok)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"streamer bench: error: {e}", file=sys.stderr)
        return 1
    _warn_if_too_long(requests, served)
    model = args.served_model_name or args.model or (served.id if served is not None else None)  # (asked once)
    cfg = RunConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                    request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, num_warmups=args.num_warmups, ignore_eos=args.ignore_eos,
                    reset_prefix_cache=args.reset_prefix_cache,
                    temperature=args.temperature, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                    timeout=args.timeout, seed=args.seed, extra_body=args.extra_body,
                    language=args.language if args.endpoint == "transcriptions" else None,
                    progress=args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty()))
    _raise_fd_limit()
    try:
        out = run_loop(run(cfg, requests, tok))
    except BenchError as e:
        print(f"streamer bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        if isinstance(tok, RemoteTokenizer):
            tok.close()
    summary = summarize(out.results, out.duration, args.percentiles, dict(args.goodput) if args.goodput else None)
    print(report.format_summary(summary, max_concurrency=args.max_concurrency, client_cpu=out.client_cpu,
                                embeddings=args.endpoint == "embeddings",
                                transcriptions=args.endpoint == "transcriptions"))
    if args.save_result:
        report.save_result(args.save_result, _config_record(args, out), summary, out.results, out.client_cpu)
    if args.plot:
        report.plot(args.plot, out.results, title=f"{out.model} @ {args.base_url}")
    return 0 if summary.completed else 1


def compare_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="streamer bench compare", description="Two saved runs side by side, B/A.")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--names", nargs=2, metavar=("NAME_A", "NAME_B"), help="column names (default: file names)")
    try:
        args = p.parse_args(list(argv))
        docs = [report.load_result(f) for f in (args.a, args.b)]
    except SystemExit as e:
        return int(e.code or 0)
    except (OSError, ValueError) as e:
        p.print_usage(sys.stderr)
        print(f"streamer bench compare: error: {e}", file=sys.stderr)
        return 2
    names = args.names or [Path(args.a).stem, Path(args.b).stem]
    print(report.format_compare(docs[0], docs[1], *names))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
