"""Recurrent-state families beyond the attention + Mamba hybrids of test_hybrid.py: pure Mamba2 (Mamba2ForCausalLM, no
attention layer, so no KV cache at all), Falcon-H1 (FalconH1ForCausalLM: attention and Mamba2 side by side in every
layer, µP multipliers) and LFM2 (Lfm2ForCausalLM: gated short convolutions, whose state is a conv window, and GQA
attention with per-head q/k norms; Lfm2MoeForCausalLM: the same with sigmoid-routed experts). Greedy tokens
identical to transformers (fp32) for a batch and a lone request, whole and chunked prefill (the state carried across
chunks), prompt logprobs, preemption and fewer state slots than requests; every block and state slot free
afterwards; and for each family a distinctive part of it shown to matter (changed, transformers' own tokens
change)."""
from __future__ import annotations

import pytest
import torch

from streamer import LLM
from tests.checkpoints import hf_greedy, register_family
from tests.parity import (
    assert_logprobs_match,
    assert_state_freed,
    checkpoint_variant,
    family_checkpoints,
    family_references,
    greedy,
    prompts_of_lengths,
)

MAX_NEW = 8
# A single token (the decode path from a fresh state), fewer than the conv window, within one SSD chunk (8), several
# chunks; with max_num_batched_tokens=16 the longer prompts' prefill spans steps
LENGTHS = (1, 2, 5, 9, 17, 26, 33)
FAMILIES = ("mamba2", "falcon_h1", "lfm2", "lfm2_moe")


# ----------------------------------------------------------------------------------------------- checkpoints
def _mamba2_config(vocab_size: int, **kw):
    """3 Mamba2 blocks of 8 heads x 16 (= 2 x 64), 2 groups of B/C (the gated norm per group), SSD chunks of 8
    (prompts span several), untied head."""
    import transformers as tf
    return tf.Mamba2Config(vocab_size=vocab_size, hidden_size=kw.get("hidden_size", 64), num_heads=8, head_dim=16,
                           state_size=16, n_groups=kw.get("n_groups", 2), chunk_size=8, conv_kernel=4,
                           num_hidden_layers=kw.get("num_hidden_layers_mamba2", 3), initializer_range=0.2,
                           tie_word_embeddings=False, layer_norm_epsilon=1e-5)


def _mamba2_randomise(model) -> None:
    # transformers starts D, the norms at one, dt_bias from a narrow range, A_log at log(1..heads), the conv bias at
    # zero: random ones show that each is loaded and used where it belongs.
    for name, p in model.named_parameters():
        if name.endswith(("mixer.D", "norm.weight", "norm_f.weight")):
            p.normal_(1.0, 0.3)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 1.0)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)
        elif name.endswith("conv1d.bias"):
            p.normal_(0.0, 0.3)


def _falcon_h1_config(vocab_size: int, **kw):
    """2 layers of attention (4 heads, 2 kv heads of 16) beside a Mamba2 mixer 96 wide (6 heads of 16, not 2 x
    hidden: `mamba_d_ssm`), 2 B/C groups, SSD chunks of 8; every µP multiplier away from 1."""
    import transformers as tf
    args = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                mamba_chunk_size=8, mamba_rms_norm=False, projectors_bias=True, initializer_range=0.2,
                embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.6, attention_in_multiplier=1.4,
                attention_out_multiplier=0.8, ssm_in_multiplier=1.3, ssm_out_multiplier=0.9,
                ssm_multipliers=[1.2, 0.8, 1.5, 0.7, 1.6], mlp_multipliers=[1.5, 0.7], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    args.update({k: v for k, v in kw.items() if k.startswith(("mamba_", "projectors_"))})
    return tf.FalconH1Config(**args)


def _falcon_h1_randomise(model) -> None:
    for name, p in model.named_parameters():
        if name.endswith(("mamba.D", "norm.weight", "layernorm.weight")):
            p.normal_(1.0, 0.3)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 1.0)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)
        elif name.endswith(("conv1d.bias", "out_proj.bias")):
            p.normal_(0.0, 0.3)


