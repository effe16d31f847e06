"""Llama 4 (streamer/models/llama4.py) against transformers' Llama4ForCausalLM and Llama4ForConditionalGeneration
(fp32, tiny random checkpoints: tests/checkpoints.py's "llama4" family: chunked attention in chunks of 8 on the
rope layers, a NoPE layer with temperature tuning, q/k L2 norms, top-1 MoE layers between dense ones): greedy tokens
and prompt logprobs, with prefill chunks that cross attention chunks, compiled, with top-2 routing, from per-expert
checkpoint tensors and from a Llama4ForConditionalGeneration checkpoint (text model only; images refused); the
per-layer choices against transformers' config; and, so that those tests can fail, each of Llama 4's differences
undone in the loaded model changes the tokens."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.llama4 import Llama4Attention, Llama4Layers, Llama4MoE  # noqa: E402
from tests.checkpoints import hf_config  # noqa: E402
from tests.parity import assert_logprobs_match, greedy, random_prompts, reference_cache  # noqa: E402

MAX_NEW = 10
CASES: dict[str, dict[str, Any]] = {
    "base": dict(family="llama4"),
    # every layer sparse, two experts a token (their outputs summed, each from its own scaled input); no NoPE layer
    # temperature tuning, and the chunk larger than a block
    "top2": dict(family="llama4", seed=1, num_experts_per_tok=2, interleave_moe_layer_step=1,
                 attn_temperature_tuning=False, attention_chunk_size=12),
}


# 20-40 tokens: every prompt crosses attention chunks (and one stays inside one)
PROMPTS = random_prompts(6, seed=5, min_len=20, max_len=41) + [[7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"llama4_{name}", **CASES[name])


@pytest.fixture(scope="module")
def refs(ckpt) -> Callable[[str], list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per case (computed once)."""
    return reference_cache(ckpt, PROMPTS, MAX_NEW, min_distinct=5)


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name,engine_args", [
    ("base", {}),
    # prefill chunks of 6 tokens over blocks of 4 beside other requests' decodes: chunks cross attention chunks
    # and attend their cached context
    ("base", dict(max_num_batched_tokens=6, block_size=4)),
    ("top2", dict(max_num_batched_tokens=16, block_size=8)),
], ids=["base", "base-chunked-prefill", "top2-chunked-prefill"])
def test_matches_transformers(ckpt, refs, name, engine_args) -> None:
    path = ckpt(name)
    with LLM(str(path), dtype="float32", **engine_args) as llm:
        assert greedy(llm, PROMPTS, MAX_NEW) == refs(name)
        assert greedy(llm, PROMPTS[1:2], MAX_NEW) == refs(name)[1:2]  # a lone request
        assert_logprobs_match(llm, path, PROMPTS[:2])
        model = llm.engine.runner.model
        attns = [layer.self_attn for layer in model.layers]
        chunk = CASES[name].get("attention_chunk_size", 8)
        assert [a.attn.spec.attention_chunk for a in attns] == [chunk, None, chunk, chunk]
        sparse = [isinstance(layer.mlp, Llama4MoE) for layer in model.layers]
        assert sparse == ([False, True, False, True] if name == "base" else [True] * 4)


def test_compiled_matches_transformers(ckpt, refs) -> None:
    """Compiled: the experts' op and the attention op in the graphs, and a lone request's decode inline in the
    graph (`forward_decode`, its chunk bound computed in the graph)."""
    with LLM(str(ckpt("base")), dtype="float32", enforce_eager=False) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:3], MAX_NEW) == refs("base")[:3]
        assert greedy(llm, PROMPTS[3:4], MAX_NEW) == refs("base")[3:4]
        assert llm.engine.runner.compiled  # no eager fallback on the way


