"""GLM-4 and GLM-4.5 (streamer/models/glm4.py) against transformers' Glm4ForCausalLM / Glm4MoeForCausalLM (fp32, tiny
random checkpoints: tests/checkpoints.py's "glm4" / "glm4_moe" families): greedy tokens and prompt logprobs, with
chunked prefill, compiled, and with the checkpoint's MTP layer present; the configs' defaults and layer choices; and,
so that those tests can fail, each of GLM's differences undone in the loaded model changes the tokens."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.deepseek import DeepseekMoE, Routing  # noqa: E402
from streamer.models.layers import RotaryEmbedding  # noqa: E402
from streamer.models.llama import MLP  # noqa: E402
from tests.parity import PREFILL_MODES, assert_matches_transformers, greedy, random_prompts, reference_cache  # noqa: E402

MAX_NEW = 12
CASES: dict[str, dict[str, Any]] = {
    "glm4": dict(family="glm4"),
    "glm4_moe": dict(family="glm4_moe"),
}


PROMPTS = random_prompts(10, seed=11)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(name, **CASES[name])


@pytest.fixture(scope="module")
def refs(ckpt) -> Callable[[str], list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per case (computed once)."""
    return reference_cache(ckpt, PROMPTS, MAX_NEW, min_distinct=4)


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name", list(CASES))
@PREFILL_MODES
def test_matches_transformers(ckpt, refs, name, engine_args) -> None:
    """Greedy tokens (a batch, and a lone request) and prompt logprobs; with a small token budget prompts are
    prefilled in chunks of at most 16 tokens over blocks of 8, beside other requests' decodes."""
    path = ckpt(name)
    with LLM(str(path), dtype="float32", **engine_args) as llm:
        assert_matches_transformers(llm, path, PROMPTS, refs(name), MAX_NEW)
        model = llm.engine.runner.model
        attn = model.layers[0].self_attn
        assert attn.rotary.cos_sin_cache.shape[-1] == 8  # half of each 16-dim head rotates
        assert attn.o_proj.bias is None and attn.qkv_proj.bias is not None
        if name == "glm4_moe":
            assert [type(layer.mlp) for layer in model.layers] == [MLP, DeepseekMoE, DeepseekMoE]
            assert attn.q_norm is not None and attn.rotary.is_neox
        else:
            assert attn.q_norm is None and not attn.rotary.is_neox


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_matches_transformers(ckpt, refs, name) -> None:
    """The whole model compiled (the MoE routing traced into the graph, the experts and attention opaque ops)."""
    with LLM(str(ckpt(name)), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]
        assert greedy(llm, PROMPTS[4:5], MAX_NEW) == refs(name)[4:5]
        assert llm.engine.runner.compiled  # no eager fallback on the way


def _undo(model: torch.nn.Module, mutation: str) -> None:
    """Undo one of GLM's differences in the loaded model."""
    cfg = model.cfg
    if mutation == "other rope layout":  # (one rotary, shared by the layers)
        rotary = model.layers[0].self_attn.rotary
        rotary.is_neox = not rotary.is_neox
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if mutation == "no correction bias" and isinstance(mlp, DeepseekMoE):
            mlp.gate.e_score_correction_bias.zero_()
        elif mutation == "no group limit" and isinstance(mlp, DeepseekMoE):
            mlp.routing = dataclasses.replace(mlp.routing, n_group=1, topk_group=1)
        elif mutation == "no scaling factor" and isinstance(mlp, DeepseekMoE):
            mlp.routing = dataclasses.replace(mlp.routing, scaling=1.0)
        elif mutation == "no shared experts" and isinstance(mlp, DeepseekMoE):
            mlp.shared_experts = None
        elif mutation == "no qk norm":
            attn.q_norm = attn.k_norm = None
        elif mutation == "full rotary":
            attn.rotary = RotaryEmbedding(cfg.head_dim, 512, cfg.rope_theta, None, attn.rotary.is_neox)
        elif mutation == "no sandwich norms":
            layer.post_self_attn_layernorm = layer.post_mlp_layernorm = torch.nn.Identity()


@pytest.mark.parametrize("name,mutation", [
    ("glm4_moe", "no correction bias"),
    ("glm4_moe", "no group limit"),
    ("glm4_moe", "no scaling factor"),
    ("glm4_moe", "no shared experts"),
    ("glm4_moe", "no qk norm"),
    ("glm4_moe", "other rope layout"),
    ("glm4_moe", "full rotary"),
    ("glm4", "no sandwich norms"),
    ("glm4", "other rope layout"),
    ("glm4", "full rotary"),
])
def test_features_matter(ckpt, refs, name, mutation) -> None:
    """The parity tests can fail: with one of GLM's differences undone in the loaded model, greedy tokens leave
    transformers'."""
    with LLM(str(ckpt(name)), dtype="float32") as llm:
        _undo(llm.engine.runner.model, mutation)
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


