"""Gemma 4 (streamer/models/gemma4.py) against transformers' Gemma4ForCausalLM and Gemma4ForConditionalGeneration on
tiny random checkpoints (fp32):

- "gemma4" (the E2B / E4B shape): per-layer embeddings, the last two layers sharing the KV of earlier ones (one
  sliding, one global) with double-wide MLPs, global layers with heads twice as wide and proportional rotary;
- "gemma4_moe" (the 26B-A4B shape): a MoE block beside every dense MLP, global layers with k = v and one kv head.

Greedy tokens (a batch, a lone request) and prompt logprobs, whole and chunked prefill, compiled; prefix caching; the
KV cache's per-layer geometry (the shared layers own none); a vision-language checkpoint served as its text model;
and, so that the parity can fail, each feature undone in the loaded model changes the tokens."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.models import gemma4  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from tests.checkpoints import hf_greedy, register_family  # noqa: E402
from tests.parity import PREFILL_MODES, assert_matches_transformers, checkpoint_variant, greedy, prompts_of_lengths  # noqa: E402

S, F = "sliding_attention", "full_attention"
MAX_NEW = 8


def _dense_config(**kw: Any):
    """6 layers (global at 1 and 5), sliding window 8, heads of 16 (global: 32); PLE of 8 per layer; layers 4 and 5
    read the KV of layers 3 and 1, with MLPs twice as wide; logits soft-capped."""
    import transformers as tf
    kw.update(num_hidden_layers=6, layer_types=[S, F, S, S, S, F], head_dim=16, global_head_dim=32, sliding_window=8,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=kw["vocab_size"], num_kv_shared_layers=2,
              use_double_wide_mlp=True, final_logit_softcapping=30.0, pad_token_id=0)
    return tf.Gemma4TextConfig(**kw)


def _moe_config(**kw: Any):
    """5 layers (global at 2 and 4: k = v, one kv head of 32), no PLE; beside each dense MLP 4 experts of 32, top 2."""
    import transformers as tf
    kw.update(num_hidden_layers=5, layer_types=[S, S, F, S, F], head_dim=16, global_head_dim=32, sliding_window=8,
              hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
              enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, pad_token_id=0)
    return tf.Gemma4TextConfig(**kw)


def _randomise(model: Any) -> None:
    """transformers starts the norms, router scales and layer scalars at one: random ones show each is loaded and
    used where it belongs."""
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
            p.normal_(1.0, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.uniform_(0.5, 1.5)


register_family("gemma4", _dense_config, _randomise)
register_family("gemma4_moe", _moe_config, _randomise)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths((1, 5, 9, 17, 40, 70), seed=3)  # (past the window of 8, several times)


@pytest.fixture(scope="module")
def refs(make_ckpt, prompts):
    cache: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(family: str) -> tuple[Path, list[list[int]]]:
        if family not in cache:
            path = make_ckpt(family, family=family)
            ref = hf_greedy(path, prompts, MAX_NEW)
            assert len({tuple(r) for r in ref}) == len(prompts), "degenerate reference"
            cache[family] = path, ref
        return cache[family]
    return get


@PREFILL_MODES
@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_matches_transformers(refs, prompts, family, engine_args) -> None:
    path, ref = refs(family)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=96, **engine_args)
    assert_matches_transformers(llm, path, prompts, ref, MAX_NEW)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_compiled_matches_transformers(refs, prompts) -> None:
    path, ref = refs("gemma4")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=96, enforce_eager=False)
    assert llm.engine.runner.compiled
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert greedy(llm, prompts[4:5], MAX_NEW) == ref[4:5]  # (a lone request's decode attends inside the graph)


def test_kv_cache_per_layer_geometry_and_sharing(refs, prompts) -> None:
    """Each layer's cache has its attention's geometry; the KV-shared layers own none (the block budget counts
    only the others), and a prefix-cache hit (their source layers' cached blocks) gives the same tokens."""
    path, ref = refs("gemma4")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=96, block_size=8, enable_prefix_caching=True)
    runner = llm.engine.runner
    assert runner.model.kv_source == [0, 1, 2, 3, 3, 1]
    shapes = [tuple(c.shape) for c in runner.kv_caches]
    assert shapes == [(2, 97, 8, 2, 16), (2, 97, 8, 2, 32), (2, 97, 8, 2, 16), (2, 97, 8, 2, 16), (0,), (0,)]
    assert runner.kv_bytes_per_block() == 2 * 8 * 2 * 4 * (16 + 32 + 16 + 16)  # (k and v, 8 slots, 2 heads, fp32)
    assert greedy(llm, prompts, MAX_NEW) == ref
    hits = llm.engine.kv.prefix_hits
    assert greedy(llm, prompts, MAX_NEW) == ref  # (the long prompts' full blocks now come from the cache)
    assert llm.engine.kv.prefix_hits >= hits + 8 + 40 + 64
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_kv_shared_layers_never_write_the_cache(refs, prompts) -> None:
    """A KV-shared layer's backend reads its source's cache and stores nothing (a second store of the same values
    made the compiled decode graph copy the whole cache each step: 1.5 tokens/s instead of 53 on the bench model):
    given other k / v on that lone-decode path, the cache is unchanged."""
    from streamer.attention.base import DecodeBatch
    path, _ = refs("gemma4")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, block_size=8)
    layer = llm.engine.runner.model.layers[5].self_attn
    assert layer.shared and layer.attn.spec.kv_shared and not llm.engine.runner.model.layers[1].self_attn.shared
    cache = torch.randn(2, 33, 8, 2, 32)
    before = cache.clone()
    q, k, v = torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    table = torch.tensor([[3, 4]], dtype=torch.int32)
    decode = DecodeBatch(torch.tensor([3 * 8 + 2, 33 * 8 + 3 * 8 + 2]), table, torch.tensor([11]), 1)
    layer.attn.forward_decode(q, k, v, cache, decode)
    assert torch.equal(cache, before)
    layer.attn.spec.kv_shared = False  # (the check can fail: a writing layer changes it)
    layer.attn.forward_decode(q, k, v, cache, decode)
    assert not torch.equal(cache, before)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_tp2_matches_transformers(refs, prompts, family) -> None:
    """Two ranks (gloo): heads split (the MoE model's lone global kv head replicated, k = v on each rank), experts
    split along their intermediate size, the per-layer embeddings whole on every rank."""
    path, ref = refs(family)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=96, max_num_batched_tokens=16) as llm:
        attn = llm.engine.runner.model.layers[1 if family == "gemma4" else 2].self_attn
        assert attn.num_heads == 2 and attn.num_kv_heads == 1  # (2 kv heads split; 1 replicated)
        assert greedy(llm, prompts, MAX_NEW) == ref