def test_per_expert_checkpoint_tensors(ckpt, refs, tmp_path) -> None:
    """The same weights with each expert's matrices stored apart (experts.E.{gate,up,down}_proj.weight, as some
    quantized checkpoints store them) load to the same model."""
    src = ckpt("base")
    dst = tmp_path / "per_expert"
    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        base = name.removesuffix("gate_up_proj")
        gate_up, down = tensors.pop(name), tensors.pop(f"{base}down_proj")
        inter = gate_up.shape[-1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{base}{e}.gate_proj.weight"] = gate_up[e, :, :inter].t().contiguous()
            tensors[f"{base}{e}.up_proj.weight"] = gate_up[e, :, inter:].t().contiguous()
            tensors[f"{base}{e}.down_proj.weight"] = down[e].t().contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with LLM(str(dst), dtype="float32") as llm:
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, Llama4MoE)]
        assert moes and not any(m.fused for m in moes)
        assert greedy(llm, PROMPTS[:3], MAX_NEW) == refs("base")[:3]
    # and a missing expert is named in the checkpoint's spelling
    tensors.pop("model.layers.3.feed_forward.experts.2.up_proj.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.3\.feed_forward\.experts\.2\.up_proj\.weight"):
        LLM(str(dst), dtype="float32")


# ------------------------------------------------------------------------------- Llama4ForConditionalGeneration
def _make_vlm_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """A Llama4ForConditionalGeneration checkpoint (the released Scout / Maverick's class): the "llama4" family's
    text model under `language_model.`, beside a tiny vision model and projector."""
    import transformers as tf

    from tests.tokenizer_factory import make_bytelevel_tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    make_bytelevel_tokenizer(out_dir)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(1 for t in tok["added_tokens"] if t["id"] >= len(tok["model"]["vocab"]))
    text = hf_config("llama4", vocab)
    vision = tf.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32,
                                   projector_output_dim=32)
    cfg = tf.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=vocab - 1)
    torch.manual_seed(seed)
    tf.Llama4ForConditionalGeneration(cfg).save_pretrained(out_dir)
    return out_dir


def test_conditional_generation_checkpoint(ckpt_root) -> None:
    import numpy as np
    import transformers as tf
    from PIL import Image

    path = ckpt_root / "llama4_vlm"
    if not (path / "config.json").exists():
        _make_vlm_checkpoint(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]
    # (its text model generates: transformers' Llama4ForConditionalGeneration.forward fails on text-only inputs,
    # reading `image_outputs` from the text model's output, and hands text-only inputs to its text model anyway)
    model = tf.Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).language_model.eval()
    prompts = PROMPTS[:4]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            want.append(gen[0, len(p):].tolist())
    assert sum(len(set(r)) for r in want) > 5 * len(want), "degenerate reference"
    with LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8) as llm:
        cfg = llm.engine.model_config
        assert cfg.architecture == "Llama4ForCausalLM" and cfg.text_only_of == "Llama4ForConditionalGeneration"
        assert cfg.multimodal is None
        assert greedy(llm, prompts, MAX_NEW) == want
        image = Image.fromarray(np.zeros((28, 28, 3), dtype=np.uint8))
        with pytest.raises(ValueError, match="vision encoder is not supported"):
            llm.generate({"prompt_token_ids": prompts[0], "multi_modal_data": {"image": image}})


