"""The classic families (GPT-NeoX, Falcon, GPT-J, OPT, Phi, GPTBigCode, GPT-2), whose checkpoints name tensors
otherwise than Llama, against transformers (+ PEFT) on the tiny random checkpoints of test_classic_families.py and
test_more_classic_families.py: LoRA adapters trained on the checkpoints' own module names (fused query_key_value /
c_attn included), the LM head tied or not whatever the embeddings are called, and embeddings of an OPT-350m-shaped
model whose final hidden states are narrower than its layers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM, LoRARequest, PoolingParams, SamplingParams  # noqa: E402
from tests import test_classic_families as classic  # noqa: E402  (registers gpt_neox, phi, gpt_bigcode, gpt2)
from tests import test_more_classic_families as more  # noqa: E402  (registers falcon, gptj, opt)
from tests.checkpoints import hf_greedy  # noqa: E402
from tests.parity import greedy, random_prompts  # noqa: E402

PROMPTS = random_prompts(4, seed=29, max_len=40)
MAX_NEW = 8
# Every case of both modules, by the folder name those modules build it under (so a session builds each once).
CASES: dict[str, dict[str, Any]] = {**{f"classic_{k}": v for k, v in classic.CASES.items()},
                                    **{f"more_classic_{k}": v for k, v in more.CASES.items()}}


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[..., Path]:
    """name -> its checkpoint; extra overrides build a variant under its own folder."""
    def make(name: str, **overrides: Any) -> Path:
        folder = name + "".join(f"_{k}_{v}" for k, v in sorted(overrides.items()))
        return make_ckpt(folder, **{**CASES[name], **overrides})
    return make


# ------------------------------------------------------------------------------------------------- LoRA
NEOX = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]  # GPT-NeoX's and Falcon's names
LORA_CASES = {
    "classic_neox": NEOX,  # query_key_value per head [q_h, k_h, v_h]
    "more_classic_falcon_7b": NEOX,  # multi-query [all q; k; v]
    "more_classic_falcon_40b": NEOX,  # grouped by kv head: [q_g..., k_g, v_g]
    "more_classic_gptj": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"],
    "more_classic_opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "more_classic_opt_350m": ["q_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "classic_phi": ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"],
    "classic_bigcode": ["c_attn", "c_proj", "c_fc"],  # multi-query c_attn; attn.c_proj and mlp.c_proj both
    "classic_gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D layers (PEFT's fan_in_fan_out)
}


@pytest.fixture(scope="module")
def lora(ckpt, tmp_path_factory) -> Callable[[str], tuple[Path, Path, list, list]]:
    """name -> (checkpoint, its adapter, PEFT's greedy tokens without and with the adapter), built once."""
    from tests.lora_adapters import make_adapter, peft_greedy
    root = tmp_path_factory.mktemp("classic_loras")
    cache: dict[str, tuple[Path, Path, list, list]] = {}

    def get(name: str) -> tuple[Path, Path, list, list]:
        if name not in cache:
            base = ckpt(name)
            adapter = make_adapter(base, root / name, 7, r=4, alpha=8, targets=LORA_CASES[name])
            cache[name] = (base, adapter, peft_greedy(base, None, PROMPTS, MAX_NEW),
                           peft_greedy(base, adapter, PROMPTS, MAX_NEW))
            assert cache[name][2] != cache[name][3], "an adapter that changes nothing proves nothing"
        return cache[name]
    return get


def _with_and_without(llm: LLM, adapter: Path) -> list[list[int]]:
    """Every prompt without the adapter and with it, in one batch."""
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    loras = [None] * len(PROMPTS) + [LoRARequest("a", str(adapter))] * len(PROMPTS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(LORA_CASES))
def test_adapter_on_checkpoint_names_matches_peft(lora, name) -> None:
    """An adapter on the family's own module names: the base model's and the adapter's tokens in one batch."""
    base, adapter, without, with_adapter = lora(name)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4) as llm:
        assert _with_and_without(llm, adapter) == without + with_adapter


def test_fused_qkv_adapter_over_two_ranks(lora) -> None:
    # Falcon-40B's grouped query_key_value: B cut into q, k, v by kv group, then each rank takes its heads' rows.
    base, adapter, without, with_adapter = lora("more_classic_falcon_40b")
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4, tensor_parallel_size=2) as llm:
        assert _with_and_without(llm, adapter) == without + with_adapter


