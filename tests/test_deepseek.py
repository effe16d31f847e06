"""DeepSeek-V2 / V3 (streamer/models/deepseek.py) against transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
(fp32, tiny random checkpoints: tests/checkpoints.py's "deepseek_v2" / "deepseek_v3" families): greedy tokens and
prompt logprobs with chunked prefill, over two ranks, compiled, 4-bit, with the latent KV cache (the default) and
the per-head MHA one; the cache's bytes per token at V3's and V2-Lite's real sizes; the rotary layout and the
softmax scale against transformers' own functions; and, so that those tests can fail, each of DeepSeek's
differences undone in the loaded model changes the tokens."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from streamer import LLM  # noqa: E402
from streamer.models.config import ModelConfig  # noqa: E402
from streamer.models.deepseek import DeepseekMoE, MLAttention, Routing, deinterleave, softmax_scale  # noqa: E402
from streamer.models.layers import RotaryEmbedding  # noqa: E402
from streamer.models.woq import int4_supported, kernel_group, quantize_rtn  # noqa: E402
from tests.checkpoints import hf_greedy  # noqa: E402
from tests.parity import assert_logprobs_match, greedy, random_prompts, reference_cache  # noqa: E402

MAX_NEW = 12
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}
# name -> make_ckpt arguments
CASES: dict[str, dict[str, Any]] = {
    "v2": dict(family="deepseek_v2"),  # q_proj (no q LoRA), softmax top-2 of 8
    # 2 groups of 4 experts, both experts from the best group: half the tokens would pick another pair without it
    "v2_grouped": dict(family="deepseek_v2", topk_method="group_limited_greedy", n_group=2, topk_group=1),
    "v3": dict(family="deepseek_v3"),  # q LoRA, sigmoid + correction bias, best 2 of 4 groups, interleaved rope
    # YaRN over 32 pretraining positions (prompts run past it); mscale != mscale_all_dim: both the rotary table's
    # attention factor and the softmax scale's mscale ** 2 differ from 1
    "v3_yarn": dict(family="deepseek_v3", seed=1, rope_parameters=YARN),
}


PROMPTS = random_prompts(10, seed=11)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Callable[[str], Path]:
    return lambda name: make_ckpt(f"deepseek_{name}", **CASES[name])


@pytest.fixture(scope="module")
def refs(ckpt) -> Callable[[str], list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per case (computed once)."""
    return reference_cache(ckpt, PROMPTS, MAX_NEW)


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name,latent", [(name, True) for name in CASES] + [("v3", False)])
def test_matches_transformers(ckpt, refs, name, latent) -> None:
    """Greedy tokens and prompt logprobs, prompts prefilled in chunks of at most 16 tokens over blocks of 8 (chunks
    attend their cached context) beside other requests' decodes: with the latent cache (the default), and once with
    the per-head MHA cache (`mla_latent_cache=False`), so that both forms are shown to agree with transformers."""
    path = ckpt(name)
    ref = refs(name)
    assert len({tuple(r) for r in ref}) == len(ref) and sum(len(set(r)) for r in ref) > 6 * len(ref), \
        "degenerate reference: the test would not discriminate"
    with LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8, mla_latent_cache=latent) as llm:
        assert greedy(llm, PROMPTS, MAX_NEW) == ref
        assert_logprobs_match(llm, path, PROMPTS[:3])
        runner = llm.engine.runner
        attn = runner.model.layers[0].self_attn
        if latent:
            # One kv head per token and layer: K = [normed latent (16), rope(k_pe) (8)], V the same (a copy)
            assert runner.kv_caches[0].shape[2:] == (8, 1, 16 + 8)
            assert runner.kv_bytes_per_block() == 3 * 8 * (2 * 1 * 24) * 4
            assert attn.kv_b_proj.weight.numel() == 0 and attn.w_uk.shape == (4, 16, 16) and attn.w_uv.shape == (4, 16, 12)
        else:
            # Every head's K (16 + 8) and V (12, padded to 24): 2 * 4 * 24 values a token, 4x the latent cache's
            assert runner.kv_caches[0].shape[2:] == (8, 4, 24)
            assert runner.kv_bytes_per_block() == 3 * 8 * (2 * 4 * 24) * 4
            assert attn.w_uk is None and (attn.kv_b_proj.weight.numel() or attn.kv_b_proj.packed is not None)