@pytest.mark.parametrize("family,undo", [
    ("gemma4", "per-layer embeddings"), ("gemma4", "layer scalars"), ("gemma4", "proportional rotary"),
    ("gemma4_moe", "per-expert scales"), ("gemma4_moe", "v norm"), ("gemma4_moe", "experts"),
])
def test_each_feature_changes_the_tokens(refs, prompts, family, undo, monkeypatch) -> None:
    """The parity above can fail: each Gemma 4 difference undone in the loaded model changes the greedy tokens."""
    path, ref = refs(family)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=96)
    model = llm.engine.runner.model
    layers = list(model.layers)
    if undo == "per-layer embeddings":
        model.ple = 0
    elif undo == "layer scalars":
        for layer in layers:
            layer.layer_scalar.data.fill_(1.0)
    elif undo == "proportional rotary":  # every frequency of the global layers' heads turning
        table = gemma4.RotaryEmbedding(32, 4096, 1_000_000.0, None).cos_sin_cache
        layers[1].self_attn.rotary.cos_sin_cache.copy_(table[:layers[1].self_attn.rotary.cos_sin_cache.shape[0]])
    elif undo == "per-expert scales":
        for layer in layers:
            layer.mlp.per_expert_scale.data.fill_(1.0)
    elif undo == "v norm":
        monkeypatch.setattr(gemma4, "rms_norm_unscaled", lambda x, eps: x)
    elif undo == "experts":
        for layer in layers:
            layer.moe = False
    assert greedy(llm, prompts, MAX_NEW) != ref


