"""OLMo 3, EXAONE 4.0, ERNIE 4.5 (dense), Seed-OSS, Arcee (AFM), Apertus, Hunyuan (dense) and Ministral
(streamer/models/olmo3.py, exaone4.py, ernie4_5.py, seed_oss.py, arcee.py, apertus.py, hunyuan_dense.py,
ministral.py) against transformers (fp32, tiny random checkpoints registered
here): greedy tokens for a batch and a lone request, whole and chunked prefill, prompt logprobs, compiled for some;
tensor parallelism (or its refusal); the configs' defaults as transformers' config classes fill them in; and, so
that the parity tests can fail, each family's difference from Llama undone in the loaded model (or in the
checkpoint, for transformers) changes the tokens."""
from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models.apertus import XIELU  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.exaone4 import exaone4_layer_types  # noqa: E402
from streamer.models.layers import ParallelContext, RotaryEmbedding  # noqa: E402
from streamer.models.llama import Attention  # noqa: E402
from streamer.models.olmo3 import Olmo3ForCausalLM, olmo3_layer_types, olmo3_rope  # noqa: E402
from tests.checkpoints import hf_greedy, register_family  # noqa: E402
from tests.parity import PREFILL_MODES, assert_matches_transformers, greedy, random_prompts, reference_cache  # noqa: E402


# --------------------------------------------------------------------------------------- tiny checkpoints
def _olmo3(**kw: Any):
    """A sliding layer (window 8: the prompts run past it; plain rotary, base 10,000) then a full one (YaRN over
    base 1,000): the two layer types' own rotary parameters, in transformers-5's per-type spelling."""
    import transformers as tf
    kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
    kw.setdefault("sliding_window", 8)
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("rope_parameters", {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                           "rope_theta": 1_000.0}})
    return tf.Olmo3Config(**kw)


def _exaone4(**kw: Any):
    """A sliding layer (window 8, rotary) then a global one (NoPE); per-head q/k norms."""
    import transformers as tf
    kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
    kw.setdefault("sliding_window", 8)
    return tf.Exaone4Config(**kw)


def _ernie4_5(**kw: Any):
    """Biases everywhere (use_bias; random: see _randomise), interleaved rotary, tied head, head_dim 16."""
    import transformers as tf
    kw.setdefault("head_dim", 16)
    kw.setdefault("use_bias", True)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10_000.0})
    # Larger weights: with a tied head at 0.08, continuations mostly repeat each prompt's last token.
    kw["initializer_range"] = 0.2
    return tf.Ernie4_5Config(**kw)


def _seed_oss(**kw: Any):
    """q/k/v biases without an o_proj bias (the released models' switches), head_dim 32 (not hidden / heads)."""
    import transformers as tf
    kw.setdefault("head_dim", 32)
    kw["initializer_range"] = 0.2  # (at 0.08 continuations mostly repeat one token)
    return tf.SeedOssConfig(**kw)


def _arcee(**kw: Any):
    import transformers as tf
    return tf.ArceeConfig(**kw)  # (relu2, no gate: its defaults)


