"""Pure Mamba (v1) families: Mamba (MambaForCausalLM: mamba-130m-hf .. 2.8b-hf) and Falcon-Mamba
(FalconMambaForCausalLM: falcon-mamba-7b, weightless RMS norms on B, C and dt), no attention layer and so no KV cache.
Greedy tokens identical to transformers (fp32) for a batch and a lone request, whole and chunked prefill (the conv
window and SSM state carried across chunks, prefill chunks beside decodes), prompt logprobs, preemption and fewer
state slots than requests, the prefill scan split into blocks; every block and state slot free afterwards; the scan
against a plain recurrence; each family's distinctive parts shown to matter (changed, transformers' own tokens
change, and the engine follows); the Hub checkpoints' shapes; refusals."""
from __future__ import annotations

import pytest
import torch

from streamer import LLM
from tests.checkpoints import hf_greedy, register_family
from tests.parity import (
    PREFILL_MODES,
    assert_matches_transformers,
    assert_state_freed,
    checkpoint_variant,
    family_checkpoints,
    family_references,
    greedy,
    prompts_of_lengths,
)

MAX_NEW = 8
# A single token (the decode path from a fresh state: in a whole-prefill batch, a one-token row between prefill chunks,
# which then are not consecutive rows), fewer than the conv window, one more than it, several chunks of 16 (chunked
# prefill) and several of the small scan blocks' tokens (test_scan_blocks_carry_state)
LENGTHS = (9, 5, 1, 2, 17, 26, 33)
FAMILIES = ("mamba1", "falcon_mamba")


# ----------------------------------------------------------------------------------------------- checkpoints
def _mamba1_config(vocab_size: int, **kw):
    """3 blocks; d_inner 128 (expand 2), 16 states a channel, conv of 4 taps with a bias, dt rank "auto" (4);
    tied head (MambaConfig's default)."""
    import transformers as tf
    return tf.MambaConfig(vocab_size=vocab_size, hidden_size=64, state_size=16, num_hidden_layers=3, expand=2,
                          conv_kernel=4, use_bias=kw.get("use_bias", False),
                          use_conv_bias=kw.get("use_conv_bias", True), time_step_rank=kw.get("time_step_rank", "auto"),
                          layer_norm_epsilon=1e-5, initializer_range=0.2)


def _falcon_mamba_config(vocab_size: int, **kw):
    """2 blocks; d_inner 96 from `intermediate_size` although expand says 16 (as falcon-mamba-7b's config.json: the
    intermediate size wins), 8 states, dt rank 6, the B / C / dt norms' eps 1e-3; untied head."""
    import transformers as tf
    return tf.FalconMambaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, expand=16, state_size=8,
                                num_hidden_layers=2, conv_kernel=4, time_step_rank=6, mixer_rms_eps=1e-3,
                                layer_norm_epsilon=1e-5, tie_word_embeddings=False, initializer_range=0.2)


def _randomise(model) -> None:
    # transformers starts D and the norms at one, A_log at log(1..d_state) in every channel, dt_proj's bias at
    # softplus^-1 of small steps, the conv bias at zero: random ones show that each is loaded and used where it
    # belongs (A_log differs per channel and per state)
    for name, p in model.named_parameters():
        if name.endswith(("mixer.D", "norm.weight", "norm_f.weight")):
            p.normal_(1.0, 0.3)
        elif name.endswith("dt_proj.bias"):
            p.normal_(-1.0, 1.0)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)
        elif name.endswith(("conv1d.bias", "in_proj.bias", "out_proj.bias")):
            p.normal_(0.0, 0.3)


register_family("mamba1", _mamba1_config, _randomise)
register_family("falcon_mamba", _falcon_mamba_config, _randomise)


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=11)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return family_checkpoints(make_ckpt, "mamba1_")


@pytest.fixture(scope="module")
def ref(ckpt, prompts):
    return family_references(ckpt, prompts, MAX_NEW)


# ------------------------------------------------------------------------------------------------------ tests
@PREFILL_MODES
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(ckpt, ref, prompts, family, engine_args):
    path = ckpt(family)
    llm = LLM(str(path), dtype="float32", **engine_args)
    assert llm.engine.prefix_caching is True  # (from state checkpoints: test_hybrid_prefix_caching.py)
    assert_matches_transformers(llm, path, prompts, ref(family), MAX_NEW)
    assert_state_freed(llm)


