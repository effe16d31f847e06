"""Gemma 1 (streamer/models/gemma.py), Cohere and Cohere2 (models/cohere.py) and StarCoder2 (models/starcoder2.py)
against transformers' GemmaForCausalLM / CohereForCausalLM / Cohere2ForCausalLM / Starcoder2ForCausalLM (fp32, tiny
random checkpoints registered here with tests.checkpoints.register_family): greedy tokens and prompt logprobs, whole
and chunked prefill, compiled, over two tensor-parallel ranks; the shipped configs' readings; and, so that those
tests can fail, each family's differences from Llama undone in the loaded model (or its config) change the
tokens (or, for Cohere's logit scale, which no argmax sees, the logprobs)."""
from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models.cohere import CohereLayerNorm, cohere2_layer_types  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.gemma3 import GemmaRMSNorm  # noqa: E402
from streamer.models.layers import (  # noqa: E402
    LayerNorm,  # noqa: E402
    ParallelContext,
    silu_and_mul,
)
from tests.checkpoints import hf_greedy, register_family  # noqa: E402
from tests.parity import (  # noqa: E402
    PREFILL_MODES,
    assert_logprobs_match,
    assert_matches_transformers,
    greedy,
    random_prompts,
    reference_cache,
)


# ------------------------------------------------------------------------------------------ checkpoints
def _gemma_config(**kw: Any):
    """Gemma 1: head_dim 32 where hidden / heads is 16 (so a head_dim taken from the hidden size would not load)."""
    import transformers as tf
    kw.setdefault("head_dim", 32)
    kw.setdefault("hidden_act", "gelu_pytorch_tanh")
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0})
    kw["initializer_range"] = 0.3  # (the base 0.08 mostly repeats each prompt's last token: the tied head)
    return tf.GemmaConfig(**kw)


def _gemma_randomise(model) -> None:
    # Gemma's norms start at zero (a scale of 1 + w): random ones show that each is loaded.
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(0.0, 0.3)


def _cohere_config(**kw: Any):
    """Cohere: tied head, logit_scale 0.0625 (the default), q/k norms when asked (use_qk_norm)."""
    import transformers as tf
    kw.setdefault("layer_norm_eps", kw.pop("rms_norm_eps", 1e-5))
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0})
    kw["initializer_range"] = 0.2  # (the base 0.08 gives degenerate continuations)
    return tf.CohereConfig(**kw)


def _cohere2_config(**kw: Any):
    """Cohere2: 3 layers, sliding (window 16, rotary), global (no rotary), sliding; every layer parallel."""
    import transformers as tf
    kw["num_hidden_layers"] = 3
    kw.setdefault("layer_norm_eps", kw.pop("rms_norm_eps", 1e-5))
    kw.setdefault("sliding_window", 16)
    if "sliding_window_pattern" not in kw:
        kw.setdefault("layer_types", ["sliding_attention", "full_attention", "sliding_attention"]
                      [:kw["num_hidden_layers"]])
    kw.setdefault("logit_scale", 0.25)
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0})
    kw["initializer_range"] = 0.2  # (the base 0.08 gives degenerate continuations)
    return tf.Cohere2Config(**kw)


def _cohere_randomise(model) -> None:
    # transformers starts the LayerNorms (q/k norms included) at one: random ones show that each is loaded, per head.
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.3)


def _starcoder2_config(**kw: Any):
    """StarCoder2: sliding window 16, biases everywhere (use_bias), tied head."""
    import transformers as tf
    kw.setdefault("norm_epsilon", kw.pop("rms_norm_eps", 1e-5))
    kw.setdefault("sliding_window", 16)
    kw.setdefault("bos_token_id", None)
    kw.setdefault("eos_token_id", None)
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0})
    kw["initializer_range"] = 0.5  # (smaller ones give degenerate continuations)
    return tf.Starcoder2Config(**kw)


def _starcoder2_randomise(model) -> None:
    # transformers starts the LayerNorms at (1, 0) and every bias at zero: random ones show that each is loaded.
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.normal_(1.0, 0.3)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)  # (larger final-norm biases make one token win everywhere)


register_family("gemma", _gemma_config, _gemma_randomise)
register_family("cohere", _cohere_config, _cohere_randomise)
register_family("cohere2", _cohere2_config, _cohere_randomise)
register_family("starcoder2", _starcoder2_config, _starcoder2_randomise)

