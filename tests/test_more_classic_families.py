"""Falcon (streamer/models/falcon.py), GPT-J (models/gptj.py), OPT (models/opt.py), OLMo (models/olmo.py) and Nemotron
(models/nemotron.py) against transformers' FalconForCausalLM / GPTJForCausalLM / OPTForCausalLM / OlmoForCausalLM /
NemotronForCausalLM (fp32, tiny random checkpoints registered here with tests.checkpoints.register_family): greedy
tokens and prompt logprobs, whole and chunked prefill, compiled, over two tensor-parallel ranks; released configs'
shapes, built on the meta device and loaded with transformers' tensors of those shapes; refusals; and, so that those
tests can fail, each family's differences from Llama undone in the loaded model change the tokens."""
from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models import falcon  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.layers import LayerNorm, build_cos_sin_cache  # noqa: E402
from streamer.models.nemotron import LayerNorm1P  # noqa: E402
from streamer.models.registry import model_class  # noqa: E402
from tests.checkpoints import hf_greedy, register_family  # noqa: E402
from tests.parity import PREFILL_MODES, assert_matches_transformers, greedy, random_prompts, reference_cache  # noqa: E402


# ------------------------------------------------------------------------------------------ checkpoints
def _falcon_config(**kw: Any):
    """Falcon: 7B's multi-query parallel layers by default; new_decoder_architecture: GQA (num_key_value_heads kv
    heads) and two norms a layer."""
    import transformers as tf
    kw["ffn_hidden_size"] = kw.pop("intermediate_size")
    kw["layer_norm_epsilon"] = kw.pop("rms_norm_eps")
    kv = kw.pop("num_key_value_heads")
    # (without multi_query or the new architecture, transformers needs as many kv heads as heads: its default)
    kw["num_kv_heads"] = kv if kw.get("new_decoder_architecture") else None
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0})
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.2
    return tf.FalconConfig(**kw)


def _gptj_config(**kw: Any):
    """GPT-J: GPT-2's spellings, half of each head (8 of 16 dims) rotating in interleaved pairs, an untied head."""
    import transformers as tf
    for ours, theirs in (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                         ("num_hidden_layers", "n_layer"), ("max_position_embeddings", "n_positions"),
                         ("intermediate_size", "n_inner"), ("rms_norm_eps", "layer_norm_epsilon")):
        kw[theirs] = kw.pop(ours)
    kw.pop("num_key_value_heads")
    kw.setdefault("rotary_dim", 8)
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.2
    return tf.GPTJConfig(**kw)


def _opt_config(**kw: Any):
    """OPT: ReLU, pre-LN, learned positions (offset 2), a tied head, unless the case says otherwise."""
    import transformers as tf
    kw["ffn_dim"] = kw.pop("intermediate_size")
    kw.pop("num_key_value_heads"), kw.pop("rms_norm_eps"), kw.pop("initializer_range")
    kw.setdefault("pad_token_id", 0)
    kw["init_std"] = kw.pop("init_std", 0.2)
    return tf.OPTConfig(**kw)


def _olmo_config(**kw: Any):
    """OLMo: GQA 4/2, non-parametric LayerNorms, clip_qkv low enough to bite, a tied head."""
    import transformers as tf
    kw.pop("rms_norm_eps")
    kw.setdefault("clip_qkv", 1.0)
    kw.setdefault("tie_word_embeddings", True)
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.2
    return tf.OlmoConfig(**kw)


def _nemotron_config(**kw: Any):
    """Nemotron: GQA 4/2, half of each head rotating (the default), ReLU² MLP, LayerNorm1P."""
    import transformers as tf
    kw["norm_eps"] = kw.pop("rms_norm_eps")
    kw.setdefault("head_dim", 16)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.2
    return tf.NemotronConfig(**kw)


_NORM = re.compile(r"(norm|(^|\.)ln_)")