def test_cli_flag_turns_the_latent_cache_off() -> None:
    from streamer.cli import build_parser, engine_kwargs
    for argv, latent in ((["serve", "m"], True), (["serve", "m", "--no-mla-latent-cache"], False),
                         (["generate", "--prompt", "x", "--no-mla-latent-cache"], False)):
        assert engine_kwargs(build_parser().parse_args(argv))["mla_latent_cache"] is latent


@pytest.mark.parametrize("name,mutation", [
    ("v3", "no correction bias"),
    ("v3", "bias weights too"),
    ("v3", "no group limit"),
    ("v3", "no norm_topk_prob"),
    ("v3", "no scaling factor"),
    ("v3", "no shared experts"),
    ("v3", "rope not interleaved"),
    ("v2", "no scaling factor"),
    ("v2", "no shared experts"),
    ("v2_grouped", "no group limit"),
    ("v3_yarn", "no mscale"),
])
def test_features_matter(ckpt, refs, name, mutation, monkeypatch) -> None:
    """The parity test can fail: with one of DeepSeek's differences undone in the loaded model, greedy tokens leave
    transformers'."""
    with LLM(str(ckpt(name)), dtype="float32") as llm:
        model = llm.engine.runner.model
        moes = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
        attns = [m for m in model.modules() if isinstance(m, MLAttention)]
        assert len(moes) == 2 and len(attns) == 3  # (layer 0 is dense)
        for m in moes:
            r = m.routing
            if mutation == "no correction bias":
                m.gate.e_score_correction_bias.zero_()
            elif mutation == "no group limit":
                m.routing = dataclasses.replace(r, n_group=1, topk_group=1)
            elif mutation == "no norm_topk_prob":
                m.routing = dataclasses.replace(r, norm_topk_prob=False)
            elif mutation == "no scaling factor":
                m.routing = dataclasses.replace(r, scaling=1.0)
            elif mutation == "no shared experts":
                m.shared_experts = None
        if mutation == "bias weights too":  # the chosen experts weighted by their biased scores
            route = DeepseekMoE.route

            def biased(self: DeepseekMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                _, ids = route(self, x)
                scores = F.linear(x.float(), self.gate.weight).sigmoid() + self.gate.e_score_correction_bias
                weights = scores.gather(1, ids)
                return weights / weights.sum(-1, keepdim=True) * self.routing.scaling, ids
            monkeypatch.setattr(DeepseekMoE, "route", biased)
        for a in attns:
            if mutation == "rope not interleaved":
                a.interleaved = False
            elif mutation == "no mscale":
                a.attn.spec.scale = a.qk_dim ** -0.5
        assert greedy(llm, PROMPTS, MAX_NEW) != refs(name)


def test_tp2_matches_transformers(ckpt, refs) -> None:
    """Heads split over two ranks (q_b_proj / q_proj and kv_b_proj by rows, so each rank's absorbed W_UK / W_UV are
    its heads', o_proj by columns), the latent projections and the latent cache replicated, every expert and the
    shared and dense MLPs split along their intermediate size."""
    for name in ("v3", "v2"):
        # (eager: the CPU decode kernel's compiled form is the parity tests', and compiling it on each rank is slow)
        with LLM(str(ckpt(name)), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16,
                 enforce_eager=True) as llm:
            model = llm.engine.runner.model
            attn, moe = model.layers[1].self_attn, model.layers[1].mlp
            # (the linears' plain weights are gone, prepacked for oneDNN: their sizes remain)
            # each rank absorbs its heads' halves of kv_b_proj; the latent cache is whole on every rank
            assert attn.num_heads == 2 and attn.kv_b_proj.weight.numel() == 0
            assert attn.w_uk.shape == (2, 16, 16) and attn.w_uv.shape == (2, 16, 12)
            assert llm.engine.runner.kv_caches[0].shape[2:] == (16, 1, 16 + 8)
            assert attn.o_proj.input_size == 2 * 12
            assert attn.kv_a_proj_with_mqa.out_features == 16 + 8  # whole on every rank
            q_out = attn.q_b_proj.out_features if name == "v3" else attn.q_proj.out_features
            assert q_out == 2 * (16 + 8)
            if name == "v3":
                assert attn.q_a_proj.out_features == 24
            assert moe.expert_shapes == ((8, 2 * 8, 64), (8, 64, 8)) and moe.cpu_packed is not None
            assert moe.shared_experts.down_proj.input_size == (1 if name == "v3" else 2) * 16 // 2
            assert greedy(llm, PROMPTS, MAX_NEW) == refs(name), name
            assert_logprobs_match(llm, ckpt(name), PROMPTS[:2])


def test_compiled_matches_transformers(ckpt, refs) -> None:
    """The whole model compiled (routing traced into the graph, the experts and attention opaque ops; a lone
    request's decode attends inside the graph)."""
    with LLM(str(ckpt("v3")), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert greedy(llm, PROMPTS, MAX_NEW) == refs("v3")
        assert greedy(llm, PROMPTS[:1], MAX_NEW) == refs("v3")[:1]
        assert_logprobs_match(llm, ckpt("v3"), PROMPTS[:2])


# -------------------------------------------------------------------------------------------- loading
def test_multi_token_prediction_layers_are_skipped(ckpt, refs, tmp_path) -> None:
    """V3 checkpoints also store the MTP layer (model.layers.<num_hidden_layers>.*): it loads without them."""
    path = tmp_path / "with_mtp"
    shutil.copytree(ckpt("v3"), path)
    state = load_file(str(path / "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in state.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(mtp, str(path / "model-mtp.safetensors"))
    with LLM(str(path), dtype="float32") as llm:
        assert len(llm.engine.runner.model.layers) == 3
        assert greedy(llm, PROMPTS[:3], MAX_NEW) == refs("v3")[:3]


def _round_like_int4(src: Path, out: Path) -> Path:
    """`src` with every weight that quantization="int4" rounds (the linears and sparse MLPs the int4 kernels take,
    but kv_b_proj, kept in float for MLA's absorption) replaced by its rounded value, in fp32: what transformers must compute to agree with the engine."""
    shutil.copytree(src, out)
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    inter, hidden = cfg["moe_intermediate_size"], cfg["hidden_size"]
    cpu = torch.device("cpu")

    def takes(rows: int, cols: int) -> bool:
        g = kernel_group(cols, 128)
        return g is not None and int4_supported(rows, cols, g, torch.float32, cpu)
    experts_round = takes(2 * inter, hidden) and takes(hidden, inter)
    for name, w in state.items():
        if not name.endswith("_proj.weight") or name.endswith("kv_b_proj.weight"):
            continue  # (kv_b_proj stays float: MLA absorbs it)
        if ".experts." in name:  # (a sparse MLP's experts go 4-bit all together or not at all)
            ok = experts_round
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):  # halves of a packed gate_up_proj
            ok = takes(2 * w.shape[0], w.shape[1])
        else:
            ok = takes(*w.shape)
        if ok:  # (row by row, so an expert's gate and up round as the rows of its stacked matrix do)
            state[name] = quantize_rtn(w, kernel_group(w.shape[1], 128)).dequantize(torch.float32)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_int4_experts_match_transformers_on_the_rounded_weights(make_ckpt, tmp_path) -> None:
    """quantization="int4": the sparse MLPs' experts (moe_experts_int4, routed by DeepSeek's router), shared experts
    and dense MLPs compute with 4-bit weights; kv_b_proj (kv_lora_rank 32: a shape the int4 kernels take) stays in
    float, absorbed by the latent form and used as is by the MHA form; transformers running the same rounded weights
    agrees with both."""
    src = make_ckpt("deepseek_v3_i32_r32", family="deepseek_v3", moe_intermediate_size=32, kv_lora_rank=32)
    want = hf_greedy(_round_like_int4(src, tmp_path / "rounded"), PROMPTS[:4], MAX_NEW)
    assert want != hf_greedy(src, PROMPTS[:4], MAX_NEW), "rounding must change something to prove much"
    for latent in (True, False):
        with LLM(str(src), dtype="float32", quantization="int4", mla_latent_cache=latent) as llm:
            model = llm.engine.runner.model
            moes = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
            assert moes and all(m.int4 is not None for m in moes)
            assert all(m.shared_experts.gate_up_proj.qweight is not None for m in moes)
            assert model.layers[0].mlp.down_proj.qweight is not None  # (the dense layer's)
            attn = model.layers[0].self_attn
            if latent:
                assert attn.kv_b_proj.weight.numel() == 0 and attn.w_uk.dtype == torch.float32
            else:
                assert attn.kv_b_proj.qweight is None and not attn.kv_b_proj.prepare_int4(32)
            assert greedy(llm, PROMPTS[:4], MAX_NEW) == want, latent


# --------------------------------------------------------------------------------------------- config and maths
def _v3_config(**over: Any) -> dict[str, Any]:
    """DeepSeek-V3's config.json (its real sizes), in the transformers-4 spelling it ships with."""
    c = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
         "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
         "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
         "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
         "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
         "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
         "rope_theta": 10000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "type": "yarn"}}
    c.update(over)
    return c


def test_config_spellings_and_softmax_scale() -> None:
    """V3's shipped config (transformers-4 `rope_scaling`) and the same in transformers-5 `rope_parameters` read
    alike: the latent cache's one kv head of 576 = 512 + 64 (the MHA cache's: 192 = 128 + 64, V 128 padded, 128 K/V
    heads), 64 rotating dims, YaRN; the softmax
    scale is transformers' (192 ** -0.5 times mscale(40, 1) ** 2)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    legacy = ModelConfig.from_dict(_v3_config())
    v5_dict = _v3_config(rope_parameters=dict(_v3_config()["rope_scaling"], rope_type="yarn", rope_theta=10000.0))
    for key in ("rope_scaling", "rope_theta"):
        del v5_dict[key]
    del v5_dict["rope_parameters"]["type"]
    v5 = ModelConfig.from_dict(v5_dict)
    for cfg in (legacy, v5):
        # the latent cache: one kv head of kv_lora_rank + qk_rope_head_dim; the MHA cache's: 128 heads of 192
        assert (cfg.head_dim, cfg.num_kv_heads, cfg.rotary_dim) == (512 + 64, 1, 64)
        mha = cfg.with_mla_cache(False)
        assert (mha.head_dim, mha.num_kv_heads, mha.rotary_dim) == (192, 128, 64)
        assert mha.with_mla_cache(True) == cfg
        assert cfg.mla is not None and (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank) == (1536, 512)
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
        assert cfg.rope_scaling["factor"] == 40 and cfg.rope_scaling["mscale_all_dim"] == 1.0
        want = yarn_apply_mscale({"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}, 192 ** -0.5)
        assert softmax_scale(cfg) == pytest.approx(want, rel=1e-12)
        assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    plain = ModelConfig.from_dict({k: v for k, v in _v3_config().items() if k != "rope_scaling"})
    assert softmax_scale(plain) == 192 ** -0.5
    # V2-Lite: no q LoRA; V and the nope part both 128
    lite = ModelConfig.from_dict(_v3_config(architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None,
                                            num_attention_heads=16, topk_method="greedy", scoring_func="softmax"))
    assert lite.mla is not None and lite.mla.q_lora_rank is None and lite.head_dim == 576
    assert lite.with_mla_cache(False).head_dim == 192


@pytest.mark.parametrize("name,over,mha_bytes,latent_bytes", [
    # (MHA: 2 * 128 heads * 192 * 2 bytes * 61 layers; latent: 2 * (512 + 64) * 2 * 61: 42.7x fewer)
    ("V3", {}, 5_996_544, 140_544),
    # (MHA: 2 * 16 * 192 * 2 * 27; latent: 2 * 576 * 2 * 27: 5.3x fewer)
    ("V2-Lite", dict(architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None, num_attention_heads=16,
                     num_key_value_heads=16, num_hidden_layers=27, hidden_size=2048, intermediate_size=10944,
                     moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                     first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1, vocab_size=102400, rope_scaling=None),
     331_776, 62_208),
])
def test_cache_bytes_per_token_at_real_sizes(name, over, mha_bytes, latent_bytes) -> None:
    """The runner's KV cache bytes per token (all layers, bf16) for the real models, built on the meta device: the
    latent cache (one kv head of 576, stored as K and V) against every head's K and V."""
    from streamer.attention.torch_backend import TorchAttentionBackend
    from streamer.models.deepseek import DeepseekForCausalLM
    from streamer.worker.model_runner import ModelRunner
    cfg = ModelConfig.from_dict(_v3_config(**over))
    got = {}
    for latent in (True, False):
        c = cfg.with_mla_cache(latent)
        with torch.device("meta"):
            model = DeepseekForCausalLM(c, TorchAttentionBackend, 4096)
        attn = model.layers[0].self_attn
        assert (attn.num_kv_heads, attn.head_dim) == (c.num_kv_heads, c.head_dim)
        runner = SimpleNamespace(model=model, model_cfg=c, block_size=1, kv_dtype=torch.bfloat16)
        got[latent] = ModelRunner.kv_bytes_per_block(runner)  # type: ignore[arg-type]
    assert (got[False], got[True]) == (mha_bytes, latent_bytes), name


def test_routing_layers() -> None:
    """first_k_dense_replace dense layers, then every moe_layer_freq-th layer sparse (DeepSeek's rule)."""
    r = Routing.from_config(ModelConfig.from_dict(_v3_config(first_k_dense_replace=1, moe_layer_freq=2)))
    assert [r.sparse(i) for i in range(6)] == [False, False, True, False, True, False]
    r = Routing.from_config(ModelConfig.from_dict(_v3_config()))
    assert [r.sparse(i) for i in range(5)] == [False, False, False, True, True]
    assert (r.sigmoid, r.n_group, r.topk_group, r.top_k, r.scaling) == (True, 8, 4, 8, 2.5)


@pytest.mark.parametrize("over,field", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc", scoring_func="softmax"), "topk_method"),
    (dict(architectures=["DeepseekV2ForCausalLM"], topk_method="greedy", scoring_func="softmax"), "norm_topk_prob"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(n_group=3), "n_group"),
    (dict(num_experts_per_tok=40, topk_group=1), "num_experts_per_tok"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (dict(kv_lora_rank=None), "kv_lora_rank"),
])
def test_unsupported_configs_are_refused(over, field) -> None:
    with pytest.raises(ValueError, match=field):
        Routing.from_config(ModelConfig.from_dict(_v3_config(**over)))


def test_unsupported_checkpoint_is_refused_by_the_engine(ckpt, tmp_path) -> None:
    path = tmp_path / "bad"
    shutil.copytree(ckpt("v3"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, scoring_func="softmax")))
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        LLM(str(path), dtype="float32")