# ------------------------------------------------------------------------------------------ config readings
def test_layer_plans_from_global_keys_equal_transformers_per_layer_config(refs) -> None:
    """transformers writes `per_layer_config`; a config.json with `global_head_dim` / `num_global_key_value_heads`
    instead (as Google's) reads the same."""
    path, _ = refs("gemma4_moe")
    raw = json.loads((path / "config.json").read_text())
    assert "per_layer_config" in raw
    plans = gemma4.layer_plans(ModelConfig.from_dict(raw))
    bare = {k: v for k, v in raw.items() if k != "per_layer_config"}
    bare.update(global_head_dim=32, num_global_key_value_heads=1)
    assert gemma4.layer_plans(ModelConfig.from_dict(bare)) == plans
    assert [(p.head_dim, p.num_kv_heads, p.k_eq_v) for p in plans] == [
        (16, 2, False), (16, 2, False), (32, 1, True), (16, 2, False), (32, 1, True)]


def test_bad_configs_refused(refs) -> None:
    path, _ = refs("gemma4")
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="shares the KV of an earlier full_attention layer"):
        gemma4.layer_plans(ModelConfig.from_dict(dict(raw, layer_types=[S, S, S, S, F, F])))
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        gemma4.layer_plans(ModelConfig.from_dict(dict(raw, num_kv_shared_layers=6)))
    bad = checkpoint_variant(path, path.parent / "gemma4_bad_moe", config={"enable_moe_block": True})
    with pytest.raises(ValueError, match="num_experts, top_k_experts"):
        LLM(str(bad), dtype="float32", num_kv_blocks=16)


def test_prompt_embeds_refused_with_per_layer_embeddings(refs) -> None:
    path, _ = refs("gemma4")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="per-layer embeddings"):
        llm.generate({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(max_tokens=2))


# ------------------------------------------------------------------------------------------ the released form
def _make_conditional_generation(out_dir: Path, text_dir: Path) -> Path:
    """A Gemma4ForConditionalGeneration checkpoint (a tiny vision tower) over the "gemma4" text model's weights."""
    import transformers as tf

    from tests.tokenizer_factory import make_bytelevel_tokenizer
    text_cfg = tf.AutoConfig.from_pretrained(text_dir)
    cfg = tf.Gemma4Config(text_config=text_cfg.to_dict(),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                             patch_size=4, pooling_kernel_size=2, position_embedding_size=64),
                          audio_config=None, image_token_id=5, boi_token_id=6, eoi_token_id=7, video_token_id=8)
    torch.manual_seed(0)
    model = tf.Gemma4ForConditionalGeneration(cfg).eval()
    text = tf.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    missing = model.model.language_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in text.state_dict().items() if k.startswith("model.")}, strict=False)
    assert not missing.missing_keys, missing.missing_keys
    model.save_pretrained(out_dir)
    make_bytelevel_tokenizer(out_dir)
    tf.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70).save_pretrained(out_dir)
    return out_dir


def test_conditional_generation_text_and_text_only(refs, prompts, ckpt_root) -> None:
    """Every Gemma 4 release is a Gemma4ForConditionalGeneration: on text prompts it equals transformers' whole model;
    without a vision_config (its tower's weights still in the files) it serves as its text model alone, skipping
    them, and refuses images with a clear error. (Images: tests/test_gemma4_vision.py.)"""
    import transformers as tf
    text_path, _ = refs("gemma4")
    path = ckpt_root / "gemma4_vlm"
    if not (path / "config.json").exists():
        _make_conditional_generation(path, text_path)
    model = tf.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts[:4]:
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
            want.append(out[0, len(p):].tolist())
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.model_config.multimodal_architecture == "Gemma4ForConditionalGeneration"
    assert greedy(llm, prompts[:4], MAX_NEW) == want
    text_only = checkpoint_variant(path, ckpt_root / "gemma4_vlm_text_only", config={"vision_config": None})
    llm = LLM(str(text_only), dtype="float32", num_kv_blocks=64)
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma4ForCausalLM" and cfg.text_only_of == "Gemma4ForConditionalGeneration"
    assert greedy(llm, prompts[:4], MAX_NEW) == want
    with pytest.raises(ValueError, match="vision encoder is not supported"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": torch.zeros(3, 8, 8)}}, SamplingParams(max_tokens=2))
