"""`streamer bench` command line: usage errors (exit 2), full runs, result files, plot, compare, progress."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from streamer.bench import main
from streamer.bench.fake_server import FakeServer, Plan
from streamer.bench.report import RESULT_FORMAT, format_compare, plot_available
from streamer.bench.runner import Progress
from streamer.bench.testing import make_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer(lambda i, b: Plan(status=500) if "fail" in b.get("prompt", "") else Plan()) as s:
        yield s


BASE = ["--base-url", "http://127.0.0.1:9"]


@pytest.mark.parametrize("argv,message", [
    ([], "--base-url"),
    (["--base-url", "ftp://x"], "--base-url must look like"),
    (BASE + ["--num-prompts", "0"], "must be >= 1"),
    (BASE + ["--num-prompts", "ten"], "expected an integer"),
    (BASE + ["--input-len", "0"], "must be >= 1"),
    (BASE + ["--output-len", "-3"], "must be >= 1"),
    (BASE + ["--prefix-len", "-1"], "must be >= 0"),
    (BASE + ["--range-ratio", "1.0"], "must be in [0, 1)"),
    (BASE + ["--request-rate", "0"], "must be > 0"),
    (BASE + ["--request-rate", "nan"], "must be > 0"),
    (BASE + ["--request-rate", "fast"], "expected a number"),
    (BASE + ["--burstiness", "0"], "must be > 0"),
    (BASE + ["--max-concurrency", "0"], "must be >= 1"),
    (BASE + ["--num-warmups", "-1"], "must be >= 0"),
    (BASE + ["--timeout", "0"], "must be > 0"),
    (BASE + ["--percentiles", "0,50"], "percentiles must be in (0, 100]"),
    (BASE + ["--percentiles", "50,x"], "comma-separated"),
    (BASE + ["--goodput", "ttft"], "KEY:MS"),
    (BASE + ["--goodput", "itl:5"], "KEY:MS"),
    (BASE + ["--goodput", "ttft:-5"], "must be > 0"),
    (BASE + ["--endpoint", "vectors"], "invalid choice"),
    (BASE + ["--endpoint", "embeddings", "--ignore-eos"], "does not apply to --endpoint embeddings"),
    (BASE + ["--endpoint", "embeddings", "--goodput", "ttft:50"], "does not apply to --endpoint embeddings"),
    (BASE + ["--dataset", "file"], "needs --dataset-path"),
    (BASE + ["--dataset-path", "/no/such/file.json"], "is not a file"),
    (BASE + ["--dataset", "prefix", "--tokenizer", "TOK"], "needs --prefix-len"),
    (BASE, "no server answered GET http://127.0.0.1:9/v1/models: is it running?"),
    (BASE + ["--model", "not-a-folder"], "no server answered"),
    (BASE + ["--tokenizer", "/no/such/dir"], "cannot load a tokenizer"),
    (BASE + ["--extra-body", "[1]"], "expected a JSON object"),
    (BASE + ["--save-result", "/no/such/dir/r.json", "--tokenizer", "TOK"], "no such folder"),
    (BASE + ["--bogus"], "unrecognized arguments"),
])
def test_usage_errors_exit_2(argv: list[str], message: str, tokdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [tokdir if a == "TOK" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: streamer bench" in err and message in err


def test_plot_without_matplotlib_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tokdir: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("streamer.bench.report.plot_available", lambda: False)
    assert main(BASE + ["--tokenizer", tokdir, "--plot", "x.png"]) == 2
    assert "pip install 'streamer[plot]'" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--request-rate" in capsys.readouterr().out


def test_module_entry_point_exit_code() -> None:
    p = subprocess.run([sys.executable, "-m", "streamer.bench", "--base-url", "x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--base-url must look like" in p.stderr


def run_cli(server: FakeServer, tokdir: str, tmp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    res = tmp / "r.json"
    code = main(["--base-url", server.base_url, "--tokenizer", tokdir, "--input-len", "8", "--output-len", "5",
                 "--num-prompts", "20", "--max-concurrency", "5", "--save-result", str(res), *extra])
    return code, json.loads(res.read_text())


def test_full_run_table_and_result_file(server: FakeServer, tokdir: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_cli(server, tokdir, tmp_path, "--api-key", "s3cret", "--percentiles", "50,99.9",
                        "--goodput", "ttft:60000", "e2el:60000", "--progress", "on")
    out, err = capsys.readouterr()
    assert code == 0
    assert "Successful requests:" in out and "Request goodput (req/s):" in out and "P99.9 ITL (ms):" in out
    assert "20/20 requests" in err  # the progress bar's last frame
    assert doc["format"] == RESULT_FORMAT
    assert "api_key" not in doc["config"] and "s3cret" not in json.dumps(doc)
    assert doc["config"]["model"] == "fake" and doc["config"]["request_rate"] == "inf"
    assert server.received[-1]["model"] == "fake"  # discovered from GET /v1/models
    s = doc["summary"]
    assert s["completed"] == 20 and s["failed"] == 0 and s["total_output_tokens"] == 100
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert set(s["stats"]["itl"]) == {"mean", "median", "std", "p50", "p99.9"}
    r = doc["requests"][0]
    assert r["success"] and len(r["itl"]) == 4 and r["output_len"] == 5 and r["prompt_len"] > 0
    assert {"start", "ttft", "latency", "error", "asked_output_len"} <= set(r)


def test_all_failed_exits_1_with_errors_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["please fail"] * 3))
    with FakeServer(lambda i, b: Plan(status=500)) as srv:
        code = main(["--base-url", srv.base_url, "--model", "m", "--dataset-path", str(f), "--num-prompts", "3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Failed requests:" in out and "3 x HTTP 500: scripted failure" in out


def test_sharegpt_file_without_tokenizer(server: FakeServer, tmp_path: Path) -> None:
    f = tmp_path / "sg.json"
    f.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi there"},
                                                {"from": "gpt", "value": "hello"}]}]))
    res = tmp_path / "r.json"
    assert main(["--base-url", server.base_url, "--dataset-path", str(f), "--num-prompts", "4", "--output-len", "3",
                 "--endpoint", "chat", "--save-result", str(res)]) == 0
    doc = json.loads(res.read_text())
    assert doc["summary"]["completed"] == 4 and doc["summary"]["total_output_tokens"] == 12


def test_served_model_name(server: FakeServer, tokdir: str, tmp_path: Path) -> None:
    code, doc = run_cli(server, tokdir, tmp_path, "--model", tokdir, "--served-model-name", "alias")
    assert code == 0 and doc["config"]["model"] == "alias" and server.received[-1]["model"] == "alias"


def test_prefix_dataset_via_cli(server: FakeServer, tokdir: str, tmp_path: Path) -> None:
    code, doc = run_cli(server, tokdir, tmp_path, "--dataset", "prefix", "--prefix-len", "6", "--num-prefixes", "2",
                        "--request-rate", "200", "--burstiness", "2", "--seed", "4")
    assert code == 0 and doc["summary"]["completed"] == 20


@pytest.mark.parametrize("extra", [[], ["--model", "not-a-folder"]])
def test_a_live_server_without_a_tokenizer_is_a_usage_error(server: FakeServer, extra: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--base-url", server.base_url, *extra]) == 2
    assert "builds prompts with the model's tokenizer" in capsys.readouterr().err


def test_unreachable_model_listing_is_an_error(tokdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer() as srv:
        url = srv.base_url
    assert main(["--base-url", url, "--tokenizer", tokdir, "--num-prompts", "1"]) == 1
    assert "pass --model" in capsys.readouterr().err


def test_compare(server: FakeServer, tokdir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, a = run_cli(server, tokdir, tmp_path)
    (tmp_path / "a.json").write_text(json.dumps(a))
    b = json.loads(json.dumps(a))
    b["summary"]["request_throughput"] = a["summary"]["request_throughput"] * 2
    b["summary"]["stats"]["ttft"]["p99"] = a["summary"]["stats"]["ttft"]["p99"] / 4
    (tmp_path / "b.json").write_text(json.dumps(b))
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "B/A" in out
    assert [ln for ln in out.splitlines() if ln.startswith("Request throughput")][0].endswith("2.00x")
    assert [ln for ln in out.splitlines() if ln.startswith("p99 TTFT")][0].endswith("0.25x")
    assert "vllm" in format_compare(a, b, "vllm", "streamer")


@pytest.mark.parametrize("argv", [["compare", "only-one.json"], ["compare", "/no/a.json", "/no/b.json"]])
def test_compare_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage: streamer bench compare" in capsys.readouterr().err


def test_compare_rejects_other_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "x.json"
    f.write_text("{}")
    assert main(["compare", str(f), str(f)]) == 2
    assert "not a `streamer bench --save-result` file" in capsys.readouterr().err


@pytest.mark.skipif(not plot_available(), reason="matplotlib is an optional extra")
def test_plot(server: FakeServer, tokdir: str, tmp_path: Path) -> None:
    png = tmp_path / "p.png"
    code, _ = run_cli(server, tokdir, tmp_path, "--plot", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_render() -> None:
    p = Progress(4, enabled=False)
    p.add(True)
    p.add(False)
    line = p.render()
    assert line.startswith("\r[###############               ] 2/4 requests, 1 failed")


def test_demo_model_server_needs_no_tokenizer(tmp_path: Path) -> None:
    """`streamer serve` with no model serves the embedded demo model: its tokenizer ships with streamer, so a
    random-dataset run against it needs no --tokenizer (found through GET /v1/models)."""
    from streamer.demo_model import DEFAULT_MODEL_NAME

    res = tmp_path / "r.json"
    with FakeServer(model=DEFAULT_MODEL_NAME) as srv:
        assert main(["--base-url", srv.base_url, "--num-prompts", "3", "--input-len", "12", "--output-len", "2",
                     "--save-result", str(res), "--progress", "off"]) == 0
        prompts = [b["prompt"] for b in srv.received]
    doc = json.loads(res.read_text())
    assert doc["summary"]["completed"] == 3
    assert len(prompts) >= 3 and all(isinstance(p, str) and p for p in prompts)


def test_default_input_len_fits_the_servers_context(tokdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The default prompt length (1024) shrinks to what the server's reported max_model_len holds; an explicit
    length is kept, with a warning naming how many requests the server will refuse."""
    with FakeServer(max_model_len=300) as srv:
        assert main(["--base-url", srv.base_url, "--tokenizer", tokdir, "--num-prompts", "3", "--output-len", "20",
                     "--progress", "off"]) == 0
        err = capsys.readouterr().err
        assert "--input-len 140 (not 1024): the server's max_model_len is 300" in err
        assert "warning" not in err
        prompt_words = [len(b["prompt"].split()) for b in srv.received]
        assert prompt_words and max(prompt_words) <= 140  # whitespace words never outnumber the tokens
        srv.received.clear()
        assert main(["--base-url", srv.base_url, "--tokenizer", tokdir, "--num-prompts", "3", "--input-len", "400",
                     "--output-len", "20", "--progress", "off"]) == 0
        err = capsys.readouterr().err
        assert "3 of 3 requests need more than the server's max_model_len (300)" in err
        assert "(not 1024)" not in err
    with FakeServer() as srv:  # no max_model_len reported: the default stands, silently
        assert main(["--base-url", srv.base_url, "--tokenizer", tokdir, "--num-prompts", "2", "--output-len", "2",
                     "--progress", "off"]) == 0
        assert capsys.readouterr().err == ""