def test_rotary_matches_transformers() -> None:
    """De-interleaved and rotated by our half-split rotary (YaRN table included), q_pe / k_pe equal transformers'
    V3 interleaved rotary exactly, and V2's complex one with each (real, imaginary) pair stored apart."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )
    dims = dict(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8, max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 70, 8, generator=g), torch.randn(1, 1, 70, 8, generator=g)
    positions = torch.arange(70)
    for rope in ({"rope_type": "default", "rope_theta": 10000.0}, YARN):
        ours = RotaryEmbedding(8, 256, rope["rope_theta"], None if rope["rope_type"] == "default" else dict(
            rope, max_position_embeddings=256))
        got_q, got_k = ours(positions, deinterleave(q[0].transpose(0, 1)), deinterleave(k[0].transpose(0, 1)))
        got_q, got_k = got_q.transpose(0, 1)[None], got_k.transpose(0, 1)[None]
        v3 = DeepseekV3Config(**dims, rope_parameters=dict(rope))
        cos, sin = DeepseekV3RotaryEmbedding(v3)(q, positions[None])
        want_q, want_k = apply_rotary_pos_emb_interleave(q, k, cos, sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        v2 = DeepseekV2Config(**dims, rope_parameters=dict(rope))
        want_q, want_k = apply_rotary_emb(q, k, DeepseekV2RotaryEmbedding(v2)(q, positions[None]))
        torch.testing.assert_close(got_q, deinterleave(want_q), rtol=0, atol=1e-6)
        torch.testing.assert_close(got_k, deinterleave(want_k), rtol=0, atol=1e-6)
        assert not torch.allclose(got_q, deinterleave(q))  # (it did rotate)