MAX_NEW = 12
CASES: dict[str, dict[str, Any]] = {
    "gemma": dict(family="gemma"),
    "cohere": dict(family="cohere"),
    "cohere_qk": dict(family="cohere", use_qk_norm=True),
    "cohere2": dict(family="cohere2"),
    "starcoder2": dict(family="starcoder2"),
}
PROMPTS = random_prompts(8, seed=13)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"dfa_{name}", **CASES[name])


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
        attn = [layer.self_attn for layer in model.layers]
        assert model.lm_head is None  # tied
        if name == "gemma":
            assert attn[0].head_dim == 32 and attn[0].attn.spec.sliding_window is None
        elif name.startswith("cohere"):
            assert not attn[0].rotary.is_neox and not hasattr(model.layers[0], "post_attention_layernorm")
            assert (attn[0].q_norm is not None) == (name == "cohere_qk")
        if name == "cohere2":
            assert [a.use_rope for a in attn] == [True, False, True]
            assert [a.attn.spec.sliding_window for a in attn] == [16, None, 16]
        if name == "starcoder2":
            assert attn[0].attn.spec.sliding_window == 16
            assert attn[0].qkv_proj.bias is not None and attn[0].o_proj.bias is not None


@pytest.mark.parametrize("name", ["gemma", "cohere_qk", "starcoder2"])
def test_compiled_matches_transformers(ckpt, refs, name) -> None:
    """The whole model compiled (attention and the linears opaque ops, the norms and activations traced)."""
    with LLM(str(ckpt(name)), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]
        assert greedy(llm, PROMPTS[4:5], MAX_NEW) == refs(name)[4:5]
        assert llm.engine.runner.compiled  # no eager fallback on the way


@pytest.mark.parametrize("name,overrides", [
    ("gemma", {}),
    ("cohere_qk", dict(num_key_value_heads=1)),  # per-head q norms split; the one k norm head replicated
    ("cohere2", {}),
    ("starcoder2", {}),  # c_fc's bias split with its rows, c_proj's added after the all-reduce
])
def test_tp2_matches_transformers(make_ckpt, name, overrides) -> None:
    path = make_ckpt(f"dfa_{name}_tp", seed=3, **CASES[name], **overrides)
    prompts = PROMPTS[:4]
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.num_heads == 2  # this rank's half
        got = greedy(llm, prompts, MAX_NEW)
    assert got == hf_greedy(path, prompts, MAX_NEW)


# ---------------------------------------------------------------------------------- differences matter
def _plain_norms(model: torch.nn.Module) -> None:
    """Every (1 + w) RMSNorm scaled by w instead."""
    for m in model.modules():
        if isinstance(m, GemmaRMSNorm):
            m.offset = 0.0


def _rms_instead_of_layer_norm(model: torch.nn.Module) -> None:
    """Every LayerNorm without the mean subtracted (RMSNorm with the same weight and bias)."""
    def rms(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        if getattr(self, "bias", None) is not None:
            out = out + self.bias.float()
        out = out.to(x.dtype)
        return out if residual is None else (out, residual)
    for m in model.modules():
        if isinstance(m, (CohereLayerNorm, LayerNorm)):
            m.forward = types.MethodType(rms, m)


def _silu_mlp(model: torch.nn.Module) -> None:
    for layer in model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            mlp.forward = lambda x, mlp=mlp: mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))
        else:
            mlp.forward = lambda x, mlp=mlp: mlp.c_proj(F.silu(mlp.c_fc(x)))


def _sequential(model: torch.nn.Module) -> None:
    """Cohere's layers made Llama's: the MLP reads the norm of the stream after attention, not the same input."""
    def forward(self, positions, x, residual, kv_cache, decode=None):
        stream = x if residual is None else x + residual
        stream = stream + self.self_attn(positions, self.input_layernorm(stream), kv_cache, decode)
        return self.mlp(self.input_layernorm(stream)), stream
    for layer in model.layers:
        layer.forward = types.MethodType(forward, layer)


def _undo(model: torch.nn.Module, mutation: str) -> None:
    """Undo one of the family's differences in the loaded model."""
    if mutation == "plain norms":
        _plain_norms(model)
    elif mutation == "no embedding scale":
        model.embed_scale = 1.0
    elif mutation == "silu mlp":
        _silu_mlp(model)
    elif mutation == "rms norms":
        _rms_instead_of_layer_norm(model)
    elif mutation == "sequential layers":
        _sequential(model)
    elif mutation == "other rope layout":  # (one rotary, shared by the layers)
        rotary = model.layers[0].self_attn.rotary
        rotary.is_neox = not rotary.is_neox
    elif mutation == "no qk norm":
        for layer in model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
    elif mutation == "rope on global layers":
        for layer in model.layers:
            layer.self_attn.use_rope = True
    elif mutation == "no biases":
        for name, p in model.named_parameters():
            if name.endswith("proj.bias") or name.endswith("c_fc.bias"):
                p.zero_()
    elif mutation == "no norm biases":
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("bias"):
                p.zero_()
    else:
        raise ValueError(mutation)


