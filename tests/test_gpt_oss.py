"""gpt-oss and what it brought: YaRN rope scaling (also Qwen3's long-context configs), attention sinks, biased experts
with a clamped SwiGLU, and MXFP4 checkpoints, all against transformers (fp32). The plain greedy parity over many
prompts is tests/test_engine_hf_parity.py's (the "gpt_oss" family, eager and compiled)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from streamer.models.config import ModelConfig
from streamer.models.layers import build_cos_sin_cache
from streamer.models.quant import FP4_E2M1, dequantize_mxfp4
from tests.checkpoints import hf_greedy

MAX_NEW = 12


def _prompts(n: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(2, max_len))] for _ in range(n)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _assert_logits_match(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    """At every prompt position, the log-probabilities of the 20 most likely tokens and of the prompt's own within
    1e-4 of transformers', and the same 5 most likely tokens."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0].log_softmax(-1)
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            where = f"position {i + 1} of a {len(p)}-token prompt"
            assert max(abs(lp.logprob - want[i, t].item()) for t, lp in entry.items()) < 1e-4, where
            assert {t for t, lp in entry.items() if lp.rank <= 5} == set(want[i].topk(5).indices.tolist()), where


# ------------------------------------------------------------------------------------------------------------ YaRN
@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=64),  # Qwen3's long-context recipe; truncated ramp
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),  # gpt-oss
    dict(factor=8.0, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=128, beta_fast=16),  # DeepSeek
    dict(factor=2.0, attention_factor=1.3, original_max_position_embeddings=100),
], ids=["qwen3", "gpt-oss", "mscale", "attention-factor"])
def test_yarn_table_matches_transformers(params) -> None:
    """cos / sin (attention factor included) of every position, as transformers' rotary embedding computes them."""
    import transformers as tf
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    rope = dict(rope_type="yarn", rope_theta=150000.0, **params)
    hf = tf.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=512,
                        rope_parameters=dict(rope))
    cos, sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), torch.arange(512)[None])
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 64,
                                 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "head_dim": 32, "max_position_embeddings": 512, "rope_parameters": rope})
    table = build_cos_sin_cache(32, 512, cfg.rope_theta, cfg.rope_scaling)
    assert torch.allclose(table, torch.cat([cos[0, :, :16], sin[0, :, :16]], dim=-1), rtol=0, atol=1e-6)


def test_yarn_config_lengths() -> None:
    """As transformers: a top-level original_max_position_embeddings wins over the rope dict's; without `factor`,
    it is the ratio of the lengths; the legacy `type` key names the kind."""
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096}
    cfg = ModelConfig.from_dict({**base, "original_max_position_embeddings": 1024,
                                 "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 2048}})
    assert cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 1024
    derived = build_cos_sin_cache(16, 64, 10000.0, cfg.rope_scaling)
    assert torch.equal(derived, build_cos_sin_cache(16, 64, 10000.0, {**cfg.rope_scaling, "factor": 4.0}))
    default = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert default.rope_scaling["original_max_position_embeddings"] == 4096


def test_qwen3_yarn_matches_transformers(make_ckpt) -> None:
    """A Qwen3 long-context config (YaRN, factor 4 over 32 pretraining positions): logits and greedy tokens."""
    path = make_ckpt("qwen3_yarn", family="qwen3", seed=3, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0})
    prompts = _prompts(6, seed=5, max_len=50)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.runner.model_cfg.rope_scaling["rope_type"] == "yarn"
    assert _greedy(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
    _assert_logits_match(llm, path, prompts[:3])


# --------------------------------------------------------------------------------------------------------- gpt-oss
def test_gpt_oss_logits_match_transformers(make_ckpt) -> None:
    """Every prompt position's logits, with prompts up to 4x the sliding window, prefilled in chunks of 5 over
    blocks of 4 (chunks attend their cached context through the window, with the sinks)."""
    path = make_ckpt("gpt_oss", family="gpt_oss")
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=5, block_size=4)
    _assert_logits_match(llm, path, _prompts(4, seed=2, max_len=32))


def test_gpt_oss_prefix_caching_chunking_preemption(make_ckpt) -> None:
    """Prompts sharing a 14-token prefix (longer than the window): batched, repeated (prefix-cache hits), then with a
    pool so small that requests are preempted and recomputed."""
    path = make_ckpt("gpt_oss", family="gpt_oss")
    prefix = list(range(40, 54))
    prompts = [prefix + tail for tail in ([7], [8, 9, 10], list(range(60, 80)))]
    ref = hf_greedy(path, prompts, MAX_NEW)
    with LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=6) as llm:
        assert _greedy(llm, prompts) == ref
        hits = llm.engine.kv.prefix_hits
        assert [_greedy(llm, [p])[0] for p in reversed(prompts)] == ref[::-1]
        assert llm.engine.kv.prefix_hits > hits
    with LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=8) as llm:
        assert _greedy(llm, prompts + prompts) == ref + ref
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mutation", ["no sinks", "no window", "no clamp", "no expert biases"])
def test_gpt_oss_features_matter(make_ckpt, mutation) -> None:
    """The parity tests can fail: with any one of gpt-oss's differences undone in the loaded model, greedy tokens
    leave transformers'."""
    path = make_ckpt("gpt_oss", family="gpt_oss")
    prompts = _prompts(8, seed=1)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32")
    assert _greedy(llm, prompts) == ref
    for layer in llm.engine.runner.model.layers:
        if mutation == "no sinks":
            layer.self_attn.sinks.fill_(float("-inf"))
        elif mutation == "no window":
            layer.self_attn.attn.spec.sliding_window = None
        elif mutation == "no clamp":
            layer.mlp.limit = 1e9
        else:
            layer.mlp.w13_bias.zero_()
            layer.mlp.w2_bias.zero_()
    assert _greedy(llm, prompts) != ref


