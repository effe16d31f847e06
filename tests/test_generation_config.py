"""Default sampling from the checkpoint's generation_config.json (vLLM's `--generation-config auto`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from streamer import LLM
from streamer.engine.generation_config import sampling_defaults
from streamer.server.protocol import parse_chat, parse_completion
from tests.server_utils import LiveServer

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5, "do_sample": True,
               "bos_token_id": 1}


@pytest.fixture(scope="module")
def tuned_dir(llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny Llama with a generation_config.json that recommends a sampling (as Qwen3's and Llama-3's do)."""
    folder = tmp_path_factory.mktemp("tuned") / "llama"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return folder


def test_defaults_read_from_the_file(tuned_dir: Path) -> None:
    assert sampling_defaults("auto", tuned_dir) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    assert sampling_defaults("vllm", tuned_dir) == {}
    assert sampling_defaults(str(tuned_dir), Path("/nonexistent")) == sampling_defaults("auto", tuned_dir)
    # Overrides use the file's keys and win over it; they apply on top of "vllm" too.
    assert sampling_defaults("auto", tuned_dir, {"temperature": 0.0})["temperature"] == 0.0
    assert sampling_defaults("vllm", tuned_dir, {"max_new_tokens": 9}) == {"max_tokens": 9}
    # top_k 0 is transformers' "off": the engine's -1, not a refusal to start.
    assert sampling_defaults("auto", tuned_dir, {"top_k": 0})["top_k"] == -1


def test_bad_generation_config_is_a_clear_error(tuned_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown key"):
        sampling_defaults("auto", tuned_dir, {"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults("auto", tuned_dir, {"top_p": 7.0})
    with pytest.raises(ValueError, match="generation_config must be"):
        sampling_defaults(str(tmp_path / "missing"), tuned_dir)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        sampling_defaults(str(tmp_path), tuned_dir)


def test_request_fields_win_over_the_defaults() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5, "repetition_penalty": 1.1}
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, defaults).params
    assert (chat.temperature, chat.top_k, chat.max_tokens, chat.repetition_penalty) == (0.6, 20, 5, 1.1)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_k": 0,
                       "max_completion_tokens": 9}, defaults).params
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.0, -1, 9)
    cmpl = parse_completion({"prompt": "x"}, defaults).params
    assert (cmpl.temperature, cmpl.max_tokens) == (0.6, 5)
    assert parse_completion({"prompt": "x"}).params.max_tokens == 16  # OpenAI's default without a file


def test_llm_uses_the_checkpoint_sampling_when_given_none(tuned_dir: Path) -> None:
    with LLM(str(tuned_dir), dtype="float32", num_kv_blocks=64) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 5)
        out = llm.generate(["hello world"])[0].outputs[0]
        assert 1 <= len(out.token_ids) <= 5
    with LLM(str(tuned_dir), dtype="float32", num_kv_blocks=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params().temperature == 1.0


@pytest.mark.parametrize("source, expected", [("auto", 5), ("vllm", 16)])
def test_server_defaults_max_tokens_from_the_file(tuned_dir: Path, source: str, expected: int) -> None:
    import openai
    with LiveServer(tuned_dir, generation_config=source) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        out = client.completions.create(model=server.model_name, prompt="hello", extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == expected
        out = client.completions.create(model=server.model_name, prompt="hello", max_tokens=3,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        server.wait_idle()