def _lfm2_config(vocab_size: int, **kw):
    """4 layers: short convs (3 taps) around an attention layer (4 heads, 2 kv heads of 16, per-head q/k norms); the
    MLP 96 -> 2/3 -> 64 wide (`block_auto_adjust_ff_dim`, multiples of 32); tied head."""
    import transformers as tf
    return tf.Lfm2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, block_multiple_of=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, norm_eps=1e-5, conv_L_cache=3,
                         conv_bias=kw.get("conv_bias", False),
                         layer_types=kw.get("layer_types", ["conv", "full_attention", "conv", "conv"]),
                         initializer_range=0.2)


def _lfm2_randomise(model) -> None:
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.3)
        elif name.endswith("conv.bias"):
            p.normal_(0.0, 0.3)
        elif name.endswith("conv.weight"):
            p.normal_(0.0, 0.5)


def _lfm2_moe_config(vocab_size: int, **kw):
    """LFM2's layers (conv, attention, conv, conv); the first MLP dense (96 wide), the others 4 experts of 32, top
    2, by the sigmoid router with an expert bias, scaled by 1.7; tied head."""
    import transformers as tf
    return tf.Lfm2MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1,
                            num_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.7,
                            max_position_embeddings=512, norm_eps=1e-5, conv_L_cache=3,
                            layer_types=["conv", "full_attention", "conv", "conv"], initializer_range=0.2)


def _lfm2_moe_randomise(model) -> None:
    _lfm2_randomise(model)
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):  # (zero at first: a random one changes some tokens' experts)
            b.normal_(0.0, 0.1)


register_family("mamba2", _mamba2_config, _mamba2_randomise)
register_family("falcon_h1", _falcon_h1_config, _falcon_h1_randomise)
register_family("lfm2", _lfm2_config, _lfm2_randomise)
register_family("lfm2_moe", _lfm2_moe_config, _lfm2_moe_randomise)


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=5)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return family_checkpoints(make_ckpt, "recurrent_")


@pytest.fixture(scope="module")
def ref(ckpt, prompts):
    return family_references(ckpt, prompts, MAX_NEW)


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(ckpt, ref, prompts, family):
    llm = LLM(str(ckpt(family)), dtype="float32")
    assert llm.engine.prefix_caching is True  # (from state checkpoints: test_hybrid_prefix_caching.py)
    want = ref(family)
    assert greedy(llm, prompts, MAX_NEW) == want
    assert greedy(llm, prompts[:2], MAX_NEW) == want[:2]  # after the batch, in used slots: they start fresh
    assert_state_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_carries_state(ckpt, ref, prompts, family):
    llm = LLM(str(ckpt(family)), dtype="float32", max_num_batched_tokens=16, block_size=8)
    assert greedy(llm, prompts, MAX_NEW) == ref(family)
    assert_state_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match(ckpt, prompts, family):
    path = ckpt(family)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8)
    assert_logprobs_match(llm, path, [p for p in prompts if len(p) > 8][:3])
    assert_state_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_and_few_state_slots(ckpt, ref, prompts, family):
    want = ref(family)
    # a small block pool (bookkeeping only for Mamba2, which has no KV): preemption, recomputed from scratch
    llm = LLM(str(ckpt(family)), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=12, block_size=4)
    assert greedy(llm, prompts, MAX_NEW) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    assert_state_freed(llm)
    # state slots for two requests at a time: the others wait for a slot, then start from a zeroed one
    if family.startswith("lfm2"):  # (its conv windows are tiny next to a KV block: a budget cannot make slots scarce)
        llm = LLM(str(ckpt(family)), dtype="float32", max_num_seqs=2)
    else:  # the budget holds two slots (the state takes at most half of it; all of it without KV)
        per_slot = llm.engine.runner.model.state_bytes_per_slot(torch.float32)
        share = 1 if family == "mamba2" else 2
        llm = LLM(str(ckpt(family)), dtype="float32", kv_cache_memory=int(2.5 * per_slot * share))
    assert llm.engine.kv.state.num_slots == 2
    assert greedy(llm, prompts, MAX_NEW) == want
    assert_state_freed(llm)