def _write_adapter(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_unsupported_targets_are_refused_by_their_names(ckpt, tmp_path) -> None:
    # The LM head is no adapter target: refused, naming it and listing the targets in the family's own names; so is
    # a query_key_value whose B does not have the fused rows.
    pair = lambda m, rows: {f"base_model.model.{m}.lora_A.weight": torch.zeros(4, 64),  # noqa: E731
                            f"base_model.model.{m}.lora_B.weight": torch.zeros(rows, 4)}
    head = _write_adapter(tmp_path / "head", pair("embed_out", 512))
    qkv = _write_adapter(tmp_path / "qkv", pair("gpt_neox.layers.0.attention.query_key_value", 64))
    with LLM(str(ckpt("classic_neox")), dtype="float32", enable_lora=True, max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match=r"LoRA on 'embed_out' is not supported \(adapters may target dense, "
                                             r"dense_4h_to_h, dense_h_to_4h, query_key_value\)"):
            llm.add_lora("head", str(head))
        with pytest.raises(ValueError, match="query_key_value.* has 64 rows, expected 192"):
            llm.add_lora("qkv", str(qkv))
        assert not llm.engine.loras


# --------------------------------------------------------------------------------------------- tied heads
def _variant(src: Path, dst: Path, tie: bool, drop_head: bool) -> Path:
    """A copy of checkpoint `src` whose config.json says `tie_word_embeddings: tie`, without its LM head tensor
    (lm_head.weight, or GPT-NeoX's embed_out.weight) if `drop_head`."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": tie}))
    if drop_head:
        tensors = load_file(str(dst / "model.safetensors"))
        heads = [n for n in tensors if n in ("lm_head.weight", "embed_out.weight")]
        assert len(heads) == 1, list(tensors)
        del tensors[heads[0]]
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# Untied checkpoints of each family (its own head stored), and the name the head goes by.
UNTIED = {
    "classic_neox": {},  # gpt_neox.embed_in / embed_out
    "more_classic_falcon_40b": {},  # transformer.word_embeddings / lm_head
    "more_classic_gptj": {},  # transformer.wte / lm_head (with a bias)
    "more_classic_opt_bare": {},  # model.decoder.embed_tokens / lm_head
    "classic_phi": {},  # model.embed_tokens / lm_head (with a bias)
    "classic_bigcode": dict(tie_word_embeddings=False),  # transformer.wte / lm_head
    "classic_gpt2": dict(tie_word_embeddings=False),
}
HEAD_BIAS = ("more_classic_gptj", "classic_phi")  # (no tied head: its bias is its own)


@pytest.mark.parametrize("name", list(UNTIED))
def test_head_tied_or_not_whatever_the_names(ckpt, tmp_path, name) -> None:
    """A config that ties the head over a checkpoint storing its own (transformers uses that one) loads it; a
    checkpoint without a head loads tied where the config ties it, and is refused where it does not."""
    src = ckpt(name, **UNTIED[name])
    prompts = PROMPTS[:2]
    own = _variant(src, tmp_path / "own", tie=True, drop_head=False)
    want = hf_greedy(own, prompts, MAX_NEW)
    assert want == hf_greedy(src, prompts, MAX_NEW)  # (transformers reads the stored head)
    with LLM(str(own), dtype="float32") as llm:
        assert llm.engine.runner.model.lm_head is not None
        assert greedy(llm, prompts, MAX_NEW) == want

    tied = _variant(src, tmp_path / "tied", tie=True, drop_head=True)
    if name in HEAD_BIAS:
        with pytest.raises(ValueError, match="with tie_word_embeddings is not supported"):
            LLM(str(tied), dtype="float32")
    else:
        want = hf_greedy(tied, prompts, MAX_NEW)
        with LLM(str(tied), dtype="float32") as llm:
            assert llm.engine.runner.model.lm_head is None
            assert greedy(llm, prompts, MAX_NEW) == want

    headless = _variant(src, tmp_path / "headless", tie=False, drop_head=True)
    head = "embed_out.weight" if name == "classic_neox" else "lm_head.weight"
    with pytest.raises(ValueError, match=rf"missing 1 tensor\(s\): {head}; no LM head \({head}\), and config.json "
                                         "does not tie it"):
        LLM(str(headless), dtype="float32")


# ----------------------------------------------------------------------------------------------- embeddings
def test_opt_350m_embeddings_are_word_embed_proj_dim_wide(ckpt) -> None:
    """OPT-350m's final hidden states are project_out's (word_embed_proj_dim, 32 here, of hidden 64): embeddings
    that wide equal transformers' last_hidden_state, `dimensions` cuts them, and more than 32 is refused."""
    import transformers as tf
    path = ckpt("more_classic_opt_350m")
    model = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def reference(prompt: list[int], dims: int) -> np.ndarray:
        with torch.no_grad():
            v = model(torch.tensor([prompt])).last_hidden_state[0, -1, :dims].double()
        return (v / v.norm()).numpy()

    with LLM(str(path), dtype="float32") as llm:
        for dims in (None, 32, 10):
            outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(dimensions=dims))
            for out, p in zip(outs, PROMPTS):
                assert len(out.embedding) == (dims or 32)
                assert np.allclose(out.embedding, reference(p, dims or 32), atol=2e-5, rtol=1e-4)
        with pytest.raises(ValueError, match=r"dimensions \(33\) exceeds the model's embedding size 32"):
            llm.embed("hi", PoolingParams(dimensions=33))


def test_opt_350m_embeddings_endpoint_dimensions(ckpt) -> None:
    import httpx

    from tests.server_utils import LiveServer
    with LiveServer(ckpt("more_classic_opt_350m")) as live:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            body = {"model": live.model_name, "input": [PROMPTS[0]]}
            r = http.post("/v1/embeddings", json={**body, "dimensions": 32})
            assert r.status_code == 200, r.text
            assert len(r.json()["data"][0]["embedding"]) == 32
            r = http.post("/v1/embeddings", json={**body, "dimensions": 33})
            assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
