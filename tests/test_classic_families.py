"""GPT-NeoX (streamer/models/gpt_neox.py), Phi (models/phi.py) and StableLM (models/stablelm.py) against transformers'
GPTNeoXForCausalLM / PhiForCausalLM / StableLmForCausalLM (fp32, tiny random checkpoints registered here with
tests.checkpoints.register_family): greedy tokens and prompt logprobs, whole and chunked prefill, compiled, over two
tensor-parallel ranks; the released configs' readings; and, so that those tests can fail, each family's differences
from Llama undone in the loaded model change the tokens."""
from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models import gpt2  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.gpt2 import GPT2LMHeadModel  # noqa: E402
from streamer.models.gpt_bigcode import GPTBigCodeForCausalLM  # noqa: E402
from streamer.models.gpt_neox import GPTNeoXForCausalLM  # noqa: E402
from streamer.models.layers import (
    LayerNorm,  # noqa: E402
    build_cos_sin_cache,  # noqa: E402
)
from streamer.models.stablelm import PerHeadLayerNorm  # noqa: E402
from tests.checkpoints import hf_greedy, register_family  # noqa: E402
from tests.parity import PREFILL_MODES, assert_matches_transformers, greedy, random_prompts, reference_cache  # noqa: E402


# ------------------------------------------------------------------------------------------ checkpoints
def _common(kw: dict[str, Any], init: float) -> dict[str, Any]:
    kw.setdefault("layer_norm_eps", kw.pop("rms_norm_eps", 1e-5))
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = init
    return kw


def _neox_config(**kw: Any):
    """GPT-NeoX: MHA (no num_key_value_heads: every head its own k/v), head_dim 16 of which rotary_pct rotate."""
    import transformers as tf
    kw.pop("num_key_value_heads", None)
    rotary = kw.pop("rotary_pct", 0.25)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": rotary})
    return tf.GPTNeoXConfig(**_common(kw, 0.2))


def _phi_config(**kw: Any):
    """Phi: half of each head rotates (the default), GQA 4/2, gelu_new."""
    import transformers as tf
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
    return tf.PhiConfig(**_common(kw, 0.2))


def _stablelm_config(**kw: Any):
    """StableLM: a quarter of each head rotates (the default), GQA 4/2."""
    import transformers as tf
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25})
    return tf.StableLmConfig(**_common(kw, 0.2))


def _bigcode_config(**kw: Any):
    """GPTBigCode: multi-query attention (one kv head) unless multi_query=False, learned positions, tied head."""
    import transformers as tf
    for ours, theirs in (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                         ("num_hidden_layers", "n_layer"), ("max_position_embeddings", "n_positions"),
                         ("intermediate_size", "n_inner"), ("rms_norm_eps", "layer_norm_epsilon")):
        kw[theirs] = kw.pop(ours)
    kw.pop("num_key_value_heads", None)
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.2
    return tf.GPTBigCodeConfig(**kw)


def _gpt2_config(**kw: Any):
    """GPT-2: every head its own k/v, Conv1D linears, gelu_new, learned positions, tied head; scores of layer i
    also divided by i + 1 when asked (scale_attn_by_inverse_layer_idx)."""
    import transformers as tf
    for ours, theirs in (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                         ("num_hidden_layers", "n_layer"), ("max_position_embeddings", "n_positions"),
                         ("intermediate_size", "n_inner"), ("rms_norm_eps", "layer_norm_epsilon")):
        kw[theirs] = kw.pop(ours)
    kw.pop("num_key_value_heads", None)
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.2
    return tf.GPT2Config(**kw)


def _randomise(model) -> None:
    # transformers starts the LayerNorms (q/k norms included) at (1, 0) and the biases at zero: random ones show
    # that each is loaded and used where it belongs.
    for name, p in model.named_parameters():
        if ("norm" in name or ".ln_" in name) and name.endswith("weight"):
            p.normal_(1.0, 0.3)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)