def test_mamba2_has_no_kv_cache(ckpt):
    llm = LLM(str(ckpt("mamba2")), dtype="float32", max_num_seqs=3)
    runner = llm.engine.runner
    assert runner.kv_bytes_per_block() == 0
    assert all(kv.numel() == 0 for kv in runner.kv_caches)
    assert llm.engine.kv.state.num_slots == 3  # max_num_seqs slots bound the batch
    assert llm.engine.kv.num_blocks == 3 * runner.max_blocks_per_req  # (bookkeeping: as many as they can fill)


def test_falcon_h1_norm_variants(ckpt, prompts):
    """The mixer's optional grouped RMSNorm: before the gate (with a bias on out_proj but not in_proj), and after it
    (mamba_norm_before_gate=False, no biases)."""
    for name, kw in (("_norm_before", dict(mamba_rms_norm=True, mamba_norm_before_gate=True)),
                     ("_norm_after", dict(mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=False))):
        path = ckpt("falcon_h1", name, **kw)
        want = hf_greedy(path, prompts, MAX_NEW)
        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8)
        assert greedy(llm, prompts, MAX_NEW) == want, name
        assert_state_freed(llm)


def test_lfm2_layout_and_conv_bias(ckpt, prompts):
    """`full_attn_idxs` instead of layer_types (attention first and last), biases on the short convs."""
    path = ckpt("lfm2", "_bias", conv_bias=True, layer_types=["full_attention", "conv", "conv", "full_attention"])
    want = hf_greedy(path, prompts, MAX_NEW)
    alt = checkpoint_variant(path, path.parent / "recurrent_lfm2_idxs", config={"layer_types": None, "full_attn_idxs": [0, 3]})
    llm = LLM(str(alt), dtype="float32", max_num_batched_tokens=16, block_size=8)
    assert greedy(llm, prompts, MAX_NEW) == want
    assert_state_freed(llm)


# Each family's distinctive parts, changed in a copy of its checkpoint: transformers' tokens change (so matching them
# on the original checks those parts), and the engine follows the copy too.
def _each(suffix: str, change):
    """A change to each tensor whose name ends with `suffix`."""
    return lambda tensors: [change(v) for k, v in tensors.items() if k.endswith(suffix)]


_DISTINCTIVE = {
    "mamba2": [("no_D", None, _each("mixer.D", torch.Tensor.zero_)),
               ("gate_norm_off", None, _each("mixer.norm.weight", lambda v: v.fill_(1.0)))],
    "falcon_h1": [("mup_off", {"ssm_multipliers": [1.0] * 5}, None), ("key_mult_off", {"key_multiplier": 1.0}, None),
                  ("mlp_mult_off", {"mlp_multipliers": [1.0, 1.0]}, None),
                  ("attn_in_off", {"attention_in_multiplier": 1.0}, None)],
    "lfm2": [("qk_norm_off", None, _each("_layernorm.weight", lambda v: v.fill_(1.0))),
             ("conv_tap_off", None, _each("conv.conv.weight", lambda v: v[..., 0].zero_()))],
    "lfm2_moe": [("expert_bias_off", None, _each("expert_bias", torch.Tensor.zero_)),
                 ("scaling_off", {"routed_scaling_factor": 1.0}, None)],
}


@pytest.mark.parametrize("family,change", [(f, c[0]) for f, cs in _DISTINCTIVE.items() for c in cs])
def test_distinctive_part_matters(ckpt, ref, prompts, family, change):
    name, config, weights = next(c for c in _DISTINCTIVE[family] if c[0] == change)
    base = ckpt(family)
    path = checkpoint_variant(base, base.parent / f"{base.name}_{name}", config, weights)
    want = hf_greedy(path, prompts[3:], MAX_NEW)
    assert want != ref(family)[3:], f"{family}: {name} does not change transformers' tokens"
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8)
    assert greedy(llm, prompts[3:], MAX_NEW) == want


