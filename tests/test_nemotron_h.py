"""NVIDIA Nemotron-H (NemotronHForCausalLM): single-block layers by `hybrid_override_pattern` (Mamba2 "M", NoPE
attention "*", relu2 MLP "-", MoE "E"); greedy tokens identical to transformers (fp32) whatever the batching
(chunked prefill carrying the Mamba state across chunks, preemption), and every state slot back in its pool."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamer import LLM
from streamer.models.config import ModelConfig
from streamer.models.family_configs import nemotron_h_layer_kinds
from tests.checkpoints import hf_greedy
from tests.parity import assert_state_freed, greedy, prompts_of_lengths
from tests.tokenizer_factory import make_bytelevel_tokenizer

MAX_NEW = 10
# A single token (the decode path from a fresh state), fewer than conv_kernel - 1, within one SSD chunk (8), several
LENGTHS = (1, 2, 6, 9, 17, 26, 33)


def make_nemotron_h(out_dir: Path, **overrides) -> Path:
    """A tiny random NemotronH checkpoint as transformers' save_pretrained writes it (backbone.* names). The Mamba
    width (8 heads x 12) is not expand x hidden_size; 2 B/C groups (the gated norm per group); SSD chunks of 8."""
    import transformers as tf
    out_dir.mkdir(parents=True, exist_ok=True)
    make_bytelevel_tokenizer(out_dir)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(1 for t in tok["added_tokens"] if t["id"] >= len(tok["model"]["vocab"]))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    special = {k: (v if isinstance(v, str) else (v or {}).get("content")) for k, v in tok_cfg.items()
               if k in ("bos_token", "eos_token")}
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, hybrid_override_pattern="M*-ME-M", mamba_num_heads=8, mamba_head_dim=12,
              ssm_state_size=16, n_groups=2, chunk_size=8, conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, initializer_range=0.2, tie_word_embeddings=False,
              # (transformers clamps prefill's dt at time_step_min, decode's not at all; the reference code, and
              # streamer, at time_step_limit: a tiny minimum keeps them the same model)
              time_step_min=1e-6, bos_token_id=ids.get(special.get("bos_token")),
              eos_token_id=ids.get(special.get("eos_token")))
    kw.update(overrides)
    cfg = tf.NemotronHConfig(**kw)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    # transformers starts the norms, D and dt_bias near fixed values and the router's correction bias at zero:
    # random ones show that each is loaded and used where it belongs.
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "norm_f.weight", "mixer.D")):
                p.normal_(1.0, 0.3)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=3)


@pytest.fixture(scope="module")
def ckpt(ckpt_root) -> Path:
    path = ckpt_root / "nemotron_h"
    return path if (path / "config.json").exists() else make_nemotron_h(path)


@pytest.fixture(scope="module")
def ref(ckpt, prompts) -> list[list[int]]:
    return hf_greedy(ckpt, prompts, MAX_NEW)


def _check_reference(ref: list[list[int]]) -> None:
    assert len({tuple(r) for r in ref}) > 4, "degenerate reference: the test would not discriminate"
    assert sum(len(set(r)) for r in ref) > 2 * len(ref), "degenerate reference: continuations repeat one token"


def test_matches_transformers(ckpt, ref, prompts):
    llm = LLM(str(ckpt), dtype="float32")
    assert llm.engine.prefix_caching is True  # (from state checkpoints: test_hybrid_prefix_caching.py)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert greedy(llm, prompts[:1], MAX_NEW) == ref[:1]  # alone, after the batch: its slot starts fresh
    _check_reference(ref)
    assert_state_freed(llm)


def test_latent_moe_attention_first(ckpt_root, prompts):
    """Attention first, MoE experts inside a latent projection, ungrouped routing, biases in the MLPs and the
    Mamba projections; chunked prefill."""
    path = make_nemotron_h(ckpt_root / "nemotron_h_latent", hybrid_override_pattern="*ME-M", moe_latent_size=32,
                           n_group=1, topk_group=1, n_groups=1, mlp_bias=True, use_bias=True)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=7)
    assert greedy(llm, prompts, MAX_NEW) == ref
    _check_reference(ref)
    assert_state_freed(llm)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=5),  # prompts over many chunks (state carried), mixed with decodes
    dict(max_num_batched_tokens=7, num_kv_blocks=8, block_size=8),  # chunking + preemption
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_chunked_prefill_and_preemption(ckpt, ref, prompts, engine_args):
    llm = LLM(str(ckpt), dtype="float32", **engine_args)
    assert greedy(llm, prompts, MAX_NEW) == ref
    assert_state_freed(llm)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"


def test_config_from_pattern():
    """NVIDIA's own configs: hybrid_override_pattern, num_hidden_layers, attention_head_dim."""
    raw = dict(architectures=["NemotronHForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
               num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=32,
               hybrid_override_pattern="M-M*E", layer_norm_epsilon=1e-4)
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_layers, cfg.head_dim, cfg.rms_norm_eps) == (5, 32, 1e-4)
    assert nemotron_h_layer_kinds(cfg.raw) == ["mamba", "mlp", "mamba", "attention", "moe"]
    with pytest.raises(ValueError, match="unsupported NemotronH layer"):
        ModelConfig.from_dict(dict(raw, hybrid_override_pattern="M?"))