register_family("gpt_neox", _neox_config, _randomise)
register_family("phi", _phi_config, _randomise)
register_family("stablelm", _stablelm_config, _randomise)
register_family("gpt_bigcode", _bigcode_config, _randomise)
register_family("gpt2", _gpt2_config, _randomise)

MAX_NEW = 12
CASES: dict[str, dict[str, Any]] = {
    "neox": dict(family="gpt_neox"),  # parallel residual (Pythia's)
    "neox_seq": dict(family="gpt_neox", use_parallel_residual=False, rotary_pct=0.5),
    "phi": dict(family="phi"),
    "phi_qk": dict(family="phi", qk_layernorm=True),
    "stablelm": dict(family="stablelm", use_qkv_bias=True),  # StableLM 2 1.6B's shape
    "stablelm_12b": dict(family="stablelm", qk_layernorm=True, use_parallel_residual=True),  # StableLM 2 12B's
    "bigcode": dict(family="gpt_bigcode"),  # multi-query (StarCoder's, SantaCoder's)
    "bigcode_mha": dict(family="gpt_bigcode", multi_query=False),
    "gpt2": dict(family="gpt2", scale_attn_by_inverse_layer_idx=True),
}
PROMPTS = random_prompts(8, seed=17)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"classic_{name}", **CASES[name])


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
        bigcode = name.startswith(("bigcode", "gpt2"))
        assert (model.lm_head is None) == bigcode  # (GPTBigCode ties its head to the embeddings)
        assert attn[0].use_rope != bigcode
        kv_heads = {"bigcode": 1, "bigcode_mha": 4, "gpt2": 4, "neox": 4, "neox_seq": 4}.get(name, 2)
        assert attn[0].num_kv_heads == kv_heads
        if not bigcode:
            assert attn[0].rotary.cos_sin_cache.shape[-1] == {"neox_seq": 8, "phi": 8, "phi_qk": 8}.get(name, 4)
        parallel = name not in ("neox_seq", "stablelm") and not bigcode
        assert [layer.parallel for layer in model.layers] == [parallel] * 2
        assert (attn[0].q_norm is not None) == name.endswith(("_qk", "_12b"))
        assert (attn[0].qkv_proj.bias is not None) == (name != "stablelm_12b")


@pytest.mark.parametrize("name", ["neox", "stablelm_12b", "bigcode"])
def test_compiled_matches_transformers(ckpt, refs, name) -> None:
    """The whole model compiled (attention and the linears opaque ops, the norms and activations traced)."""
    with LLM(str(ckpt(name)), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]
        assert greedy(llm, PROMPTS[4:5], MAX_NEW) == refs(name)[4:5]
        assert llm.engine.runner.compiled  # no eager fallback on the way


@pytest.mark.parametrize("name,overrides", [
    ("neox", {}),  # the de-interleaved q/k/v split by heads, biases with their rows
    ("phi_qk", {}),  # the shared q/k norms whole on each rank; the LM head's bias
    ("stablelm_12b", dict(num_key_value_heads=1)),  # per-head q norms split; the one k norm head replicated
    ("bigcode", {}),  # the one (multi-query) kv head replicated on both ranks
    ("bigcode_mha", {}),  # c_attn de-interleaved, then split by heads
    ("gpt2", {}),  # Conv1D weights transposed, then split
])
def test_tp2_matches_transformers(make_ckpt, name, overrides) -> None:
    path = make_ckpt(f"classic_{name}_tp", seed=3, **CASES[name], **overrides)
    prompts = PROMPTS[:4]
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.num_heads == 2  # this rank's half
        got = greedy(llm, prompts, MAX_NEW)
    assert got == hf_greedy(path, prompts, MAX_NEW)