def _randomise(model) -> None:
    # transformers starts the LayerNorms at (1, 0) (Nemotron's 1 + w at w = 0) and the biases at zero: random ones
    # show that each is loaded and used where it belongs.
    one_plus = type(model).__name__.startswith("Nemotron")
    for name, p in model.named_parameters():
        if _NORM.search(name) and name.endswith("weight"):
            p.normal_(0.0 if one_plus else 1.0, 0.3)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)


register_family("falcon", _falcon_config, _randomise)
register_family("gptj", _gptj_config, _randomise)
register_family("opt", _opt_config, _randomise)
register_family("olmo", _olmo_config, _randomise)
register_family("nemotron", _nemotron_config, _randomise)

MAX_NEW = 12
CASES: dict[str, dict[str, Any]] = {
    "falcon_7b": dict(family="falcon"),  # multi-query, one norm, parallel; tied head
    "falcon_40b": dict(family="falcon", new_decoder_architecture=True, tie_word_embeddings=False),  # GQA, 2 norms
    "falcon_seq": dict(family="falcon", multi_query=False, parallel_attn=False, bias=True),  # per-head qkv, biases
    "falcon_11b": dict(family="falcon", new_decoder_architecture=True, num_ln_in_parallel_attn=1),  # Falcon2's
    "gptj": dict(family="gptj"),
    "opt": dict(family="opt"),  # opt-125m's shape: pre-LN, ReLU, biases, tied head
    # post-LN, projections (smaller weights: at 0.2 most continuations repeat one token)
    "opt_350m": dict(family="opt", do_layer_norm_before=False, word_embed_proj_dim=32, init_std=0.1),
    "opt_bare": dict(family="opt", enable_bias=False, layer_norm_elementwise_affine=False,
                     activation_function="gelu", tie_word_embeddings=False),  # no biases, no norm weights, GELU
    "olmo": dict(family="olmo"),
    "nemotron": dict(family="nemotron", attention_bias=True, mlp_bias=True),
}
PROMPTS = random_prompts(8, seed=23)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"more_classic_{name}", **CASES[name])


