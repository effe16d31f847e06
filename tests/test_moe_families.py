"""Qwen2-MoE (streamer/models/qwen2_moe.py), OLMoE (models/olmoe.py), Granite MoE and GraniteMoeShared
(models/granite_moe.py), ERNIE 4.5 MoE (models/ernie4_5_moe.py), Hunyuan MoE (models/hunyuan_moe.py) and Phi-3.5-MoE
(models/phimoe.py) against transformers' Qwen2MoeForCausalLM / OlmoeForCausalLM / GraniteMoeForCausalLM /
GraniteMoeSharedForCausalLM / Ernie4_5_MoeForCausalLM / HunYuanMoEV1ForCausalLM / PhimoeForCausalLM (fp32, tiny random
checkpoints of 4 experts, top 2, registered here with tests.checkpoints.register_family): greedy tokens (a batch, a
lone request) and prompt logprobs, whole and chunked prefill, compiled; transformers 5's fused expert layout; 4-bit
experts (GPTQ); two tensor-parallel ranks (OLMoE refused); the shipped configs' readings; and, so that those tests can
fail, each family's routing details (and other differences from Llama) undone in the loaded model change the
tokens."""
from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.ernie4_5_moe import ErnieMoE, ernie_sparse  # noqa: E402
from streamer.models.hunyuan_dense import ntk_alpha_rope  # noqa: E402
from streamer.models.hunyuan_moe import HunyuanMoE  # noqa: E402
from streamer.models.layers import build_cos_sin_cache  # noqa: E402
from streamer.models.llama import MLP, Attention  # noqa: E402
from streamer.models.moe import SparseMoE, unfuse_experts  # noqa: E402
from streamer.models.qwen2_moe import Qwen2MoeSparseMoE, qwen2_moe_sparse, qwen2_moe_window  # noqa: E402
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
def _qwen2_moe_config(**kw: Any):
    """3 layers: 0 and 2 sparse (4 experts of 32, top 2, not renormalised, a shared expert of 64 behind its sigmoid
    gate), 1 dense (mlp_only_layers); q/k/v biases."""
    import transformers as tf
    kw["num_hidden_layers"] = 3
    kw.setdefault("num_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw.setdefault("moe_intermediate_size", 32)
    kw.setdefault("shared_expert_intermediate_size", 64)
    kw.setdefault("mlp_only_layers", [1])
    kw.setdefault("norm_topk_prob", False)
    kw["initializer_range"] = 0.15  # (at tests.checkpoints' 0.08, continuations mostly repeat one token)
    return tf.Qwen2MoeConfig(**kw)


def _olmoe_config(**kw: Any):
    """Every layer sparse: 4 experts of 32, top 2, not renormalised; whole-projection q/k norms."""
    import transformers as tf
    kw.setdefault("num_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw["intermediate_size"] = kw.get("intermediate_size", 32)
    kw.setdefault("pad_token_id", 0)
    kw["initializer_range"] = 0.15  # (at tests.checkpoints' 0.08, continuations mostly repeat one token)
    return tf.OlmoeConfig(**kw)


def _granitemoe_config(shared: bool) -> Callable[..., Any]:
    def config(**kw: Any):
        """Granite-3-like multipliers (as tests/checkpoints.py's "granite"), 4 experts of 32, top 2; the Shared
        variant adds a shared MLP of 48."""
        import transformers as tf
        kw.setdefault("num_local_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw["intermediate_size"] = kw.get("intermediate_size", 32)
        kw.setdefault("embedding_multiplier", 12.0)
        kw.setdefault("residual_multiplier", 0.22)
        kw.setdefault("attention_multiplier", 0.25)
        kw.setdefault("logits_scaling", 8.0)
        kw.setdefault("tie_word_embeddings", False)
        kw["initializer_range"] = 0.15  # (at tests.checkpoints' 0.08, continuations mostly repeat one token)
        if shared:
            kw.setdefault("shared_intermediate_size", 48)
            return tf.GraniteMoeSharedConfig(**kw)
        return tf.GraniteMoeConfig(**kw)
    return config


def _ernie_config(**kw: Any):
    """3 layers: 0 dense (moe_layer_start_index 1), 1 and 2 sparse (4 experts of 32, top 2, a shared expert);
    interleaved rotary; tied head."""
    import transformers as tf
    kw["num_hidden_layers"] = 3
    kw.setdefault("moe_num_experts", 4)
    kw.setdefault("moe_k", 2)
    kw.setdefault("moe_intermediate_size", 32)
    kw.setdefault("moe_num_shared_experts", 1)
    kw["initializer_range"] = 0.15  # (at tests.checkpoints' 0.08, continuations mostly repeat one token)
    return tf.Ernie4_5_MoeConfig(**kw)


def _randomise(model) -> None:
    """transformers starts the norms at one, the q/k/v biases at zero and ERNIE's correction bias at zero: random
    ones show that each is loaded and used where it belongs (the correction bias about as wide as the probabilities'
    spread, so that it changes some tokens' experts)."""
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.normal_(1.0, 0.3)
        elif name.endswith(".bias"):  # (q/k/v/o, LayerNorms', Phi-MoE's LM head's)
            p.normal_(0.0, 0.3)
        elif name.endswith("e_score_correction_bias"):
            p.normal_(0.0, 0.1)


def _hunyuan_config(**kw: Any):
    """Every layer sparse (4 experts of 32, top 2, renormalised) plus a shared MLP of 32; per-head q/k norms after
    rotary; NTK-alpha rope (alpha 1000, as the released configs)."""
    import transformers as tf
    kw.setdefault("num_experts", 4)
    kw.setdefault("moe_topk", 2)
    kw["intermediate_size"] = kw.get("intermediate_size", 32)
    kw.setdefault("head_dim", 16)
    kw.setdefault("rope_parameters", {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})
    kw["initializer_range"] = 0.15  # (at tests.checkpoints' 0.08, continuations mostly repeat one token)
    return tf.HunYuanMoEV1Config(**kw)


def _phimoe_config(**kw: Any):
    """Phi-3.5-MoE-like: every layer sparse (4 experts of 32, sparsemixer top 2, router_jitter_noise 0.01), LayerNorms,
    q/k/v/o and LM head biases, longrope (original length 32: the prompts reach past it) with equal mscales."""
    import transformers as tf
    kw.setdefault("num_local_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw["intermediate_size"] = kw.get("intermediate_size", 32)
    kw.setdefault("attention_bias", True)
    kw.setdefault("lm_head_bias", True)
    kw.setdefault("pad_token_id", 0)
    half = kw["hidden_size"] // kw["num_attention_heads"] // 2
    kw.setdefault("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                      "long_factor": [1.0 + 2.0 * i for i in range(half)],
                                      "short_mscale": 1.2, "long_mscale": 1.2, "original_max_position_embeddings": 32})
    kw["initializer_range"] = 0.15  # (at tests.checkpoints' 0.08, continuations mostly repeat one token)
    return tf.PhimoeConfig(**kw)


register_family("qwen2_moe", _qwen2_moe_config, _randomise)
register_family("olmoe", _olmoe_config, _randomise)
register_family("granitemoe", _granitemoe_config(False), _randomise)
register_family("granitemoeshared", _granitemoe_config(True), _randomise)
register_family("ernie4_5_moe", _ernie_config, _randomise)
register_family("hunyuan_moe", _hunyuan_config, _randomise)
register_family("phimoe", _phimoe_config, _randomise)

MAX_NEW = 12
CASES: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(family="qwen2_moe"),
    "olmoe": dict(family="olmoe"),
    "granitemoe": dict(family="granitemoe"),
    "granitemoeshared": dict(family="granitemoeshared"),
    "ernie4_5_moe": dict(family="ernie4_5_moe"),
    "hunyuan_moe": dict(family="hunyuan_moe"),
    "phimoe": dict(family="phimoe"),
    "olmoe_clip": dict(family="olmoe", clip_qkv=0.6),  # (clip_qkv low enough to bite)
}
PARITY = [c for c in CASES if c != "olmoe_clip"]
PROMPTS = random_prompts(10, seed=23)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"moe_families_{name}", **CASES[name])


@pytest.fixture(scope="module")
def refs(ckpt) -> Callable[[str], list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per case (computed once)."""
    return reference_cache(ckpt, PROMPTS, MAX_NEW, min_distinct=4)


def _moes(model: torch.nn.Module) -> list[SparseMoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name", PARITY)
@PREFILL_MODES
def test_matches_transformers(ckpt, refs, name, engine_args) -> None:
    """Greedy tokens (a batch, and a lone request) and prompt logprobs; with a small token budget prompts are
    prefilled in chunks of at most 16 tokens over blocks of 8, beside other requests' decodes."""
    path = ckpt(name)
    with LLM(str(path), dtype="float32", **engine_args) as llm:
        assert_matches_transformers(llm, path, PROMPTS, refs(name), MAX_NEW)
        model = llm.engine.runner.model
        kinds = [type(layer.mlp) for layer in model.layers]
        if name == "qwen2_moe":
            assert kinds == [Qwen2MoeSparseMoE, MLP, Qwen2MoeSparseMoE]
            attn = model.layers[0].self_attn
            assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
        elif name == "ernie4_5_moe":
            assert kinds == [MLP, ErnieMoE, ErnieMoE] and model.lm_head is None
            assert not model.layers[0].self_attn.rotary.is_neox
            assert model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
        else:
            assert all(issubclass(k, SparseMoE) for k in kinds)
        if name == "hunyuan_moe":
            assert all(k is HunyuanMoE for k in kinds)
            assert model.layers[0].mlp.gate.weight.dtype == torch.float32
        if name == "granitemoeshared":
            assert all(layer.shared_mlp is not None for layer in model.layers)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe", "ernie4_5_moe", "phimoe"])
def test_compiled_matches_transformers(ckpt, refs, name) -> None:
    """The whole model compiled (the routing and the shared experts traced into the graph, the experts and
    attention opaque ops)."""
    with LLM(str(ckpt(name)), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]
        assert greedy(llm, PROMPTS[4:5], MAX_NEW) == refs(name)[4:5]
        assert llm.engine.runner.compiled  # no eager fallback on the way


def test_olmoe_clip_qkv(ckpt, refs) -> None:
    """OLMoE's clip_qkv clamps the normed q, k and v (transformers' tokens with it differ from those without)."""
    assert refs("olmoe_clip") != refs("olmoe")
    path = ckpt("olmoe_clip")
    with LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8) as llm:
        assert greedy(llm, PROMPTS, MAX_NEW) == refs("olmoe_clip")
        assert_logprobs_match(llm, path, PROMPTS[:2])


# ------------------------------------------------------------------------------------ the tests can fail
class _Zero(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def _undo(model: torch.nn.Module, mutation: str) -> None:
    """Undo one of a family's details in the loaded model."""
    rotary = model.layers[0].self_attn.rotary  # (one, shared by the layers)
    if mutation == "neox rope":
        rotary.is_neox = not rotary.is_neox
    elif mutation == "long factors":  # (what LongRoPE would switch to past the original length)
        factors = torch.tensor(model.cfg.rope_scaling["long_factor"])
        inv_freq = 1.0 / (factors * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        freqs = torch.outer(torch.arange(rotary.cos_sin_cache.shape[0]).float(), inv_freq)
        rotary.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * 1.2
    elif mutation == "no lm head bias":
        model.lm_head.bias.zero_()
    elif mutation == "rope without alpha":
        rotary.cos_sin_cache = build_cos_sin_cache(16, rotary.cos_sin_cache.shape[0], 10000.0, None)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        moe = isinstance(mlp, SparseMoE)
        if mutation == "renormalised top-k" and moe:
            mlp.norm_topk_prob = True
        elif mutation == "top-k not renormalised" and moe:
            mlp.norm_topk_prob = False
        elif mutation == "constant shared expert gate" and moe:
            mlp.shared_expert_gate.weight.zero_()  # sigmoid(0) = 0.5 for every token
        elif mutation == "no shared expert" and moe:
            mlp.shared_expert = _Zero()  # (its linears' weights are prepacked for the CPU: replaced, not zeroed)
        elif mutation == "no shared experts" and moe:
            mlp.shared_experts = None
        elif mutation == "softmax top-2" and moe:
            mlp.route = types.MethodType(SparseMoE.route, mlp)
        elif mutation == "no shared mlp" and isinstance(mlp, HunyuanMoE):
            mlp.shared_mlp = _Zero()
        elif mutation == "no shared mlp":  # (Granite's, beside the experts)
            layer.shared_mlp = None
        elif mutation == "no qkv bias":
            attn.qkv_proj.bias.zero_()
        elif mutation == "no qk norm":
            attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
        elif mutation == "no correction bias" and moe:
            mlp.gate.e_score_correction_bias.zero_()
        elif mutation == "correction bias weights too" and moe:
            route = mlp.route

            def biased(x, mlp=mlp, route=route):  # the experts weighted by probability + bias, as chosen
                weights, ids = route(x)
                w = weights + mlp.gate.e_score_correction_bias[ids].to(weights.dtype)
                return w / w.sum(-1, keepdim=True), ids
            mlp.route = biased
        elif mutation == "qk norm before rotary":  # (Llama's forward, with Qwen3's norms: before rotary)
            attn.q_norm, attn.k_norm = attn.query_layernorm, attn.key_layernorm
            attn.forward = types.MethodType(Attention.forward, attn)
        elif mutation == "no residual multiplier":
            layer.residual_multiplier = 1.0


@pytest.mark.parametrize("name,mutation", [
    ("qwen2_moe", "renormalised top-k"),
    ("qwen2_moe", "constant shared expert gate"),
    ("qwen2_moe", "no shared expert"),
    ("qwen2_moe", "no qkv bias"),
    ("olmoe", "renormalised top-k"),
    ("olmoe", "no qk norm"),
    ("granitemoe", "top-k not renormalised"),
    ("granitemoe", "no residual multiplier"),
    ("granitemoeshared", "no shared mlp"),
    ("ernie4_5_moe", "no correction bias"),
    ("ernie4_5_moe", "correction bias weights too"),
    ("ernie4_5_moe", "top-k not renormalised"),
    ("ernie4_5_moe", "no shared experts"),
    ("ernie4_5_moe", "neox rope"),
    ("hunyuan_moe", "top-k not renormalised"),
    ("hunyuan_moe", "no shared mlp"),
    ("hunyuan_moe", "qk norm before rotary"),
    ("hunyuan_moe", "rope without alpha"),
    ("phimoe", "softmax top-2"),
    ("phimoe", "no lm head bias"),
    ("phimoe", "long factors"),
])
def test_features_matter(ckpt, refs, name, mutation) -> None:
    """The parity tests can fail: with one of the family's details undone in the loaded model, greedy tokens leave
    transformers'."""
    with LLM(str(ckpt(name)), dtype="float32") as llm:
        with torch.no_grad():
            _undo(llm.engine.runner.model, mutation)
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


def test_dense_and_sparse_layers_matter(ckpt, refs, tmp_path) -> None:
    """Which layers are sparse is read from the config: Qwen2-MoE's mlp_only_layers and ERNIE's
    moe_layer_start_index changed in the checkpoint's config (the weights then fit no more) are refused, not
    silently misread."""
    for name, key, value in (("qwen2_moe", "mlp_only_layers", []), ("ernie4_5_moe", "moe_layer_start_index", 0)):
        path = tmp_path / name
        shutil.copytree(ckpt(name), path)
        c = json.loads((path / "config.json").read_text())
        c[key] = value
        (path / "config.json").write_text(json.dumps(c))
        with pytest.raises(ValueError, match="missing|unexpected"):
            LLM(str(path), dtype="float32")


# -------------------------------------------------------------------------------------------- loading
def _fuse(state: dict[str, torch.Tensor], granite: bool) -> dict[str, torch.Tensor]:
    """The per-expert tensors of every layer fused as transformers 5 holds them: experts.gate_up_proj [E, 2I, H]
    (each expert's gate rows, then its up rows) and experts.down_proj [E, H, I]; Granite's Hub names renamed to
    transformers 5's (block_sparse_moe.experts.*, router.weight), Phi-MoE's (block_sparse_moe.gate, experts.E.w1 /
    w3 / w2) to mlp.router and mlp.experts; ERNIE's correction bias under gate.moe_statics."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        if not granite and ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.gate.", ".mlp.router.").replace(".block_sparse_moe.", ".mlp.")
            for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                name = name.replace(f".{old}.weight", f".{new}.weight")
        if granite and ".block_sparse_moe.input_linear." in name:
            out[name.replace(".input_linear.weight", ".experts.gate_up_proj")] = t
        elif granite and ".block_sparse_moe.output_linear." in name:
            out[name.replace(".output_linear.weight", ".experts.down_proj")] = t
        elif granite and ".block_sparse_moe.router.layer." in name:
            out[name.replace(".router.layer.", ".router.")] = t
        elif ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = t
        elif ".mlp.moe_statics." in name:
            out[name.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics.")] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        order = sorted(by_e)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in order])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in order])
    return out


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe", "granitemoeshared", "ernie4_5_moe", "hunyuan_moe", "phimoe"])
def test_fused_expert_layout_loads(ckpt, refs, tmp_path, name) -> None:
    """transformers 5's in-memory layout (fused experts, its spellings) loads as the Hub's per-expert one does
    (save_pretrained writes the Hub's: this test writes the fused one itself)."""
    path = tmp_path / name
    shutil.copytree(ckpt(name), path)
    state = load_file(str(path / "model.safetensors"))
    fused = _fuse(state, granite=name.startswith("granite"))
    assert any(k.endswith("experts.gate_up_proj") for k in fused) and not any(".experts.0." in k for k in fused)
    save_file(fused, str(path / "model.safetensors"))
    with LLM(str(path), dtype="float32") as llm:
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]


def test_unfuse_experts() -> None:
    """gate_up_proj [E, 2I, H] -> per expert gate (first I rows) and up; names paired with no tensor pass."""
    t = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    out = dict(unfuse_experts([("model.layers.0.mlp.experts.gate_up_proj", t), ("x", "x")]))
    assert torch.equal(out["model.layers.0.mlp.experts.1.gate_proj.weight"], t[1, :2])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], t[1, 2:])
    assert out["x"] == "x"
    names = dict(unfuse_experts([("model.layers.0.mlp.experts.gate_up_proj", "n")]))
    assert names == {"model.layers.0.mlp.experts.gate_up_proj": "n"}
    with pytest.raises(ValueError, match="expected"):
        list(unfuse_experts([("model.layers.0.block_sparse_moe.output_linear.weight", torch.zeros(2, 3))]))


@pytest.mark.parametrize("name", ["qwen2_moe", "ernie4_5_moe"])
def test_gptq_experts_stay_4bit(ckpt, tmp_path, name) -> None:
    """A GPTQ checkpoint (per-expert qweight / scales / qzeros, the loader's generic expert mapping): every sparse
    MLP computes with its 4-bit experts and matches transformers on the dequantized weights."""
    from tests.int_checkpoints import write_int_checkpoint
    out_dir, ref_dir = tmp_path / "quant", tmp_path / "ref"
    write_int_checkpoint(ckpt(name), out_dir, ref_dir, "gptq", group_size=32, sym=False)
    want = hf_greedy(ref_dir, PROMPTS[:4], 8)
    with LLM(str(out_dir), dtype="float32", max_num_batched_tokens=16) as llm:
        got = greedy(llm, PROMPTS[:4], 8)
        moes = _moes(llm.engine.runner.model)
    assert got == want
    assert moes and all(m.int4 is not None and m.w13.numel() == 0 for m in moes)


@pytest.mark.parametrize("name", ["qwen2_moe", "granitemoeshared", "ernie4_5_moe", "hunyuan_moe", "phimoe"])
def test_tp2_matches_transformers(ckpt, refs, name) -> None:
    """Two ranks (gloo): experts and shared experts split along their intermediate size, the routers (ERNIE's fp32
    one and its correction bias, Qwen2-MoE's shared expert gate) whole on every rank."""
    with LLM(str(ckpt(name)), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.num_heads == 2
        assert greedy(llm, PROMPTS[:4], MAX_NEW) == refs(name)[:4]


def test_olmoe_refuses_tensor_parallelism(ckpt) -> None:
    with pytest.raises(ValueError, match="q/k norms span all heads"):
        LLM(str(ckpt("olmoe")), dtype="float32", tensor_parallel_size=2)


# --------------------------------------------------------------------------------------------- configs
def _qwen15_moe_config(**over: Any) -> dict[str, Any]:
    """Qwen1.5-MoE-A2.7B's config.json, as shipped (no qkv_bias key: q/k/v biases always)."""
    c = {"architectures": ["Qwen2MoeForCausalLM"], "bos_token_id": 151643, "decoder_sparse_step": 1,
         "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
         "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
         "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
         "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
         "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
    c.update(over)
    return c


def test_qwen2_moe_config() -> None:
    raw = _qwen15_moe_config()
    cfg = ModelConfig.from_dict(raw)
    assert cfg.architecture == "Qwen2MoeForCausalLM" and cfg.rope_theta == 1e6
    assert all(qwen2_moe_sparse(raw, i) for i in range(24))
    assert [qwen2_moe_sparse(dict(raw, decoder_sparse_step=2, mlp_only_layers=[3]), i) for i in range(6)] == \
        [False, True, False, False, False, True]
    assert qwen2_moe_window(raw, 0) is None  # (sliding_window is there, use_sliding_window is not)
    slide = dict(raw, use_sliding_window=True, max_window_layers=3)
    assert [qwen2_moe_window(slide, i) for i in range(5)] == [32768, None, 32768, None, None]


def test_olmoe_and_ernie_config_defaults() -> None:
    """Keys a config.json may leave out take transformers' defaults: OLMoE's and ERNIE's rms_norm_eps 1e-5, ERNIE's
    rope_theta 500000 and tied head; ERNIE's sparse layers."""
    olmoe = {"architectures": ["OlmoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 1024,
             "num_attention_heads": 16, "num_hidden_layers": 16, "vocab_size": 50304, "num_experts": 64,
             "num_experts_per_tok": 8, "rope_theta": 10000.0}
    assert ModelConfig.from_dict(olmoe).rms_norm_eps == 1e-5
    ernie = {"architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 2560, "intermediate_size": 12288,
             "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 103424,
             "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
             "moe_intermediate_size": 1536, "moe_k": 6, "moe_layer_interval": 1, "num_nextn_predict_layers": 1}
    cfg = ModelConfig.from_dict(ernie)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.tie_word_embeddings, cfg.head_dim) == (1e-5, 500000.0, True, 128)
    assert [ernie_sparse(ernie, 28, i) for i in (0, 1, 27)] == [False, True, True]
    assert [ernie_sparse(dict(ernie, moe_layer_end_index=2, moe_layer_interval=2), 28, i) for i in range(5)] == \
        [False, True, False, False, False]


def test_ernie_refuses_use_bias(ckpt, tmp_path) -> None:
    path = tmp_path / "ernie_bias"
    shutil.copytree(ckpt("ernie4_5_moe"), path)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(c, use_bias=True)))
    with pytest.raises(ValueError, match="use_bias"):
        LLM(str(path), dtype="float32")


def test_ernie_skips_mtp_weights(ckpt, refs, tmp_path) -> None:
    """ERNIE's Hub checkpoints also store the multi-token-prediction block (model.mtp_*): it is skipped."""
    path = tmp_path / "ernie_mtp"
    shutil.copytree(ckpt("ernie4_5_moe"), path)
    save_file({"model.mtp_linear_proj.0.weight": torch.zeros(64, 128), "model.mtp_emb_norm.0.weight": torch.ones(64),
               "model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(64, 64)},
              str(path / "model-mtp.safetensors"))
    with LLM(str(path), dtype="float32") as llm:
        assert greedy(llm, PROMPTS[:2], MAX_NEW) == refs("ernie4_5_moe")[:2]


def test_ernie_routing_bias_changes_choices(ckpt) -> None:
    """In the test checkpoint the correction bias changes many tokens' expert choices (so the parity test covers it
    well beyond the odd token), and the weights stay the unbiased probabilities, renormalised."""
    with LLM(str(ckpt("ernie4_5_moe")), dtype="float32") as llm:
        moe = llm.engine.runner.model.layers[1].mlp
        assert isinstance(moe, ErnieMoE) and moe.gate.weight.dtype == torch.float32
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
        weights, ids = moe.route(x)
        assert torch.allclose(weights.sum(-1), torch.ones(256))
        bias = moe.gate.e_score_correction_bias.clone()
        moe.gate.e_score_correction_bias.zero_()
        _, unbiased = moe.route(x)
        moe.gate.e_score_correction_bias.copy_(bias)
        changed = (ids.sort(-1).values != unbiased.sort(-1).values).any(-1).float().mean().item()
        assert changed > 0.1, f"only {changed:.0%} of tokens change experts"


def test_hunyuan_config() -> None:
    """A Hunyuan-A13B-like config: rms_norm_eps 1e-5 by default; NTK-alpha folded into the rotary base."""
    c = {"architectures": ["HunYuanMoEV1ForCausalLM"], "hidden_size": 4096, "intermediate_size": 3072,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32,
         "vocab_size": 128167, "num_experts": 64, "moe_topk": [8] * 32, "rope_theta": 10000.0,
         "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "type": "dynamic"}}
    cfg = ModelConfig.from_dict(c)
    assert cfg.rms_norm_eps == 1e-5
    folded = ntk_alpha_rope(cfg)
    assert folded.rope_scaling is None and folded.rope_theta == pytest.approx(10000.0 * 1000.0 ** (128 / 126))