def test_reset_prefix_cache_gives_the_timed_run_a_cold_cache(llama_dir, capsys: pytest.CaptureFixture[str]) -> None:
    """--reset-prefix-cache: the warm-ups sent the same prompts, yet the timed run finds nothing cached (streamer's
    POST /reset_prefix_cache); without it, it finds their blocks. A server without the route stops the run."""
    from tests.server_utils import LiveServer

    def argv(seed: int, *more: str) -> list[str]:
        return ["--base-url", server.url, "--tokenizer", str(llama_dir), "--num-prompts", "2", "--input-len", "40",
                "--output-len", "2", "--num-warmups", "2", "--max-concurrency", "1", "--seed", str(seed),
                "--progress", "off", *more]

    with LiveServer(llama_dir, block_size=16) as server:
        kv = server.engine._core.kv  # type: ignore[union-attr]
        before = kv.prefix_hits
        assert main(argv(1, "--reset-prefix-cache")) == 0
        assert kv.prefix_hits == before  # (two distinct random prompts: the warm-ups share nothing either)
        assert main(argv(2)) == 0
        assert kv.prefix_hits - before == 2 * 32  # each timed prompt found its warm-up's two full blocks
    with FakeServer() as fake:
        args = argv(1, "--reset-prefix-cache")
        args[1] = fake.base_url
        assert main(args) == 1
        assert "POST /reset_prefix_cache failed (HTTP 404" in capsys.readouterr().err