@pytest.mark.parametrize("name,mutation", [
    ("gemma", "plain norms"),
    ("gemma", "no embedding scale"),
    ("gemma", "silu mlp"),
    ("cohere", "rms norms"),
    ("cohere", "sequential layers"),
    ("cohere", "other rope layout"),
    ("cohere_qk", "no qk norm"),
    ("cohere2", "rope on global layers"),
    ("cohere2", "sequential layers"),
    ("cohere2", "other rope layout"),
    ("starcoder2", "rms norms"),
    ("starcoder2", "no norm biases"),
    ("starcoder2", "no biases"),
    ("starcoder2", "silu mlp"),
])
def test_features_matter(ckpt, refs, name, mutation) -> None:
    """The parity tests can fail: with one of the family's differences undone in the loaded model, greedy tokens
    leave transformers'."""
    with LLM(str(ckpt(name)), dtype="float32") as llm:
        _undo(llm.engine.runner.model, mutation)
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


@pytest.mark.parametrize("name,override", [
    ("cohere2", dict(sliding_window=512)),  # the window never bites
    ("cohere2", dict(layer_types=["sliding_attention"] * 3)),  # no global (NoPE) layer
    ("starcoder2", dict(sliding_window=None)),
], ids=["cohere2-no-window", "cohere2-no-global-layer", "starcoder2-no-window"])
def test_config_difference_matters(make_ckpt, refs, name, override) -> None:
    """The same weights with the window (or the global layers) gone: transformers' own tokens change, so the parity
    test sees a window that is ignored."""
    key = next(iter(override))
    path = make_ckpt(f"dfa_{name}_{key}", **{**CASES[name], **override})
    assert hf_greedy(path, PROMPTS, MAX_NEW) != refs(name)


@pytest.mark.parametrize("name", ["cohere", "cohere2"])
def test_logit_scale_matters(ckpt, name) -> None:
    """Cohere's logits are scaled (0.0625 and, in the Cohere2 checkpoint, 0.25): greedy tokens cannot show it (the
    argmax is the same), the logprobs do."""
    path = ckpt(name)
    with LLM(str(path), dtype="float32") as llm:
        model = llm.engine.runner.model
        assert model.logit_scale == (0.0625 if name == "cohere" else 0.25)
        model.logit_scale = 1.0
        with pytest.raises(AssertionError, match="position"):
            assert_logprobs_match(llm, path, PROMPTS[:1])


# --------------------------------------------------------------------------------------------- configs
GEMMA_7B = {"architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu",
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3072, "initializer_range": 0.02,
            "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma",
            "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16, "pad_token_id": 0,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
            "vocab_size": 256000}
COMMAND_R = {"architectures": ["CohereForCausalLM"], "attention_bias": False, "bos_token_id": 5,
             "eos_token_id": 255001, "hidden_act": "silu", "hidden_size": 8192, "intermediate_size": 22528,
             "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "max_position_embeddings": 8192, "model_type": "cohere",
             "num_attention_heads": 64, "num_hidden_layers": 40, "num_key_value_heads": 64, "pad_token_id": 0,
             "rope_theta": 8000000.0, "torch_dtype": "float16", "use_qk_norm": False, "vocab_size": 256000}
COMMAND_R7B = {"architectures": ["Cohere2ForCausalLM"], "attention_bias": False, "bos_token_id": 5,
               "eos_token_id": 255001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
               "intermediate_size": 14336, "layer_norm_eps": 1e-05, "logit_scale": 0.25,
               "max_position_embeddings": 132096, "model_type": "cohere2", "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "pad_token_id": 0, "rope_theta": 50000,
               "sliding_window": 4096, "sliding_window_pattern": 4, "torch_dtype": "bfloat16", "vocab_size": 256000}
STARCODER2_3B = {"architectures": ["Starcoder2ForCausalLM"], "attention_dropout": 0.1, "residual_dropout": 0.1,
                 "embedding_dropout": 0.1, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu_pytorch_tanh",
                 "hidden_size": 3072, "intermediate_size": 12288, "max_position_embeddings": 16384,
                 "model_type": "starcoder2", "norm_epsilon": 1e-05, "num_attention_heads": 24,
                 "num_hidden_layers": 30, "num_key_value_heads": 2, "rope_theta": 999999.4420358813,
                 "sliding_window": 4096, "torch_dtype": "bfloat16", "use_bias": True, "vocab_size": 49152}