def _apertus(**kw: Any):
    """xIELU (random scalars: see _randomise), per-head q/k norms, llama3 rope scaling past 64 tokens."""
    import transformers as tf
    kw.setdefault("rope_parameters", {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
                                      "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0})
    return tf.ApertusConfig(**kw)


def _hunyuan_dense(**kw: Any):
    """q/k norms after rotary; NTK-alpha rotary (alpha 4: the base stretched to ~49,000)."""
    import transformers as tf
    kw.setdefault("head_dim", 16)
    kw.setdefault("rope_parameters", {"rope_type": "dynamic", "alpha": 4.0, "factor": 1.0, "rope_theta": 10_000.0})
    return tf.HunYuanDenseV1Config(**kw)


def _ministral(**kw: Any):
    """A sliding layer (window 8) then a full one."""
    import transformers as tf
    kw.setdefault("head_dim", 16)
    kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
    kw.setdefault("sliding_window", 8)
    return tf.MinistralConfig(**kw)


def _randomise(model) -> None:
    """transformers starts norms at one, biases at zero and xIELU at fixed scalars: random ones show that each is
    loaded and used where it belongs."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.3)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.2)
        elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
            p.normal_(0.0, 1.0)
    for name, b in model.named_buffers():
        if name.endswith("act_fn.beta"):
            b.uniform_(0.3, 0.7)


for _name, _fn in (("olmo3", _olmo3), ("exaone4", _exaone4), ("ernie4_5", _ernie4_5), ("seed_oss", _seed_oss),
                   ("arcee", _arcee), ("apertus", _apertus), ("hunyuan_dense", _hunyuan_dense),
                   ("ministral", _ministral)):
    register_family(_name, _fn, _randomise)

NAMES = ["olmo3", "exaone4", "ernie4_5", "seed_oss", "arcee", "apertus", "hunyuan_dense", "ministral"]
MAX_NEW = 12
PROMPTS = random_prompts(8, seed=23)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"{name}_b", family=name)


@pytest.fixture(scope="module")
def refs(ckpt) -> Callable[[str], list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per family (computed once)."""
    return reference_cache(ckpt, PROMPTS, MAX_NEW, min_distinct=4)


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name", NAMES)
@PREFILL_MODES
def test_matches_transformers(ckpt, refs, name, engine_args) -> None:
    """Greedy tokens (a batch, and a lone request) and prompt logprobs; with a small token budget prompts are
    prefilled in chunks of at most 16 tokens over blocks of 8, beside other requests' decodes."""
    path = ckpt(name)
    with LLM(str(path), dtype="float32", **engine_args) as llm:
        assert_matches_transformers(llm, path, PROMPTS, refs(name), MAX_NEW)


@pytest.mark.parametrize("name", ["exaone4", "apertus"])
def test_compiled_matches_transformers(ckpt, refs, name) -> None:
    """The whole model compiled: EXAONE's NoPE global layer beside a rotating sliding one, Apertus's xIELU."""
    with LLM(str(ckpt(name)), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]
        assert greedy(llm, PROMPTS[4:5], MAX_NEW) == refs(name)[4:5]
        assert llm.engine.runner.compiled  # no eager fallback on the way


def test_model_structure(ckpt) -> None:
    """What each family built, per layer (the parity tests then show it is what transformers computes)."""
    def model(name: str):
        return LLM(str(ckpt(name)), dtype="float32").engine.runner.model

    m = model("olmo3")
    windows = [layer.self_attn.attn.spec.sliding_window for layer in m.layers]
    assert windows == [8, None]
    tables = [layer.self_attn.rotary.cos_sin_cache for layer in m.layers]
    assert not torch.equal(tables[0], tables[1])
    m = model("exaone4")
    layers = [(layer.self_attn.attn.spec.sliding_window, layer.self_attn.use_rope) for layer in m.layers]
    assert layers == [(8, True), (None, False)]
    assert m.layers[0].self_attn.q_norm.weight.shape == (16,)  # per head
    m = model("ernie4_5")
    attn = m.layers[0].self_attn
    assert not attn.rotary.is_neox and attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert m.layers[0].mlp.gate_up_proj.bias is not None and m.layers[0].mlp.down_proj.bias is not None
    assert m.lm_head is None  # tied
    m = model("seed_oss")
    attn = m.layers[0].self_attn
    assert attn.head_dim == 32 and attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert m.layers[0].mlp.gate_up_proj.bias is None
    m = model("arcee")
    assert not hasattr(m.layers[0].mlp, "gate_up_proj") and m.layers[0].mlp.up_proj.output_sizes == [128]
    m = model("apertus")
    act = m.layers[0].mlp.act_fn
    assert isinstance(act, XIELU) and not torch.equal(act.alpha_p, m.layers[1].mlp.act_fn.alpha_p)
    assert 0.3 <= act.beta.item() <= 0.7 and act.beta.item() != 0.5
    m = model("hunyuan_dense")
    attn = m.layers[0].self_attn
    assert attn.q_norm is None and attn.query_layernorm.weight.shape == (16,)
    assert m.cfg.rope_scaling is None and m.cfg.rope_theta == pytest.approx(10_000.0 * 4.0 ** (16 / 14))
    m = model("ministral")
    assert [layer.self_attn.attn.spec.sliding_window for layer in m.layers] == [8, None]


# ---------------------------------------------------------------------------- each difference matters
def _undo(model: torch.nn.Module, mutation: str) -> None:
    """Undo one of a family's differences from Llama in the loaded model."""
    cfg = model.cfg
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if mutation == "no sliding window":
            attn.attn.spec.sliding_window = None
        elif mutation == "one rotary table" and i > 0:
            attn.rotary = model.layers[0].self_attn.rotary
        elif mutation == "global layers rotate":
            attn.use_rope = True
        elif mutation == "no qk norm":
            attn.q_norm = attn.k_norm = None
        elif mutation == "all sliding":
            attn.attn.spec.sliding_window = 8
        elif mutation == "qk norm before rotary":  # (Llama's forward, with Qwen3's norms: before rotary)
            attn.q_norm, attn.k_norm = attn.query_layernorm, attn.key_layernorm
            attn.forward = types.MethodType(Attention.forward, attn)
        elif mutation == "no ntk alpha":
            attn.rotary = RotaryEmbedding(cfg.rotary_dim, 512, cfg.raw["rope_parameters"]["rope_theta"], None)
        elif mutation == "no post norms":
            layer.post_attention_layernorm = layer.post_feedforward_layernorm = torch.nn.Identity()
        elif mutation == "neox rotary":
            rotary = attn.rotary
            attn.rotary = RotaryEmbedding(cfg.rotary_dim, 512, cfg.rope_theta, cfg.rope_scaling, is_neox=True)
            assert not rotary.is_neox
        elif mutation == "no qkv bias":
            attn.qkv_proj.bias.zero_()
        elif mutation == "no o bias":
            attn.o_proj.bias.zero_()
        elif mutation == "no mlp bias":
            layer.mlp.gate_up_proj.bias.zero_()
            layer.mlp.down_proj.bias.zero_()
        elif mutation == "relu":
            layer.mlp.act_fn = torch.nn.ReLU()
        elif mutation == "silu":
            layer.mlp.act_fn = torch.nn.SiLU()
        elif mutation == "default xielu":  # the scalars transformers starts from: the checkpoint's ignored
            act = layer.mlp.act_fn
            act.alpha_p.fill_(math.log(math.expm1(0.8)))
            act.alpha_n.fill_(math.log(math.expm1(0.8 - 0.5)))
            act.beta.fill_(0.5)


@pytest.mark.parametrize("name,mutation", [
    ("olmo3", "no sliding window"),
    ("olmo3", "one rotary table"),
    ("exaone4", "no sliding window"),
    ("exaone4", "global layers rotate"),
    ("exaone4", "no qk norm"),
    ("exaone4", "no post norms"),
    ("ernie4_5", "neox rotary"),
    ("ernie4_5", "no qkv bias"),
    ("ernie4_5", "no o bias"),
    ("ernie4_5", "no mlp bias"),
    ("seed_oss", "no qkv bias"),
    ("arcee", "relu"),
    ("apertus", "silu"),
    ("apertus", "default xielu"),
    ("apertus", "no qk norm"),
    ("hunyuan_dense", "qk norm before rotary"),
    ("hunyuan_dense", "no ntk alpha"),
    ("ministral", "no sliding window"),
    ("ministral", "all sliding"),
])
def test_features_matter(ckpt, refs, name, mutation) -> None:
    """The parity tests can fail: with one of the family's differences undone in the loaded model, greedy tokens
    leave transformers'."""
    with LLM(str(ckpt(name)), dtype="float32") as llm:
        _undo(llm.engine.runner.model, mutation)
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


@pytest.mark.parametrize("name,override", [
    ("seed_oss", {"attention_out_bias": True, "mlp_bias": True}),
    ("arcee", {"mlp_bias": True, "attention_bias": True}),
    ("ernie4_5", {"use_bias": False, "tie_word_embeddings": False}),
], ids=["seed_oss-out-and-mlp-bias", "arcee-biases", "ernie-no-bias"])
def test_bias_switches_match_transformers(make_ckpt, name, override) -> None:
    """The families' other bias switches (random biases), against transformers."""
    path = make_ckpt(f"{name}_{'_'.join(override)}_b", family=name, **override)
    want = hf_greedy(path, PROMPTS[:4], MAX_NEW)
    with LLM(str(path), dtype="float32", max_num_batched_tokens=16) as llm:
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == want


# -------------------------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("name", ["exaone4", "ernie4_5", "apertus", "hunyuan_dense"])
def test_tp2_matches_transformers(ckpt, refs, name) -> None:
    """Two ranks, each half of the heads and of the (gated or gateless) MLP; per-head norms, biases, xIELU whole."""
    with LLM(str(ckpt(name)), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.num_heads == 2  # this rank's half
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]


def test_olmo3_refuses_tensor_parallelism(ckpt, monkeypatch) -> None:
    path = ckpt("olmo3")
    with pytest.raises(ValueError, match="Olmo3ForCausalLM does not support tensor parallelism"):  # before any worker
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
    monkeypatch.setattr(ParallelContext, "size", 2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        Olmo3ForCausalLM(ModelConfig.from_dir(path), None, 64)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- configs
def _tf_config(model_type: str, c: dict[str, Any]):
    import transformers
    return transformers.AutoConfig.for_model(model_type, **{k: v for k, v in c.items() if k != "architectures"})


@pytest.mark.parametrize("over", [
    {},  # every 4th layer full; the older spelling: rope_theta and YaRN for the full layers only
    {"rope_theta": 10_000.0},  # (the sliding layers keep OLMo 3's default base, as transformers' config)
    {"rope_scaling": None, "layer_types": ["full_attention"] * 6},
])
def test_olmo3_config_as_transformers(over) -> None:
    """Olmo-3-7B's config.json (older spelling): the layer types and each type's rotary as transformers reads them."""
    c = {"architectures": ["Olmo3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 100, "rope_theta": 500000,
         "max_position_embeddings": 65536, "sliding_window": 4096,
         "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                          "original_max_position_embeddings": 8192, "rope_type": "yarn"}, **over}
    want = _tf_config("olmo3", c)
    for cfg_dict in (c, json.loads(want.to_json_string())):  # and as transformers 5 writes it back
        cfg = ModelConfig.from_dict({**cfg_dict, "architectures": ["Olmo3ForCausalLM"]})
        assert olmo3_layer_types(cfg.raw, 6) == want.layer_types
        rope = olmo3_rope(cfg.raw)
        for t in ("full_attention", "sliding_attention"):
            p = want.rope_parameters[t]
            assert rope[t][0] == p["rope_theta"]
            assert (rope[t][1] or {}).get("rope_type", "default") == p["rope_type"]
            if p["rope_type"] == "yarn":
                assert rope[t][1]["factor"] == 8.0 and rope[t][1]["attention_factor"] == p["attention_factor"]
        assert cfg.rms_norm_eps == want.rms_norm_eps


@pytest.mark.parametrize("over", [{}, {"sliding_window_pattern": 3}, {"layer_types": None, "sliding_window": None}])
def test_exaone4_layer_types_as_transformers(over) -> None:
    """Without `layer_types` (EXAONE-4.0-32B's config has them; a hand-written one may not), the sliding and global
    layers transformers' config derives; without a sliding window every layer is global and rotates."""
    c = {"architectures": ["Exaone4ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 8, "vocab_size": 100, "sliding_window": 4096, **over}
    c = {k: v for k, v in c.items() if v is not None or k == "sliding_window"}
    cfg = ModelConfig.from_dict(c)
    if c.get("sliding_window") is None:
        assert exaone4_layer_types(cfg.raw, 8) == ["full_attention"] * 8
        return
    assert exaone4_layer_types(cfg.raw, 8) == _tf_config("exaone4", c).layer_types
    assert exaone4_layer_types({"sliding_window": 16, "sliding_window_pattern": "LLLG"}, 6) == \
        ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("arch,model_type", [
    ("Olmo3ForCausalLM", "olmo3"), ("Exaone4ForCausalLM", "exaone4"), ("Ernie4_5ForCausalLM", "ernie4_5"),
    ("SeedOssForCausalLM", "seed_oss"), ("ArceeForCausalLM", "arcee"), ("ApertusForCausalLM", "apertus"),
    ("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"), ("MinistralForCausalLM", "ministral"),
])
def test_config_defaults_as_transformers(arch, model_type) -> None:
    """A config.json that leaves the optional keys out: what transformers' config class fills in (eps, head size,
    tying, rotary base, biases)."""
    c = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100}
    want = _tf_config(model_type, c)
    cfg = ModelConfig.from_dict(c)
    assert cfg.rms_norm_eps == want.rms_norm_eps
    assert cfg.head_dim == (getattr(want, "head_dim", None) or 16)
    assert cfg.tie_word_embeddings == want.tie_word_embeddings
    params = want.rope_parameters.get("full_attention", want.rope_parameters)
    if model_type != "apertus":  # (Apertus's default is Llama-3 scaled: the released configs spell it out)
        assert cfg.rope_theta == params["rope_theta"]
    if model_type == "seed_oss":
        assert cfg.attention_bias and want.attention_bias and not want.attention_out_bias


def test_xielu_matches_transformers() -> None:
    """The activation itself, against transformers' (Python path), over both branches and at random scalars."""
    from transformers.activations import XIELUActivation
    ref = XIELUActivation(dtype=torch.float32)
    ours = XIELU()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (ref.alpha_p, ref.alpha_n):
            p.normal_(0.0, 1.0, generator=g)
        ours.alpha_p.copy_(ref.alpha_p)
        ours.alpha_n.copy_(ref.alpha_n)
        x = torch.randn(64, 32, generator=g) * 3
        torch.testing.assert_close(ours(x), ref(x))
    assert set(dict(ref.state_dict())) == {n for n, _ in ours.named_parameters()}  # (the checkpoint's names)


def test_apertus_loads_without_xielu_constants(ckpt, refs, tmp_path) -> None:
    """A checkpoint without act_fn.beta / act_fn.eps (older writers kept them out of the state dict) loads with
    their defaults; the learned alpha_p / alpha_n are required."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = ckpt("apertus")
    for drop, ok in (((".act_fn.beta", ".act_fn.eps"), True), ((".act_fn.alpha_p",), False)):
        path = tmp_path / f"apertus_{ok}"
        shutil.copytree(src, path)
        state = load_file(str(path / "model.safetensors"))
        if ok:  # (the constants back at their defaults, so that transformers' tokens still apply)
            assert any(v.item() != 0.5 for k, v in state.items() if k.endswith(".act_fn.beta"))
        state = {k: v for k, v in state.items() if not k.endswith(drop)}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        if ok:
            with LLM(str(path), dtype="float32") as llm:
                assert all(layer.mlp.act_fn.beta.item() == 0.5 for layer in llm.engine.runner.model.layers)
        else:
            with pytest.raises(ValueError, match="act_fn.alpha_p"):
                LLM(str(path), dtype="float32")


def test_hunyuan_ntk_alpha_rope_as_transformers() -> None:
    """Hunyuan-7B's rope_scaling (older spelling): the stretched base gives transformers' inverse frequencies; a
    dynamic NTK scaling without alpha is refused."""
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    from streamer.models.hunyuan_dense import ntk_alpha_rope
    c = {"architectures": ["HunYuanDenseV1ForCausalLM"], "hidden_size": 256, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "num_hidden_layers": 2,
         "vocab_size": 100, "rope_theta": 10000.0, "max_position_embeddings": 32768,
         "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "type": "dynamic"}}
    want = HunYuanDenseV1RotaryEmbedding(_tf_config("hunyuan_v1_dense", c)).inv_freq
    cfg = ntk_alpha_rope(ModelConfig.from_dict(c))
    assert cfg.rope_scaling is None
    got = 1.0 / cfg.rope_theta ** (torch.arange(0, 128, 2).float() / 128)
    torch.testing.assert_close(got, want)
    c["rope_scaling"] = {"factor": 2.0, "type": "dynamic"}
    with pytest.raises(ValueError, match="NTK"):
        ntk_alpha_rope(ModelConfig.from_dict(c))