def test_messages_endpoint_against_a_live_server(llama_dir, tmp_path: Path) -> None:
    """--endpoint messages drives Anthropic's /v1/messages: every request completes with the asked output length
    (message_delta's usage), the prompt lengths from message_start's."""
    from tests.server_utils import LiveServer

    res = tmp_path / "r.json"
    with LiveServer(llama_dir) as server:
        assert main(["--base-url", server.url, "--tokenizer", str(llama_dir), "--endpoint", "messages",
                     "--num-prompts", "4", "--input-len", "12", "--output-len", "5", "--ignore-eos",
                     "--max-concurrency", "2", "--save-result", str(res), "--progress", "off"]) == 0
    doc = json.loads(res.read_text())
    assert doc["summary"]["completed"] == 4 and doc["summary"]["failed"] == 0
    reqs = doc["requests"]
    assert [r["output_len"] for r in reqs] == [5] * 4 and all(r["output_len_source"] == "usage" for r in reqs)
    assert all(r["prompt_len"] > 0 for r in reqs)


def test_embeddings_endpoint_against_a_live_encoder(ckpt_root, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--endpoint embeddings drives /v1/embeddings: every request completes, its prompt length the server's usage
    (the encoder's [CLS] and [SEP] included), its latency its whole answer; the table shows the input side and
    end-to-end latency only."""
    pytest.importorskip("transformers")
    from tests.encoder_checkpoints import make_encoder_checkpoint
    from tests.server_utils import LiveServer
    model = ckpt_root / "bert-bench"
    if not (model / "config.json").exists():
        make_encoder_checkpoint(model)
    res = tmp_path / "r.json"
    with LiveServer(model) as server:
        assert main(["--base-url", server.url, "--tokenizer", str(model), "--endpoint", "embeddings",
                     "--num-prompts", "6", "--input-len", "12", "--max-concurrency", "2", "--goodput", "e2el:60000",
                     "--save-result", str(res), "--progress", "off"]) == 0
    table = capsys.readouterr().out
    assert "Input token throughput (tok/s):" in table and "End-to-end Latency" in table
    assert "Time to First Token" not in table and "Total generated tokens" not in table
    doc = json.loads(res.read_text())
    assert doc["summary"]["completed"] == 6 and doc["summary"]["failed"] == 0
    assert doc["summary"]["total_input_tokens"] == sum(r["prompt_len"] for r in doc["requests"])
    assert all(r["prompt_len"] == 14 and r["output_len"] == 0 and r["latency"] > 0 for r in doc["requests"])
    side_by_side = format_compare(doc, doc)  # (`streamer bench compare`: no token timings either)
    assert "Input throughput" in side_by_side and "E2EL" in side_by_side
    assert "TTFT" not in side_by_side and "Output throughput" not in side_by_side
    with FakeServer() as fake:  # (a server without /v1/embeddings: every request fails, the run says so)
        assert main(["--base-url", fake.base_url, "--tokenizer", str(model), "--endpoint", "embeddings",
                     "--num-prompts", "2", "--input-len", "4", "--progress", "off"]) == 1


def test_a_server_started_from_a_local_folder_needs_only_base_url(llama_dir, tmp_path: Path) -> None:
    """`python -m streamer.bench --base-url URL` against a streamer server started from a folder on this machine:
    the tokenizer is the folder's, found as the model's `root` in GET /v1/models (no --tokenizer, no --model)."""
    from tests.server_utils import LiveServer

    res = tmp_path / "r.json"
    with LiveServer(llama_dir) as server:
        p = subprocess.run([sys.executable, "-m", "streamer.bench", "--base-url", server.url, "--num-prompts", "2",
                            "--save-result", str(res)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"streamer bench: tokenizer from {llama_dir} (the model's root in GET /v1/models)" in p.stderr
    assert "--input-len 192 (not 1024): the server's max_model_len is 512" in p.stderr  # (512 - 128 output) / 2
    doc = json.loads(res.read_text())
    assert doc["summary"]["completed"] == 2 and doc["summary"]["failed"] == 0
    assert all(r["prompt_len"] == 192 + 1 for r in doc["requests"])  # the server's count: the prompt and a BOS


def test_a_server_whose_folder_is_elsewhere_lends_its_tokenizer(llama_dir, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The model's `root` is not on this machine (another host's folder): the random and prefix datasets are
    built with the server's POST /tokenize and /detokenize, and a prompt file's prompts and replies are counted
    with them, all with nothing but --base-url."""
    from streamer.bench.datasets import count_tokens, load_tokenizer
    from streamer.bench.remote_tokenizer import RemoteTokenizer
    from tests.server_utils import LiveServer

    routes: list[tuple[str, Any]] = []
    post = RemoteTokenizer._post

    def spy(self: RemoteTokenizer, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        routes.append((route, self.model))
        return post(self, route, body)

    monkeypatch.setattr(RemoteTokenizer, "_post", spy)
    local = load_tokenizer(llama_dir)
    res = tmp_path / "r.json"
    with LiveServer(llama_dir, served_model_name="tiny") as server:
        cards = server.app.state.server._model_cards
        monkeypatch.setattr(server.app.state.server, "_model_cards",
                            lambda: [{**c, "root": "/elsewhere/tiny-llama"} for c in cards()])
        for dataset in (["--dataset", "random"], ["--dataset", "prefix", "--prefix-len", "6"]):
            assert main(["--base-url", server.url, *dataset, "--num-prompts", "4", "--input-len", "20",
                         "--output-len", "3", "--ignore-eos", "--save-result", str(res), "--progress", "off"]) == 0
            err = capsys.readouterr().err
            assert ("tokenizing through the server's POST /tokenize and /detokenize (the model's root "
                    "'/elsewhere/tiny-llama' is no folder with a tokenizer on this machine") in err
            doc = json.loads(res.read_text())
            assert doc["summary"]["completed"] == 4 and doc["config"]["model"] == "tiny"
            want = 20 + int(dataset[1] == "prefix") * 6 + 1  # the server's count of each prompt: with its BOS
            assert [r["prompt_len"] for r in doc["requests"]] == [want] * 4
            assert {"/tokenize", "/detokenize"} <= {r for r, _ in routes} and {m for _, m in routes} == {"tiny"}
        routes.clear()
        reply = "a reply of some length, counted by the server"
        f = tmp_path / "sg.json"
        f.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi there"},
                                                    {"from": "gpt", "value": reply}]}]))
        assert main(["--base-url", server.url, "--dataset-path", str(f), "--num-prompts", "2", "--endpoint", "chat",
                     "--save-result", str(res), "--progress", "off"]) == 0
    doc = json.loads(res.read_text())
    assert [r["asked_output_len"] for r in doc["requests"]] == [count_tokens(local, reply)] * 2  # the reply's length
    assert {r for r, _ in routes} == {"/tokenize"}  # (a file needs no decoding)


def test_neither_a_local_root_nor_a_tokenize_route_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A server whose model folder is not here and that has no POST /tokenize: the random dataset cannot be
    built; the error says why and what to pass. (A prompt file still runs, its lengths left to the server.)"""
    class ElsewhereServer(FakeServer):
        def route(self, proto: Any, method: str, path: str, headers: dict[str, str], raw: bytes) -> None:
            if method == "GET" and path == "/v1/models":
                card = {"id": self.model, "object": "model", "root": "/no/such/model"}
                return proto.send(200, json.dumps({"object": "list", "data": [card]}).encode())
            return super().route(proto, method, path, headers, raw)

    with ElsewhereServer() as srv:
        assert main(["--base-url", srv.base_url, "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "the random dataset builds prompts with the model's tokenizer: pass --tokenizer PATH" in err
    assert "the model's root '/no/such/model' is no folder with a tokenizer on this machine" in err
    assert "POST /tokenize answered HTTP 404" in err
