"""`hf_overrides` (vLLM's; `--hf-overrides JSON`): config.json keys that win over the checkpoint's, e.g. to run a
model past its trained length with rope scaling. The engine with an override writes what transformers writes on a
copy of the checkpoint whose config.json says the same."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streamer import LLM, SamplingParams
from streamer.models.config import ModelConfig, with_overrides
from tests.checkpoints import hf_greedy

PROMPTS = [[5, 9, 200, 3, 17, 88, 120, 7, 7, 31, 64, 2, 90, 14, 15, 16, 300, 301] * 3, [40, 41, 42]]
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


def edited_copy(src: Path, dst: Path, overrides: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(with_overrides(cfg, overrides)))
    return dst


def test_rope_scaling_and_length(make_ckpt, tmp_path):
    path = make_ckpt("hfo_llama", family="llama", max_position_embeddings=64)
    theta = json.loads((path / "config.json").read_text()).get("rope_parameters", {}).get("rope_theta", 10000.0)
    overrides = {"max_position_embeddings": 256,
                 "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}}
    with LLM(str(path), dtype="float32") as llm:
        assert llm.engine.max_model_len == 64
        plain = tokens(llm)
    with LLM(str(path), dtype="float32", hf_overrides=overrides) as llm:
        assert llm.engine.max_model_len == 256
        assert llm.engine.model_config.rope_scaling["factor"] == 4.0
        scaled = tokens(llm)
        llm.update_weights(str(path))  # (a checkpoint of this model: it is checked with the same overrides)
    assert scaled != plain
    assert scaled == hf_greedy(edited_copy(path, tmp_path / "edited", overrides), PROMPTS, NEW)


def test_nested_configs_are_amended_key_by_key():
    base = {"architectures": ["X"], "text_config": {"hidden_size": 64, "max_position_embeddings": 512},
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    got = with_overrides(base, {"text_config": {"max_position_embeddings": 4096}, "rope_scaling": {"factor": 8.0}})
    assert got["text_config"] == {"hidden_size": 64, "max_position_embeddings": 4096}
    assert got["rope_scaling"] == {"factor": 8.0}  # (not a nested config: replaced whole)
    assert base["text_config"]["max_position_embeddings"] == 512  # (the original is left alone)


def test_a_vlms_text_config(make_ckpt, tmp_path):
    from tests.checkpoints import make_llava_checkpoint
    path = make_llava_checkpoint(tmp_path / "llava")
    before = ModelConfig.from_dir(path).max_position_embeddings
    cfg = ModelConfig.from_dir(path, {"text_config": {"max_position_embeddings": before * 2}})
    assert cfg.max_position_embeddings == before * 2 and cfg.multimodal is not None


def test_bad_overrides(make_ckpt):
    path = make_ckpt("hfo_llama", family="llama", max_position_embeddings=64)
    for bad in ("max_position_embeddings=256", [1], {1: 2}):
        with pytest.raises(ValueError, match="hf_overrides must be a dict"):
            LLM(str(path), hf_overrides=bad)
    for bad, message in [({"num_hidden_layers": "two"}, "num_hidden_layers is int in config.json \\(2\\), got 'two'"),
                         ({"num_hidden_layers": 2.5}, "num_hidden_layers is int"),
                         ({"max_position_embeddings": -3}, "max_position_embeddings must be a positive integer"),
                         ({"hidden_size": True}, "hidden_size is int")]:
        with pytest.raises(ValueError, match=f"hf_overrides: {message}"):
            LLM(str(path), hf_overrides=bad)
    cli = subprocess.run([sys.executable, "-m", "streamer", "generate", str(path), "--prompt", "x",
                          "--hf-overrides", "[1]"], capture_output=True, text=True)
    assert cli.returncode == 2 and "--hf-overrides: must be a JSON object" in cli.stderr