# ---------------------------------------------------------------------------------- differences matter
def _rms_instead_of_layer_norm(model: torch.nn.Module) -> None:
    """Every LayerNorm without the mean subtracted (RMSNorm with the same weight and bias)."""
    def rms(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias
        return out if residual is None else (out, residual)
    for m in model.modules():
        if isinstance(m, LayerNorm):
            m.forward = types.MethodType(rms, m)


def _one_norm_sequential(model: torch.nn.Module) -> None:
    """Phi's / StableLM-12B's parallel layers made Llama's: the MLP reads the norm of the stream after attention."""
    def forward(self, positions, x, residual, kv_cache, decode=None):
        stream = x if residual is None else x + residual
        stream = stream + self.self_attn(positions, self.input_layernorm(stream), kv_cache, decode)
        return self.mlp(self.input_layernorm(stream)), stream
    for layer in model.layers:
        layer.forward = types.MethodType(forward, layer)


def _qkv_not_interleaved(monkeypatch, name: str) -> None:
    """A fused q/k/v of per-head layout (GPT-NeoX's query_key_value, GPTBigCode's c_attn without multi_query) read
    as [all q; all k; all v] rows (as Phi-3's qkv_proj): the loader is handed each fused tensor regrouped so that
    its de-interleaving yields that contiguous split."""
    cls, frag = (GPTNeoXForCausalLM, ".query_key_value.") if name.startswith("neox") else \
        (GPTBigCodeForCausalLM, ".c_attn.")
    original = cls.rename_weights

    def rename(self, weights):
        heads, dim = self.cfg.num_heads, self.cfg.head_dim

        def regrouped():
            for tensor_name, t in weights:
                if frag in tensor_name:
                    t = t.view(3, heads, dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
                yield tensor_name, t
        return original(self, regrouped())
    monkeypatch.setattr(cls, "rename_weights", rename)


def _full_rotary(model: torch.nn.Module) -> None:
    rotary = model.layers[0].self_attn.rotary  # (one, shared by the layers)
    c = model.cfg
    rotary.cos_sin_cache = build_cos_sin_cache(c.head_dim, rotary.cos_sin_cache.shape[0], c.rope_theta, None)


def _undo(model: torch.nn.Module, mutation: str) -> None:
    if mutation == "rms norms":
        _rms_instead_of_layer_norm(model)
    elif mutation == "other residual":
        for layer in model.layers:
            layer.parallel = not layer.parallel
    elif mutation == "one-norm sequential":
        _one_norm_sequential(model)
    elif mutation == "full rotary":
        _full_rotary(model)
    elif mutation == "no qk norm":
        for layer in model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
    elif mutation == "no norm biases":
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("bias"):
                p.zero_()
    elif mutation == "no qkv bias":
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.zero_()
    elif mutation == "no position embeddings":
        model.wpe.weight.zero_()
    elif mutation == "no lm head bias":
        model.lm_head.bias.zero_()
    elif mutation == "silu mlp":
        for layer in model.layers:
            mlp = layer.mlp
            mlp.forward = lambda x, mlp=mlp: mlp.fc2(torch.nn.functional.silu(mlp.fc1(x)))
    else:
        raise ValueError(mutation)


@pytest.mark.parametrize("name,mutation", [
    ("neox", "qkv not interleaved"),
    ("neox", "other residual"),
    ("neox_seq", "other residual"),
    ("neox", "full rotary"),
    ("neox", "rms norms"),
    ("neox", "no norm biases"),
    ("neox", "silu mlp"),
    ("phi", "one-norm sequential"),
    ("phi", "full rotary"),
    ("phi", "no lm head bias"),
    ("phi", "no qkv bias"),
    ("phi_qk", "no qk norm"),
    ("stablelm", "rms norms"),
    ("stablelm", "full rotary"),
    ("stablelm", "no qkv bias"),
    ("stablelm_12b", "one-norm sequential"),
    ("stablelm_12b", "no qk norm"),
    ("bigcode", "no position embeddings"),
    ("bigcode", "rms norms"),
    ("bigcode", "no norm biases"),
    ("bigcode_mha", "qkv not interleaved"),
    ("gpt2", "no position embeddings"),
    ("gpt2", "per-head qkv"),
    ("gpt2", "weights not transposed"),
    ("gpt2", "no inverse layer scale"),
])
def test_features_matter(ckpt, refs, make_ckpt, monkeypatch, name, mutation) -> None:
    """The parity tests can fail: with one of the family's differences undone in the loaded model (or its
    loading), greedy tokens leave transformers'."""
    loading = mutation in ("qkv not interleaved", "per-head qkv", "weights not transposed")
    if mutation == "qkv not interleaved":
        _qkv_not_interleaved(monkeypatch, name)
    elif mutation == "per-head qkv":  # GPT-2's [q; k; v] c_attn read as GPTBigCode's per-head layout
        monkeypatch.setattr(GPT2LMHeadModel, "per_head_qkv", True)
    elif mutation == "weights not transposed":  # attn.c_proj's Conv1D [in, out] weight read as nn.Linear's
        monkeypatch.setattr(gpt2, "_CONV1D", re.compile(r"\.(attn\.c_attn|mlp\.c_fc|mlp\.c_proj)\.weight$"))
    path = ckpt(name)
    if mutation == "no inverse layer scale":  # the same weights, the config's flag off (transformers' refs: on)
        path = make_ckpt(f"classic_{name}_no_inverse_scale", **dict(CASES[name], scale_attn_by_inverse_layer_idx=False))
    with LLM(str(path), dtype="float32") as llm:
        if not loading and mutation != "no inverse layer scale":
            _undo(llm.engine.runner.model, mutation)
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


@pytest.mark.parametrize("name", ["neox", "gpt2"])
def test_hub_checkpoint_names(ckpt, refs, tmp_path, name) -> None:
    """Checkpoints as the Hub holds them: buffers older transformers saved beside the weights (GPT-NeoX's causal
    mask and rotary frequencies, GPT-2's masks) are skipped, and GPT-2's original names lack `transformer.`."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / name
    shutil.copytree(ckpt(name), path)
    tensors = load_file(path / "model.safetensors")
    for i in range(2):
        if name == "neox":
            tensors[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
            tensors[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
            tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
        else:
            tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 8, 8)
            tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if name == "gpt2":
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with LLM(str(path), dtype="float32") as llm:
        assert greedy(llm, PROMPTS[:3], MAX_NEW) == refs(name)[:3]


def test_missing_tensor_named_as_stored(ckpt, tmp_path) -> None:
    """A missing tensor is named as the checkpoint spells it (GPT-NeoX's fused query_key_value, its embed_out)."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / "neox"
    shutil.copytree(ckpt("neox"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["gpt_neox.layers.1.attention.query_key_value.bias"], tensors["embed_out.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 4 tensor\(s\): embed_out.weight, "
                                         r"gpt_neox.layers.1.attention.query_key_value.bias"):
        LLM(str(path), dtype="float32")


def test_per_head_norms_differ_per_head(ckpt) -> None:
    """StableLM's q/k norms are loaded one head at a time, each head its own weight, in its own row."""
    import transformers as tf
    path = ckpt("stablelm_12b")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with LLM(str(path), dtype="float32") as llm:
        norm = llm.engine.runner.model.layers[1].self_attn.k_norm
        assert isinstance(norm, PerHeadLayerNorm) and norm.weight.shape == (2, 16)
        want = torch.stack([n.weight for n in hf.model.layers[1].self_attn.k_layernorm.norms])
        assert torch.equal(norm.weight, want) and not torch.equal(want[0], want[1])


# --------------------------------------------------------------------------------------------- configs
PYTHIA_160M = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
               "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
               "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 12,
               "num_hidden_layers": 12, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
               "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}
PHI_2 = {"architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0,
         "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02,
         "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi",
         "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
         "partial_rotary_factor": 0.4, "qk_layernorm": False, "resid_pdrop": 0.1, "rope_scaling": None,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 51200}
STABLELM_2_12B = {"architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257,
                  "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 13824, "layer_norm_eps": 1e-05,
                  "max_position_embeddings": 4096, "model_type": "stablelm", "num_attention_heads": 32,
                  "num_hidden_layers": 40, "num_key_value_heads": 8, "partial_rotary_factor": 0.25,
                  "qk_layernorm": True, "rope_theta": 10000, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", "use_parallel_residual": True, "use_qkv_bias": False,
                  "vocab_size": 100352}

STARCODER = {"activation_function": "gelu_pytorch_tanh", "architectures": ["GPTBigCodeForCausalLM"],
             "attention_softmax_in_fp32": True, "attn_pdrop": 0.1, "bos_token_id": 0, "embd_pdrop": 0.1,
             "eos_token_id": 0, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt_bigcode",
             "multi_query": True, "n_embd": 6144, "n_head": 48, "n_inner": 24576, "n_layer": 40,
             "n_positions": 8192, "resid_pdrop": 0.1, "scale_attention_softmax_in_fp32": True,
             "scale_attn_weights": True, "torch_dtype": "float32", "use_cache": True, "vocab_size": 49152}

GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": 50257}


def test_shipped_configs() -> None:
    """Released configs (pythia-160m, phi-2, stablelm-2-12b, starcoder, gpt2) read as transformers reads them:
    GPT-NeoX's older spellings (rotary_pct, rotary_emb_base), GPT-2's (n_embd, ...), and each config class's
    defaults where keys are missing."""
    import transformers as tf
    for raw, cls in ((PYTHIA_160M, tf.GPTNeoXConfig), (PHI_2, tf.PhiConfig), (STABLELM_2_12B, tf.StableLmConfig)):
        for drop in ((), ("rotary_pct", "rotary_emb_base", "partial_rotary_factor", "rope_theta")):
            c = {k: v for k, v in raw.items() if k not in drop}
            cfg, hf = ModelConfig.from_dict(c), cls(**{k: v for k, v in c.items() if k != "architectures"})
            head = hf.hidden_size // hf.num_attention_heads
            assert cfg.head_dim == head
            assert cfg.rotary_dim == int(head * hf.rope_parameters["partial_rotary_factor"])
            assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
            assert cfg.num_kv_heads == (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
            assert cfg.tie_word_embeddings is False
    cfg = ModelConfig.from_dict(dict(PYTHIA_160M, rotary_pct=0.5, rotary_emb_base=500))
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.attention_bias) == (32, 500.0, True)
    assert ModelConfig.from_dict(dict(PYTHIA_160M, attention_bias=False)).attention_bias is False
    cfg = ModelConfig.from_dict(STARCODER)  # (GPT-2's spellings)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.num_layers, cfg.max_position_embeddings, cfg.tie_word_embeddings) == \
        (6144, 48, 1, 128, 24576, 40, 8192, True)
    bare = {k: v for k, v in STARCODER.items() if k not in ("n_inner", "multi_query")}  # (defaults: 4x, MQA)
    assert (ModelConfig.from_dict(bare).intermediate_size, ModelConfig.from_dict(bare).num_kv_heads) == (24576, 1)
    assert ModelConfig.from_dict(dict(STARCODER, multi_query=False)).num_kv_heads == 48
    cfg = ModelConfig.from_dict(GPT2)  # (no multi_query: every head its own k/v)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.tie_word_embeddings) == \
        (12, 12, 64, 3072, True)


@pytest.mark.parametrize("name,override,match", [
    ("neox", dict(hidden_act="relu"), "hidden_act 'relu'"),
    ("stablelm", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("bigcode", dict(activation_function="relu"), "activation_function 'relu'"),
])
def test_unsupported_activation_refused(make_ckpt, name, override, match) -> None:
    path = make_ckpt(f"classic_{name}_{next(iter(override.values()))}", **{**CASES[name], **override})
    with pytest.raises(ValueError, match=match):
        LLM(str(path), dtype="float32")