def test_shipped_configs() -> None:
    """The released configs (gemma-7b, c4ai-command-r-v01, c4ai-command-r7b-12-2024, starcoder2-3b) read as
    transformers reads them, and its defaults where keys are missing: tied heads, Cohere's rope base."""
    cfg = ModelConfig.from_dict(GEMMA_7B)
    assert (cfg.head_dim, cfg.num_heads, cfg.tie_word_embeddings, cfg.sliding_window) == (256, 16, True, None)
    bare = {k: v for k, v in GEMMA_7B.items() if k != "head_dim"}  # (GemmaConfig's default: 256, not 3072 / 16)
    assert ModelConfig.from_dict(bare).head_dim == 256
    cfg = ModelConfig.from_dict(COMMAND_R)
    assert (cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings, cfg.attention_bias) == (128, 8e6, True, False)
    bare = {k: v for k, v in COMMAND_R.items() if k not in ("rope_theta", "tie_word_embeddings")}
    assert (ModelConfig.from_dict(bare).rope_theta, ModelConfig.from_dict(bare).tie_word_embeddings) == (5e5, True)
    cfg = ModelConfig.from_dict(COMMAND_R7B)
    assert (cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (128, 50000.0, True)
    assert cohere2_layer_types(cfg)[:8] == ["sliding_attention"] * 3 + ["full_attention"] + \
        ["sliding_attention"] * 3 + ["full_attention"]
    types_ = ["full_attention"] * 32
    assert cohere2_layer_types(ModelConfig.from_dict(dict(COMMAND_R7B, layer_types=types_))) == types_
    cfg = ModelConfig.from_dict(STARCODER2_3B)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.sliding_window, cfg.tie_word_embeddings) == (128, 2, 4096, True)
    assert ModelConfig.from_dict(dict(STARCODER2_3B, tie_word_embeddings=False)).tie_word_embeddings is False


def test_cohere2_layer_pattern_matches_transformers(make_ckpt) -> None:
    """Without layer_types, transformers derives the layers from sliding_window_pattern (every 4th global by
    default); so do we."""
    import transformers as tf
    for pattern in (None, 2, 3):
        kw = dict(num_hidden_layers=6, **({} if pattern is None else {"sliding_window_pattern": pattern}))
        hf = tf.Cohere2Config(**kw)
        raw = dict(architectures=["Cohere2ForCausalLM"], hidden_size=64, intermediate_size=64, num_attention_heads=4,
                   vocab_size=100, **kw)
        assert cohere2_layer_types(ModelConfig.from_dict(raw)) == hf.layer_types


@pytest.mark.parametrize("name,override,match", [
    ("gemma", dict(hidden_act="silu"), "hidden_act 'silu'"),
    ("starcoder2", dict(hidden_act="relu"), "hidden_act 'relu'"),
    ("cohere", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_activation_refused(make_ckpt, name, override, match) -> None:
    path = make_ckpt(f"dfa_{name}_{override['hidden_act']}", **{**CASES[name], **override})
    with pytest.raises(ValueError, match=match):
        LLM(str(path), dtype="float32")


@pytest.mark.parametrize("rank,size,total,local,first", [
    (0, 1, 4, 4, 0),
    (1, 2, 4, 2, 2),  # q heads 2, 3
    (3, 4, 4, 1, 3),
    (1, 2, 1, 1, 0),  # one kv head for two ranks: replicated
    (3, 4, 2, 1, 1),  # two kv heads for four ranks: ranks 2 and 3 hold head 1
])
def test_per_head_norm_weights_split_with_their_heads(monkeypatch, rank, size, total, local, first) -> None:
    """Cohere's q/k norm weights ([heads, head_dim]) load as the k/v projections' heads do under tensor parallelism."""
    monkeypatch.setattr(ParallelContext, "rank", rank)
    monkeypatch.setattr(ParallelContext, "size", size)
    norm = CohereLayerNorm(8, 1e-5, heads=local)
    loaded = torch.arange(total, dtype=torch.float32)[:, None].expand(total, 8)
    norm.weight.weight_loader(norm.weight, loaded, "q_norm.weight")
    assert norm.weight[:, 0].tolist() == list(range(first, first + local))
    with pytest.raises(ValueError, match="has shape"):
        norm.weight.weight_loader(norm.weight, torch.ones(total, 4), "q_norm.weight")