def test_routing_restricted_by_groups_and_bias(ckpt) -> None:
    """In the test checkpoint the group limit and the correction bias each change many tokens' expert choices (so
    the parity test covers them well beyond the odd token)."""
    with LLM(str(ckpt("glm4_moe")), dtype="float32") as llm:
        moe = llm.engine.runner.model.layers[1].mlp
        assert isinstance(moe, DeepseekMoE) and moe.routing.n_group == 4 and moe.routing.topk_group == 2
        assert moe.gate.e_score_correction_bias.abs().min() > 0
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
        chosen = moe.route(x)[1].sort(-1).values
        routing, bias = moe.routing, moe.gate.e_score_correction_bias.clone()
        for undo in ("no group limit", "no correction bias"):
            _undo(llm.engine.runner.model, undo)
            changed = (moe.route(x)[1].sort(-1).values != chosen).any(-1).float().mean().item()
            assert changed > 0.1, f"{undo}: only {changed:.0%} of tokens change experts"
            moe.routing = routing
            moe.gate.e_score_correction_bias.copy_(bias)


# -------------------------------------------------------------------------------------------- loading
def test_multi_token_prediction_layers_are_skipped(ckpt, refs, tmp_path, monkeypatch) -> None:
    """GLM-4.5 checkpoints also store the MTP layer (model.layers.<num_hidden_layers>.*: a decoder layer with its
    experts, eh_proj, enorm, hnorm, shared_head): it loads without them (and would not, were they not skipped)."""
    path = tmp_path / "with_mtp"
    shutil.copytree(ckpt("glm4_moe"), path)
    state = load_file(str(path / "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in state.items() if ".layers.2." in k}
    mtp.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
                "model.layers.3.hnorm.weight": torch.ones(64),
                "model.layers.3.shared_head.norm.weight": torch.ones(64)})
    assert any(".mlp.experts." in k for k in mtp)
    save_file(mtp, str(path / "model-mtp.safetensors"))
    with LLM(str(path), dtype="float32") as llm:
        assert len(llm.engine.runner.model.layers) == 3
        assert greedy(llm, PROMPTS[:3], MAX_NEW) == refs("glm4_moe")[:3]
    monkeypatch.setattr("streamer.models.glm4.without_mtp_layers", lambda weights, n: weights)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.3."):
        LLM(str(path), dtype="float32")


# --------------------------------------------------------------------------------------------- configs
def _glm45_config(**over: Any) -> dict[str, Any]:
    """GLM-4.5's config.json (zai-org/GLM-4.5), as shipped."""
    c = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "first_k_dense_replace": 3,
         "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 12288,
         "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536, "n_group": 1,
         "n_routed_experts": 160, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
         "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
         "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
         "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
         "use_qk_norm": True, "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338]}
    c.update(over)
    return c


def test_glm45_config() -> None:
    """GLM-4.5's shipped config: 64 of 128 dims rotate; q/k/v biases, none on o_proj; q/k norms; three dense
    layers, then MoE layers routed as DeepSeek-V3's; and transformers' defaults where keys are missing."""
    cfg = ModelConfig.from_dict(_glm45_config())
    assert (cfg.rotary_dim, cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (64, True, False, True)
    r = Routing.from_config(cfg)
    assert [r.sparse(i) for i in range(5)] == [False, False, False, True, True]
    assert (r.sigmoid, r.num_experts, r.top_k, r.n_group, r.topk_group, r.scaling, r.n_shared) == \
        (True, 160, 8, 1, 1, 2.5, 1)
    bare = {k: v for k, v in _glm45_config().items()
            if k not in ("partial_rotary_factor", "use_qk_norm", "n_group", "topk_group", "routed_scaling_factor",
                         "first_k_dense_replace")}
    cfg = ModelConfig.from_dict(bare)
    assert (cfg.rotary_dim, cfg.qk_norm) == (64, False)
    r = Routing.from_config(cfg)
    assert (r.n_group, r.topk_group, r.scaling, r.first_dense) == (1, 1, 1.0, 1)
    with pytest.raises(ValueError, match="scoring_func"):
        Routing.from_config(ModelConfig.from_dict(_glm45_config(scoring_func="softmax")))


def test_glm4_config_defaults() -> None:
    """GLM-4-9B-0414's config (transformers' defaults where keys are missing: half the head rotates, q/k/v biases)."""
    c = {"architectures": ["Glm4ForCausalLM"], "head_dim": 128, "hidden_size": 4096, "intermediate_size": 13696,
         "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "vocab_size": 151552}
    cfg = ModelConfig.from_dict(c)
    assert (cfg.rotary_dim, cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (64, True, False, False)
    cfg = ModelConfig.from_dict(dict(c, attention_bias=False, partial_rotary_factor=0.25))
    assert (cfg.rotary_dim, cfg.attention_bias) == (32, False)