def _stack_experts(t: dict) -> None:
    """The Hub's per-expert tensors (`feed_forward.experts.E.w1/w3/w2`) restacked as transformers 5 holds them."""
    layers = sorted({k.split(".experts.")[0] for k in t if ".experts." in k})
    for prefix in layers:
        n = len({k for k in t if k.startswith(prefix + ".experts.") and k.endswith(".w1.weight")})
        w = {p: [t.pop(f"{prefix}.experts.{e}.{p}.weight") for e in range(n)] for p in ("w1", "w3", "w2")}
        t[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"])])
        t[f"{prefix}.experts.down_proj"] = torch.stack(w["w2"])


def test_lfm2_moe_stacked_experts(ckpt, ref, prompts):
    """LFM2-MoE's experts stacked per layer (transformers 5's layout) load as the per-expert ones do."""
    base = ckpt("lfm2_moe")
    path = checkpoint_variant(base, base.parent / f"{base.name}_stacked", weights=_stack_experts)
    llm = LLM(str(path), dtype="float32")
    assert greedy(llm, prompts, MAX_NEW) == ref("lfm2_moe")


def test_mamba2_bf16_runs(ckpt, ref, prompts):
    """In bf16 the residual stream stays fp32 (`residual_in_fp32`), each block's norm reading it in bf16, the head
    the final norm's output in bf16: the dtypes meet without error, and the tokens mostly agree with fp32's (not
    exactly: transformers itself rounds dt's softplus and the decode step's y to bf16, and ties flip)."""
    llm = LLM(str(ckpt("mamba2")), dtype="bfloat16")
    out = greedy(llm, prompts, MAX_NEW)
    assert sum(a[0] == b[0] for a, b in zip(out, ref("mamba2"))) >= len(prompts) - 2
    assert_state_freed(llm)


def test_hub_configs():
    """The Hub's config.json spellings: Mamba-Codestral-7B's (SSM `num_heads` / `head_dim`, no attention, no MLP, no
    length) and LFM2-1.2B's (`block_ff_dim` adjusted to 8192, `norm_eps`, `tie_embedding`, `full_attn_idxs`)."""
    from streamer.models.config import ModelConfig
    from streamer.models.family_configs import mamba2_mixer_config
    from streamer.models.lfm2 import lfm2_layer_kinds
    codestral = dict(architectures=["Mamba2ForCausalLM"], chunk_size=256, conv_kernel=4, expand=2, head_dim=64,
                     hidden_size=4096, layer_norm_epsilon=1e-5, n_groups=8, num_heads=128, num_hidden_layers=64,
                     residual_in_fp32=True, state_size=128, tie_word_embeddings=False,
                     time_step_limit=[0.0, float("inf")], vocab_size=32768)
    cfg = ModelConfig.from_dict(codestral)
    assert (cfg.num_layers, cfg.hidden_size, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (64, 4096, 1e-5, False)
    assert cfg.max_position_embeddings == 262144
    m = mamba2_mixer_config(cfg.raw)
    assert (m["mamba_n_heads"], m["mamba_d_head"], m["mamba_n_groups"], m["mamba_d_state"]) == (128, 64, 8, 128)
    assert ModelConfig.from_dict(cfg.raw).raw == cfg.raw  # (normalising twice changes nothing)
    lfm2 = dict(architectures=["Lfm2ForCausalLM"], block_auto_adjust_ff_dim=True, block_ff_dim=12288,
                block_ffn_dim_multiplier=1.0, block_multiple_of=256, conv_L_cache=3, hidden_size=2048,
                max_position_embeddings=128000, norm_eps=1e-5, num_attention_heads=32, num_hidden_layers=16,
                num_key_value_heads=8, tie_embedding=True, vocab_size=65536, full_attn_idxs=[2, 5, 8, 10, 12, 14])
    cfg = ModelConfig.from_dict(lfm2)
    assert (cfg.intermediate_size, cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.rope_theta) == (8192, 1e-5, True, 1e6)
    assert [i for i, k in enumerate(lfm2_layer_kinds(cfg.raw, 16)) if k == "attention"] == [2, 5, 8, 10, 12, 14]
    assert ModelConfig.from_dict(cfg.raw).intermediate_size == 8192