def test_bias_variant_matches_transformers(ckpt, prompts):
    """Biases on in_proj / out_proj (`use_bias`), none on the conv (`use_conv_bias: false`), an explicit dt rank."""
    path = ckpt("mamba1", "_bias", use_bias=True, use_conv_bias=False, time_step_rank=7)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8)
    assert greedy(llm, prompts, MAX_NEW) == hf_greedy(path, prompts, MAX_NEW)
    assert_state_freed(llm)


def test_scan_blocks_carry_state(ckpt, ref, prompts, monkeypatch):
    """The prefill scan over blocks of 5 tokens (the [tokens, d_inner, d_state] budget made tiny): chunks that start,
    end or run on across block boundaries, the state carried from block to block."""
    from streamer.models import mamba1
    monkeypatch.setattr(mamba1, "_SCAN_BLOCK_ELEMS", 5 * 128 * 16)
    llm = LLM(str(ckpt("mamba1")), dtype="float32")
    assert greedy(llm, prompts, MAX_NEW) == ref("mamba1")
    assert_state_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_and_few_state_slots(ckpt, ref, prompts, family):
    want = ref(family)
    # a small block pool (bookkeeping only: there is no KV): preemption, recomputed from scratch
    llm = LLM(str(ckpt(family)), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=12, block_size=4)
    assert greedy(llm, prompts, MAX_NEW) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    assert_state_freed(llm)
    # a budget of two state slots (all of it: no KV): the other requests wait for a slot, then start from a zeroed one
    per_slot = llm.engine.runner.model.state_bytes_per_slot(torch.float32)
    llm = LLM(str(ckpt(family)), dtype="float32", kv_cache_memory=int(2.5 * per_slot))
    assert llm.engine.kv.state.num_slots == 2
    assert greedy(llm, prompts, MAX_NEW) == want
    assert_state_freed(llm)


def test_no_kv_cache(ckpt):
    llm = LLM(str(ckpt("mamba1")), dtype="float32", max_num_seqs=3)
    runner = llm.engine.runner
    assert runner.kv_bytes_per_block() == 0
    assert all(kv.numel() == 0 for kv in runner.kv_caches)
    assert llm.engine.kv.state.num_slots == 3  # max_num_seqs slots bound the batch
    # per layer: the conv window (d_inner x 3 taps) and the fp32 SSM state (d_inner x d_state)
    assert runner.model.state_bytes_per_slot(torch.float32) == 3 * (128 * 3 * 4 + 128 * 16 * 4)


def test_bf16_runs(ckpt, ref, prompts):
    """bf16 weights, the residual stream fp32 (`residual_in_fp32`) and the SSM state fp32: the dtypes meet without
    error and the first tokens mostly agree with fp32's (not exactly: transformers itself rounds dt and the state's
    read-out to bf16)."""
    llm = LLM(str(ckpt("mamba1")), dtype="bfloat16", max_num_batched_tokens=16)
    out = greedy(llm, prompts, MAX_NEW)
    assert sum(a[0] == b[0] for a, b in zip(out, ref("mamba1"))) >= len(prompts) - 2
    assert_state_freed(llm)


# Each family's distinctive parts, changed in a copy of its checkpoint: transformers' tokens change (so matching them
# on the original checks those parts), and the engine follows the copy too.
def _each(suffix: str, change):
    """A change to each tensor whose name ends with `suffix`."""
    return lambda tensors: [change(v) for k, v in tensors.items() if k.endswith(suffix)]