# ----------------------------------------------------------------------------------------------------------- MXFP4
def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's expert matrix [E, in, out] (x @ W) -> MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32]
    as the Hub's checkpoints store them: each block of 32 gets the power of two that fits its largest value under 6,
    and each value the nearest FP4 E2M1 code, two codes a byte, the even element in the low nibble."""
    e, cols, rows = w.shape
    blocks = w.transpose(1, 2).float().reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1) / 6.0)).clamp(-127, 127)
    codes = (blocks / torch.exp2(exp)[..., None]).unsqueeze(-1).sub(torch.tensor(FP4_E2M1)).abs().argmin(-1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dirs(make_ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(an MXFP4 checkpoint of a bf16 gpt-oss, that bf16 model with its experts replaced by transformers' own
    dequantization of those MXFP4 tensors: the oracle)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    src = make_ckpt("gpt_oss_bf16", family="gpt_oss", dtype=torch.bfloat16, seed=7)
    root = tmp_path_factory.mktemp("mxfp4")
    quantized, oracle = root / "quantized", root / "oracle"
    state = load_file(str(src / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(t)
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales)
            assert not torch.equal(dequantized[name], t), "rounding to FP4 should change the weights"
            assert (dequantized[name].float() - t.float()).abs().max() < 0.1
        else:
            packed[name] = dequantized[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for folder, tensors, extra in ((quantized, packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                   (oracle, dequantized, {})):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file(tensors, str(folder / "model.safetensors"))
    return quantized, oracle


def test_mxfp4_dequantization_matches_transformers() -> None:
    """Every FP4 code in either nibble, scales across the E8M0 range that bf16 holds: bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(2, 250, (3, 40, 4), dtype=torch.uint8, generator=g)
    assert torch.equal(dequantize_mxfp4(blocks, scales, "w"), convert_moe_packed_tensors(blocks, scales))
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[:, :, :3], "w")


def test_mxfp4_checkpoint_loads_and_matches(mxfp4_dirs) -> None:
    """The loaded experts are transformers' dequantization of the checkpoint's (gate and up de-interleaved into
    w13's rows), and the model generates as transformers does with those weights."""
    quantized, oracle = mxfp4_dirs
    llm = LLM(str(quantized), dtype="float32", cpu_weight_packing=False)  # (the float experts kept, to compare)
    moe = llm.engine.runner.model.layers[1].mlp
    want = load_file(str(oracle / "model.safetensors"))
    gate_up = want["model.layers.1.mlp.experts.gate_up_proj"].float()  # [E, H, 2I], gate/up interleaved
    assert torch.equal(moe.w13, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2))
    assert torch.equal(moe.w2, want["model.layers.1.mlp.experts.down_proj"].float().transpose(1, 2))
    prompts = _prompts(6, seed=9)
    assert _greedy(llm, prompts) == hf_greedy(oracle, prompts, MAX_NEW)


def test_mxfp4_scales_without_blocks(mxfp4_dirs, tmp_path) -> None:
    quantized, _ = mxfp4_dirs
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.0.mlp.experts.down_proj_blocks"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="MXFP4 scales without blocks: model.layers.0.mlp.experts.down_proj"):
        LLM(str(broken), dtype="float32")