@pytest.fixture(scope="module")
def refs(ckpt) -> Callable[[str], list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per case (computed once)."""
    return reference_cache(ckpt, PROMPTS, MAX_NEW, min_distinct=4)


# ------------------------------------------------------------------------------------------------ parity
# case -> (kv heads, rotary dims (None: no rotary), parallel layers, two norms a layer, tied head)
SHAPES = {"falcon_7b": (1, 16, True, False, True), "falcon_40b": (2, 16, True, True, False),
          "falcon_seq": (4, 16, False, True, True), "falcon_11b": (2, 16, True, False, True),
          "gptj": (4, 8, True, False, False), "opt": (4, None, False, True, True),
          "opt_350m": (4, None, False, True, True), "opt_bare": (4, None, False, True, False),
          "olmo": (2, 16, False, True, True), "nemotron": (2, 8, False, True, False)}


@pytest.mark.parametrize("name", list(CASES))
@PREFILL_MODES
def test_matches_transformers(ckpt, refs, name, engine_args) -> None:
    """Greedy tokens (a batch, and a lone request) and prompt logprobs; with a small token budget prompts are
    prefilled in chunks of at most 16 tokens over blocks of 8, beside other requests' decodes."""
    path = ckpt(name)
    with LLM(str(path), dtype="float32", **engine_args) as llm:
        assert_matches_transformers(llm, path, PROMPTS, refs(name), MAX_NEW)
        model = llm.engine.runner.model
        kv, rotary, parallel, two_norms, tied = SHAPES[name]
        attn = model.layers[0].self_attn
        assert attn.num_kv_heads == kv and attn.use_rope == (rotary is not None)
        if rotary is not None:
            assert attn.rotary.cos_sin_cache.shape[-1] == rotary
        assert (model.lm_head is None) == tied
        layer = model.layers[0]
        if hasattr(layer, "parallel"):
            assert (layer.parallel, layer.post_attention_layernorm is not None) == (parallel, two_norms)


@pytest.mark.parametrize("name", ["gptj", "opt_350m"])
def test_compiled_matches_transformers(ckpt, refs, name) -> None:
    """The whole model compiled (attention and the linears opaque ops, the norms and activations traced)."""
    with LLM(str(ckpt(name)), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]
        assert greedy(llm, PROMPTS[4:5], MAX_NEW) == refs(name)[4:5]
        assert llm.engine.runner.compiled  # no eager fallback on the way


@pytest.mark.parametrize("name", [
    "falcon_40b",  # the grouped query_key_value split, then each rank its kv group
    "opt_350m",  # post-LN; project_in / project_out whole on each rank; the biases split with their rows
])
def test_tp2_matches_transformers(make_ckpt, name) -> None:
    path = make_ckpt(f"more_classic_{name}_tp", seed=3, **CASES[name])
    prompts = PROMPTS[:4]
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.num_heads == 2  # this rank's half
        got = greedy(llm, prompts, MAX_NEW)
    assert got == hf_greedy(path, prompts, MAX_NEW)


# ---------------------------------------------------------------------------------- differences matter
def _layer_norm_without(model: torch.nn.Module, what: str) -> None:
    """Every LayerNorm's mean left in ("mean": RMSNorm with the same weight and bias), or Nemotron's 1 + w
    applied as w ("one plus")."""
    for m in model.modules():
        if isinstance(m, LayerNorm1P) and what == "one plus":
            m.scale = types.MethodType(LayerNorm.scale, m)
        elif isinstance(m, LayerNorm) and what == "mean":
            def rms(self, x, residual=None):
                if residual is not None:
                    x = x + residual
                    residual = x
                out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
                if self.weight is not None:
                    out = out * self.scale() + self.bias
                return out if residual is None else (out, residual)
            m.forward = types.MethodType(rms, m)


def _one_norm_sequential(model: torch.nn.Module) -> None:
    """Parallel one-norm layers made Llama's: the MLP reads the norm of the stream after attention."""
    def forward(self, positions, x, residual, kv_cache, decode=None):
        stream = x if residual is None else x + residual
        stream = stream + self.self_attn(positions, self.input_layernorm(stream), kv_cache, decode)
        return self.mlp(self.input_layernorm(stream)), stream
    for layer in model.layers:
        layer.forward = types.MethodType(forward, layer)


def _rotary(model: torch.nn.Module, full: bool = False, neox: bool = False) -> None:
    rotary = model.layers[0].self_attn.rotary  # (one, shared by the layers)
    c = model.cfg
    if full:
        rotary.cos_sin_cache = build_cos_sin_cache(c.head_dim, rotary.cos_sin_cache.shape[0], c.rope_theta, None)
    if neox:
        rotary.is_neox = True


def _undo(model: torch.nn.Module, mutation: str) -> None:
    layers = model.layers
    if mutation in ("mean", "one plus"):
        _layer_norm_without(model, mutation)
    elif mutation == "one norm":  # Falcon-40B's ln_mlp unread: the MLP takes ln_attn's output
        for layer in layers:
            layer.post_attention_layernorm = None
    elif mutation == "other residual":
        for layer in layers:
            layer.parallel = not layer.parallel
    elif mutation == "one-norm sequential":
        _one_norm_sequential(model)
    elif mutation == "full rotary":
        _rotary(model, full=True)
    elif mutation == "neox rotary":
        _rotary(model, neox=True)
    elif mutation == "no lm head bias":
        model.lm_head.bias.zero_()
    elif mutation == "no qkv bias":
        for layer in layers:
            layer.self_attn.qkv_proj.bias.zero_()
    elif mutation == "no position offset":  # position p reads row p (two rows put in front: p + 2 reads them)
        w = model.embed_positions.weight.data
        model.embed_positions.weight.data = torch.cat([w[:2], w])
    elif mutation == "pre-LN":
        for layer in layers:
            layer.norm_before = True
    elif mutation == "no clip":
        for layer in layers:
            layer.self_attn.clip = None
    elif mutation == "relu not squared":
        for layer in layers:
            layer.mlp.act_fn = torch.nn.ReLU()
    elif mutation == "silu mlp":
        for layer in layers:
            layer.mlp.act_fn = torch.nn.SiLU()
    else:
        raise ValueError(mutation)


@pytest.mark.parametrize("name,mutation", [
    ("falcon_7b", "one-norm sequential"),
    ("falcon_40b", "qkv not grouped"),
    ("falcon_40b", "one norm"),
    ("falcon_seq", "other residual"),
    ("falcon_seq", "no qkv bias"),
    ("gptj", "neox rotary"),
    ("gptj", "full rotary"),
    ("gptj", "no lm head bias"),
    ("opt", "no position offset"),
    ("opt", "silu mlp"),
    ("opt_350m", "pre-LN"),
    ("olmo", "no clip"),
    ("olmo", "mean"),
    ("nemotron", "one plus"),
    ("nemotron", "relu not squared"),
    ("nemotron", "full rotary"),
])
def test_features_matter(ckpt, refs, monkeypatch, name, mutation) -> None:
    """The parity tests can fail: with one of the family's differences undone in the loaded model (or its
    loading), greedy tokens leave transformers'."""
    if mutation == "qkv not grouped":  # Falcon's query_key_value read as [all q; all k; all v] (Phi-3's layout)
        original = falcon.fused_qkv_parts
        monkeypatch.setattr(falcon, "fused_qkv_parts",
                            lambda n, t, kv, dim, rows, family: original(n, t, 1, dim * kv, rows, family))
    with LLM(str(ckpt(name)), dtype="float32") as llm:
        if mutation != "qkv not grouped":
            _undo(llm.engine.runner.model, mutation)
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


@pytest.mark.parametrize("name", ["gptj", "opt_350m"])
def test_hub_checkpoint_names(ckpt, refs, tmp_path, name) -> None:
    """Checkpoints as the Hub holds them: GPT-J's causal-mask buffers (older transformers saved them) are skipped;
    OPT's older names lack `model.`, and a final_layer_norm beside post-LN layers (which have none) is skipped, as
    transformers skips it."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / name
    shutil.copytree(ckpt(name), path)
    tensors = load_file(path / "model.safetensors")
    if name == "gptj":
        for i in range(2):
            tensors[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
            tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e9)
    else:
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        tensors["decoder.final_layer_norm.weight"] = torch.ones(64)
        tensors["decoder.final_layer_norm.bias"] = torch.zeros(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with LLM(str(path), dtype="float32") as llm:
        assert greedy(llm, PROMPTS[:3], MAX_NEW) == refs(name)[:3]


@pytest.mark.parametrize("name,drop,match", [
    ("falcon_40b", ["transformer.h.1.self_attention.query_key_value.weight", "transformer.h.0.ln_mlp.bias"],
     r"missing 4 tensor\(s\): transformer.h.0.ln_mlp.bias, transformer.h.1.self_attention.query_key_value.weight"),
    ("opt_350m", ["model.decoder.project_in.weight", "model.decoder.layers.1.fc1.bias"],
     r"missing 2 tensor\(s\): model.decoder.layers.1.fc1.bias, model.decoder.project_in.weight"),
])
def test_missing_tensor_named_as_stored(ckpt, tmp_path, name, drop, match) -> None:
    """A missing tensor is named as the checkpoint spells it (Falcon's fused query_key_value and ln_mlp, OPT's
    decoder names)."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / name
    shutil.copytree(ckpt(name), path)
    tensors = load_file(path / "model.safetensors")
    for key in drop:
        del tensors[key]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        LLM(str(path), dtype="float32")


# --------------------------------------------------------------------------------------------- configs
_FALCON = {"alibi": False, "apply_residual_connection_post_layernorm": False, "architectures": ["FalconForCausalLM"],
           "attention_dropout": 0.0, "bias": False, "bos_token_id": 11, "eos_token_id": 11, "hidden_dropout": 0.0,
           "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "falcon", "parallel_attn": True,
           "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 65024}
FALCON_7B = dict(_FALCON, hidden_size=4544, multi_query=True, new_decoder_architecture=False, num_attention_heads=71,
                 num_hidden_layers=32)
FALCON_40B = dict(_FALCON, hidden_size=8192, new_decoder_architecture=True, num_attention_heads=128,
                  num_hidden_layers=60, num_kv_heads=8)
FALCON_180B = dict(_FALCON, hidden_size=14848, new_decoder_architecture=True, num_attention_heads=232,
                   num_hidden_layers=80, num_kv_heads=8)
FALCON2_11B = dict(_FALCON, activation="gelu", ffn_hidden_size=16384, hidden_size=4096, max_position_embeddings=8192,
                   multi_query=True, new_decoder_architecture=True, num_attention_heads=32, num_hidden_layers=60,
                   num_kv_heads=8, num_ln_in_parallel_attn=1, rope_theta=500042.0, tie_word_embeddings=False)
FALCON_RW_1B = dict(_FALCON, alibi=True, bias=True, hidden_size=2048, multi_query=False, num_attention_heads=32,
                    num_hidden_layers=24, parallel_attn=False, vocab_size=50304)
GPTJ_6B = {"activation_function": "gelu_new", "architectures": ["GPTJForCausalLM"], "attn_pdrop": 0.0,
           "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256, "initializer_range": 0.02,
           "layer_norm_epsilon": 1e-05, "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_inner": None,
           "n_layer": 28, "n_positions": 2048, "resid_pdrop": 0.0, "rotary": True, "rotary_dim": 64,
           "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "vocab_size": 50400}
_OPT = {"activation_dropout": 0.0, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
        "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2,
        "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt", "pad_token_id": 1,
        "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272}
OPT_125M = dict(_OPT, ffn_dim=3072, hidden_size=768, num_attention_heads=12, num_hidden_layers=12,
                word_embed_proj_dim=768)
OPT_350M = dict(_OPT, do_layer_norm_before=False, ffn_dim=4096, hidden_size=1024, num_attention_heads=16,
                num_hidden_layers=24, word_embed_proj_dim=512, _remove_final_layer_norm=False)
GALACTICA_125M = dict(_OPT, activation_function="gelu", bos_token_id=0, ffn_dim=3072, hidden_size=768,
                      learned_embeddings=True, num_attention_heads=12, num_hidden_layers=12, scale_embeddings=False,
                      vocab_size=50000, word_embed_proj_dim=768)
_OLMO = {"architectures": ["OlmoForCausalLM"], "attention_bias": False, "eos_token_id": 50279, "hidden_act": "silu",
         "model_type": "olmo", "pad_token_id": 1, "rope_scaling": None, "rope_theta": 10000.0,
         "torch_dtype": "float32", "use_cache": True, "vocab_size": 50304}
OLMO_1B = dict(_OLMO, clip_qkv=None, hidden_size=2048, intermediate_size=8192, max_position_embeddings=2048,
               num_attention_heads=16, num_hidden_layers=16, num_key_value_heads=16, tie_word_embeddings=True)
OLMO_7B_0424 = dict(_OLMO, clip_qkv=8.0, hidden_size=4096, intermediate_size=11008, max_position_embeddings=4096,
                    num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32, tie_word_embeddings=False)
_NEMOTRON = {"architectures": ["NemotronForCausalLM"], "bos_token_id": 2, "eos_token_id": 3, "head_dim": 128,
             "hidden_act": "relu2", "initializer_range": 0.0134, "max_position_embeddings": 4096,
             "model_type": "nemotron", "norm_eps": 1e-05, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "partial_rotary_factor": 0.5, "rope_theta": 10000, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "vocab_size": 256000}
MINITRON_4B = dict(_NEMOTRON, hidden_size=3072, intermediate_size=9216, num_attention_heads=24)
MINITRON_8B = dict(_NEMOTRON, hidden_size=4096, intermediate_size=16384, num_attention_heads=48)  # (48 x 128 wide)

SHIPPED = {"falcon-7b": FALCON_7B, "falcon-40b": FALCON_40B, "falcon-180B": FALCON_180B, "falcon-11B": FALCON2_11B,
           "falcon-rw-1b": FALCON_RW_1B,
           "gpt-j-6b": GPTJ_6B, "opt-125m": OPT_125M, "opt-350m": OPT_350M, "galactica-125m": GALACTICA_125M,
           "OLMo-1B-hf": OLMO_1B, "OLMo-7B-0424-hf": OLMO_7B_0424, "Minitron-4B-Base": MINITRON_4B,
           "Minitron-8B-Base": MINITRON_8B}


def _hf_config(raw: dict[str, Any]):
    import transformers as tf
    return tf.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                         if k not in ("architectures", "model_type")})


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_configs(name) -> None:
    """Released configs read as transformers reads them (its config classes' defaults where keys are missing), and
    their layers' shapes: two layers of each, built on the meta device, load transformers' tensors of those shapes
    (Falcon's fused query_key_value of 71 heads and one kv head, or of 8 groups of 16 and 29 heads, split as they
    load; OPT-350m's projections) with nothing missing."""
    import transformers as tf

    from streamer.attention.torch_backend import TorchAttentionBackend
    raw = SHIPPED[name]
    cfg, hf = ModelConfig.from_dict(raw), _hf_config(raw)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers, cfg.vocab_size) == \
        (hf.hidden_size, hf.num_attention_heads, head, hf.num_hidden_layers, hf.vocab_size)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    rope = getattr(hf, "rope_parameters", None) or {}
    if name.startswith("gpt-j"):
        assert (cfg.rotary_dim, cfg.rope_theta) == (hf.rotary_dim, 10000.0)
    elif rope:
        assert cfg.rope_theta == rope["rope_theta"]
        assert cfg.rotary_dim == int(head * rope.get("partial_rotary_factor", 1.0))
    small = dict(raw, **{"n_layer" if "n_layer" in raw else "num_hidden_layers": 2})
    cfg, hf = ModelConfig.from_dict(small), _hf_config(small)
    with torch.device("meta"):
        ours = model_class(cfg.architecture)(cfg, TorchAttentionBackend, 64)
        theirs = tf.AutoModelForCausalLM.from_config(hf)
    assert ours.layers[0].self_attn.num_kv_heads == cfg.num_kv_heads
    loaded = ours.load_weights(ours.rename_weights(theirs.state_dict().items()))
    assert not ours.expected_weights() - loaded
    widths = {"falcon-7b": 1, "falcon-40b": 8, "falcon-180B": 8, "falcon-11B": 8, "gpt-j-6b": 16}
    assert cfg.num_kv_heads == widths.get(name, getattr(hf, "num_key_value_heads", hf.num_attention_heads))


@pytest.mark.parametrize("raw,match", [
    (dict(FALCON_40B, parallel_attn=False), "parallel_attn"),
    (dict(FALCON_7B, num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn"),
    (dict(FALCON_7B, activation="relu"), "activation 'relu'"),
    (dict(GPTJ_6B, rotary_dim=None), "rotary_dim"),
    (dict(GPTJ_6B, rotary_dim=65), "rotary_dim"),
    (dict(GPTJ_6B, tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(OPT_125M, activation_function="silu"), "activation_function 'silu'"),
    (dict(MINITRON_4B, hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_refused(raw, match) -> None:
    """What these families' configs may ask for that is not built here is refused, naming the field."""
    from streamer.attention.torch_backend import TorchAttentionBackend
    with pytest.raises(ValueError, match=match):
        cfg = ModelConfig.from_dict(dict(raw, num_hidden_layers=1, n_layer=1))
        with torch.device("meta"):
            model_class(cfg.architecture)(cfg, TorchAttentionBackend, 64)