_DISTINCTIVE = {
    "mamba1": [("no_D", None, _each("mixer.D", torch.Tensor.zero_)),
               ("dt_bias_off", None, _each("dt_proj.bias", torch.Tensor.zero_)),
               # one decay per state, the same in every channel: shows A is read per channel
               ("A_per_state", None, _each("A_log", lambda v: v.copy_(v.mean(0, keepdim=True).expand_as(v)))),
               ("conv_tap_off", None, _each("conv1d.weight", lambda v: v[..., 0].zero_()))],
    # read as plain Mamba (no B / C / dt norms), and with another eps for them
    "falcon_mamba": [("as_mamba", {"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, None),
                     ("norm_eps", {"mixer_rms_eps": 0.3}, None)],
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


def _naive_scan(dA: torch.Tensor, dBx: torch.Tensor) -> torch.Tensor:
    h, out = torch.zeros_like(dBx[0]), []
    for t in range(dA.shape[0]):
        h = dA[t] * h + dBx[t]
        out.append(h)
    return torch.stack(out)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 9, 16, 17, 50])
def test_selective_scan_matches_recurrence(length):
    """Any length (a square number of tokens or not, padded or not); zero decays (where a chunk starts) cut it."""
    from streamer.models.mamba1 import selective_scan
    g = torch.Generator().manual_seed(length)
    dA = torch.rand(length, 6, 4, generator=g, dtype=torch.float64)
    dA[torch.rand(length, generator=g) < 0.2] = 0
    dBx = torch.randn(length, 6, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(selective_scan(dA.clone(), dBx.clone()), _naive_scan(dA, dBx))


def test_refuses_other_activations(ckpt):
    """The conv's activation is `hidden_act`: only SiLU is computed."""
    base = ckpt("mamba1")
    path = checkpoint_variant(base, base.parent / f"{base.name}_gelu", {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LLM(str(path), dtype="float32")


# The Hub's config.json files (as shipped, keys the loader does not read left out) and their checkpoints' tensor shapes
_MAMBA_130M = dict(architectures=["MambaForCausalLM"], model_type="mamba", bos_token_id=0, conv_kernel=4,
                   d_inner=1536, d_model=768, eos_token_id=0, expand=2, fused_add_norm=True, hidden_act="silu",
                   hidden_size=768, intermediate_size=1536, layer_norm_epsilon=1e-5, n_layer=24, num_hidden_layers=24,
                   pad_token_id=0, pad_vocab_size_multiple=8, residual_in_fp32=True, rms_norm=True, ssm_cfg={},
                   state_size=16, time_step_rank=48, torch_dtype="float32", use_bias=False, use_cache=True,
                   use_conv_bias=True, vocab_size=50280)
_FALCON_MAMBA_7B = dict(architectures=["FalconMambaForCausalLM"], model_type="falcon_mamba", bos_token_id=0,
                        conv_kernel=4, eos_token_id=11, expand=16, hidden_act="silu", hidden_size=4096,
                        intermediate_size=8192, layer_norm_epsilon=1e-5, num_hidden_layers=64, pad_token_id=11,
                        residual_in_fp32=True, state_size=16, tie_word_embeddings=False, time_step_rank=256,
                        torch_dtype="bfloat16", use_bias=False, use_cache=True, use_conv_bias=True, vocab_size=65024)


@pytest.mark.parametrize("config,layers,inner,rank,tied", [
    (_MAMBA_130M, 24, 1536, 48, True),
    (dict(_MAMBA_130M, hidden_size=2560, d_model=2560, intermediate_size=5120, d_inner=5120, num_hidden_layers=64,
          n_layer=64, time_step_rank=160), 64, 5120, 160, True),  # mamba-2.8b-hf
    (_FALCON_MAMBA_7B, 64, 8192, 256, False),  # (expand says 16: intermediate_size wins)
    (dict(_MAMBA_130M, intermediate_size=None, time_step_rank="auto"), 24, 1536, 48, True),  # expand x hidden
], ids=["mamba-130m", "mamba-2.8b", "falcon-mamba-7b", "auto"])
def test_hub_configs(config, layers, inner, rank, tied):
    from streamer.models.config import ModelConfig
    from streamer.models.mamba1 import MambaForCausalLM
    cfg = ModelConfig.from_dict(config)
    assert (cfg.num_layers, cfg.tie_word_embeddings, cfg.rms_norm_eps) == (layers, tied, 1e-5)
    assert cfg.max_position_embeddings == 262144  # (no length limit of its own)
    assert ModelConfig.from_dict(cfg.raw).raw == cfg.raw  # (normalising twice changes nothing)
    with torch.device("meta"):
        model = MambaForCausalLM(cfg, None, 16)  # type: ignore[arg-type]
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.0.")}
    assert shapes == {
        "layers.0.norm.weight": (hidden,), "layers.0.mixer.in_proj.weight": (2 * inner, hidden),
        "layers.0.mixer.conv1d.weight": (inner, 1, 4), "layers.0.mixer.conv1d.bias": (inner,),
        "layers.0.mixer.x_proj.weight": (rank + 32, inner), "layers.0.mixer.dt_proj.weight": (inner, rank),
        "layers.0.mixer.dt_proj.bias": (inner,), "layers.0.mixer.A_log": (inner, 16), "layers.0.mixer.D": (inner,),
        "layers.0.mixer.out_proj.weight": (hidden, inner)}
    assert tuple(model.embed_tokens.weight.shape) == (vocab, hidden) and (model.lm_head is None) == tied
    # per slot, bf16: each layer's conv window (3 taps) and fp32 SSM state
    assert model.state_bytes_per_slot(torch.bfloat16) == layers * (inner * 3 * 2 + inner * 16 * 4)
