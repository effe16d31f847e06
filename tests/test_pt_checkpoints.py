"""Checkpoints that ship PyTorch .bin files instead of safetensors (models/weight_files.py): one file or shards with
an index, tied embeddings stored twice, a LoRA adapter's adapter_model.bin; the same tokens as transformers reading
the same .bin files. `load_format` picks between the two kinds; a .bin that would run code is refused."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from streamer import LLM, LoRARequest, SamplingParams
from tests.checkpoints import hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], [7, 7, 8]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def to_bin(src: Path, dst: Path, shards: int = 1) -> Path:
    """src's folder with its safetensors written as transformers 4 wrote .bin checkpoints: pytorch_model.bin, or
    pytorch_model-0000i-of-0000n.bin shards and pytorch_model.bin.index.json. Tied tensors share storage."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if "lm_head.weight" in state and "model.embed_tokens.weight" in state and \
            torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # (one storage, two names, as torch.save keeps)
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _tokens(path: Path, **kw) -> list[list[int]]:
    with LLM(str(path), dtype="float32", **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]


@pytest.mark.parametrize("family, shards", [("llama", 1), ("llama", 3), ("qwen2", 2)], ids=["one", "sharded", "tied"])
def test_bin_checkpoints_load_as_transformers_reads_them(make_ckpt, tmp_path, family, shards):
    src = make_ckpt(family, family=family)
    path = to_bin(src, tmp_path / "bin", shards)
    assert not list(path.glob("*.safetensors"))
    want = hf_greedy(path, PROMPTS, PARAMS.max_tokens)  # (transformers reading the .bin files)
    assert _tokens(path) == want == _tokens(src)


def test_load_format_picks_the_files(llama_dir, tmp_path):
    # Both kinds in one folder, the .bin's weights different: "pt" reads them, "auto" and "safetensors" do not.
    path = to_bin(llama_dir, tmp_path / "both")
    for f in llama_dir.glob("*.safetensors"):
        shutil.copy(f, path / f.name)
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    torch.save({n: t * 1.5 if t.ndim == 2 else t for n, t in state.items()}, path / "pytorch_model.bin")
    base = _tokens(path)
    assert _tokens(path, load_format="safetensors") == base != _tokens(path, load_format="pt")
    only_bin = to_bin(llama_dir, tmp_path / "only-bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        LLM(str(only_bin), load_format="safetensors")
    (only_bin / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"safetensors or pytorch_model\*\.bin"):
        LLM(str(only_bin))


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_RunsCode.marker}",))


def test_a_bin_that_would_run_code_is_refused(llama_dir, tmp_path):
    path = to_bin(llama_dir, tmp_path / "evil")
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    _RunsCode.marker = tmp_path / "ran"
    torch.save({**state, "extra": _RunsCode()}, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a weights-only PyTorch checkpoint"):
        LLM(str(path))
    assert not _RunsCode.marker.exists()


def test_lora_adapter_bin(llama_dir, tmp_path):
    pytest.importorskip("peft")
    from tests.lora_adapters import ALL_LINEARS, make_adapter
    st = make_adapter(llama_dir, tmp_path / "st", seed=3, r=4, alpha=8, targets=ALL_LINEARS)
    binary = tmp_path / "bin"
    shutil.copytree(st, binary, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(str(st / "adapter_model.safetensors")), binary / "adapter_model.bin")
    with LLM(str(llama_dir), dtype="float32", enable_lora=True) as llm:
        outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                                                              lora_request=LoRARequest(name, 1 + i, str(path)))]
                for i, (name, path) in enumerate((("st", st), ("bin", binary)))]
        plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    assert outs[0] == outs[1] != plain