# ------------------------------------------------------------------------------------------------ config
def test_layers_follow_transformers_config() -> None:
    """Llama4Layers derives what transformers' Llama4TextConfig does, from a Scout-like config.json (no_rope_layers
    empty: every 4th layer NoPE; attn_temperature_tuning a number, as some configs have it) and a Maverick-like one
    (MoE every 2nd layer, no q/k norm, no rope scaling)."""
    import transformers as tf
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1)
    scout = dict(base, no_rope_layers=[], attn_temperature_tuning=4, attention_chunk_size=8192, use_qk_norm=True,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}, rope_theta=500000.0)
    maverick = dict(base, no_rope_layers=[], interleave_moe_layer_step=2, use_qk_norm=False, rope_scaling=None)
    for raw in (scout, maverick):
        hf = tf.Llama4TextConfig(**dict(raw, attn_temperature_tuning=True))  # (transformers 5 takes a bool only)
        layers = Llama4Layers.from_config(ModelConfig.from_dict(dict(raw, architectures=["Llama4ForCausalLM"])))
        assert layers.rope == [bool(f) for f in hf.no_rope_layers]
        assert layers.chunked == [t == "chunked_attention" for t in hf.layer_types]
        assert layers.sparse == [i in hf.moe_layers for i in range(8)]
        assert layers.qk_norm == raw["use_qk_norm"] and layers.temperature == (0.1, 8192.0)
    assert Llama4Layers.from_config(ModelConfig.from_dict(dict(scout, architectures=["Llama4ForCausalLM"]))).rope \
        == [True, True, True, False] * 2
    bad = ModelConfig.from_dict(dict(scout, architectures=["Llama4ForCausalLM"], num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Llama4Layers.from_config(bad)


def test_rotary_and_qk_norm_match_transformers() -> None:
    """The interleaved rotary (and the L2 norm after it) against transformers' own functions."""
    from transformers.models.llama4 import modeling_llama4 as m

    from streamer.models.layers import RotaryEmbedding
    from streamer.models.llama4 import l2_norm
    hf = m.Llama4TextConfig(head_dim=16, hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                             "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(30, 4, 16, generator=g), torch.randn(30, 2, 16, generator=g)
    pos = torch.arange(100, 130)
    freqs = m.Llama4TextRotaryEmbedding(hf)(q, pos[None])
    want_q, want_k = m.apply_rotary_emb(q[None], k[None], freqs)
    ours = RotaryEmbedding(16, 512, 10000.0, dict(hf.rope_parameters), is_neox=False)
    got_q, got_k = ours(pos, q, k)
    assert torch.allclose(got_q, want_q[0], atol=1e-5) and torch.allclose(got_k, want_k[0], atol=1e-5)
    neox_q, _ = RotaryEmbedding(16, 512, 10000.0, dict(hf.rope_parameters))(pos, q, k)
    assert not torch.allclose(neox_q, want_q[0], atol=1e-2)
    assert torch.allclose(l2_norm(got_q, 1e-5), m.Llama4TextL2Norm(1e-5)(want_q[0]), atol=1e-6)


# ------------------------------------------------------------------------------------------------ mutations
@pytest.fixture(scope="module")
def base_llm(ckpt):
    with LLM(str(ckpt("base")), dtype="float32", enable_prefix_caching=False) as llm:
        yield llm


@pytest.mark.parametrize("mutation", ["no attention chunks", "no temperature tuning", "no qk norm",
                                      "neox rotary", "no shared expert", "scores scale the output"])
def test_features_matter(base_llm, refs, mutation, monkeypatch) -> None:
    """The parity tests can fail: with one of Llama 4's differences undone in the loaded model, greedy tokens leave
    transformers'."""
    model = base_llm.engine.runner.model
    attns = [m for m in model.modules() if isinstance(m, Llama4Attention)]
    for a in attns:
        if mutation == "no attention chunks":
            monkeypatch.setattr(a.attn.spec, "attention_chunk", None)
        elif mutation == "no temperature tuning":
            monkeypatch.setattr(a, "temperature", None)
        elif mutation == "no qk norm":
            monkeypatch.setattr(a, "l2_eps", None)
        elif mutation == "neox rotary":
            monkeypatch.setattr(a.rotary, "is_neox", True)
    if mutation == "no shared expert":
        forward = Llama4MoE.forward
        monkeypatch.setattr(Llama4MoE, "forward", lambda self, x: forward(self, x) - self.shared_expert(x))
    elif mutation == "scores scale the output":
        from streamer.models.moe import SparseMoE
        monkeypatch.setattr(Llama4MoE, "forward", lambda self, x: self.shared_expert(x) + SparseMoE.forward(self, x))
    assert greedy(base_llm, PROMPTS, MAX_NEW) != refs("base")
    monkeypatch.undo()
    assert greedy(base_llm, PROMPTS, MAX_NEW) == refs("base")  # (and undone, they agree again)
